"""What a training sample is: a box of an array (:class:`Sample`) or an index selection
(:class:`IndexQuery`). Both are frozen and hashable, and hold only plain Python values so
they travel to the daemon as they are."""

from __future__ import annotations

import operator
from typing import Any

from damacy_protocol.errors import InvalidArgument


def _int(value: Any, what: str, uri: str) -> int:
    if isinstance(value, bool):
        raise InvalidArgument(f"{what} must be an integer, got {value!r}", uri=uri)
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{what} must be an integer, got {value!r}", uri=uri) from None


def _uri(uri: Any) -> str:
    import os

    if not isinstance(uri, (str, os.PathLike)) or not os.fspath(uri):
        raise InvalidArgument(f"a sample's uri must be a non-empty string or path, got {uri!r}")
    return os.fspath(uri)


class Sample:
    """A box of the array at ``uri``: per axis ``(start, stop)`` or a slice (``np.s_[...]``).

    Coordinates are absolute array coordinates: a box may reach outside the array (negative
    starts, stops past the end) and that part is padded with the array's fill value (or
    refused, per ``out_of_bounds``), never clipped or wrapped. An open slice bound
    (``np.s_[:, 0:64]``) means the array's own bound on that axis.
    """

    __slots__ = ("uri", "aabb", "_hash")

    uri: str
    aabb: tuple[tuple[int | None, int | None], ...]

    def __init__(self, uri: Any, aabb: Any) -> None:
        uri = _uri(uri)
        if not isinstance(aabb, (tuple, list)):
            aabb = (aabb,)
        axes = []
        for axis, edge in enumerate(aabb):
            if isinstance(edge, slice):
                if edge.step not in (None, 1):
                    raise InvalidArgument(f"axis {axis}: a box has no step (got {edge.step})", uri=uri)
                start, stop = edge.start, edge.stop
            elif isinstance(edge, (tuple, list)) and len(edge) == 2:
                start, stop = edge
            else:
                raise InvalidArgument(f"axis {axis}: a box edge is (start, stop) or a slice, got {edge!r}", uri=uri)
            start = None if start is None else _int(start, f"axis {axis} start", uri)
            stop = None if stop is None else _int(stop, f"axis {axis} stop", uri)
            if start is not None and stop is not None and stop < start:
                raise InvalidArgument(f"axis {axis}: box stop {stop} is before its start {start}", uri=uri)
            axes.append((start, stop))
        object.__setattr__(self, "uri", uri)
        object.__setattr__(self, "aabb", tuple(axes))
        object.__setattr__(self, "_hash", hash(("Sample", uri, self.aabb)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Sample is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sample) and self.uri == other.uri and self.aabb == other.aabb

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return (Sample, (self.uri, self.aabb))

    @property
    def shape(self) -> tuple[int, ...] | None:
        """The box's shape, or ``None`` while an open bound depends on the array."""
        if any(a is None or b is None for a, b in self.aabb):
            return None
        return tuple(b - a for a, b in self.aabb)

    def __repr__(self) -> str:
        box = ", ".join(f"{'' if a is None else a}:{'' if b is None else b}" for a, b in self.aabb)
        return f"Sample({self.uri!r}, [{box}])"


class IndexQuery:
    """An index selection of the array at ``uri``: per axis an index list or a slice.

    The result is the outer product of the axes (like zarr's ``oindex``): every combination,
    in the given order, duplicates kept; negative indices and slice bounds count from the
    end as in numpy. Indices outside the array are refused when the query is planned.
    """

    __slots__ = ("uri", "selection", "_hash")

    uri: str
    selection: tuple[tuple[int, ...] | tuple[str, int | None, int | None, int | None], ...]

    def __init__(self, uri: Any, selection: Any) -> None:
        uri = _uri(uri)
        if not isinstance(selection, tuple):
            selection = (selection,)
        axes: list = []
        for axis, entry in enumerate(selection):
            if isinstance(entry, slice):
                parts = [None if v is None else _int(v, f"axis {axis} slice", uri) for v in (entry.start, entry.stop, entry.step)]
                if parts[2] is not None and parts[2] <= 0:
                    raise InvalidArgument(f"axis {axis}: slice step must be positive, got {parts[2]}", uri=uri)
                axes.append(slice(*parts))
            elif isinstance(entry, (str, bytes)) or not hasattr(entry, "__iter__"):
                raise InvalidArgument(f"axis {axis}: expected an index list or a slice, got {entry!r}", uri=uri)
            else:
                axes.append(tuple(_int(i, f"axis {axis} index", uri) for i in _flat(entry, axis, uri)))
        object.__setattr__(self, "uri", uri)
        object.__setattr__(self, "selection", tuple(axes))
        key = tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in axes)
        object.__setattr__(self, "_hash", hash(("IndexQuery", uri, key)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("IndexQuery is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, IndexQuery) and self.uri == other.uri and self._key() == other._key()

    def _key(self):
        return tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in self.selection)

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return (IndexQuery, (self.uri, self.selection))

    @property
    def shape(self) -> tuple[int, ...]:
        """The selection's shape; an error when a slice's length depends on the array's shape
        (then use :meth:`shape_for`)."""
        out = []
        for axis, s in enumerate(self.selection):
            if isinstance(s, slice):
                if s.stop is None or s.stop < 0 or (s.start or 0) < 0:
                    raise InvalidArgument(
                        f"axis {axis}: the length of slice {s} depends on the array's shape; use shape_for(shape)",
                        uri=self.uri,
                    )
                out.append(len(range(s.start or 0, s.stop, s.step or 1)))
            else:
                out.append(len(s))
        return tuple(out)

    def shape_for(self, array_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The selection's shape on an array of ``array_shape`` (unnamed axes select all)."""
        out = []
        for axis, n in enumerate(array_shape):
            s = self.selection[axis] if axis < len(self.selection) else slice(None)
            out.append(len(range(*s.indices(n))) if isinstance(s, slice) else len(s))
        return tuple(out)

    def __repr__(self) -> str:
        def one(s):
            if isinstance(s, slice):
                return f"{'' if s.start is None else s.start}:{'' if s.stop is None else s.stop}" + (
                    f":{s.step}" if s.step is not None else ""
                )
            if len(s) > 8:
                return "[" + ", ".join(map(str, s[:4])) + f", ... ({len(s)} indices)]"
            return "[" + ", ".join(map(str, s)) + "]"

        return f"IndexQuery({self.uri!r}, [{', '.join(one(s) for s in self.selection)}])"


def _flat(entry: Any, axis: int, uri: str) -> list:
    import numpy as np

    if isinstance(entry, np.ndarray):
        if entry.ndim != 1 or entry.dtype.kind not in "iu":
            raise InvalidArgument(f"axis {axis}: an index list must be a flat list of integers", uri=uri)
        return entry.tolist()
    return list(entry)
