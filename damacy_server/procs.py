"""Processes of this machine, as the daemon and the disk tier see them: is a pid still running
(a client to reclaim, a segment or a temporary file whose owner is gone)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Is process ``pid`` running (as far as this pid namespace can tell)? A process killed
    and not yet reaped by its parent (a zombie) is not: it runs nothing and maps nothing."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # no /proc (or gone meanwhile): as kill said
        return True
    end = stat.rfind(b")")  # the state follows the command name, which may hold anything
    return stat[end + 2 : end + 3] not in (b"Z", b"X")
