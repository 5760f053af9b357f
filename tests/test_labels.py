"""Label-aware random boxes: centred on label classes drawn by ratios, and holding a minimum
share of foreground measured on a coarse map; deterministic and resumable like every box."""

from __future__ import annotations

import numpy as np
import pytest

import damacy
from damacy.labels import LabelMaps

from conftest import write_array

SHAPE, BOX = (64, 128, 96), (16, 32, 32)
KW = dict(seed=5, rank=0, world_size=1)


def _centre(s):
    return [(sl.start + sl.stop) // 2 for sl in s.selection]


def _in(c, lo, hi):
    return all(a <= x <= b for x, a, b in zip(c, lo, hi))


def _labels():
    lab = np.zeros((8, 16, 12), dtype=np.uint8)  # one element per 8x8x8 of the array
    lab[1, 2, 2] = 1  # array [8:16, 16:24, 16:24]
    lab[6, 12, 9:11] = 2  # array [48:56, 96:104, 72:88]
    return lab


def test_boxes_centre_on_classes_by_their_ratios(tmp_path):
    lab = _labels()
    # class 3 is nowhere in the map: the ratios of the classes it holds are renormalised (3:1)
    s = damacy.RandomBoxes({"/d/a.zarr": SHAPE}, BOX, samples_per_epoch=2000, labels=[lab], label_ratios={1: 3, 2: 1, 3: 5}, **KW)
    boxes = list(s)
    one = sum(_in(_centre(b), (8, 16, 16), (16, 24, 24)) for b in boxes)
    two = sum(_in(_centre(b), (48, 96, 72), (56, 104, 88)) for b in boxes)
    assert one + two == 2000 and abs(one - 1500) < 80, (one, two)  # 3 sigma is 58
    assert all(0 <= e.start and e.stop <= n for b in boxes for e, n in zip(b.selection, SHAPE))
    assert len({tuple(_centre(b)) for b in boxes if _in(_centre(b), (48, 96, 72), (56, 104, 88))}) > 100  # spread over the class
    # deterministic and resumable: the same boxes again, and from any offset
    again = damacy.RandomBoxes({"/d/a.zarr": SHAPE}, BOX, samples_per_epoch=2000, labels={"/d/a.zarr": lab}, label_ratios={1: 3, 2: 1, 3: 5}, **KW)
    assert list(again) == boxes and list(again.iter_from(1500)) == boxes[1500:]
    # background is a class too (MONAI's ratios name it): half the boxes centre on 0s
    half = list(damacy.RandomBoxes({"/d/a.zarr": SHAPE}, BOX, samples_per_epoch=2000, labels=[lab], label_ratios={0: 1, 1: 1}, **KW))
    on_one = sum(_in(_centre(b), (8, 16, 16), (16, 24, 24)) for b in half)
    assert abs(on_one - 1000) < 110, on_one
    # a label map read from an array written by zarr-python: the same boxes
    write_array(tmp_path / "labels.zarr", lab, chunks=(4, 8, 6))
    from_uri = damacy.RandomBoxes({"/d/a.zarr": SHAPE}, BOX, samples_per_epoch=2000, labels=[str(tmp_path / "labels.zarr")], label_ratios={1: 3, 2: 1, 3: 5}, **KW)
    assert list(from_uri) == boxes


def test_label_options_are_checked():
    lab = _labels()
    with pytest.raises(damacy.InvalidArgument, match="holds none of the classes"):
        damacy.RandomBoxes({"/d/a.zarr": SHAPE}, BOX, samples_per_epoch=10, labels=[lab], label_ratios={7: 1}, **KW)
    with pytest.raises(damacy.InvalidArgument, match="label_ratios needs labels"):
        damacy.RandomBoxes({"/d/a.zarr": SHAPE}, BOX, samples_per_epoch=10, label_ratios={1: 1}, **KW)
    with pytest.raises(damacy.InvalidArgument, match="not both"):
        damacy.RandomBoxes({"/d/a.zarr": SHAPE}, BOX, samples_per_epoch=10, labels=[lab], foreground=[lab], **KW)
    with pytest.raises(damacy.InvalidArgument, match="non-negative"):
        damacy.RandomBoxes({"/d/a.zarr": SHAPE}, BOX, samples_per_epoch=10, labels=[lab], label_ratios={1: -1}, **KW)
    with pytest.raises(damacy.InvalidArgument, match="min_foreground"):
        damacy.RandomBoxes({"/d/a.zarr": SHAPE}, BOX, samples_per_epoch=10, labels=[lab], min_foreground=2.0, **KW)
    with pytest.raises(damacy.InvalidArgument, match="2 maps for 1 arrays"):
        damacy.RandomBoxes({"/d/a.zarr": SHAPE}, BOX, samples_per_epoch=10, labels=[lab, lab], label_ratios={1: 1}, **KW)
    for weight in ("x", [1], True):
        with pytest.raises(damacy.InvalidArgument, match="weights must be numbers"):
            damacy.RandomBoxes({"/d/a.zarr": SHAPE}, BOX, samples_per_epoch=10, labels=[lab], label_ratios={1: weight}, **KW)
    with pytest.raises(damacy.InvalidArgument, match="no elements"):
        damacy.RandomBoxes({"/d/e.zarr": (0, 30)}, (4, 4), samples_per_epoch=4, foreground=[np.ones((1, 30))], min_foreground=0.5, **KW)


def test_a_box_centred_on_foreground_holds_it_when_the_scales_align_boxes():
    """Boxes of an aligned size (scales of 1/4: origins on multiples of 4) centred on the one
    foreground element hold it (the origin is the aligned one nearest the centred box's)."""
    mask = np.zeros(64, np.uint8)
    mask[33] = 1
    for size in (4, 8, 12):
        s = damacy.RandomBoxes({"/d/a.zarr": (64,)}, (size,), samples_per_epoch=100, foreground=[mask], scales={"a": 0.25}, **KW)
        boxes = [x.selection[0] for x in s]
        assert all(b.start <= 33 < b.stop and b.start % 4 == 0 for b in boxes), (size, boxes[:3])


def _exact_fraction(mask, shape, box):
    """The share of a box's voxels (inside the array) whose map element is nonzero, voxel by
    voxel: voxel x lies in map element floor(x * m / n) on each axis."""
    idx = [np.minimum((np.arange(max(a, 0), min(b, n)) * m) // n, m - 1) for (a, b), n, m in zip(box, shape, mask.shape)]
    sub = (mask != 0)[np.ix_(*idx)]
    return sub.mean()


def test_the_foreground_share_of_a_box_comes_from_the_summed_area_table():
    rng = np.random.default_rng(0)
    mask = (rng.random((8, 16, 12)) < 0.3).astype(np.uint8)
    maps = LabelMaps([mask], ["/d/a.zarr"])
    shape = np.array(SHAPE)
    origins = np.stack([rng.integers(0, n - k + 1, 300) for n, k in zip(SHAPE, BOX)], axis=1)
    sizes = np.tile(BOX, (300, 1))
    got = maps.fraction(0, origins, sizes, shape)
    want = [_exact_fraction(mask, SHAPE, [(o, o + k) for o, k in zip(org, BOX)]) for org in origins]
    assert np.allclose(got, want, atol=1e-9)  # whole map elements per voxel: exact
    # a map that does not divide the array: elements straddle voxels, the share is the map's
    odd = (rng.random((7, 13, 11)) < 0.5).astype(np.uint8)
    got = LabelMaps([odd], ["/d/a.zarr"]).fraction(0, origins, sizes, shape)
    want = [_exact_fraction(odd, SHAPE, [(o, o + k) for o, k in zip(org, BOX)]) for org in origins]
    assert np.abs(got - np.array(want)).max() < 0.1


def test_boxes_hold_the_minimum_share_of_foreground():
    mask = np.zeros((8, 16, 12), dtype=np.uint8)
    mask[4:8, 0:6, 0:5] = 1  # a corner block: most uniform boxes miss it
    kw = dict(samples_per_epoch=400, **KW)
    plain = list(damacy.RandomBoxes({"/d/a.zarr": SHAPE}, BOX, **kw))
    held = list(damacy.RandomBoxes({"/d/a.zarr": SHAPE}, BOX, foreground=[mask], foreground_fraction=0.0, min_foreground=0.5, max_tries=256, **kw))

    def share(b):
        return _exact_fraction(mask, SHAPE, [(sl.start, sl.stop) for sl in b.selection])

    assert sum(share(b) >= 0.5 for b in plain) < 100  # uniform boxes mostly fall short
    assert all(share(b) >= 0.5 for b in held)  # each drawn again until it holds enough (1 in 20 draws does)
    # boxes that already hold enough are kept as drawn
    assert [b for b in plain if share(b) >= 0.5] == [b for b, p in zip(held, plain) if share(p) >= 0.5]
    # one try: some stay short, the best of the tries is kept, never worse than the first draw
    once = list(damacy.RandomBoxes({"/d/a.zarr": SHAPE}, BOX, foreground=[mask], foreground_fraction=0.0, min_foreground=0.5, max_tries=1, **kw))
    assert sum(share(b) >= 0.5 for b in plain) < sum(share(b) >= 0.5 for b in once) < 400
    assert all(share(b) >= share(p) for b, p in zip(once, plain))
    # label maps serve too (their nonzero elements), with class centring on top
    lab = _labels()
    both = list(damacy.RandomBoxes({"/d/a.zarr": SHAPE}, BOX, labels=[lab], label_ratios={2: 1}, min_foreground=0.05, **kw))
    assert all(_exact_fraction(lab, SHAPE, [(sl.start, sl.stop) for sl in b.selection]) >= 0.05 for b in both)
