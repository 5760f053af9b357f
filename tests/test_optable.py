"""Op tables (the copies of a plan as an array) reproduce the CPU path's batches."""

from __future__ import annotations

import numpy as np
from zarr.codecs import BytesCodec, ShardingCodec, ZstdCodec

import damacy
from damacy_server.cpu import optable
from damacy_server.decode.chunks import decode_unit

from conftest import random_data, write_array


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
    plan = damacy.ChunkPlanner().plan(samples, shape)
    units = [u for g in plan.groups for u in g.units]
    table = optable.build(units)
    assert table.ops.shape[1] == 2 + 3 * 3 and sorted(set(table.ops[:, 1].tolist())) == list(range(5))
    decoded = [decode_unit(u.meta, u.meta.store.read_range(u.key, u.offset, u.nbytes), u.unit, u.key) for u in units]
    out = np.zeros((5, *shape), dtype="f4")
    for s, fill in plan.fills:
        out[s] = fill
    optable.apply(table, decoded, out)
    cfg = damacy.Config(samples_per_batch=5, sample_shape=shape, pop_timeout_s=30)
    with damacy.Pipeline(cfg) as p:
        p.push(samples)
        with p.pop() as b:
            assert np.array_equal(b.numpy(), out)


def test_op_table_holds_index_copies_in_the_callers_order(tmp_path):
    data = random_data((20, 30, 40), "uint16", 4)
    write_array(tmp_path / "i", data, chunks=(10, 15, 20), compressors=[ZstdCodec(level=1)])
    uri = str(tmp_path / "i")
    queries = [damacy.IndexQuery(uri, ([19, 3, 3, 0], slice(4, 9), [39, 1, 22, 22, 7]))]
    plan = damacy.ChunkPlanner().plan(queries, (4, 5, 5))
    units = [u for g in plan.groups for u in g.units]
    table = optable.build(units)
    assert (table.ops[:, 2:5] < 0).any() and len(table.pool) > 0  # index lists in the pool
    assert (table.ops[:, 5:8] < 0).any()  # and the positions they go to
    decoded = [decode_unit(u.meta, u.meta.store.read(u.key), u.unit, u.key) for u in units]
    out = np.zeros((1, 4, 5, 5), dtype="u2")
    optable.apply(table, decoded, [out[0]])
    assert np.array_equal(out[0], data[np.ix_([19, 3, 3, 0], range(4, 9), [39, 1, 22, 22, 7])])
