"""Spatial queries, checked against the seed's spatial guide: the value types and their
messages, the NGFF adapter on OME-Zarr 0.5 images written by zarr-python (snapping, half-voxel
origins, the loader's rules and limits), level choice, the resolved transform, the bounds of
each filter and boundary, and what an aligned result pushes as."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import zarr

from damacy_protocol.enums import Status
from damacy_protocol.errors import BudgetExceeded, InvalidArgument, MetadataError, NotFound, UnsupportedOperation
from damacy_protocol.limits import NgffLimits
from damacy_protocol.samples import ResolvedSpatialQuery, Sample
from damacy_protocol.spatial import NgffAxis, NgffLevel, Sampler, SpatialQuery, level_map
from damacy_server.spatial import NgffImage
from damacy_server.store.file import FileMetadataReader, FileStore

SPACE2 = [{"name": "y", "type": "space", "unit": "micrometer"}, {"name": "x", "type": "space", "unit": "micrometer"}]
CZYX = [
    {"name": "c", "type": "channel"},
    {"name": "z", "type": "space"},
    {"name": "y", "type": "space", "unit": "micrometer"},
    {"name": "x", "type": "space", "unit": "micrometer"},
]
NEAREST = Sampler(filter="nearest")


def reader() -> FileMetadataReader:
    return FileMetadataReader(concurrency=4)


def write_image(path: Path, axes=SPACE2, scales=None, translations=None, shapes=None, *, levels=3, names=None,
                dtypes=None, paths=None, multiscale_extra=None, version="0.5"):
    """An OME-Zarr 0.5 pyramid: by default 2-D, 64x64 halved per level, scale 0.5 * 2**k and
    the half-voxel translation that keeps each level's origin at zero."""
    rank = len(axes)
    spatial = [a["type"] == "space" for a in axes]
    scales = scales or [[0.5 * 2**k if s else 1.0 for s in spatial] for k in range(levels)]
    translations = translations if translations is not None else [
        [0.25 * (2**k - 1) if s else 0.0 for s in spatial] for k in range(len(scales))
    ]
    shapes = shapes or [tuple(64 >> k if s else 2 for s in spatial) for k in range(len(scales))]
    paths = paths or [f"s{k}" for k in range(len(scales))]
    datasets = []
    for k, scale in enumerate(scales):
        steps = [{"type": "scale", "scale": scale}]
        if translations and translations[k] is not None:
            steps.append({"type": "translation", "translation": translations[k]})
        datasets.append({"path": paths[k], "coordinateTransformations": steps})
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    group.attrs["ome"] = {"version": version, "multiscales": [{"axes": axes, "datasets": datasets, **(multiscale_extra or {})}]}
    for k, shape in enumerate(shapes):
        zarr.create_array(
            str(path / paths[k]),
            shape=shape,
            dtype=(dtypes or ["uint16"] * len(shapes))[k],
            chunks=tuple(max(1, min(n, 16)) for n in shape),
            dimension_names=(names or {}).get(k, [a["name"] for a in axes][:rank]),
        )
    return path


def load(path, **kw) -> NgffImage:
    return NgffImage(path, reader=reader(), multiscale_index=0, **kw)


def query(linear, offset, sampler=NEAREST, level="auto") -> SpatialQuery:
    return SpatialQuery(
        output_to_reference=[tuple(row) + (b,) for row, b in zip(linear, offset)], sampler=sampler, level=level
    )


def eye(n, scale=1.0):
    return [[scale if i == j else 0.0 for j in range(n)] for i in range(n)]


@pytest.fixture
def pyramid(tmp_path) -> NgffImage:
    return load(write_image(tmp_path / "img.zarr"))


# -- the value types ------------------------------------------------------------------------


def test_sampler_defaults_and_checks():
    s = Sampler()
    assert (s.filter, s.boundary, s.constant_value) == ("linear", "error", 0.0)
    assert type(s.constant_value) is float and not hasattr(s, "__dict__")
    assert Sampler("nearest", "constant", 7).constant_value == 7.0
    with pytest.raises(ValueError, match=r"^filter must be 'nearest' or 'linear'$"):
        Sampler(filter="cubic")
    with pytest.raises(ValueError, match=r"^boundary must be 'error', 'constant', or 'clamp'$"):
        Sampler(boundary="wrap")
    for bad in ("1", b"1", True):
        with pytest.raises(TypeError, match="^transform and sampler values must be numbers$"):
            Sampler(boundary="constant", constant_value=bad)
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="^transform and sampler values must be finite$"):
            Sampler(boundary="constant", constant_value=bad)
    for boundary in ("error", "clamp"):
        with pytest.raises(ValueError, match=r"^constant_value requires boundary='constant'$"):
            Sampler(boundary=boundary, constant_value=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.filter = "nearest"


def test_spatial_query_checks_and_stored_form():
    q = SpatialQuery(output_to_reference=[[1, 0, 2], np.array([0, 1, 3])], sampler=Sampler())
    assert q.output_to_reference == ((1.0, 0.0, 2.0), (0.0, 1.0, 3.0)) and q.level == "auto"
    assert SpatialQuery(output_to_reference=[[1, 0, 0], [0, 1, 0]], sampler=Sampler(), level=np.int64(3)).level == 3
    with pytest.raises(TypeError):
        SpatialQuery([[1, 0, 0], [0, 1, 0]], Sampler())  # keyword-only
    with pytest.raises(TypeError, match="^sampler must be a Sampler$"):
        SpatialQuery(output_to_reference=[[1, 0, 0], [0, 1, 0]], sampler="linear")
    with pytest.raises(TypeError, match="^transform and sampler values must be numbers$"):
        SpatialQuery(output_to_reference=[[1, 0, "0"], [0, 1, 0]], sampler=Sampler())
    with pytest.raises(TypeError, match="^transform and sampler values must be numbers$"):
        SpatialQuery(output_to_reference=[[True, 0, 0], [0, 1, 0]], sampler=Sampler())
    with pytest.raises(ValueError, match="^transform and sampler values must be finite$"):
        SpatialQuery(output_to_reference=[[1, 0, math.inf], [0, 1, 0]], sampler=Sampler())
    shape_message = "^output_to_reference must have rank rows and rank \\+ 1 columns$"
    for bad in ([[1, 0]], [[1, 0, 0], [0, 1]], [[1, 0], [0, 1]], [[0.0] * 33 for _ in range(32)]):
        with pytest.raises(ValueError, match=shape_message):
            SpatialQuery(output_to_reference=bad, sampler=Sampler())
    good = [[1, 0, 0], [0, 1, 0]]
    with pytest.raises(TypeError, match="^level must be an integer$"):
        SpatialQuery(output_to_reference=good, sampler=Sampler(), level=True)
    with pytest.raises(ValueError, match="^level must be 'auto' or a nonnegative integer$"):
        SpatialQuery(output_to_reference=good, sampler=Sampler(), level="coarsest")
    for bad in (-1, 2**31):
        with pytest.raises(ValueError, match=r"^level must be between 0 and 2\*\*31 - 1$"):
            SpatialQuery(output_to_reference=good, sampler=Sampler(), level=bad)
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.level = 0
    assert pickle.loads(pickle.dumps(q)) == q and hash(q) == hash(pickle.loads(pickle.dumps(q)))


def test_resolved_spatial_query_cannot_be_made_directly():
    with pytest.raises(TypeError, match=r"^use NgffImage.resolve\(\) to create a ResolvedSpatialQuery$"):
        ResolvedSpatialQuery()


def test_axis_and_level_are_plain_frozen_values():
    axis = NgffAxis("x", "space", "micrometer")
    level = NgffLevel("/a/s0", (4, 4), (1.0, 1.0), (0.0, 0.0))
    assert (axis.name, axis.kind, axis.unit) == ("x", "space", "micrometer")
    assert level == NgffLevel(uri="/a/s0", shape=(4, 4), scale_to_reference=(1.0, 1.0), origin_reference_index=(0.0, 0.0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        level.uri = "/b"
    assert not hasattr(axis, "__dict__") and not hasattr(level, "__dict__")


# -- the NGFF adapter -----------------------------------------------------------------------


def test_level_map_snaps_rounding_errors_and_keeps_declared_alignment():
    assert 0.3 / 0.1 == 2.9999999999999996  # what a writer's floats give
    assert level_map([0.3], [0.0], [0.1], [0.0]) == ((3.0,), (-1.0,))  # both snapped exactly
    assert level_map([1.0], [0.5], [0.5], [0.0]) == ((2.0,), (0.5,))
    assert level_map([2.0], [0.5], [1.0], [0.0]) == ((2.0,), (0.0,))  # 2x, half a voxel: origin 0
    assert level_map([2.0], [0.0], [1.0], [0.0]) == ((2.0,), (-0.5,))  # scale only: kept as declared
    assert level_map([8.0], [100.5], [4.0], [100.5]) == ((2.0,), (-0.5,))  # a shared translation cancels
    assert level_map([0.7], [0.3], [0.7], [0.3]) == ((1.0,), (0.0,))  # level 0 is the identity
    assert level_map([3.001], [0.0], [1.0], [0.0])[0] == (3.001,)  # not a rounding error: kept
    ratio, origin = level_map([0.1 * 3], [0.1], [0.1], [0.0])
    assert ratio == (3.0,) and origin == (0.0,) and math.copysign(1, origin[0]) == 1  # no negative zero


def test_image_axes_levels_and_dtype(tmp_path):
    path = write_image(tmp_path / "img.zarr", CZYX)
    image = NgffImage(os.fspath(path), reader=reader(), multiscale_index=0)
    assert image.axes == (
        NgffAxis("c", "channel", None),
        NgffAxis("z", "space", None),
        NgffAxis("y", "space", "micrometer"),
        NgffAxis("x", "space", "micrometer"),
    )
    assert image.data_type == "uint16"
    assert [lv.uri for lv in image.levels] == [str(path / f"s{k}") for k in range(3)]
    assert [lv.shape for lv in image.levels] == [(2, 64, 64, 64), (2, 32, 32, 32), (2, 16, 16, 16)]
    assert [lv.scale_to_reference for lv in image.levels] == [(1.0, 1.0, 1.0, 1.0), (1.0, 2.0, 2.0, 2.0), (1.0, 4.0, 4.0, 4.0)]
    assert all(lv.origin_reference_index == (0.0,) * 4 for lv in image.levels)
    assert load(path).axes == image.axes  # a Path works as the uri
    with pytest.raises(dataclasses.FrozenInstanceError):
        image.axes = ()
    assert not hasattr(image, "__dict__")


def test_tenth_and_three_tenths_snap_to_exactly_three(tmp_path):
    path = write_image(tmp_path / "img.zarr", scales=[[0.1, 0.1], [0.3, 0.3]], translations=[[0, 0], [0.1, 0.1]],
                       shapes=[(30, 30), (10, 10)])
    image = load(path)
    assert image.levels[1].scale_to_reference == (3.0, 3.0) and image.levels[1].origin_reference_index == (0.0, 0.0)
    # an aligned crop of level 1 from its own values is exact
    r = image.resolve(query(eye(2, 3.0), [0 + 3.0 * 2, 0 + 3.0 * 4]), shape=(5, 5))
    assert r.level == 1 and not r.requires_resampling and r.source_bounds_index == ((2, 7), (4, 9))
    # one from physical coordinates is a rounding error off and needs resampling
    off = image.resolve(query(eye(2, 0.3 / 0.1), [6.0, 12.0], level=1), shape=(5, 5))
    assert off.requires_resampling


def test_scale_only_levels_keep_their_half_voxel_origin(tmp_path):
    path = write_image(tmp_path / "img.zarr", translations=[])
    image = load(path)
    assert [lv.origin_reference_index for lv in image.levels] == [(0.0, 0.0), (-0.5, -0.5), (-1.5, -1.5)]
    r = image.resolve(query(eye(2, 2.0), [0.0, 0.0]), shape=(8, 8))
    assert r.level == 1 and r.output_to_source == ((1.0, 0.0, 0.25), (0.0, 1.0, 0.25)) and r.requires_resampling
    # the crop built from the level's values: origin + R * beg
    aligned = image.resolve(query(eye(2, 2.0), [-0.5 + 2 * 3, -0.5 + 2 * 1]), shape=(8, 8))
    assert not aligned.requires_resampling and aligned.source_bounds_index == ((3, 11), (1, 9))


# -- the loader's checks --------------------------------------------------------------------


def test_image_argument_checks(tmp_path):
    path = write_image(tmp_path / "img.zarr")
    for bad in (None, FileStore(), "reader"):
        with pytest.raises(TypeError, match="^reader must be a FileMetadataReader$"):
            NgffImage(path, reader=bad, multiscale_index=0)
    with pytest.raises(TypeError, match="^limits must be NgffLimits$"):
        NgffImage(path, reader=reader(), multiscale_index=0, limits={"max_levels": 2})
    for bad in ("", "/tmp/a\0b"):
        with pytest.raises(ValueError, match="^uri must be a nonempty path without NUL characters$"):
            NgffImage(bad, reader=reader(), multiscale_index=0)
    with pytest.raises(TypeError, match="^multiscale_index must be an integer$"):
        NgffImage(path, reader=reader(), multiscale_index=False)
    for bad in (-1, 2**31):
        with pytest.raises(ValueError, match=r"^multiscale_index must be between 0 and 2\*\*31 - 1$"):
            NgffImage(path, reader=reader(), multiscale_index=bad)
    with pytest.raises(TypeError):
        NgffImage(path, reader(), 0)  # keyword-only
    with pytest.raises(InvalidArgument, match="multiscale_index 1 asked, the image has 1 multiscales"):
        NgffImage(path, reader=reader(), multiscale_index=1)
    with pytest.raises(NotFound):
        load(tmp_path / "none.zarr")
    with pytest.raises(InvalidArgument, match="not an NGFF image"):
        load(path / "s0")  # an array


def test_multiscale_index_selects_the_entry(tmp_path):
    path = write_image(tmp_path / "img.zarr")
    group = zarr.open_group(str(path), mode="r+")
    ome = group.attrs["ome"]
    second = {**ome["multiscales"][0], "datasets": ome["multiscales"][0]["datasets"][1:]}
    group.attrs["ome"] = {**ome, "multiscales": [ome["multiscales"][0], second]}
    image = NgffImage(path, reader=reader(), multiscale_index=1)
    assert [lv.uri for lv in image.levels] == [str(path / "s1"), str(path / "s2")]
    assert image.levels[1].scale_to_reference == (2.0, 2.0)  # relative to its own level 0


def rewrite(file: Path, old: str, new: str) -> None:
    """``file``'s JSON written compactly, ``old`` (which it must hold) replaced by ``new``."""
    text = json.dumps(json.loads(file.read_text()))
    assert old in text
    file.write_text(text.replace(old, new))


def edit_ome(path: Path, change) -> None:
    doc = json.loads((path / "zarr.json").read_text())
    change(doc["attributes"]["ome"], doc["attributes"]["ome"]["multiscales"][0])
    (path / "zarr.json").write_text(json.dumps(doc))


def _set(key, value):
    return lambda ome, ms: ms.__setitem__(key, value)


def _dataset(k, **fields):
    return lambda ome, ms: ms["datasets"][k].update(fields)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda ome, ms: ome.__setitem__("version", "0.4"), UnsupportedOperation, "version '0.4' is not supported"),
        (lambda ome, ms: ome.pop("multiscales"), InvalidArgument, "not an OME-Zarr 0.5 image"),
        (_set("axes", [{"name": "y", "type": "space"}, {"name": "x", "type": "angle"}]), UnsupportedOperation, "custom type 'angle'"),
        (_set("axes", [{"name": "y", "type": "space"}, {"name": "x"}]), UnsupportedOperation, "unspecified type"),
        (_set("axes", ["y", "x"]), MetadataError, "axes must be a list of objects"),
        (_set("axes", [{"name": "y", "type": "space"}, {"name": "y", "type": "space"}]), MetadataError, "distinct"),
        (_set("axes", [{"name": "y", "type": "space"}, {"name": "x", "type": "space", "unit": 3}]), MetadataError, "unit"),
        (_set("datasets", []), MetadataError, "datasets must be a non-empty list"),
        (_dataset(1, path="/abs/s1"), MetadataError, "not a relative path"),
        (_dataset(1, path="../s1"), MetadataError, "not a relative path"),
        (_dataset(1, path="./s1"), MetadataError, "not a relative path"),
        (_dataset(1, coordinateTransformations=[{"type": "translation", "translation": [0, 0]}, {"type": "scale", "scale": [1, 1]}]),
         MetadataError, "one scale and an optional translation"),
        (_dataset(1, coordinateTransformations=[{"type": "scale", "scale": [1, 1]}, {"type": "scale", "scale": [1, 1]}]),
         MetadataError, "one scale and an optional translation"),
        (_dataset(1, coordinateTransformations=[{"type": "identity"}]), MetadataError, "one scale"),
        (_dataset(1, coordinateTransformations=[{"type": "scale", "path": "scales"}]), UnsupportedOperation, "external arrays"),
        (_dataset(1, coordinateTransformations=[{"type": "scale", "scale": [1, 0]}]), MetadataError, "must be positive"),
        (_dataset(1, coordinateTransformations=[{"type": "scale", "scale": [1, 1, 1]}]), MetadataError, "must list 2 finite numbers"),
        (_dataset(1, coordinateTransformations=[{"type": "scale", "scale": [1, True]}]), MetadataError, "must list 2 finite numbers"),
        (_dataset(1, coordinateTransformations=[{"type": "scale", "scale": [1, 1]}, {"type": "translation", "translation": [0]}]),
         MetadataError, "translation must list 2"),
        (_dataset(2, coordinateTransformations=[{"type": "scale", "scale": [0.75, 2.0]}]), MetadataError, "decreases"),
    ],
)
def test_metadata_rules(tmp_path, change, error, message):
    path = write_image(tmp_path / "img.zarr")
    edit_ome(path, change)
    with pytest.raises(error, match=message):
        load(path)


def test_nonfinite_transforms_are_refused(tmp_path):
    path = write_image(tmp_path / "img.zarr")
    rewrite(path / "zarr.json", '"scale": [1.0, 1.0]', '"scale": [1.0, NaN]')
    with pytest.raises(MetadataError, match="finite"):
        load(path)


def test_time_and_channel_must_stay_unchanged_across_levels(tmp_path):
    with pytest.raises(MetadataError, match="channel axis 'c' must keep level 0's transform"):
        load(write_image(tmp_path / "a.zarr", CZYX, scales=[[1, 1, 1, 1], [2, 2, 2, 2]]))
    with pytest.raises(MetadataError, match="channel axis 'c' must keep level 0's transform"):
        load(write_image(tmp_path / "b.zarr", CZYX, scales=[[1, 1, 1, 1]] * 2, translations=[[0] * 4, [1, 0, 0, 0]]))
    with pytest.raises(MetadataError, match="time and channel extents"):
        load(write_image(tmp_path / "c.zarr", CZYX, levels=2, shapes=[(2, 8, 8, 8), (1, 4, 4, 4)]))
    with pytest.raises(MetadataError, match="does not fit the finer levels"):
        load(write_image(tmp_path / "d.zarr", shapes=[(64, 64), (32, 32), (16, 33)]))
    tzyx = [{"name": "t", "type": "time"}] + CZYX[1:]
    assert [a.kind for a in load(write_image(tmp_path / "e.zarr", tzyx)).axes] == ["time", "space", "space", "space"]


@pytest.mark.parametrize("axes", [[{"name": "x", "type": "space"}], [{"name": n, "type": "space"} for n in "wzyx"],
                                  [{"name": "c", "type": "channel"}, {"name": "d", "type": "channel"}] + SPACE2])
def test_two_or_three_spatial_axes_and_at_most_one_time_and_channel(tmp_path, axes):
    with pytest.raises(UnsupportedOperation, match="are not supported"):
        load(write_image(tmp_path / "img.zarr", axes, levels=1))


def test_levels_agree_on_names_and_dtype(tmp_path):
    with pytest.raises(MetadataError, match="dimension_names"):
        load(write_image(tmp_path / "a.zarr", names={1: ["x", "y"]}))
    with pytest.raises(MetadataError, match="dimension_names"):
        load(write_image(tmp_path / "b.zarr", names={2: None}))
    with pytest.raises(MetadataError, match="differs from level 0's 'uint16'"):
        load(write_image(tmp_path / "c.zarr", dtypes=["uint16", "uint16", "float32"]))
    assert load(write_image(tmp_path / "d.zarr", dtypes=["float32"] * 3)).data_type == "float32"
    assert load(write_image(tmp_path / "e.zarr", paths=["full/res", "half", "quarter"])).levels[0].uri == str(
        tmp_path / "e.zarr" / "full/res"
    )


def test_a_field_given_twice_is_refused_where_it_is_read(tmp_path):
    path = write_image(tmp_path / "img.zarr")
    rewrite(path / "zarr.json", '"scale": [1.0, 1.0]', '"scale": [1.0, 1.0], "scale": [2.0, 2.0]')
    with pytest.raises(MetadataError, match="'scale' more than once"):
        load(path)
    path = write_image(tmp_path / "other.zarr")
    rewrite(path / "zarr.json", '"ome": {', '"note": {"a": 1, "a": 2}, "ome": {')
    assert len(load(path).levels) == 3  # unconsumed fields are left alone
    rewrite(path / "s1" / "zarr.json", '"shape": [32, 32]', '"shape": [32, 32], "shape": [8, 8]')
    with pytest.raises(MetadataError, match="'shape' more than once"):
        load(path)


def test_a_zarr_json_that_is_no_json_object_is_a_metadata_error(tmp_path):
    path = write_image(tmp_path / "img.zarr")
    for text, message in (("{not json", "not valid JSON"), ("[1, 2]", "must hold a JSON object")):
        (path / "zarr.json").write_text(text)
        with pytest.raises(MetadataError, match=message):
            load(path)


# -- the limits -----------------------------------------------------------------------------


class CountingReader(FileMetadataReader):
    """Records each size asked and each file read."""

    def __init__(self) -> None:
        super().__init__(concurrency=1)
        self.calls: list[tuple[str, str]] = []

    def size(self, key):
        self.calls.append(("size", key))
        return super().size(key)

    def read(self, key):
        self.calls.append(("read", key))
        return super().read(key)


def test_limits_bound_levels_and_the_sum_of_json_sizes(tmp_path):
    path = write_image(tmp_path / "img.zarr")
    files = [path / "zarr.json"] + [path / f"s{k}" / "zarr.json" for k in range(3)]
    total = sum(f.stat().st_size for f in files)
    assert len(load(path, limits=NgffLimits(max_levels=3, max_metadata_bytes=total)).levels) == 3
    with pytest.raises(BudgetExceeded, match="max_levels"):
        load(path, limits=NgffLimits(max_levels=2))
    with pytest.raises(BudgetExceeded, match="max_metadata_bytes") as caught:
        load(path, limits=NgffLimits(max_metadata_bytes=total - 1))
    assert caught.value.status == Status.BUDGET and caught.value.uri == str(path / "s2")
    counting = CountingReader()
    with pytest.raises(BudgetExceeded):
        NgffImage(path, reader=counting, multiscale_index=0, limits=NgffLimits(max_metadata_bytes=files[0].stat().st_size))
    # every file's size is asked before it is read, and one over the budget is never read
    assert counting.calls == [("size", str(files[0])), ("read", str(files[0])), ("size", str(files[1]))]


def test_loading_reads_only_the_json_files(tmp_path):
    path = write_image(tmp_path / "img.zarr")
    counting = CountingReader()
    NgffImage(path, reader=counting, multiscale_index=0)
    assert {key for _, key in counting.calls} == {str(path / "zarr.json")} | {str(path / f"s{k}" / "zarr.json") for k in range(3)}


# -- resolution -----------------------------------------------------------------------------


def test_resolve_argument_checks(pyramid):
    q = query(eye(2), [0, 0])
    with pytest.raises(TypeError, match="^query must be a SpatialQuery$"):
        pyramid.resolve("q", shape=(4, 4))
    for bad in ((0, 4), (4, 2**52)):
        with pytest.raises(ValueError, match=r"^shape extent must be in \[1, 4503599627370495\]$"):
            pyramid.resolve(q, shape=bad)
    with pytest.raises(ValueError, match="^output rank must match the NGFF image$"):
        pyramid.resolve(q, shape=(4, 4, 4))
    with pytest.raises(TypeError):
        pyramid.resolve(q, (4, 4))  # shape is keyword-only
    with pytest.raises(InvalidArgument, match="rank 3"):
        pyramid.resolve(query(eye(3), [0, 0, 0]), shape=(4, 4))


def test_identity_crop_is_aligned_and_pushes_as_a_sample(pyramid):
    r = pyramid.resolve(query(eye(2), [8, 16]), shape=(16, 32))
    assert (r.uri, r.level, r.shape, r.source_shape) == (pyramid.levels[0].uri, 0, (16, 32), (64, 64))
    assert r.output_to_source == ((1.0, 0.0, 8.0), (0.0, 1.0, 16.0))
    assert r.source_bounds_index == r.read_bounds_index == ((8, 24), (16, 48))
    assert not r.requires_resampling and r.sampler == NEAREST
    assert r._as_sample() == Sample(pyramid.levels[0].uri, [(8, 24), (16, 48)])
    linear = pyramid.resolve(query(eye(2), [8, 16], sampler=Sampler()), shape=(16, 32))
    assert not linear.requires_resampling and linear.source_bounds_index == ((8, 24), (16, 48))


def test_aligned_crop_of_a_coarser_level(pyramid):
    level = pyramid.levels[2]
    ratio, origin, beg = level.scale_to_reference, level.origin_reference_index, (3, 5)
    offset = [o + r * b for o, r, b in zip(origin, ratio, beg)]
    for chosen in ("auto", 2):
        r = pyramid.resolve(query(eye(2, ratio[0]), offset, level=chosen), shape=(8, 8))
        assert r.level == 2 and not r.requires_resampling
        assert r._as_sample() == Sample(level.uri, [(3, 11), (5, 13)])


def test_resampling_results_are_inspectable_but_do_not_push(pyramid):
    r = pyramid.resolve(query(eye(2), [0.5, 0]), shape=(4, 4))
    assert r.requires_resampling and r.source_bounds_index == ((1, 5), (0, 4))
    with pytest.raises(UnsupportedOperation, match="^submit spatial query: resampling required$") as caught:
        r._as_sample()
    assert caught.value.status == Status.UNSUPPORTED and caught.value.what == "submit spatial query: resampling required"


@pytest.mark.parametrize(
    "scale, level",
    [(1.0, 0), (0.5, 0), (1.9, 0), (2.0, 1), (2.0 * (1 - 1e-15), 1), (3.0, 1), (4.0, 2), (16.0, 2)],
)
def test_auto_takes_the_coarsest_level_no_coarser_than_the_output(pyramid, scale, level):
    r = pyramid.resolve(query(eye(2, scale), [0, 0]), shape=(4, 4))
    assert r.level == level


def test_auto_level_sees_anisotropy_rotation_and_shear(pyramid):
    assert pyramid.resolve(query([[2, 0], [0, 8]], [0, 0]), shape=(4, 4)).level == 1  # the finer direction decides
    c = s = 4 * math.sqrt(0.5)  # a 45 degree rotation scaled by 4: both singular values 4
    rotated = pyramid.resolve(query([[c, -s], [s, c]], [32, 32]), shape=(4, 4))
    assert rotated.level == 2 and rotated.requires_resampling
    sheared = pyramid.resolve(query([[2, 2], [0, 2]], [0, 0]), shape=(4, 4))  # smallest singular value 1.24
    assert sheared.level == 0 and sheared.requires_resampling
    assert pyramid.resolve(query(eye(2), [0, 0], level=2), shape=(4, 4)).output_to_source == (
        (0.25, 0.0, 0.0), (0.0, 0.25, 0.0)
    )
    with pytest.raises(InvalidArgument, match="level 3 asked, the image has 3 levels"):
        pyramid.resolve(query(eye(2), [0, 0], level=3), shape=(4, 4))


def test_reflection_and_rotation_need_resampling(pyramid):
    flipped = pyramid.resolve(query([[-1, 0], [0, 1]], [16, 0]), shape=(16, 16))
    assert flipped.requires_resampling and flipped.source_bounds_index == ((0, 16), (0, 16))
    turned = pyramid.resolve(query([[0, 1], [1, 0]], [0, 0]), shape=(8, 16))
    assert turned.requires_resampling and turned.source_bounds_index == ((0, 16), (0, 8))


def test_transform_validity(pyramid):
    with pytest.raises(InvalidArgument, match="singular"):
        pyramid.resolve(query([[1, 1], [1, 1]], [0, 0]), shape=(4, 4))
    with pytest.raises(InvalidArgument, match="singular"):
        pyramid.resolve(query([[0, 0], [0, 1]], [0, 0]), shape=(4, 4))
    with pytest.raises(InvalidArgument, match="singular"):
        pyramid.resolve(query([[1, 1], [1, 1 + 1e-15]], [0, 0]), shape=(4, 4))
    assert pyramid.resolve(query([[1, 1], [1, 1 + 1e-9]], [0, 0]), shape=(4, 4)).requires_resampling
    tiny = pyramid.resolve(query(eye(2, 1e-300), [1, 1]), shape=(4, 4))  # rows are normalised: not singular
    assert tiny.level == 0 and tiny.source_bounds_index == ((1, 2), (1, 2))
    with pytest.raises(InvalidArgument, match=r"beyond 2\*\*52 - 1"):
        pyramid.resolve(query(eye(2), [2.0**52, 0]), shape=(4, 4))
    with pytest.raises(InvalidArgument, match=r"beyond 2\*\*52 - 1"):
        pyramid.resolve(query(eye(2, 2.0**30), [0, 0]), shape=(4, 2**23))  # 2**30 * 2**23 = 2**53


def test_time_and_channel_axes_pass_through(tmp_path):
    image = load(write_image(tmp_path / "img.zarr", CZYX))
    r = image.resolve(query(eye(4, 1.0), [1, 0, 0, 0]), shape=(1, 8, 8, 8))
    assert not r.requires_resampling and r.source_bounds_index == ((1, 2), (0, 8), (0, 8), (0, 8))
    down = image.resolve(query([[1, 0, 0, 0], [0, 4, 0, 0], [0, 0, 4, 0], [0, 0, 0, 4]], [0, 0, 0, 0]), shape=(2, 4, 4, 4))
    assert down.level == 2 and not down.requires_resampling  # the channel axis does not hold the level back
    for linear, offset in (
        ([[2, 0, 0, 0]] + eye(4)[1:], [0, 0, 0, 0]),  # scaled
        ([[1, 0, 0, 0], [0.5, 1, 0, 0]] + eye(4)[2:], [0, 0, 0, 0]),  # mixed into a spatial row
        ([[1, 0, 0, 0.5]] + eye(4)[1:], [0, 0, 0, 0]),  # a spatial column mixed into it
        (eye(4), [0.5, 0, 0, 0]),  # a fractional offset
    ):
        with pytest.raises(InvalidArgument, match="channel axis 'c' must map as the identity"):
            image.resolve(query(linear, offset), shape=(1, 4, 4, 4))
    for offset in (-1, 2):
        with pytest.raises(InvalidArgument, match="outside its extent 2"):
            image.resolve(query(eye(4), [offset, 0, 0, 0], sampler=Sampler(boundary="constant")), shape=(1, 4, 4, 4))


# -- bounds ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "filter, scale, offset, bounds",
    [
        ("nearest", 1, 0.5, (1, 9)),  # centres at j + 1: a tie takes the larger index
        ("nearest", 1, 0.25, (0, 8)),
        ("nearest", 1, -0.25, (0, 8)),
        ("nearest", 2, 0, (1, 16)),  # centres at 2j + 1
        ("linear", 1, 0, (0, 8)),  # on the centres: the zero-weight neighbour is left out
        ("linear", 1, 0.25, (0, 9)),
        ("linear", 1, -0.25, (-1, 8)),
        ("linear", 2, 0, (0, 16)),  # 2j + 0.5 between centres 2j and 2j + 1
        ("linear", 0.5, 0, (-1, 5)),  # upsampling: s - 0.5 = 0.5j - 0.25, from -0.25 to 3.25
        ("nearest", -1, 8, (0, 8)),  # reflected
    ],
)
def test_source_bounds_of_each_filter(pyramid, filter, scale, offset, bounds):
    sampler = Sampler(filter=filter, boundary="constant")
    r = pyramid.resolve(query([[1, 0], [0, scale]], [0, offset], sampler=sampler, level=0), shape=(4, 8))
    assert r.source_bounds_index == ((0, 4), bounds)


def test_boundaries(pyramid):
    shifted = [[1, 0], [0, 1]], [0, -2.25]  # x from -2.25: linear reads -3 .. 6
    with pytest.raises(InvalidArgument, match="boundary='error'"):
        pyramid.resolve(query(*shifted, sampler=Sampler()), shape=(4, 8))
    constant = pyramid.resolve(query(*shifted, sampler=Sampler(boundary="constant", constant_value=-1)), shape=(4, 8))
    assert constant.source_bounds_index == ((0, 4), (-3, 6)) and constant.read_bounds_index == ((0, 4), (0, 6))
    assert constant.sampler.constant_value == -1.0 and constant.requires_resampling
    clamp = pyramid.resolve(query(*shifted, sampler=Sampler(boundary="clamp")), shape=(4, 8))
    assert clamp.read_bounds_index == ((0, 4), (0, 6)) and clamp.requires_resampling
    # wholly outside: nothing to read with a constant, the edge voxels with clamp
    outside = [[1, 0], [0, 1]], [0, 100]
    empty = pyramid.resolve(query(*outside, sampler=Sampler(boundary="constant")), shape=(4, 8))
    assert empty.source_bounds_index == ((0, 4), (100, 108)) and empty.read_bounds_index == ((0, 4), (64, 64))
    edge = pyramid.resolve(query(*outside, sampler=Sampler(filter="nearest", boundary="clamp")), shape=(4, 8))
    assert edge.read_bounds_index == ((0, 4), (63, 64))
    before = pyramid.resolve(query([[1, 0], [0, 1]], [-20, -100], sampler=Sampler(boundary="clamp")), shape=(4, 8))
    assert before.read_bounds_index == ((0, 1), (0, 1))
    # an integral shift reaching outside is no plain copy: boundary sampling needs resampling
    padded = pyramid.resolve(query(eye(2), [60, 0], sampler=Sampler(filter="nearest", boundary="constant")), shape=(8, 8))
    assert padded.output_to_source == ((1.0, 0.0, 60.0), (0.0, 1.0, 0.0)) and padded.requires_resampling
    assert padded.read_bounds_index == ((60, 64), (0, 8))
    # the rule applies to the chosen level's extent, not the reference's
    with pytest.raises(InvalidArgument, match="extent 16"):
        pyramid.resolve(query(eye(2, 4.0), [0, 40]), shape=(8, 8))


# -- results as values ----------------------------------------------------------------------


def test_results_are_immutable_picklable_and_outlive_the_image(tmp_path):
    image = load(write_image(tmp_path / "img.zarr"))
    results = [
        image.resolve(query(eye(2), [4, 4]), shape=(8, 8)),
        image.resolve(query([[0, 2], [2, 0]], [1.5, 0], sampler=Sampler(boundary="constant", constant_value=3)), shape=(8, 8)),
    ]
    del image
    for r in results:
        back = pickle.loads(pickle.dumps(r))
        assert back == r and hash(back) == hash(r) and type(back) is ResolvedSpatialQuery
        assert [getattr(back, f) for f in ResolvedSpatialQuery._fields] == [getattr(r, f) for f in ResolvedSpatialQuery._fields]
        assert isinstance(back.sampler, Sampler)
        with pytest.raises(AttributeError):
            r.level = 1
    assert results[0]._as_sample() == pickle.loads(pickle.dumps(results[0]))._as_sample()
    assert results[1].requires_resampling and results[1].level == 1


# -- the README's example -----------------------------------------------------------------


def test_the_readmes_spatial_block_runs_and_its_crop_reads_level_one(tmp_path):
    """The README's spatial block, on a pyramid whose level 1 halves y and x (its origin at
    zero): "auto" picks level 1, the query is an aligned crop of it, and pushed to a pipeline
    it reads exactly that crop."""
    from test_readme import block

    import damacy

    zyx = [{"name": a, "type": "space", "unit": "micrometer"} for a in "zyx"]
    path = write_image(
        tmp_path / "image.zarr", axes=zyx, scales=[[1.0, 1.0, 1.0], [1.0, 2.0, 2.0]],
        translations=[[0.0, 0.0, 0.0], [0.0, 0.5, 0.5]], shapes=[(8, 64, 64), (8, 32, 32)], levels=2,
    )
    rng = np.random.default_rng(5)
    level1 = rng.integers(0, 1000, size=(8, 32, 32), dtype=np.uint16)
    zarr.open_array(str(path / "s0"), mode="r+")[...] = rng.integers(0, 1000, size=(8, 64, 64), dtype=np.uint16)
    zarr.open_array(str(path / "s1"), mode="r+")[...] = level1
    scope: dict = {"damacy": damacy}
    exec(compile(block("spatial").replace("data/image.zarr", str(path)), "README spatial", "exec"), scope)
    resolved = scope["resolved"]
    assert resolved.uri == str(path / "s1") and resolved.source_bounds_index == ((0, 8), (0, 32), (0, 32))
    planner = damacy.ChunkPlanner(metadata=damacy.ZarrMetadata(reader=scope["reader"], cache=damacy.MetadataCache()))
    executor = damacy.CpuExecutor(reader=damacy.FileReader(workers=2), limits=damacy.CpuLimits(max_memory_bytes=64 << 20, decode_workers=2))
    output = damacy.BatchSpec(samples=1, shape=(8, 32, 32), dtype="u16")
    with damacy.Pipeline(planner=planner, executor=executor, output=output, queues=damacy.QueueLimits(2)) as p:
        p.push([resolved])
        with p.pop() as batch:
            assert np.array_equal(np.from_dlpack(batch)[0], level1)
