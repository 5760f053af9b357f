"""Op tables: the copies of a set of read units as one int64 array, for executors that run
them outside Python (the native CPU path now; a GPU assembly kernel later).

Row layout (``2 + 3 * ndim`` columns): unit index, target index, then per axis the source
start (in the unit), the destination start (in the target) and the extent. Rows are grouped
by unit, in unit order. :func:`apply` is the numpy reference an executor must agree with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from damacy_server.selection import SliceCopy


@dataclass(frozen=True)
class OpTable:
    ops: np.ndarray  # int64 (n_ops, 2 + 3 * ndim)
    samples: list[int]  # target index -> sample index in the plan
    ndim: int


def build(units: list[Any], ndim: int) -> OpTable:
    """The box copies of ``units`` (each with ``copies``: (sample, SliceCopy)) as a table."""
    rows = []
    targets: dict[int, int] = {}
    for k, u in enumerate(units):
        for s, op in u.copies:
            if type(op) is not SliceCopy:
                raise TypeError("op tables hold box copies only")
            t = targets.get(s)
            if t is None:
                t = targets[s] = len(targets)
            rows.append((k, t, *(p.start for p in op.src), *(p.start for p in op.dst), *(p.stop - p.start for p in op.src)))
    ops = np.asarray(rows, dtype=np.int64).reshape(len(rows), 2 + 3 * ndim)
    return OpTable(ops, list(targets), ndim)


def apply(table: OpTable, decoded: list[np.ndarray], targets: list[np.ndarray]) -> None:
    """The reference semantics: ``targets[t][dst box] = decoded[unit][src box]`` (numpy cast)."""
    n = table.ndim
    with np.errstate(invalid="ignore", over="ignore"):
        for row in table.ops.tolist():
            unit, t = row[0], row[1]
            src, dst, ext = row[2 : 2 + n], row[2 + n : 2 + 2 * n], row[2 + 2 * n :]
            targets[t][tuple(slice(d, d + e) for d, e in zip(dst, ext))] = decoded[unit][
                tuple(slice(a, a + e) for a, e in zip(src, ext))
            ]
