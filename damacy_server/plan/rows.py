"""A batch's copies as arrays: per array the rows its samples cut (sample, unit coordinates,
source starts, destination starts, extents), the distinct units those rows touch, and once
the units are located, the copy table an executor runs. Each pass is one native call where
the native module is built (numpy takes tens of calls per array, each costing more than the
rows of a batch), with the numpy form it equals beside it (builds without a compiler, and
the fuzz targets and tests hold the native passes to them)."""

from __future__ import annotations

import math

import numpy as np

from damacy_server import native
from damacy_server.plan.locate import UnitLocations
from damacy_server.plan.selection import AxisRange, AxisSelection, axis_parts
from damacy_server.zarr.metadata import ArrayMetadata


class ArrayRows:
    """The copies of one array's samples while a batch is planned: per sample a block of rows
    (sample, unit coordinates, source starts, destination starts, extents), and the pool of
    index lists they point to. Boxes (a range on every axis, the common case) are kept as
    their edges and turned into rows all at once (:func:`box_rows`); a sample with an index
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
            out.append((u, start, to, part_len(dst)))
        return out

    def rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All rows, in sample order; the unique units (n, ndim) they touch; each row's unit
        (index into them)."""
        ndim = self.meta.ndim
        blocks = self.blocks
        if self.boxes:
            boxes = box_rows(np.array(self.boxes, dtype=np.int64), self.meta.shape, self.meta.layout.unit_shape)
            blocks = [boxes, *blocks]
        rows = np.concatenate(blocks) if len(blocks) > 1 else blocks[0]
        if self.boxes and self.blocks:  # boxes and index lists: back in sample order
            rows = rows[np.argsort(rows[:, 0], kind="stable")]
        coords = rows[:, 1 : 1 + ndim]
        grid = self.meta.layout.grid
        if ndim == 0:
            return rows, np.zeros((1, 0), dtype=np.int64), np.zeros(len(rows), dtype=np.int64)
        if math.prod(grid) >= 1 << 62:
            units, inverse = np.unique(coords, axis=0, return_inverse=True)
            return rows, units, inverse.reshape(-1)
        units, inverse = unique_units(rows, grid)
        return rows, units, inverse


def box_rows(boxes: np.ndarray, shape: tuple[int, ...], unit_shape: tuple[int, ...]) -> np.ndarray:
    """The rows of boxes (per box: sample, starts, stops; each reaching into the array), as
    :meth:`ArrayRows.add` makes them for one sample: per box the units it cuts in C order,
    each row the sample, then per axis the unit coordinate, source start, destination start
    and extent (columns ``1 + a + k * ndim``). In one native pass where the native module is
    built (numpy takes tens of calls, each costing more than the rows of a batch)."""
    rows = native.box_rows(boxes, shape, unit_shape)
    return rows if rows is not None else box_rows_numpy(boxes, shape, unit_shape)


def unique_units(rows: np.ndarray, grid: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The distinct units of ``rows`` (coordinates in columns 1 to ndim, in a grid of fewer
    than 2**62 units), in C order, and each row's index in them."""
    found = native.unique_units(rows, 1, grid)
    return found if found is not None else unique_units_numpy(rows, grid)


def unique_units_numpy(rows: np.ndarray, grid: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`unique_units` with numpy (no native module)."""
    ids = np.ravel_multi_index(tuple(rows[:, 1 : 1 + len(grid)].T), grid)
    uniq, inverse = np.unique(ids, return_inverse=True)
    return np.stack(np.unravel_index(uniq, grid), axis=1).astype(np.int64, copy=False), inverse.reshape(-1)


def box_rows_numpy(boxes: np.ndarray, shape: tuple[int, ...], unit_shape: tuple[int, ...]) -> np.ndarray:
    """:func:`box_rows` with numpy (no native module)."""
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


def chunk_uses(rows: np.ndarray, inverse: np.ndarray, n_units: int) -> int:
    """Chunk uses of one array's rows: each (sample, unit) once (an index list reading a
    chunk at several places uses it once)."""
    if not len(rows):
        return 0
    return int(np.unique(rows[:, 0] * max(n_units, 1) + inverse).size)


def plan_table(rows: np.ndarray, ndim: int, inverse: np.ndarray, hit: np.ndarray | None, dropped: np.ndarray | None, locs: UnitLocations):
    """One array's copy table once its units are located: (order, table rows, spans, bounds,
    fill samples, cached units), as :func:`plan_table_numpy` says; in one native pass where
    the native module is built."""
    args = (rows, ndim, inverse, hit, dropped, locs.missing, locs.owners, locs.offsets, locs.nbytes)
    found = native.plan_table(*args)
    return found if found is not None else plan_table_numpy(*args)


def plan_table_numpy(
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


def part_len(p) -> int:
    return p.stop - p.start if isinstance(p, slice) else len(p)
