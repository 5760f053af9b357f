"""Spatial queries: a fixed output grid mapped into an NGFF image's reference level, and
the resolution of one against the image's levels into source geometry.

The value types (:class:`Sampler`, :class:`SpatialQuery`, :class:`NgffAxis`,
:class:`NgffLevel`) and the math live here, below the engine, because they are pure: a
query resolves from the description the server loaded (:func:`resolve`), with no I/O and
no shared state, so any thread may resolve and the result
(:class:`~damacy_protocol.samples.ResolvedSpatialQuery`) travels as plain values.

Three decisions (docs: the seed's spatial guide):

- Coordinates are voxel corners throughout; a level maps into the reference by the
  per-axis ``reference = R_l * level + origin_l`` (:func:`level_map`), with values a
  rounding error from a multiple of 1/256 snapped to it, so that a crop built from the
  level's own values resolves exactly.
- Whether a result can be copied without resampling is decided exactly, never by rounding
  a query into a crop: the resolved linear map must be the identity as floats, and the
  offsets and bounds are computed with :class:`~fractions.Fraction` from those floats.
- Failures here are the native resolver's (:class:`InvalidArgument`): a singular or
  non-separable transform, a level the image lacks, and ``boundary="error"`` when a
  contributing index lies outside the level. Construction checks (types, ranges) raise
  the built-in ``TypeError``/``ValueError``, as the seed's wrapper does.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

from damacy_protocol.errors import InvalidArgument
from damacy_protocol.limits import MAX_RANK
from damacy_protocol.samples import ResolvedSpatialQuery

#: the numerical slack of every test on transforms and level values (64 * DBL_EPSILON)
TOLERANCE = 64 * sys.float_info.epsilon
#: the largest extent or coordinate, in index units: half-voxel centres stay exact doubles
MAX_COORDINATE = (1 << 52) - 1
#: level values this close to a multiple of 1/SNAP (within TOLERANCE, relatively) snap to it
SNAP = 256
INT31_MAX = (1 << 31) - 1

Matrix = tuple[tuple[float, ...], ...]


def check_index(value: Any, name: str) -> int:
    """``value`` as an index in ``[0, 2**31 - 1]`` (a bool is refused, unlike elsewhere)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer")
    result = operator.index(value)
    if not 0 <= result <= INT31_MAX:
        raise ValueError(f"{name} must be between 0 and 2**31 - 1")
    return result


def _finite(value: Any) -> float:
    if isinstance(value, (str, bytes, bool)):
        raise TypeError("transform and sampler values must be numbers")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError("transform and sampler values must be finite")
    return result


@dataclass(frozen=True, slots=True)
class NgffAxis:
    """An axis in the array's dimension order, with its declared NGFF unit."""

    name: str
    kind: Literal["space", "time", "channel"]
    unit: str | None


@dataclass(frozen=True, slots=True)
class NgffLevel:
    """A level's array (``uri``, usable as a sample's) and its voxel-corner map into
    reference indices: ``reference = scale_to_reference * index + origin_reference_index``."""

    uri: str
    shape: tuple[int, ...]
    scale_to_reference: tuple[float, ...]
    origin_reference_index: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Sampler:
    """How source values are sampled at a corner coordinate ``s``.

    ``filter``: ``"nearest"`` takes ``floor(s)`` (a tie on a voxel boundary takes the larger
    index); ``"linear"`` interpolates between the centres ``floor(s - 0.5)`` and
    ``ceil(s - 0.5)`` per spatial axis. ``boundary``: ``"error"`` refuses a query needing
    indices outside the level, ``"constant"`` extends it with ``constant_value``,
    ``"clamp"`` repeats its edge. No antialias filter is applied.
    """

    filter: Literal["nearest", "linear"] = "linear"
    boundary: Literal["error", "constant", "clamp"] = "error"
    constant_value: float = 0

    def __post_init__(self) -> None:
        if self.filter not in ("nearest", "linear"):
            raise ValueError("filter must be 'nearest' or 'linear'")
        if self.boundary not in ("error", "constant", "clamp"):
            raise ValueError("boundary must be 'error', 'constant', or 'clamp'")
        value = _finite(self.constant_value)
        if self.boundary != "constant" and value != 0:
            raise ValueError("constant_value requires boundary='constant'")
        object.__setattr__(self, "constant_value", value)


@dataclass(frozen=True, slots=True, init=False)
class SpatialQuery:
    """A fixed output grid mapped into reference-level (``levels[0]``) voxel corners.

    ``output_to_reference``: rank rows of rank + 1 numbers, ``reference = linear * output +
    offset`` with the offset in the last column; rows and columns follow the array's axes,
    time and channel included (those allow only the identity and an integral offset).
    ``level="auto"`` takes the coarsest level no coarser than the output spacing in any
    spatial direction (level 0 when none is); an index forces that level.
    """

    output_to_reference: Matrix
    sampler: Sampler
    level: int | Literal["auto"]

    def __init__(
        self,
        *,
        output_to_reference: Iterable[Iterable[float]],
        sampler: Sampler,
        level: int | Literal["auto"] = "auto",
    ) -> None:
        if not isinstance(sampler, Sampler):
            raise TypeError("sampler must be a Sampler")
        matrix = tuple(tuple(_finite(v) for v in row) for row in output_to_reference)
        rank = len(matrix)
        if not 2 <= rank <= MAX_RANK or any(len(row) != rank + 1 for row in matrix):
            raise ValueError("output_to_reference must have rank rows and rank + 1 columns")
        if isinstance(level, str):
            if level != "auto":
                raise ValueError("level must be 'auto' or a nonnegative integer")
        else:
            level = check_index(level, "level")
        object.__setattr__(self, "output_to_reference", matrix)
        object.__setattr__(self, "sampler", sampler)
        object.__setattr__(self, "level", level)


# -- the NGFF adapter ---------------------------------------------------------------------


def _snap(value: float, tolerance: float) -> float:
    """``value``, or the nearest multiple of 1/SNAP when it is within ``tolerance`` of it."""
    scaled = value * SNAP
    if not math.isfinite(scaled):
        return value
    near = round(scaled) / SNAP
    return near + 0.0 if abs(value - near) <= tolerance else value  # + 0.0: no negative zero


def level_map(
    scale: Sequence[float], translation: Sequence[float], scale0: Sequence[float], translation0: Sequence[float]
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(``R_l``, ``origin_l``) of a level whose NGFF centre map is ``scale * i + translation``,
    given level 0's: ``R_l = S_l / S_0`` and ``origin_l = (T_l - T_0) / S_0 + (1 - R_l) / 2``,
    each snapped to a multiple of 1/256 when a rounding error from one (the writer's floats:
    scales 0.1 and 0.3 give 2.9999999999999996). Level 0 maps exactly as the identity."""
    ratios, origins = [], []
    for s, t, s0, t0 in zip(scale, translation, scale0, translation0, strict=True):
        ratio = s / s0
        origin = (t - t0) / s0 + (1 - ratio) / 2
        ratios.append(_snap(ratio, TOLERANCE * ratio))
        origins.append(_snap(origin, TOLERANCE * ((abs(t) + abs(t0)) / s0 + ratio)))
    return tuple(ratios), tuple(origins)


# -- resolution ---------------------------------------------------------------------------


def resolve(
    query: SpatialQuery, *, axes: Sequence[NgffAxis], levels: Sequence[NgffLevel], shape: Sequence[int]
) -> ResolvedSpatialQuery:
    """``query`` for an output grid of ``shape`` resolved against an image of ``axes`` and
    ``levels``: the level chosen, the map from output corners to its corners
    (``inverse(R_l) * A`` and ``inverse(R_l) * (b - origin_l)``), the contributing source
    box before and after boundary handling, and whether a plain copy can produce it.

    :class:`InvalidArgument` for a rank or shape that does not fit, a time/channel axis
    that is not an in-bounds identity, a (numerically) singular spatial map, coordinates
    past 2**52 - 1, a level the image lacks, or contributions outside the level with
    ``boundary="error"``."""
    rank, shape = len(axes), tuple(shape)
    matrix = query.output_to_reference
    if len(matrix) != rank or len(shape) != rank:
        raise InvalidArgument(f"the query has rank {len(matrix)} and the output {len(shape)}, the image {rank}")
    if not all(1 <= n <= MAX_COORDINATE for n in shape):
        raise InvalidArgument(f"output shape {shape}: extents must be in [1, 2**52 - 1]")
    linear = [row[:rank] for row in matrix]
    offset = [row[rank] for row in matrix]
    spatial = [k for k, a in enumerate(axes) if a.kind == "space"]
    _check_fixed_axes(linear, offset, axes, levels[0].shape, shape)
    _check_nonsingular([[linear[i][j] for j in spatial] for i in spatial])
    _check_coordinates(linear, offset, shape, "reference")

    if query.level == "auto":
        chosen = choose_level(linear, levels, spatial)
    elif query.level < len(levels):
        chosen = query.level
    else:
        raise InvalidArgument(f"level {query.level} asked, the image has {len(levels)} levels (0 to {len(levels) - 1})")
    level = levels[chosen]
    ratio, origin = level.scale_to_reference, level.origin_reference_index
    # divisions, not products with 1/R: a crop built as R * beg + origin comes back exact
    to_source = [[v / ratio[i] for v in row] for i, row in enumerate(linear)]
    source_offset = [(offset[i] - origin[i]) / ratio[i] for i in range(rank)]
    _check_coordinates(to_source, source_offset, shape, "source")

    bounds = _source_bounds(to_source, source_offset, shape, query.sampler.filter)
    read = _read_bounds(bounds, level.shape, query.sampler.boundary, axes)
    aligned = (
        all(to_source[i][j] == (1.0 if i == j else 0.0) for i in range(rank) for j in range(rank))
        and all(v.is_integer() for v in source_offset)
        and all(0 <= lo and hi <= n for (lo, hi), n in zip(bounds, level.shape))
    )
    return ResolvedSpatialQuery._restore(
        {
            "uri": level.uri,
            "level": chosen,
            "shape": shape,
            "source_shape": tuple(level.shape),
            "output_to_source": tuple(tuple(row) + (source_offset[i],) for i, row in enumerate(to_source)),
            "sampler": query.sampler,
            "source_bounds_index": bounds,
            "read_bounds_index": read,
            "requires_resampling": not aligned,
        }
    )


def choose_level(linear: Sequence[Sequence[float]], levels: Sequence[NgffLevel], spatial: Sequence[int]) -> int:
    """The coarsest level whose spacing is no coarser than the output's in any spatial
    direction: the smallest singular value of ``inverse(R_l) * A`` over the spatial axes is
    at least one (within TOLERANCE); level 0 (upsampling) when none is."""
    import numpy as np  # only here: the rest of the protocol does without it

    for index in range(len(levels) - 1, 0, -1):
        ratio = levels[index].scale_to_reference
        part = np.array([[linear[i][j] / ratio[i] for j in spatial] for i in spatial], dtype=np.float64)
        if np.linalg.svd(part, compute_uv=False)[-1] >= 1 - TOLERANCE:
            return index
    return 0


def _check_fixed_axes(
    linear: list[tuple[float, ...]],
    offset: list[float],
    axes: Sequence[NgffAxis],
    extent: Sequence[int],
    shape: tuple[int, ...],
) -> None:
    """Time and channel axes pass through: a unit row and column, an integral offset, and the
    selected range inside the array (every level has the reference's extent there)."""
    rank = len(axes)
    for k, axis in enumerate(axes):
        if axis.kind == "space":
            continue
        unit = all(linear[k][j] == linear[j][k] == (1.0 if j == k else 0.0) for j in range(rank))
        if not unit or not offset[k].is_integer():
            raise InvalidArgument(
                f"output_to_reference: the {axis.kind} axis {axis.name!r} must map as the identity "
                "(a unit row and column) with an integral offset"
            )
        if not 0 <= offset[k] <= extent[k] - shape[k]:
            begin = int(offset[k])
            raise InvalidArgument(
                f"the {axis.kind} axis {axis.name!r} selects [{begin}, {begin + shape[k]}), outside its extent {extent[k]}"
            )


def _check_nonsingular(rows: list[list[float]]) -> None:
    """Gaussian elimination on the rows normalised by their largest coefficient, pivoting on
    the largest remaining entry: a pivot no larger than TOLERANCE is singular."""
    singular = InvalidArgument("output_to_reference: its spatial linear map is singular (a pivot at most 64 * DBL_EPSILON)")
    work = []
    for row in rows:
        largest = max(abs(v) for v in row)
        if largest == 0:
            raise singular
        work.append([v / largest for v in row])
    n = len(work)
    for col in range(n):
        best = max(range(col, n), key=lambda r: abs(work[r][col]))
        if abs(work[best][col]) <= TOLERANCE:
            raise singular
        work[col], work[best] = work[best], work[col]
        for r in range(col + 1, n):
            factor = work[r][col] / work[col][col]
            work[r] = [a - factor * p for a, p in zip(work[r], work[col])]


def _extremes(
    linear: Sequence[Sequence[float]], offset: Sequence[float], shape: Sequence[int], inset: Fraction
) -> list[tuple[Fraction, Fraction]]:
    """Per row, the exact least and greatest of ``linear * p + offset`` over the points ``p``
    with each coordinate ``inset`` or ``n - inset`` (an affine map's extremes over a box)."""
    out = []
    for row, b in zip(linear, offset):
        lo = hi = Fraction(b)
        for a, n in zip(row, shape):
            ends = (Fraction(a) * inset, Fraction(a) * (n - inset))
            lo, hi = lo + min(ends), hi + max(ends)
        out.append((lo, hi))
    return out


def _check_coordinates(
    linear: Sequence[Sequence[float]], offset: Sequence[float], shape: Sequence[int], frame: str
) -> None:
    for lo, hi in _extremes(linear, offset, shape, Fraction(0)):
        if max(-lo, hi) > MAX_COORDINATE:
            raise InvalidArgument(f"the output grid maps to {frame} coordinates beyond 2**52 - 1 index units")


def _source_bounds(
    linear: Sequence[Sequence[float]], offset: Sequence[float], shape: Sequence[int], filter: str
) -> tuple[tuple[int, int], ...]:
    """The half-open box of source indices the filter reads at the output centres, before
    boundary handling; a linear neighbour of zero weight is left out."""
    out = []
    for lo, hi in _extremes(linear, offset, shape, Fraction(1, 2)):
        if filter == "nearest":
            out.append((math.floor(lo), math.floor(hi) + 1))
        else:
            out.append((math.floor(lo - Fraction(1, 2)), math.ceil(hi - Fraction(1, 2)) + 1))
    return tuple(out)


def _read_bounds(
    bounds: tuple[tuple[int, int], ...], extent: Sequence[int], boundary: str, axes: Sequence[NgffAxis]
) -> tuple[tuple[int, int], ...]:
    """The box actually read once the boundary rule has been applied to ``bounds``."""
    out = []
    for (lo, hi), n, axis in zip(bounds, extent, axes):
        if 0 <= lo and hi <= n:
            out.append((lo, hi))
        elif boundary == "error":
            raise InvalidArgument(
                f"boundary='error': source indices [{lo}, {hi}) along axis {axis.name!r} reach outside the "
                f"level's extent {n} (boundary='constant' or 'clamp' extends it)"
            )
        elif boundary == "constant" or n == 0:  # an empty axis has no edge to repeat
            start = min(max(lo, 0), n)
            out.append((start, max(min(hi, n), start)))
        else:  # clamp: every index outside lands on the nearest edge voxel
            out.append((min(max(lo, 0), n - 1), min(max(hi - 1, 0), n - 1) + 1))
    return tuple(out)
