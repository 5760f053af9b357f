"""Op tables: the copies of a set of read units as one int64 array, for executors that run
them outside Python (the native CPU path now; a GPU assembly kernel later).

Row layout (``2 + 3 * ndim`` columns): unit number (``base`` for the first unit given, then
counting up), sample (the target index), then per axis the source start (in the unit), the destination start (in the
target) and the extent. A negative start ``-(k + 1)``, on either side, stands for the index
list ``pool[k : k + extent]`` (index queries: which elements of the unit, and where they go
in the caller's order). Rows are grouped by unit, in unit order. The planner already holds the copies in this form
(:class:`damacy_server.plan.CopyTable`); :func:`build` takes a task's slice of it, and
:func:`apply` is the numpy reference an executor must agree with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class OpTable:
    ops: np.ndarray  # int64 (n_ops, 2 + 3 * ndim)
    ndim: int
    pool: np.ndarray  # int64: the index lists the rows point to
    base: int  # the unit number of the first unit (units are numbered base, base + 1, ...)
    spans: np.ndarray  # int64 (n_units, 2): each unit's offset in its object and length (-1: whole)


def build(units: Sequence[Any]) -> OpTable:
    """The copies of ``units`` (planned units of one array), in the order given. Consecutive
    units of a plan table (a task's usual case) are views of it, not copies."""
    first = units[0]
    table = first.table
    last = units[-1]
    if last.table is table and last.pos - first.pos == len(units) - 1 and all(u.table is table for u in units):
        return OpTable(table.rows[first.lo : last.hi], table.ndim, table.pool, first.pos, table.spans[first.pos : last.pos + 1])
    if any(u.table is not table for u in units):
        raise ValueError("an op table holds the units of one plan table")
    parts = []
    for k, u in enumerate(units):
        part = table.rows[u.lo : u.hi].copy()
        part[:, 0] = k
        parts.append(part)
    spans = table.spans[[u.pos for u in units]]
    return OpTable(np.concatenate(parts), table.ndim, table.pool, 0, spans)


def apply(table: OpTable, decoded: list[np.ndarray], targets: Sequence[np.ndarray]) -> None:
    """The reference semantics: ``targets[sample][dst] = decoded[unit - base][src]``, each
    side the outer product of its ranges and index lists (numpy cast)."""
    n = table.ndim
    with np.errstate(invalid="ignore", over="ignore"):
        for row in table.ops.tolist():
            unit, t = row[0] - table.base, row[1]
            src, dst, ext = row[2 : 2 + n], row[2 + n : 2 + 2 * n], row[2 + 2 * n :]
            piece = decoded[unit]
            for axis, (a, e) in enumerate(zip(src, ext)):  # one axis at a time (outer product)
                piece = piece.take(_indices(table.pool, a, e), axis=axis)
            targets[t][np.ix_(*(_indices(table.pool, d, e) for d, e in zip(dst, ext)))] = piece


def _indices(pool: np.ndarray, start: int, extent: int) -> np.ndarray:
    return np.arange(start, start + extent) if start >= 0 else pool[-start - 1 : -start - 1 + extent]
