"""A self-pipe that wakes a thread polling ZeroMQ sockets from any other thread.

Both ends of a connection (the client's I/O thread and damacyd's loop) poll their socket
and this pipe's read end; ``wake()`` makes the poll return so queued messages go out now.
"""

from __future__ import annotations

import os


class Waker:
    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._pending = False  # a wake-up is written and not yet drained: another adds nothing

    @property
    def fd(self) -> int:
        """The end to register with a poller (-1 once closed)."""
        return self._r

    def wake(self) -> None:
        """Make the poll return (from any thread; a no-op once closed)."""
        fd = self._w
        if fd < 0 or self._pending:  # closed (the number may belong to another file by now), or woken already
            return
        self._pending = True
        try:
            os.write(fd, b"x")
        except (BlockingIOError, OSError):
            pass  # already being woken, or closing

    def drain(self) -> None:
        """Take back every wake-up (after the poll said the read end is readable), then let
        the next wake write again. A wake between the two writes nothing: what it announces
        was queued before it, and the owner handles the queues after draining."""
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        self._pending = False

    def close(self) -> None:
        fds = (self._r, self._w)
        self._r = self._w = -1
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
