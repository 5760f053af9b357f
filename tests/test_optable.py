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
    # random plan tables and random subsets of their units in any order: the op table is each
    # unit's rows in the order given, numbered 0, 1, ... (a run in table order is a view,
    # numbered from its first position), with each unit's span
    from types import SimpleNamespace

    rng = np.random.default_rng(0)
    for trial in range(300):
        n_units, ndim = int(rng.integers(1, 30)), 3
        counts = rng.integers(0, 5, n_units)
        bounds = np.concatenate([[0], np.cumsum(counts)])
        rows = rng.integers(0, 100, (int(bounds[-1]), 2 + 3 * ndim)).astype(np.int64)
        rows[:, 0] = np.repeat(np.arange(n_units), counts)
        spans = rng.integers(0, 100, (n_units, 2)).astype(np.int64)
        table = SimpleNamespace(rows=rows, ndim=ndim, pool=np.zeros(0, np.int64), spans=spans)
        units = [SimpleNamespace(table=table, pos=p, lo=int(bounds[p]), hi=int(bounds[p + 1])) for p in range(n_units)]
        pick = [units[i] for i in rng.permutation(n_units)[: int(rng.integers(1, n_units + 1))]]
        got = optable.build(pick)
        want = rows[[r for u in pick for r in range(u.lo, u.hi)]]
        numbers = [k + got.base for k, u in enumerate(pick) for _ in range(u.hi - u.lo)]
        assert got.ops[:, 1:].tolist() == want[:, 1:].tolist() and got.ops[:, 0].tolist() == numbers, trial
        assert got.spans.tolist() == spans[[u.pos for u in pick]].tolist(), trial
    other = SimpleNamespace(rows=rows, ndim=3, pool=np.zeros(0, np.int64), spans=spans)
    with pytest.raises(ValueError, match="one plan table"):
        optable.build([units[0], SimpleNamespace(table=other, pos=1, lo=0, hi=0)])
