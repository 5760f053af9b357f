"""Samples of several arrays: an image, its labels at half the resolution and a mask, at one
box, read into one batch per name, each exact against zarr-python, in both modes."""

from __future__ import annotations

import numpy as np
import pytest
import zarr
from zarr.codecs import ZstdCodec

import damacy

from conftest import random_data, write_array


@pytest.fixture(scope="module")
def arrays(tmp_path_factory):
    folder = tmp_path_factory.mktemp("multi")
    write_array(folder / "image.zarr", random_data((32, 48, 40), "uint16", seed=1), chunks=(8, 16, 16), compressors=[ZstdCodec()])
    write_array(folder / "label.zarr", random_data((16, 24, 20), "uint8", seed=2), chunks=(8, 8, 10))
    write_array(folder / "mask.zarr", random_data((32, 48, 40), "bool", seed=3), chunks=(16, 16, 20))
    uris = {name: str(folder / f"{name}.zarr") for name in ("image", "label", "mask")}
    return uris, {name: zarr.open_array(uri, mode="r")[...] for name, uri in uris.items()}


def _configs(on_error="raise", drop_last=False, **kw):
    # (damacy's own policies: a bad sample raised at its pop, the last batch short)
    kw["drop_last"] = drop_last
    return {
        "image": damacy.Config(samples_per_batch=3, sample_shape=(8, 16, 16), dtype="f32", on_error=on_error, **kw),
        "label": damacy.Config(samples_per_batch=3, sample_shape=(4, 8, 8), dtype="u8", on_error=on_error, **kw),
        "mask": damacy.Config(samples_per_batch=3, sample_shape=(8, 16, 16), dtype="bool", on_error=on_error, **kw),
    }


def _boxes(n, seed=0):
    rng = np.random.default_rng(seed)
    return [tuple(slice(int(a), int(a) + k) for a, k in zip(2 * rng.integers(0, [12, 16, 12]), (8, 16, 16))) for _ in range(n)]


def _half(box):
    return tuple(slice(s.start // 2, s.stop // 2) for s in box)


@pytest.mark.parametrize("mode", ["embedded", "daemon"])
def test_every_array_of_a_sample_reads_exactly(arrays, mode, request):
    uris, data = arrays
    kw = {"endpoint": request.getfixturevalue("daemon").endpoint} if mode == "daemon" else {}
    boxes = _boxes(7)
    samples = [damacy.MultiSample.at(uris, b, scales={"label": 0.5}) for b in boxes]
    got = {name: [] for name in uris}
    with damacy.MultiPipeline(_configs(), **kw) as pipe:
        pipe.push(samples)
        for multi in pipe:
            with multi:
                assert {b.info.batch_id for _, b in multi.items()} == {multi.batch_id}
                for name, batch in multi.items():
                    got[name].extend(batch.copy())
                    assert list(batch.info.samples) == [s[name] for s in samples[3 * multi.batch_id : 3 * multi.batch_id + 3]]
    for k, box in enumerate(boxes):
        np.testing.assert_array_equal(got["image"][k], data["image"][box].astype("f4"))
        np.testing.assert_array_equal(got["label"][k], data["label"][_half(box)])
        np.testing.assert_array_equal(got["mask"][k], data["mask"][box])


def test_a_failed_part_fails_the_whole_batch_and_the_next_stays_aligned(arrays):
    uris, data = arrays
    boxes = _boxes(6, seed=1)
    samples = [damacy.MultiSample.at(uris, b, scales={"label": 0.5}) for b in boxes]
    bad = dict(samples[1].parts, label=damacy.Sample(uris["label"], np.s_[14:18, 0:8, 0:8]))  # past the label's end
    samples[1] = damacy.MultiSample(bad)
    with damacy.MultiPipeline(_configs(out_of_bounds="error")) as pipe:
        pipe.push(samples)
        with pytest.raises(damacy.OutOfBounds):
            pipe.pop()
        with pipe.pop() as multi:
            assert multi.batch_id == 1
            np.testing.assert_array_equal(multi["image"].copy()[0], data["image"][boxes[3]].astype("f4"))
            np.testing.assert_array_equal(multi["label"].copy()[2], data["label"][_half(boxes[5])])


def test_transforms_apply_to_every_part(arrays):
    uris, data = arrays
    box = _boxes(1, seed=2)[0]
    cfgs = {name: damacy.Config(samples_per_batch=1, sample_shape=tuple(reversed(c.sample_shape)), dtype=c.dtype) for name, c in _configs().items()}
    with damacy.MultiPipeline(cfgs) as pipe:
        pipe.push([damacy.MultiSample.at(uris, box, scales={"label": 0.5}, flip=(1,), transpose=(2, 1, 0))])
        with pipe.pop() as multi:
            for name, sel in (("image", box), ("label", _half(box)), ("mask", box)):
                want = np.transpose(np.flip(data[name][sel], 1), (2, 1, 0))
                np.testing.assert_array_equal(multi[name].copy()[0], want.astype(multi[name].copy().dtype))


def test_what_a_multi_pipeline_refuses(arrays):
    uris, _ = arrays
    with pytest.raises(damacy.InvalidArgument, match="skip"):
        damacy.MultiPipeline(_configs(on_error="skip"))
    cfgs = _configs()
    cfgs["label"] = damacy.Config(samples_per_batch=2, sample_shape=(4, 8, 8))
    with pytest.raises(damacy.InvalidArgument, match="same samples_per_batch"):
        damacy.MultiPipeline(cfgs)
    with pytest.raises(damacy.InvalidArgument, match="whole numbers"):
        damacy.MultiSample.at(uris, np.s_[1:9, 0:16, 0:16], scales={"label": 0.5})
    with damacy.MultiPipeline(_configs()) as pipe:
        pipe.push([damacy.MultiSample({"image": damacy.Sample(uris["image"], np.s_[0:8, 0:16, 0:16])})])
        with pytest.raises(damacy.InvalidArgument, match="MultiSamples of"):
            pipe.pop()


def test_samplers_draw_groups_of_arrays(arrays):
    uris, data = arrays
    sampler = damacy.RandomBoxes([uris], (8, 16, 16), seed=3, samples_per_epoch=6, scales={"label": 0.5}, rank=0, world_size=1)
    drawn = list(sampler)
    assert all(isinstance(s, damacy.MultiSample) and list(s.parts) == list(uris) for s in drawn)
    even = [s for s in drawn if all(sl.start % 2 == 0 for sl in s["image"].selection)]
    assert even == drawn  # origins kept even: the half-resolution labels land on whole coordinates
    with damacy.MultiPipeline({k: damacy.Config(samples_per_batch=1, sample_shape=c.sample_shape, dtype=c.dtype) for k, c in _configs().items()}) as pipe:
        pipe.push(even)
        for s, multi in zip(even, pipe):
            with multi:
                box = tuple(slice(sl.start, sl.stop) for sl in s["image"].selection)
                np.testing.assert_array_equal(multi["image"].copy()[0], data["image"][box].astype("f4"))
                np.testing.assert_array_equal(multi["label"].copy()[0], data["label"][_half(box)])
    grid = damacy.GridBoxes([{"image": uris["image"], "mask": uris["mask"]}], (8, 16, 20), rank=0, world_size=1)
    assert len(grid) == 4 * 3 * 2 and all(set(s.parts) == {"image", "mask"} for s in grid)


def test_padding_of_a_group_marks_every_part(arrays):
    uris, _ = arrays
    grid = damacy.GridBoxes([{"image": uris["image"], "mask": uris["mask"]}], (8, 16, 20), rank=4, world_size=5)  # 24 windows
    last = list(grid)[-1]
    assert len(grid) == 5 and all(isinstance(p, damacy.Padding) for p in last.parts.values())


def test_a_timed_out_name_keeps_the_others_in_step_and_state_carries_the_sampler(arrays):
    uris, data = arrays
    cfgs = _configs()
    cfgs["label"] = damacy.Config(samples_per_batch=3, sample_shape=(4, 8, 8), dtype="u8", prepared_batches=1, on_error="raise", drop_last=False)
    sampler = damacy.RandomBoxes([uris], (8, 16, 16), seed=5, samples_per_epoch=9, scales={"label": 0.5}, rank=0, world_size=1)
    drawn = list(sampler)
    with damacy.MultiPipeline(cfgs) as pipe:
        pipe.push(sampler)
        first = pipe.pop()
        with pytest.raises(damacy.SlotsHeld):
            pipe.pop(timeout=1)  # the label's only slot is held by batch 0
        first.release()
        with pipe.pop() as second:
            for name in ("image", "label"):
                assert list(second[name].info.samples) == [s[name] for s in drawn[3:6]]
            box = tuple(slice(sl.start, sl.stop) for sl in drawn[3]["image"].selection)
            np.testing.assert_array_equal(second["label"].copy()[0], data["label"][_half(box)])
        state = pipe.state_dict()
    assert state["image"]["source_state"]["seed"] == 5 and state["label"]["offset"] == 6


def test_an_iterable_that_fails_fails_batch_k_of_every_name_once(arrays):
    # the stream's error spends batch k of each name: raised once, and the next push's
    # batches come out in step (they came one name behind the other, for ever)
    uris, _ = arrays
    uris = {name: uris[name] for name in ("image", "label")}
    boxes = _boxes(4, seed=3)

    def broken():
        yield damacy.MultiSample.at(uris, boxes[0], scales={"label": 0.5})
        raise ValueError("the iterable broke")

    cfgs = {
        "image": damacy.Config(samples_per_batch=1, sample_shape=(8, 16, 16), dtype="f32"),
        "label": damacy.Config(samples_per_batch=1, sample_shape=(4, 8, 8), dtype="u8"),
    }
    with damacy.MultiPipeline(cfgs) as pipe:
        pipe.push(broken())
        pipe.push([damacy.MultiSample.at(uris, b, scales={"label": 0.5}) for b in boxes[1:]])
        got = []
        for _ in range(5):
            try:
                with pipe.pop(timeout=60) as multi:
                    got.append([multi[n].info.samples[0].selection[0].start for n in ("image", "label")])
            except ValueError as e:
                got.append(str(e))
            except damacy.PipelineDrained:
                break
    assert got == [[boxes[0][0].start, boxes[0][0].start // 2], "the iterable broke"] + [[b[0].start, b[0].start // 2] for b in boxes[1:]]


def test_a_state_taken_while_one_name_is_a_batch_ahead_resumes_every_name_in_step(arrays):
    # batch 1 of the image failed (counted as seen at once) while the label's pop timed out
    # (its only slot held by batch 0): the names' own offsets differ; the state is one place
    uris, data = arrays
    boxes = _boxes(6, seed=4)
    samples = [damacy.MultiSample.at(uris, b, scales={"label": 0.5}) for b in boxes]
    samples[4] = damacy.MultiSample(dict(samples[4].parts, image=damacy.Sample(uris["image"] + ".gone", boxes[4])))  # batch 1
    cfgs = _configs()
    cfgs["label"] = damacy.Config(samples_per_batch=3, sample_shape=(4, 8, 8), dtype="u8", prepared_batches=1, on_error="raise", drop_last=False)
    with damacy.MultiPipeline(cfgs) as pipe:
        pipe.push(samples)
        first = pipe.pop()
        with pytest.raises(damacy.SlotsHeld):
            pipe.pop(timeout=1)
        first.release()
        state = pipe.state_dict()
    assert {n: st["offset"] for n, st in state.items()} == dict.fromkeys(cfgs, 3)
    with damacy.MultiPipeline(_configs(on_error="fill")) as pipe:
        pipe.load_state_dict(state)
        pipe.push(samples)
        with pipe.pop() as multi:
            for name in ("image", "label"):
                assert list(multi[name].info.samples) == [s[name] for s in samples[3:6]]


def test_a_group_refuses_names_it_does_not_have_and_scales_land_within_rounding(arrays):
    uris, _ = arrays
    for kw in ({"levels": {"lable": 1}}, {"scales": {"lable": 0.5}}):
        with pytest.raises(damacy.InvalidArgument, match="'lable'"):
            damacy.MultiSample.at(uris, _boxes(1)[0], **kw)
    part = damacy.MultiSample.at({"a": uris["image"]}, np.s_[49:98, 0:49, 0:98], scales={"a": 1 / 49})["a"]
    assert [(s.start, s.stop) for s in part.selection] == [(1, 2), (0, 1), (0, 2)]  # 49 * (1/49) is not 1.0 in floats
    # a scale above 1 that is not whole: origins kept on multiples of its denominator
    sampler = damacy.RandomBoxes([{"image": uris["image"], "up": uris["image"]}], (4, 8, 8), seed=1, samples_per_epoch=50, scales={"up": 1.5}, shape_of=lambda u: (64, 64, 64))
    for s in sampler:
        assert all(sl.start % 2 == 0 for sl in s["image"].selection)
    with pytest.raises(damacy.InvalidArgument, match="ratio of whole numbers"):
        damacy.RandomBoxes([{"image": uris["image"], "up": uris["image"]}], (4, 8, 8), seed=1, samples_per_epoch=5, scales={"up": 2 ** 0.5})
