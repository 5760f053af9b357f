"""OME-NGFF images by level and by scale: 0.4 (Zarr v2) and 0.5 (Zarr v3) pyramids written by
zarr-python, listed by ``damacy.open_image`` and read with ``level=`` or ``scale=``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zarr

import damacy

AXES = [
    {"name": "c", "type": "channel"},
    {"name": "z", "type": "space", "unit": "micrometer"},
    {"name": "y", "type": "space", "unit": "micrometer"},
    {"name": "x", "type": "space", "unit": "micrometer"},
]


def pyramid(path, fmt, levels=3, global_scale=None, size=32, chunks=(1, 4, 8, 8)):
    """A (c, z, y, x) image: level k halves y and x; voxel (2, 0.5 * 2**k, 0.5 * 2**k)."""
    group = zarr.open_group(str(path), mode="w", zarr_format=fmt)
    multiscale = {
        "name": "cells",
        "axes": AXES,
        "datasets": [
            {
                "path": f"s{k}",
                "coordinateTransformations": [
                    {"type": "scale", "scale": [1, 2.0, 0.5 * 2**k, 0.5 * 2**k]},
                    {"type": "translation", "translation": [0, 0, 0.25 * (2**k - 1), 0.25 * (2**k - 1)]},
                ],
            }
            for k in range(levels)
        ],
    }
    if global_scale is not None:
        multiscale["coordinateTransformations"] = [{"type": "scale", "scale": global_scale}]
    if fmt == 2:
        group.attrs["multiscales"] = [{"version": "0.4", **multiscale}]
    else:
        group.attrs["ome"] = {"version": "0.5", "multiscales": [multiscale]}
    data = []
    for k in range(levels):
        n = size >> k
        values = (np.arange(2 * 8 * n * n).reshape(2, 8, n, n) * (k + 1) % 5000).astype("uint16")
        group.create_array(f"s{k}", shape=values.shape, chunks=chunks, dtype="uint16")[:] = values
        data.append(values)
    return str(path), data


@pytest.mark.parametrize("fmt, version", [(2, "0.4"), (3, "0.5")])
def test_open_image_lists_levels_axes_and_transforms(tmp_path, fmt, version):
    uri, data = pyramid(tmp_path / "img.zarr", fmt, global_scale=[1, 1, 3.0, 3.0])
    image = damacy.open_image(uri)
    assert image.version == version and image.name == "cells"
    assert [(a.name, a.type, a.unit) for a in image.axes] == [(a["name"], a["type"], a.get("unit")) for a in AXES]
    assert [lv.path for lv in image.levels] == ["s0", "s1", "s2"]
    assert [lv.shape for lv in image.levels] == [d.shape for d in data]
    assert all(lv.dtype == np.uint16 for lv in image.levels)
    assert image.levels[1].scale == (1.0, 2.0, 3.0, 3.0)  # the dataset's, times the multiscale's
    assert image.levels[1].translation == (0.0, 0.0, 0.75, 0.75)
    assert image.levels[2].uri == f"{uri}/s2"


@pytest.mark.parametrize("fmt", [2, 3])
def test_read_picks_a_level_by_index_or_by_scale(tmp_path, fmt):
    uri, data = pyramid(tmp_path / "img.zarr", fmt)
    box = np.s_[1, 2:6, 1:7, 0:5]  # a channel selected like any axis
    assert np.array_equal(damacy.read(uri, box), data[0][box])  # no level: level 0
    for k in range(3):
        assert np.array_equal(damacy.read(uri, box, level=k), data[k][box])
    image = damacy.open_image(uri)
    assert image.level_for([2.0, 1.0, 1.0]) == 1  # per spatial axis, in axis order (z, y, x)
    assert image.level_for({"y": 2.0, "x": 2.1}) == 2  # by axis name
    assert image.level_for({"x": 0.7}) == 0  # 0.5 is closer than 1.0 by ratio (1.4x vs 1.43x)
    assert image.level_for(1.0) == 0  # z is 2.0 at every level: a tie on the worst axis, the finer level wins
    assert np.array_equal(damacy.read(uri, box, scale=[2.0, 1.0, 1.0]), data[1][box])


def test_a_sample_of_a_level_is_named_by_its_path(tmp_path):
    uri, data = pyramid(tmp_path / "img.zarr", 3)
    level = damacy.open_image(uri).levels[1]
    cfg = damacy.Config(samples_per_batch=1, sample_shape=(4, 4, 4), dtype="u16")
    with damacy.Pipeline(cfg, embedded=True) as pipe:
        pipe.push([damacy.Sample(level.uri, np.s_[0, 0:4, 4:8, 8:12])])
        with pipe.pop() as batch:
            assert np.array_equal(batch.numpy()[0], data[1][0, 0:4, 4:8, 8:12])


def test_refusals_say_what_was_found(tmp_path):
    uri, _ = pyramid(tmp_path / "img.zarr", 3)
    with pytest.raises(damacy.InvalidArgument, match="has 3 levels \\(0 to 2\\), level 3 asked"):
        damacy.read(uri, level=3)
    with pytest.raises(damacy.InvalidArgument, match="level or scale, not both"):
        damacy.read(uri, level=0, scale=1.0)
    with pytest.raises(damacy.InvalidArgument, match="2 values for the 3 spatial axes"):
        damacy.read(uri, scale=[1.0, 1.0])
    with pytest.raises(damacy.InvalidArgument, match="axes \\['t'\\]"):
        damacy.read(uri, scale={"t": 1.0})
    with pytest.raises(damacy.InvalidArgument, match="positive finite numbers"):
        damacy.read(uri, scale=-1.0)
    zarr.open_group(str(tmp_path / "plain.zarr"), mode="w")
    with pytest.raises(damacy.InvalidArgument, match="not an NGFF image"):
        damacy.open_image(str(tmp_path / "plain.zarr"))
    # a level whose array is missing, and a level that is a group
    meta = json.loads((tmp_path / "img.zarr" / "zarr.json").read_text())
    meta["attributes"]["ome"]["multiscales"][0]["datasets"][1]["path"] = "gone"
    (tmp_path / "img.zarr" / "zarr.json").write_text(json.dumps(meta))
    fresh = damacy.ZarrMetadata(reader=damacy.FileMetadataReader(), cache=damacy.MetadataCache())  # a fresh cache: the metadata changed
    assert "level 1 ('gone') has no array" in str(damacy.open_image(uri, metadata=fresh).levels[1].error)
    with pytest.raises(damacy.NotFound, match="level 1 \\('gone'\\) has no array"):
        damacy.read(uri, level=1, metadata=fresh)
    zarr.open_group(str(tmp_path / "img.zarr" / "sub"), mode="w")
    meta["attributes"]["ome"]["multiscales"][0]["datasets"][0]["path"] = "sub"
    (tmp_path / "img.zarr" / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(damacy.InvalidArgument, match="level 0 \\('sub'\\) is a Zarr group; a level must be an array"):
        damacy.read(uri, metadata=damacy.ZarrMetadata(reader=damacy.FileMetadataReader(), cache=damacy.MetadataCache()))


def test_the_conformance_corpus_ngff_example_lists_its_levels(conformance_dir):
    image_dir = conformance_dir / "neuroglancer/testdata/datasource/zarr/ome_zarr/simple_0.5"
    if not image_dir.is_dir():
        pytest.skip("the NGFF example is not in this corpus")
    image = damacy.open_image(str(image_dir))
    assert image.version == "0.5" and image.levels[0].shape == (10, 10)
    assert np.array_equal(damacy.read(str(image_dir), level=0), np.arange(100, dtype="uint16").reshape(10, 10))


def test_samples_and_index_queries_pick_a_level(tmp_path, make):
    """Sample(image, box, level=k) in every mode (embedded, damacyd, the CUDA executor on the
    stand-in device); a level the image lacks fails its sample, naming it, and the others go on."""
    uri, data = pyramid(tmp_path / "img.zarr", 3)
    samples = [
        damacy.Sample(uri, np.s_[0, 0:4, 0:4, 0:4], level=1),
        damacy.Sample(uri, np.s_[1, 0:4, 4:8, 4:8], level=2),
        damacy.Sample(uri, np.s_[1, 0:4, 4:8, 4:8]),  # no level: level 0
        damacy.Sample(uri, np.s_[0, 0:4, 0:4, 0:4], level=7),
    ]
    cfg = damacy.Config(samples_per_batch=4, sample_shape=(4, 4, 4), dtype="u16", on_error="fill", pop_timeout_s=60)
    with make(cfg) as pipe:
        pipe.push(samples)
        with pipe.pop() as batch:
            got = batch.numpy()
            assert np.array_equal(got[0], data[1][0, 0:4, 0:4, 0:4])
            assert np.array_equal(got[1], data[2][1, 0:4, 4:8, 4:8])
            assert np.array_equal(got[2], data[0][1, 0:4, 4:8, 4:8])
            ((index, error),) = batch.info.errors
            assert index == 3 and "3 levels (0 to 2), level 7 asked" in str(error)


def test_a_level_is_part_of_a_samples_identity(tmp_path):
    import pickle

    a, b = damacy.Sample("img.zarr", np.s_[0:4], level=1), damacy.Sample("img.zarr", np.s_[0:4])
    assert a != b and hash(a) != hash(b) and a.level == 1 and b.level is None
    assert pickle.loads(pickle.dumps(a)) == a and "level=1" in repr(a)
    q = damacy.IndexQuery("img.zarr", ([1, 2],), level=2)
    assert pickle.loads(pickle.dumps(q)) == q
    with pytest.raises(damacy.InvalidArgument, match="level must be a non-negative integer"):
        damacy.Sample("img.zarr", np.s_[0:4], level=-1)


def test_a_level_that_cannot_be_read_fails_only_its_samples(tmp_path, make):
    import shutil

    path, data = pyramid(tmp_path / "img.zarr", 3)
    shutil.rmtree(tmp_path / "img.zarr" / "s1")  # level 1 is gone
    image = damacy.open_image(path, metadata=damacy.ZarrMetadata(reader=damacy.FileMetadataReader(), cache=damacy.MetadataCache()))
    assert [lv.error is None for lv in image.levels] == [True, False, True]
    assert isinstance(image.levels[1].error, damacy.NotFound) and "level 1 ('s1') has no array" in str(image.levels[1].error)
    np.testing.assert_array_equal(damacy.read(path, level=0), data[0])
    np.testing.assert_array_equal(damacy.read(path, level=2), data[2])
    with pytest.raises(damacy.NotFound, match="level 1 .'s1'. has no array"):
        damacy.read(path, level=1)
    assert image.level_for([2.0, 1.2, 1.2]) == 2  # the closest level that reads (1 would be closer)
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(1, 2, 4, 4), dtype="u16", on_error="fill")
    with make(cfg) as pipe:
        pipe.push([damacy.Sample(path, np.s_[0:1, 0:2, 0:4, 0:4], level=k) for k in (0, 1, 2, 0)])
        got = [(b.copy(), b.info.errors) for b in pipe]
    np.testing.assert_array_equal(got[0][0][0], data[0][0:1, 0:2, 0:4, 0:4])
    assert [(i, type(e)) for i, e in got[0][1]] == [(1, damacy.NotFound)]
    np.testing.assert_array_equal(got[1][0][0], data[2][0:1, 0:2, 0:4, 0:4])
    assert not got[1][1]


def test_a_scale_may_be_a_numpy_number(tmp_path):
    path, data = pyramid(tmp_path / "img.zarr", 3)
    np.testing.assert_array_equal(damacy.read(path, scale=np.float32(2.0)), data[2])
    np.testing.assert_array_equal(damacy.read(path, scale=[np.float64(2.0), 1, np.int64(1)]), data[1])


def _image(root, datasets, shapes):
    """An NGFF 0.5 image of zyx levels written as given (its datasets' entries verbatim)."""
    root.mkdir()
    axes = [{"name": n, "type": "space"} for n in "zyx"]
    (root / "zarr.json").write_text(json.dumps(
        {"zarr_format": 3, "node_type": "group", "attributes": {"ome": {"version": "0.5", "multiscales": [{"axes": axes, "datasets": datasets}]}}}
    ))
    for k, shape in enumerate(shapes):
        zarr.create_array(str(root / str(k)), shape=shape, dtype="u2", chunks=shape, fill_value=k + 1)
    return str(root)


def test_a_level_with_other_axes_or_a_bad_entry_fails_alone_and_transforms_compose_in_order(tmp_path):
    scale = lambda *v: [{"type": "scale", "scale": list(v)}]  # noqa: E731
    # level 1 is 2-d in a 3-d image: it fails alone, with its error; picking by scale skips it
    uri = _image(tmp_path / "a", [{"path": "0"}, {"path": "1", "coordinateTransformations": scale(2, 2)}], [(4, 4, 4), (2, 2)])
    image = damacy.open_image(uri)
    assert image.levels[0].error is None and isinstance(image.levels[1].error, damacy.MetadataError)
    assert "level 1 has 2 axes, the image 3" in str(image.levels[1].error) or "must list 2 numbers" in str(image.levels[1].error)
    assert (damacy.read(uri, scale=2) == 1).all() and damacy.read(uri, scale=2).shape == (4, 4, 4)
    with pytest.raises(damacy.MetadataError):
        damacy.read(uri, level=1)
    # a dataset entry that does not parse (a scale of 2 numbers) fails its level only
    uri = _image(tmp_path / "b", [{"path": "0"}, {"path": "1", "coordinateTransformations": scale(2, 2)}], [(4, 4, 4), (2, 2, 2)])
    assert damacy.read(uri, level=0).shape == (4, 4, 4)
    assert isinstance(damacy.open_image(uri).levels[1].error, damacy.MetadataError)
    # a translation before a scale is scaled by it
    both = [{"type": "translation", "translation": [1, 1, 1]}, {"type": "scale", "scale": [2, 2, 2]}]
    level = damacy.open_image(_image(tmp_path / "c", [{"path": "0", "coordinateTransformations": both}], [(4, 4, 4)])).levels[0]
    assert level.scale == (2.0, 2.0, 2.0) and level.translation == (2.0, 2.0, 2.0)
    with pytest.raises(damacy.InvalidArgument, match="positive finite"):
        image.level_for(float("inf"))
