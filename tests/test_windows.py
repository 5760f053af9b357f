"""Chunk-aware epochs: the samplers' ``window=`` orders an epoch so that each chunk is decoded
about once, keeping the samples drawn, determinism, rank shares and resume."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest
from zarr.codecs import ZstdCodec

import damacy
from damacy.windows import CellIndex, batch_diversity, chunk_windows

from conftest import random_data, write_array

SHAPE, CHUNKS = (64, 128, 128), (16, 64, 64)  # chunks of 128 KiB: batches in flight share them
VOLS = {f"/w/v{i}.zarr": SHAPE for i in range(3)}
CELL = 16 * 128 * 128 * 2  # a slab of chunks one chunk deep: the cell of a plane, u16


def chunks_of(uri, level):
    return SHAPE, CHUNKS, 2


def _key(s):
    return (s.uri, tuple((sl.start, sl.stop) for sl in s.selection))


def _planes(window=None, **kw):
    kw.setdefault("samples_per_epoch", 300)
    return damacy.RandomBoxes(VOLS, (1, 128, 128), seed=5, window=window, chunks_of=chunks_of, **kw)


def _cells(samples):
    return [(s.uri, s.selection[0].start // CHUNKS[0]) for s in samples]


def test_a_windowed_epoch_holds_the_same_samples_window_by_window():
    plain, windowed = _planes(), _planes(window=2 * CELL)
    for epoch in (0, 3):
        plain.set_epoch(epoch)
        windowed.set_epoch(epoch)
        a, b = list(plain), list(windowed)
        assert sorted(map(_key, a)) == sorted(map(_key, b)) and a != b  # the same draws, reordered
        # the order comes in runs of at most 2 cells each, and no cell comes back after its run
        cells = _cells(b)
        runs, done = [], set()
        for c in cells:
            if not runs or c not in runs[-1]:
                if len(runs) and len(runs[-1]) == 2 or not runs:
                    runs.append(set())
                assert c not in done, "a cell came back after its window"
                runs[-1].add(c)
            for old in runs[:-1]:
                done |= old
        assert all(len(r) <= 2 for r in runs)
    again = _planes(window=2 * CELL)
    again.set_epoch(3)
    assert list(again) == list(windowed)  # from (seed, epoch) alone
    again.set_epoch(4)
    assert list(again) != list(windowed)


def test_windows_pack_cells_up_to_their_bytes():
    s = _planes(window=3 * CELL + 1)
    q = s.shuffle_quality(8)
    assert q["windows"] == math.ceil(3 * 4 / 3) and q["window_bytes"] <= 3 * CELL + 1
    tiny = _planes(window=1).shuffle_quality(8)  # a cell larger than the window is one of its own
    assert tiny["windows"] == 12 and tiny["window_bytes"] == CELL
    assert s.shuffle_quality(8)["batch_diversity"] > tiny["batch_diversity"]


def test_batch_diversity_compares_with_a_uniform_permutation():
    rng = np.random.default_rng(0)
    uniform = rng.permutation(np.repeat(np.arange(12), 50)).tolist()
    assert 0.95 < batch_diversity(uniform, 8) < 1.05
    def distinct(order):
        return np.mean([len(set(order[i : i + 8])) for i in range(0, 600, 8)])

    grouped = sorted(uniform)  # batches of one cell (or two, where a cell ends)
    shuffles = np.mean([distinct(rng.permutation(uniform).tolist()) for _ in range(200)])
    assert batch_diversity(grouped, 8) == pytest.approx(distinct(grouped) / shuffles, rel=0.02)
    assert _planes().shuffle_quality(8)["batch_diversity"] > 0.9
    assert _planes(window=CELL).shuffle_quality(8)["batch_diversity"] < 0.4


def test_cells_cover_the_chunks_of_every_sample():
    idx = CellIndex(chunks_of)
    samples = [
        damacy.Sample("/w/v0.zarr", np.s_[0:1, 0:128, 0:128]),
        damacy.Sample("/w/v0.zarr", np.s_[15:17, 0:128, 0:128]),  # starts in the same cell, reaches the next
        damacy.Sample("/w/v0.zarr", np.s_[-4:2, 60:70, 0:10]),  # reaches outside (clipped) and into the next chunk
        damacy.IndexQuery("/w/v1.zarr", (slice(40, 41), [127, 3], [7])),
    ]
    cells = idx.cells(samples)
    assert cells.of == [0, 0, 0, 1]
    chunk = 16 * 64 * 64 * 2
    assert cells.nbytes == [2 * 2 * 2 * chunk, 1 * 2 * 1 * chunk]
    assert idx.cell_keys() == [(0, (0, 0, 0)), (1, (2, 0, 0))]


@pytest.mark.parametrize("share", [False, True])
def test_ranks_read_whole_windows(share):
    world, local = 4, 2
    ranks = [_planes(window=2 * CELL, rank=r, world_size=world, local_world_size=local, share_windows=share) for r in range(world)]
    whole = _planes()
    parts = [[_key(s) for s in r] for r in ranks]
    per = len(whole.epoch_samples()) // world
    assert {len(p) for p in parts} == {per}
    read = sum(parts, [])
    assert Counter(read) == Counter(map(_key, whole.epoch_samples()))  # every draw once (300 % 4 = 0 dropped)
    # windows are packed within each rank's run (each node's, shared): a chunk slab is read by
    # two of them only where a run's edge cuts its cell, at most once per edge (cut through
    # windows, the runs shared both cells of each window at an edge)
    readers = [set(range(r, r + 1)) if not share else set(range(r // local * local, r // local * local + local)) for r in range(world)]
    groups = world // local if share else world
    by_cell: dict = {}
    for r, part in enumerate(ranks):
        for cell in _cells(list(part)):
            by_cell.setdefault(cell, set()).add(min(readers[r]))
    assert sum(len(g) - 1 for g in by_cell.values()) <= groups - 1, by_cell
    for node in range(groups):  # each run's cells come window by window (2 cells a window)
        turns = [list(ranks[node * (local if share else 1) + t]) for t in range(local if share else 1)]
        merged = [turns[j % len(turns)][j // len(turns)] for j in range(per * len(turns))]
        assert _open_cells(_cells(merged)) <= 2


def _open_cells(cells):
    """The most cells whose stretch (first to last sample) holds one place of the order."""
    first, last = {}, {}
    for i, c in enumerate(cells):
        first.setdefault(c, i)
        last[c] = i
    return max(sum(first[c] <= i <= last[c] for c in first) for i in range(len(cells)))


def test_a_window_with_about_as_many_samples_as_ranks_pads_or_repeats():
    grid = [damacy.GridBoxes({"/w/v0.zarr": (16, 64, 64)}, (16, 64, 64), rank=r, world_size=3, window=CELL, chunks_of=chunks_of) for r in range(3)]
    got = [list(g) for g in grid]  # one box for three ranks: the others pad with it
    assert [len(g) for g in got] == [1, 1, 1]
    assert type(got[0][0]) is damacy.Sample and all(type(g[0]) is damacy.Padding for g in got[1:])
    assert {_key(g[0]) for g in got} == {_key(got[0][0])}
    # Shuffled: 4 samples, 3 ranks of 2, the last rank's run short (its second entry wraps to the first)
    items = [damacy.Sample("/w/v0.zarr", np.s_[z : z + 1]) for z in range(4)]
    shuffled = [list(damacy.Shuffled(items, seed=0, rank=r, world_size=3, window=CELL, chunks_of=chunks_of)) for r in range(3)]
    assert [len(p) for p in shuffled] == [2, 2, 2] and {_key(s) for p in shuffled for s in p} == set(map(_key, items))
    # a grid of 5 boxes, 4 read by one rank, resumed on 2: the last box and a padding of it
    five = {"/w/v0.zarr": (16, 64, 5 * 64)}
    one = damacy.GridBoxes(five, (16, 64, 64), window=CELL, chunks_of=chunks_of)
    states = [{"version": 1, "push": 0, "offset": 4, "source_state": one.state_dict(), "batches": 0}]
    last = list(one)[4]
    resumed = []
    for r in range(2):
        g = damacy.GridBoxes(five, (16, 64, 64), window=CELL, chunks_of=chunks_of, rank=r, world_size=2)
        g.resume(states)
        resumed.append(list(g))
    assert [[(type(x).__name__, _key(x)) for x in p] for p in resumed] == [[("Sample", _key(last))], [("Padding", _key(last))]]


def test_window_orders_take_every_form_of_selection():
    forms = [
        [damacy.Sample("/w/v0.zarr", np.s_[z : z + 1]) for z in range(64)],  # axes not named: whole
        [damacy.Sample("/w/v0.zarr", np.s_[z : z + 1, ...]) for z in range(64)],
        [damacy.IndexQuery("/w/v0.zarr", (slice(z, z + 1), slice(0, 128), [3, 70])) for z in range(64)],
        [damacy.Sample("/w/v0.zarr", np.s_[z : z + 1, 0:128, 0:128]) for z in range(64)],
    ]
    orders = []
    for items in forms:
        s = damacy.Shuffled(items, seed=2, window=CELL, chunks_of=chunks_of)
        got = list(s)
        at = {repr(x): i for i, x in enumerate(items)}
        assert sorted(at[repr(x)] for x in got) == list(range(len(items)))
        orders.append([at[repr(x)] for x in got])
        assert s.shuffle_quality(8)["windows"] == 4  # a window per chunk slab, whatever the spelling
    assert orders[0] == orders[1] == orders[2] == orders[3]
    with pytest.raises(ValueError, match="index array is empty"):  # a query that reads nothing is refused
        damacy.IndexQuery("/w/v0.zarr", (slice(0, 1), [], slice(0, 4)))


def test_shuffled_and_grid_take_a_window():
    items = [damacy.Sample(u, np.s_[z : z + 1, 0:128, 0:128]) for u in VOLS for z in range(64)]
    plain = damacy.Shuffled(items, seed=1)
    windowed = damacy.Shuffled(items, seed=1, window=CELL, chunks_of=chunks_of)
    got = list(windowed)
    assert sorted(map(_key, got)) == sorted(map(_key, plain)) == sorted(map(_key, items))
    cells = _cells(got)
    assert sum(a != b for a, b in zip(cells, cells[1:])) == 12 - 1  # each cell's planes together
    assert batch_diversity([hash(c) % 1000 for c in _cells(list(plain))], 8) > 0.9
    # three ranks, the last ones repeating the first samples, as without a window
    parts = [list(damacy.Shuffled(items, seed=1, window=CELL, chunks_of=chunks_of, rank=r, world_size=5)) for r in range(5)]
    assert {len(p) for p in parts} == {-(-len(items) // 5)} and {_key(s) for p in parts for s in p} == set(map(_key, items))

    # a grid of tiles in chunk order: each chunk column's tiles together, plane by plane
    grid = damacy.GridBoxes(VOLS, (1, 32, 32), window=CELL, chunks_of=chunks_of)
    tiles = list(grid)
    assert sorted(map(_key, tiles)) == sorted(map(_key, damacy.GridBoxes(VOLS, (1, 32, 32))))
    per_chunk = 16 * 2 * 2  # 16 planes of 2 x 2 tiles
    for k in range(0, len(tiles), per_chunk):
        assert len({tuple(sl.start // c for sl, c in zip(t.selection, CHUNKS)) + (t.uri,) for t in tiles[k : k + per_chunk]}) == 1
    assert [t.selection[0].start for t in tiles[:8]] == [0, 0, 0, 0, 1, 1, 1, 1]  # C order within a chunk


def test_a_state_is_refused_by_a_sampler_with_another_window():
    saved = _planes(window=2 * CELL).state_dict()
    with pytest.raises(damacy.InvalidArgument, match="window=.*order differs"):
        _planes().load_state_dict(saved)
    with pytest.raises(damacy.InvalidArgument, match="window"):
        _planes(window=CELL).load_state_dict(saved)
    _planes(window=2 * CELL).load_state_dict(json.loads(json.dumps(saved)))
    # a state restores its own rank of the same partition (another: resume, or other samples)
    mine = _planes(window=2 * CELL, rank=1, world_size=4, local_world_size=2, share_windows=True).state_dict()
    for other, what in [
        (dict(rank=0, world_size=4, local_world_size=2, share_windows=True), "rank 1 of 4, this sampler is rank 0 of 4"),
        (dict(rank=1, world_size=2, local_world_size=2, share_windows=True), "rank 1 of 4, this sampler is rank 1 of 2"),
        (dict(rank=1, world_size=4, local_world_size=2, share_windows=False), "share_windows=True"),
        (dict(rank=1, world_size=4, local_world_size=1, share_windows=True), "local_world_size=2"),
    ]:
        with pytest.raises(damacy.InvalidArgument, match=what):
            _planes(window=2 * CELL, **other).load_state_dict(mine)
    _planes(window=2 * CELL, rank=1, world_size=4, local_world_size=2, share_windows=True).load_state_dict(mine)
    # a windowed state of several ranks from before each rank's run was packed on its own
    with pytest.raises(damacy.InvalidArgument, match="windowed order of version 1"):
        _planes(window=2 * CELL, rank=1, world_size=4, local_world_size=2, share_windows=True).load_state_dict({**mine, "window_order": 1})
    _planes(window=2 * CELL).load_state_dict({k: v for k, v in saved.items() if k != "window_order"})  # one rank: the same order
    with pytest.raises(damacy.InvalidArgument, match="locality and window"):
        _planes(window=CELL, locality=True)
    with pytest.raises(damacy.InvalidArgument, match="window must be a positive number of bytes"):
        _planes(window=0)


@pytest.mark.parametrize("old, new, taken", [(2, 3, [40, 55]), (4, 2, [10, 30, 75, 0])])
def test_an_elastic_resume_keeps_the_windowed_order(old, new, taken):
    first = [_planes(window=2 * CELL, rank=r, world_size=old, local_world_size=1) for r in range(old)]
    for s in first:
        s.set_epoch(1)
    states, seen = [], []
    for s, k in zip(first, taken):
        seen += [_key(x) for x in s.rank_samples()[:k]]
        states.append({"version": 1, "push": 0, "offset": k, "source_state": s.state_dict(), "batches": 0})
    second = [_planes(window=2 * CELL, rank=r, world_size=new, local_world_size=1) for r in range(new)]
    for s in second:
        s.resume(json.loads(json.dumps(states)))
    rest = [_key(x) for s in second for x in s]
    total = Counter(seen + rest)  # planes drawn at random: some twice
    glob = Counter(_key(x) for x in first[0].epoch_samples())
    assert not total - glob and sum((glob - total).values()) < old + new


@pytest.mark.parametrize("before, after", [(True, False), (False, True), (True, True)])
def test_an_elastic_resume_reads_the_runs_the_saved_partition_had(before, after):
    # every plane once (drop_last, 192 of them): the first run's ranks shared windows per node
    # or not; what they read is found from their states, whatever the new run does
    items = [damacy.Sample(u, np.s_[z : z + 1, 0:128, 0:128]) for u in VOLS for z in range(64)]

    def sampler(rank, world, share):
        s = damacy.Shuffled(items, seed=3, drop_last=True, window=2 * CELL, chunks_of=chunks_of, rank=rank, world_size=world, local_world_size=2, share_windows=share)
        s.set_epoch(2)
        return s

    first = [sampler(r, 4, before) for r in range(4)]
    states, seen = [], []
    for s in first:
        seen += [_key(x) for x in s.rank_samples()[:10]]
        states.append({"version": 1, "push": 0, "offset": 10, "source_state": s.state_dict(), "batches": 0})
    second = [sampler(r, 2, after) for r in range(2)]
    for s in second:
        s.resume(json.loads(json.dumps(states)))
    rest = [_key(x) for s in second for x in s]
    assert len(rest) == len(items) - 40 and sorted(seen + rest) == sorted(map(_key, items))


def test_chunk_windows_reorders_any_iterable_buffer_by_buffer():
    stream = list(_planes())
    got = list(chunk_windows(iter(stream), window=CELL, buffer=100, seed=2, chunks_of=chunks_of))
    assert sorted(map(_key, got)) == sorted(map(_key, stream))
    for k in range(0, 300, 100):  # nothing crosses a buffer
        assert sorted(map(_key, got[k : k + 100])) == sorted(map(_key, stream[k : k + 100]))
        cells = _cells(got[k : k + 100])
        assert sum(a != b for a, b in zip(cells, cells[1:])) == len(set(cells)) - 1
    assert got == list(chunk_windows(stream, window=CELL, buffer=100, seed=2, chunks_of=chunks_of))


def _decodes(tmp_path, window, depth=1, cells=2):
    """The chunks decoded by an embedded pipeline reading one epoch of planes (drawn at
    random, 2 volumes; or slabs of ``depth`` planes) with a chunk cache of ``cells`` cells'
    bytes; and the chunks the epoch cuts."""
    uris = []
    for k in range(2):
        path = tmp_path / f"v{k}.zarr"
        if not path.exists():
            write_array(path, random_data(SHAPE, "uint16", seed=k), chunks=CHUNKS, shards=(32, 128, 128), compressors=[ZstdCodec()])
        uris.append(str(path))
    sampler = damacy.RandomBoxes(uris, (depth, 128, 128), seed=3, samples_per_epoch=96, window=window)
    cfg = damacy.Config(samples_per_batch=4, sample_shape=(depth, 128, 128), dtype="u16", chunk_cache_bytes=cells * CELL, prepared_batches=2)
    got = []
    with damacy.Pipeline(cfg) as pipe:
        pipe.push(sampler)
        for batch in pipe.batches(len(sampler) // 4):
            with batch:
                got.append(np.array(np.from_dlpack(batch)))
        decoded = pipe.stats_dict()["stages"]["decode"]["count"]
    import zarr

    samples = list(sampler)
    expected = np.stack([zarr.open_array(s.uri, mode="r")[s.selection] for s in samples])
    assert np.array_equal(np.concatenate(got), expected)
    cut = {(s.uri, z // CHUNKS[0]) for s in samples for z in range(s.selection[0].start, s.selection[0].stop)}
    return decoded, len(cut) * (128 // 64) ** 2


def test_a_windowed_epoch_of_planes_decodes_each_chunk_once(tmp_path):
    decoded, chunks = _decodes(tmp_path, window=2 * CELL)
    assert decoded == chunks
    shuffled, _ = _decodes(tmp_path, window=None)  # the same planes in a uniform order
    assert shuffled > 1.5 * chunks


def test_slabs_reaching_into_the_next_cell_bring_it_into_their_window(tmp_path):
    # slabs of 6 planes start anywhere: many reach into the next chunk slab; a window takes
    # the neighbouring cell along, so a chunk slab is decoded about once, not once per window
    decoded, chunks = _decodes(tmp_path, window=4 * CELL, depth=6, cells=4)
    assert decoded <= 1.25 * chunks, (decoded, chunks)
    s = damacy.RandomBoxes(VOLS, (6, 128, 128), seed=3, samples_per_epoch=300, window=4 * CELL, chunks_of=chunks_of)
    cells = s._cells.cells(s.epoch_samples())
    order, starts = s._windows(s.epoch_samples())[:2]
    bounds = [*starts, len(order)]
    windows = [{cells.of[p] for p in order[a:b]} for a, b in zip(bounds, bounds[1:])]
    read = sum(s._cells.window_bytes(cells, w) for w in windows)
    assert all(s._cells.window_bytes(cells, w) <= 4 * CELL for w in windows if len(w) > 1)
    assert read <= 1.3 * 3 * 4 * CELL  # every slab of the 3 volumes about once


def test_the_guide_block_reads_planes_chunk_by_chunk(tmp_path, capsys):
    from test_readme import block

    code = block("windows")
    for name in ("a", "b"):
        write_array(tmp_path / f"{name}.zarr", random_data((64, 256, 256), "uint16", seed=1), chunks=(32, 64, 64), compressors=[ZstdCodec()])
        code = code.replace(f"data/{name}.zarr", str(tmp_path / f"{name}.zarr"))
    assert "window = 64 << 20" in code
    code = code.replace("window = 64 << 20", "window = 8 << 20")  # cells of 4 MiB here: 2 windows
    scope: dict = {}
    exec(compile(code, "docs windows", "exec"), scope)
    quality = eval(capsys.readouterr().out)
    assert quality["windows"] == 2 and quality["window_bytes"] == 8 << 20 and quality["batch_diversity"] < 0.9
    assert scope["x"].shape == (8, 1, 256, 256)


# -- splits along chunk boundaries ---------------------------------------------------------


def test_a_split_deals_chunk_blocks_and_its_boxes_stay_inside():
    split = damacy.split_chunks(list(VOLS), {"train": 0.75, "val": 0.25}, seed=4, chunks_of=chunks_of)
    # 3 volumes x 4 blocks of 16 planes: 9 for training, 3 for validation, every block once
    blocks = {name: [(u, z) for u, box in split.regions(name) for z in range(box[0][0], box[0][1], 16)] for name in ("train", "val")}
    assert len(blocks["train"]) == 9 and len(blocks["val"]) == 3 and not set(blocks["train"]) & set(blocks["val"])
    assert all(box[1:] == ((0, 128), (0, 128)) and box[0][0] % 16 == 0 for _, box in split.regions("val"))
    # boxes drawn from a split's regions read that split's chunks only (crossing chunks of one region)
    train = damacy.RandomBoxes(split.regions("train"), (12, 64, 64), seed=0, samples_per_epoch=400)
    samples = list(train)
    assert all(split.owner(s) == "train" for s in samples)
    # uniform over the regions' elements: every training block is read
    read = {(s.uri, z // 16 * 16) for s in samples for z in range(s.selection[0].start, s.selection[0].stop)}
    assert read == set(blocks["train"])
    val = damacy.GridBoxes(split.regions("val"), (8, 64, 64))
    tiles = list(val)
    assert all(split.owner(t) == "val" for t in tiles)
    covered = {(t.uri, z) for t in tiles for z in range(t.selection[0].start, t.selection[0].stop)}
    assert covered == {(u, z) for u, z0 in blocks["val"] for z in range(z0, z0 + 16)}
    # samples of another kind placed by the split: one crossing two splits belongs to none
    inside = [(u, z0) for u, z0 in blocks["val"] if z0 + 16 < 64]
    crossing = [damacy.Sample(u, np.s_[z0 + 10 : z0 + 20, 0:8, 0:8]) for u, z0 in inside]
    assert [split.owner(s) for s in crossing] == [("val" if (u, z0 + 16) in blocks["val"] else None) for u, z0 in inside]
    whole = [damacy.Sample(u, np.s_[z0 : z0 + 16, :8, :8]) for u, z0 in blocks["train"] + blocks["val"]]
    assert split.filter(whole, "val") == whole[len(blocks["train"]) :]
    # a MultiSample goes where its parts of the split's arrays go (a label map the split does
    # not name follows them)
    u, z0 = blocks["val"][0]
    pair = damacy.MultiSample({"image": damacy.Sample(u, np.s_[z0 : z0 + 4, 0:8, 0:8]), "labels": damacy.Sample("/w/labels.zarr", np.s_[z0 : z0 + 4, 0:8, 0:8])})
    assert split.owner(pair) == "val" and split.filter([pair], "val") == [pair]
    assert split.owner(damacy.MultiSample({"labels": damacy.Sample("/w/labels.zarr", np.s_[0:4, 0:8, 0:8])})) is None
    # deterministic, and kept with a checkpoint as plain data
    again = damacy.split_chunks(list(VOLS), {"train": 0.75, "val": 0.25}, seed=4, chunks_of=chunks_of)
    assert again.parts == split.parts
    restored = damacy.Split.from_state(json.loads(json.dumps(split.state_dict())))
    assert restored.parts == split.parts and restored.params["seed"] == 4
    assert damacy.split_chunks(list(VOLS), {"train": 0.75, "val": 0.25}, seed=5, chunks_of=chunks_of).parts != split.parts


def test_splits_refuse_what_would_cross_them():
    split = damacy.split_chunks(list(VOLS), {"train": 0.5, "val": 0.5}, seed=1, chunks_of=chunks_of)
    with pytest.raises(damacy.InvalidArgument, match="does not fit in the region"):
        damacy.RandomBoxes(split.regions("val"), (20, 64, 64), seed=0, samples_per_epoch=4)
    with pytest.raises(damacy.InvalidArgument, match="would read past the region"):
        damacy.GridBoxes(split.regions("val"), (8, 64, 64), edge="pad")
    # a region of 5 planes, windows of 4 kept on a grid of 2 by the scales: the last window
    # would start at 4 and reach into the next region
    narrow = damacy.split_chunks(["/n.zarr"], {"train": 0.5, "val": 0.5}, seed=1, chunks_of=lambda u, level: ((20,), (5,), 1))
    with pytest.raises(damacy.InvalidArgument, match="only past the region's end on axis 0"):
        damacy.GridBoxes(narrow.regions("val"), (4,), scales={"half": 0.5})
    # regions given as an iterator (read more than once) keep their places
    for make in (lambda r: damacy.RandomBoxes(r, (4, 64, 64), seed=0, samples_per_epoch=50), lambda r: damacy.GridBoxes(r, (4, 64, 64))):
        assert {split.owner(s) for s in make(iter(split.regions("val")))} == {"val"}
    with pytest.raises(damacy.InvalidArgument, match="summing to 1"):
        damacy.split_chunks(list(VOLS), {"train": 0.5, "val": 0.2}, seed=1, chunks_of=chunks_of)
    with pytest.raises(damacy.InvalidArgument, match="no split named 'test'"):
        split.regions("test")
    # a selection naming fewer axes, or with '...', reads the others whole: across both splits
    across = damacy.split_chunks(["/w/v0.zarr"], {"train": 0.5, "val": 0.5}, seed=0, axis=2, chunks_of=chunks_of)
    left = next(n for n in ("train", "val") if across.regions(n)[0][1][2] == (0, 64))
    for sel in (np.s_[0:4], np.s_[0:4, ...], np.s_[0:4, 0:8]):
        assert across.owner(damacy.Sample("/w/v0.zarr", sel)) is None
    assert across.owner(damacy.Sample("/w/v0.zarr", np.s_[0:4, ..., 0:64])) == left
    assert across.owner(damacy.IndexQuery("/w/v0.zarr", (slice(0, 4), slice(0, 128), [3, 63]))) == left
    assert across.owner(damacy.IndexQuery("/w/v0.zarr", (slice(0, 4), slice(0, 128), [3, 64]))) is None
    old = damacy.Split.from_state({**across.state_dict(), "params": {}})  # saved without the shapes
    with pytest.raises(damacy.InvalidArgument, match="axis 1: the selection reaches the array's end"):
        old.owner(damacy.Sample("/w/v0.zarr", np.s_[0:4]))
    assert old.owner(damacy.Sample("/w/v0.zarr", np.s_[0:4, 0:128, 0:64])) == left
    whole = damacy.split_chunks(list(VOLS), {"train": 2 / 3, "test": 1 / 3}, seed=1, axis=None, chunks_of=chunks_of)
    assert sorted(len(whole.parts[n]) for n in whole.parts) == [1, 2]  # whole arrays
    assert all(box == ((0, 64), (0, 128), (0, 128)) for _, box in whole.regions("train"))


def test_the_guide_block_splits_two_volumes(tmp_path):
    from test_readme import block

    code = block("splits")
    for name in ("a", "b"):
        write_array(tmp_path / f"{name}.zarr", random_data((64, 64, 64), "uint16", seed=2), chunks=(16, 32, 32), compressors=[ZstdCodec()])
        code = code.replace(f"data/{name}.zarr", str(tmp_path / f"{name}.zarr"))
    scope: dict = {}
    exec(compile(code, "docs splits", "exec"), scope)
    split = scope["split"]
    assert len(split.regions("val")) >= 1 and damacy.Split.from_state(scope["saved"]).parts == split.parts
    blocks = {n: sum((box[0][1] - box[0][0]) // 16 for _, box in split.regions(n)) for n in ("train", "val")}
    assert blocks == {"train": 6, "val": 2}


def test_a_sampler_of_fewer_ranks_than_torchrun_started_is_one_node(monkeypatch):
    # validation on one rank inside a job of 2 ranks per node: LOCAL_WORLD_SIZE does not apply
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _planes(window=CELL, rank=0, world_size=1).local_world_size == 1
    assert _planes(window=CELL, rank=0, world_size=4).local_world_size == 2
    with pytest.raises(damacy.InvalidArgument, match="local_world_size must divide"):
        _planes(window=CELL, rank=0, world_size=4, local_world_size=3)
