"""Selections: what part of an array a request wants, axis by axis, and which read units
it touches.

Per axis a selection is either a :class:`AxisRange` (a box edge, absolute coordinates that
may reach outside the array: that part is padded or refused by the caller) or an
:class:`AxisIndex` (a list of indices, order and duplicates kept; those outside the array
are padded). A multi-axis
selection is their outer product (orthogonal indexing, as zarr's ``oindex``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from damacy_protocol.enums import BoundsPolicy
from damacy_protocol.errors import InvalidArgument, OutOfBounds
from damacy_protocol.selection import expand
from damacy_server.zarr.metadata import MAX_EXTENT


@dataclass(frozen=True)
class AxisRange:
    start: int
    stop: int

    @property
    def size(self) -> int:
        return max(0, self.stop - self.start)


@dataclass(frozen=True, eq=False)
class AxisIndex:
    indices: np.ndarray  # int64; positions outside [0, axis size) are padded

    @property
    def size(self) -> int:
        return len(self.indices)


AxisSelection = AxisRange | AxisIndex
#: a destination or source selector along one axis: a slice or an index array
Part = slice | np.ndarray


def selection_shape(axes: Sequence[AxisSelection]) -> tuple[int, ...]:
    return tuple(a.size for a in axes)


def resolve(
    entries: tuple[Any, ...], shape: tuple[int, ...], out_of_bounds: BoundsPolicy | str, uri: str | None = None
) -> tuple[list[AxisSelection], list[int]]:
    """The axes of normalised selection ``entries`` (:mod:`damacy_protocol.selection`) on an
    array of ``shape``, and the axes an integer drops. Positions outside the array stay in
    the selection (they are padded) with ``out_of_bounds="pad"`` and are refused with
    ``"error"``."""
    axes: list[AxisSelection] = []
    drop: list[int] = []
    for axis, (e, size) in enumerate(zip(expand(entries, len(shape), uri), shape)):
        if isinstance(e, slice):
            start = 0 if e.start is None else e.start
            # an open stop is the array's end; from past the end it selects nothing
            stop = max(size, start) if e.stop is None else e.stop
            if stop < start:
                raise InvalidArgument(f"axis {axis}: {start}:{stop} ends before it starts (size {size})", uri=uri)
            if start < -MAX_EXTENT or stop > MAX_EXTENT:  # (no array reaches there; offsets past it would overflow)
                raise InvalidArgument(f"axis {axis}: {start}:{stop} reaches past 2**62, where no array has elements", uri=uri)
            # the last position selected (a step may stop short of `stop`)
            last = start + (stop - start - 1) // (e.step or 1) * (e.step or 1) if stop > start else start - 1
            if out_of_bounds == BoundsPolicy.ERROR and not (0 <= start and last < size and start <= size):
                text = f"{start}:{'' if e.stop is None else stop}" + (f":{e.step}" if e.step else "")
                raise OutOfBounds(
                    f"axis {axis}: {text} leaves the array (size {size}){_NOT_FROM_END if start < 0 else ''}",
                    uri=uri,
                )
            if e.step is None:
                axes.append(AxisRange(start, stop))
            else:
                axes.append(AxisIndex(np.arange(start, stop, e.step, dtype=np.int64)))
        elif isinstance(e, int):
            if out_of_bounds == BoundsPolicy.ERROR and not 0 <= e < size:
                raise OutOfBounds(
                    f"axis {axis}: index {e} is outside the array (size {size}){_NOT_FROM_END if e < 0 else ''}", uri=uri
                )
            axes.append(AxisRange(e, e + 1))
            drop.append(axis)
        else:
            idx = np.asarray(e)
            if idx.dtype == bool:
                if idx.shape != (size,):
                    raise InvalidArgument(
                        f"axis {axis}: a boolean mask must have length {size}, got shape {idx.shape}", uri=uri
                    )
                idx = np.flatnonzero(idx)
            idx = idx.astype(np.int64, copy=False)
            if out_of_bounds == BoundsPolicy.ERROR and idx.size:
                bad = (idx < 0) | (idx >= size)
                if bad.any():
                    first = int(idx[bad][0])
                    raise OutOfBounds(
                        f"axis {axis}: index {first} is outside the array (size {size})"
                        f"{_NOT_FROM_END if first < 0 else ''}",
                        uri=uri,
                    )
            axes.append(AxisIndex(idx))
    return axes, drop


_NOT_FROM_END = "; negative numbers are positions before the array, not counted from the end"


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
    inside = np.flatnonzero((idx >= 0) & (idx < size))  # the others are padded
    if not len(inside):
        return out
    if len(inside) < len(idx):
        idx = idx[inside]
    else:
        inside = None
    units = idx // unit
    order = np.argsort(units, kind="stable")
    uniq, starts = np.unique(units[order], return_index=True)
    ends = [*starts[1:].tolist(), len(order)]
    for u, s, e in zip(uniq.tolist(), starts.tolist(), ends):
        pos = order[s:e]
        local = idx[pos] - u * unit
        out.append((u, _compact(pos if inside is None else inside[pos]), _compact(local)))
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

    def apply(self, target: np.ndarray, arr: np.ndarray, convert=None) -> int:
        """Copy (with the cast to the target's dtype, or ``convert(piece)``); returns the
        elements copied."""
        piece = arr[self.src] if self.src else arr[...]  # (a 0-d array, not a scalar: cast as arrays are)
        target[self.dst] = piece if convert is None else convert(piece)
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

    def apply(self, target: np.ndarray, arr: np.ndarray, convert=None) -> int:
        piece = arr[self.src]
        for axis, idx in self.takes:
            piece = piece.take(idx, axis=axis)
        if self.transpose is not None:
            piece = piece.transpose(self.transpose)
        target[self.dst] = piece if convert is None else convert(piece)
        return piece.size

    def fill(self, target: np.ndarray, value: np.ndarray) -> None:
        """Write ``value`` (already of the target's dtype) where this copy would write."""
        target[self.dst] = value
