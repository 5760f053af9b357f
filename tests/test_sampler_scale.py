"""Samplers at scale: the i-th sample of an epoch from (seed, epoch, i), so a rank of a
10^8-sample epoch iterates, saves and restores its share without the epoch's list; the keyed
permutation and the counter-based draws behind it; the order's version in the state."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from zarr.codecs import ZstdCodec

import damacy
from damacy import order

from conftest import random_data, write_array

BIG = 10**8
SHAPES = {"/data/a.zarr": (2000, 3000, 4000), "/data/b.zarr": (500, 800, 900)}


def zarr_read(uri, selection):
    import zarr

    return zarr.open_array(uri, mode="r")[selection]


def _boxes(samples):
    return [(s.uri, tuple((sl.start, sl.stop) for sl in s.selection)) for s in samples]


def _peak(fn):
    """fn()'s result and the peak of Python and numpy allocations while it ran."""
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_rank_of_a_huge_epoch_starts_saves_and_resumes_without_the_epoch_list():
    def first_and_state():
        s = damacy.RandomBoxes(SHAPES, (64, 64, 64), seed=5, samples_per_epoch=BIG, rank=63, world_size=64, flips=(0, 2))
        s.set_epoch(7)
        it = iter(s)
        head = [next(it) for _ in range(3000)]  # past the first block of computed samples
        return s, head, len(s)

    (s, head, n), peak = _peak(first_and_state)
    assert n == BIG // 64 and peak < 64 << 20  # the list would take gigabytes
    # what the rank reads is the global list's entries 63, 127, ... (computed one by one here)
    assert _boxes(head[:5]) == _boxes(s._at(np.arange(63, 64 * 5, 64)))
    assert _boxes(head[2999:3000]) == _boxes(s._at(np.array([63 + 2999 * 64])))
    # a restore mid-epoch starts at its offset by index arithmetic
    later, peak = _peak(lambda: [next(iter(s.iter_from(1_000_000))) for _ in range(2)])
    assert peak < 64 << 20 and _boxes(later) == _boxes(s._at(np.array([63 + 1_000_000 * 64] * 2)))


def test_a_pipeline_saves_and_restores_a_huge_epoch_in_its_state(tmp_path):
    write_array(tmp_path / "v.zarr", random_data((40, 60), "uint16", seed=1), chunks=(10, 20), compressors=[ZstdCodec()])
    uri = str(tmp_path / "v.zarr")
    cfg = damacy.Config(samples_per_batch=4, sample_shape=(8, 8), dtype="u16")

    def sampler():
        s = damacy.RandomBoxes({uri: (40, 60)}, (8, 8), seed=2, samples_per_epoch=BIG, rank=63, world_size=64)
        s.set_epoch(1)
        return s

    with damacy.Pipeline(cfg) as pipe:
        pipe.push(sampler())
        for _ in range(3):
            pipe.pop().release()
        state = pipe.state_dict()
        want = pipe.pop().numpy().copy()
    assert state["offset"] == 12 and state["source_state"]["order"] == order.ORDER_VERSION

    def restored():
        s = sampler()
        s.load_state_dict(state["source_state"])
        with damacy.Pipeline(cfg) as pipe:
            pipe.load_state_dict(state)
            pipe.push(s)
            return pipe.pop().numpy().copy()

    got, peak = _peak(restored)
    assert np.array_equal(got, want) and peak < 256 << 20
    # deep in the epoch: the pipeline starts the sampler at its offset, computing no sample before it
    deep = dict(state, offset=1_000_000)
    computed = []
    s = sampler()
    s.load_state_dict(deep["source_state"])
    at = s._at
    s._at = lambda positions: computed.append(len(positions)) or at(positions)
    with damacy.Pipeline(cfg) as pipe:
        pipe.load_state_dict(deep)
        pipe.push(s)
        got = pipe.pop().numpy().copy()
    assert sum(computed) <= 2048
    boxes = s._at(63 + 64 * np.arange(1_000_000, 1_000_004))
    want = np.stack([zarr_read(uri, b.selection) for b in boxes])
    assert np.array_equal(got, want)


def test_a_state_of_the_old_order_is_refused_saying_why():
    s = damacy.RandomBoxes(SHAPES, (4, 4, 4), seed=3, samples_per_epoch=9, rank=0, world_size=1)
    old = {k: v for k, v in s.state_dict().items() if k != "order"}  # what the list-building samplers saved
    with pytest.raises(damacy.InvalidArgument, match="order version 1.*order version 2.*other samples"):
        s.load_state_dict(old)
    with pytest.raises(damacy.InvalidArgument, match="order version 1"):
        s.resume([{"offset": 0, "source_state": old}])


def test_elastic_resume_of_a_huge_epoch_keeps_its_state_a_few_ranges():
    # 64 ranks stopped in step at 1000 samples each, one ran 2 ahead: 8 ranks go on
    old = []
    for r in range(64):
        s = damacy.RandomBoxes(SHAPES, (16, 16, 16), seed=9, samples_per_epoch=BIG, rank=r, world_size=64)
        s.set_epoch(2)
        old.append({"offset": 1002 if r == 5 else 1000, "source_state": s.state_dict()})

    def resumed():
        s = damacy.RandomBoxes(SHAPES, (16, 16, 16), seed=9, samples_per_epoch=BIG, rank=3, world_size=8)
        s.resume(old)
        return s, list(zip(range(3), s))

    (s, head), peak = _peak(resumed)
    assert peak < 64 << 20
    assert s.consumed == [(0, 64000), (64005, 64006), (64069, 64070)]
    assert len(s) == (BIG - 64002) // 8
    # the pool skips what was read: this rank's first entries are the remaining positions 3, 11, 19
    remaining = [p for p in range(64000, 64100) if p not in (64005, 64069)]
    assert _boxes(x for _, x in head) == _boxes(s._at(np.array([remaining[3], remaining[11], remaining[19]])))


def test_grid_windows_are_indexed_arithmetically():
    shapes = {"/data/g.zarr": (20000, 20000, 300), "/data/h.zarr": (70, 70, 70)}

    def head():
        s = damacy.GridBoxes(shapes, (20, 20, 10), rank=63, world_size=64)
        it = iter(s)
        return s, [next(it), next(it)], len(s)

    (s, first, n), peak = _peak(head)
    assert peak < 64 << 20
    # h: 70 = starts 0, 20, 40 and the last shifted to 50 (4), and 7 of 10: 112 windows
    total = 1000 * 1000 * 30 + 4 * 4 * 7
    assert n == -(-total // 64)
    base, extra = divmod(total, 64)
    start = 63 * base + min(63, extra)  # rank 63's contiguous block
    for j, box in enumerate(_boxes(first)):
        i = np.unravel_index(start + j, (1000, 1000, 30))
        assert box == ("/data/g.zarr", tuple((int(a) * k, int(a) * k + k) for a, k in zip(i, (20, 20, 10))))
    small = _boxes(s._at(np.arange(total - 112, total)))  # every window of h once, in C order, last
    want = [("/data/h.zarr", ((z, z + 20), (y, y + 20), (x, x + 10))) for z in (0, 20, 40, 50) for y in (0, 20, 40, 50) for x in range(0, 70, 10)]
    assert small == want


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 12345])
def test_the_keyed_permutation_is_a_bijection_and_depends_on_its_key(n):
    perm = order.Permutation(n, order.key(1, 2, 3))
    got = perm(np.arange(n))
    assert sorted(got.tolist()) == list(range(n))
    assert np.array_equal(perm(np.arange(n)[::-1]), got[::-1])  # any positions, any order
    if n > 3:
        assert not np.array_equal(order.Permutation(n, order.key(1, 2, 4))(np.arange(n)), got)


def test_the_permutation_and_the_draws_are_uniform():
    # where sample 0 of a list of 10 lands over 4000 epochs: each place about 400 times
    lands = np.array([order.Permutation(10, order.key(0, e, 3))(np.array([0]))[0] for e in range(4000)])
    counts = np.bincount(lands, minlength=10)
    assert counts.min() > 300 and counts.max() < 500, counts
    k = order.key(4, 5)
    u = order.uniform(k, np.arange(200_000), 0)
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.005
    assert abs(np.corrcoef(u, order.uniform(k, np.arange(200_000), 1))[0, 1]) < 0.01  # streams independent
    ints = order.integers(k, np.arange(100_000), 2, np.full(100_000, 3))
    assert set(np.unique(ints).tolist()) == {0, 1, 2} and abs(np.bincount(ints)[0] / 100_000 - 1 / 3) < 0.01


def test_shuffled_reads_a_keyed_permutation_of_its_list():
    items = [damacy.Sample("/data/a.zarr", np.s_[i : i + 1, 0:4, 0:4]) for i in range(50)]
    s = damacy.Shuffled(items, seed=4, rank=1, world_size=4)
    s.set_epoch(2)
    perm = order.Permutation(50, order.key(4, 2, 3))(np.arange(50))
    want = [items[i] for i in perm.tolist()]
    assert list(s) == (want + want[:2])[1::4]  # 13 each: the last ranks repeat the first of the order
    assert list(s.iter_from(5)) == list(s)[5:]
