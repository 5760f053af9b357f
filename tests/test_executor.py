"""The executor's bookkeeping under pressure: budgets, unexpected errors, in-place reordering."""

from __future__ import annotations

import dataclasses
import gc
import threading
import time

import numpy as np
import pytest
from zarr.codecs import ZstdCodec

import damacy
from damacy_server.engine.budget import MIN_INFLIGHT_BYTES, MemoryBudget, Reservation
from damacy_server.plan.planner import Planner
from damacy_server.plan.resolve import Resolver
from damacy_server.plan.selection import SliceCopy

from conftest import random_data, write_array
from daemon_helpers import wait_for
from pipeline_helpers import composed, cpu_executor_for


@pytest.fixture
def volume(tmp_path):
    data = random_data((32, 64, 64), "uint16", 3)
    oracle = write_array(tmp_path / "v", data, chunks=(8, 32, 32), compressors=[ZstdCodec(level=1)])
    return str(tmp_path / "v"), oracle


def test_unsorted_index_query_with_a_tight_budget(volume):
    uri, oracle = volume
    sample_bytes = 16 * 64 * 64 * 4
    cfg = damacy.Config(samples_per_batch=1, sample_shape=(16, 64, 64), prepared_batches=2, pop_timeout_s=30)
    # the least room beside the slots: one read of the largest chunk admitted
    cfg = dataclasses.replace(cfg, max_memory_bytes=2 * sample_bytes + cfg.cpu_limits.min_inflight_bytes + (1 << 20))
    z = list(range(31, 15, -1))  # reversed: assembled sorted, reordered in place
    y = [63 - i for i in range(64)]
    with damacy.Pipeline(cfg) as p:
        p.push([damacy.IndexQuery(uri, (z, y, slice(0, 64)))] * 3)
        for batch in p.batches():
            with batch:
                assert np.array_equal(batch.numpy()[0], oracle.oindex[z, y, :].astype("f4"))


def test_an_unexpected_error_fails_its_samples_only(volume, monkeypatch):
    uri, oracle = volume
    real = SliceCopy.apply
    calls = []

    def flaky(self, target, arr, convert=None):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real(self, target, arr, convert)

    monkeypatch.setattr(SliceCopy, "apply", flaky)
    monkeypatch.setattr("damacy_server.native.kernel_for", lambda meta, dtype, normalized=False: None)  # the Python path
    # three samples: the last batch is short (drop_last=False delivers it)
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(8, 64, 64), on_error="fill", pop_timeout_s=30, lookahead_samples=2, drop_last=False)
    with damacy.Pipeline(cfg) as p:
        p.push([damacy.Sample(uri, np.s_[0:8, :, :]), damacy.Sample(uri, np.s_[8:16, :, :]), damacy.Sample(uri, np.s_[16:24, :, :])])
        with p.pop() as b:
            (i, err), = b.info.errors
            assert isinstance(err, damacy.DamacyError) and "internal error: RuntimeError: boom" in str(err)
            ok = 1 - i
            assert np.array_equal(b.numpy()[ok], oracle[8 * ok : 8 * ok + 8].astype("f4"))
        with p.pop() as b:  # the stream goes on
            assert b.info.errors == () and np.array_equal(b.numpy()[0], oracle[16:24].astype("f4"))
        assert p.executor.budget.used == p.executor.budget.slots


def test_a_batch_whose_execution_raised_keeps_its_slot_until_its_work_is_reported(volume, monkeypatch):
    """An executor that raises after queuing work (a bug) fails that batch (its pop raises
    BatchFailed) and the stream goes on; the work it queued may still write into the batch's
    slot, so the slot goes back only when that work is reported, and the batch is never
    delivered a second time."""
    uri, oracle = volume
    real = damacy.CpuExecutor.execute
    gate, reporting = threading.Event(), threading.Event()
    calls = []

    def execute(self, plan, targets, on_done, cancelled=lambda: False, key=None):
        calls.append(1)
        if len(calls) > 1:
            return real(self, plan, targets, on_done, cancelled, key)

        def late(errors):  # the queued work, written and reporting after the raise
            def report():
                reporting.set()
                assert gate.wait(30)
                on_done(errors)

            # on a thread of its own: the work may be done before execute returns (on_done is
            # then called on the engine's thread, which must go on to the raise)
            threading.Thread(target=report, daemon=True).start()

        real(self, plan, targets, late, cancelled, key)
        raise RuntimeError("a bug after queuing")

    monkeypatch.setattr(damacy.CpuExecutor, "execute", execute)
    # on_error="raise": the failed batch's pop raises and the next pop goes on
    cfg = damacy.Config(samples_per_batch=1, sample_shape=(8, 64, 64), prepared_batches=1, pop_timeout_s=30, on_error="raise")
    with damacy.Pipeline(cfg) as p:
        p.push([damacy.Sample(uri, np.s_[0:8, :, :]), damacy.Sample(uri, np.s_[8:16, :, :])])
        with pytest.raises(damacy.BatchFailed, match="a bug after queuing"):
            p.pop()
        assert wait_for(reporting.is_set, what="the first batch's work to report")
        assert p.engine.free_slots() == 0 and len(calls) == 1  # the slot is still the first batch's
        gate.set()
        with p.pop() as b:  # the next batch, in the slot once it was given back
            assert np.array_equal(b.numpy()[0], oracle[8:16].astype("f4"))
        assert wait_for(lambda: p.engine.free_slots() == 1, what="the slot back")
        assert not p.engine._ready  # the failed batch was not delivered again


def test_slots_wait_for_chunk_data_in_flight():
    budget = MemoryBudget(MIN_INFLIGHT_BYTES + 1000)
    assert budget.reserve(MIN_INFLIGHT_BYTES + 500, lambda: False) is Reservation.TAKEN  # in flight now
    done = threading.Event()

    def admit():
        budget.admit_slots(1000, "slots")
        done.set()

    t = threading.Thread(target=admit)
    t.start()
    deadline = time.monotonic() + 30
    while budget.waiting == 0 and time.monotonic() < deadline:  # until it waits for room
        time.sleep(0.01)
    assert budget.waiting == 1 and not done.is_set()  # it fits the budget, but only once the reads are done
    budget.release(MIN_INFLIGHT_BYTES + 500)
    assert done.wait(60)
    assert budget.reserve(MIN_INFLIGHT_BYTES + 1, lambda: False) is Reservation.TOO_BIG  # beside the slots it never fits
    with pytest.raises(damacy.BudgetExceeded, match="set max_memory_bytes >="):
        budget.admit_slots(10, "more slots")


def _waiting(budget, n):
    assert wait_for(lambda: budget.waiting == n, what=f"{n} slot admission(s) waiting")


def test_two_slot_admissions_waiting_together_cannot_leave_less_than_the_minimum_in_flight():
    mb = 1 << 20
    budget = MemoryBudget(40 * mb)
    assert budget.reserve(30 * mb, lambda: False) is Reservation.TAKEN
    outcomes = []

    def admit():
        try:
            budget.admit_slots(20 * mb, "2 batch slots")  # 20 + 16 fits 40, but not twice
            outcomes.append("admitted")
        except damacy.BudgetExceeded as e:
            outcomes.append(str(e))

    threads = [threading.Thread(target=admit) for _ in range(2)]
    for t in threads:
        t.start()
    _waiting(budget, 2)
    budget.release(30 * mb)
    for t in threads:
        t.join(60)
    assert sorted(outcomes)[0] == "admitted" and "beside 20971520 held by other slots" in sorted(outcomes)[1], outcomes
    assert budget.capacity >= MIN_INFLIGHT_BYTES


def test_a_waiting_slot_admission_is_not_starved_by_new_reads_in_flight():
    mb = 1 << 20
    budget = MemoryBudget(64 * mb)
    assert budget.reserve(40 * mb, lambda: False) is Reservation.TAKEN
    done = threading.Event()
    t = threading.Thread(target=lambda: (budget.admit_slots(32 * mb, "2 batch slots"), done.set()))
    t.start()
    _waiting(budget, 1)
    assert not budget.try_reserve(8 * mb)  # 40 + 8 fits, but would leave the admission less than it waits for
    took = []
    reader = threading.Thread(target=lambda: took.append(budget.reserve(8 * mb, lambda: False)))
    reader.start()
    budget.release(40 * mb)  # the reads finish: the admission goes first
    assert done.wait(60)
    reader.join(60)
    assert took == [Reservation.TAKEN] and budget.slots == 32 * mb and budget.used == 32 * mb + 8 * mb


def test_a_read_stuck_in_flight_holds_other_reads_back_only_for_a_while(monkeypatch):
    """An admission waits on a read stuck in flight (a stalled server): new reads leave it
    room only for ADMIT_FIRST_S, then go on."""
    from damacy_server.engine import budget as budget_module

    monkeypatch.setattr(budget_module, "ADMIT_FIRST_S", 0.2)
    monkeypatch.setattr(budget_module, "SLOT_WAIT_S", 60.0)
    mb = 1 << 20
    budget = MemoryBudget(64 * mb)
    assert budget.reserve(40 * mb, lambda: False) is Reservation.TAKEN  # stuck
    t = threading.Thread(target=budget.admit_slots, args=(32 * mb, "2 batch slots"))
    t.start()
    _waiting(budget, 1)
    assert wait_for(lambda: budget.try_reserve(8 * mb), what="new reads to go on")  # not for the whole wait
    budget.release(48 * mb)  # the reads end: the admission gets in
    t.join(60)
    assert not t.is_alive() and budget.slots == 32 * mb


def test_the_planner_takes_cached_units_out_and_fits_reads_to_the_budget(tmp_path):
    from zarr.codecs import BytesCodec, ShardingCodec

    from damacy_server.cache import LRUCache
    from damacy_server.plan.units import unit_key

    data = random_data((8, 64, 64), "uint16", 5)
    write_array(tmp_path / "s", data, chunks=(8, 64, 64), serializer=ShardingCodec(chunk_shape=(8, 32, 32), codecs=[BytesCodec(), ZstdCodec(level=1)]))
    box = damacy.Sample(str(tmp_path / "s"), np.s_[0:8, 0:64, 0:64])  # four units of one shard
    planner = Planner(Resolver(), damacy.PlanLimits(max_gap_bytes=1 << 30, max_read_bytes=1 << 30))
    plain = planner.plan([box], (8, 64, 64))
    (group,) = plain.groups
    units = group.units
    assert len(units) == 4 and plain.cached == []
    # a budget too small for the merged read splits it unit by unit
    one = max(g.reserve_nbytes for g in planner.plan([damacy.Sample(box.uri, np.s_[0:8, 0:32, 0:32])], (8, 32, 32)).groups)
    tight = planner.plan([box], (8, 64, 64), capacity=one)
    assert [len(g.units) for g in tight.groups] == [1, 1, 1, 1]
    # units in the cache leave their reads and come with their arrays
    cache = LRUCache(8)
    arr = np.zeros((8, 32, 32), dtype="u2")
    cache.put(unit_key(units[0].meta, units[0].unit), arr)
    planned = planner.plan([box], (8, 64, 64), cache=cache)
    (block,) = planned.cached
    assert [(block.unit(p), a is arr) for p, a in enumerate(block.arrays)] == [(units[0].unit, True)]
    # its copies are the head of the table: every copy of unit 0, and only those
    assert set(block.rows[:, 0].tolist()) == {0} and len(block.rows) == int((block.table.rows[:, 0] == 0).sum())
    assert [u.unit for g in planned.groups for u in g.units] == [u.unit for u in units[1:]]


def test_an_executor_serves_one_pipeline_then_the_next_and_each_returns_its_slots(volume):
    # an executor serves one open pipeline at a time (a second is refused), and the next
    # once that one is closed, with a budget of its own: a slot of the first still held past
    # its close stays in the first's budget, outside the next one's (as the seed API says of
    # results retained across restarts), and goes back there once its memory is gone
    uri, oracle = volume
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(8, 32, 32), dtype="u16", pop_timeout_s=60)
    executor = cpu_executor_for(cfg, max_memory_bytes=256 << 20, decode_workers=2)
    samples = [damacy.Sample(uri, np.s_[z : z + 8, 0:32, 0:32]) for z in (0, 8, 16, 24)]
    try:
        first = composed(cfg, executor=executor)
        with pytest.raises(damacy.InvalidArgument, match="another pipeline that is still open"):
            composed(cfg, executor=executor)
        first.push(samples)
        held = None
        for batch in first.batches():
            with batch:
                held = batch.numpy()  # a view of first's slot, kept past its close
        one_slot = first.slot_bytes // 2  # 2 slots of 2 samples
        first_budget = executor.budget
        first.close()
        assert first_budget.slots == one_slot  # the slot still held
        second = composed(cfg, executor=executor)  # the executor serves the next pipeline
        assert executor.budget is not first_budget and executor.budget.slots == second.slot_bytes
        second.push(samples)
        got = [b.copy() for b in second.batches()]
        np.testing.assert_array_equal(np.concatenate(got), np.stack([oracle[s.selection] for s in samples]))
        np.testing.assert_array_equal(held, oracle[16:32, 0:32, 0:32].reshape(2, 8, 32, 32))
        del held, batch
        gc.collect()
        assert first_budget.slots == first_budget.used == 0  # first's back once its memory is gone
        assert executor.budget.slots == second.slot_bytes
        second.close()
        assert executor.budget.slots == executor.budget.used == 0
    finally:
        executor.close()


def test_a_slot_that_cannot_be_allocated_leaves_the_budget_as_it_was(volume, monkeypatch):
    import damacy_server.engine.slots as slots

    executor = damacy.CpuExecutor(reader=damacy.FileReader(), limits=damacy.CpuLimits(max_memory_bytes=256 << 20))
    made = []
    real = np.zeros

    def second_fails(n, dtype=float):
        if len(made) == 1:
            raise MemoryError("no room for a second slot")
        made.append(n)
        return real(n, dtype=dtype)

    monkeypatch.setattr(slots.np, "zeros", second_fails)
    try:
        with pytest.raises(MemoryError):
            composed(damacy.Config(samples_per_batch=2, sample_shape=(8, 32, 32), prepared_batches=2), executor=executor)
        gc.collect()
        assert (executor.budget.slots, executor.budget.used) == (0, 0)
    finally:
        executor.close()


def test_closing_mid_stream_returns_every_reservation(tmp_path):
    # closed with reads and decodes queued: each still runs, sees the close and gives back
    # what it reserved and the units it registered (the decode thread is held until the
    # close has begun, so tasks are queued behind it when it does)
    write_array(tmp_path / "p", random_data((32, 256, 256), "uint16", 4), chunks=(16, 64, 64), compressors=[ZstdCodec(level=1)])
    samples = [damacy.Sample(str(tmp_path / "p"), np.s_[z, 0:256, 0:256]) for z in range(32)] * 2
    for _ in range(3):
        p = damacy.Pipeline(damacy.Config(samples_per_batch=2, sample_shape=(256, 256), prepared_batches=3, decode_workers=1, n_io_threads=1))
        hold = threading.Event()
        p.executor._decode.submit(hold.wait, 60)
        p.push(samples)
        # a batch's reads queued behind the held thread, the next batches waiting for its units
        ex = p.executor
        assert wait_for(lambda ex=ex: ex.queue_depths()["decode"] >= 1 and len(ex.inflight) > 0, what="reads queued behind the held thread")
        closing = threading.Thread(target=p.close)
        closing.start()
        assert wait_for(lambda ex=ex: ex._closed, what="the close to begin")
        hold.set()
        closing.join(60)
        assert not closing.is_alive()
        assert p.executor.budget.used == p.executor.budget.slots == 0
        assert len(p.executor.inflight) == 0


def test_an_executor_given_inline_goes_with_its_pipeline(volume):
    # the composed form: the pipeline claims the executor it was given and closes it as it
    # closes: its workers exit
    uri, _ = volume
    cfg = damacy.Config(samples_per_batch=1, sample_shape=(8, 32, 32))
    pipe = composed(cfg, executor=cpu_executor_for(cfg))
    pipe.push([damacy.Sample(uri, np.s_[0:8, 0:32, 0:32])] * 2)
    for batch in pipe.batches():
        batch.release()
    workers = [*pipe.executor._io._threads, *pipe.executor._decode._threads]
    assert workers and all(t.is_alive() for t in workers)
    pipe.close()
    deadline = time.monotonic() + 60
    while any(t.is_alive() for t in workers) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.is_alive() for t in workers)
