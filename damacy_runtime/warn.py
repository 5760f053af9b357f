"""Warnings to the caller of damacy: each said once per process and case, at the line of the
program that led to it (the first frame outside damacy's packages, however deep in damacy
the warning is found)."""

from __future__ import annotations

import sys
import threading
import types
import warnings
from collections.abc import Hashable

_OWN = ("damacy", "damacy_server", "damacy_runtime", "damacy_client", "damacy_protocol")
_said: set[Hashable] = set()
_lock = threading.Lock()


def warn_once(key: Hashable, message: str) -> bool:
    """A ``UserWarning`` with ``message`` unless one was already given for ``key`` in this
    process; True when it was given now."""
    with _lock:
        if key in _said:
            return False
        _said.add(key)
    warnings.warn(message, UserWarning, stacklevel=_outside_damacy())
    return True


def _outside_damacy() -> int:
    """The ``stacklevel`` (for a ``warnings.warn`` in :func:`warn_once`) of the first frame
    not in damacy's packages."""
    frame: types.FrameType | None = sys._getframe(1)  # warn_once's
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _OWN:
        frame, level = frame.f_back, level + 1
    return level
