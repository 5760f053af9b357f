"""Exact resume: a pipeline's state, taken mid-epoch by a training loop and restored in a new
process, gives bit for bit the batches the uninterrupted run gave after it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from zarr.codecs import ZstdCodec

import damacy
from damacy_runtime.front import Progress

from conftest import random_data, write_array

BATCH = 4
EPOCHS = 2

#: the training loop of both runs: epochs of a RandomBoxes sampler; the first run saves the
#: state after ``stop_after`` batches of epoch 1 and goes on, the second starts from it
LOOP = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import damacy

    uris, out, endpoint, stop_after, resume, window = json.loads(sys.argv[1])
    sampler = damacy.RandomBoxes(uris, (6, 10, 10), seed=12, samples_per_epoch=26, rank=0, world_size=1)
    if window:  # chunk-aware: stopped and resumed mid-window
        sampler = damacy.RandomBoxes(uris, (6, 10, 10), seed=12, samples_per_epoch=26, rank=0, world_size=1, window=window)
    cfg = damacy.Config(samples_per_batch=4, sample_shape=(6, 10, 10), dtype="u16", prepared_batches=3, drop_last=False)
    pipe = damacy.Pipeline(cfg, endpoint=endpoint) if endpoint else damacy.Pipeline(cfg)
    epochs = 2
    if resume is not None:
        state = json.load(open(resume))
        sampler.load_state_dict(state["source_state"])
        pipe.load_state_dict(state)
    seen = []
    with pipe:
        for epoch in range(sampler.epoch, epochs):
            sampler.set_epoch(epoch)
            pipe.push(sampler)
            for k, batch in enumerate(pipe.batches()):  # until this epoch's samples are drained
                with batch:
                    seen.append(np.array(np.from_dlpack(batch)))
                if resume is None and epoch == 1 and k + 1 == stop_after:
                    state = pipe.state_dict()
                    json.dump(state, open(out + ".state.json", "w"))
                    mark = sum(len(x) for x in seen)
    np.save(out, np.concatenate(seen))
    if resume is None:
        json.dump(mark, open(out + ".mark.json", "w"))
    """
)


def test_the_readme_says_what_the_loop_does():
    from test_readme import block

    code = [line.strip() for line in block("resume").splitlines() if line.strip() and not line.strip().startswith("#")]
    loop = LOOP.replace("  ", "")
    for line in code:
        assert line.split("  #")[0].strip() in loop, line


def _run(tmp_path, uris, out, endpoint, stop_after, resume, window=None):
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    args = json.dumps([uris, str(out), endpoint, stop_after, resume, window])
    done = subprocess.run([sys.executable, str(script), args], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("mode, window", [("embedded", None), ("daemon", None), ("embedded", 4 * 10 * 16 * 16 * 2), ("daemon", 4 * 10 * 16 * 16 * 2)])
def test_a_restore_in_a_new_process_continues_bit_for_bit(tmp_path, mode, window, request):
    uris = []
    for k in range(2):
        write_array(tmp_path / f"v{k}.zarr", random_data((30, 40, 50), "uint16", seed=k), chunks=(10, 16, 16), compressors=[ZstdCodec()])
        uris.append(str(tmp_path / f"v{k}.zarr"))
    endpoint = request.getfixturevalue("daemon").endpoint if mode == "daemon" else None
    _run(tmp_path, uris, tmp_path / "whole.npy", endpoint, 3, None, window)
    state = json.loads((tmp_path / "whole.npy.state.json").read_text())
    assert state["push"] == 1 and state["offset"] == 3 * BATCH and state["source_state"]["epoch"] == 1
    assert state["source_state"]["window"] == window
    if window:  # the stop falls inside a window (a window holds the boxes of about 4 chunks)
        sampler = damacy.RandomBoxes(uris, (6, 10, 10), seed=12, samples_per_epoch=26, rank=0, world_size=1, window=window)
        sampler.set_epoch(1)
        starts = sampler._windows(sampler.epoch_samples())[1]
        assert len(starts) > 2 and 3 * BATCH not in starts
    _run(tmp_path, uris, tmp_path / "resumed.npy", endpoint, None, str(tmp_path / "whole.npy.state.json"), window)
    whole, resumed = np.load(tmp_path / "whole.npy"), np.load(tmp_path / "resumed.npy")
    mark = json.loads((tmp_path / "whole.npy.mark.json").read_text())
    assert mark == 26 + 3 * BATCH  # epoch 0 (26 samples), then 3 batches of epoch 1
    assert len(resumed) == len(whole) - mark > 0
    assert np.array_equal(resumed, whole[mark:])


def test_a_batch_still_held_is_not_counted_as_seen(tmp_path, make):
    write_array(tmp_path / "a.zarr", random_data((40, 10), "uint8", seed=1), chunks=(10, 10))
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(1, 10), dtype="u8", prepared_batches=3)
    samples = [damacy.Sample(str(tmp_path / "a.zarr"), np.s_[i : i + 1, 0:10]) for i in range(20)]
    with make(cfg) as pipe:
        pipe.push(samples)
        first = pipe.pop()
        second = pipe.pop()
        second.release()  # out of order: the first is still held
        assert pipe.state_dict()["offset"] == 0
        first.release()
        assert pipe.state_dict() | {"source_state": None} == {"version": 1, "push": 0, "offset": 4, "source_state": None, "batches": 2}
        with pytest.raises(damacy.InvalidArgument, match="before the first push"):
            pipe.load_state_dict(pipe.state_dict())


def test_a_restore_leaves_out_what_was_seen_and_checks_the_state(tmp_path, make):
    data = random_data((40, 10), "uint8", seed=2)
    write_array(tmp_path / "a.zarr", data, chunks=(10, 10))
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(1, 10), dtype="u8")
    samples = [damacy.Sample(str(tmp_path / "a.zarr"), np.s_[i : i + 1, 0:10]) for i in range(9)]
    with make(cfg) as pipe:
        pipe.load_state_dict({"version": 1, "push": 0, "offset": 5, "source_state": None, "batches": 2})
        pipe.push(samples)
        got = [np.array(np.from_dlpack(b)) for b in pipe]
    np.testing.assert_array_equal(np.concatenate(got)[:, 0], data[5:9])
    with make(cfg) as pipe:
        with pytest.raises(damacy.InvalidArgument, match="not a damacy pipeline state"):
            pipe.load_state_dict({"offset": 3})


@pytest.mark.parametrize("kind", ["shuffled", "random"])
def test_the_next_epoch_queued_while_one_is_pulled_leaves_it_as_pushed(tmp_path, kind):
    """set_epoch(e + 1) and a second push while the pipeline still pulls epoch e: epoch e is
    read in its own order (an iteration keeps the epoch of its start), then e + 1, and the
    state saved in epoch e names epoch e."""
    data = np.arange(300, dtype=np.int32).reshape(300, 1)
    write_array(tmp_path / "a.zarr", data, chunks=(100, 1))
    uri = str(tmp_path / "a.zarr")
    sampler = {
        "shuffled": lambda: damacy.Shuffled([damacy.Sample(uri, np.s_[i : i + 1, 0:1]) for i in range(300)], seed=3),
        "random": lambda: damacy.RandomBoxes({uri: (300, 1)}, (1, 1), seed=3, samples_per_epoch=300),
    }[kind]()
    want = {}
    for e in (0, 1):
        sampler.set_epoch(e)
        want[e] = [s.selection[0].start for s in sampler.epoch_samples()]
    assert want[0] != want[1]
    # (the Config's cache floor: the lookahead and two batches, times 64 shard indexes each)
    cfg = damacy.Config(samples_per_batch=50, sample_shape=(1, 1), dtype="i32", lookahead_samples=50, n_shard_index_cache=150 * 64)
    with damacy.Pipeline(cfg) as pipe:
        sampler.set_epoch(0)
        pipe.push(sampler)
        sampler.set_epoch(1)
        pipe.push(sampler)
        got = []
        for k, b in enumerate(pipe):
            with b:
                got.extend(b.numpy()[:, 0, 0].tolist())
            if k == 2:
                assert pipe.state_dict()["source_state"]["epoch"] == 0
    assert got[:300] == want[0] and got[300:] == want[1]


def test_progress_counts_a_prefix_of_released_batches():
    p = Progress()
    a, b, c = p.handed(4), p.handed(4), p.handed(3)
    p.released(c)
    p.released(b)
    assert p.consumed == 0
    p.released(a)
    assert (p.consumed, p.batches) == (11, 3)
    p.handed(2, released=True)  # a failed batch: done with at once
    assert p.consumed == 13


# -- elastic resume ----------------------------------------------------------------------
SHAPES = {"/e/a.zarr": (60, 50), "/e/b.zarr": (33, 70)}


def _samplers(kind, world):
    if kind == "random":
        return [damacy.RandomBoxes(SHAPES, (8, 8), seed=3, samples_per_epoch=61, rank=r, world_size=world) for r in range(world)]
    if kind == "shuffled":
        items = [damacy.Sample("/e/a.zarr", ((i, i + 1), (0, 8))) for i in range(47)]
        return [damacy.Shuffled(items, seed=3, rank=r, world_size=world) for r in range(world)]
    return [damacy.GridBoxes(SHAPES, (8, 8), step=(6, 8), rank=r, world_size=world) for r in range(world)]


def _key(s):
    return (s.uri, tuple((sl.start, sl.stop) for sl in s.selection))


@pytest.mark.parametrize("kind", ["random", "shuffled", "grid"])
@pytest.mark.parametrize("old, new, taken", [(2, 3, [5, 5]), (4, 2, [3, 3, 3, 3]), (4, 2, [4, 2, 3, 0]), (3, 3, [2, 1, 2])])
def test_an_epoch_goes_on_over_another_number_of_ranks(kind, old, new, taken):
    """N ranks read part of epoch 2 (``taken`` samples each, not necessarily in lockstep);
    M ranks resume from their N states: every sample of the epoch read once over both runs
    (padding and, for a shuffled list, its wrap-around repeats aside)."""
    first = _samplers(kind, old)
    for s in first:
        s.set_epoch(2)
    glob = [_key(x) for x in first[0].epoch_samples()]
    states, seen = [], []
    for s, k in zip(first, taken):
        part = [x for x in s.rank_samples()][:k]
        seen += [_key(x) for x in part if not isinstance(x, damacy.Padding)]
        states.append({"version": 1, "push": 0, "offset": k, "source_state": s.state_dict(), "batches": 0})
    second = _samplers(kind, new)
    for s in second:
        s.resume(json.loads(json.dumps(states)))  # as saved and loaded
    assert {s.epoch for s in second} == {2} and len({len(s) for s in second}) == 1
    rest = [_key(x) for s in second for x in s if not isinstance(x, damacy.Padding)]
    total = seen + rest
    if kind == "random":  # each rank drops the remainder its share leaves: at most world - 1 each time
        assert len(total) == len(set(total)) and len(glob) - len(total) < old + new and set(total) <= set(glob)
    elif kind == "shuffled":  # everything, repeats only where a share wraps around
        assert set(total) == set(glob) and len(total) - len(glob) < old + new
    else:
        assert sorted(total) == sorted(glob)  # every window exactly once
    second[0].set_epoch(3)  # the next epoch is whole again
    assert len(second[0]) == len(_samplers(kind, new)[0])


def test_resume_needs_every_rank_of_one_epoch():
    first = _samplers("random", 2)
    states = [{"offset": 1, "source_state": s.state_dict()} for s in first]
    with pytest.raises(damacy.InvalidArgument, match="all 2 earlier ranks"):
        _samplers("random", 3)[0].resume(states[:1])
    first[1].set_epoch(1)
    states[1]["source_state"] = first[1].state_dict()
    with pytest.raises(damacy.InvalidArgument, match="different runs or epochs"):
        _samplers("random", 3)[0].resume(states)


def test_elastic_resume_through_pipelines(tmp_path):
    """Two ranks' pipelines read part of an epoch of grid windows and save their states;
    three resume from both states: together they deliver every window once."""
    data = random_data((40, 36), "uint16", seed=8)
    write_array(tmp_path / "g.zarr", data, chunks=(10, 12), compressors=[ZstdCodec()])
    uri = str(tmp_path / "g.zarr")
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(8, 12), dtype="u16", drop_last=False)  # every window

    def grid(rank, world):
        return damacy.GridBoxes([uri], (8, 12), step=(4, 12), rank=rank, world_size=world)

    got, states = [], []
    for rank in range(2):
        sampler = grid(rank, 2)
        with damacy.Pipeline(cfg) as pipe:
            pipe.push(sampler)
            for batch in pipe.batches(2):
                with batch:
                    got += [(_key(s), np.array(np.from_dlpack(batch)[k])) for k, s in enumerate(batch.info.samples)]
            states.append(json.loads(json.dumps(pipe.state_dict())))
    for rank in range(3):
        sampler = grid(rank, 3)
        sampler.resume(states)
        with damacy.Pipeline(cfg) as pipe:
            pipe.push(sampler)
            for batch in pipe:
                with batch:
                    got += [(_key(s), np.array(np.from_dlpack(batch)[k])) for k, s in enumerate(batch.info.samples) if k not in batch.info.padding]
    windows = [_key(s) for s in grid(0, 1).epoch_samples()]
    assert sorted(k for k, _ in got) == sorted(windows)
    for (_, box), arr in got:
        np.testing.assert_array_equal(arr, data[tuple(slice(a, b) for a, b in box)])


def test_a_short_pool_after_a_resume_still_gives_every_rank_the_same_steps():
    items = [damacy.Sample("/e/a.zarr", ((i, i + 1), (0, 8))) for i in range(12)]
    old = damacy.Shuffled(items, seed=1, rank=0, world_size=1)
    states = [{"offset": 11, "source_state": old.state_dict()}]
    parts = []
    for r in range(4):
        s = damacy.Shuffled(items, seed=1, rank=r, world_size=4)
        s.resume(states)
        parts.append(list(s))
    assert [len(p) for p in parts] == [1, 1, 1, 1] and {_key(p[0]) for p in parts} == {_key(old.epoch_samples()[11])}


def test_a_second_resume_after_shares_that_wrapped_round_the_pool_ends_the_epoch():
    """Three ranks share the one sample two ranks left (each repeats it: its share wraps
    round the pool twice); one rank resuming from their states finds the epoch read."""
    items = [damacy.Sample("/e/a.zarr", ((i, i + 1), (0, 8))) for i in range(31)]
    first = [{"offset": 15, "source_state": damacy.Shuffled(items, seed=0, rank=r, world_size=2).state_dict()} for r in range(2)]
    second = []
    for r in range(3):
        s = damacy.Shuffled(items, seed=0, rank=r, world_size=3)
        s.resume(first)
        assert len(s) == 1
        second.append({"offset": 1, "source_state": s.state_dict()})
    last = damacy.Shuffled(items, seed=0, rank=0, world_size=1)
    last.resume(second)
    assert last.consumed == [(0, 31)] and len(last) == 0 and list(last) == []


def test_state_before_the_first_push_and_refused_with_skip(tmp_path, make):
    write_array(tmp_path / "a.zarr", random_data((10, 10), "uint8", seed=1), chunks=(5, 5))
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(1, 10), dtype="u8")
    with make(cfg) as pipe:
        pipe.load_state_dict({"version": 1, "push": 0, "offset": 3, "source_state": None, "batches": 1})
        assert pipe.state_dict()["offset"] == 3  # saved again before anything was read: the same place
    with make(damacy.Config(samples_per_batch=2, sample_shape=(1, 10), dtype="u8", on_error="skip")) as pipe:
        with pytest.raises(damacy.InvalidArgument, match='needs on_error="stop", "raise" or "fill"'):
            pipe.state_dict()


def test_grid_windows_of_a_scaled_group_land_on_whole_coordinates():
    grid = damacy.GridBoxes([{"image": "/g/i.zarr", "label": "/g/l.zarr"}], (4, 4), scales={"label": 0.5}, shape_of=lambda u: (9, 9))
    windows = list(grid)
    assert all(sl.start % 2 == 0 for w in windows for sl in w["image"].selection)
    cover = np.zeros((9, 9), int)
    for w in windows:
        cover[tuple(slice(sl.start, min(sl.stop, 9)) for sl in w["image"].selection)] += 1
    assert cover.min() >= 1  # the unaligned edge window reaches past the end instead of moving back
    with pytest.raises(damacy.InvalidArgument, match="multiple of 2"):
        damacy.GridBoxes([{"image": "/g/i.zarr", "label": "/g/l.zarr"}], (4, 4), step=(3, 4), scales={"label": 0.5}, shape_of=lambda u: (9, 9))
