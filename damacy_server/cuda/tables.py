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
    of a sample, or a row writes outside its sample."""
    written: dict[int, np.ndarray] = {}
    for row in np.asarray(rows, dtype=np.int64):
        sample = int(row[1])
        shape = tuple(out_shapes[sample])
        axes = [_axis_positions(int(row[2 + ndim + a]), int(row[2 + 2 * ndim + a]), pool) for a in range(ndim)]
        if any(len(p) and (p.min() < 0 or p.max() >= n) for p, n in zip(axes, shape)):
            raise OverlappingCopies(f"a row writes outside sample {sample} of shape {shape}")
        counts = written.get(sample)
        if counts is None:
            counts = written[sample] = np.zeros(shape, dtype=np.uint8)
        mesh = np.ix_(*axes) if ndim else ()
        np.add.at(counts, mesh, 1)
        if counts.max(initial=0) > 1:
            raise OverlappingCopies(f"two copies write the same element of sample {sample}")
