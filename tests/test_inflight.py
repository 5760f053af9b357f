"""Units in flight are decoded once: a batch that needs a unit another batch is decoding
waits for it, and gets its data, its error, its fill value, or reads it itself when that
batch is cancelled first."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from zarr.codecs import ZstdCodec

import damacy
from damacy_protocol.errors import DecodeError
from damacy_server.cpu.inflight import InFlight
from damacy_server.plan.planner import Planner
from damacy_server.plan.resolve import Resolver
from damacy_server.plan.units import unit_key
from damacy_server.store.file import FileReader

from conftest import random_data, write_array
from daemon_helpers import wait_for

SHAPE = (16, 32, 32)
CHUNKS = (4, 16, 16)
BOXES = [np.s_[0:8, 0:20, 4:30], np.s_[6:14, 10:32, 0:16], np.s_[2:6, 0:32, 0:32]]


# -- the registry ------------------------------------------------------------------------


def test_one_owner_and_its_waiters():
    reg = InFlight()
    got = []
    owner = reg.claim_or_join("k", got.append)
    assert owner is not None and len(reg) == 1
    assert reg.claim_or_join("k", lambda *a: got.append(a)) is None  # waits
    assert reg.start(owner, whole=False)  # someone waits: decode whole
    arr = np.arange(4)
    reg.settle(owner, array=arr)
    assert got == [(arr, None, False)] and len(reg) == 0
    reg.settle(owner, error=DecodeError("late"))  # settled once
    assert len(got) == 1 and reg.stats() == {"in_flight": 0, "joined": 1}


def test_claims_of_many_keys_are_claims_of_each():
    reg = InFlight()
    asked = []
    first = reg.claim_or_join_many(["a", "b"], lambda i: asked.append(i))
    assert all(first) and asked == [] and len(reg) == 2  # nobody had them: no waiter made
    got = []
    again = reg.claim_or_join_many(["b", "c", "a"], lambda i: (lambda *r: got.append((i, *r))))
    assert again[0] is None and again[1] is not None and again[2] is None and len(reg) == 3
    assert reg.stats()["joined"] == 2
    reg.settle(first[1], array=np.zeros(1))
    reg.settle(first[0], missing=True)
    assert [(i, m) for i, _, _, m in got] == [(0, False), (2, True)]  # key 0 ("b"), then key 2 ("a")


def test_a_unit_decoded_in_part_takes_no_waiters():
    reg = InFlight()
    owner = reg.claim_or_join("k", None)
    assert not reg.start(owner, whole=False)  # nobody waits: a prefix is enough
    again = reg.claim_or_join("k", None)  # a later batch decodes it itself
    assert again is not None and again is not owner
    assert reg.start(again, whole=True) and reg.start(again, whole=False)  # whole stays whole


def test_abandoned_and_missing_reach_the_waiters():
    reg = InFlight()
    got = []
    owner = reg.claim_or_join("a", None)
    reg.claim_or_join("a", lambda *a: got.append(("a", *a)))
    other = reg.claim_or_join("b", None)
    reg.claim_or_join("b", lambda *a: got.append(("b", *a)))
    reg.settle(owner)
    reg.settle(other, missing=True)
    assert got == [("a", None, None, False), ("b", None, None, True)]


# -- the executor --------------------------------------------------------------------------


class GatedReader(FileReader):
    """Reads wait for a gate (no direct reads: every read goes through the I/O threads)."""

    def __init__(self) -> None:
        super().__init__(workers=2)
        self.gate = threading.Event()
        self.reads = 0

    @property
    def direct(self):  # hides FileReader.direct: decode threads do not read themselves
        raise AttributeError("direct")

    def read(self, key):
        self.gate.wait(30)
        self.reads += 1
        return super().read(key)

    def read_range(self, key, offset, length):
        self.gate.wait(30)
        self.reads += 1
        return super().read_range(key, offset, length)


@pytest.fixture(autouse=True)
def share_small_units(monkeypatch):
    """The test volume's units are small (2 KiB); share them anyway."""
    monkeypatch.setattr("damacy_server.cpu.sharing.SHARE_MIN_BYTES", 0)


@pytest.fixture
def volume(tmp_path):
    data = random_data(SHAPE, "uint16", 5)
    write_array(tmp_path / "v", data, chunks=CHUNKS, compressors=[ZstdCodec(level=1)])
    return str(tmp_path / "v"), data


def plan_of(samples, sample_shape, **kwargs):
    """The plan of one batch, by the planning machinery itself (a planner of its own)."""
    return Planner(Resolver(), damacy.PlanLimits()).plan(samples, sample_shape, **kwargs)


def cpu_executor(reader, **limits):
    """A CPU executor reading through ``reader``, with ``CpuLimits(**limits)`` (2 GiB of
    memory unless given)."""
    limits.setdefault("max_memory_bytes", 2 << 30)
    return damacy.CpuExecutor(reader=reader, limits=damacy.CpuLimits(**limits))


def run_plan(executor, uri, boxes, cancelled=lambda: False):
    """Start a batch for each of ``boxes``; returns (outputs, finished events, errors by box,
    unit references over the batches)."""
    samples = [damacy.Sample(uri, b) for b in boxes]
    shapes = [s.shape for s in samples]
    plans = [plan_of([s], shape, capacity=executor.inflight_capacity) for s, shape in zip(samples, shapes)]
    outs, events, errors = [], [], {}
    for k, (plan, shape) in enumerate(zip(plans, shapes)):
        out = np.full(shape, -1, dtype="f4")
        done = threading.Event()

        def finished(errs, k=k, done=done):
            if errs:  # the plan's first failed sample
                errors[k] = next(iter(errs.values()))
            done.set()

        executor.execute(plan, [out], finished, cancelled)
        outs.append(out)
        events.append(done)
    return outs, events, errors, sum(len(g.units) for plan in plans for g in plan.groups)


def wait_all(events):
    for e in events:
        assert e.wait(60), "a batch never finished"


@pytest.mark.parametrize("native", [True, False])
def test_a_unit_in_flight_is_decoded_once(volume, native):
    uri, data = volume
    reader = GatedReader()
    executor = cpu_executor(reader, decode_workers=2, native=native)
    try:
        first, done1, err1, refs = run_plan(executor, uri, BOXES)  # the boxes overlap
        units = len(executor.inflight)
        assert units > 0  # registered, held at the gate
        second, done2, err2, more = run_plan(executor, uri, BOXES)  # the same units again
        assert len(executor.inflight) == units
        assert executor.inflight.stats()["joined"] == refs + more - units  # all but the first of each
        reader.gate.set()
        wait_all(done1 + done2)
        assert not err1 and not err2
        for out1, out2, box in zip(first, second, BOXES):
            want = data[box].astype("f4")
            assert np.array_equal(out1, want) and np.array_equal(out2, want)
        stages = executor.stats.snapshot()
        assert stages["decode"]["count"] == units and stages["shared"]["count"] == refs + more - units
        assert len(executor.inflight) == 0
    finally:
        executor.close()


def test_a_cancelled_owner_leaves_its_waiters_to_read_alone(volume):
    uri, data = volume
    reader = GatedReader()
    executor = cpu_executor(reader, decode_workers=2)
    stop = threading.Event()
    try:
        _, done1, _, _ = run_plan(executor, uri, BOXES, cancelled=stop.is_set)
        second, done2, err2, _ = run_plan(executor, uri, BOXES)
        stop.set()  # the owner's batch goes before its reads are made
        reader.gate.set()
        wait_all(done1 + done2)
        assert not err2
        for out, box in zip(second, BOXES):
            assert np.array_equal(out, data[box].astype("f4"))
        assert len(executor.inflight) == 0
    finally:
        executor.close()


def test_an_abandoned_unit_the_budget_cannot_hold_fails_its_waiters(volume, monkeypatch):
    """A waiter reading an abandoned unit alone keeps to the memory budget: a unit more than
    it can ever hold fails, as it failed its owner, rather than being read outside it."""
    uri, data = volume
    executor = cpu_executor(FileReader(), decode_workers=2, max_memory_bytes=1 << 20)
    monkeypatch.setattr(executor.budget, "min_inflight", 0)  # the test's units are KiB
    try:
        box = np.s_[0:4, 0:16, 0:16]  # one unit
        plan = plan_of([damacy.Sample(uri, box)], (4, 16, 16))
        (unit,) = [u for g in plan.groups for u in g.units]
        owner = executor.inflight.claim_or_join(unit_key(unit.meta, unit.unit), None)  # another batch's
        out, done, errors = np.full((4, 16, 16), -1, dtype="f4"), threading.Event(), {}
        executor.execute(plan, [out], lambda errs: (errors.update(errs), done.set()))
        assert executor.inflight.stats()["joined"] == 1
        executor.reserve_slots(executor.inflight_capacity - 1024, "slots")  # the budget shrinks
        executor.inflight.settle(owner)  # abandoned: the waiter reads it alone
        assert done.wait(60)
        assert set(errors) == {0} and "raise max_memory_bytes" in str(errors[0]) and (out == -1).all()
        executor.budget.release_slots(executor.budget.slots)
        # with room, the abandoned unit is read alone and copied
        owner = executor.inflight.claim_or_join(unit_key(unit.meta, unit.unit), None)
        done.clear()
        errors.clear()
        executor.execute(plan, [out], lambda errs: (errors.update(errs), done.set()))
        executor.inflight.settle(owner)
        assert done.wait(60) and not errors and np.array_equal(out, data[box].astype("f4"))
        assert wait_for(lambda: executor.budget.used == 0, what="the budget to be returned")
    finally:
        executor.close()


@pytest.mark.parametrize("native", [True, False])
def test_waiters_get_the_owners_error_and_fill(volume, tmp_path, native):
    uri, data = volume
    (tmp_path / "v" / "c" / "0" / "0" / "0").write_bytes(b"\x28\xb5\x2f\xfd" + b"\x00" * 12)  # corrupt
    (tmp_path / "v" / "c" / "3" / "1" / "1").unlink()  # never written: the fill value (0)
    reader = GatedReader()
    executor = cpu_executor(reader, decode_workers=2, native=native)
    boxes = [np.s_[0:4, 0:16, 0:16], np.s_[12:16, 16:32, 16:32], np.s_[4:8, 0:32, 0:32]]
    try:
        first, done1, err1, _ = run_plan(executor, uri, boxes)
        second, done2, err2, _ = run_plan(executor, uri, boxes)
        assert executor.inflight.stats()["joined"] > 0
        reader.gate.set()
        wait_all(done1 + done2)
        for errs, outs in ((err1, first), (err2, second)):
            assert set(errs) == {0} and isinstance(errs[0], DecodeError) and errs[0].chunk == (0, 0, 0)
            assert not outs[1].any()  # the missing chunk: its fill value
            assert np.array_equal(outs[2], data[4:8].astype("f4"))
    finally:
        executor.close()


def test_overlapping_batches_in_flight_read_right(volume):
    """End to end: a pipeline whose batches in flight share units gives each its data."""
    uri, data = volume
    rng = np.random.default_rng(0)
    starts = [tuple(int(rng.integers(0, n - b + 1)) for n, b in zip(SHAPE, (4, 16, 16))) for _ in range(24)]
    samples = [damacy.Sample(uri, tuple((a, a + b) for a, b in zip(s, (4, 16, 16)))) for s in starts]
    cfg = damacy.Config(samples_per_batch=4, sample_shape=(4, 16, 16), pop_timeout_s=30, lookahead_samples=12, prepared_batches=3)
    got = []
    with damacy.Pipeline(cfg) as p:
        p.push(samples)
        for b in p.batches():
            with b:
                got.append(b.copy())
    want = [np.stack([data[tuple(slice(a, b) for a, b in s.aabb)] for s in samples[i : i + 4]]).astype("f4") for i in range(0, 24, 4)]
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_small_units_are_not_shared(volume, monkeypatch):
    """Below SHARE_MIN_BYTES a unit's decode costs less than sharing it: nothing registers."""
    monkeypatch.setattr("damacy_server.cpu.sharing.SHARE_MIN_BYTES", 1 << 20)
    uri, data = volume
    reader = GatedReader()
    executor = cpu_executor(reader, decode_workers=2)
    try:
        first, done1, _, _ = run_plan(executor, uri, BOXES)
        second, done2, _, _ = run_plan(executor, uri, BOXES)
        assert len(executor.inflight) == 0 and executor.inflight.stats()["joined"] == 0
        reader.gate.set()
        wait_all(done1 + done2)
        for out, box in zip(first + second, BOXES + BOXES):
            assert np.array_equal(out, data[box].astype("f4"))
    finally:
        executor.close()


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("cache", [True, False, "budget full"])
def test_units_waited_for_are_copied_together_once_they_arrive(volume, native, cache):
    """A batch waiting for units another batch decodes into the chunk cache copies those that
    have arrived in one task, not one task each: here every unit arrives before the copy task
    gets a thread. The memory budget counts them while they wait (the cache may evict them
    meanwhile): with no room left there ("budget full"), each is copied at once, in the task
    that decoded it, as without the cache, where a unit's array lives only as long as its
    owner's task (the budget counts it there)."""
    uri, data = volume
    reader = GatedReader()
    executor = cpu_executor(reader, decode_workers=1, native=native, chunk_cache_bytes=(64 << 20) if cache else 0)
    copies = []
    real = executor._copy_cached

    def spy(run, blocks, late, reports=1, release=0):
        copies.append((run, len(late), reports))
        real(run, blocks, late, reports, release)

    executor._copy_cached = spy
    started, hold = threading.Event(), threading.Event()

    def blocker():  # holds the one decode thread until every read has landed
        started.set()
        hold.wait(120)

    try:
        first, done1, err1, refs = run_plan(executor, uri, BOXES[2:])
        second, done2, err2, _ = run_plan(executor, uri, BOXES[2:])
        joined = executor.inflight.stats()["joined"]
        assert joined == refs > 1  # the second batch waits for every unit of the first
        executor._decode.submit(blocker, priority=-1)
        assert started.wait(30)
        if cache == "budget full":  # no room for units to wait in, whenever they arrive
            executor.budget.try_reserve = lambda nbytes: False
        reader.gate.set()
        wait_for(lambda: executor._decode.queued() == refs, what="the first batch's decodes queued")
        hold.set()
        wait_all(done1 + done2)
        assert not err1 and not err2
        want = data[BOXES[2]].astype("f4")
        assert np.array_equal(first[0], want) and np.array_equal(second[0], want)
        waited = [(n, r) for run, n, r in copies if n]
        if cache is True:
            assert waited == [(joined, joined)]  # one task copied them all and reported them all
        else:
            assert waited == [(1, 1)] * joined
        assert executor.stats.snapshot()["shared"]["count"] == joined
        # every reservation returned: the reads', and what counted the units while they waited
        assert executor.budget.used == executor.budget.slots
    finally:
        hold.set()
        executor.close()


@pytest.mark.parametrize("native", [True, False])
def test_units_one_task_settles_for_a_waiting_batch_are_copied_in_one_go(tmp_path, native):
    """With no chunk cache a unit another batch waits for is copied in the task that decoded
    it (its memory goes with that task); the units one task decodes (a shard's, read in one
    go) are copied for a waiting batch together at the task's end, one copy per batch and
    plan table, not one per unit, and read right."""
    data = random_data(SHAPE, "uint16", 6)
    write_array(tmp_path / "s", data, chunks=CHUNKS, shards=(8, 32, 32), compressors=[ZstdCodec(level=1)])
    uri = str(tmp_path / "s")
    reader = GatedReader()
    executor = cpu_executor(reader, decode_workers=1, native=native)
    copies = []
    real = executor._copy_cached

    def spy(run, blocks, late, reports=1, release=0):
        copies.append((len(late), reports))
        real(run, blocks, late, reports, release)

    executor._copy_cached = spy
    box = [np.s_[0:8, 0:32, 0:32]]  # one shard: its 8 units in one read, decoded by one task
    try:
        first, done1, err1, refs = run_plan(executor, uri, box)
        second, done2, err2, _ = run_plan(executor, uri, box)
        assert executor.inflight.stats()["joined"] == refs == 8
        reader.gate.set()
        wait_all(done1 + done2)
        assert not err1 and not err2
        want = data[box[0]].astype("f4")
        assert np.array_equal(first[0], want) and np.array_equal(second[0], want)
        assert [c for c in copies if c[0]] == [(8, 8)]  # the waiting batch's eight units in one copy
        assert executor.stats.snapshot()["shared"]["count"] == 8
        assert executor.budget.used == executor.budget.slots
    finally:
        executor.close()
