"""Op tables: the copies of a set of read units as one int64 array, for executors that run
them outside Python (the native CPU path now; a GPU assembly kernel later).

Row layout (``2 + 3 * ndim`` columns): unit index, target index, then per axis the source
start (in the unit), the destination start (in the target) and the extent. A negative source
start ``-(k + 1)`` stands for an ascending index list, ``pool[k : k + extent]`` (index queries,
which are assembled in sorted order). Rows are grouped by unit, in unit order. :func:`apply`
is the numpy reference an executor must agree with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from damacy_server.selection import CopyOp, SliceCopy


@dataclass(frozen=True)
class OpTable:
    ops: np.ndarray  # int64 (n_ops, 2 + 3 * ndim)
    samples: list[int]  # target index -> sample index in the plan
    ndim: int
    pool: np.ndarray  # int64: the index lists the rows point to


def tabulable(op: Any) -> bool:
    """Can this copy be a row? Boxes always; index copies when their destination is a box
    (index queries are planned in sorted order, so it is)."""
    return type(op) is SliceCopy or (
        type(op) is CopyOp and op.transpose is None and all(type(p) is slice for p in op.dst)
    )


def build(units: list[Any], ndim: int) -> OpTable:
    """The copies of ``units`` (each with ``copies``: (sample, op)) as a table."""
    rows = []
    pool: list[int] = []
    targets: dict[int, int] = {}
    for k, u in enumerate(units):
        for s, op in u.copies:
            t = targets.get(s)
            if t is None:
                t = targets[s] = len(targets)
            if type(op) is SliceCopy:
                rows.append((k, t, *(p.start for p in op.src), *(p.start for p in op.dst), *(p.stop - p.start for p in op.src)))
                continue
            if not tabulable(op):
                raise TypeError("this copy has no row form (its destination is not a box)")
            starts = [p.start for p in op.src]
            extents = [p.stop - p.start if p.stop is not None else -1 for p in op.src]
            for axis, idx in op.takes:
                starts[axis] = -(len(pool) + 1)
                extents[axis] = len(idx)
                pool.extend(int(i) for i in idx)
            rows.append((k, t, *starts, *(p.start for p in op.dst), *extents))
    ops = np.asarray(rows, dtype=np.int64).reshape(len(rows), 2 + 3 * ndim)
    return OpTable(ops, list(targets), ndim, np.asarray(pool, dtype=np.int64))


def apply(table: OpTable, decoded: list[np.ndarray], targets: list[np.ndarray]) -> None:
    """The reference semantics: ``targets[t][dst box] = decoded[unit][src box]`` (numpy cast)."""
    n = table.ndim
    with np.errstate(invalid="ignore", over="ignore"):
        for row in table.ops.tolist():
            unit, t = row[0], row[1]
            src, dst, ext = row[2 : 2 + n], row[2 + n : 2 + 2 * n], row[2 + 2 * n :]
            piece = decoded[unit]
            for axis, (a, e) in enumerate(zip(src, ext)):  # one axis at a time (outer product)
                idx = np.arange(a, a + e) if a >= 0 else table.pool[-a - 1 : -a - 1 + e]
                piece = piece.take(idx, axis=axis)
            targets[t][tuple(slice(d, d + e) for d, e in zip(dst, ext))] = piece
