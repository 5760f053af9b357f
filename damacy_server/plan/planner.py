"""The plan stage: the samples of a batch → byte ranges to read, units to decode, copies.

For one batch the planner finds every read unit the samples touch (a unit shared by several
samples is read and decoded once), looks up where each one's bytes are (shard indexes, read
once and cached), merges nearby byte ranges of one object into one read, and lists for each
unit the copies (unit region → sample region) that assemble the batch. The plan is what an
executor consumes (the CPU executor today; a GPU executor takes the same plan).

Units found in the chunk cache are taken from there before they are located (they need no
shard index and no read). Grouping the units into reads (merging, the budget) is in
:mod:`damacy_server.plan.reads`.

Selections become per-array rows and copy tables in :mod:`damacy_server.plan.rows`; a
sample's flip and transpose are :mod:`damacy_server.plan.transforms`'.
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
from damacy_server.cache import AnyCache
from damacy_server.claim import Claim
from damacy_server.decode import contract
from damacy_server.plan.items import BadSample, Selected, sample_axes
from damacy_server.plan.locate import UnitLocations
from damacy_server.plan.reads import Caps, ReadGroup, fit_reads, merge_reads
from damacy_server.plan.resolve import Resolver, ZarrMetadata
from damacy_server.plan.rows import ArrayRows, chunk_uses, plan_table
from damacy_server.plan.selection import resolve, selection_shape
from damacy_server.plan.transforms import transform_of
from damacy_server.plan.units import CachedUnits, CopyTable, UnitBlock, unit_keys, unit_names
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
        out = UnitLocations.none(len(units))
        if hit.all():  # (a cached batch's usual case) nothing to locate
            return out
        idx = np.flatnonzero(~hit)
        owners, offsets, nbytes, missing = out.owners, out.offsets, out.nbytes, out.missing
        sub = self.metadata.locate(meta, units[idx])
        owners[idx] = sub.owners
        offsets[idx] = sub.offsets
        nbytes[idx] = sub.nbytes
        missing[idx] = sub.missing
        errors = {int(idx[j]): e for j, e in sub.errors.items()}
        return UnitLocations(owners, sub.objects, offsets, nbytes, missing, errors)

    def plan(
        self,
        samples: Sequence[Any],
        sample_shape: tuple[int, ...],
        out_of_bounds: BoundsPolicy | str = BoundsPolicy.PAD,
        *,
        capacity: int | None = None,
        cache: AnyCache | None = None,
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
        by_array: dict[str, ArrayRows] = {}
        # every array the batch names, those not cached read together (Resolver.arrays)
        requests = [(s.uri, s.level) for s in samples if isinstance(s, (Sample, IndexQuery, Selected))]
        if self.fresh_after is not None:
            self.metadata.recheck(requests, self.fresh_after)
        found = self.metadata.arrays(requests, self.fresh_after)
        sized: set[int] = set()  # the arrays whose chunk size passed (by id): checked once a batch
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
                if self.batch_limits and id(meta) not in sized:
                    self._check_chunk_size(meta, caps)
                    sized.add(id(meta))
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
                result = tuple(n for a, n in enumerate(shape) if a not in drop) if drop else shape
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
                    acc = by_array[meta.root] = ArrayRows(meta, self.limits.max_shards_per_sample if self.batch_limits else None)
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
                uses = sum(chunk_uses(rows, inverse, len(units)) for _, rows, units, inverse in tables)
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
            hits, hit, sources = _cache_hits(names, cache)
            skip = ~needed if hit is None else hit | ~needed
            locs = self._locate(acc.meta, units, skip if skip.any() else None)
            if locs.objects and caps is not None and caps.max_encoded is not None:  # (none located: nothing stored to check)
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
            located.append((acc, rows, units, inverse, locs, hits, hit, sources, names))

        dropped = None
        if errors:  # per sample whether it failed
            dropped = np.zeros(n, dtype=bool)
            dropped[np.fromiter(errors, dtype=np.int64, count=len(errors))] = True
        groups: list[ReadGroup] = []
        merged = 0
        cached: list[CachedUnits] = []
        for acc, rows, units, inverse, locs, hits, hit, sources, names in located:
            meta = acc.meta
            ndim = meta.ndim
            order, table_rows, spans, bounds, fill_samples, n_hit = plan_table(rows, ndim, inverse, hit, dropped, locs)
            fills.extend((s, meta.fill_value) for s in fill_samples.tolist())
            pool = np.concatenate(acc.pool) if acc.pool else np.zeros(0, dtype=np.int64)
            table = CopyTable(ndim, table_rows, pool, spans)
            if n_hit:
                # the arrays of the cached units copied (hits holds every cached unit's, in unit
                # order), with their addresses where the cache keeps them
                picks = None if n_hit == len(hits) else np.cumsum(hit)[order[:n_hit]] - 1
                arrays = hits if picks is None else list(map(hits.__getitem__, picks.tolist()))
                at = sources if picks is None or sources is None else sources[picks]
                cached.append(CachedUnits(meta, table, arrays, bounds[: n_hit + 1], units[order[:n_hit]], at))
            if n_hit == len(order):
                continue
            at = order[n_hit:]
            block = UnitBlock(
                meta, table, n_hit, units[at], locs.objects, locs.owners[at], locs.offsets[at], locs.nbytes[at],
                bounds[n_hit:], unit_names(names, at),
            )
            reads, saved = merge_reads(block, self.limits, caps)
            groups.extend(reads)
            merged += saved

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


def _cache_hits(names: np.ndarray | list, cache: AnyCache | None) -> tuple[list | None, np.ndarray | None, np.ndarray | None]:
    """The decoded arrays of the units named ``names`` (:func:`unit_keys`) that the chunk
    cache holds, in unit order, a mask of which units those are, and their addresses where
    the cache keeps them (None: it does not); all None when it holds none. Looked up before
    the units are located: a unit in the cache needs no shard index."""
    if cache is None or not len(names):
        return None, None, None
    hit, found, sources = cache.get_hits(names)
    return (found, hit, sources) if found else (None, None, None)


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
