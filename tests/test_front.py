"""The front half both pipelines share, on its own: lazy pulls, deferred errors, messages."""

from __future__ import annotations

import threading

import pytest

import damacy
from damacy_protocol.config import Config
from damacy_protocol.errors import InvalidArgument
from damacy_runtime import front


def test_sources_pull_lazily_in_push_order_and_hand_back_errors():
    sources = front.Sources(threading.Condition())
    pulled = []

    def gen():
        for i in range(3):
            pulled.append(i)
            yield i
        raise RuntimeError("the caller's generator broke")

    sources.add(gen())
    sources.add(["a", "b"])
    assert pulled == []  # nothing runs until a pull
    # (a full pull pulls the next sample ahead, to know whether its iterable has ended)
    assert sources.pull(2) == ([0, 1], None) and pulled == [0, 1, 2]
    out, err = sources.pull(5)
    assert out == [2] and isinstance(err, RuntimeError)  # cut short at the failure
    assert sources.pull(5) == (["a", "b"], None) and not sources  # the broken iterable was dropped


def test_a_refused_sample_cuts_the_pull_but_not_its_iterable():
    sources = front.Sources(threading.Lock())
    sources.add([1, "bad", 3])

    def convert(x):
        if x == "bad":
            raise InvalidArgument("not a sample")
        return x * 10

    out, err = sources.pull(5, convert=convert)
    assert out == [10] and isinstance(err, InvalidArgument)
    assert sources.pull(5, convert=convert) == ([30], None)
    stopped = front.Sources(threading.Lock())
    stopped.add(range(10))
    assert stopped.pull(5, stop=lambda: True) == ([], None) and stopped


def test_push_refuses_what_is_not_an_iterable_of_samples():
    for bad in ("/data/a.zarr", b"x", 7):
        with pytest.raises(TypeError, match="iterable of samples"):
            front.Sources.check(bad)


def test_batch_info_and_timeout_messages():
    cfg = Config(samples_per_batch=4, sample_shape=(2, 3), dtype="native")
    info = front.batch_info(cfg.output, 3, "uint16", 7, ["s0", "s1", "s2"])
    assert info.shape == (3, 2, 3) and info.dtype == damacy.Dtype.U16 and info.batch_id == 7 and info.samples == ("s0", "s1", "s2")
    assert front.batch_info(Config(samples_per_batch=4, sample_shape=(2,)).output, 4, "uint16", 0, []).dtype == damacy.Dtype.F32
    held = front.pop_timeout(3, 0.5, front.SLOTS_HELD, 2)
    assert isinstance(held, damacy.SlotsHeld) and isinstance(held, damacy.PoolStarved)
    assert str(held).startswith("all 2 batch slots are held by batches that were not released, or by arrays exported")
    assert "batch.copy()" in str(held) and "within" not in str(held)
    late = front.pop_timeout(3, 0.5, front.WAITING_FOR_INPUT, 2)
    assert type(late) is damacy.PoolStarved and "yield samples" in str(late)
    assert str(front.pop_timeout(3, 0.5, front.WORKING, 2, 1, " in damacyd")) == (
        "Pipeline.pop() timed out: no batch 3 within 0.5s: its reads and decodes are still running in damacyd (1 slots in use). "
        "If the loop keeps earlier batches (or tensors made from them), their memory cannot be filled again: release them, "
        "or copy what must be kept"
    )
    assert front.deadline(None) is None and front.deadline(float("inf")) is None and front.time_left(None) is None


class FakeEngine:
    """A batch engine as the core sees it: slots, starts, patches, idleness."""

    def __init__(self, slots: int) -> None:
        self.cond = threading.Condition()
        self.slots = slots
        self.log: list[tuple] = []
        self.patches: list = []
        self.busy = 0

    def free_slots(self) -> int:
        return self.slots

    def start(self, samples):
        self.slots -= 1
        self.busy += 1
        self.log.append(("start", list(samples)))

    def start_error(self, error):
        self.log.append(("error", str(error)))

    def take_patch(self):
        return self.patches.pop(0) if self.patches else None

    def refill(self, patch, samples):
        self.log.append(("refill", list(samples)))

    def patches_waiting(self) -> bool:
        return bool(self.patches)

    def idle(self) -> bool:
        return not self.busy and not self.patches


class FakePatch:
    def __init__(self, dropped):
        self.dropped = dropped
        self.needed = len(dropped)


def test_the_core_starts_a_batch_when_a_slot_is_free_and_keeps_to_the_lookahead():
    from damacy_runtime.core import FrontCore

    engine = FakeEngine(slots=1)
    core = FrontCore(engine, samples_per_batch=2, lookahead=5)
    assert core.room() == 5
    core.add(["a"], final=False)
    core.pump()
    assert engine.log == [] and not core.can_pump()  # half a batch: wait for more
    core.add(["b", "c", "d"], final=False)
    assert core.room() == 1 and core.can_pump()
    core.pump()
    assert engine.log == [("start", ["a", "b"])] and core.queued == 2
    assert core.waiting_for_slot() and not core.can_pump()  # the next batch waits for a slot
    engine.slots += 1
    core.pump()
    assert engine.log[-1] == ("start", ["c", "d"]) and core.queued == 0
    core.delivered(2)
    assert core.room() == 3


def test_the_core_starts_the_rest_of_a_final_input_or_keeps_it_for_a_later_push_under_drop_last():
    from damacy_runtime.core import FrontCore

    for drop_last, want in ((False, [("start", ["a", "b"]), ("start", ["c"])]), (True, [("start", ["a", "b"])])):
        engine = FakeEngine(slots=4)
        core = FrontCore(engine, samples_per_batch=2, lookahead=8, drop_last=drop_last)
        core.add(["a", "b", "c"], final=True)
        core.pump()
        assert engine.log == want
        assert core.take_discarded() == []  # nothing is left out
        assert core.outstanding == 3 and core.queued == (1 if drop_last else 0)
        if drop_last:  # the short batch waits, queued: a later push completes it
            engine.busy = 0
            assert core.short_tail() == 1 and not core.drained()
            core.add(["d"], final=True)
            core.pump()
            assert engine.log[-1] == ("start", ["c", "d"]) and core.queued == 0


def test_the_core_refills_skipped_samples_from_the_queue_in_order():
    from damacy_runtime.core import FrontCore

    engine = FakeEngine(slots=1)
    core = FrontCore(engine, samples_per_batch=2, lookahead=8)
    core.add(["a", "b"], final=False)
    core.pump()
    engine.patches.append(FakePatch([("a", ValueError("bad a"))]))
    core.pump()
    assert [s for s, _ in core.take_dropped()] == ["a"] and core.outstanding == 1
    assert engine.log == [("start", ["a", "b"])]  # the patch waits for a sample to take a's place
    core.add(["c", "d"], final=False)
    core.pump()
    assert engine.log[-1] == ("refill", ["c"]) and core.queued == 1


def test_an_error_of_the_input_comes_after_the_samples_before_it():
    from damacy_runtime.core import FrontCore

    engine = FakeEngine(slots=4)
    core = FrontCore(engine, samples_per_batch=3, lookahead=8)
    core.add(["a"], final=False, error=RuntimeError("the generator broke"))
    core.pump()
    assert engine.log == [("start", ["a"]), ("error", "the generator broke")]  # a short batch, then the error


def test_the_core_is_drained_only_with_a_final_input_and_nothing_in_flight():
    from damacy_runtime.core import FrontCore

    engine = FakeEngine(slots=1)
    core = FrontCore(engine, samples_per_batch=2, lookahead=4)
    assert not core.drained()  # no input said it was final
    core.add(["a", "b"], final=True)
    assert not core.drained()  # queued
    core.pump()
    assert not core.drained()  # in the engine
    engine.busy = 0
    assert core.drained()
    core.add(["c"], final=False)  # a new push: not drained any more
    assert not core.drained()


def test_a_patch_is_refilled_short_when_an_input_error_is_queued_before_later_samples():
    """[x, <error>, y, z]: a patch needing 2 takes x and the batch ends at the error (it must
    not wait for input before the error, which can never come), then the error goes out."""
    from damacy_runtime.core import FrontCore

    engine = FakeEngine(slots=1)
    core = FrontCore(engine, samples_per_batch=2, lookahead=8)
    core.add(["a", "b"], final=False)
    core.pump()
    core.add(["x"], final=False, error=RuntimeError("the generator broke"))
    core.add(["y", "z"], final=False)  # the next push, pulled before the patch came
    engine.patches.append(FakePatch([("a", ValueError("bad a")), ("b", ValueError("bad b"))]))
    assert core.can_pump()
    core.pump()
    assert engine.log[1:3] == [("refill", ["x"]), ("error", "the generator broke")]
    assert core.queued == 2


def test_a_cut_ends_batches_where_the_input_raised_and_delivers_nothing_itself():
    """A daemon client raises its input's error itself; its push says where: batches end
    there as at an error, and nothing is started for it."""
    from damacy_runtime.core import FrontCore

    engine = FakeEngine(slots=4)
    core = FrontCore(engine, samples_per_batch=2, lookahead=8)
    core.add(["a", "b", "c"], final=False, cut=True)
    core.add(["d", "e"], final=True)
    core.pump()
    assert engine.log == [("start", ["a", "b"]), ("start", ["c"]), ("start", ["d", "e"])]
    assert core.queued == 0 and not core._queue
