"""Op tables: the copies of a set of read units as one int64 array, for executors that run
them outside Python (the native CPU path now; a GPU assembly kernel later).

Row layout (``2 + 3 * ndim`` columns): unit number (``base`` for the first unit given, then
counting up), sample (the target index), then per axis the source start (in the unit), the destination start (in the
target) and the extent. A negative start ``-(k + 1)``, on either side, stands for the index
list ``pool[k : k + extent]`` (index queries: which elements of the unit, and where they go
in the caller's order). Rows are grouped by unit, in unit order. The planner already holds the copies in this form
(:class:`damacy_server.plan.units.CopyTable`); :func:`build` takes a task's slice of it for native
code, and :func:`copy_rows` / :func:`fill_rows` execute rows with numpy (the CPU executor's
Python path; :func:`apply` runs a whole table the same way, for tests). There is no other
form of a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from damacy_server.decode import contract
from damacy_server.decode.chunks import cast_fill
from damacy_server.native import OpTable
from damacy_server.plan.selection import CopyOp, SliceCopy


def build(units: Sequence[Any]) -> OpTable:
    """The copies of ``units`` (planned units of one array: views of one block), in the
    order given."""
    block = units[0].block
    if any(u.block is not block for u in units):
        raise ValueError("an op table holds the units of one plan table")
    return build_block(block, np.fromiter((u.i for u in units), dtype=np.int64, count=len(units)))


def build_block(block: Any, picks: np.ndarray) -> OpTable:
    """The copies of the units ``picks`` (int64 indices in ``block``, a
    :class:`~damacy_server.plan.units.UnitBlock`), in the order given. Consecutive units (a
    job's usual case) are a view of the plan table, not a copy."""
    table = block.table
    n = len(picks)
    bounds = block.bounds
    first = int(picks[0]) if n else 0
    if n and int(picks[-1]) - first == n - 1 and (n < 3 or bool((np.diff(picks) == 1).all())):
        pos = block.first + first
        return OpTable(table.rows[bounds[first] : bounds[first + n]], table.ndim, table.pool, pos, table.spans[pos : pos + n])
    # units apart (others were taken from another batch's decode, or come in another order):
    # their rows gathered at once, renumbered 0, 1, ... in the order given
    lo = bounds[picks]
    counts = bounds[picks + 1] - lo
    ends = np.cumsum(counts)
    rows = table.rows[np.repeat(lo - ends + counts, counts) + np.arange(int(ends[-1]) if n else 0)]
    rows[:, 0] = np.repeat(np.arange(n, dtype=np.int64), counts)
    return OpTable(rows, table.ndim, table.pool, 0, table.spans[block.first + picks])


def _op(row: list[int], ndim: int, pool: np.ndarray) -> SliceCopy | CopyOp:
    """One row as a numpy copy: slices on both sides when it holds no index list."""
    src, dst, ext = row[2 : 2 + ndim], row[2 + ndim : 2 + 2 * ndim], row[2 + 2 * ndim :]
    if all(a >= 0 for a in src) and all(d >= 0 for d in dst):
        return SliceCopy(tuple(slice(d, d + e) for d, e in zip(dst, ext)), tuple(slice(a, a + e) for a, e in zip(src, ext)))
    src_parts = [slice(a, a + e) if a >= 0 else pool[-a - 1 : -a - 1 + e] for a, e in zip(src, ext)]
    dst_parts = [slice(d, d + e) if d >= 0 else pool[-d - 1 : -d - 1 + e] for d, e in zip(dst, ext)]
    return CopyOp(dst_parts, src_parts)


def copy_rows(
    rows: np.ndarray, ndim: int, pool: np.ndarray, targets: Sequence[np.ndarray], arr: np.ndarray, norms: Sequence = ()
) -> int:
    """Make the copies of ``rows`` (a unit's) from its decoded array ``arr`` into
    ``targets[sample]``, converted under damacy's numeric contract (numpy's casts, but for
    the pairs where :mod:`damacy_server.decode.contract` defines what numpy does not), and
    normalised for the samples with ``norms[sample]`` = (offset, scale); returns the bytes
    written."""
    written = 0
    raw = arr
    if len(rows) and contract.differs(arr.dtype, targets[int(rows[0, 1])].dtype):
        arr = contract.convert(arr, targets[int(rows[0, 1])].dtype)
    for row in rows.tolist():
        target = targets[row[1]]
        norm = norms[row[1]] if norms else None
        if norm is None:
            written += _op(row, ndim, pool).apply(target, arr) * target.itemsize
        else:
            convert = lambda piece, t=target.dtype, o=norm[0], s=norm[1]: contract.normalize(piece, t, o, s)  # noqa: E731
            written += _op(row, ndim, pool).apply(target, raw, convert) * target.itemsize
    return written


def fill_rows(rows: np.ndarray, ndim: int, pool: np.ndarray, targets: Sequence[np.ndarray], value, norms: Sequence = ()) -> None:
    """Write ``value`` (cast to each target's dtype, normalised per ``norms`` as in
    :func:`copy_rows`) where the copies of ``rows`` would write (a unit that was never
    written reads as the fill value)."""
    for row in rows.tolist():
        target = targets[row[1]]
        _op(row, ndim, pool).fill(target, cast_fill(value, target.dtype, norms[row[1]] if norms else None))


def apply(table: OpTable, decoded: list[np.ndarray], targets: Sequence[np.ndarray], norms: Sequence = ()) -> None:
    """Every copy of ``table``: ``targets[sample][dst] = decoded[unit - base][src]``."""
    with np.errstate(invalid="ignore", over="ignore"):
        ops = table.ops
        units = ops[:, 0] - table.base
        bounds = np.flatnonzero(np.diff(units)) + 1
        for part in np.split(ops, bounds) if len(ops) else []:
            copy_rows(part, table.ndim, table.pool, targets, decoded[int(part[0, 0]) - table.base], norms)
