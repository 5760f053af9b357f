"""The plan stage: the samples of a batch → byte ranges to read, units to decode, copies.

For one batch the planner finds every read unit the samples touch (a unit shared by several
samples is read and decoded once), looks up where each one's bytes are (shard indexes, read
once and cached), merges nearby byte ranges of one object into one read, and lists for each
unit the copies (unit region → sample region) that assemble the batch. The same plan feeds
the CPU and the GPU executors.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from damacy_protocol.errors import InvalidArgument, OutOfBounds, SampleError
from damacy_protocol.samples import IndexQuery, Sample
from damacy_server.resolve import ZarrMetadata
from damacy_server.selection import (
    AxisIndex,
    AxisRange,
    AxisSelection,
    axis_parts,
    CopyOp,
    SliceCopy,
    index_array,
    selection_shape,
    slice_selection,
)
from damacy_server.store import Store
from damacy_server.zarr.metadata import ArrayMetadata


@dataclass(frozen=True)
class PlanLimits:
    """How reads are merged: byte ranges of one object closer than ``max_gap_bytes`` are read
    as one, up to ``max_read_bytes`` per read."""

    max_gap_bytes: int = 64 << 10
    max_read_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        for name in ("max_gap_bytes", "max_read_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise InvalidArgument(f"PlanLimits.{name} must be an integer >= 0, got {v!r}")


@dataclass(frozen=True)
class BatchSpec:
    """What a batch is: ``samples`` samples of ``shape``, cast to ``dtype``."""

    samples: int
    shape: tuple[int, ...]
    dtype: str = "f32"


@dataclass(eq=False)
class UnitJob:
    """One read unit to decode, and where its pieces go."""

    meta: ArrayMetadata
    unit: tuple[int, ...]
    key: str
    offset: int  # within the object (-1: the whole object)
    nbytes: int  # encoded size (-1: the whole object, size unknown)
    copies: list[tuple[int, SliceCopy | CopyOp]] = field(default_factory=list)  # (sample, copy into it)

    @property
    def decoded_nbytes(self) -> int:
        return self.meta.layout.leaf.spec.nbytes


@dataclass(eq=False)
class ReadGroup:
    """One read: a byte range (or the whole) of one object, holding one or more units."""

    store: Store
    key: str
    offset: int
    length: int  # -1: the whole object
    units: list[UnitJob]

    @property
    def reserve_nbytes(self) -> int:
        """Memory this read needs while in flight: its bytes plus its decoded units."""
        decoded = sum(u.decoded_nbytes for u in self.units)
        encoded = self.length if self.length >= 0 else decoded + decoded // 64 + 4096
        return encoded + decoded


@dataclass(eq=False)
class BatchPlan:
    samples: list[Any]
    shapes: list[tuple[int, ...] | None]  # per sample: its selection's shape (view of its slot)
    fills: list[tuple[int, Any]]  # (sample, fill value) to write before the copies
    groups: list[ReadGroup]
    errors: dict[int, SampleError]
    metas: list[ArrayMetadata | None]
    # per sample: (axis, inverse order) to apply at the end, for index queries whose lists
    # were sorted so that each read unit fills a contiguous block (None: no permutation)
    perms: list[list[tuple[int, np.ndarray]] | None] = field(default_factory=list)
    copy_counts: list[int] = field(default_factory=list)  # per sample: copies to apply
    units_total: int = 0  # unit references over all samples
    units_unique: int = 0
    reads_merged: int = 0  # ranges saved by merging
    seconds: float = 0.0


class ChunkPlanner:
    """Turns the samples of a batch into a :class:`BatchPlan`."""

    def __init__(self, metadata: ZarrMetadata | None = None, limits: PlanLimits | None = None) -> None:
        self.metadata = metadata if metadata is not None else ZarrMetadata()
        self.limits = limits if limits is not None else PlanLimits()

    def plan(self, samples: Sequence[Any], sample_shape: tuple[int, ...], out_of_bounds: str = "pad") -> BatchPlan:
        t0 = time.perf_counter()
        n = len(samples)
        shapes: list[tuple[int, ...] | None] = [None] * n
        metas: list[ArrayMetadata | None] = [None] * n
        errors: dict[int, SampleError] = {}
        fills: list[tuple[int, Any]] = []
        by_array: dict[str, dict[tuple[int, ...], UnitJob]] = {}
        perms: list[list[tuple[int, np.ndarray]] | None] = [None] * n
        total = 0
        for i, sample in enumerate(samples):
            try:
                if isinstance(sample, BadSample):
                    raise sample.error
                meta = self.metadata.array(sample.uri)
                metas[i] = meta
                axes = sample_axes(sample, meta, out_of_bounds)
                if isinstance(sample, IndexQuery):
                    axes, perms[i] = sorted_axes(axes)
                shape = selection_shape(axes)
                if not same_shape(shape, sample_shape):
                    raise InvalidArgument(f"selects shape {shape}, the batch holds samples of shape {sample_shape}")
                shapes[i] = shape
                per_axis = [axis_parts(a, s, u) for a, s, u in zip(axes, meta.shape, meta.layout.unit_shape)]
                if math.prod(sum(_part_len(p[1]) for p in parts) for parts in per_axis) < math.prod(shape):
                    fills.append((i, meta.fill_value))  # pads outside the array
                jobs = by_array.get(meta.root)
                if jobs is None:
                    jobs = by_array[meta.root] = {}
                boxes = all(isinstance(a, AxisRange) for a in axes)
                for combo in itertools.product(*per_axis):
                    unit, dst, src = zip(*combo) if combo else ((), (), ())
                    job = jobs.get(unit)
                    if job is None:
                        job = jobs[unit] = UnitJob(meta, unit, "", -1, -1)
                    job.copies.append((i, SliceCopy(dst, src) if boxes else CopyOp(dst, src)))
                    total += 1
            except SampleError as e:
                errors[i] = e.with_context(uri=sample.uri, sample=sample)

        present: list[UnitJob] = []
        unique = 0
        for table in by_array.values():
            jobs_list = list(table.values())
            if not jobs_list:  # only boxes wholly outside the array
                continue
            unique += len(jobs_list)
            meta = jobs_list[0].meta
            units = np.array([j.unit for j in jobs_list], dtype=np.int64).reshape(len(jobs_list), meta.ndim)
            locs = self.metadata.locate(meta, units)
            for k, job in enumerate(jobs_list):
                job.key = locs.keys[k]
                if k in locs.errors:
                    for s, _ in job.copies:
                        errors.setdefault(s, _copy_error(locs.errors[k]).with_context(sample=samples[s]))
                elif locs.missing[k]:
                    fills.extend((s, meta.fill_value) for s, _ in job.copies)
                else:
                    job.offset, job.nbytes = int(locs.offsets[k]), int(locs.nbytes[k])
                    present.append(job)

        if errors:  # a failed sample gets no copies
            for job in present:
                job.copies = [c for c in job.copies if c[0] not in errors]  # (sample, op)
            present = [j for j in present if j.copies]
            fills = [f for f in fills if f[0] not in errors]
        copy_counts = [0] * n
        for job in present:
            for s, _ in job.copies:
                copy_counts[s] += 1
        groups, merged = merge_reads(present, self.limits)
        seen = set()
        fills = [f for f in fills if not (f[0] in seen or seen.add(f[0]))]
        return BatchPlan(
            samples=list(samples),
            shapes=shapes,
            fills=fills,
            groups=groups,
            errors=errors,
            metas=metas,
            perms=[None if i in errors else p for i, p in enumerate(perms)],
            copy_counts=copy_counts,
            units_total=total,
            units_unique=unique,
            reads_merged=merged,
            seconds=time.perf_counter() - t0,
        )


def _part_len(p) -> int:
    return p.stop - p.start if isinstance(p, slice) else len(p)


def _copy_error(e: SampleError) -> SampleError:
    """A fresh instance, so each sample's error names its own sample."""
    return type(e)(e.reason, uri=e.uri, path=e.path, chunk=e.chunk)


def same_shape(shape: tuple[int, ...], sample_shape: tuple[int, ...]) -> bool:
    """Equal, or equal once axes of length 1 are dropped (a 2-d slice of a 3-d volume)."""
    if shape == sample_shape:
        return True
    return tuple(n for n in shape if n != 1) == tuple(n for n in sample_shape if n != 1)


class BadSample:
    """A sample that was refused before planning (e.g. a path the daemon may not serve); its
    pop reports ``error`` like any other bad sample."""

    __slots__ = ("uri", "error", "description")

    def __init__(self, uri: str, error: SampleError, description: str | None = None) -> None:
        self.uri = uri
        self.error = error
        self.description = description or f"sample of {uri!r}"

    def __repr__(self) -> str:
        return self.description


def sample_axes(sample: Any, meta: ArrayMetadata, out_of_bounds: str) -> list[AxisSelection]:
    """The per-axis selection of a :class:`Sample` or :class:`IndexQuery` on ``meta``."""
    ndim = meta.ndim
    if isinstance(sample, Sample):
        if len(sample.aabb) != ndim:
            raise InvalidArgument(f"the box has {len(sample.aabb)} axes, the array has {ndim}")
        axes: list[AxisSelection] = []
        for axis, ((start, stop), size) in enumerate(zip(sample.aabb, meta.shape)):
            start = 0 if start is None else start
            stop = size if stop is None else stop
            if out_of_bounds == "error" and not (0 <= start <= stop <= size):
                raise OutOfBounds(f"axis {axis}: box ({start}, {stop}) leaves the array (size {size})")
            axes.append(AxisRange(start, stop))
        return axes
    if isinstance(sample, IndexQuery):
        if len(sample.selection) > ndim:
            raise InvalidArgument(f"the query has {len(sample.selection)} axes, the array has {ndim}")
        axes = []
        for axis, size in enumerate(meta.shape):
            s = sample.selection[axis] if axis < len(sample.selection) else slice(None)
            if isinstance(s, slice):
                axes.append(slice_selection(s, size, axis, None))
            else:
                axes.append(AxisIndex(index_array(list(s), size, axis, None)))
        return axes
    raise InvalidArgument(f"expected a Sample or an IndexQuery, got {type(sample).__name__}")


def sorted_axes(axes: list[AxisSelection]) -> tuple[list[AxisSelection], list[tuple[int, np.ndarray]] | None]:
    """Index lists in ascending order (so each read unit's part is one block of the
    selection) and, per reordered axis, the order that restores the caller's."""
    perm = []
    out = list(axes)
    for k, a in enumerate(axes):
        if isinstance(a, AxisIndex) and len(a.indices) > 1 and bool(np.any(np.diff(a.indices) < 0)):
            order = np.argsort(a.indices, kind="stable")
            out[k] = AxisIndex(a.indices[order])
            inverse = np.empty_like(order)
            inverse[order] = np.arange(len(order))
            perm.append((k, inverse))
    return out, perm or None


def merge_reads(jobs: list[UnitJob], limits: PlanLimits) -> tuple[list[ReadGroup], int]:
    """Group units into reads: ranges of one object closer than ``max_gap_bytes`` become one."""
    groups: list[ReadGroup] = []
    ranged: dict[str, list[UnitJob]] = {}
    for job in jobs:
        if job.nbytes < 0:
            groups.append(ReadGroup(job.meta.store, job.key, 0, -1, [job]))
        else:
            ranged.setdefault(job.key, []).append(job)
    merged = 0
    for key, items in ranged.items():
        items.sort(key=lambda j: j.offset)
        current: ReadGroup | None = None
        for job in items:
            end = job.offset + job.nbytes
            if (
                current is not None
                and job.offset - (current.offset + current.length) <= limits.max_gap_bytes
                and end - current.offset <= limits.max_read_bytes
            ):
                current.length = max(current.length, end - current.offset)
                current.units.append(job)
                merged += 1
                continue
            current = ReadGroup(job.meta.store, key, job.offset, job.nbytes, [job])
            groups.append(current)
    return groups, merged
