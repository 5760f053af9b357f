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
    assert sources.pull(2) == ([0, 1], None) and pulled == [0, 1]
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
        with pytest.raises(InvalidArgument, match="iterable of samples"):
            front.Sources.check(bad)


def test_batch_info_and_timeout_messages():
    cfg = Config(samples_per_batch=4, sample_shape=(2, 3), dtype="native")
    info = front.batch_info(cfg, 3, "uint16", 7, ["s0", "s1", "s2"])
    assert info.shape == (3, 2, 3) and info.dtype == "uint16" and info.batch_id == 7 and info.samples == ("s0", "s1", "s2")
    assert front.batch_info(Config(samples_per_batch=4, sample_shape=(2,)), 4, "uint16", 0, []).dtype == "f32"
    held = front.pop_timeout(3, 0.5, front.SLOTS_HELD, 2)
    assert isinstance(held, damacy.SlotsHeld) and isinstance(held, TimeoutError)
    assert str(held).startswith("all 2 batch slots are held by batches that were not released, or by arrays exported")
    assert "batch.copy()" in str(held) and "within" not in str(held)
    late = front.pop_timeout(3, 0.5, front.WAITING_FOR_INPUT, 2)
    assert type(late) is TimeoutError and "yield samples" in str(late)
    assert str(front.pop_timeout(3, 0.5, front.WORKING, 2, 1, " in damacyd")) == "no batch 3 within 0.5s: its reads and decodes are still running in damacyd (1 slots in use)"
    assert front.deadline(None) is None and front.deadline(float("inf")) is None and front.time_left(None) is None
