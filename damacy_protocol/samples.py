"""What a training sample is: a box of an array (:class:`Sample`) or an index selection
(:class:`IndexQuery`). Both are frozen and hashable, and hold only plain Python values so
they travel to the daemon as they are."""

from __future__ import annotations

import math
import operator
from types import EllipsisType
from typing import Any

from damacy_protocol.errors import InvalidArgument, redact_uri
from damacy_protocol.selection import BOX, QUERY, Indices, describe, key
from damacy_protocol.selection import normalize as normalize_selection


def _uri(uri: Any) -> str:
    import os

    if not isinstance(uri, (str, os.PathLike)) or not os.fspath(uri):
        raise InvalidArgument(f"a sample's uri must be a non-empty string or path, got {uri!r}")
    return os.fspath(uri)


def _span(entry: Any) -> tuple[int | None, int | None]:
    if isinstance(entry, slice):
        return (entry.start, entry.stop)
    return (entry, entry + 1)


def _level(level: Any, uri: str) -> int | None:
    """An NGFF image's level (None: the uri's own array, level 0 for an image)."""
    if level is None:
        return None
    if not isinstance(level, int) or isinstance(level, bool) or level < 0:
        raise InvalidArgument(f"level must be a non-negative integer (an NGFF image's level), got {level!r}", uri=uri)
    return level


def _rebuild(cls, uri, selection, level, flip=(), transpose=None, normalize=None):
    return cls(uri, selection, level=level, flip=flip, transpose=transpose, normalize=normalize)


def normalize_pair(normalize: Any, uri: str | None = None) -> tuple[float, float] | None:
    """A sample's intensity normalisation ``(offset, scale)``: the output is
    ``(x - offset) * scale``, fused into the cast (see the README's numeric contract)."""
    if normalize is None:
        return None
    try:
        offset, scale = normalize
        pair = (float(offset), float(scale))
    except (TypeError, ValueError, OverflowError):
        raise InvalidArgument(f"normalize must be a pair (offset, scale) of numbers, got {normalize!r}", uri=uri) from None
    if isinstance(offset, bool) or isinstance(scale, bool) or not all(math.isfinite(v) for v in pair):
        raise InvalidArgument(f"normalize must be a pair of finite numbers (offset, scale), got {normalize!r}", uri=uri)
    return pair


def _transform(flip: Any, transpose: Any, uri: str) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """A sample's transform, checked as far as it can be without the array: ``flip``, the
    axes reversed (of the selection's result, dropped axes left out); ``transpose``, the
    result's axes in a new order (``np.transpose``'s ``axes``), applied after the flips."""
    given = () if flip is None else (flip,) if _is_axis(flip) else flip  # one axis, or a sequence (an array too)
    try:
        listed = list(given)
    except TypeError:
        raise InvalidArgument(f"flip must be an axis or a sequence of axes, got {flip!r}", uri=uri) from None
    if not all(_is_axis(a) and a >= 0 for a in listed):
        raise InvalidArgument(f"flip axes must be non-negative integers, got {flip!r}", uri=uri)
    axes = tuple(sorted({operator.index(a) for a in listed}))
    if transpose is None:
        return axes, None
    try:
        order = tuple(transpose)
    except TypeError:
        raise InvalidArgument(f"transpose must be a sequence of axes, got {transpose!r}", uri=uri) from None
    if not all(_is_axis(a) for a in order) or sorted(operator.index(a) for a in order) != list(range(len(order))):
        raise InvalidArgument(f"transpose must be a permutation of 0..n-1, got {transpose!r}", uri=uri)
    order = tuple(operator.index(a) for a in order)
    return axes, (None if order == tuple(range(len(order))) else order)


def _is_axis(a: Any) -> bool:
    """An integer (Python's or numpy's), not a bool nor a float."""
    return hasattr(a, "__index__") and not isinstance(a, bool) and type(a).__name__ != "bool_" and not hasattr(a, "__len__")


def _describe_transform(flip: tuple[int, ...], transpose: tuple[int, ...] | None, normalize: tuple[float, float] | None = None) -> str:
    return (
        (f", flip={flip}" if flip else "") + (f", transpose={transpose}" if transpose is not None else "")
        + (f", normalize={normalize}" if normalize is not None else "")
    )


def _aabb_selection(aabb: Any, uri: str) -> tuple[Any, ...]:
    """The selection of an ``aabb``: a sequence (list, tuple or an (n, 2) array) of per-axis
    ``(start, stop)`` pairs or slices (``...`` for the axes not named), always a box, never
    index lists."""
    if isinstance(aabb, slice):
        aabb = (aabb,)
    elif type(aabb).__name__ == "ndarray" and getattr(aabb, "ndim", 0) == 2 and aabb.shape[1] == 2:
        aabb = aabb.tolist()
    if not isinstance(aabb, (list, tuple)):
        raise InvalidArgument(f"aabb must be a sequence of per-axis (start, stop) pairs or slices, got {aabb!r}", uri=uri)
    entries: list[Any] = []
    for axis, e in enumerate(aabb):
        if isinstance(e, slice) or e is Ellipsis:
            entries.append(e)
        elif isinstance(e, (list, tuple)) and len(e) == 2:
            entries.append(slice(*e))
        elif type(e).__name__ == "ndarray" and getattr(e, "shape", None) == (2,):
            entries.append(slice(*e.tolist()))
        else:
            raise InvalidArgument(f"aabb axis {axis}: expected a (start, stop) pair or a slice, got {e!r}", uri=uri)
    return tuple(entries)


def _is_aabb_list(selection: Any) -> bool:
    """A list of per-axis (start, stop) pairs or slices: an aabb given where a selection goes
    (a list is never a Sample's selection: it would be an index list, an IndexQuery's)."""
    return isinstance(selection, list) and bool(selection) and all(
        isinstance(e, slice) or e is Ellipsis or (isinstance(e, (list, tuple)) and len(e) == 2) for e in selection
    )


class Sample:
    """A box of the array at ``uri``: per axis ``(start, stop)``, a slice or an integer (the
    axis is dropped), in a tuple (``np.s_[...]``); ``...`` stands for the axes not named and
    fewer entries select the rest whole (see :mod:`damacy_protocol.selection`).

    ``aabb=``: the box as the seed API writes it, a list (or tuple) of per-axis ``(start,
    stop)`` pairs or slices: ``Sample(uri=uri, aabb=[(0, 64), (0, 256), (0, 256)])``, or the
    same list in the selection's place (``Sample(uri, [(0, 64), (0, 256), (0, 256)])``).
    Always a box: any other list is an index list, which only an :class:`IndexQuery` takes.

    ``level``: for an OME-NGFF image uri, the level to read (the box is in its index space;
    none: level 0).

    ``flip`` (axes to reverse) and ``transpose`` (a new order of the axes) transform the
    result as ``np.transpose(np.flip(box, flip), transpose)``, made by the copies that
    assemble the batch (no pass of their own); the batch's ``sample_shape`` is the
    transformed shape.

    ``normalize=(offset, scale)``: the sample's values become ``(x - offset) * scale``
    (``scale = 1 / std`` standardises), computed in the cast that writes the batch (no pass
    of its own); the batch's dtype must be a float type (see the README's numeric contract).

    Coordinates are absolute array coordinates: a box may reach outside the array (negative
    starts, stops past the end) and that part is padded with the array's fill value (or
    refused, per ``out_of_bounds``), never clipped or wrapped. An open slice bound
    (``np.s_[:, 0:64]``) means the array's own bound on that axis.
    """

    __slots__ = ("uri", "selection", "level", "flip", "transpose", "normalize", "_hash")

    uri: str
    selection: tuple[slice | int | EllipsisType, ...]
    level: int | None
    flip: tuple[int, ...]
    transpose: tuple[int, ...] | None
    normalize: tuple[float, float] | None
    _hash: int

    def __init__(
        self, uri: Any, selection: Any = None, *, aabb: Any = None, level: int | None = None, flip: Any = (),
        transpose: Any = None, normalize: Any = None,
    ) -> None:
        uri = _uri(uri)
        if aabb is not None:
            if selection is not None:
                raise InvalidArgument("a Sample takes a selection or aabb=, not both", uri=uri)
            entries = normalize_selection(_aabb_selection(aabb, uri), BOX, uri)
        elif selection is None:
            raise InvalidArgument("a Sample needs its box: a selection (np.s_[...]) or aabb=[(start, stop), ...]", uri=uri)
        elif _is_aabb_list(selection):  # Sample(uri, [(start, stop), ...]): the seed's positional aabb
            entries = normalize_selection(_aabb_selection(selection, uri), BOX, uri)
        else:
            entries = normalize_selection(selection, BOX, uri)
        object.__setattr__(self, "uri", uri)
        object.__setattr__(self, "selection", entries)
        object.__setattr__(self, "level", _level(level, uri))
        flip, transpose = _transform(flip, transpose, uri)
        object.__setattr__(self, "flip", flip)
        object.__setattr__(self, "transpose", transpose)
        object.__setattr__(self, "normalize", normalize_pair(normalize, uri))
        object.__setattr__(self, "_hash", hash(("Sample", uri, key(entries), self.level, flip, transpose, self.normalize)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Sample is immutable")

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Sample) and self.uri == other.uri and self.level == other.level
            and key(self.selection) == key(other.selection) and self.flip == other.flip and self.transpose == other.transpose
            and self.normalize == other.normalize
        )

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return (_rebuild, (type(self), self.uri, self.selection, self.level, self.flip, self.transpose, self.normalize))

    @property
    def aabb(self) -> tuple[tuple[int | None, int | None] | EllipsisType, ...]:
        """The box per named axis as ``(start, stop)`` (an integer ``i`` as ``(i, i + 1)``;
        ``None``: the array's bound; ``...`` as given)."""
        return tuple(e if e is Ellipsis else _span(e) for e in self.selection)

    @property
    def shape(self) -> tuple[int, ...] | None:
        """The box's shape over the axes it names (dropped axes left out), or ``None`` while
        it depends on the array (an open bound or ``...``). A selection naming fewer axes
        than its array has takes the rest whole: those are not in this shape (the sample
        does not know the array's)."""
        out = []
        for e in self.selection:
            if e is Ellipsis or (isinstance(e, slice) and (e.start is None or e.stop is None)):
                return None
            if isinstance(e, slice):
                out.append(e.stop - e.start)
        return tuple(out)

    def __repr__(self) -> str:
        level = "" if self.level is None else f", level={self.level}"
        return f"{type(self).__name__}({redact_uri(self.uri)!r}, {describe(self.selection)}{level}{_describe_transform(self.flip, self.transpose, self.normalize)})"


class Padding(Sample):
    """A sample repeated only so that every rank takes the same number of steps (a window
    another position of the batch or another rank already holds): drop it from results
    (``BatchInfo.padding`` names its positions)."""

    __slots__ = ()


class IndexQuery:
    """An index selection of the array at ``uri``: per axis an index list, a range (with a
    step), an integer (the axis is dropped) or ``...``, in a tuple (see
    :mod:`damacy_protocol.selection`).

    The result is the outer product of the axes (like zarr's ``oindex``): every combination,
    in the given order, duplicates kept; ``flip``, ``transpose`` and ``normalize`` as for a
    :class:`Sample`. Numbers are array coordinates as in a
    :class:`Sample` (negative ones are before the array, not counted from the end);
    positions outside the array are padded or refused per ``out_of_bounds``.
    """

    __slots__ = ("uri", "selection", "level", "flip", "transpose", "normalize", "_hash")

    uri: str
    selection: tuple[slice | int | Indices | EllipsisType, ...]
    level: int | None
    flip: tuple[int, ...]
    transpose: tuple[int, ...] | None
    normalize: tuple[float, float] | None
    _hash: int

    def __init__(
        self, uri: Any, selection: Any, *, level: int | None = None, flip: Any = (), transpose: Any = None,
        normalize: Any = None,
    ) -> None:
        uri = _uri(uri)
        entries = normalize_selection(selection, QUERY, uri)
        object.__setattr__(self, "uri", uri)
        object.__setattr__(self, "selection", entries)
        object.__setattr__(self, "level", _level(level, uri))
        flip, transpose = _transform(flip, transpose, uri)
        object.__setattr__(self, "flip", flip)
        object.__setattr__(self, "transpose", transpose)
        object.__setattr__(self, "normalize", normalize_pair(normalize, uri))
        object.__setattr__(self, "_hash", hash(("IndexQuery", uri, key(entries), self.level, flip, transpose, self.normalize)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("IndexQuery is immutable")

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, IndexQuery) and self.uri == other.uri and self.level == other.level
            and key(self.selection) == key(other.selection) and self.flip == other.flip and self.transpose == other.transpose
            and self.normalize == other.normalize
        )

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return (_rebuild, (IndexQuery, self.uri, self.selection, self.level, self.flip, self.transpose, self.normalize))

    @property
    def shape(self) -> tuple[int, ...]:
        """The selection's shape over the axes it names (dropped axes left out; axes it does
        not name are whole, and not in it); an error when it depends on the array's shape
        (then use :meth:`shape_for`)."""
        out = []
        for axis, e in enumerate(self.selection):
            if isinstance(e, int):
                continue
            if e is Ellipsis or (isinstance(e, slice) and (e.start is None or e.stop is None)):
                raise InvalidArgument(
                    f"axis {axis}: the selection's shape depends on the array's; use shape_for(shape)", uri=self.uri
                )
            out.append(len(range(e.start, e.stop, e.step or 1)) if isinstance(e, slice) else len(e))
        return tuple(out)

    def shape_for(self, array_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The selection's shape on an array of ``array_shape`` (dropped axes left out)."""
        from damacy_protocol.selection import expand

        out = []
        for e, n in zip(expand(self.selection, len(array_shape), self.uri), array_shape):
            if isinstance(e, slice):
                start = 0 if e.start is None else e.start
                stop = n if e.stop is None else e.stop
                out.append(len(range(start, max(start, stop), e.step or 1)))
            elif not isinstance(e, int):
                out.append(len(e))
        return tuple(out)

    def __repr__(self) -> str:
        level = "" if self.level is None else f", level={self.level}"
        return f"IndexQuery({redact_uri(self.uri)!r}, {describe(self.selection)}{level}{_describe_transform(self.flip, self.transpose, self.normalize)})"


#: how an error names a pushed item that is no sample (its reason says what it was)
PUSHED_ITEM = "a pushed item"


def describe_item(item: Any) -> str:
    """A pushed item that is no sample, as an error message names it."""
    text = repr(item)
    return f"{type(item).__name__} {text if len(text) <= 60 else text[:57] + '...'}"
