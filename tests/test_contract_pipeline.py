"""Contract §8 (Pipeline), §11 (where errors surface) and §12 (ownership, threading) on CPU
pipelines composed from the documented components, with data
written by zarr-python and every batch compared with zarr-python's reads.
"""

from __future__ import annotations

import gc
import itertools
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from contract_helpers import (
    assert_same,
    batch_values,
    box,
    cpu_limits,
    executor,
    expected_batch,
    pipeline,
    planner,
    ramp,
    write,
)

import damacy

from daemon_helpers import wait_for
from pipeline_helpers import waiting_in_pop

SHAPE, CHUNKS, BOX = (8, 12), (4, 6), (4, 6)
BOXES = [((0, 4), (0, 6)), ((2, 6), (3, 9)), ((4, 8), (6, 12)), ((1, 5), (5, 11)), ((3, 7), (1, 7)), ((0, 4), (6, 12))]
BAD = ((0, 3), (0, 6))  # a (3, 6) box: not BatchSpec.shape


@pytest.fixture
def arr(tmp_path):
    return write(tmp_path / "good.zarr", ramp(SHAPE), chunks=CHUNKS)


def uri_of(arr) -> str:
    return str(arr.store.root)


def samples(arr, boxes):
    return [damacy.Sample(uri_of(arr), b) for b in boxes]


def check(batch, arr, boxes, out="f32"):
    assert_same(batch_values(batch, out), expected_batch([box(arr, b) for b in boxes], out))


# ---- §8 push / pop / batches ------------------------------------------------------------


@pytest.mark.parametrize("layout", ["zstd", "raw", "blosc", "sharded"])
def test_push_pop_batch_matches_zarr(tmp_path, layout):
    kw = {"shards": (8, 12), "codec": "zstd"} if layout == "sharded" else {"codec": None if layout == "raw" else layout}
    a = write(tmp_path / "a.zarr", ramp(SHAPE, "uint16", 7), chunks=CHUNKS, **kw)
    with pipeline(BOX) as p:
        p.push(samples(a, BOXES[:2]))
        with p.pop() as batch:
            assert np.from_dlpack(batch).shape == (2, *BOX)
            check(batch, a, BOXES[:2])


def test_pop_returns_batches_in_push_order(arr):
    with pipeline(BOX) as p:
        p.push(samples(arr, BOXES))
        for k in range(3):
            with p.pop() as batch:
                check(batch, arr, BOXES[2 * k : 2 * k + 2])


def test_batches_n_yields_n_batches_lazily(arr):
    with pipeline(BOX, pop_timeout_s=5.0) as p:
        it = p.batches(3)  # nothing pushed yet: a lazy generator pops nothing here
        p.push(samples(arr, BOXES))
        got = []
        for batch in it:
            with batch:
                got.append(batch_values(batch, "f32"))
        assert len(got) == 3
        for k, values in enumerate(got):
            assert_same(values, expected_batch([box(arr, b) for b in BOXES[2 * k : 2 * k + 2]], "f32"))


def test_drop_last_only_complete_batches(arr):
    with pipeline(BOX, pop_timeout_s=2.0) as p:
        p.push(samples(arr, BOXES[:5]))
        for k in range(2):
            with p.pop() as batch:
                check(batch, arr, BOXES[2 * k : 2 * k + 2])
        with pytest.raises(damacy.PoolStarved):
            p.pop()


def test_pool_starved_is_not_terminal_and_the_next_pop_adopts_the_wait(arr):
    with pipeline(BOX, pop_timeout_s=2.0) as p:
        p.push(samples(arr, BOXES[:1]))  # half a batch: it cannot seal yet
        with pytest.raises(damacy.PoolStarved):
            p.pop()
        p.push(samples(arr, BOXES[1:2]))
        with p.pop() as batch:
            check(batch, arr, BOXES[:2])


def test_pop_timeout_none_is_a_plain_blocking_pop(arr):
    with pipeline(BOX, pop_timeout_s=None) as p:
        p.push(samples(arr, BOXES[:2]))
        with p.pop() as batch:
            check(batch, arr, BOXES[:2])


def test_push_accepts_any_iterable_and_mixed_query_kinds(arr):
    query = damacy.IndexQuery(uri_of(arr), [[5, 1, 1, 7], slice(2, 8)])
    with pipeline(BOX) as p:
        p.push(iter([damacy.Sample(uri_of(arr), BOXES[0])]))
        p.push(q for q in [query])
        with p.pop() as batch:
            want = [box(arr, BOXES[0]), arr[...][np.ix_([5, 1, 1, 7], range(2, 8))]]
            assert_same(batch_values(batch, "f32"), expected_batch(want, "f32"))


def test_push_accepts_an_infinite_generator(arr):
    def forever():
        for i in itertools.count():
            yield damacy.Sample(uri_of(arr), BOXES[i % len(BOXES)])

    with pipeline(BOX, lookahead=2) as p:
        p.push(forever())  # returns: it pulls a bounded window
        for k in range(3):
            with p.pop() as batch:
                check(batch, arr, [BOXES[(2 * k) % 6], BOXES[(2 * k + 1) % 6]])


def test_pending_tracks_the_python_side_queue(arr):
    with pipeline(BOX, lookahead=2) as p:
        assert p.pending is False
        p.push(samples(arr, BOXES[:2]))
        assert p.pending is False  # two samples fit the empty lookahead
        with p.pop() as batch:
            check(batch, arr, BOXES[:2])
        p.push(itertools.islice(itertools.cycle(samples(arr, BOXES[:2])), 40))
        assert p.pending is True
        for _ in range(20):
            with p.pop() as batch:
                check(batch, arr, BOXES[:2])
        assert p.pending is False


def test_cpu_pipeline_device_is_minus_one(arr):
    with pipeline(BOX) as p:
        assert p.device == -1


def test_injected_pipeline_properties():
    output, queues = damacy.BatchSpec(2, BOX, "u16"), damacy.QueueLimits(lookahead_samples=4, prepared_batches=3)
    with damacy.Pipeline(planner=planner(), executor=executor(), output=output, queues=queues) as p:
        assert p.config is None
        assert p.output == output
        assert p.queues == queues


CLOSED_OPS = {
    "push": lambda p: p.push([]),
    "pop": lambda p: p.pop(),
    "stats": lambda p: p.stats(),
    "stats_reset": lambda p: p.stats_reset(),
    "device": lambda p: p.device,
}


@pytest.mark.parametrize("op", sorted(CLOSED_OPS))
def test_closed_pipeline_raises_shutdown_error(op):
    p = pipeline(BOX)
    p.close()
    with pytest.raises(damacy.ShutdownError) as info:
        CLOSED_OPS[op](p)
    assert str(info.value) == "damacy: pipeline has been closed"
    assert info.value.what == "closed"
    assert info.value.status == damacy.Status.SHUTDOWN


def test_close_is_idempotent():
    p = pipeline(BOX)
    assert p.close() is None
    assert p.close() is None
    with pytest.raises(damacy.ShutdownError):
        _ = p.device


def test_context_manager_returns_self_and_closes():
    p = pipeline(BOX)
    with p as entered:
        assert entered is p
    with pytest.raises(damacy.ShutdownError):
        p.stats()


def test_context_manager_does_not_suppress_exceptions():
    p = pipeline(BOX)
    with pytest.raises(KeyError):
        with p:
            raise KeyError("from the body")
    with pytest.raises(damacy.ShutdownError):
        p.pop()


# ---- §8 Pipeline(...) arguments ---------------------------------------------------------


def components():
    return {"planner": planner(), "executor": executor(), "output": damacy.BatchSpec(2, BOX), "queues": damacy.QueueLimits(4)}


def test_pipeline_config_and_components_type_error():
    cfg = damacy.Config(samples_per_batch=2, sample_shape=BOX, max_gpu_memory_bytes=1 << 30)
    with pytest.raises(TypeError) as info:
        damacy.Pipeline(cfg, planner=planner())
    assert str(info.value) == "supply either Config or pipeline components"


@pytest.mark.parametrize("missing", ["planner", "executor", "output", "queues", "all"])
def test_pipeline_missing_components_type_error(missing):
    kwargs = {} if missing == "all" else {k: v for k, v in components().items() if k != missing}
    with pytest.raises(TypeError) as info:
        damacy.Pipeline(**kwargs)
    assert str(info.value) == "planner, executor, output, and queues are required"


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan])
def test_pipeline_pop_timeout_message(bad):
    with pytest.raises(ValueError) as info:
        damacy.Pipeline(**components(), pop_timeout_s=bad)
    assert str(info.value) == "pop_timeout_s must be positive and finite, or None"


def test_pipeline_cpu_memory_cap_too_small_budget_exceeded():
    with pytest.raises(damacy.BudgetExceeded) as info:
        pipeline(BOX, cpu_limits=cpu_limits(max_memory_bytes=1 << 20))
    assert info.value.status == damacy.Status.BUDGET


def test_pipeline_metadata_cache_array_floor():
    """floor = lookahead_samples + output.samples = 6 array entries."""
    with pytest.raises(damacy.InvalidArgument):
        pipeline(BOX, cache=damacy.MetadataCache(array_entries=5))
    pipeline(BOX, cache=damacy.MetadataCache(array_entries=6)).close()


def test_pipeline_metadata_cache_shard_index_floor():
    """floor * max_shards_per_sample = 6 * 2 shard-index entries."""
    limits = damacy.PlanLimits(max_shards_per_sample=2)
    with pytest.raises(damacy.InvalidArgument):
        pipeline(BOX, plan_limits=limits, cache=damacy.MetadataCache(shard_index_entries=11))
    pipeline(BOX, plan_limits=limits, cache=damacy.MetadataCache(shard_index_entries=12)).close()


def test_pipeline_lookahead_below_one_batch_rejected():
    """§17 #20: the floor is native; only that Pipeline(...) refuses is asserted."""
    with pytest.raises((damacy.DamacyError, ValueError)):
        pipeline(BOX, samples=2, lookahead=1)


# ---- §12 ownership ----------------------------------------------------------------------


@pytest.mark.parametrize("shared", ["planner", "executor"])
def test_planner_or_executor_serves_one_open_pipeline_then_reusable(arr, shared):
    part = planner() if shared == "planner" else executor()
    fresh = {"planner_": part} if shared == "planner" else {"executor_": part}
    first = pipeline(BOX, **fresh)
    with pytest.raises((damacy.DamacyError, TypeError, ValueError)):
        pipeline(BOX, **fresh)
    first.close()
    with pipeline(BOX, **fresh) as again:
        again.push(samples(arr, BOXES[:2]))
        with again.pop() as batch:
            check(batch, arr, BOXES[:2])


def test_metadata_reader_and_provider_shared_by_open_pipelines(arr):
    reader = damacy.FileMetadataReader(concurrency=4)
    provider = damacy.ZarrMetadata(reader=reader, cache=damacy.MetadataCache())
    one = damacy.ChunkPlanner(metadata=provider)
    two = damacy.ChunkPlanner(metadata=damacy.ZarrMetadata(reader=reader, cache=damacy.MetadataCache()))
    three = damacy.ChunkPlanner(metadata=provider)
    with pipeline(BOX, planner_=one) as a, pipeline(BOX, planner_=two) as b, pipeline(BOX, planner_=three) as c:
        for p in (a, b, c):
            p.push(samples(arr, BOXES[:2]))
        for p in (c, b, a):
            with p.pop() as batch:
                check(batch, arr, BOXES[:2])


def test_pipeline_keeps_its_components_alive(arr):
    p = damacy.Pipeline(
        planner=damacy.ChunkPlanner(metadata=damacy.ZarrMetadata(reader=damacy.FileMetadataReader(concurrency=4), cache=damacy.MetadataCache())),
        executor=damacy.CpuExecutor(reader=damacy.FileReader(workers=2), limits=cpu_limits()),
        output=damacy.BatchSpec(2, BOX),
        queues=damacy.QueueLimits(4),
        pop_timeout_s=20.0,
    )
    gc.collect()
    with p:
        p.push(samples(arr, BOXES[:2]))
        with p.pop() as batch:
            check(batch, arr, BOXES[:2])


def test_pop_from_a_background_thread(arr):
    with pipeline(BOX) as p, ThreadPoolExecutor(1) as pool:
        p.push(samples(arr, BOXES[:4]))
        for k in range(2):
            batch = pool.submit(p.pop).result(timeout=60)
            with batch:
                check(batch, arr, BOXES[2 * k : 2 * k + 2])


def test_close_wakes_a_blocked_pop(arr):
    p = pipeline(BOX, pop_timeout_s=None)
    p.push(samples(arr, BOXES[:1]))  # half a batch: the pop waits for one that never seals
    result = {}

    def wait():
        try:
            result["batch"] = p.pop()
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            result["error"] = exc

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    assert wait_for(lambda: waiting_in_pop(t.ident), what="the pop to wait")  # blocked, not yet closed
    p.close()
    t.join(60)
    assert not t.is_alive()
    assert isinstance(result.get("error"), damacy.ShutdownError)


# ---- §11 push-time errors: the pipeline keeps running -----------------------------------


def test_push_shape_mismatch_invalid_argument_and_pipeline_keeps_running(arr):
    with pipeline(BOX) as p:
        with pytest.raises(damacy.InvalidArgument) as info:
            p.push([damacy.Sample(uri_of(arr), BAD)])
        assert info.value.status == damacy.Status.INVAL
        p.push(samples(arr, BOXES[:2]))
        with p.pop() as batch:
            check(batch, arr, BOXES[:2])


def test_push_reversed_interval_invalid_argument(arr):
    with pipeline(BOX) as p:
        with pytest.raises(damacy.InvalidArgument):
            p.push([damacy.Sample(uri_of(arr), [(4, 0), (0, 6)])])


def test_push_rank_mismatch_rejected_at_push(arr):
    with pipeline(BOX) as p:
        with pytest.raises(damacy.DamacyError):
            p.push([damacy.Sample(uri_of(arr), [(0, 1), (0, 4), (0, 6)])])
        p.push(samples(arr, BOXES[:2]))
        with p.pop() as batch:
            check(batch, arr, BOXES[:2])


def test_push_error_drops_the_iterator_and_its_buffered_items(arr):
    pulled = [0]

    def bad_first():
        yield damacy.Sample(uri_of(arr), BAD)
        while True:
            pulled[0] += 1
            yield damacy.Sample(uri_of(arr), BOXES[5])

    with pipeline(BOX, lookahead=4) as p:
        with pytest.raises(damacy.InvalidArgument):
            p.push(bad_first())
        seen = pulled[0]
        p.push(samples(arr, BOXES[1:3]))
        with p.pop() as batch:
            check(batch, arr, BOXES[1:3])  # not the dropped iterator's buffered BOXES[5]
        assert pulled[0] == seen  # the dropped iterator was not pulled again


def test_deferred_validation_error_surfaces_from_pop(arr):
    good = samples(arr, BOXES[:4])
    late_bad = damacy.Sample(uri_of(arr), BAD)
    with pipeline(BOX, lookahead=2, pop_timeout_s=5.0) as p:
        p.push(iter([*good, late_bad]))
        values, errors = [], []
        for _ in range(3):
            try:
                with p.pop() as batch:
                    values.append(batch_values(batch, "f32"))
            except damacy.InvalidArgument as exc:
                errors.append(exc)
        assert len(errors) == 1
        assert len(values) == 2
        for k, got in enumerate(values):
            assert_same(got, expected_batch([box(arr, b) for b in BOXES[2 * k : 2 * k + 2]], "f32"))
        p.push(samples(arr, BOXES[4:6]))
        with p.pop() as batch:
            check(batch, arr, BOXES[4:6])


# ---- §11 pop-time errors: terminal ------------------------------------------------------


def _missing(tmp_path):
    return {}, [damacy.Sample(str(tmp_path / "missing.zarr"), BOXES[0])]


def _index_out_of_bounds(tmp_path):
    a = write(tmp_path / "a.zarr", ramp(SHAPE), chunks=CHUNKS)
    return {"shape": (2, 6)}, [damacy.IndexQuery(uri_of(a), [[0, 9], slice(0, 6)])]


def _corrupt_chunk(tmp_path):
    a = write(tmp_path / "a.zarr", ramp(SHAPE), chunks=CHUNKS, codec="zstd")
    (tmp_path / "a.zarr" / "c" / "0" / "0").write_bytes(b"\x00not zstd\xff" * 8)
    return {}, samples(a, BOXES[:1])


def _chunk_over_plan_cap(tmp_path):
    a = write(tmp_path / "a.zarr", ramp(SHAPE), chunks=CHUNKS)  # 48-byte decoded chunks
    return {"plan_limits": damacy.PlanLimits(max_chunk_bytes=32)}, samples(a, BOXES[:1])


def _encoded_chunk_over_cpu_cap(tmp_path):
    a = write(tmp_path / "a.zarr", ramp(SHAPE), chunks=CHUNKS, codec=None)  # 48 encoded bytes
    return {"cpu_limits": cpu_limits(max_encoded_chunk_bytes=16)}, samples(a, BOXES[:1])


def _decoded_chunk_over_cpu_cap(tmp_path):
    a = write(tmp_path / "a.zarr", ramp(SHAPE), chunks=CHUNKS)
    return {"cpu_limits": cpu_limits(max_decoded_chunk_bytes=16)}, samples(a, BOXES[:1])


def _array_rank_mismatch(tmp_path):
    a = write(tmp_path / "a.zarr", ramp((2, *SHAPE)), chunks=(1, *CHUNKS))
    return {}, samples(a, BOXES[:1])  # a rank-2 sample of a rank-3 array


POP_ERRORS = {
    "missing-array": (_missing, "NotFound", "NOTFOUND"),
    "index-out-of-bounds": (_index_out_of_bounds, "InvalidArgument", "INVAL"),
    "corrupt-chunk": (_corrupt_chunk, "DecodeError", "DECODE"),
    "chunk-over-max_chunk_bytes": (_chunk_over_plan_cap, "BudgetExceeded", "BUDGET"),
    "encoded-chunk-over-CpuLimits": (_encoded_chunk_over_cpu_cap, "BudgetExceeded", "BUDGET"),
    "decoded-chunk-over-CpuLimits": (_decoded_chunk_over_cpu_cap, "BudgetExceeded", "BUDGET"),
    "array-rank-mismatch": (_array_rank_mismatch, "RankMismatch", "RANK"),
}


def failing_pipeline(tmp_path, scenario):
    make, exc_name, status = POP_ERRORS[scenario]
    parts, queries = make(tmp_path)
    p = pipeline(parts.pop("shape", BOX), samples=1, **parts)
    try:
        p.push(queries * 10)  # store-derived problems do not surface at push; some stay pending
    except BaseException:
        p.close()
        raise
    return p, getattr(damacy, exc_name), getattr(damacy.Status, status)


@pytest.mark.parametrize("scenario", sorted(POP_ERRORS))
def test_store_derived_error_raised_by_pop(tmp_path, scenario):
    p, exc, status = failing_pipeline(tmp_path, scenario)
    with p:
        with pytest.raises(exc) as info:
            p.pop()
        assert info.value.status == status
        assert isinstance(info.value.what, str)


@pytest.mark.parametrize("scenario", sorted(POP_ERRORS))
def test_store_derived_error_is_terminal(tmp_path, scenario, arr):
    p, exc, _ = failing_pipeline(tmp_path, scenario)
    with p:
        with pytest.raises(exc) as first:
            p.pop()
        with pytest.raises(exc) as again:
            p.pop()  # the same status again, not the ShutdownError of draining what is pending
        assert str(again.value) == str(first.value) and again.value is not first.value  # naming the same sample
        assert again.value.sample == first.value.sample is not None
        with pytest.raises(damacy.ShutdownError):
            p.push(samples(arr, BOXES[:1]))


def test_sample_over_max_shards_per_sample_invalid_argument(tmp_path):
    a = write(tmp_path / "s.zarr", ramp(SHAPE), chunks=(2, 3), shards=(4, 6))  # 2 x 2 shards
    with pipeline(SHAPE, samples=1, plan_limits=damacy.PlanLimits(max_shards_per_sample=2)) as p:
        with pytest.raises(damacy.InvalidArgument):
            p.push([damacy.Sample(uri_of(a), [(0, 8), (0, 12)])])
            p.pop()


def test_float64_sources_are_damacys_to_read(tmp_path):
    """The seed API refuses float64 sources (DtypeMismatch at pop); damacy reads them, cast
    by the same rules (a listed difference, docs/seed.md)."""
    a = write(tmp_path / "a.zarr", ramp(SHAPE, "float64"), chunks=CHUNKS)
    with pipeline(BOX, samples=1) as p:
        p.push(samples(a, BOXES[:1]))
        with p.pop() as batch:
            got = np.from_dlpack(batch).copy()
    (z0, z1), (y0, y1) = BOXES[0]
    np.testing.assert_array_equal(got[0], np.asarray(a[z0:z1, y0:y1], dtype=np.float32))
