"""The plan stage: the samples of a batch → byte ranges to read, units to decode, copies.

For one batch the planner finds every read unit the samples touch (a unit shared by several
samples is read and decoded once), looks up where each one's bytes are (shard indexes, read
once and cached), merges nearby byte ranges of one object into one read, and lists for each
unit the copies (unit region → sample region) that assemble the batch. The plan is what an
executor consumes (the CPU executor today; a GPU executor takes the same plan).

Units found in the chunk cache are taken from there before they are located (they need no
shard index and no read). Grouping the units into reads (merging, the budget) is in
:mod:`damacy_server.plan.reads`.

(Over 400 lines: one job, one batch's plan; resolving selections into per-array rows, locating
units and building the copy tables are its steps, each used only here.)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from damacy_protocol.enums import BoundsPolicy
from damacy_protocol.errors import BudgetExceeded, DamacyError, InvalidArgument, RankMismatch
from damacy_protocol.limits import PlanLimits
from damacy_protocol.samples import PUSHED_ITEM, IndexQuery, Sample, describe_item
from damacy_server import native
from damacy_server.cache import LRUCache
from damacy_server.claim import Claim
from damacy_server.decode import contract
from damacy_server.plan.reads import Caps, ReadGroup, fit_reads, merge_reads
from damacy_server.plan.resolve import Resolver, UnitLocations, ZarrMetadata
from damacy_server.plan.selection import AxisRange, AxisSelection, axis_parts, resolve, selection_shape
from damacy_server.plan.units import CachedUnits, CopyTable, UnitJob, unit_keys
from damacy_server.zarr.metadata import ArrayMetadata


@dataclass(eq=False)
class BatchPlan:
    samples: list[Any]
    shapes: list[tuple[int, ...] | None]  # per sample: its selection's shape (view of its slot)
    # per sample its flip and transpose (None: none), see :func:`sample_view`
    transforms: list[tuple[tuple[int, ...], tuple[int, ...] | None] | None]
    fills: list[tuple[int, Any]]  # (sample, fill value) to write before the copies
    groups: list[ReadGroup]
    errors: dict[int, DamacyError]
    metas: list[ArrayMetadata | None]
    units_total: int = 0  # unit references over all samples
    units_unique: int = 0
    reads_merged: int = 0  # ranges saved by merging
    seconds: float = 0.0
    # per plan table the units found in the executor's chunk cache, with their decoded
    # arrays (not in groups)
    cached: list[CachedUnits] = field(default_factory=list)
    # per sample its normalisation (offset, scale), fused into the cast (None: none)
    norms: list[tuple[float, float] | None] = field(default_factory=list)

    def norm(self, i: int) -> tuple[float, float] | None:
        return self.norms[i] if self.norms else None


class _ArrayRows:
    """The copies of one array's samples while a batch is planned: per sample a block of rows
    (sample, unit coordinates, source starts, destination starts, extents), and the pool of
    index lists they point to. Boxes (a range on every axis, the common case) are kept as
    their edges and turned into rows all at once (:func:`_box_rows`); a sample with an index
    list gets its block at once."""

    __slots__ = ("meta", "blocks", "pool", "pool_len", "boxes", "shard_limit", "per", "over")

    def __init__(self, meta: ArrayMetadata, shard_limit: int | None = None) -> None:
        """``shard_limit``: count the shards each sample touches (of a sharded array) and keep
        those over it in ``over``, (sample, shards) pairs; None: not counted."""
        self.meta = meta
        self.blocks: list[np.ndarray] = []
        self.pool: list[np.ndarray] = []
        self.pool_len = 0
        self.boxes: list[tuple[int, ...]] = []  # per box: sample, then each axis' start, then stop
        self.shard_limit = shard_limit
        self.per = meta.layout.units_per_chunk if shard_limit is not None and meta.layout.levels else None
        self.over: list[tuple[int, int]] = []

    def pooled(self, indices: np.ndarray) -> int:
        """Keep an index list; returns its reference (a negative start)."""
        ref = -(self.pool_len + 1)
        self.pool.append(indices)
        self.pool_len += len(indices)
        return ref

    def __bool__(self) -> bool:
        return bool(self.blocks or self.boxes)

    def add(self, sample: int, axes: list[AxisSelection]) -> bool:
        """The rows of one sample; returns whether they cover all of it (else it is padded)."""
        meta = self.meta
        per = self.per
        if all(type(a) is AxisRange for a in axes):
            covered = wanted = 1
            for a, size in zip(axes, meta.shape):
                covered *= max(0, min(a.stop, size) - max(a.start, 0))
                wanted *= a.size
            if covered:
                self.boxes.append((sample, *(a.start for a in axes), *(a.stop for a in axes)))
                if per is not None:  # the shards it cuts on each axis, multiplied
                    shards = 1
                    for a, size, unit, p in zip(axes, meta.shape, meta.layout.unit_shape, per):
                        shards *= (min(a.stop, size) - 1) // unit // p - max(a.start, 0) // unit // p + 1
                    if shards > self.shard_limit:
                        self.over.append((sample, shards))
            return covered >= wanted
        ndim = meta.ndim
        per_axis = [self._axis(a, size, unit) for a, size, unit in zip(axes, meta.shape, meta.layout.unit_shape)]
        covered = math.prod(sum(p[3] for p in parts) for parts in per_axis)
        counts = [len(parts) for parts in per_axis]
        total = math.prod(counts)
        if total and per is not None:  # its units are every combination of each axis' units
            shards = math.prod(len({part[0] // p for part in parts}) for parts, p in zip(per_axis, per))
            if shards > self.shard_limit:
                self.over.append((sample, shards))
        if total:
            block = np.empty((total, 1 + 4 * ndim), dtype=np.int64)
            block[:, 0] = sample
            if ndim:
                grid = np.indices(counts).reshape(ndim, total)
                for a, parts in enumerate(per_axis):
                    # columns 1 + a + k * ndim: unit coordinate, source, destination, extent
                    block[:, 1 + a :: ndim] = np.asarray(parts, dtype=np.int64)[grid[a]]
            self.blocks.append(block)
        return covered >= math.prod(a.size for a in axes)

    def _axis(self, sel: AxisSelection, size: int, unit: int) -> list[tuple[int, int, int, int]]:
        """(unit index, source start or index-list reference, destination start, extent) of
        each read unit one axis touches."""
        if isinstance(sel, AxisRange):
            lo, hi = max(sel.start, 0), min(sel.stop, size)
            out = []
            for u in range(lo // unit, (hi - 1) // unit + 1) if lo < hi else ():
                a, b = max(lo, u * unit), min(hi, (u + 1) * unit)
                out.append((u, a - u * unit, a - sel.start, b - a))
            return out
        out = []
        for u, dst, src in axis_parts(sel, size, unit):
            start = src.start if isinstance(src, slice) else self.pooled(np.asarray(src, dtype=np.int64))
            to = dst.start if isinstance(dst, slice) else self.pooled(np.asarray(dst, dtype=np.int64))
            out.append((u, start, to, _part_len(dst)))
        return out

    def rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All rows, in sample order; the unique units (n, ndim) they touch; each row's unit
        (index into them)."""
        ndim = self.meta.ndim
        blocks = self.blocks
        if self.boxes:
            boxes = _box_rows(np.array(self.boxes, dtype=np.int64), self.meta.shape, self.meta.layout.unit_shape)
            blocks = [boxes, *blocks]
        rows = np.concatenate(blocks) if len(blocks) > 1 else blocks[0]
        if self.boxes and self.blocks:  # boxes and index lists: back in sample order
            rows = rows[np.argsort(rows[:, 0], kind="stable")]
        coords = rows[:, 1 : 1 + ndim]
        grid = tuple(-(-s // u) for s, u in zip(self.meta.shape, self.meta.layout.unit_shape))
        if ndim == 0:
            return rows, np.zeros((1, 0), dtype=np.int64), np.zeros(len(rows), dtype=np.int64)
        if math.prod(grid) >= 1 << 62:
            units, inverse = np.unique(coords, axis=0, return_inverse=True)
            return rows, units, inverse.reshape(-1)
        units, inverse = _unique_units(rows, grid)
        return rows, units, inverse


def _box_rows(boxes: np.ndarray, shape: tuple[int, ...], unit_shape: tuple[int, ...]) -> np.ndarray:
    """The rows of boxes (per box: sample, starts, stops; each reaching into the array), as
    :meth:`_ArrayRows.add` makes them for one sample: per box the units it cuts in C order,
    each row the sample, then per axis the unit coordinate, source start, destination start
    and extent (columns ``1 + a + k * ndim``). In one native pass where the native module is
    built (numpy takes tens of calls, each costing more than the rows of a batch)."""
    rows = native.box_rows(boxes, shape, unit_shape)
    return rows if rows is not None else _box_rows_numpy(boxes, shape, unit_shape)


def _unique_units(rows: np.ndarray, grid: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The distinct units of ``rows`` (coordinates in columns 1 to ndim, in a grid of fewer
    than 2**62 units), in C order, and each row's index in them."""
    found = native.unique_units(rows, 1, grid)
    return found if found is not None else _unique_units_numpy(rows, grid)


def _unique_units_numpy(rows: np.ndarray, grid: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_unique_units` with numpy (no native module)."""
    ids = np.ravel_multi_index(tuple(rows[:, 1 : 1 + len(grid)].T), grid)
    uniq, inverse = np.unique(ids, return_inverse=True)
    return np.stack(np.unravel_index(uniq, grid), axis=1).astype(np.int64, copy=False), inverse.reshape(-1)


def _box_rows_numpy(boxes: np.ndarray, shape: tuple[int, ...], unit_shape: tuple[int, ...]) -> np.ndarray:
    """:func:`_box_rows` with numpy (no native module)."""
    ndim = len(shape)
    starts, stops = boxes[:, 1 : 1 + ndim], boxes[:, 1 + ndim :]
    size, unit = np.asarray(shape, dtype=np.int64), np.asarray(unit_shape, dtype=np.int64)
    lo, hi = np.maximum(starts, 0), np.minimum(stops, size)
    first, last = lo // unit, (hi - 1) // unit
    counts = last - first + 1  # units cut per axis
    per_box = np.prod(counts, axis=1)
    total = int(per_box.sum())
    box = np.repeat(np.arange(len(boxes)), per_box)
    rows = np.empty((total, 1 + 4 * ndim), dtype=np.int64)
    rows[:, 0] = boxes[box, 0]
    # the position of each row in its box's grid of units, last axis fastest
    left = np.arange(total) - np.repeat(np.cumsum(per_box) - per_box, per_box)
    for a in range(ndim - 1, -1, -1):
        n = counts[box, a]
        u = first[box, a] + left % n
        left //= n
        begin = u * unit[a]
        a0 = np.maximum(lo[box, a], begin)
        rows[:, 1 + a] = u
        rows[:, 1 + ndim + a] = a0 - begin
        rows[:, 1 + 2 * ndim + a] = a0 - starts[box, a]
        rows[:, 1 + 3 * ndim + a] = np.minimum(hi[box, a], begin + unit[a]) - a0
    return rows


class ChunkPlanner:
    """The planning component of a composed pipeline: plans each batch's reads from its
    samples and the metadata ``metadata`` (a :class:`~damacy_server.plan.resolve.ZarrMetadata`)
    provides, within ``limits`` (a :class:`~damacy_protocol.limits.PlanLimits`; None: the
    defaults). It serves one open pipeline at a time (a second is refused with
    :class:`InvalidArgument`) and may serve another once that one is closed; each pipeline it
    serves starts with empty metadata caches of its own."""

    __slots__ = ("metadata", "limits", "_owner")

    def __init__(self, *, metadata: ZarrMetadata, limits: PlanLimits | None = None) -> None:
        if not isinstance(metadata, ZarrMetadata):
            raise TypeError(f"metadata must be a ZarrMetadata, got {type(metadata).__name__}")
        limits = limits if limits is not None else PlanLimits()
        if not isinstance(limits, PlanLimits):
            raise TypeError(f"limits must be a PlanLimits or None, got {type(limits).__name__}")
        self.metadata = metadata
        self.limits = limits
        self._owner = Claim()

    def claim(self, owner: Any, *, recheckable: bool = False) -> Planner:
        """The :class:`Planner` that plans for ``owner`` (a pipeline), with fresh caches;
        InvalidArgument while another open pipeline holds this planner."""
        self._owner.take(
            owner,
            "this ChunkPlanner plans for another pipeline that is still open: close that one first, "
            "or give each pipeline a planner of its own",
        )
        return Planner(self.metadata.resolver(recheckable=recheckable), self.limits)

    def give_back(self, owner: Any) -> None:
        self._owner.give_back(owner)

    def __repr__(self) -> str:
        return f"ChunkPlanner(metadata={self.metadata!r}, limits={self.limits!r})"


class Planner:
    """Turns the samples of a batch into a :class:`BatchPlan`."""

    def __init__(
        self,
        metadata: Resolver | None = None,
        limits: PlanLimits | None = None,
        *,
        fresh_after: float | None = None,
        batch_limits: bool = True,
    ) -> None:
        """``fresh_after`` (a ``time.monotonic()``): metadata cached before it is checked
        against storage once before use (see :meth:`Resolver.recheck`; a daemon session's
        planner, whose caches outlive sessions); None: cached metadata is used as it is.
        ``batch_limits``: hold batches to :class:`PlanLimits`' caps (``damacy.read``'s
        one-sample plans are no batches)."""
        self.metadata = metadata if metadata is not None else Resolver()
        self.limits = limits if limits is not None else PlanLimits()
        self.fresh_after = fresh_after
        self.batch_limits = batch_limits

    # -- the limits a batch is planned within ----------------------------------------------
    def _check_chunk_size(self, meta: ArrayMetadata, caps: Caps | None) -> None:
        """A sample's chunks (read units) decode to at most ``PlanLimits.max_chunk_bytes``,
        and to at most the executor's cap."""
        decoded = math.prod(meta.layout.unit_shape) * meta.dtype.itemsize
        limit = self.limits.max_chunk_bytes
        if decoded > limit:
            raise BudgetExceeded(
                f"its chunks ({meta.layout.unit_shape} {meta.dtype.name}) decode to {decoded} bytes, more than "
                f"PlanLimits.max_chunk_bytes={limit} (Config.max_chunk_uncompressed_bytes): raise it to at least {decoded}"
            )
        if caps is not None and caps.max_decoded is not None and decoded > caps.max_decoded:
            raise BudgetExceeded(
                f"its chunks ({meta.layout.unit_shape} {meta.dtype.name}) decode to {decoded} bytes, more than the "
                f"executor admits ({caps.max_decoded}: CpuLimits.max_decoded_chunk_bytes, CudaLimits.max_chunk_bytes)"
            )

    def _check_batch(self, uses: int, located: list, samples: Sequence[Any], errors: dict) -> None:
        """A batch uses at most ``PlanLimits.max_chunks`` chunks (each counted once per sample
        using it) and its plan's tables take at most ``PlanLimits.max_plan_bytes``: else every
        sample of it fails (BudgetExceeded)."""
        limits = self.limits
        table_bytes = sum(rows.nbytes + units.nbytes + inverse.nbytes for _, rows, units, inverse in located)
        if uses > limits.max_chunks:
            why = f"the batch uses {uses} chunks (counted once per sample), more than PlanLimits.max_chunks={limits.max_chunks}"
        elif table_bytes > limits.max_plan_bytes:
            why = f"the batch's plan takes {table_bytes} bytes, more than PlanLimits.max_plan_bytes={limits.max_plan_bytes}"
        else:
            return
        for s, sample in enumerate(samples):
            if s not in errors:
                errors[s] = BudgetExceeded(why).with_context(uri=getattr(sample, "uri", None), sample=sample)

    def _locate(self, meta: ArrayMetadata, units: np.ndarray, hit: np.ndarray | None) -> UnitLocations:
        """Where ``units`` are; those marked in ``hit`` (found in the chunk cache, or needed by
        no sample still standing) are not looked up (their places are left empty: they are
        copied from the cache, or not read)."""
        if hit is None:
            return self.metadata.locate(meta, units)
        n = len(units)
        idx = np.flatnonzero(~hit)
        owners = np.full(n, -1, dtype=np.int64)
        offsets = np.zeros(n, dtype=np.int64)
        nbytes = np.zeros(n, dtype=np.int64)
        missing = np.zeros(n, dtype=bool)
        if not len(idx):  # all in the cache
            return UnitLocations([""] * n, owners, [], offsets, nbytes, missing, {})
        sub = self.metadata.locate(meta, units[idx])
        keys = [""] * n
        for j, k in enumerate(idx.tolist()):
            keys[k] = sub.keys[j]
        owners[idx] = sub.owners
        offsets[idx] = sub.offsets
        nbytes[idx] = sub.nbytes
        missing[idx] = sub.missing
        errors = {int(idx[j]): e for j, e in sub.errors.items()}
        return UnitLocations(keys, owners, sub.objects, offsets, nbytes, missing, errors)

    def plan(
        self,
        samples: Sequence[Any],
        sample_shape: tuple[int, ...],
        out_of_bounds: BoundsPolicy | str = BoundsPolicy.PAD,
        *,
        capacity: int | None = None,
        cache: LRUCache | None = None,
        accept: Callable[[ArrayMetadata], np.dtype | None] | None = None,
        dtype: np.dtype | None = None,
        caps: Caps | None = None,
    ) -> BatchPlan:
        """The plan of one batch. With the executor's ``capacity`` (bytes a read may hold in
        flight) merged reads that would not fit are split again; with its chunk ``cache``,
        units found there leave their reads and come with their arrays (``plan.cached``, a
        :class:`CachedUnits` per plan table).
        ``accept(meta)`` may refuse a sample's array (a DamacyError, that sample's), and
        returns the batch's dtype where it fixes one (``dtype="native"``: the first array's).
        ``dtype``: the batch's (None: the array's own), which a normalised sample needs to
        be a float type. ``caps``: what the executor admits (:class:`Caps`): a sample reading a
        chunk larger than its caps fails with BudgetExceeded, as one over
        :class:`PlanLimits`' (the chunks a batch uses, the shards a sample touches)."""
        t0 = time.perf_counter()
        n = len(samples)
        shapes: list[tuple[int, ...] | None] = [None] * n
        transforms: list = [None] * n
        norms: list = [None] * n
        metas: list[ArrayMetadata | None] = [None] * n
        errors: dict[int, DamacyError] = {}
        fills: list[tuple[int, Any]] = []
        by_array: dict[str, _ArrayRows] = {}
        # every array the batch names, those not cached read together (Resolver.arrays)
        requests = [(s.uri, s.level) for s in samples if isinstance(s, (Sample, IndexQuery, Selected))]
        if self.fresh_after is not None:
            self.metadata.recheck(requests, self.fresh_after)
        found = self.metadata.arrays(requests, self.fresh_after)
        for i, sample in enumerate(samples):
            try:
                if isinstance(sample, BadSample):
                    raise sample.error
                if not isinstance(sample, (Sample, IndexQuery, Selected)):  # a pushed item that is no sample
                    raise InvalidArgument(f"expected a Sample or an IndexQuery, got {describe_item(sample)}")
                meta = found[(sample.uri, sample.level)]
                if isinstance(meta, DamacyError):
                    raise meta.copy() from meta.__cause__
                metas[i] = meta
                if self.batch_limits:
                    self._check_chunk_size(meta, caps)
                fixed = accept(meta) if accept is not None else None
                if isinstance(sample, (Sample, IndexQuery)):
                    named = len(sample.selection)
                    if named != meta.ndim and not any(e is Ellipsis for e in sample.selection):
                        raise RankMismatch(f"names {named} axes, the array has {meta.ndim} (shape {meta.shape})")
                    axes, drop = resolve(sample.selection, meta.shape, out_of_bounds)
                else:
                    axes, drop = sample_axes(sample, meta, out_of_bounds), []
                shape = selection_shape(axes)
                transform = transform_of(sample, shape, drop)
                result = tuple(n for a, n in enumerate(shape) if a not in drop)
                out = result if transform is None or transform[1] is None else tuple(result[a] for a in transform[1])
                if tuple(out) != tuple(sample_shape):
                    what = f"selects shape {result}" + (f", {out} transposed" if out != result else "")
                    raise InvalidArgument(f"{what}, the batch holds samples of shape {sample_shape}")
                norm = sample.normalize
                if norm is not None:  # written as the batch's dtype (native: the one the first array fixed)
                    _check_normalized(dtype if dtype is not None else fixed if fixed is not None else meta.dtype, norm)
                shapes[i] = shape
                transforms[i] = transform
                norms[i] = norm
                acc = by_array.get(meta.root)
                if acc is None:
                    acc = by_array[meta.root] = _ArrayRows(meta, self.limits.max_shards_per_sample if self.batch_limits else None)
                if not acc.add(i, axes):
                    fills.append((i, meta.fill_value))  # pads outside the array
            except DamacyError as e:
                known = isinstance(sample, (Sample, IndexQuery, Selected, BadSample))
                errors[i] = e.with_context(uri=sample.uri, sample=sample) if known else e.with_context(sample=PUSHED_ITEM)

        # the batch's chunk uses and shards per sample, checked before any unit is located
        # (a sample or batch over its limits reads no shard index and no chunk)
        tables = []
        limit = self.limits.max_shards_per_sample
        for acc in by_array.values():
            for s, shards in acc.over:
                if s not in errors:
                    errors[s] = InvalidArgument(
                        f"touches {shards} shards, more than PlanLimits.max_shards_per_sample={limit}"
                    ).with_context(uri=samples[s].uri, sample=samples[s])
            if not acc:  # only boxes wholly outside the array
                continue
            tables.append((acc, *acc.rows()))
        if self.batch_limits:
            # a batch's rows bound its chunk uses: counted exactly only when the bound is over
            uses = sum(len(t[1]) for t in tables)
            if uses > self.limits.max_chunks:
                uses = sum(_uses(rows, inverse, len(units)) for _, rows, units, inverse in tables)
            self._check_batch(uses, tables, samples, errors)

        # where the units are; units that cannot be located fail their samples
        located = []
        total = unique = 0
        for acc, rows, units, inverse in tables:
            needed = np.zeros(len(units), dtype=bool)  # by the samples not failed already
            failed_now = np.fromiter(errors, dtype=np.int64, count=len(errors))
            needed[inverse[~np.isin(rows[:, 0], failed_now)] if len(failed_now) else inverse] = True
            if not needed.any():
                continue
            names = unit_keys(acc.meta, units)
            hits, hit = _cache_hits(names, cache)
            skip = ~needed if hit is None else hit | ~needed
            locs = self._locate(acc.meta, units, skip if skip.any() else None)
            if caps is not None and caps.max_encoded is not None:
                _check_stored(acc.meta, rows, inverse, locs, caps.max_encoded, samples, errors)
            total += len(rows)
            unique += len(units)
            if locs.errors:  # each sample takes the error of the first failed unit it reads
                bad = np.fromiter(locs.errors, dtype=np.int64, count=len(locs.errors))
                at = np.flatnonzero(np.isin(inverse, bad))
                first = np.unique(rows[at, 0], return_index=True)
                for s, r in zip(first[0].tolist(), at[first[1]].tolist()):
                    if s not in errors:
                        errors[s] = locs.errors[int(inverse[r])].copy(keep_sample=False).with_context(sample=samples[s])
            located.append((acc, rows, units, inverse, locs, hits, hit, names))

        dropped = None
        if errors:  # per sample whether it failed
            dropped = np.zeros(n, dtype=bool)
            dropped[np.fromiter(errors, dtype=np.int64, count=len(errors))] = True
        present: list[UnitJob] = []
        cached: list[CachedUnits] = []
        for acc, rows, units, inverse, locs, hits, hit, names in located:
            meta = acc.meta
            ndim = meta.ndim
            order, table_rows, spans, bounds, fill_samples, n_hit = _plan_table(rows, ndim, inverse, hit, dropped, locs)
            fills.extend((s, meta.fill_value) for s in fill_samples.tolist())
            pool = np.concatenate(acc.pool) if acc.pool else np.zeros(0, dtype=np.int64)
            table = CopyTable(ndim, table_rows, pool, spans)
            if n_hit:
                # the arrays of the cached units copied (hits holds every cached unit's, in unit order)
                arrays = hits if n_hit == len(hits) else list(map(hits.__getitem__, (np.cumsum(hit)[order[:n_hit]] - 1).tolist()))
                cached.append(CachedUnits(meta, table, arrays, bounds[: n_hit + 1], units[order[:n_hit]]))
            if n_hit == len(order):
                continue
            keys = locs.keys
            bounds = bounds.tolist()
            coords = units.tolist()
            offsets, nbytes = locs.offsets.tolist(), locs.nbytes.tolist()
            for p, k in enumerate(order[n_hit:].tolist(), n_hit):
                present.append(UnitJob(meta, tuple(coords[k]), keys[k], offsets[k], nbytes[k], table, p, bounds[p], bounds[p + 1], names[k]))

        groups, merged = merge_reads(present, self.limits, caps)
        groups = fit_reads(groups, capacity)
        seen = set()
        fills = [f for f in fills if f[0] not in errors and not (f[0] in seen or seen.add(f[0]))]
        return BatchPlan(
            samples=list(samples),
            shapes=shapes,
            transforms=transforms,
            norms=norms if any(x is not None for x in norms) else [],
            fills=fills,
            groups=groups,
            errors=errors,
            metas=metas,
            units_total=total,
            units_unique=unique,
            reads_merged=merged,
            seconds=time.perf_counter() - t0,
            cached=cached,
        )


def _uses(rows: np.ndarray, inverse: np.ndarray, n_units: int) -> int:
    """Chunk uses of one array's rows: each (sample, unit) once (an index list reading a
    chunk at several places uses it once)."""
    if not len(rows):
        return 0
    return int(np.unique(rows[:, 0] * max(n_units, 1) + inverse).size)


def _check_stored(meta: ArrayMetadata, rows: np.ndarray, inverse: np.ndarray, locs: UnitLocations, cap: int, samples, errors) -> None:
    """Samples reading a unit stored in more than ``cap`` bytes fail (BudgetExceeded)."""
    big = np.flatnonzero(locs.nbytes > cap)
    if not len(big):
        return
    at = np.flatnonzero(np.isin(inverse, big))
    for s, r in zip(*np.unique(rows[at, 0], return_index=True)):
        s = int(s)
        if s not in errors:
            n = int(locs.nbytes[inverse[at[r]]])
            errors[s] = BudgetExceeded(
                f"a chunk of it is stored in {n} bytes, more than the executor admits ({cap}: "
                "CpuLimits.max_encoded_chunk_bytes)"
            ).with_context(uri=samples[s].uri, sample=samples[s])


def _plan_table(rows: np.ndarray, ndim: int, inverse: np.ndarray, hit: np.ndarray | None, dropped: np.ndarray | None, locs: UnitLocations):
    """One array's copy table once its units are located: (order, table rows, spans, bounds,
    fill samples, cached units), as :func:`_plan_table_numpy` says; in one native pass where
    the native module is built."""
    args = (rows, ndim, inverse, hit, dropped, locs.missing, locs.owners, locs.offsets, locs.nbytes)
    found = native.plan_table(*args)
    return found if found is not None else _plan_table_numpy(*args)


def _plan_table_numpy(
    rows: np.ndarray, ndim: int, inverse: np.ndarray, hit: np.ndarray | None, dropped: np.ndarray | None,
    missing: np.ndarray, owners: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """The copy table of one array's ``rows`` (each row's unit ``inverse``), leaving out the
    rows of samples ``dropped`` marks (None: none) and of units ``missing`` (never written:
    their samples read the fill value). Returns

    - ``order``: the units copied from, those the chunk cache holds (``hit``) first, by index
      (their copies are the head of the table, made in one go), then the others by owner,
      offset, index (what merging and the executors expect);
    - the table rows (k, 2 + 3 * ndim): position in ``order``, sample, then per axis source
      start, destination start, extent; grouped by position, rows in their order within one;
    - ``spans``: per position (offset, stored bytes), offset 0 where nothing is stored;
    - ``bounds``: per position its first row, then the table's length;
    - the samples that read a missing unit (ascending, once each), and how many units of
      ``order`` are cached."""
    ok = ~dropped[rows[:, 0]] if dropped is not None else np.ones(len(rows), dtype=bool)
    gone = missing[inverse]
    fill_samples = np.unique(rows[ok & gone, 0])
    keep = ok & ~gone
    used = np.zeros(len(missing), dtype=bool)
    used[inverse[keep]] = True
    idx = np.flatnonzero(used)
    hit_idx = idx[hit[idx]] if hit is not None else idx[:0]
    if len(hit_idx):
        idx = idx[~hit[idx]]
    order = np.concatenate([hit_idx, idx[np.lexsort((offsets[idx], owners[idx]))]])
    pos_of = np.full(len(missing), -1, dtype=np.int64)
    pos_of[order] = np.arange(len(order))
    kept = rows[keep]
    pos = pos_of[inverse[keep]]
    by_pos = np.argsort(pos, kind="stable")
    kept, pos = kept[by_pos], pos[by_pos]
    table_rows = np.empty((len(kept), 2 + 3 * ndim), dtype=np.int64)
    table_rows[:, 0] = pos
    table_rows[:, 1] = kept[:, 0]
    table_rows[:, 2:] = kept[:, 1 + ndim :]
    spans = np.ascontiguousarray(np.stack([np.where(nbytes[order] < 0, 0, offsets[order]), nbytes[order]], axis=1), dtype=np.int64)
    bounds = np.searchsorted(pos, np.arange(len(order) + 1)).astype(np.int64)
    return order.astype(np.int64), table_rows, spans, bounds, fill_samples.astype(np.int64), len(hit_idx)


def _cache_hits(names: list, cache: LRUCache | None) -> tuple[list | None, np.ndarray | None]:
    """The decoded arrays of the units named ``names`` (:func:`unit_keys`) that the chunk
    cache holds, in unit order, and a mask of which units those are; (None, None) when it
    holds none. Looked up before the units are located: a unit in the cache needs no shard
    index."""
    if cache is None or not names:
        return None, None
    hit, found = cache.get_hits(names)
    return (found, hit) if found else (None, None)


def _part_len(p) -> int:
    return p.stop - p.start if isinstance(p, slice) else len(p)


def _check_normalized(dtype: np.dtype, norm: tuple[float, float]) -> None:
    """A normalised sample needs a float batch, and an offset and scale its compute type holds."""
    dtype = np.dtype(dtype)
    if not contract.is_float(dtype):
        raise InvalidArgument(
            f"normalize writes a float type (float16, bfloat16, float32, float64), the batch's dtype is {dtype.name}"
        )
    ct = contract.compute_dtype(dtype)
    info = np.finfo(ct)
    for name, v in zip(("offset", "scale"), norm):
        if abs(v) > float(info.max) or (v != 0 and abs(v) < float(info.smallest_subnormal)):
            raise InvalidArgument(f"normalize's {name} {v!r} is outside what {ct.name} holds (normalisation into {dtype.name} computes in {ct.name})")


def transform_of(sample: Any, shape: tuple[int, ...], drop: Sequence[int]) -> tuple | None:
    """A sample's (flip, transpose, dropped axes), checked against the axes of its result
    (``shape`` without the ``drop`` ped ones, which integers select); None: none."""
    flip, order = sample.flip, sample.transpose
    if not flip and order is None:
        return None
    ndim = len(shape) - len(drop)
    if flip and flip[-1] >= ndim:
        raise InvalidArgument(f"flip names axis {flip[-1]}, the selection has {ndim} axes")
    if order is not None and len(order) != ndim:
        raise InvalidArgument(f"transpose {order} names {len(order)} axes, the selection has {ndim}")
    return flip, order, tuple(drop)


def sample_view(target: Any, shape: tuple[int, ...], transform: tuple | None) -> Any:
    """Sample ``target`` (its slot's region, numpy or device memory) as the executors write
    it: in the selection's axis order and ``shape``. A transformed sample's view is permuted
    and reversed so that writing the selection as it is stores
    ``np.transpose(np.flip(selection, flip), transpose)`` in the slot: the copies make the
    transform, no pass of its own."""
    if transform is None:
        return target.reshape(shape)
    flip, order, drop = transform
    result = tuple(n for a, n in enumerate(shape) if a not in drop)  # the axes the sample has
    if order is None:
        view = target.reshape(result)
    else:
        view = target.reshape(tuple(result[a] for a in order)).transpose(tuple(int(a) for a in np.argsort(order)))
    if flip:
        view = np.flip(view, flip) if isinstance(view, np.ndarray) else view.flip(flip)
    if drop:  # the axes an integer selects, back as length-1 axes
        view = np.expand_dims(view, tuple(drop)) if isinstance(view, np.ndarray) else view.expand_dims(tuple(drop))
    return view


class BadSample:
    """A sample that was refused before planning (e.g. a path the daemon may not serve); its
    pop reports ``error`` like any other bad sample."""

    __slots__ = ("uri", "error", "description")

    def __init__(self, uri: str | None, error: DamacyError, description: str | None = None) -> None:
        self.uri = uri
        self.error = error
        self.description = description or f"sample of {uri!r}"

    def __repr__(self) -> str:
        return self.description


class Selected:
    """A sample whose per-axis selection is already parsed (``damacy.read``'s): no level of
    its own, no transform."""

    __slots__ = ("uri", "axes")
    level = None
    flip: tuple[int, ...] = ()
    transpose = None
    normalize = None

    def __init__(self, uri: str, axes: list[AxisSelection]) -> None:
        self.uri = uri
        self.axes = axes

    def __repr__(self) -> str:
        return f"damacy.read({self.uri!r})"


def sample_axes(sample: Any, meta: ArrayMetadata, out_of_bounds: BoundsPolicy | str) -> list[AxisSelection]:
    """The per-axis selection of a :class:`Sample` or :class:`IndexQuery` on ``meta``."""
    if isinstance(sample, Selected):
        return sample.axes
    if isinstance(sample, (Sample, IndexQuery)):
        return resolve(sample.selection, meta.shape, out_of_bounds)[0]
    raise InvalidArgument(f"expected a Sample or an IndexQuery, got {type(sample).__name__}")
