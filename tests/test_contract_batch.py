"""Contract §9 (Batch, BatchInfo, DLPack, the output pool), §10 (Stats, Metric), §13 (reads
under small limits) and §14 (output dtypes and conversions), on CPU pipelines. The CUDA
rows are in test_contract_cuda.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from contract_helpers import (
    OUT_BYTES,
    OUT_NAMES,
    assert_same,
    batch_values,
    box,
    convert,
    cpu_limits,
    expected_batch,
    out_numpy_dtype,
    pipeline,
    ramp,
    write,
)

import damacy

SHAPE, CHUNKS, BOX = (8, 12), (4, 6), (4, 6)
BOXES = [((0, 4), (0, 6)), ((2, 6), (3, 9)), ((4, 8), (6, 12)), ((1, 5), (5, 11)), ((3, 7), (1, 7)), ((0, 4), (6, 12))]


@pytest.fixture
def arr(tmp_path):
    return write(tmp_path / "a.zarr", ramp(SHAPE), chunks=CHUNKS)


def samples(arr, boxes):
    return [damacy.Sample(str(arr.store.root), b) for b in boxes]


def want(arr, boxes, out="f32"):
    return expected_batch([box(arr, b) for b in boxes], out)


# ---- §9 Batch and BatchInfo -------------------------------------------------------------


def test_batch_info_on_cpu(arr):
    with pipeline(BOX, dtype="u16") as p:
        p.push(samples(arr, BOXES[:2]))
        with p.pop() as batch:
            assert isinstance(batch, damacy.Batch)
            info = batch.info
            assert isinstance(info, damacy.BatchInfo)
            assert info.device_type is damacy.DeviceType.CPU
            assert info.dtype is damacy.Dtype.U16
            assert info.shape == (2, *BOX)
            assert info.data == info.device_ptr
            assert type(info.batch_id) is int


def test_batch_info_data_is_the_dlpack_address(arr):
    with pipeline(BOX) as p:
        p.push(samples(arr, BOXES[:2]))
        with p.pop() as batch:
            view = np.from_dlpack(batch)
            assert view.__array_interface__["data"][0] == batch.info.data
            del view


def test_batch_info_constructor_defaults_and_frozen():
    info = damacy.BatchInfo(device_ptr=4096, shape=(2, 3), dtype=damacy.Dtype.U8, ready_stream=0, batch_id=7)
    assert info.device_type is damacy.DeviceType.CUDA
    assert info.device_id == 0
    assert info.data == 4096
    with pytest.raises(AttributeError):  # frozen
        info.batch_id = 8


def test_batch_release_is_keyword_only_and_idempotent(arr):
    with pipeline(BOX) as p:
        p.push(samples(arr, BOXES[:2]))
        batch = p.pop()
        with pytest.raises(TypeError):
            batch.release(None)
        assert batch.release() is None
        assert batch.release(event=None) is None
        assert batch.release() is None


def test_batch_info_raises_after_release(arr):
    with pipeline(BOX) as p:
        p.push(samples(arr, BOXES[:2]))
        batch = p.pop()
        batch.release()
        with pytest.raises(BufferError, match="was released"):  # (the seed leaves the type unspecified)
            _ = batch.info


def test_batch_with_block_releases(arr):
    with pipeline(BOX) as p:
        p.push(samples(arr, BOXES[:2]))
        with p.pop() as batch:
            assert repr(batch) != "Batch(<released>)"
        assert repr(batch) == "Batch(<released>)"


def test_batch_repr_forms(arr):
    with pipeline(BOX, dtype="i32") as p:
        p.push(samples(arr, BOXES[:2]))
        with p.pop() as batch:
            info = batch.info
            assert repr(batch) == f"Batch(batch_id={info.batch_id}, shape={(2, *BOX)}, dtype=I32)"
        batch.release()
        assert repr(batch) == "Batch(<released>)"


def test_cpu_batch_refuses_a_release_event(arr):
    with pipeline(BOX) as p:
        p.push(samples(arr, BOXES[:2]))
        with p.pop() as batch:
            with pytest.raises(damacy.InvalidArgument, match="without an event"):  # (type unspecified by the seed)
                batch.release(event=1)


def test_cpu_batch_refuses_a_dlpack_stream(arr):
    with pipeline(BOX) as p:
        p.push(samples(arr, BOXES[:2]))
        with p.pop() as batch:
            with pytest.raises(BufferError, match="takes no stream"):  # (type unspecified by the seed)
                batch.__dlpack__(stream=1)
            assert_same(batch_values(batch, "f32"), want(arr, BOXES[:2]))


def test_cpu_batch_dlpack_device(arr):
    with pipeline(BOX) as p:
        p.push(samples(arr, BOXES[:2]))
        with p.pop() as batch:
            assert tuple(batch.__dlpack_device__()) == (1, 0)


def test_dlpack_capsule_versions_and_copy(arr):
    with pipeline(BOX) as p:
        p.push(samples(arr, BOXES[:2]))
        with p.pop() as batch:
            assert '"dltensor"' in repr(batch.__dlpack__())
            assert '"dltensor_versioned"' in repr(batch.__dlpack__(max_version=(1, 0)))
            assert '"dltensor"' in repr(batch.__dlpack__(dl_device=(1, 0)))
            with pytest.raises(BufferError):
                batch.__dlpack__(copy=True)


def test_dlpack_view_valid_after_release_and_close(arr):
    p = pipeline(BOX)
    with p:
        p.push(samples(arr, BOXES[:2]))
        batch = p.pop()
        view = np.from_dlpack(batch)
        batch.release()
    assert_same(view.astype(np.float32), want(arr, BOXES[:2]))


def test_holding_both_output_buffers_starves_the_pool(arr):
    with pipeline(BOX, prepared=2, pop_timeout_s=2.0) as p:
        p.push(samples(arr, BOXES))
        first, second = p.pop(), p.pop()
        with pytest.raises(damacy.PoolStarved):
            p.pop()
        assert_same(batch_values(first, "f32"), want(arr, BOXES[0:2]))
        first.release()
        with p.pop() as third:
            assert_same(batch_values(third, "f32"), want(arr, BOXES[4:6]))
        assert_same(batch_values(second, "f32"), want(arr, BOXES[2:4]))
        second.release()


def test_prepared_batches_are_damacys_slots(arr):
    """damacy prepares each batch into a slot of its own: ``prepared_batches`` is the number
    of slots (the seed API keeps two output buffers whatever it is: a listed difference), so
    holding two of eight lets a third come, and holding all eight starves the pool."""
    with pipeline(BOX, prepared=8, pop_timeout_s=2.0) as p:
        p.push(samples(arr, BOXES * 4))
        held = [p.pop() for _ in range(8)]
        with pytest.raises(damacy.PoolStarved):
            p.pop()
        assert_same(batch_values(held[2], "f32"), want(arr, BOXES[4:6]))
        for b in held:
            b.release()


def test_live_views_keep_buffers_after_release(arr):
    with pipeline(BOX, pop_timeout_s=2.0) as p:
        p.push(samples(arr, BOXES))
        views = []
        for _ in range(2):
            with p.pop() as batch:
                views.append(np.from_dlpack(batch))
        with pytest.raises(damacy.PoolStarved):
            p.pop()
        assert_same(views[0].copy(), want(arr, BOXES[0:2]))
        del views[:]
        with p.pop() as third:
            assert_same(batch_values(third, "f32"), want(arr, BOXES[4:6]))


def test_torch_synchronous_pattern_keeps_its_own_reference(arr):
    torch = pytest.importorskip("torch")
    with pipeline(BOX) as p:
        p.push(samples(arr, BOXES[:2]))
        with p.pop() as batch:
            x = torch.from_dlpack(batch)
    assert_same(x.numpy().copy(), want(arr, BOXES[:2]))


# ---- §4.2 IndexQuery semantics ----------------------------------------------------------


def test_index_query_is_the_cartesian_product_in_caller_order(arr):
    uri = str(arr.store.root)
    queries = [
        damacy.IndexQuery(uri, [range(7, 3, -1), [11, 0, 11, 5, 5, 2]]),  # reversed, duplicates
        damacy.IndexQuery(uri, [[3, 3, 3, 3], slice(6, 12)]),
    ]
    full = arr[...]
    with pipeline(BOX) as p:
        p.push(queries)
        with p.pop() as batch:
            expected = [full[np.ix_(range(7, 3, -1), [11, 0, 11, 5, 5, 2])], full[np.ix_([3, 3, 3, 3], range(6, 12))]]
            assert_same(batch_values(batch, "f32"), expected_batch(expected, "f32"))


def test_index_query_singleton_keeps_its_axis_and_large_gaps(tmp_path):
    a = write(tmp_path / "g.zarr", ramp((4, 100_000), "int32"), chunks=(4, 1000))
    q = damacy.IndexQuery(str(a.store.root), [[2], [99_999, 0, 50_123]])
    assert q.shape == (1, 3)
    with pipeline((1, 3), samples=1, dtype="i32") as p:
        p.push([q])
        with p.pop() as batch:
            assert_same(batch_values(batch, "i32"), a[...][np.ix_([2], [99_999, 0, 50_123])][None])


# ---- §10 Stats --------------------------------------------------------------------------

STAGES = ["plan", "io", "input_transfer", "decode", "post_decode", "decode_gap", "assemble", "bind_wait", "pop_wait"]
COUNTERS = [
    "array_meta_hits",
    "array_meta_misses",
    "shard_index_hits",
    "shard_index_misses",
    "chunk_layout_hits",
    "chunk_layout_misses",
    "metadata_latency_ops",
    "metadata_latency_stat_ops",
    "metadata_latency_submit_ops",
    "metadata_latency_active",
    "metadata_latency_max_active",
    "metadata_latency_total_sleep_ns",
    "metadata_latency_max_sleep_ns",
    "metadata_backend_read_jobs",
    "metadata_backend_read_active",
    "metadata_backend_read_max_active",
    "batches_emitted",
    "waves_emitted",
    "chunks_planned",
    "chunks_to_load",
    "chunks_dispatched",
    "reads_issued",
    "worker_steps",
    "gpu_bytes_committed",
    "host_bytes_committed",
]
CACHE_COUNTERS = COUNTERS[:6]
LATENCY_COUNTERS = [c for c in COUNTERS if c.startswith("metadata_latency_")]


def test_stats_fields_in_documented_order():
    names = [f.name for f in dataclasses.fields(damacy.Stats)]
    assert names == STAGES + COUNTERS
    assert len(names) == 34
    assert dataclasses.fields(damacy.Stats)[-1].default == 0  # host_bytes_committed=0


def test_metric_fields():
    assert [f.name for f in dataclasses.fields(damacy.Metric)] == ["name", "ms", "best_ms", "input_bytes", "output_bytes", "count"]


def test_stats_snapshot_types(arr):
    with pipeline(BOX) as p:
        p.push(samples(arr, BOXES[:2]))
        with p.pop():
            pass
        s = p.stats()
        assert isinstance(s, damacy.Stats)
        for name in STAGES:
            m = getattr(s, name)
            assert isinstance(m, damacy.Metric), name
            assert isinstance(m.name, str) and type(m.count) is int
        for name in COUNTERS:
            assert type(getattr(s, name)) is int, name
            assert getattr(s, name) >= 0, name
        with pytest.raises(AttributeError):  # frozen
            s.batches_emitted = 0


def test_batches_emitted_counts_batches(arr):
    with pipeline(BOX) as p:
        assert p.stats().batches_emitted == 0
        p.push(samples(arr, BOXES[:4]))
        for _ in range(2):
            with p.pop():
                pass
        assert p.stats().batches_emitted == 2


def test_stats_reset_zeroes_timings_and_keeps_cache_counters(arr):
    with pipeline(BOX) as p:
        p.push(samples(arr, BOXES[:4]))
        for _ in range(2):
            with p.pop():
                pass
        before = p.stats()
        assert before.array_meta_hits + before.array_meta_misses > 0
        assert p.stats_reset() is None
        after = p.stats()
        for name in STAGES:
            assert getattr(after, name).ms == 0, name
        for name in LATENCY_COUNTERS:
            assert getattr(after, name) == 0, name
        for name in CACHE_COUNTERS:
            assert getattr(after, name) == getattr(before, name), name


# ---- §14 output dtypes and conversions --------------------------------------------------

SOURCES = {
    "int8": [-128, -1, 0, 1, 12, 100, 127, -77],
    "int16": [-32768, -1, 0, 12, 256, 32767, -300, 1000],
    "int32": [-(2**31), -1, 0, 256, 65536, 2**31 - 1, 16777217, -16777219],
    "int64": [-(2**63), -1, 0, 2**31, 2**32 + 5, 2**63 - 1, 2**53 + 1, 16777219],
    "uint8": [0, 1, 127, 128, 200, 255, 12, 99],
    "uint16": [0, 1, 255, 256, 32767, 32768, 65535, 1000],
    "uint32": [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 65536, 16777217, 70000],
    "uint64": [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 2**32, 2**53 + 1, 16777219],
    "float16": [-1.9, 12.9, float("nan"), float("inf"), float("-inf"), 65504, -0.5, 300.7],
    "float32": [-1.9, 12.9, float("nan"), float("inf"), float("-inf"), 3e9, -3e9, 1.00390625],
}


def one_batch(tmp_path, values, out, *, chunks=(4,)):
    """Write ``values`` (1-D) with zarr-python, read it back through a one-sample pipeline."""
    data = np.asarray(values)
    a = write(tmp_path / "v.zarr", data, chunks=chunks)
    with pipeline(data.shape, samples=1, dtype=out) as p:
        p.push([damacy.Sample(str(a.store.root), [(0, data.shape[0])])])
        with p.pop() as batch:
            assert batch.info.dtype is damacy.Dtype.coerce(out)
            return a, batch_values(batch, out)


@pytest.mark.parametrize("out", OUT_NAMES)
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_output_dtype_conversion(tmp_path, source, out):
    a, got = one_batch(tmp_path, np.array(SOURCES[source], dtype=source), out)
    assert got.dtype == out_numpy_dtype(out) and got.dtype.itemsize == OUT_BYTES[out]
    assert_same(got, convert(a[...], out)[None])


def test_documented_example_int16_to_uint8(tmp_path):
    _, got = one_batch(tmp_path, np.array([-1, 12, 256], dtype="int16"), "u8", chunks=(3,))
    assert got.tolist() == [[0, 12, 255]]


def test_documented_example_float32_to_int16(tmp_path):
    _, got = one_batch(tmp_path, np.array([-1.9, 12.9, np.nan, np.inf], dtype="float32"), "i16")
    assert got.tolist() == [[-1, 12, 0, 32767]]


def test_bf16_rounds_ties_to_even(tmp_path):
    import ml_dtypes

    ties = np.array([1.00390625, 1.01171875, -1.00390625, 3.0], dtype="float32")
    _, got = one_batch(tmp_path, ties, "bf16")
    assert got.astype(np.float32).tolist() == [[1.0, 1.015625, -1.0, 3.0]]
    assert_same(got, ties.astype(ml_dtypes.bfloat16)[None])


def test_int_to_f32_rounds_ties_to_even(tmp_path):
    _, got = one_batch(tmp_path, np.array([16777217, 16777219, -16777217, 16777218], dtype="int32"), "f32")
    assert got.tolist() == [[16777216.0, 16777220.0, -16777216.0, 16777218.0]]


def test_int64_above_float32_range_kept_exactly(tmp_path):
    values = np.array([2**63 - 1, -(2**63), 2**53 + 1, 12], dtype="int64")
    _, got = one_batch(tmp_path, values, "i64")
    assert got.tolist() == [values.tolist()]


@pytest.mark.parametrize("out", ["u8", "i16", "f32", "u64"])
def test_missing_chunks_read_as_converted_fill_value(tmp_path, out):
    a = zarr_partial(tmp_path)
    with pipeline((8,), samples=1, dtype=out) as p:
        p.push([damacy.Sample(str(a.store.root), [(0, 8)])])
        with p.pop() as batch:
            got = batch_values(batch, out)
    assert_same(got, convert(a[...], out)[None])
    assert convert(a[...], out)[4:].tolist() == [convert(np.array([-5], "int16"), out)[0].tolist()] * 4


def zarr_partial(tmp_path):
    import zarr

    a = zarr.create_array(str(tmp_path / "p.zarr"), shape=(8,), dtype="int16", chunks=(4,), fill_value=-5)
    a[0:4] = [1, 2, 300, -7]  # the second chunk is never written
    assert not (tmp_path / "p.zarr" / "c" / "1").exists()
    return a


# ---- §13 reads under small limits -------------------------------------------------------

READERS = {
    "max_inflight_reads=1": lambda: {"file_reader": damacy.FileReader(workers=2, max_inflight_reads=1)},
    "readahead=False": lambda: {"file_reader": damacy.FileReader(workers=1, readahead=False)},
    "one-decode-worker": lambda: {"cpu_limits": cpu_limits(decode_workers=1, chunks_per_input_buffer=1)},
    "wide-input-buffer": lambda: {
        "cpu_limits": cpu_limits(decode_workers=2, chunks_per_input_buffer=64, max_encoded_chunk_bytes=64 << 10)
    },
}


@pytest.mark.parametrize("setting", sorted(READERS))
@pytest.mark.parametrize("sharded", [False, True])
def test_reads_under_small_limits_match_zarr(tmp_path, setting, sharded):
    a = write(tmp_path / "a.zarr", ramp(SHAPE, "int32", 3), chunks=(2, 3), shards=(4, 6) if sharded else None)
    with pipeline(BOX, **READERS[setting]()) as p:
        p.push(samples(a, BOXES))
        for k in range(3):
            with p.pop() as batch:
                assert_same(batch_values(batch, "f32"), want(a, BOXES[2 * k : 2 * k + 2]))
