"""Op tables (the copies of a plan as an array) reproduce the CPU path's batches."""

from __future__ import annotations

import numpy as np
import pytest
from zarr.codecs import BytesCodec, ShardingCodec, ZstdCodec

import damacy
from damacy_server.cpu import optable
from damacy_server.decode.chunks import decode_unit
from damacy_server.plan.planner import Planner
from damacy_server.plan.resolve import Resolver

from conftest import random_data, write_array


def plan_of(samples, sample_shape):
    """The plan of one batch, by the planning machinery itself (a planner of its own)."""
    return Planner(Resolver(), damacy.PlanLimits()).plan(samples, sample_shape)


def test_op_table_reproduces_the_batch(tmp_path):
    data = random_data((20, 30, 40), "int16", 2)
    write_array(
        tmp_path / "o",
        data,
        chunks=(10, 15, 20),
        serializer=ShardingCodec(chunk_shape=(5, 5, 10), codecs=[BytesCodec(endian="big"), ZstdCodec(level=1)]),
    )
    uri = str(tmp_path / "o")
    rng = np.random.default_rng(3)
    shape = (6, 7, 9)
    samples = [damacy.Sample(uri, tuple((int(a), int(a) + n) for a, n in zip(rng.integers(-2, 16, 3), shape))) for _ in range(5)]
    plan = plan_of(samples, shape)
    units = [u for g in plan.groups for u in g.units]
    table = optable.build(units)
    assert table.ops.shape[1] == 2 + 3 * 3 and sorted(set(table.ops[:, 1].tolist())) == list(range(5))
    decoded = [decode_unit(u.meta, u.meta.store.read_range(u.key, u.offset, u.nbytes), u.unit, u.key) for u in units]
    out = np.zeros((5, *shape), dtype="f4")
    for s, fill in plan.fills:
        out[s] = fill
    optable.apply(table, decoded, out)
    cfg = damacy.Config(samples_per_batch=5, sample_shape=shape, pop_timeout_s=30, out_of_bounds="pad")  # boxes reach out
    with damacy.Pipeline(cfg) as p:
        p.push(samples)
        with p.pop() as b:
            assert np.array_equal(b.numpy(), out)


def test_op_table_holds_index_copies_in_the_callers_order(tmp_path):
    data = random_data((20, 30, 40), "uint16", 4)
    write_array(tmp_path / "i", data, chunks=(10, 15, 20), compressors=[ZstdCodec(level=1)])
    uri = str(tmp_path / "i")
    queries = [damacy.IndexQuery(uri, ([19, 3, 3, 0], slice(4, 9), [39, 1, 22, 22, 7]))]
    plan = plan_of(queries, (4, 5, 5))
    units = [u for g in plan.groups for u in g.units]
    table = optable.build(units)
    assert (table.ops[:, 2:5] < 0).any() and len(table.pool) > 0  # index lists in the pool
    assert (table.ops[:, 5:8] < 0).any()  # and the positions they go to
    decoded = [decode_unit(u.meta, u.meta.store.read(u.key), u.unit, u.key) for u in units]
    out = np.zeros((1, 4, 5, 5), dtype="u2")
    optable.apply(table, decoded, [out[0]])
    assert np.array_equal(out[0], data[np.ix_([19, 3, 3, 0], range(4, 9), [39, 1, 22, 22, 7])])


def test_op_table_of_units_in_any_order_numbers_them_as_given(tmp_path):
    """Units given out of table order (units other batches decoded arrive in any order):
    unit k of the op table is the k-th given, even when the first and last given are as far
    apart in the table as a run in order would be."""
    data = random_data((8, 8, 8), "uint16", 6)
    write_array(tmp_path / "u", data, chunks=(4, 4, 4), compressors=[ZstdCodec(level=1)])
    uri = str(tmp_path / "u")
    plan = plan_of([damacy.Sample(uri, ((0, 8), (0, 8), (0, 8)))], (8, 8, 8))
    units = sorted((u for g in plan.groups for u in g.units), key=lambda u: u.pos)
    assert len(units) == 8
    order = [units[0], units[2], units[1], *units[3:]]  # first and last where a run in order has them
    table = optable.build(order)
    assert table.ops[:, 0].tolist() == [k for k, u in enumerate(order) for _ in range(u.hi - u.lo)]
    assert table.spans.tolist() == [u.table.spans[u.pos].tolist() for u in order]
    decoded = [decode_unit(u.meta, u.meta.store.read(u.key), u.unit, u.key) for u in order]
    out = np.zeros((1, 8, 8, 8), dtype="u2")
    optable.apply(table, decoded, [out[0]])
    assert np.array_equal(out[0], data)
    run = optable.build(units)  # in table order: a view of the table
    assert run.base == units[0].pos and np.shares_memory(run.ops, units[0].table.rows)


def test_op_tables_of_units_apart_are_their_rows_gathered_and_renumbered():
    # random plan tables, their units to read a block from a random position on (those before
    # it cached), and random subsets of the block's units in any order: the op table is each
    # unit's rows in the order given, numbered 0, 1, ... (a run in table order is a view,
    # numbered from its first position), with each unit's span
    from types import SimpleNamespace

    rng = np.random.default_rng(0)
    views = 0
    for trial in range(300):
        n_units, ndim = int(rng.integers(1, 30)), 3
        first = int(rng.integers(0, n_units))  # the table's positions before it are cached units
        counts = rng.integers(0, 5, n_units)
        bounds = np.concatenate([[0], np.cumsum(counts)])
        rows = rng.integers(0, 100, (int(bounds[-1]), 2 + 3 * ndim)).astype(np.int64)
        rows[:, 0] = np.repeat(np.arange(n_units), counts)
        spans = rng.integers(0, 100, (n_units, 2)).astype(np.int64)
        table = SimpleNamespace(rows=rows, ndim=ndim, pool=np.zeros(0, np.int64), spans=spans)
        block = SimpleNamespace(table=table, first=first, bounds=bounds[first:])
        m = n_units - first
        units = [SimpleNamespace(block=block, i=i) for i in range(m)]
        if trial % 3 == 0:  # a run in table order
            lo = int(rng.integers(0, m))
            pick = units[lo : int(rng.integers(lo + 1, m + 1))]
        else:
            pick = [units[i] for i in rng.permutation(m)[: int(rng.integers(1, m + 1))]]
        got = optable.build(pick)
        want = rows[[r for u in pick for r in range(bounds[first + u.i], bounds[first + u.i + 1])]]
        numbers = [k + got.base for k, u in enumerate(pick) for _ in range(bounds[first + u.i + 1] - bounds[first + u.i])]
        assert got.ops[:, 1:].tolist() == want[:, 1:].tolist() and got.ops[:, 0].tolist() == numbers, trial
        assert got.spans.tolist() == spans[[first + u.i for u in pick]].tolist(), trial
        in_order = [u.i for u in pick] == list(range(pick[0].i, pick[0].i + len(pick)))
        assert (got.base == first + pick[0].i and np.shares_memory(got.ops, rows)) if in_order and len(want) else got.base in (0, first + pick[0].i)
        views += in_order
    assert views > 100
    other = SimpleNamespace(table=table, first=0, bounds=bounds)
    with pytest.raises(ValueError, match="one plan table"):
        optable.build([units[0], SimpleNamespace(block=other, i=0)])
