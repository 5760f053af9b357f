"""Selections: what part of an array a request wants, axis by axis, and which read units
it touches.

Per axis a selection is either a :class:`AxisRange` (a box edge, absolute coordinates that
may reach outside the array: that part is padded or refused by the caller) or an
:class:`AxisIndex` (a list of in-range indices, order and duplicates kept). A multi-axis
selection is their outer product (orthogonal indexing, as zarr's ``oindex``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from damacy_protocol.errors import InvalidArgument, OutOfBounds


@dataclass(frozen=True)
class AxisRange:
    start: int
    stop: int

    @property
    def size(self) -> int:
        return max(0, self.stop - self.start)


@dataclass(frozen=True, eq=False)
class AxisIndex:
    indices: np.ndarray  # int64, each in [0, axis size)

    @property
    def size(self) -> int:
        return len(self.indices)


AxisSelection = Union[AxisRange, AxisIndex]
#: a destination or source selector along one axis: a slice or an index array
Part = Union[slice, np.ndarray]


def selection_shape(axes: Sequence[AxisSelection]) -> tuple[int, ...]:
    return tuple(a.size for a in axes)


def _as_int(value: Any, what: str, uri: str | None) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{what} must be an integer, got {value!r}", uri=uri) from None


def index_array(value: Any, size: int, axis: int, uri: str | None) -> np.ndarray:
    """An index list (numpy semantics: negative counts from the end; a boolean mask of the
    axis' length selects where true) as in-range int64 indices; out of range is refused."""
    arr = np.asarray(value)
    if arr.dtype == bool:
        if arr.shape != (size,):
            raise InvalidArgument(f"axis {axis}: a boolean mask must have length {size}, got shape {arr.shape}", uri=uri)
        return np.flatnonzero(arr).astype(np.int64)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidArgument(f"axis {axis}: an index list must be a flat list of integers, got {value!r}", uri=uri)
    if arr.dtype.kind == "u" and arr.max() > np.iinfo(np.int64).max:
        raise OutOfBounds(f"axis {axis}: index {int(arr.max())} is out of range for size {size}", uri=uri)
    idx = arr.astype(np.int64)
    bad = (idx < -size) | (idx >= size)
    if bad.any():
        raise OutOfBounds(f"axis {axis}: index {int(idx[bad][0])} is out of range for size {size}", uri=uri)
    return np.where(idx < 0, idx + size, idx)


def slice_selection(s: slice, size: int, axis: int, uri: str | None) -> AxisSelection:
    """A slice with numpy's meaning of negative bounds; bounds past the axis are refused
    rather than clipped."""
    step = 1 if s.step is None else _as_int(s.step, f"axis {axis} step", uri)
    if step <= 0:
        raise InvalidArgument(f"axis {axis}: slice step must be positive, got {step}", uri=uri)

    def bound(v: Any, default: int) -> int:
        if v is None:
            return default
        b = _as_int(v, f"axis {axis} slice bound", uri)
        if b < 0:
            b += size
        if not 0 <= b <= size:
            raise OutOfBounds(f"axis {axis}: slice {s.start}:{s.stop} is out of range for size {size}", uri=uri)
        return b

    start, stop = bound(s.start, 0), bound(s.stop, size)
    stop = max(start, stop)
    if step == 1:
        return AxisRange(start, stop)
    return AxisIndex(np.arange(start, stop, step, dtype=np.int64))


def parse_read_selection(
    selection: Any, shape: tuple[int, ...], uri: str | None = None
) -> tuple[list[AxisSelection], list[int]]:
    """The axes of a ``damacy.read`` selection and the axes that an integer drops.

    Per axis: a slice (numpy semantics, no clipping), a ``(start, stop)`` tuple (absolute
    box coordinates), an integer (the axis is dropped, as in numpy), or an index list /
    array / boolean mask; ``...`` stands for the axes not named.
    """
    ndim = len(shape)
    if selection is None:
        entries: tuple = ()
    elif isinstance(selection, tuple):
        entries = selection
    else:
        entries = (selection,)
    ellipses = [i for i, e in enumerate(entries) if e is Ellipsis]
    if len(ellipses) > 1:
        raise InvalidArgument("a selection may hold one '...' only", uri=uri)
    if ellipses:
        i = ellipses[0]
        fill = ndim - (len(entries) - 1)
        entries = entries[:i] + (slice(None),) * max(fill, 0) + entries[i + 1 :]
    if len(entries) > ndim:
        raise InvalidArgument(f"the selection has {len(entries)} axes, the array has {ndim}", uri=uri)
    entries = entries + (slice(None),) * (ndim - len(entries))

    axes: list[AxisSelection] = []
    drop: list[int] = []
    for axis, (e, size) in enumerate(zip(entries, shape)):
        if isinstance(e, slice):
            axes.append(slice_selection(e, size, axis, uri))
        elif isinstance(e, tuple):
            if len(e) != 2:
                raise InvalidArgument(f"axis {axis}: a box edge is (start, stop), got {e!r}", uri=uri)
            start = _as_int(e[0], f"axis {axis} start", uri)
            stop = _as_int(e[1], f"axis {axis} stop", uri)
            if not 0 <= start <= stop <= size:
                raise OutOfBounds(f"axis {axis}: box ({start}, {stop}) is out of range for size {size}", uri=uri)
            axes.append(AxisRange(start, stop))
        elif isinstance(e, (int, np.integer)) and not isinstance(e, (bool, np.bool_)):
            axes.append(AxisIndex(index_array([e], size, axis, uri)))
            drop.append(axis)
        elif isinstance(e, (list, range, np.ndarray)):
            axes.append(AxisIndex(index_array(e, size, axis, uri)))
        else:
            raise InvalidArgument(f"axis {axis}: cannot select with {e!r}", uri=uri)
    return axes, drop


def axis_parts(sel: AxisSelection, size: int, unit: int) -> list[tuple[int, Part, Part]]:
    """The read units one axis of a selection touches, as (unit index, destination part,
    source part within the unit); positions outside [0, size) are in no part."""
    out: list[tuple[int, Part, Part]] = []
    if isinstance(sel, AxisRange):
        lo, hi = max(sel.start, 0), min(sel.stop, size)
        if lo >= hi:
            return out
        for u in range(lo // unit, (hi - 1) // unit + 1):
            a, b = max(lo, u * unit), min(hi, (u + 1) * unit)
            out.append((u, slice(a - sel.start, b - sel.start), slice(a - u * unit, b - u * unit)))
        return out
    idx = sel.indices
    if not len(idx):
        return out
    units = idx // unit
    order = np.argsort(units, kind="stable")
    uniq, starts = np.unique(units[order], return_index=True)
    ends = [*starts[1:].tolist(), len(order)]
    for u, s, e in zip(uniq.tolist(), starts.tolist(), ends):
        pos = order[s:e]
        local = idx[pos] - u * unit
        out.append((u, _compact(pos), _compact(local)))
    return out


def _compact(a: np.ndarray) -> Part:
    """An index array that counts up by one becomes the equivalent slice."""
    n = len(a)
    if n and int(a[-1]) - int(a[0]) == n - 1 and (n < 3 or bool(np.all(np.diff(a) == 1))):
        return slice(int(a[0]), int(a[-1]) + 1)
    return a


class SliceCopy:
    """Copy a box of a read unit into a box of the destination (slices on both sides)."""

    __slots__ = ("dst", "src")

    def __init__(self, dst: tuple[slice, ...], src: tuple[slice, ...]) -> None:
        self.dst = dst
        self.src = src

    def apply(self, target: np.ndarray, arr: np.ndarray) -> int:
        """Copy (with the cast to the target's dtype); returns the elements copied."""
        piece = arr[self.src]
        target[self.dst] = piece
        return piece.size

    def fill(self, target: np.ndarray, value: np.ndarray) -> None:
        target[self.dst] = value


class CopyOp:
    """Copy one piece of a read unit into a destination: ``apply(target, unit_array)``.

    Box edges are slices on both sides (one numpy assignment). Index lists are gathered
    with ``take`` along each listed axis (a row copy, fast) and scattered with broadcast
    index arrays, which is several times faster than an ``np.ix_`` gather and scatter.
    """

    __slots__ = ("dst", "src", "takes", "transpose")

    def __init__(self, dst_parts: Sequence[Part], src_parts: Sequence[Part]) -> None:
        dst_arrays = [k for k, p in enumerate(dst_parts) if isinstance(p, np.ndarray)]
        self.takes = tuple((k, p) for k, p in enumerate(src_parts) if isinstance(p, np.ndarray))
        self.src = tuple(slice(None) if isinstance(p, np.ndarray) else p for p in src_parts)
        self.transpose = None
        if len(dst_arrays) <= 1:
            self.dst = tuple(dst_parts)
            return
        n = len(dst_arrays)
        dst = list(dst_parts)
        for j, k in enumerate(dst_arrays):
            shape = [1] * n
            shape[j] = -1
            dst[k] = dst_parts[k].reshape(shape)
        self.dst = tuple(dst)
        if dst_arrays != list(range(dst_arrays[0], dst_arrays[0] + n)):
            # numpy puts the broadcast axes of non-adjacent index arrays first
            rest = [k for k in range(len(dst_parts)) if k not in dst_arrays]
            self.transpose = tuple(dst_arrays + rest)

    def apply(self, target: np.ndarray, arr: np.ndarray) -> int:
        piece = arr[self.src]
        for axis, idx in self.takes:
            piece = piece.take(idx, axis=axis)
        if self.transpose is not None:
            piece = piece.transpose(self.transpose)
        target[self.dst] = piece
        return piece.size

    def fill(self, target: np.ndarray, value: np.ndarray) -> None:
        """Write ``value`` (already of the target's dtype) where this copy would write."""
        target[self.dst] = value
