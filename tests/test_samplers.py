"""Samplers: each rank's part of each epoch, checked against the one global list built from
(seed, epoch): disjoint across ranks, complete, the same on every run, and windows that
cover every element."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from zarr.codecs import ZstdCodec

import damacy

from conftest import random_data, write_array

SHAPES = {"/data/a.zarr": (100, 80, 60), "/data/b.zarr": (40, 300, 50), "/data/c.zarr": (20, 20, 20)}


def _boxes(samples):
    return [(s.uri, tuple((sl.start, sl.stop) for sl in s.selection)) for s in samples]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_random_boxes_ranks_take_disjoint_strides_of_one_global_list(world):
    ranks = [damacy.RandomBoxes(SHAPES, (16, 16, 16), seed=7, samples_per_epoch=103, rank=r, world_size=world) for r in range(world)]
    for s in ranks:
        s.set_epoch(3)
    glob = _boxes(ranks[0].epoch_samples())
    assert len(glob) == 103
    per_rank = 103 // world
    for r, s in enumerate(ranks):
        mine = _boxes(list(s))
        assert len(mine) == len(s) == per_rank
        assert mine == glob[r::world][:per_rank]
    positions = sorted(i for r in range(world) for i in range(r, 103, world)[:per_rank])
    assert len(positions) == len(set(positions)) == per_rank * world  # disjoint, nothing dropped but the remainder
    again = damacy.RandomBoxes(SHAPES, (16, 16, 16), seed=7, samples_per_epoch=103, rank=0, world_size=1)
    again.set_epoch(3)
    assert _boxes(again.epoch_samples()) == glob  # the same for any number of ranks
    again.set_epoch(4)
    assert _boxes(again.epoch_samples()) != glob


def test_random_boxes_stay_inside_and_follow_weights():
    s = damacy.RandomBoxes(SHAPES, (16, 32, 16), seed=1, samples_per_epoch=2000, weights=[1, 3, 0], rank=0, world_size=1)
    boxes = _boxes(s)
    counts = {u: sum(1 for b in boxes if b[0] == u) for u in SHAPES}
    assert counts["/data/c.zarr"] == 0 and counts["/data/b.zarr"] > 2 * counts["/data/a.zarr"] > 0
    for uri, box in boxes:
        for (a, b), n, k in zip(box, SHAPES[uri], (16, 32, 16)):
            assert b - a == k and a >= 0 and (b <= n or a == 0)
    c_only = damacy.RandomBoxes({"/data/c.zarr": (20, 20, 20)}, (16, 32, 16), seed=1, samples_per_epoch=10)
    assert all(box[1] == (0, 32) for _, box in _boxes(c_only))  # an axis shorter than the box: origin 0


def test_random_boxes_read_shapes_from_metadata(tmp_path):
    write_array(tmp_path / "v.zarr", random_data((30, 40), "uint8"), chunks=(10, 10))
    s = damacy.RandomBoxes([str(tmp_path / "v.zarr")], (8, 8), seed=0, samples_per_epoch=5)
    assert s.arrays == [(str(tmp_path / "v.zarr"), (30, 40))] and len(list(s)) == 5


@pytest.mark.parametrize("world, drop_last", [(1, False), (3, False), (3, True), (4, False), (7, True)])
def test_shuffled_covers_the_list_once_per_epoch(world, drop_last):
    samples = [damacy.Sample("/data/a.zarr", ((i, i + 1), (0, 1), (0, 1))) for i in range(22)]
    ranks = [damacy.Shuffled(samples, seed=5, rank=r, world_size=world, drop_last=drop_last) for r in range(world)]
    parts = [list(s) for s in ranks]
    assert len({len(p) for p in parts}) == 1 and len(parts[0]) == len(ranks[0])
    seen = [x for p in parts for x in p]
    if drop_last:
        assert len(seen) == len(set(seen)) == (22 // world) * world
    else:
        assert set(seen) == set(samples)
        assert len(seen) - len(set(seen)) == -(-22 // world) * world - 22  # only the padding repeats
    order = ranks[0].epoch_samples()
    ranks[0].set_epoch(1)
    assert ranks[0].epoch_samples() != order and sorted(map(hash, ranks[0].epoch_samples())) == sorted(map(hash, order))


@pytest.mark.parametrize("edge", ["shift", "pad"])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_grid_windows_cover_everything_each_once_across_ranks(edge, world):
    shapes = {"/x.zarr": (37, 50), "/y.zarr": (8, 9)}
    ranks = [damacy.GridBoxes(shapes, (16, 20), step=(12, 20), edge=edge, rank=r, world_size=world) for r in range(world)]
    parts = [list(s) for s in ranks]
    assert len({len(p) for p in parts}) == 1  # every rank takes the same number of steps
    real = [s for p in parts for s in p if not isinstance(s, damacy.Padding)]
    padding = [s for p in parts for s in p if isinstance(s, damacy.Padding)]
    assert _boxes(real) == _boxes(ranks[0].epoch_samples())  # each window once, in order, contiguous per rank
    assert len(padding) == len(parts[0]) * world - len(real) < world
    for uri, shape in shapes.items():
        cover = np.zeros(shape, dtype=np.int32)
        for u, box in _boxes(real):
            if u == uri:
                assert edge == "pad" or all(b <= n or a == 0 for (a, b), n in zip(box, shape))
                cover[tuple(slice(max(a, 0), b) for a, b in box)] += 1
        assert cover.min() >= 1  # every element in some window


def test_grid_refuses_gaps_and_bad_edges():
    with pytest.raises(damacy.InvalidArgument, match="leave gaps"):
        damacy.GridBoxes({"/x.zarr": (10,)}, (4,), step=(5,))
    with pytest.raises(damacy.InvalidArgument, match="edge"):
        damacy.GridBoxes({"/x.zarr": (10,)}, (4,), edge="wrap")


def test_rank_and_world_size_come_from_torchruns_environment(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    s = damacy.RandomBoxes(SHAPES, (4, 4, 4), seed=0, samples_per_epoch=9)
    assert (s.rank, s.world_size) == (2, 3)
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(damacy.InvalidArgument, match=r"rank must be in \[0, 3\)"):
        damacy.RandomBoxes(SHAPES, (4, 4, 4), seed=0, samples_per_epoch=9)


def test_counts_may_be_numpy_integers_and_bools_are_refused():
    counts = np.array([9, 1, 3, 0])
    s = damacy.RandomBoxes(SHAPES, (4, 4, 4), seed=counts[3], samples_per_epoch=counts[0], rank=counts[1], world_size=counts[2], max_tries=counts[2])
    assert (s.samples_per_epoch, s.rank, s.world_size, s.max_tries) == (9, 1, 3, 3) and len(s) == 3
    assert type(s.samples_per_epoch) is int and type(s.world_size) is int
    with pytest.raises(damacy.InvalidArgument, match="seed"):
        damacy.RandomBoxes(SHAPES, (4, 4, 4), seed=True, samples_per_epoch=9)
    with pytest.raises(damacy.InvalidArgument, match="world_size"):
        damacy.RandomBoxes(SHAPES, (4, 4, 4), seed=0, samples_per_epoch=9, rank=0, world_size=np.bool_(True))
    with pytest.raises(damacy.InvalidArgument, match="GridBoxes needs at least one array"):
        damacy.GridBoxes({}, (4, 4, 4))


def test_bad_arguments_are_refused_naming_them():
    cases = [
        (lambda: damacy.RandomBoxes(SHAPES, (0, 3, 3), seed=0, samples_per_epoch=2), "sample_shape must be a positive integer per axis"),
        (lambda: damacy.RandomBoxes(SHAPES, (-2, 3, 3), seed=0, samples_per_epoch=2), "sample_shape must be a positive integer per axis"),
        (lambda: damacy.GridBoxes(SHAPES, (0, 3, 3)), "sample_shape must be a positive integer per axis"),
        (lambda: damacy.RandomBoxes(SHAPES, (3, 3, 3), seed=0, samples_per_epoch=3, flips="x"), "flips must be a sequence of axis numbers"),
        (lambda: damacy.RandomBoxes(SHAPES, (3, 3, 3), seed=0, samples_per_epoch=3, transposes=[(0, "a", 2)]), "each of transposes must be"),
        (lambda: damacy.RandomBoxes(SHAPES, (3, 3, 3), seed=0, samples_per_epoch=3, weights=["a", 1, 1]), "weights must be 3 non-negative numbers"),
        (lambda: damacy.chunk_windows([], window=10, seed=-1), "seed must be a non-negative integer"),
        (lambda: damacy.split_chunks(["/a"], {"t": 1.0}, seed=-1, chunks_of=lambda u, level: ((8,), (4,), 1)), "seed must be"),
        (lambda: damacy.split_chunks(["/a"], {"t": 1.0}, seed=0, axis=0.0, chunks_of=lambda u, level: ((8,), (4,), 1)), "axis must be an axis number"),
    ]
    for make, message in cases:
        with pytest.raises(damacy.InvalidArgument, match=message):
            result = make()
            list(result) if hasattr(result, "__next__") else None
    # flips and transposes as any iterables of integers
    s = damacy.RandomBoxes(SHAPES, (3, 3, 3), seed=0, samples_per_epoch=3, flips={2, 0}, transposes=iter([(2, 1, 0)]))
    assert s.flips == (0, 2) and s.transposes == [(2, 1, 0)]
    # an elastic resume checks each state's offset against its rank's share
    items = [damacy.Sample("/a", ((i, i + 1),)) for i in range(10)]
    state = damacy.Shuffled(items, seed=0).state_dict()
    for bad in ({"source_state": state}, {"source_state": state, "offset": -1}, {"source_state": state, "offset": 11}):
        with pytest.raises(damacy.InvalidArgument, match=r"offset .* from 0 to 10"):
            damacy.Shuffled(items, seed=0).resume([bad])


def test_sampler_state_round_trips_and_checks_the_seed():
    s = damacy.RandomBoxes(SHAPES, (4, 4, 4), seed=3, samples_per_epoch=9, rank=0, world_size=1)
    s.set_epoch(5)
    t = damacy.RandomBoxes(SHAPES, (4, 4, 4), seed=3, samples_per_epoch=9, rank=0, world_size=1)
    t.load_state_dict(pickle.loads(pickle.dumps(s.state_dict())))
    assert t.epoch == 5 and _boxes(t) == _boxes(s)
    with pytest.raises(damacy.InvalidArgument, match="seed 3"):
        damacy.RandomBoxes(SHAPES, (4, 4, 4), seed=4, samples_per_epoch=9).load_state_dict(s.state_dict())


def test_padding_is_marked_in_batch_info_in_every_mode(tmp_path, make):
    data = random_data((30, 20), "uint16", seed=2)
    write_array(tmp_path / "g.zarr", data, chunks=(10, 10), compressors=[ZstdCodec()])
    uri = str(tmp_path / "g.zarr")
    grid = damacy.GridBoxes([uri], (10, 10), rank=1, world_size=4)  # 6 windows: ranks 2 and 3 pad
    rank3 = damacy.GridBoxes([uri], (10, 10), rank=3, world_size=4)
    assert len(grid) == len(rank3) == 2
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(10, 10), dtype="u16")
    for sampler, padded in ((grid, ()), (rank3, (1,))):
        with make(cfg) as p:
            p.push(sampler)
            batch = p.pop()
            got = np.array(np.from_dlpack(batch))
            assert batch.info.padding == padded
            for k, s in enumerate(batch.info.samples):
                box = tuple(slice(sl.start, sl.stop) for sl in s.selection)
                np.testing.assert_array_equal(got[k], data[box])
    assert isinstance(pickle.loads(pickle.dumps(list(rank3)[1])), damacy.Padding)


def test_the_readme_example_runs(tmp_path):
    from test_readme import block

    for name in ("a", "b"):
        write_array(tmp_path / f"{name}.zarr", random_data((64, 96, 80), "uint16", seed=ord(name)), chunks=(32, 32, 32), compressors=[ZstdCodec()])
    code = block("samplers").replace('"data/', f'"{tmp_path}/')
    scope: dict = {}
    exec(compile(code, "README samplers", "exec"), scope)
    assert len(scope["train"]) == 64 and scope["train"].epoch == 1
    assert len(scope["val"]) == 3 * 2 * 2 and scope["keep"]  # 3 x 2 x 2 windows, none padding on one rank


def test_locality_gives_a_nodes_ranks_neighbouring_boxes_at_each_step():
    shapes = {"/d/a.zarr": (256, 256, 256), "/d/b.zarr": (256, 256, 256)}

    def ranks(locality):
        out = []
        for r in range(4):
            s = damacy.RandomBoxes(shapes, (32, 32, 32), seed=9, samples_per_epoch=400, rank=r, world_size=4, local_world_size=2, locality=locality)
            s.set_epoch(1)
            out.append(list(s))
        return out

    def cell(s):
        return (s.uri, tuple(sl.start // 32 for sl in s.selection))

    plain, local = ranks(False), ranks(True)
    everything = sorted(_boxes(x for p in plain for x in p))
    assert sorted(_boxes(x for p in local for x in p)) == everything  # the same boxes, read by others
    for parts in (plain, local):
        assert len({len(p) for p in parts}) == 1
    shared = [sum(cell(a) == cell(b) for a, b in zip(parts[2 * n], parts[2 * n + 1])) for parts in (plain, local) for n in range(2)]
    assert min(shared[2:]) > 5 * max(1, max(shared[:2]))  # a node's two ranks read the same cell at most steps
    # elastic resume keeps working with the order: 4 ranks (2 nodes) -> 3 ranks on one node
    states = [{"offset": 30, "source_state": s.state_dict()} for s in [
        damacy.RandomBoxes(shapes, (32, 32, 32), seed=9, samples_per_epoch=400, rank=r, world_size=4, local_world_size=2, locality=True) for r in range(4)]]
    for st in states:
        st["source_state"]["epoch"] = 1
    firsts = [p[:30] for p in local]
    new = []
    for r in range(3):
        s = damacy.RandomBoxes(shapes, (32, 32, 32), seed=9, samples_per_epoch=400, rank=r, world_size=3, local_world_size=3, locality=True)
        s.resume(states)
        new += list(s)
    read = _boxes(x for p in firsts for x in p) + _boxes(new)
    assert len(read) == len(set(read)) and len(everything) - len(read) < 4 + 3


def _centre(s):
    return np.array([(e.start + e.stop) // 2 for e in s.selection])


def test_foreground_masks_centre_boxes_on_foreground(tmp_path):
    shape, box = (64, 128, 96), (16, 32, 32)
    mask = np.zeros((8, 16, 12), dtype=np.uint8)  # one element per 8x8x8 of the array
    mask[3, 10, 2:4] = 1  # array region [24:32, 80:88, 16:32]
    kw = dict(seed=2, samples_per_epoch=200)
    drawn = list(damacy.RandomBoxes({"/d/a.zarr": shape}, box, foreground=[mask], **kw))
    for s in drawn:
        c = _centre(s)
        assert 24 <= c[0] < 32 + 1 and 80 <= c[1] < 88 + 1 and 16 <= c[2] < 32 + 1, s  # centred there (+-1: an even box's centre)
        assert all(0 <= e.start and e.stop <= n for e, n in zip(s.selection, shape))  # and inside the array
    assert len({tuple(_centre(s)) for s in drawn}) > 50  # anywhere in the foreground, not one box
    assert drawn == list(damacy.RandomBoxes({"/d/a.zarr": shape}, box, foreground={"/d/a.zarr": mask}, **kw))  # same seed, same boxes

    # a fraction of them: the others uniform; an array without a mask as before
    half = list(damacy.RandomBoxes({"/d/a.zarr": shape}, box, foreground=[mask], foreground_fraction=0.3, **kw))
    on = sum(bool(24 <= _centre(s)[0] <= 32 and 80 <= _centre(s)[1] <= 88 and 16 <= _centre(s)[2] <= 32) for s in half)
    assert 30 <= on <= 100  # 0.3 of 200 drawn (plus uniform boxes landing there by chance), a fixed seed
    plain = damacy.RandomBoxes({"/d/a.zarr": shape, "/d/b.zarr": shape}, box, **kw)
    masked_b = damacy.RandomBoxes({"/d/a.zarr": shape, "/d/b.zarr": shape}, box, foreground={"/d/b.zarr": mask}, **kw)
    assert [s for s in plain if s.uri.endswith("a.zarr")] != [] and all(
        s == t for s, t in zip(plain, masked_b) if s.uri.endswith("a.zarr")
    )  # a's boxes are unchanged: the masks draw only after the uniform draw
    assert list(plain) == list(damacy.RandomBoxes({"/d/a.zarr": shape, "/d/b.zarr": shape}, box, foreground=[None, None], **kw))

    # a mask read from an array (labels at a coarse level), written by zarr-python
    write_array(tmp_path / "mask.zarr", mask, chunks=(4, 8, 6))
    from_uri = list(damacy.RandomBoxes({"/d/a.zarr": shape}, box, foreground=[str(tmp_path / "mask.zarr")], **kw))
    assert from_uri == drawn

    with pytest.raises(damacy.InvalidArgument, match="no foreground"):
        damacy.RandomBoxes({"/d/a.zarr": shape}, box, foreground=[np.zeros((4, 4, 4))], **kw)
    with pytest.raises(damacy.InvalidArgument, match="2 axes, the array 3"):
        damacy.RandomBoxes({"/d/a.zarr": shape}, box, foreground=[np.ones((4, 4))], **kw)
    with pytest.raises(damacy.InvalidArgument, match="not among the arrays"):
        damacy.RandomBoxes({"/d/a.zarr": shape}, box, foreground={"/d/c.zarr": mask}, **kw)
    with pytest.raises(damacy.InvalidArgument, match="probability"):
        damacy.RandomBoxes({"/d/a.zarr": shape}, box, foreground=[mask], foreground_fraction=1.5, **kw)
    with pytest.raises(damacy.InvalidArgument, match="2 masks for 1 arrays"):
        damacy.RandomBoxes({"/d/a.zarr": shape}, box, foreground=[mask, mask], **kw)


def test_foreground_boxes_near_an_edge_stay_inside_and_keep_scaled_parts_whole():
    shape = (40, 40)
    mask = np.zeros((40, 40), dtype=bool)
    mask[0, 39] = True  # a corner: the box centred there reaches out, and is moved in
    group = [{"image": "/d/i.zarr", "label": "/d/l.zarr"}]
    s = damacy.RandomBoxes(group, (8, 8), seed=1, samples_per_epoch=20, foreground=[mask], scales={"label": 0.5}, shape_of=lambda u: shape)
    for m in s:
        assert m["image"].selection == (slice(0, 8), slice(32, 40))  # inside, on even origins
        assert m["label"].selection == (slice(0, 4), slice(16, 20))


def test_an_array_that_cannot_be_opened_fails_its_samples_and_the_epoch_goes_on(tmp_path, make):
    """RandomBoxes reads an array's shape when it first draws it: one that cannot be opened
    (a plate's missing field, a broken zarr.json) stands as one box at its origin, whose
    samples fail naming it under the error policy, and the epoch is delivered whole."""
    data = random_data((16, 16), "uint16", seed=3)
    write_array(tmp_path / "good.zarr", data, chunks=(8, 8))
    (tmp_path / "broken.zarr").mkdir()
    (tmp_path / "broken.zarr" / "zarr.json").write_text("{not json")
    uris = [str(tmp_path / "good.zarr"), str(tmp_path / "gone.zarr"), str(tmp_path / "broken.zarr")]
    sampler = damacy.RandomBoxes(uris, (4, 4), seed=1, samples_per_epoch=30, rank=0, world_size=1)
    with make(damacy.Config(samples_per_batch=5, sample_shape=(4, 4), dtype="u16", on_error="fill")) as p:
        p.push(sampler)
        seen = failed = 0
        for b in p:
            with b:
                errors = dict(b.info.errors)
                for j, s in enumerate(b.info.samples):
                    seen += 1
                    if s.uri == uris[0]:
                        assert j not in errors and np.array_equal(b.numpy()[j], data[s.selection])
                    else:
                        failed += 1
                        assert s.selection == (slice(0, 4), slice(0, 4))
                        kind = damacy.NotFound if s.uri == uris[1] else damacy.MetadataError
                        assert isinstance(errors[j], kind) and s.uri in str(errors[j])
    assert seen == 30 and 0 < failed < 30
    assert sorted(sampler.arrays.unreadable) == [1, 2]
