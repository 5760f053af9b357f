"""Host-side checks of a copy table before a kernel runs it.

The assembly kernel writes each output element from exactly one thread, which holds only if
no two rows of a launch write the same element of a sample. The planner builds tables that
way (a unit's part of a box is disjoint from any other unit's, an index list's destination
positions are distinct); :func:`check_disjoint` proves it for a table, so a planning bug is
an error on the host instead of a race on the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class OverlappingCopies(ValueError):
    """Two rows of a copy table write the same output element."""


def _axis_positions(start: int, extent: int, pool: np.ndarray) -> np.ndarray:
    if start >= 0:
        return np.arange(start, start + extent, dtype=np.int64)
    return pool[-start - 1 : -start - 1 + extent]


def check_disjoint(rows: np.ndarray, ndim: int, pool: np.ndarray, out_shapes: Sequence[tuple[int, ...]]) -> None:
    """Raise :class:`OverlappingCopies` when two rows (or one row twice) write one element
    of a sample, or a row writes outside its sample.

    It runs before every assembly launch, so it costs what the table's size does, not what
    the batch's does: the planner's rows of a sample form a grid (per axis, the pieces of
    the units the sample cuts, which are disjoint), so per axis the distinct destination
    pieces are checked to be disjoint and in bounds, and then two rows overlap exactly when
    they take the same piece on every axis. A table that is not such a grid (no planner
    makes one) is checked element by element."""
    rows = np.asarray(rows, dtype=np.int64)
    if not len(rows):
        return
    samples = rows[:, 1]
    for sample in np.unique(samples).tolist():
        mine = rows[samples == sample]
        shape = tuple(out_shapes[sample])
        if len(shape) != ndim:
            raise OverlappingCopies(f"rows of {ndim} axes write sample {sample} of shape {shape}")
        pieces = np.empty((len(mine), ndim), dtype=np.int64)
        grid = True
        for a in range(ndim):
            spans, pieces[:, a] = np.unique(mine[:, [2 + ndim + a, 2 + 2 * ndim + a]], axis=0, return_inverse=True)
            positions = [_axis_positions(start, extent, pool) for start, extent in spans.tolist()]
            at = np.concatenate(positions) if positions else np.zeros(0, dtype=np.int64)
            if len(at) and (at.min() < 0 or at.max() >= shape[a]):
                raise OverlappingCopies(f"a row writes outside sample {sample} of shape {shape}")
            grid = grid and len(np.unique(at)) == len(at)
        if not grid:
            _count_writes(mine, ndim, pool, sample, shape)
        elif len(np.unique(pieces, axis=0)) != len(pieces):
            raise OverlappingCopies(f"two copies write the same element of sample {sample}")


def _count_writes(rows: np.ndarray, ndim: int, pool: np.ndarray, sample: int, shape: tuple[int, ...]) -> None:
    """The exact check of one sample's rows (in bounds already): count every element's writes."""
    counts = np.zeros(shape, dtype=np.int32)
    for row in rows:
        axes = [_axis_positions(int(row[2 + ndim + a]), int(row[2 + 2 * ndim + a]), pool) for a in range(ndim)]
        np.add.at(counts, np.ix_(*axes) if ndim else (), 1)
    if counts.max(initial=0) > 1:
        raise OverlappingCopies(f"two copies write the same element of sample {sample}")
