"""One meaning of a selection, for :class:`Sample`, :class:`IndexQuery` and ``damacy.read``.

A selection is one entry per axis, in a tuple (``np.s_[...]`` makes one); fewer entries
than axes select the rest whole, and ``...`` stands for the axes not named. Every number
is an array coordinate: a negative number is a position before the array's start, never a
count from the end (as in tensorstore, unlike numpy), so a box centred near an edge is
padded, not wrapped. Positions outside the array are padded with its fill value or refused,
per ``out_of_bounds`` (pipelines: ``"pad"`` by default; ``damacy.read``: ``"error"``).

=====================  =============================================  ======  ==========  ====
entry                  selects                                        Sample  IndexQuery  read
=====================  =============================================  ======  ==========  ====
``a:b``, ``(a, b)``    positions a .. b-1; an open bound is the       yes     yes         yes
                       array's own (``:b`` from 0, ``a:`` to the end)
``a:b:s``              every s-th position from a (s > 0)             no [1]  yes         yes
``i``                  position i; the axis is dropped                yes     yes         yes
``[i, j, ...]``        those positions, in order, duplicates kept     no [2]  yes         yes
boolean mask           where true (its length is the axis')           no      no [3]      yes
``...``                the axes not named                             yes     yes         yes
=====================  =============================================  ======  ==========  ====

[1] a sample is a box; strided samples come with read-time transforms. [2] index lists
are what :class:`IndexQuery` is for. [3] masks are refused (a mask's length needs the
array); pass ``np.flatnonzero(mask)``.

This module checks and normalises entries without knowing the array (``normalize``);
the engine resolves them against the array's shape.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from damacy_protocol.errors import InvalidArgument


class Indices(tuple):
    """An index list of a selection (a tuple of ints that is not a range)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return describe_indices(self)


def describe_indices(indices: Sequence[int]) -> str:
    """An index list as a message shows it: whole when short, else its first four and count."""
    if len(indices) > 8:
        return "[" + ", ".join(map(str, indices[:4])) + f", ... ({len(indices)} indices)]"
    return "[" + ", ".join(map(str, indices)) + "]"


#: a normalised entry: a range (``slice``, int bounds or None, step None or > 0), a
#: position (``int``), an index list (:class:`Indices`), or ``...``; ``damacy.read`` may
#: also hold numpy index arrays and boolean masks
Entry = Any

BOX = "box"
QUERY = "query"
READ = "read"


def _int(value: Any, what: str, uri: str | None) -> int:
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise InvalidArgument(f"{what} must be an integer, got {value!r}", uri=uri)
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{what} must be an integer, got {value!r}", uri=uri) from None


def normalize(selection: Any, kind: str, uri: str | None = None) -> tuple[Entry, ...]:
    """The entries of ``selection`` for a ``kind`` of request (``BOX``: a Sample,
    ``QUERY``: an IndexQuery, ``READ``: damacy.read), checked against the table above;
    :class:`InvalidArgument` names the axis and says what to use instead."""
    if selection is None:
        return ()
    entries = selection if isinstance(selection, tuple) else (selection,)
    if sum(1 for e in entries if e is Ellipsis) > 1:
        raise InvalidArgument("a selection may hold one '...' only", uri=uri)
    return tuple(_entry(e, axis, kind, uri) for axis, e in enumerate(entries))


def _entry(e: Any, axis: int, kind: str, uri: str | None) -> Entry:
    where = f"axis {axis}"
    if e is Ellipsis:
        return e
    if e is None:
        raise InvalidArgument(f"{where}: new axes (None) are not supported", uri=uri)
    if isinstance(e, slice):
        start = None if e.start is None else _int(e.start, f"{where} start", uri)
        stop = None if e.stop is None else _int(e.stop, f"{where} stop", uri)
        step = None if e.step is None else _int(e.step, f"{where} step", uri)
        return _range(start, stop, step, where, kind, uri)
    if isinstance(e, Indices):
        if kind == BOX:
            raise InvalidArgument(f"{where}: a Sample is a box; an index list is an IndexQuery's", uri=uri)
        return e
    if isinstance(e, tuple):
        if len(e) != 2:
            raise InvalidArgument(f"{where}: a range is (start, stop), got {e!r}; an index list is a list", uri=uri)
        start = None if e[0] is None else _int(e[0], f"{where} start", uri)
        stop = None if e[1] is None else _int(e[1], f"{where} stop", uri)
        return _range(start, stop, None, where, kind, uri)
    if isinstance(e, (str, bytes, dict, set)):
        raise InvalidArgument(f"{where}: cannot select with {e!r}", uri=uri)
    if hasattr(e, "__index__") and not hasattr(e, "__len__"):
        return _int(e, where, uri)
    if not hasattr(e, "__iter__"):
        raise InvalidArgument(f"{where}: cannot select with {e!r}", uri=uri)
    return _list(e, where, kind, uri)


def _range(start: int | None, stop: int | None, step: int | None, where: str, kind: str, uri: str | None) -> slice:
    if step == 1:
        step = None
    if step is not None:
        if step <= 0:
            raise InvalidArgument(f"{where}: a step must be positive, got {step}", uri=uri)
        if kind == BOX:
            raise InvalidArgument(
                f"{where}: a Sample is a box and has no step (got {step}); "
                "use IndexQuery for a strided selection",
                uri=uri,
            )
    if start is not None and stop is not None and stop < start:
        raise InvalidArgument(f"{where}: stop {stop} is before start {start}", uri=uri)
    return slice(start, stop, step)


def _list(e: Any, where: str, kind: str, uri: str | None) -> Entry:
    import numpy as np

    if kind == BOX:
        raise InvalidArgument(
            f"{where}: a Sample is a box, per axis (start, stop) or a slice in a tuple; "
            f"a list selects indices (an IndexQuery's), got {_short(e)}; a list of (start, stop) pairs is "
            "Sample(uri, aabb=[...])",
            uri=uri,
        )
    arr = e if isinstance(e, np.ndarray) else np.asarray(list(e))
    if arr.dtype == bool:
        if kind != READ:
            raise InvalidArgument(
                f"{where}: a boolean mask needs the array's shape; pass np.flatnonzero(mask)", uri=uri
            )
        if arr.ndim != 1:
            raise InvalidArgument(f"{where}: a boolean mask must be one-dimensional, got shape {arr.shape}", uri=uri)
        return arr
    if arr.size == 0:
        arr = np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidArgument(f"{where}: an index list must be a flat list of integers, got {_short(e)}", uri=uri)
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > (1 << 63) - 1:
        raise InvalidArgument(f"{where}: index {int(arr.max())} does not fit an int64", uri=uri)
    if kind == READ:
        return arr.astype(np.int64, copy=False)
    return Indices(arr.tolist())


def _short(e: Any) -> str:
    text = repr(e)
    return text if len(text) <= 60 else text[:57] + "..."


def expand(entries: tuple[Entry, ...], ndim: int, uri: str | None = None) -> tuple[Entry, ...]:
    """One entry per axis of an ``ndim``-d array: ``...`` and the axes not named select
    whole (``slice(None)``); more entries than axes are refused."""
    named = sum(1 for e in entries if e is not Ellipsis)
    if named > ndim:
        raise InvalidArgument(f"the selection names {named} axes, the array has {ndim}", uri=uri)
    whole = (slice(None),) * (ndim - named)
    for i, e in enumerate(entries):
        if e is Ellipsis:
            return entries[:i] + whole + entries[i + 1 :]
    return entries + whole


def key(entries: tuple[Entry, ...]) -> tuple:
    """A hashable, comparable form of normalised entries."""
    return tuple(
        ("r", e.start, e.stop, e.step) if isinstance(e, slice) else ("l", e) if isinstance(e, Indices) else e
        for e in entries
    )


def describe(entries: tuple[Entry, ...]) -> str:
    """``[0:4, 5, [3, 1], ...]``: how entries read in a message."""

    def one(e: Entry) -> str:
        if e is Ellipsis:
            return "..."
        if isinstance(e, slice):
            text = f"{'' if e.start is None else e.start}:{'' if e.stop is None else e.stop}"
            return text + (f":{e.step}" if e.step is not None else "")
        return repr(e)

    return "[" + ", ".join(one(e) for e in entries) + "]"
