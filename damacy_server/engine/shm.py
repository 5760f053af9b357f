"""POSIX shared-memory segments for batch slots (files under /dev/shm).

Segment names carry the daemon's pid: ``damacy-<pid>-<session>-<slot>``. The daemon unlinks
a segment's name as soon as its client has mapped it (the memory lives on while mapped), at
session end at the latest, and a starting daemon removes the segments of dead predecessors,
so no segment outlives its daemon.
"""

from __future__ import annotations

import mmap
import os
import re

import numpy as np

from damacy_protocol.errors import DamacyError
from damacy_server.procs import pid_alive

SHM_DIR = "/dev/shm"
PREFIX = "damacy-"
_NAME = re.compile(r"^damacy-(\d+)-[0-9a-f]+-\d+$")


class Segment:
    """A segment this process created and maps.

    ``mode`` (read/write bits only) and ``gid`` follow the daemon's socket: whoever may
    connect may map the slots it is given (names are unguessable and unlinked once mapped).
    """

    def __init__(self, name: str, nbytes: int, mode: int = 0o600, gid: int | None = None) -> None:
        self.name = name
        self.nbytes = nbytes
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            if gid is not None:
                os.fchown(fd, -1, gid)
            os.fchmod(fd, mode & 0o666)  # not narrowed by the umask
            try:  # claim the pages now: a full /dev/shm is an error here, not a SIGBUS later
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                raise DamacyError(
                    f"cannot allocate {nbytes} bytes of shared memory in {SHM_DIR}: {e.strerror}"
                    " (is /dev/shm too small? containers often give 64 MB)"
                ) from e
            self._map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.linked = True
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    def unlink(self) -> None:
        """Remove the name (mappings stay valid). Idempotent."""
        if self.linked:
            self.linked = False
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass

    def close(self) -> bool:
        """Unlink and unmap now; False while a view of the memory is still alive (a task in
        flight, say): then nothing is unmapped and the owner calls again later."""
        self.unlink()
        self.array = None  # type: ignore[assignment]
        if self._map.closed:
            return True
        try:
            self._map.close()  # also closes the descriptor the mapping keeps
        except BufferError:
            return False
        return True

    @property
    def mapped(self) -> bool:
        return not self._map.closed


def remove_stale(log=None, own: bool = False) -> list[str]:
    """Unlink segments whose daemon process is gone (``own``: this process's, as it stops:
    those of sessions still starting included); returns their names."""
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in names:
        match = _NAME.match(name)
        if not match:
            continue
        pid = int(match.group(1))
        if (pid != os.getpid()) if own else (pid == os.getpid() or pid_alive(pid)):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except OSError:
            pass
    if removed and log is not None:
        log(f"removed {len(removed)} stale shared-memory segment(s) of dead damacyd processes")
    return removed
