"""Processes of this machine, as the daemon and the disk tier see them: is a pid still running
(a client to reclaim, a segment or a temporary file whose owner is gone)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Is process ``pid`` running (as far as this pid namespace can tell)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True
