"""What a batch is asked for, one family with one frozen base: a box of an array
(:class:`Sample`), an index selection (:class:`IndexQuery`), a sample repeated only to even
out ranks (:class:`Padding`) and a spatial query resolved against an NGFF image
(:class:`ResolvedSpatialQuery`).

Every member is immutable, hashable, compares by value and holds only plain Python values,
so it travels to the daemon and to other processes as it is. What can be checked without
the array is checked where it is made (its form, with the seed API's messages) or where it
is pushed (its geometry against the batch: :func:`check_pushed`); the rest when its array's
metadata arrives.

(Over 400 lines: one job, the family of what a batch is asked for; its members share the
base, the per-sample options and the checks at push.)
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import EllipsisType
from typing import Any, ClassVar

from damacy_protocol.errors import BudgetExceeded, InvalidArgument, UnsupportedOperation, redact_uri
from damacy_protocol.limits import INT63_MAX, MAX_RANK, UINT32_MAX
from damacy_protocol.selection import Indices, describe, key

#: how an error names a pushed item that is no sample (its reason says what it was)
PUSHED_ITEM = "a pushed item"


def describe_item(item: Any) -> str:
    """A pushed item that is no sample, as an error message names it."""
    text = repr(item)
    return f"{type(item).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


@dataclass(frozen=True, slots=True, init=False, eq=False, repr=False)
class Query:
    """The frozen base of the family (frozen dataclasses): compared and hashed by
    :meth:`_key` (equivalent spellings of one selection are equal), pickled by
    :attr:`_fields` (each a keyword of the constructor)."""

    _fields: ClassVar[tuple[str, ...]] = ()

    def _key(self) -> tuple:
        return tuple(getattr(self, f) for f in self._fields)

    @classmethod
    def _family(cls) -> type:
        """The class members compare equal across (a Padding equals its Sample)."""
        return cls

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Query) or other._family() is not self._family():
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash((self._family(), self._key()))

    def __reduce__(self):
        return (_rebuild, (type(self), {f: getattr(self, f) for f in self._fields}))


def _rebuild(cls: type, values: dict[str, Any]) -> Any:
    return cls._restore(values) if hasattr(cls, "_restore") else cls(**values)


# -- helpers shared by the members ------------------------------------------------------


def _uri(uri: Any) -> str:
    if not isinstance(uri, (str, os.PathLike)) or not os.fspath(uri):
        raise InvalidArgument(f"a sample's uri must be a non-empty string or path, got {uri!r}")
    return os.fspath(uri)


def _level(level: Any, uri: str) -> int | None:
    """An NGFF image's level (None: the uri's own array, level 0 for an image)."""
    if level is None:
        return None
    if not isinstance(level, int) or isinstance(level, bool) or level < 0:
        raise InvalidArgument(f"level must be a non-negative integer (an NGFF image's level), got {level!r}", uri=uri)
    return level


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


def _is_axis(a: Any) -> bool:
    """An integer (Python's or numpy's), not a bool nor a float."""
    return hasattr(a, "__index__") and not isinstance(a, bool) and type(a).__name__ != "bool_" and not hasattr(a, "__len__")


def _transform(flip: Any, transpose: Any, uri: str) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """A sample's transform, checked as far as it can be without the array: ``flip``, the
    axes reversed (of the selection's result, dropped axes left out); ``transpose``, the
    result's axes in a new order (``np.transpose``'s ``axes``), applied after the flips."""
    if transpose is None and (flip is None or (type(flip) in (tuple, list) and not flip)):
        return (), None  # (most samples: no transform)
    given = () if flip is None else (flip,) if _is_axis(flip) else flip
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


def _describe_transform(q: Any) -> str:
    level = "" if q.level is None else f", level={q.level}"
    return (
        level
        + (f", flip={q.flip}" if q.flip else "")
        + (f", transpose={q.transpose}" if q.transpose is not None else "")
        + (f", normalize={q.normalize}" if q.normalize is not None else "")
    )


@dataclass(frozen=True, slots=True, init=False, eq=False, repr=False)
class _Selected(Query):
    """A selection of the array at ``uri`` with damacy's per-sample options: ``level`` (an
    NGFF image's), ``flip``, ``transpose`` and ``normalize``."""

    uri: str
    level: int | None
    flip: tuple[int, ...]
    transpose: tuple[int, ...] | None
    normalize: tuple[float, float] | None

    def _options(self, uri: Any, level: Any, flip: Any, transpose: Any, normalize: Any) -> str:
        uri = _uri(uri)
        set_ = object.__setattr__
        set_(self, "uri", uri)
        set_(self, "level", _level(level, uri))
        flips, order = _transform(flip, transpose, uri)
        set_(self, "flip", flips)
        set_(self, "transpose", order)
        set_(self, "normalize", normalize_pair(normalize, uri))
        return uri

    def result_shape(self) -> tuple[int, ...] | None:
        """The shape the sample takes in a batch (after ``transpose``), or None while it
        depends on the array."""
        shape = self.shape  # type: ignore[attr-defined]  # (each member's)
        if shape is None or self.transpose is None or len(self.transpose) != len(shape):
            return shape
        return tuple(shape[a] for a in self.transpose)

    def _key(self) -> tuple:
        return (self.uri, key(self.selection), self.level, self.flip, self.transpose, self.normalize)  # type: ignore[attr-defined]


# -- Sample --------------------------------------------------------------------------------


def _aabb_axis(x: Any, axis: int) -> slice:
    """One axis of an aabb as the seed API writes it: a 2-tuple ``(start, stop)`` or a
    slice with a stop (step 1 or none; an open start is 0)."""
    if isinstance(x, slice):
        _check_step(x.step, axis)
        if x.stop is None:
            raise ValueError(f"aabb axis {axis}: slice stop is required (got {x!r})")
        return slice(0 if x.start is None else int(x.start), int(x.stop))
    if isinstance(x, tuple) and len(x) == 2:
        return slice(int(x[0]), int(x[1]))
    raise TypeError(f"aabb axis {axis}: expected slice or (start, stop) tuple; got {type(x).__name__}")


def _check_step(step: Any, axis: int) -> None:
    if step not in (None, 1):
        raise ValueError(f"aabb axis {axis}: slice step must be 1 or omitted (got step={step})")


def _selection_axis(x: Any, axis: int) -> slice | int | EllipsisType:
    """One entry of a numpy-style selection (``np.s_[...]``): a slice (an open bound is the
    array's), a ``(start, stop)`` pair, an integer (that position; the axis is dropped) or
    ``...`` (the axes not named)."""
    if x is Ellipsis:
        return x
    if isinstance(x, slice):
        if x.step is None and type(x.start) is int and (x.stop is None or type(x.stop) is int):
            return x  # already in the normal form (a slice is immutable: it is its own copy)
        _check_step(x.step, axis)
        start = 0 if x.start is None else _integer(x.start, axis)
        return slice(start, None if x.stop is None else _integer(x.stop, axis))
    if isinstance(x, tuple) and len(x) == 2:
        return slice(int(x[0]), int(x[1]))
    if _is_axis(x):
        return operator.index(x)
    raise TypeError(f"aabb axis {axis}: expected slice or (start, stop) tuple; got {type(x).__name__}")


def _integer(value: Any, axis: int) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"aabb axis {axis}: slice bounds must be integers, got {value!r}")
    return operator.index(value)


@dataclass(frozen=True, slots=True, init=False, eq=False, repr=False)
class Sample(_Selected):
    """A box of the array at ``uri``.

    ``aabb`` as the seed API writes it: per axis of the array, in its stored order, a
    ``(start, stop)`` pair or a slice (half-open, step 1, a stop required). In a tuple
    (``np.s_[...]``), damacy also takes an integer (that position; the axis is dropped),
    ``...`` (the axes not named; fewer entries select the rest whole) and open bounds (the
    array's own): see docs/seed.md. Equivalent spellings compare and hash equal:

    >>> a = Sample("cell.zarr", [(0, 64), (0, 256)])
    >>> a == Sample("cell.zarr", [slice(None, 64), slice(0, 256)]), a.aabb
    (True, ((0, 64), (0, 256)))
    >>> Sample("cell.zarr", [64, 256])
    Traceback (most recent call last):
        ...
    TypeError: aabb axis 0: expected slice or (start, stop) tuple; got int

    Coordinates are array coordinates: a box may reach outside the array (negative starts,
    stops past the end), which ``out_of_bounds="error"`` refuses and ``"pad"`` fills with
    the array's fill value; never clipped or wrapped.

    ``level``: for an OME-NGFF image uri, the level to read (the box is in its index space;
    none: level 0). ``flip`` (axes to reverse) and ``transpose`` (a new order of the axes)
    transform the result as ``np.transpose(np.flip(box, flip), transpose)``;
    ``normalize=(offset, scale)`` makes the values ``(x - offset) * scale`` in the cast.
    """

    _fields: ClassVar[tuple[str, ...]] = ("uri", "selection", "level", "flip", "transpose", "normalize")

    selection: tuple[slice | int | EllipsisType, ...]

    def __init__(
        self,
        uri: Any,
        aabb: Any = None,
        *,
        selection: Any = None,
        level: int | None = None,
        flip: Any = (),
        transpose: Any = None,
        normalize: Any = None,
    ) -> None:
        if aabb is not None and selection is not None:
            raise TypeError("a Sample takes its box as aabb or selection, not both")
        box = aabb if selection is None else selection
        if box is None:
            raise TypeError("a Sample needs its box: aabb=[(start, stop), ...] or a selection np.s_[...]")
        uri = self._options(uri, level, flip, transpose, normalize)
        if isinstance(box, tuple) or not isinstance(box, Iterable) or isinstance(box, (str, bytes)):
            entries = box if isinstance(box, tuple) else (box,)
            if sum(1 for e in entries if e is Ellipsis) > 1:
                raise InvalidArgument("a selection may hold one '...' only", uri=uri)
            parts = tuple(_selection_axis(x, i) for i, x in enumerate(entries))
        else:
            parts = tuple(_aabb_axis(x, i) for i, x in enumerate(box))
        object.__setattr__(self, "selection", parts)

    @classmethod
    def _family(cls) -> type:
        return Sample

    @property
    def aabb(self) -> tuple[tuple[int, int | None] | EllipsisType, ...]:
        """The box per named axis as ``(start, stop)`` (an integer ``i`` as ``(i, i + 1)``;
        a stop ``None``: the array's bound; ``...`` as given)."""
        return tuple(
            e if e is Ellipsis else (e.start, e.stop) if isinstance(e, slice) else (e, e + 1) for e in self.selection
        )

    @property
    def shape(self) -> tuple[int, ...] | None:
        """The box's shape over the axes it names (dropped axes left out), or ``None`` while
        it depends on the array (an open bound or ``...``)."""
        out = []
        for e in self.selection:
            if e is Ellipsis or (isinstance(e, slice) and e.stop is None):
                return None
            if isinstance(e, slice):
                out.append(e.stop - e.start)
        return tuple(out)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact_uri(self.uri)!r}, {describe(self.selection)}{_describe_transform(self)})"


@dataclass(frozen=True, slots=True, init=False, eq=False, repr=False)
class Padding(Sample):
    """A sample repeated only so that every rank takes the same number of steps (a window
    another position of the batch or another rank already holds): drop it from results
    (``BatchInfo.padding`` names its positions)."""


# -- IndexQuery ----------------------------------------------------------------------------


def _index_values(item: Any, axis: int) -> tuple[int, ...]:
    if type(item).__name__ == "ndarray":
        if item.ndim != 1 or item.dtype.kind not in "iu":
            raise TypeError(f"selection axis {axis}: an index array holds integers, got a {item.dtype} array of shape {item.shape}")
        values = tuple(item.tolist())
    else:
        if not isinstance(item, Iterable) or isinstance(item, (str, bytes)):
            raise TypeError(f"selection axis {axis}: expected a slice or an iterable of indices, got {type(item).__name__}")
        values = tuple(operator.index(v) for v in item)
    if not values:
        raise ValueError(f"selection axis {axis}: index array is empty")
    if len(values) > UINT32_MAX:
        raise ValueError(f"selection axis {axis}: too many indices")
    if min(values) < 0 or max(values) >= INT63_MAX:
        raise ValueError(f"selection axis {axis}: indices must be nonnegative int64 values")
    return values


@dataclass(frozen=True, slots=True, init=False, eq=False, repr=False)
class IndexQuery(_Selected):
    """Per axis of the array an index array or a contiguous slice; the result is every
    combination (``np.ix_``), in the given order, duplicates kept; a singleton array keeps
    its axis.

    Any iterable other than a slice is an index array (a list, a tuple such as ``(7, 2)``,
    a ``range``, a numpy array): nonnegative integers. A slice has a stop and a step of
    one. Positions past the array's end are refused when its metadata arrives (or padded:
    ``out_of_bounds="pad"``). ``level``, ``flip``, ``transpose``, ``normalize`` as for a
    :class:`Sample`.

    >>> q = IndexQuery("cell.zarr", selection=([7, 2, 7], slice(4, 8)))
    >>> q.shape, q.indices, q.aabb
    ((3, 4), ((7, 2, 7), None), ((2, 8), (4, 8)))
    """

    _fields: ClassVar[tuple[str, ...]] = ("uri", "selection", "level", "flip", "transpose", "normalize")

    selection: tuple[slice | Indices, ...]
    aabb: tuple[tuple[int, int], ...] = field(init=False)
    indices: tuple[tuple[int, ...] | None, ...] = field(init=False)

    def __init__(
        self,
        uri: Any,
        selection: Iterable[slice | Iterable[int]],
        *,
        level: int | None = None,
        flip: Any = (),
        transpose: Any = None,
        normalize: Any = None,
    ) -> None:
        bounds: list[tuple[int, int]] = []
        indices: list[tuple[int, ...] | None] = []
        entries: list[slice | Indices] = []
        if isinstance(selection, slice) or not isinstance(selection, Iterable):
            raise TypeError(f"selection must be a sequence with one slice or index array per axis, got {type(selection).__name__}")
        for axis, item in enumerate(selection):
            if axis >= MAX_RANK:
                raise ValueError(f"selection rank must not exceed {MAX_RANK}")
            if isinstance(item, slice):
                if item.step is not None and operator.index(item.step) != 1:
                    raise ValueError(f"selection axis {axis}: slice step must be one")
                if item.stop is None:
                    raise ValueError(f"selection axis {axis}: slice stop is required")
                start = 0 if item.start is None else operator.index(item.start)
                stop = operator.index(item.stop)
                if not 0 <= start < stop <= INT63_MAX:
                    raise ValueError(f"selection axis {axis}: invalid slice bounds")
                bounds.append((start, stop))
                indices.append(None)
                entries.append(slice(start, stop))
            else:
                values = _index_values(item, axis)
                bounds.append((min(values), max(values) + 1))
                indices.append(values)
                entries.append(Indices(values))
        if not bounds:
            raise ValueError("selection must have at least one axis")
        self._options(uri, level, flip, transpose, normalize)
        set_ = object.__setattr__
        set_(self, "aabb", tuple(bounds))
        set_(self, "indices", tuple(indices))
        set_(self, "selection", tuple(entries))

    @property
    def shape(self) -> tuple[int, ...]:
        """The result's shape: per axis the index array's length or the slice's extent."""
        return tuple(
            len(ix) if ix is not None else stop - start for (start, stop), ix in zip(self.aabb, self.indices, strict=True)
        )

    def __repr__(self) -> str:
        return f"IndexQuery({redact_uri(self.uri)!r}, {describe(self.selection)}{_describe_transform(self)})"


# -- ResolvedSpatialQuery ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, init=False, eq=False, repr=False)
class ResolvedSpatialQuery(Query):
    """A spatial query resolved against an NGFF image (``NgffImage.resolve``): the source
    level and its array (``uri``, ``level``, ``source_shape``), the output grid (``shape``),
    the map from output voxel corners to source ones (``output_to_source``, rank rows of rank
    + 1, the last column the offset), the ``sampler``, the box of source indices that
    contribute before boundary handling (``source_bounds_index``) and after it
    (``read_bounds_index``), and whether producing it needs resampling
    (``requires_resampling``).

    An aligned one (no resampling) is pushed as the box ``source_bounds_index`` of its
    level; one that needs resampling is refused at push with :class:`UnsupportedOperation`
    (its geometry stays readable). Made only by ``NgffImage.resolve``; immutable and
    picklable.
    """

    _fields: ClassVar[tuple[str, ...]] = (
        "uri", "level", "shape", "source_shape", "output_to_source", "sampler", "source_bounds_index",
        "read_bounds_index", "requires_resampling",
    )

    uri: str
    level: int
    shape: tuple[int, ...]
    source_shape: tuple[int, ...]
    output_to_source: tuple[tuple[float, ...], ...]
    sampler: Any
    source_bounds_index: tuple[tuple[int, int], ...]
    read_bounds_index: tuple[tuple[int, int], ...]
    requires_resampling: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("use NgffImage.resolve() to create a ResolvedSpatialQuery")

    @classmethod
    def _restore(cls, values: dict[str, Any]) -> ResolvedSpatialQuery:
        """The query of these field values (the resolver's, and unpickling's way in)."""
        out = object.__new__(cls)
        for name in cls._fields:
            object.__setattr__(out, name, values[name])
        return out

    def _as_sample(self) -> Sample:
        """The box of its level this query copies (an aligned one), as a :class:`Sample`;
        :class:`UnsupportedOperation` when it needs resampling."""
        if self.requires_resampling:
            what = "submit spatial query: resampling required"
            raise UnsupportedOperation(what, what=what)
        return Sample(self.uri, tuple(slice(a, b) for a, b in self.source_bounds_index))

    def __repr__(self) -> str:
        kind = "resampling" if self.requires_resampling else "aligned"
        return (
            f"ResolvedSpatialQuery({redact_uri(self.uri)!r}, level={self.level}, shape={self.shape}, "
            f"source_bounds_index={self.source_bounds_index}, {kind})"
        )


# -- what push checks -----------------------------------------------------------------------


def check_pushed(item: Any, shape: tuple[int, ...], pad: bool, no_index_queries: str | None = None) -> Any:
    """The sample a pushed ``item`` is, checked as far as it can be without its array:
    refused (:class:`InvalidArgument`) when it is no sample, when a box is empty or reversed
    (or reaches before the array, unless ``pad``), or when its shape is known and is not the
    batch's ``shape``; a :class:`ResolvedSpatialQuery` becomes the box it copies
    (:class:`UnsupportedOperation` when it needs resampling). ``no_index_queries``: the
    setting that gives the pipeline no index storage (``max_index_bytes=0``, as spelled
    there), which refuses an :class:`IndexQuery` (BudgetExceeded)."""
    if no_index_queries is not None and isinstance(item, IndexQuery):
        raise BudgetExceeded(f"index queries need index storage: this GPU pipeline has {no_index_queries}", sample=item)
    if isinstance(item, ResolvedSpatialQuery):
        if tuple(item.shape) != tuple(shape):
            raise InvalidArgument(
                f"the spatial query's output shape {tuple(item.shape)} is not the batch's sample shape {tuple(shape)}",
                sample=item,
            )
        return item._as_sample()
    if isinstance(item, Sample):
        for axis, e in enumerate(item.selection):
            if isinstance(e, slice) and e.stop is not None:
                if e.stop <= e.start:
                    raise InvalidArgument(f"axis {axis}: the box [{e.start}, {e.stop}) is empty or reversed", sample=item)
                if e.start < 0 and not pad:
                    raise InvalidArgument(
                        f"axis {axis}: the box starts at {e.start}, before the array (out_of_bounds='pad' pads it)", sample=item
                    )
            elif isinstance(e, int) and e < 0 and not pad:
                raise InvalidArgument(f"axis {axis}: position {e} is before the array (out_of_bounds='pad' pads it)", sample=item)
    elif not isinstance(item, IndexQuery):
        raise InvalidArgument(
            f"push takes Sample, IndexQuery and ResolvedSpatialQuery items, got {describe_item(item)}", sample=PUSHED_ITEM
        )
    got = item.result_shape()
    if got is not None and tuple(got) != tuple(shape):
        raise InvalidArgument(
            f"its shape {tuple(got)} is not the batch's sample shape {tuple(shape)} (an integer selects a point and "
            "drops its axis: np.s_[3, 0:7, 10:18] is a 2-d sample of a volume)",
            sample=item,
        )
    return item
