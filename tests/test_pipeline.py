"""The embedded pipeline: batches equal zarr-python's reads; streaming; errors; memory."""

from __future__ import annotations

import itertools
import os
import threading
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ShardingCodec, ZstdCodec

import damacy
from damacy_server.decode.contract import convert

from conftest import padded_selection, random_data, write_array
from daemon_helpers import wait_for
from pipeline_helpers import DAMACY_OWN, expected_box, out_dtype, same, waiting_in_pop

LE = BytesCodec(endian="little")
SHAPE = (30, 40, 50)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipe")
    arrays = {}
    arrays["u16"] = write_array(root / "u16", random_data(SHAPE, "uint16", 1), chunks=(8, 10, 16), compressors=[ZstdCodec(level=1)], fill_value=7)
    arrays["f32-sharded"] = write_array(
        root / "f32s",
        random_data(SHAPE, "float32", 2),
        chunks=(16, 20, 25),
        serializer=ShardingCodec(chunk_shape=(8, 10, 5), codecs=[LE, ZstdCodec(level=1)], index_codecs=[LE, Crc32cCodec()]),
        fill_value=float("nan"),
    )
    arrays["i8-blosc"] = write_array(
        root / "i8", random_data(SHAPE, "int8", 3), chunks=(7, 9, 11), compressors=[BloscCodec(cname="lz4", shuffle="shuffle", typesize=1)], fill_value=-5
    )
    arrays["u16-sharded-start"] = write_array(
        root / "u16s",
        random_data(SHAPE, "uint16", 4),
        chunks=(15, 20, 50),
        serializer=ShardingCodec(chunk_shape=(5, 10, 10), codecs=[LE], index_codecs=[LE], index_location="start"),
    )
    return root, {k: (str(root / {"u16": "u16", "f32-sharded": "f32s", "i8-blosc": "i8", "u16-sharded-start": "u16s"}[k]), v) for k, v in arrays.items()}


def config(n=4, shape=(6, 7, 8), **kw):
    kw.setdefault("pop_timeout_s", 30)
    kw.setdefault("max_memory_bytes", 256 << 20)
    return damacy.Config(samples_per_batch=n, sample_shape=shape, **kw)


def check_batch(batch, arrays_by_uri, dtype_name):
    x = batch.numpy()
    assert x.shape == batch.info.shape
    for j, sample in enumerate(batch.info.samples):
        oracle = arrays_by_uri[sample.uri]
        # "native": the dtype of the batch's first array; the others are cast to it
        dt = x.dtype if dtype_name == "native" else out_dtype(dtype_name)
        if isinstance(sample, damacy.Sample):
            want = expected_box(oracle, sample.aabb, dt)
        else:  # positions outside the array are padded (the pipelines' default)
            want = convert(padded_selection(oracle[...], sample.selection, oracle.fill_value), dt)
        assert same(x[j].reshape(want.shape), want), (j, sample)


def by_uri(store):
    return {uri: arr for uri, arr in store[1].values()}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_boxes_with_padding(store, data, make):
    arrays = list(store[1].values())
    shape = (5, 9, 13)
    samples = []
    for _ in range(data.draw(st.integers(1, 9))):
        uri, arr = data.draw(st.sampled_from(arrays))
        starts = [data.draw(st.integers(-n // 2 - 4, n)) for n in arr.shape]
        samples.append(damacy.Sample(uri, tuple((a, a + s) for a, s in zip(starts, shape))))
    dtype = data.draw(st.sampled_from(["f32", "f64", "bf16"]))
    with make(config(n=4, shape=shape, dtype=dtype, **DAMACY_OWN)) as p:
        p.push(samples)
        got = 0
        for batch in p.batches():
            with batch:
                check_batch(batch, by_uri(store), dtype)
                got += len(batch)
        assert got == len(samples)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16", "f64", "u8", "u16", "i16", "i32"])
def test_every_output_dtype_and_mixed_sources(store, dtype, make):
    samples = []
    for k, (uri, _) in enumerate(store[1].values()):
        samples.append(damacy.Sample(uri, np.s_[k : k + 6, 3 : 10, 40:48]))
        samples.append(damacy.Sample(uri, np.s_[-2:4, 35:42, 45:53]))  # pads
    with make(config(n=3, dtype=dtype, **DAMACY_OWN)) as p:
        p.push(samples)
        seen = 0
        for batch in p.batches():
            with batch:
                assert str(batch.info.dtype) == dtype and batch.numpy().dtype == out_dtype(dtype)
                check_batch(batch, by_uri(store), dtype)
                seen += len(batch)
    assert seen == len(samples)


def test_native_dtype_is_the_first_arrays_for_the_whole_pipeline(store, make):
    arrays = store[1]
    u16, f32, i8 = arrays["u16"][0], arrays["f32-sharded"][0], arrays["i8-blosc"][0]
    box = np.s_[0:6, 3:10, 40:48]
    # u16 first: f32 and i8 do not cast safely to uint16 and are refused, naming both dtypes
    samples = [damacy.Sample(u16, box), damacy.Sample(f32, box), damacy.Sample(i8, box), damacy.Sample(arrays["u16-sharded-start"][0], box)]
    with make(config(n=2, dtype="native", on_error="fill")) as p:
        p.push(samples)
        errors = {}
        for batch in p.batches():
            with batch:
                assert batch.info.dtype == damacy.Dtype.U16 and batch.numpy().dtype == np.uint16
                for j, err in batch.info.errors:
                    errors[batch.info.samples[j].uri] = str(err)
                for j, sample in enumerate(batch.info.samples):
                    if sample.uri == u16:
                        assert np.array_equal(batch.numpy()[j], arrays["u16"][1][box])
    assert set(errors) == {f32, i8}
    assert "float32" in errors[f32] and "uint16" in errors[f32] and "int8" in errors[i8]
    # i8 first: uint16 does not cast safely to int8
    with make(config(n=1, dtype="native", on_error="fill")) as p:
        p.push([damacy.Sample(i8, box), damacy.Sample(u16, box)])
        with p.pop() as b:
            assert b.numpy().dtype == np.int8 and not b.info.errors
        with p.pop() as b:
            assert b.numpy().dtype == np.int8 and b.info.errors


def test_native_dtype_is_the_first_batchs_when_batches_plan_side_by_side(store):
    # on a plan pool (damacyd's) batches plan on several threads; the first array read must
    # still be the first batch's: batch 1 (int8) waits for batch 0 (uint16) to be planned
    import threading

    from damacy_server.engine.batches import BatchEngine
    from damacy_server.engine.policy import Policy
    from damacy_server.plan.planner import Planner as PlanMachinery
    from damacy_server.workers import WorkerPool

    u16, i8 = store[1]["u16"][0], store[1]["i8-blosc"][0]
    box = np.s_[0:6, 3:10, 40:48]
    second = threading.Event()

    class Planner(PlanMachinery):
        def plan(self, samples, *args, **kw):
            if samples[0].uri == u16:
                second.wait(1)  # unordered, batch 1 plans meanwhile and its int8 comes first
            else:
                second.set()
            return super().plan(samples, *args, **kw)

    executor = damacy.CpuExecutor(reader=damacy.FileReader(), limits=damacy.CpuLimits(max_memory_bytes=64 << 20, decode_workers=2))
    pool = WorkerPool(2, "plan")
    output = damacy.BatchSpec(1, (6, 7, 8), "native")
    engine = BatchEngine(output, Policy(on_error="fill", out_of_bounds="pad"), Planner(), executor, 2, plan_pool=pool)
    try:
        engine.start([damacy.Sample(u16, box)])
        engine.start([damacy.Sample(i8, box)])
        got = []
        while len(got) < 2:
            with engine.cond:
                assert engine.cond.wait_for(engine.ready, timeout=30)
            got.append(engine.next_delivery())
        first, later = got
        assert first.dtype == np.uint16 and not first.errors and first.error is None
        assert later.dtype == np.uint16 and "int8" in str(later.errors[0][1])
    finally:
        engine.close()
        executor.close()
        pool.close()


def test_index_queries_with_duplicates_and_reversed_order(store, make):
    uri, arr = store[1]["f32-sharded"]
    uri2, arr2 = store[1]["u16"]
    queries = [
        # 30: past the end of axis 0, padded (an IndexQuery's indices are nonnegative)
        damacy.IndexQuery(uri, ([29, 3, 3, 0, 30, 12], slice(5, 12), [49, 48, 47, 0, 0, 25, 1, 2])),
        damacy.IndexQuery(uri2, ([0, 1, 2, 3, 4, 5], [39, 20, 20, 1, 0, 7, 8], slice(0, 8))),
        damacy.IndexQuery(uri, (slice(0, 6), slice(33, 40), [7, 6, 5, 4, 3, 2, 1, 0])),
    ]
    with make(config(n=2, shape=(6, 7, 8), **DAMACY_OWN)) as p:
        p.push(queries)
        for batch in p.batches():
            with batch:
                check_batch(batch, by_uri(store), "f32")


def test_index_query_out_of_range_is_refused_or_padded(store, make):
    uri, arr = store[1]["u16"]
    # out_of_bounds="error" (the default), on_error="raise": the stream goes on after the error
    with make(config(n=1, shape=(2, 7, 8), on_error="raise")) as p:
        p.push([damacy.IndexQuery(uri, ([0, 30], slice(0, 7), slice(0, 8)))])
        with pytest.raises(damacy.OutOfBounds, match="index 30 is outside the array"):
            p.pop()
        p.push([damacy.IndexQuery(uri, ([29, 0], slice(34, 41), slice(0, 8)))])
        with pytest.raises(damacy.OutOfBounds, match="axis 1: 34:41 leaves the array"):
            p.pop()
    # a negative index is refused where the query is made: never counted from the end
    with pytest.raises(ValueError, match="indices must be nonnegative"):
        damacy.IndexQuery(uri, ([-1, 0], slice(0, 7), slice(0, 8)))
    with make(config(n=1, shape=(2, 7, 8), dtype="native", out_of_bounds="pad")) as p:  # "pad": the fill value
        p.push([damacy.IndexQuery(uri, ([30, 0], slice(0, 7), slice(0, 8)))])
        with p.pop() as b:
            assert np.array_equal(b.numpy()[0, 0], np.full((7, 8), 7, arr.dtype))  # its fill value
            assert np.array_equal(b.numpy()[0, 1], arr[0, 0:7, 0:8])


def test_out_of_bounds_error_policy(store, make):
    uri, _ = store[1]["u16"]
    with make(config(n=2)) as p:  # out_of_bounds="error": the default
        # a box that starts before the array is refused where it is pushed
        with pytest.raises(damacy.InvalidArgument, match=r"axis 0: the box starts at -1, before the array") as info:
            p.push([damacy.Sample(uri, np.s_[-1:5, 0:7, 0:8]), damacy.Sample(uri, np.s_[0:6, 0:7, 0:8])])
        assert "Sample(" in str(info.value)
        # one that ends past it fails at its pop, naming the sample
        p.push([damacy.Sample(uri, np.s_[25:31, 0:7, 0:8]), damacy.Sample(uri, np.s_[0:6, 0:7, 0:8])])
        with pytest.raises(damacy.OutOfBounds, match=r"axis 0: 25:31 leaves the array") as info:
            p.pop()
        assert "Sample(" in str(info.value)


def test_seed_style_composition(store):
    uri, arr = store[1]["u16-sharded-start"]
    pipe = damacy.Pipeline(
        planner=damacy.ChunkPlanner(
            metadata=damacy.ZarrMetadata(
                reader=damacy.FileMetadataReader(),
                # the seed's floors: (lookahead_samples + samples) * max_shards_per_sample = 384
                cache=damacy.MetadataCache(array_entries=16, shard_index_entries=512),
            ),
            limits=damacy.PlanLimits(),
        ),
        executor=damacy.CpuExecutor(
            reader=damacy.FileReader(workers=4, max_inflight_reads=64),
            limits=damacy.CpuLimits(max_memory_bytes=64 << 20, decode_workers=2),
        ),
        output=damacy.BatchSpec(samples=2, shape=(6, 7, 8), dtype="f32"),
        queues=damacy.QueueLimits(lookahead_samples=4, prepared_batches=2),
        drop_last=False,  # damacy's: the short last batch is delivered
    )
    with pipe:
        pipe.push(damacy.Sample(uri, np.s_[i : i + 6, i : i + 7, 2 * i : 2 * i + 8]) for i in range(5))
        sizes = []
        with pytest.raises(damacy.PipelineDrained):  # batches(n) pops n: the fourth pop finds none
            for b in pipe.batches(10):
                with b:
                    check_batch(b, by_uri(store), "f32")
                    sizes.append(len(b))
        assert sizes == [2, 2, 1]
        assert isinstance(pipe.stats(), damacy.Stats)
        stats = pipe.stats_dict()
    for stage in ("plan", "read", "decode"):
        assert stats["stages"][stage]["count"] > 0 and stats["stages"][stage]["seconds"] > 0
    # the native loop decodes and assembles in one pass, timed under "native" and "decode"
    assert stats["stages"]["assemble"]["count"] > 0 and stats["stages"]["assemble"]["bytes_out"] > 0
    assert stats["stages"]["decode"]["bytes_out"] > 0
    assert stats["cache"]["shard_indexes"]["misses"] > 0 and stats["cache"]["arrays"]["hits"] > 0
    assert stats["chunks_deduplicated"] > 0 and stats["reads_merged"] > 0


def test_two_dimensional_samples_from_a_volume(store, make):
    uri, arr = store[1]["u16"]
    with make(config(n=2, shape=(7, 8), dtype="u16")) as p:
        p.push([damacy.Sample(uri, np.s_[3, 0:7, 10:18]), damacy.Sample(uri, np.s_[4:11, 5, 0:8])])  # a point drops its axis
        with pytest.raises(damacy.InvalidArgument, match=r"its shape \(1, 7, 8\) is not the batch's"):
            p.push([damacy.Sample(uri, np.s_[3:4, 0:7, 10:18])])  # a length-1 range keeps it, as the seed API's aabb
        with p.pop() as b:
            x = b.numpy()
            assert np.array_equal(x[0], arr[3, 0:7, 10:18]) and np.array_equal(x[1], arr[4:11, 5, 0:8])


# -- streaming ----------------------------------------------------------------------


def endless(uri, counter):
    for i in itertools.count():
        counter[0] += 1
        yield damacy.Sample(uri, np.s_[i % 20 : i % 20 + 6, 0:7, 0:8])


def test_infinite_generator_is_pulled_lazily(store, make):
    uri, _ = store[1]["u16"]
    pulled = [0]
    cfg = config(n=4, lookahead_samples=8, prepared_batches=2)
    with make(cfg) as p:
        p.push(endless(uri, pulled))
        for batch in p.batches(5):
            batch.release()
        delivered = 5 * 4
        # the feeder runs ahead as far as it may, and no further: lookahead_samples past what
        # was popped; a daemon client counts from what the daemon has assembled, which may
        # be its prepared batches more
        ahead = 0 if isinstance(p, damacy.EmbeddedPipeline) else cfg.prepared_batches * cfg.samples_per_batch
        deadline = time.monotonic() + 30
        while pulled[0] < delivered + cfg.lookahead_samples and time.monotonic() < deadline:
            time.sleep(0.01)
        assert delivered + cfg.lookahead_samples <= pulled[0] <= delivered + cfg.lookahead_samples + ahead + 1


def _outcome(fn, what: str):
    """What ``fn()`` returns or raises, run in a thread that must finish within a minute
    (``what`` names it when it does not: it hangs)."""
    outcome = []
    finished = threading.Event()

    def run():
        try:
            outcome.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome.append(e)
        finished.set()

    threading.Thread(target=run, daemon=True).start()
    assert finished.wait(60), what
    return outcome[0]


def _returns(fn):
    """Run ``fn`` in a thread; fail if it has not returned in a minute (it hangs), else
    raise what it raised."""
    got = _outcome(fn, f"{fn.__name__} hangs")
    if isinstance(got, BaseException):
        raise got


def test_close_with_an_infinite_generator_does_not_hang(store, make):
    uri, _ = store[1]["u16"]
    pipes = []

    def stream_and_close():
        with make(config()) as p:
            pipes.append(p)
            p.push(endless(uri, [0]))
            p.pop().release()
        p.close()  # idempotent

    _returns(stream_and_close)
    feeder = pipes[0]._feeder
    feeder.join(60)
    assert not feeder.is_alive()  # the generator is no longer pulled


def test_exit_with_one_pushed_and_nothing_popped(store, make):
    uri, _ = store[1]["u16"]
    pipes = []

    def push_and_exit():
        with make(config()) as p:
            pipes.append(p)
            p.push([damacy.Sample(uri, np.s_[0:6, 0:7, 0:8])])

    _returns(push_and_exit)
    with pytest.raises(damacy.ShutdownError, match="closed"):
        pipes[0].pop()


def test_last_partial_batch_and_drop_last(store, make):
    uri, _ = store[1]["u16"]
    samples = [damacy.Sample(uri, np.s_[i : i + 6, 0:7, 0:8]) for i in range(10)]
    with make(config(n=4, drop_last=False)) as p:  # damacy's: the last batch comes short
        p.push(samples)
        sizes = []
        for b in p.batches():
            sizes.append(len(b))
            b.release()
        with pytest.raises(damacy.PipelineDrained):
            p.pop()
    assert sizes == [4, 4, 2]
    # drop_last=True, the default: whole batches only; iterating ends where the samples of a
    # short last batch are left, which wait for a later push to complete their batch
    with make(config(n=4, pop_timeout_s=2)) as p:
        p.push(samples)
        sizes = []
        for b in p.batches():
            sizes.append(len(b))
            b.release()
        with pytest.raises(damacy.PoolStarved):
            p.pop()
        p.push(samples[:2])
        with p.pop() as b:
            assert b.info.samples == (*samples[8:], *samples[:2])
    assert sizes == [4, 4]


def test_drained_and_empty_pops_raise_at_once(store, make):
    uri, _ = store[1]["u16"]
    # no pop timeout: a pop that waited for a batch instead of saying so would never return
    # (one sample a batch: every batch is whole, under the default drop_last=True)
    with make(config(n=1, pop_timeout_s=None)) as p:
        err = _pop_outcome(p, None)
        assert isinstance(err, damacy.PipelineDrained) and "nothing was pushed" in str(err), repr(err)
        p.push([damacy.Sample(uri, np.s_[0:6, 0:7, 0:8])])
        p.pop().release()
        err = _pop_outcome(p, None)
        assert isinstance(err, damacy.PipelineDrained) and "delivered" in str(err), repr(err)
        p.push([])  # an empty iterable
        assert isinstance(_pop_outcome(p, None), damacy.PipelineDrained)
        p.push([damacy.Sample(uri, np.s_[1:7, 0:7, 0:8])])  # pushing again continues the stream
        with p.pop() as b:
            assert b.info.batch_id == 1


def test_a_pop_with_every_slot_held_at_the_end_of_the_input_says_drained_or_raises_the_inputs_error(store, make):
    """Both slots held by the input's two batches: the next pop says the stream is drained
    (or raises the exception the iterable raised after them), never SlotsHeld, whether or not
    the feeder has yet found the input's end."""
    uri, _ = store[1]["u16"]

    def samples(fail):
        for i in range(6):
            yield damacy.Sample(uri, np.s_[i : i + 6, 0:7, 0:8])
        if fail:
            raise ValueError("the input broke")

    for trial in range(20):
        fail = trial % 2 == 1
        with make(config(n=3, prepared_batches=2)) as p:
            p.push(samples(fail))
            held = [p.pop(), p.pop()]
            with pytest.raises(ValueError if fail else damacy.PipelineDrained):
                p.pop()
            for b in held:
                b.release()


def test_pop_timeout_names_what_it_waited_for(store, make):
    uri, _ = store[1]["u16"]
    gate = threading.Event()

    def slow():
        # push pulls a first window (the lookahead: a batch, and one sample ahead) itself:
        # the input stalls after it
        for i in range(5):
            yield damacy.Sample(uri, np.s_[i : i + 6, 0:7, 0:8])
        gate.wait(60)
        for i in range(5, 8):
            yield damacy.Sample(uri, np.s_[i : i + 6, 0:7, 0:8])

    with make(config(n=4, lookahead_samples=4)) as p:
        p.push(slow())
        p.pop(timeout=60).release()
        with pytest.raises(damacy.PoolStarved, match="batch 1.*waiting for the pushed input"):
            p.pop(timeout=0.3)
        gate.set()
        p.pop(timeout=60).release()


def _pop_outcome(p, timeout):
    """What ``p.pop(timeout)`` raises (or returns), run in a thread that must finish well
    before any timeout given here runs out."""
    return _outcome(lambda: p.pop(timeout), f"pop(timeout={timeout}) waited instead of answering at once")


def test_pop_says_at_once_that_every_slot_is_held_whatever_the_timeout(store, make):
    uri, _ = store[1]["u16"]
    with make(config(n=1, prepared_batches=1, lookahead_samples=1)) as p:  # pop_timeout_s: 30
        p.push(damacy.Sample(uri, np.s_[i : i + 6, 0:7, 0:8]) for i in range(4))
        first = p.pop()
        for timeout in (None, 300.0, float("inf")):
            err = _pop_outcome(p, timeout)
            assert isinstance(err, damacy.SlotsHeld) and isinstance(err, damacy.PoolStarved), repr(err)
            text = str(err)
            assert "all 1 batch slots are held by batches that were not released, or by arrays exported" in text
            assert "batch.copy()" in text and "within" not in text
        first.release()
        kept = p.pop(timeout=30).numpy()  # an exported array keeps the only slot as well
        assert isinstance(_pop_outcome(p, 300.0), damacy.SlotsHeld)
        del kept
        p.pop(timeout=30).release()  # the slot is free again: the stream goes on
    with make(config(n=2, prepared_batches=1, lookahead_samples=2, drop_last=False)) as p:
        p.push([damacy.Sample(uri, np.s_[i : i + 6, 0:7, 0:8]) for i in range(3)])
        p.pop(timeout=30).release()
        last = p.pop(timeout=30)  # the short last batch: the input is known to be exhausted
        assert len(last.info.samples) == 1
        # nothing is left to deliver: drained, not "held", though the only slot is held
        assert isinstance(_pop_outcome(p, 300.0), damacy.PipelineDrained)
        last.release()


def test_batch_copy_is_an_array_of_its_own(store, make):
    uri, arr = store[1]["u16"]
    with make(config(n=1, prepared_batches=1, lookahead_samples=1)) as p:
        p.push([damacy.Sample(uri, np.s_[0:6, 0:7, 0:8]), damacy.Sample(uri, np.s_[6:12, 0:7, 0:8])])
        with p.pop() as b:
            owned = b.copy()
        assert owned.flags.owndata and owned.flags.writeable
        with p.pop(timeout=30) as b2:  # the copy does not hold the slot
            assert np.array_equal(b2.numpy()[0], arr[6:12, 0:7, 0:8].astype("f4"))
        assert np.array_equal(owned[0], arr[0:6, 0:7, 0:8].astype("f4"))


def test_generator_error_is_raised_at_its_pop(store, make):
    uri, _ = store[1]["u16"]

    def broken():
        yield damacy.Sample(uri, np.s_[0:6, 0:7, 0:8])
        raise RuntimeError("the sampler broke")

    with make(config(n=1)) as p:
        p.push(broken())
        p.push([damacy.Sample(uri, np.s_[2:8, 0:7, 0:8])])
        p.pop().release()
        with pytest.raises(RuntimeError, match="sampler broke"):
            p.pop()
        with p.pop() as b:
            assert b.info.samples[0].aabb[0] == (2, 8)


def _delivered(p) -> list[tuple]:
    """The z ranges of the samples every batch still to come holds, in order."""
    out = []
    for batch in p.batches():
        with batch:
            out.extend(s.aabb[0] for s in batch.info.samples)
    return out


def _box(uri, z):
    return damacy.Sample(uri, np.s_[z : z + 6, 0:7, 0:8])


def test_a_refused_iterable_drops_itself_and_not_the_samples_pulled_before_it(store, make):
    """A sample the batch cannot take drops its iterable only, raised once (by the push
    whose window pulled it, or the next pop): the earlier iterable's samples, pulled in the
    same window, are all delivered, in every mode."""
    uri, _ = store[1]["u16"]
    bad = damacy.Sample(uri, np.s_[0:3, 0:7, 0:8])  # not the batch's sample shape
    errors, got = [], []
    with make(config(n=2, lookahead_samples=2, drop_last=False, on_error="raise")) as p:
        p.push(iter([_box(uri, 0), _box(uri, 1), _box(uri, 2)]))
        try:
            p.push(iter([bad, _box(uri, 9), _box(uri, 10)]))
        except damacy.InvalidArgument as e:
            errors.append(e)
        while True:
            try:
                batch = p.pop()
            except damacy.InvalidArgument as e:
                errors.append(e)
                continue
            except damacy.PipelineDrained:
                break
            with batch:
                got.extend(s.aabb[0] for s in batch.info.samples)
    assert got == [(0, 6), (1, 7), (2, 8)]
    assert len(errors) == 1 and "sample" in str(errors[0])


def test_a_push_that_raises_an_earlier_iterables_error_still_queues_its_own_samples(store, make):
    """An error found ahead in an earlier iterable is raised by the next push (or pop); that
    push's own samples are queued first and delivered."""
    uri, _ = store[1]["u16"]
    bad = damacy.Sample(uri, np.s_[0:3, 0:7, 0:8])
    with make(config(n=2, lookahead_samples=4, on_error="raise")) as p:
        p.push(iter([_box(uri, z) for z in range(4)] + [bad]))
        with p.pop() as batch:
            assert [s.aabb[0] for s in batch.info.samples] == [(0, 6), (1, 7)]
        wait_for(lambda: p._deferred is not None, what="the feeder to find the refused sample")
        with pytest.raises(damacy.InvalidArgument, match="sample"):
            p.push([_box(uri, z) for z in range(10, 14)])
        assert _delivered(p) == [(2, 8), (3, 9), (10, 16), (11, 17), (12, 18), (13, 19)]


def test_a_pipeline_whose_only_push_was_refused_is_drained_at_once(store, make):
    """Nothing left to pull after a refused first window: the next pop says drained at once
    (a daemon session is told the input ended), not after its timeout."""
    uri, _ = store[1]["u16"]
    with make(config(n=2, pop_timeout_s=600)) as p:
        with pytest.raises(damacy.InvalidArgument):
            p.push([damacy.Sample(uri, np.s_[0:3, 0:7, 0:8])])
        with pytest.raises(damacy.PipelineDrained):
            p.pop()


def test_pop_wait_counts_every_pop_those_that_raised_too(store, make):
    """``Stats.pop_wait`` is the time callers waited in ``pop``: a pop that timed out waited
    as long as its timeout and counts, in every mode."""
    uri, _ = store[1]["u16"]
    with make(config(n=2)) as p:
        p.push([_box(uri, 0)])  # half a batch: nothing to deliver yet
        with pytest.raises(damacy.PoolStarved):
            p.pop(timeout=0.2)
        p.push([_box(uri, 1)])
        with p.pop():
            pass
        waited = p.stats().pop_wait
    assert waited.count == 2 and waited.ms >= 200  # the timed-out pop waited its whole 0.2 s: included
    assert waited.best_ms < waited.ms  # the best is one of the two waits, not their sum


def test_a_batch_ends_where_the_input_raised_before_a_later_push(store, make):
    """The samples before the error make a short batch; the next push's samples start a new
    one, in every mode (a daemon client raises the error itself: its push says where)."""
    uri, arr = store[1]["u16"]

    def broken():
        for i in range(6):
            yield damacy.Sample(uri, np.s_[i : i + 1, 0:7, 0:8])
        raise RuntimeError("the sampler broke")

    got = []
    with make(config(n=4, shape=(1, 7, 8))) as p:
        p.push(broken())
        p.push([damacy.Sample(uri, np.s_[i : i + 1, 0:7, 0:8]) for i in range(20, 28)])
        while True:
            try:
                with p.pop() as b:
                    starts = [s.selection[0].start for s in b.info.samples]
                    assert np.array_equal(b.numpy()[:, 0], np.stack([arr[i, 0:7, 0:8] for i in starts]).astype("f4"))
                    got.append(starts)
            except damacy.PipelineDrained:  # (a DamacyError is a RuntimeError: caught first)
                break
            except RuntimeError as e:
                assert "sampler broke" in str(e)
                got.append("raised")
    assert got == [[0, 1, 2, 3], [4, 5], "raised", [20, 21, 22, 23], [24, 25, 26, 27]]


# -- error policies -----------------------------------------------------------------


@pytest.fixture
def damaged(tmp_path):
    """An array with one corrupt chunk, and a uri that does not exist."""
    data = random_data((24, 7, 8), "uint16", 5)
    oracle = write_array(tmp_path / "d", data, chunks=(6, 7, 8), compressors=[ZstdCodec(level=1)], fill_value=3)
    chunk = tmp_path / "d" / "c" / "2" / "0" / "0"
    chunk.write_bytes(b"\x28\xb5\x2f\xfd" + b"\x00" * 20)  # a zstd magic, then garbage
    good = [damacy.Sample(str(tmp_path / "d"), np.s_[i : i + 6, 0:7, 0:8]) for i in (0, 6, 18)]
    corrupt = damacy.Sample(str(tmp_path / "d"), np.s_[12:18, 0:7, 0:8])
    missing = damacy.Sample(str(tmp_path / "nope.zarr"), np.s_[0:6, 0:7, 0:8])
    return oracle, good, corrupt, missing


def stream(good, corrupt, missing):
    # batches of 2: [good0, corrupt], [good1, missing], [good2]
    return [good[0], corrupt, good[1], missing, good[2]]


def test_on_error_stop_is_the_default(damaged, make):
    """on_error="stop" (the default): a bad sample's error is raised at the pop that would
    have held it, and the pipeline stops there: every later pop raises it again, push raises
    ShutdownError."""
    oracle, good, corrupt, missing = damaged
    with make(config(n=2, shape=(6, 7, 8))) as p:
        p.push(stream(good, corrupt, missing))
        with pytest.raises(damacy.DecodeError) as e1:
            p.pop()
        assert "12:18" in str(e1.value) and "chunk [2, 0, 0]" in str(e1.value) and "zstd" in str(e1.value)
        for _ in range(2):
            with pytest.raises(damacy.DecodeError, match="chunk \\[2, 0, 0\\]"):
                p.pop()
        with pytest.raises(damacy.ShutdownError):
            p.push([good[2]])


def test_on_error_raise(damaged, make):
    oracle, good, corrupt, missing = damaged
    with make(config(n=2, shape=(6, 7, 8), on_error="raise", drop_last=False)) as p:
        p.push(stream(good, corrupt, missing))
        with pytest.raises(damacy.DecodeError) as e1:
            p.pop()
        assert "12:18" in str(e1.value) and "chunk [2, 0, 0]" in str(e1.value) and "zstd" in str(e1.value)
        with pytest.raises(damacy.NotFound) as e2:
            p.pop()
        assert "nope.zarr" in str(e2.value) and e2.value.sample is not None
        with p.pop() as b:  # the stream goes on
            assert b.info.samples == (good[2],)
            assert np.array_equal(b.numpy()[0], oracle[18:24].astype("f4"))
        with pytest.raises(damacy.PipelineDrained):
            p.pop()


def test_a_raised_batch_names_all_its_failures_and_samples(damaged, make):
    """on_error="raise": the error a pop raises lists every (sample, error) of its batch and
    every sample it consumed, the same in every mode (damacyd sends them all); the samples it
    consumed are done with, so the end of the stream says drained even while the last batch
    is held."""
    oracle, good, corrupt, missing = damaged
    # past the array's end (24 planes): fails at its pop (a wrong shape is refused at push now)
    beyond = damacy.Sample(corrupt.uri, np.s_[20:26, 0:7, 0:8])
    with make(config(n=3, shape=(6, 7, 8), prepared_batches=1, on_error="raise", drop_last=False)) as p:
        p.push([missing, good[0], beyond, good[1]])
        with pytest.raises(damacy.NotFound) as e:
            p.pop()
        err = e.value
        assert err.batch_samples == (missing, good[0], beyond)
        assert [(s, type(x)) for s, x in err.batch_errors] == [(missing, damacy.NotFound), (beyond, damacy.OutOfBounds)]
        assert err.batch_errors[0][1] is err and "20:26 leaves the array" in str(err.batch_errors[1][1])
        with p.pop() as b:  # held while the stream ends: nothing else is outstanding
            assert b.info.samples == (good[1],)
            assert np.array_equal(b.numpy()[0], oracle[6:12].astype("f4"))
            with pytest.raises(damacy.PipelineDrained):
                p.pop()


@pytest.mark.parametrize("on_error", ["stop", "raise", "fill", "skip"])
def test_a_pushed_item_that_is_no_sample_is_refused(damaged, make, on_error):
    """Whatever the error policy, in every mode: in the window a push pulls, push raises
    InvalidArgument naming it; in a later window, the next pop does. Its iterable is dropped
    with the samples pulled with it (never delivered), and the stream goes on with what is
    pushed next."""
    oracle, good, _, _ = damaged
    junk = "push takes Sample, IndexQuery and ResolvedSpatialQuery items, got str 'junk'"

    def drain(p):
        delivered = []
        for b in p.batches():
            with b:
                for j, s in enumerate(b.info.samples):
                    delivered.append(s)
                    assert np.array_equal(b.numpy()[j], oracle[s.aabb[0][0] : s.aabb[0][1]].astype("f4"))
                assert b.info.errors == () and b.info.skipped == ()
        return delivered

    with make(config(n=2, shape=(6, 7, 8), on_error=on_error, lookahead_samples=2, drop_last=False)) as p:
        with pytest.raises(damacy.InvalidArgument, match=junk):
            p.push([good[0], "junk", good[1], good[2]])
        p.push(good)
        assert drain(p) == good
    with make(config(n=2, shape=(6, 7, 8), on_error=on_error, lookahead_samples=2, drop_last=False)) as p:
        p.push([good[0], good[1], good[2], "junk", good[0]])  # the first window: good[0], good[1]
        with p.pop() as b:
            assert b.info.samples == tuple(good[:2])
        with pytest.raises(damacy.InvalidArgument, match=junk):
            p.pop()
        p.push([good[2]])  # good[2] went with the iterable that held the junk
        assert drain(p) == [good[2]]


def test_on_error_fill(damaged, make):
    oracle, good, corrupt, missing = damaged
    with make(config(n=2, shape=(6, 7, 8), on_error="fill", drop_last=False)) as p:
        p.push(stream(good, corrupt, missing))
        b0, b1 = p.pop(), p.pop()
        b0c, b1c = b0.numpy().copy(), b1.numpy().copy()
        info0, info1 = b0.info, b1.info
        b0.release()
        b1.release()
        b2 = p.pop()
        assert [i for i, _ in info0.errors] == [1] and isinstance(info0.errors[0][1], damacy.DecodeError)
        assert (b0c[1] == 3).all()  # the array's fill value
        assert np.array_equal(b0c[0], oracle[0:6].astype("f4"))
        assert [i for i, _ in info1.errors] == [1] and isinstance(info1.errors[0][1], damacy.NotFound)
        assert (b1c[1] == 0).all()  # no array, no fill value: zeros
        assert b2.info.errors == () and len(b2) == 1
        b2.release()
        assert p.stats_dict()["sample_errors"] == 2


def test_on_error_skip(damaged, make):
    oracle, good, corrupt, missing = damaged
    # one batch in flight at a time, so "the next sample" is well defined
    with make(config(n=2, shape=(6, 7, 8), on_error="skip", lookahead_samples=2, drop_last=False)) as p:
        p.push(stream(good, corrupt, missing))
        samples, sizes = [], []
        for b in p.batches():
            with b:
                for j, s in enumerate(b.info.samples):
                    assert np.array_equal(b.numpy()[j], oracle[s.aabb[0][0] : s.aabb[0][1]].astype("f4"))
                assert b.info.errors == ()
                samples.extend(b.info.samples)
                sizes.append(len(b))
        assert samples == good  # bad ones replaced by the next ones, order kept
        assert sizes == [2, 1]


def _drain_skipping(p, oracle):
    """Pop every batch until drained, each checked against ``oracle``: (batch sizes, samples
    delivered, (sample, error) skipped, from the batches and the drained pop's error)."""
    sizes, got, listed = [], [], []
    while True:
        try:
            b = p.pop()
        except damacy.PipelineDrained as e:
            listed.extend(e.skipped)
            return sizes, got, listed
        with b:
            sizes.append(len(b))
            got.extend(b.info.samples)
            listed.extend(b.info.skipped)
            for j, s in enumerate(b.info.samples):
                assert np.array_equal(b.numpy()[j], oracle[s.aabb[0][0] : s.aabb[0][1]].astype("f4"))


def test_every_skipped_sample_is_listed_once(damaged, make):
    """Skipped samples are listed with their errors by the batches (or, where every batch was
    handed out already, by the drained pop's error), each once: also those of batches left
    with no sample when the input ran out (two batches in flight here, both refilled from a
    tail of bad samples)."""
    oracle, good, corrupt, missing = damaged
    kind = {id(missing): damacy.NotFound, id(corrupt): damacy.DecodeError}
    with make(config(n=3, shape=(6, 7, 8), on_error="skip", lookahead_samples=6, drop_last=False)) as p:
        for stream in ([good[0], *[missing, corrupt] * 6], [good[1], missing, good[2], corrupt, missing]):
            p.push(stream)
            _, got, listed = _drain_skipping(p, oracle)
            assert got == [s for s in stream if s in good]
            assert sorted(map(repr, (s for s, _ in listed))) == sorted(repr(s) for s in stream if s not in good)
            assert all(isinstance(e, kind[id(s)]) for s, e in listed)


def test_skip_with_drop_last_hands_out_full_batches_only(damaged, make):
    """on_error="skip", drop_last=True: a batch whose skipped samples find too few
    replacements is left out like a short last batch (it was handed out short); every
    skipped sample is still listed once."""
    oracle, good, corrupt, missing = damaged
    stream = [s for g in [*good, *good, *good, good[0]] for s in (g, missing)]  # 10 good, 10 bad
    with make(config(n=3, shape=(6, 7, 8), on_error="skip", drop_last=True)) as p:
        p.push(stream)
        sizes, got, listed = _drain_skipping(p, oracle)
        # full batches only (how many depends on which batches were in flight when the input
        # ran out: each one left short is left out with its good samples)
        assert sizes and all(n == 3 for n in sizes) and all(s in good for s in got)
        assert len(listed) == 10 and all(s is missing for s, _ in listed)


def test_skip_when_every_sample_fails(damaged, make):
    _, good, corrupt, missing = damaged
    with make(config(n=2, shape=(6, 7, 8), on_error="skip", lookahead_samples=2, drop_last=False)) as p:
        p.push([corrupt, missing, missing])
        with pytest.raises(damacy.PipelineDrained):
            p.pop()
        p.push([missing, good[0], corrupt, good[1], good[2], missing])
        got = []
        for b in p.batches():
            with b:
                got.extend(b.info.samples)
        assert got == good


def test_native_skip_takes_the_dtype_of_the_samples_that_fill_the_holes(damaged, make):
    """dtype="native": a first batch whose first samples all fail before any array is read
    takes its dtype from the samples that replace them, as every later batch does."""
    oracle, good, _, missing = damaged
    with make(config(n=2, shape=(6, 7, 8), dtype="native", on_error="skip", lookahead_samples=2, drop_last=False)) as p:
        p.push([missing, missing, good[0], good[1], good[2]])
        got = []
        for b in p.batches():
            with b:
                got.append((b.numpy().copy(), b.info.samples, [s for s, _ in b.info.skipped]))
    assert [x.dtype for x, _, _ in got] == [np.dtype("uint16")] * 2
    assert got[0][2] == [missing, missing] and got[0][1] == tuple(good[:2])
    assert np.array_equal(got[0][0], np.stack([oracle[0:6], oracle[6:12]]))


# -- construction -------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(samples_per_batch=0, sample_shape=(4,)), "samples_per_batch"),
        (dict(samples_per_batch=2, sample_shape=(4, -1)), "sample_shape"),
        (dict(samples_per_batch=2, sample_shape=(4, 0, 3)), r"sample_shape entries must be > 0 \(got \(4, 0, 3\)\)"),  # no slot of 0 bytes
        (dict(samples_per_batch=2, sample_shape=(4,), dtype="f128"), "dtype"),
        (dict(samples_per_batch=2, sample_shape=(4,), on_error="ignore"), "on_error"),
        (dict(samples_per_batch=2, sample_shape=(4,), out_of_bounds="clip"), "out_of_bounds"),
        (dict(samples_per_batch=4, sample_shape=(4,), lookahead_samples=2), "lookahead_samples"),
        (dict(samples_per_batch=2, sample_shape=(4,), prepared_batches=0), "prepared_batches"),
        (dict(samples_per_batch=2, sample_shape=(4,), pop_timeout_s=-1), "pop_timeout_s"),
        (dict(samples_per_batch=2, sample_shape=(4,), decode_workers=0), "decode_workers"),
        (dict(samples_per_batch=2, sample_shape=(4,), max_memory_bytes=0), "max_memory_bytes"),
    ],
)
def test_invalid_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):  # the seed's checks raise the built-in errors
        damacy.Config(**kwargs)


def test_budget_too_small_for_slots():
    cfg = damacy.Config(samples_per_batch=8, sample_shape=(64, 256, 256), max_memory_bytes=64 << 20)
    with pytest.raises(damacy.BudgetExceeded, match=r"max_memory_bytes >= (\d+)") as info:
        damacy.Pipeline(cfg)
    needed = 2 * 8 * 64 * 256 * 256 * 4
    assert str(needed) in str(info.value)


def test_bad_samples_are_refused_at_construction(tmp_path):
    # their form where they are made (the seed's built-in errors), their geometry at push
    with pytest.raises(ValueError, match="step"):
        damacy.Sample(tmp_path / "a", np.s_[0:10:2])
    with pytest.raises(TypeError, match="selection axis 0: expected a slice or an iterable of indices, got str"):
        damacy.IndexQuery(tmp_path / "a", ("x",))
    with damacy.Pipeline(config(n=1, shape=(3,))) as p:
        with pytest.raises(damacy.InvalidArgument, match=r"axis 0: the box \[5, 2\) is empty or reversed"):
            p.push([damacy.Sample(tmp_path / "a", ((5, 2),))])
    s = damacy.Sample(tmp_path / "a", np.s_[0:4, 2:6])
    assert s == damacy.Sample(str(tmp_path / "a"), ((0, 4), (2, 6))) and hash(s) == hash(damacy.Sample(str(tmp_path / "a"), ((0, 4), (2, 6))))
    assert s.shape == (4, 4)
    q = damacy.IndexQuery(tmp_path / "a", ([3, 1, 1], slice(0, 5), np.array([7, 0])))
    # (a tuple is an index array in an IndexQuery: the slice spelled otherwise is slice(None, 5))
    assert q.shape == (3, 5, 2) and q == damacy.IndexQuery(str(tmp_path / "a"), ([3, 1, 1], slice(None, 5), [7, 0]))
    assert q.indices == ((3, 1, 1), None, (7, 0)) and q.aabb == ((1, 4), (0, 5), (0, 8))


def test_sample_of_wrong_shape_is_a_sample_error(store, make):
    uri, arr = store[1]["u16"]
    with make(config(n=2, on_error="fill")) as p:
        # a shape known without the array is refused at push (the iterable is dropped)
        with pytest.raises(damacy.InvalidArgument, match=r"its shape \(6, 7, 9\) is not the batch's sample shape \(6, 7, 8\)"):
            p.push([damacy.Sample(uri, np.s_[0:6, 0:7, 0:9]), damacy.Sample(uri, np.s_[0:6, 0:7, 0:8])])
        # one that depends on the array (an open stop: 40:50) is a sample error at pop
        p.push([damacy.Sample(uri, np.s_[0:6, 0:7, 40:]), damacy.Sample(uri, np.s_[0:6, 0:7, 0:8])])
        with p.pop() as b:
            (i, err), = b.info.errors
            assert i == 0 and isinstance(err, damacy.InvalidArgument) and "shape" in str(err)
            assert np.array_equal(b.numpy()[1], arr[0:6, 0:7, 0:8].astype("f4"))


# -- memory ---------------------------------------------------------------------------


def test_memory_stays_under_budget_while_streaming(tmp_path):
    data = random_data((64, 64, 64), "uint16", 6)
    write_array(tmp_path / "m", data, chunks=(16, 16, 16), compressors=[ZstdCodec(level=1)])
    uri = str(tmp_path / "m")
    rng = np.random.default_rng(0)
    budget = 24 << 20
    cfg = config(n=4, shape=(32, 32, 32), max_memory_bytes=budget, lookahead_samples=8, prepared_batches=2, decode_workers=2, out_of_bounds="pad")
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        with damacy.Pipeline(cfg) as p:
            p.push(damacy.Sample(uri, tuple((int(a), int(a) + 32) for a in rng.integers(-8, 40, size=3))) for _ in range(200))
            for batch in p.batches(50):
                batch.release()
            stats = p.stats_dict()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert stats["batches"] == 50
    assert stats["memory"]["peak_bytes"] <= budget
    assert peak <= budget, f"peak {peak} > budget {budget}"


# -- DLPack and slot lifetime -------------------------------------------------------


def test_dlpack_shares_the_slot_and_keeps_it_occupied(store, make):
    uri, arr = store[1]["u16"]
    with make(config(n=1, prepared_batches=1, lookahead_samples=1)) as p:
        p.push(damacy.Sample(uri, np.s_[i : i + 6, 0:7, 0:8]) for i in range(3))
        batch = p.pop()
        x = np.from_dlpack(batch)
        assert x.shape == (1, 6, 7, 8) and x.dtype == np.float32
        assert np.shares_memory(x, batch.numpy())
        assert batch.__dlpack_device__() == (1, 0)
        batch.release()
        with pytest.raises(BufferError):
            batch.numpy()
        # x still uses the only slot: the next batch cannot be assembled yet
        with pytest.raises(damacy.PoolStarved):
            p.pop(timeout=0.5)
        expected = arr[0:6, 0:7, 0:8].astype("f4")
        assert np.array_equal(x[0], expected)  # not overwritten
        del x
        with p.pop(timeout=60) as b:
            assert b.info.batch_id == 1


def test_dlpack_capsules_versioned_and_legacy_and_bf16(store, make):
    import ctypes

    uri, arr = store[1]["u16"]
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    is_valid = ctypes.pythonapi.PyCapsule_IsValid
    is_valid.restype = ctypes.c_int
    is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
    with make(config(n=1, dtype="bf16")) as p:
        p.push([damacy.Sample(uri, np.s_[0:6, 0:7, 0:8])])
        with p.pop() as b:
            v1 = b.__dlpack__(max_version=(1, 0))
            assert is_valid(v1, b"dltensor_versioned")
            ptr = get(v1, b"dltensor_versioned")
            major = ctypes.c_uint32.from_address(ptr).value
            code, bits = ctypes.c_uint8.from_address(ptr + 32 + 20).value, ctypes.c_uint8.from_address(ptr + 32 + 21).value
            assert (major, code, bits) == (1, 4, 16)  # kDLBfloat, 16 bits
            v0 = b.__dlpack__()
            assert is_valid(v0, b"dltensor")
            ptr0 = get(v0, b"dltensor")
            assert ctypes.c_uint8.from_address(ptr0 + 20).value == 4
            del v1, v0
            import ml_dtypes

            y = b.numpy()
            assert y.dtype == ml_dtypes.bfloat16
            assert np.array_equal(y[0].astype("f4"), arr[0:6, 0:7, 0:8].astype("f4").astype(ml_dtypes.bfloat16).astype("f4"))


def test_ml_dtypes_is_imported_only_for_bf16(store):
    """Importing ml_dtypes costs over a second of CPU: a process reading f32 never pays it,
    one asking for bf16 gets it then (its numpy view, and the values, as ml_dtypes rounds)."""
    import subprocess
    import sys

    uri, arr = store[1]["u16"]
    code = f"""
import sys, numpy as np, damacy
for dtype in ("f32", "u16", "native", "bf16"):
    cfg = damacy.Config(samples_per_batch=1, sample_shape=(6, 7, 8), dtype=dtype)
    with damacy.Pipeline(cfg, embedded=True) as p:
        p.push([damacy.Sample({uri!r}, np.s_[0:6, 0:7, 0:8])])
        with p.pop() as b:
            y = b.numpy()
            print(dtype, y.dtype.name, "ml_dtypes" in sys.modules, float(y.astype("f4").sum()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    total = float(arr[0:6, 0:7, 0:8].astype("f4").sum())
    lines = [line.split() for line in out.stdout.splitlines()]
    assert [line[:3] for line in lines] == [
        ["f32", "float32", "False"],
        ["u16", "uint16", "False"],
        ["native", "uint16", "False"],
        ["bf16", "bfloat16", "True"],
    ]
    assert float(lines[0][3]) == total


def test_torch_from_dlpack(store, make):
    torch = pytest.importorskip("torch")
    uri, arr = store[1]["u16"]
    for dtype, tdtype in (("bf16", torch.bfloat16), ("f32", torch.float32)):
        with make(config(n=2, dtype=dtype)) as p:
            p.push([damacy.Sample(uri, np.s_[0:6, 0:7, 0:8]), damacy.Sample(uri, np.s_[6:12, 0:7, 0:8])])
            with p.pop() as b:
                t = torch.from_dlpack(b)
                assert t.dtype == tdtype and tuple(t.shape) == (2, 6, 7, 8)
                want = torch.from_numpy(arr[0:12, 0:7, 0:8].astype("f4").reshape(2, 6, 7, 8)).to(tdtype)
                assert torch.equal(t, want)


def test_chunk_cache_serves_repeated_chunks(store):
    uri, arr = store[1]["f32-sharded"]
    samples = [damacy.Sample(uri, np.s_[0:6, 0:7, 0:8]), damacy.Sample(uri, np.s_[2:8, 3:10, 1:9])] * 3
    # one batch at a time, so each batch finds what the one before put in the cache
    with damacy.Pipeline(config(n=2, chunk_cache_bytes=8 << 20, lookahead_samples=2, prepared_batches=1)) as p:
        p.push(samples)
        for batch in p.batches():
            with batch:
                check_batch(batch, by_uri(store), "f32")
        cache = p.executor.chunk_cache.stats()
    assert cache["misses"] > 0 and cache["hits"] >= 2 * cache["misses"]  # batches 2 and 3 decode nothing
    assert 0 < cache["bytes"] <= 8 << 20


def test_skipped_samples_are_reported_with_their_batch(damaged, make):
    _, good, corrupt, missing = damaged
    with make(config(n=2, shape=(6, 7, 8), on_error="skip", lookahead_samples=2)) as p:
        p.push([good[0], corrupt, good[1]])
        with p.pop() as b:
            assert b.info.samples == (good[0], good[1])
            (sample, err), = b.info.skipped
            assert sample == corrupt and isinstance(err, damacy.DecodeError)


def test_switch_interval_is_lowered_and_restored():
    import sys

    before = sys.getswitchinterval()
    with damacy.Pipeline(config(switch_interval_s=0.0002)):
        assert sys.getswitchinterval() == pytest.approx(0.0002)
        with damacy.Pipeline(config(switch_interval_s=0.0002)):
            pass
        assert sys.getswitchinterval() == pytest.approx(0.0002)  # still one pipeline open
    assert sys.getswitchinterval() == before
    with damacy.Pipeline(config(switch_interval_s=None)):
        assert sys.getswitchinterval() == before


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_index_queries(store, data):
    arrays = list(store[1].values())
    shape = (4, 6, 5)
    queries = []
    for _ in range(data.draw(st.integers(1, 5))):
        uri, arr = data.draw(st.sampled_from(arrays))
        sel = []
        for n, k in zip(arr.shape, shape):
            if data.draw(st.booleans()):  # indices are nonnegative: those past the end are padded
                sel.append(data.draw(st.lists(st.integers(0, 2 * n - 1), min_size=k, max_size=k)))
            else:
                a = data.draw(st.integers(0, n - k))
                sel.append(slice(a, a + k))
        queries.append(damacy.IndexQuery(uri, tuple(sel)))
    with damacy.Pipeline(config(n=2, shape=shape, dtype="f64", **DAMACY_OWN)) as p:
        p.push(queries)
        got = 0
        for batch in p.batches():
            with batch:
                check_batch(batch, by_uri(store), "f64")
                got += len(batch)
        assert got == len(queries)


def test_fill_policy_with_a_nan_fill_value_and_an_integer_batch(tmp_path, make):
    # the fill value (NaN) converted as any element (NaN to an integer: 0), not an exception
    # that loses the batch
    write_array(tmp_path / "n", np.ones((12, 7, 8), "f4"), chunks=(6, 7, 8), compressors=[ZstdCodec(level=1)], fill_value=float("nan"))
    (tmp_path / "n" / "c" / "1" / "0" / "0").write_bytes(b"\x28\xb5\x2f\xfd" + b"\x00" * 20)
    with make(config(n=2, shape=(6, 7, 8), dtype="i16", on_error="fill")) as p:
        p.push([damacy.Sample(str(tmp_path / "n"), np.s_[0:6, 0:7, 0:8]), damacy.Sample(str(tmp_path / "n"), np.s_[6:12, 0:7, 0:8])])
        with p.pop() as b:
            assert [i for i, _ in b.info.errors] == [1]
            x = b.numpy()
            assert (x[0] == 1).all() and (x[1] == 0).all()


def test_relative_uris_name_the_callers_files_in_both_modes(store, make, monkeypatch):
    uri, arr = store[1]["u16"]
    folder, name = os.path.split(uri)
    monkeypatch.chdir(folder)  # the daemon runs elsewhere: the client makes the path absolute
    with make(config(n=2)) as p:
        p.push([damacy.Sample(name, np.s_[0:6, 0:7, 0:8]), damacy.IndexQuery(name, (slice(6, 12), list(range(7)), slice(0, 8)))])
        with p.pop() as b:
            assert b.info.samples[0].uri == name  # the caller's samples come back as given
            assert np.array_equal(b.numpy(), arr[0:12, 0:7, 0:8].astype("f4").reshape(2, 6, 7, 8))
        # file: uris, absolute and relative, as embedded reads them
        p.push([damacy.Sample(f"file:{uri}", np.s_[0:6, 0:7, 0:8]), damacy.Sample(f"file:{name}", np.s_[6:12, 0:7, 0:8])])
        with p.pop() as b:
            assert b.info.errors == ()
            assert np.array_equal(b.numpy(), arr[0:12, 0:7, 0:8].astype("f4").reshape(2, 6, 7, 8))


def test_both_kinds_are_a_damacy_pipeline(make):
    with make(config(n=1)) as p:
        assert isinstance(p, damacy.Pipeline)
    assert issubclass(damacy.EmbeddedPipeline, damacy.Pipeline) and issubclass(damacy.RemotePipeline, damacy.Pipeline)
    assert not isinstance(object(), damacy.Pipeline)


# -- a pop interrupted, or closed under -------------------------------------------------


def _gated(uri, n, gate, at):
    """``n`` samples (one plane each) of ``uri``; the ``at``-th waits for ``gate``."""
    for i in range(n):
        if i == at:
            assert gate.wait(60)
        yield damacy.Sample(uri, np.s_[i : i + 1, 0:7, 0:8])


def test_a_pop_interrupted_while_it_waits_loses_no_batch(store, daemon):
    """Ctrl-C while a daemon pop waits (its request sent): the batch it asked for is the
    next pop's. (The interrupt is raised by the wait itself: a real signal could reach the
    test runner outside the pop.)"""
    uri, arr = store[1]["u16"]
    gate = threading.Event()

    class InterruptedOnce:
        def __init__(self, event):
            self.event, self.fired = event, False

        def wait(self, timeout=None):
            if not self.fired:
                self.fired = True
                raise KeyboardInterrupt
            return self.event.wait(timeout)

        def __getattr__(self, name):
            return getattr(self.event, name)

    with damacy.Pipeline(config(n=2, shape=(1, 7, 8), lookahead_samples=2), endpoint=daemon.endpoint) as p:
        # batch 1 cannot be made before the interrupt (push itself pulls samples 0 to 2)
        p.push(_gated(uri, 6, gate, at=3))
        with p.pop() as b:
            assert b.info.batch_id == 0
        call = p._next_call  # the request for batch 1, sent as batch 0 was handed out
        call.event = InterruptedOnce(call.event)
        with pytest.raises(KeyboardInterrupt):
            p.pop()
        gate.set()
        got = []
        for batch in p.batches():
            with batch:
                got.append((batch.info.batch_id, [s.selection[0].start for s in batch.info.samples]))
                assert np.array_equal(batch.numpy(), arr[got[-1][1][0] : got[-1][1][0] + 2, 0:7, 0:8].astype("f4").reshape(2, 1, 7, 8))
    assert got == [(1, [2, 3]), (2, [4, 5])]  # the batch the interrupted pop waited for is the next one


def test_close_from_another_thread_ends_a_waiting_pop(store, make):
    uri, _ = store[1]["u16"]
    gate = threading.Event()
    p = make(config(n=2, shape=(1, 7, 8), lookahead_samples=2, pop_timeout_s=None))
    p.push(_gated(uri, 4, gate, at=3))  # push itself pulls samples 0 to 2: batch 0 comes, batch 1 cannot
    p.pop().release()
    outcome = []

    def pop():
        try:
            p.pop()
            outcome.append("a batch")
        except BaseException as e:  # noqa: BLE001 - what the pop raised is the outcome
            outcome.append(e)

    t = threading.Thread(target=pop)
    t.start()
    assert wait_for(lambda: waiting_in_pop(t.ident), what="the pop to wait")
    p.close()
    assert wait_for(lambda: not t.is_alive(), what="the pop to end after close")
    gate.set()
    assert len(outcome) == 1 and isinstance(outcome[0], damacy.ShutdownError) and "closed" in str(outcome[0]), outcome


def test_a_pipeline_dropped_without_close_is_collected_and_closed(store, make):
    import gc
    import weakref

    uri, _ = store[1]["u16"]
    p = make(config(n=2))
    p.push(damacy.Sample(uri, np.s_[i : i + 6, 0:7, 0:8]) for i in range(10**6))  # an input without end
    p.pop().release()
    threads = [p._feeder] + ([p._conn._thread] if hasattr(p, "_conn") else [])
    ref = weakref.ref(p)
    del p
    gc.collect()
    assert wait_for(lambda: ref() is None, what="the pipeline to be collected")  # its threads held it only for a step
    assert wait_for(lambda: not any(t.is_alive() for t in threads), what="its threads to end (it was closed)")


@pytest.mark.parametrize("dtype", ["f32", "native"])
def test_each_batch_says_the_address_of_its_own_slot(tmp_path, dtype):
    # batches cycle through the slots: each one's device_ptr is its array's first element,
    # taken from its slot (found once per slot), for a fixed dtype and the array's own
    data = random_data((16, 8, 8), "uint16", seed=4)
    write_array(tmp_path / "a.zarr", data, chunks=(4, 8, 8))
    uri = str(tmp_path / "a.zarr")
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(2, 8, 8), dtype=dtype, prepared_batches=3, pop_timeout_s=30)
    seen = set()
    with damacy.Pipeline(cfg) as p:
        p.push([damacy.Sample(uri, np.s_[z : z + 2, :, :]) for z in range(0, 16, 2)] * 2)
        for k, b in enumerate(p.batches()):
            with b:
                arr = b.numpy()
                assert b.info.device_ptr == arr.__array_interface__["data"][0] == b.info.data
                z = (2 * 2 * k) % 16
                assert np.array_equal(arr, data[z : z + 4].reshape(2, 2, 8, 8).astype(arr.dtype))
                seen.add(b.info.device_ptr)
    assert len(seen) >= 2  # (more than one slot was used)
