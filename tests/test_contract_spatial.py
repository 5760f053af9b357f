"""Contract §15: NGFF images and spatial queries. OME-Zarr 0.5 images are written here with
zarr-python; aligned crops pushed to CPU pipelines are compared with zarr-python's reads of
the chosen level.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import pickle
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import zarr
from contract_helpers import assert_same, batch_values, pipeline, ramp, write

import damacy

BOX = (4, 6)
EPS = 2.0**-52
REFUSED = (damacy.DamacyError, ValueError) if hasattr(damacy, "DamacyError") else (ValueError,)


def raises_exactly(exc, message):
    return pytest.raises(exc, match="^" + re.escape(message) + "$")


def ngff(root: Path, *, shapes=((16, 24), (8, 12)), scales=((1.0, 1.0), (2.0, 2.0)), translations=None, axes=None, names=None, extra=()):
    """Write an OME-Zarr 0.5 image (one array per level, ramps of uint16); returns the arrays."""
    axes = axes or [{"name": n, "type": "space", "unit": "micrometer"} for n in "yx"][-len(shapes[0]) :]
    datasets = []
    for i, scale in enumerate(scales):
        transforms = [{"type": "scale", "scale": list(scale)}]
        if translations is not None and translations[i] is not None:
            transforms.append({"type": "translation", "translation": list(translations[i])})
        datasets.append({"path": str(i), "coordinateTransformations": transforms})
    multiscales = [{"name": "image", "axes": axes, "datasets": datasets}, *extra]
    zarr.create_group(str(root), zarr_format=3, attributes={"ome": {"version": "0.5", "multiscales": multiscales}})
    dims = [a["name"] for a in axes]
    arrays = []
    for i, shape in enumerate(shapes):
        chunks = tuple(min(4, s) for s in shape)
        arrays.append(write(root / str(i), ramp(shape, "uint16", 5000 * i), chunks=chunks, dimension_names=(names or {}).get(i, dims)))
    return arrays


def load(root, **kw):
    kw.setdefault("reader", damacy.FileMetadataReader(concurrency=4))
    kw.setdefault("multiscale_index", 0)
    return damacy.NgffImage(str(root), **kw)


@pytest.fixture
def image(tmp_path):
    """Level 1 is 2x with a half-reference-voxel translation: origin 0."""
    arrays = ngff(tmp_path / "img.zarr", translations=[None, (0.5, 0.5)])
    return load(tmp_path / "img.zarr"), arrays


def query(linear, offset, *, sampler=None, level="auto"):
    rows = [tuple(row) + (b,) for row, b in zip(linear, offset)]
    return damacy.SpatialQuery(output_to_reference=rows, sampler=sampler or damacy.Sampler(filter="nearest"), level=level)


def eye(n=2, k=1.0):
    return [[k if i == j else 0.0 for j in range(n)] for i in range(n)]


# ---- loading ----------------------------------------------------------------------------


def test_ngff_image_loads_axes_levels_and_dtype(image):
    img, arrays = image
    assert img.axes == (damacy.NgffAxis("y", "space", "micrometer"), damacy.NgffAxis("x", "space", "micrometer"))
    assert len(img.levels) == 2 and all(isinstance(level, damacy.NgffLevel) for level in img.levels)
    assert [level.shape for level in img.levels] == [(16, 24), (8, 12)]
    assert [level.uri.rstrip("/").rsplit("/", 1)[-1] for level in img.levels] == ["0", "1"]
    assert img.data_type == "uint16"
    with pytest.raises(AttributeError):  # frozen
        img.data_type = "int8"


def test_level_zero_is_exactly_the_identity(image):
    level = image[0].levels[0]
    assert level.scale_to_reference == (1.0, 1.0)
    assert level.origin_reference_index == (0.0, 0.0)


def test_half_voxel_translated_2x_level_has_origin_zero(image):
    level = image[0].levels[1]
    assert level.scale_to_reference == (2.0, 2.0)
    assert level.origin_reference_index == (0.0, 0.0)


def test_scale_only_2x_level_has_origin_minus_half(tmp_path):
    ngff(tmp_path / "s.zarr")
    level = load(tmp_path / "s.zarr").levels[1]
    assert level.scale_to_reference == (2.0, 2.0)
    assert level.origin_reference_index == (-0.5, -0.5)


def test_corner_origin_map_formula(tmp_path):
    """R = S_l/S_0, origin = (T_l - T_0)/S_0 + (1 - R)/2, componentwise."""
    ngff(tmp_path / "t.zarr", scales=((0.5, 0.5), (1.0, 1.5)), translations=[(10.0, 20.0), (11.0, 20.25)], shapes=((16, 24), (8, 8)))
    level = load(tmp_path / "t.zarr").levels[1]
    assert level.scale_to_reference == (2.0, 3.0)
    assert level.origin_reference_index == (1.5, -0.5)


def test_ratios_snap_to_multiples_of_1_256(tmp_path):
    ngff(tmp_path / "p.zarr", scales=((0.1, 0.1), (0.3, 0.3)), shapes=((18, 24), (6, 8)))
    assert 0.3 / 0.1 != 3.0
    level = load(tmp_path / "p.zarr").levels[1]
    assert level.scale_to_reference == (3.0, 3.0)
    assert level.origin_reference_index == (-1.0, -1.0)


def test_ngff_image_accepts_a_pathlike(tmp_path):
    ngff(tmp_path / "img.zarr")
    img = damacy.NgffImage(tmp_path / "img.zarr", reader=damacy.FileMetadataReader(), multiscale_index=0)
    assert len(img.levels) == 2


def test_multiscale_index_selects_the_entry(tmp_path):
    second = {"name": "coarse", "axes": [{"name": n, "type": "space", "unit": "micrometer"} for n in "yx"], "datasets": [{"path": "1", "coordinateTransformations": [{"type": "scale", "scale": [2.0, 2.0]}]}]}
    ngff(tmp_path / "m.zarr", extra=[second])
    assert [level.shape for level in load(tmp_path / "m.zarr", multiscale_index=1).levels] == [(8, 12)]
    with pytest.raises(REFUSED):
        load(tmp_path / "m.zarr", multiscale_index=2)


def test_channel_axis_kind_and_unit(tmp_path):
    axes = [{"name": "c", "type": "channel"}, {"name": "y", "type": "space", "unit": "micrometer"}, {"name": "x", "type": "space", "unit": "micrometer"}]
    ngff(tmp_path / "c.zarr", shapes=((3, 16, 24), (3, 8, 12)), scales=((1.0, 1.0, 1.0), (1.0, 2.0, 2.0)), axes=axes)
    img = load(tmp_path / "c.zarr")
    assert img.axes[0] == damacy.NgffAxis("c", "channel", None)
    assert img.levels[1].scale_to_reference == (1.0, 2.0, 2.0)


def test_dimension_names_must_match_at_every_level(tmp_path):
    ngff(tmp_path / "d.zarr", names={1: ["x", "y"]})
    with pytest.raises(REFUSED):
        load(tmp_path / "d.zarr")


UNSUPPORTED_IMAGES = {
    "decreasing-scale": {"scales": ((1.0, 1.0), (0.5, 0.5))},
    "increasing-shape": {"shapes": ((8, 12), (16, 24))},
    "custom-axis-type": {"axes": [{"name": "y", "type": "custom"}, {"name": "x", "type": "space"}]},
}


@pytest.mark.parametrize("kind", sorted(UNSUPPORTED_IMAGES))
def test_unsupported_ngff_layouts_refused(tmp_path, kind):
    ngff(tmp_path / "u.zarr", **UNSUPPORTED_IMAGES[kind])
    with pytest.raises(REFUSED):
        load(tmp_path / "u.zarr")


def test_levels_must_share_a_dtype(tmp_path):
    ngff(tmp_path / "m.zarr")
    zarr.create_array(str(tmp_path / "m.zarr" / "1"), shape=(8, 12), dtype="int8", chunks=(4, 4), dimension_names=["y", "x"], overwrite=True)
    with pytest.raises(REFUSED):
        load(tmp_path / "m.zarr")


def test_ngff_reader_type_message(tmp_path):
    with raises_exactly(TypeError, "reader must be a FileMetadataReader"):
        damacy.NgffImage(str(tmp_path), reader=damacy.FileReader(workers=1), multiscale_index=0)


def test_ngff_limits_type_error(tmp_path):
    with pytest.raises(TypeError):
        load(tmp_path, limits={"max_levels": 4})


@pytest.mark.parametrize("uri", ["", "a\0b"])
def test_ngff_uri_message(uri):
    with raises_exactly(ValueError, "uri must be a nonempty path without NUL characters"):
        damacy.NgffImage(uri, reader=damacy.FileMetadataReader(), multiscale_index=0)


def test_ngff_multiscale_index_checks(tmp_path):
    ngff(tmp_path / "img.zarr")
    with pytest.raises(TypeError):
        load(tmp_path / "img.zarr", multiscale_index=True)
    for bad in (-1, 1 << 31):
        with pytest.raises(ValueError):
            load(tmp_path / "img.zarr", multiscale_index=bad)


def test_ngff_image_is_keyword_only(tmp_path):
    reader = damacy.FileMetadataReader()
    with pytest.raises(TypeError):
        damacy.NgffImage(str(tmp_path), reader, 0)


@pytest.mark.parametrize("limits", [{"max_levels": 1}, {"max_metadata_bytes": 64}])
def test_ngff_load_limits_exhausted_budget_exceeded(tmp_path, limits):
    ngff(tmp_path / "img.zarr")
    with pytest.raises(damacy.BudgetExceeded) as info:
        load(tmp_path / "img.zarr", limits=damacy.NgffLimits(**limits))
    assert info.value.status == damacy.Status.BUDGET
    assert len(load(tmp_path / "img.zarr", limits=damacy.NgffLimits(max_levels=2)).levels) == 2


# ---- Sampler and SpatialQuery -----------------------------------------------------------


def test_sampler_defaults():
    s = damacy.Sampler()
    assert (s.filter, s.boundary, s.constant_value) == ("linear", "error", 0.0)
    assert type(s.constant_value) is float
    with pytest.raises(AttributeError):  # frozen
        s.filter = "nearest"


def test_sampler_choices():
    for f in ("nearest", "linear"):
        for b in ("error", "constant", "clamp"):
            assert damacy.Sampler(filter=f, boundary=b).boundary == b
    with pytest.raises(ValueError):
        damacy.Sampler(filter="cubic")
    with pytest.raises(ValueError):
        damacy.Sampler(boundary="wrap")


@pytest.mark.parametrize("bad", ["1", b"1", True])
def test_sampler_constant_value_type_error(bad):
    with pytest.raises(TypeError):
        damacy.Sampler(boundary="constant", constant_value=bad)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_sampler_constant_value_finite(bad):
    with pytest.raises(ValueError):
        damacy.Sampler(boundary="constant", constant_value=bad)


def test_sampler_constant_value_requires_constant_boundary():
    with raises_exactly(ValueError, "constant_value requires boundary='constant'"):
        damacy.Sampler(boundary="clamp", constant_value=1.0)
    s = damacy.Sampler(boundary="constant", constant_value=7)
    assert s.constant_value == 7.0 and type(s.constant_value) is float


def test_spatial_query_is_keyword_only_with_auto_level():
    q = damacy.SpatialQuery(output_to_reference=[[1, 0, 2], [0, 1, 3]], sampler=damacy.Sampler())
    assert q.level == "auto"
    assert q.output_to_reference == ((1.0, 0.0, 2.0), (0.0, 1.0, 3.0))
    with pytest.raises(TypeError):
        damacy.SpatialQuery([[1, 0, 2], [0, 1, 3]], damacy.Sampler())
    with pytest.raises(AttributeError):  # frozen
        q.level = 0


def test_spatial_query_sampler_type_error():
    with pytest.raises(TypeError):
        damacy.SpatialQuery(output_to_reference=[[1, 0, 0], [0, 1, 0]], sampler="nearest")


@pytest.mark.parametrize("bad, exc", [("1", TypeError), (b"1", TypeError), (True, TypeError), (math.nan, ValueError), (math.inf, ValueError)])
def test_spatial_query_entry_checks(bad, exc):
    with pytest.raises(exc):
        damacy.SpatialQuery(output_to_reference=[[1, 0, bad], [0, 1, 0]], sampler=damacy.Sampler())


@pytest.mark.parametrize("matrix", [[[1, 0]], [[1, 0, 0], [0, 1]], [[1, 0], [0, 1]], [[0] * 33] * 32])
def test_spatial_query_shape_message(matrix):
    with raises_exactly(ValueError, "output_to_reference must have rank rows and rank + 1 columns"):
        damacy.SpatialQuery(output_to_reference=matrix, sampler=damacy.Sampler())


def test_spatial_query_level_checks():
    m = [[1, 0, 0], [0, 1, 0]]
    assert damacy.SpatialQuery(output_to_reference=m, sampler=damacy.Sampler(), level=3).level == 3
    with raises_exactly(ValueError, "level must be 'auto' or a nonnegative integer"):
        damacy.SpatialQuery(output_to_reference=m, sampler=damacy.Sampler(), level="best")
    with pytest.raises(TypeError):
        damacy.SpatialQuery(output_to_reference=m, sampler=damacy.Sampler(), level=True)
    for bad in (-1, 1 << 31):
        with pytest.raises(ValueError):
            damacy.SpatialQuery(output_to_reference=m, sampler=damacy.Sampler(), level=bad)


# ---- resolve ----------------------------------------------------------------------------


def test_resolve_argument_checks(image):
    img = image[0]
    with raises_exactly(TypeError, "query must be a SpatialQuery"):
        img.resolve([[1, 0, 0], [0, 1, 0]], shape=BOX)
    with pytest.raises(TypeError):
        img.resolve(query(eye(), (0, 0)), BOX)
    with raises_exactly(ValueError, "output rank must match the NGFF image"):
        img.resolve(query(eye(), (0, 0)), shape=(1, 4, 6))
    for bad in (0, 1 << 52):
        with pytest.raises(ValueError):
            img.resolve(query(eye(), (0, 0)), shape=(4, bad))


def test_resolve_aligned_crop_of_level_zero(image):
    img, _ = image
    r = img.resolve(query(eye(), (2, 4)), shape=BOX)
    assert (r.level, r.shape, r.source_shape) == (0, BOX, (16, 24))
    assert r.uri == img.levels[0].uri
    assert r.output_to_source == ((1.0, 0.0, 2.0), (0.0, 1.0, 4.0))
    assert r.source_bounds_index == ((2, 6), (4, 10)) == r.read_bounds_index
    assert r.requires_resampling is False
    assert r.sampler == damacy.Sampler(filter="nearest")


@pytest.mark.parametrize(
    "linear, offset, level",
    [
        (eye(), (2, 4), 0),
        (eye(k=1.5), (0, 0), 0),
        (eye(k=2.0), (0, 0), 1),
        (eye(k=4.0), (0, 0), 1),
        (eye(k=2.0 * (1 - 1e-15)), (0, 0), 1),  # within 64 * DBL_EPSILON
        ([[2.0, 0.0], [0.0, 1.0]], (0, 0), 0),  # anisotropic: smallest singular value 0.5
        ([[2.0, 1.0], [0.0, 2.0]], (0, 0), 0),  # shear: column and row norms >= 1, smallest singular value < 1
        ([[2 * math.cos(0.3), -2 * math.sin(0.3)], [2 * math.sin(0.3), 2 * math.cos(0.3)]], (8, 4), 1),  # rotation
    ],
)
def test_auto_level_by_smallest_singular_value(image, linear, offset, level):
    """Every query here stays inside the image (the boundary is "error")."""
    assert image[0].resolve(query(linear, offset), shape=BOX).level == level


def test_auto_level_ignores_position_and_boundary(image):
    far = query(eye(k=2.0), (-100, 500), sampler=damacy.Sampler(filter="nearest", boundary="constant"))
    assert image[0].resolve(far, shape=BOX).level == 1


def test_explicit_level_overrides_auto(image):
    img = image[0]
    r = img.resolve(query(eye(k=2.0), (4, 6), level=0), shape=BOX)
    assert r.level == 0 and r.requires_resampling is True
    assert r.output_to_source == ((2.0, 0.0, 4.0), (0.0, 2.0, 6.0))
    with pytest.raises(REFUSED):
        img.resolve(query(eye(), (0, 0), level=2), shape=BOX)


def test_output_to_source_is_inverse_scale_times_query(tmp_path):
    ngff(tmp_path / "s.zarr")  # scale-only: origin -0.5 at level 1
    r = load(tmp_path / "s.zarr").resolve(query([[1.0, 0.0], [0.0, 3.0]], (4.0, 6.0), level=1), shape=BOX)
    assert r.output_to_source == ((0.5, 0.0, 2.25), (0.0, 1.5, 3.25))


@pytest.mark.parametrize("scale_only", [False, True])
def test_aligned_crop_of_level_one(tmp_path, scale_only):
    ngff(tmp_path / "i.zarr", translations=None if scale_only else [None, (0.5, 0.5)])
    img = load(tmp_path / "i.zarr")
    level, beg = img.levels[1], (1, 2)
    offset = [o + r * b for o, r, b in zip(level.origin_reference_index, level.scale_to_reference, beg)]
    r = img.resolve(query([[2.0, 0.0], [0.0, 2.0]], offset), shape=BOX)
    assert (r.level, r.requires_resampling, r.source_shape) == (1, False, (8, 12))
    assert r.output_to_source == ((1.0, 0.0, 1.0), (0.0, 1.0, 2.0))
    assert r.source_bounds_index == ((1, 5), (2, 8)) == r.read_bounds_index


@pytest.mark.parametrize(
    "filt, offset, bounds0, resampling",
    [
        ("nearest", 2.0, (2, 6), False),
        ("linear", 2.0, (2, 6), False),
        ("nearest", 2.25, (2, 6), True),
        ("linear", 2.25, (2, 7), True),
        ("nearest", 2.5, (3, 7), True),  # a tie on a voxel boundary takes the larger index
        ("linear", 2.5, (2, 7), True),
    ],
)
def test_filter_source_bounds(image, filt, offset, bounds0, resampling):
    r = image[0].resolve(query(eye(), (offset, 4), sampler=damacy.Sampler(filter=filt), level=0), shape=BOX)
    assert r.source_bounds_index == (bounds0, (4, 10))
    assert r.read_bounds_index == r.source_bounds_index
    assert r.requires_resampling is resampling


@pytest.mark.parametrize(
    "boundary, offset, source0, read0",
    [("constant", -2, (-2, 2), (0, 2)), ("clamp", -2, (-2, 2), (0, 2)), ("clamp", 14, (14, 18), (14, 16)), ("constant", 14, (14, 18), (14, 16))],
)
def test_boundary_read_bounds(image, boundary, offset, source0, read0):
    r = image[0].resolve(query(eye(), (offset, 0), sampler=damacy.Sampler(filter="nearest", boundary=boundary), level=0), shape=BOX)
    assert r.source_bounds_index == (source0, (0, 6))
    assert r.read_bounds_index == (read0, (0, 6))
    assert r.requires_resampling is True


def test_constant_read_bounds_may_be_empty(image):
    r = image[0].resolve(query(eye(), (-10, 0), sampler=damacy.Sampler(filter="nearest", boundary="constant"), level=0), shape=BOX)
    assert r.source_bounds_index == ((-10, -6), (0, 6))
    lo, hi = r.read_bounds_index[0]
    assert lo >= hi
    assert r.requires_resampling is True


def test_inside_crop_with_constant_boundary_is_aligned(image):
    r = image[0].resolve(query(eye(), (2, 4), sampler=damacy.Sampler(filter="nearest", boundary="constant", constant_value=3)), shape=BOX)
    assert r.requires_resampling is False
    assert r.source_bounds_index == ((2, 6), (4, 10)) == r.read_bounds_index


def test_rotation_and_reflection_require_resampling_with_conservative_bounds(image):
    c, s = math.cos(math.pi / 4), math.sin(math.pi / 4)
    for linear, offset in [([[c, -s], [s, c]], (8.0, 12.0)), ([[-1.0, 0.0], [0.0, 1.0]], (6.0, 0.0))]:
        r = image[0].resolve(query(linear, offset, level=0), shape=BOX)
        assert r.requires_resampling is True
        js = np.stack(np.meshgrid(np.arange(4) + 0.5, np.arange(6) + 0.5, indexing="ij"), -1).reshape(-1, 2)
        idx = np.floor(js @ np.array(linear).T + np.array(offset)).astype(int)
        for axis, (lo, hi) in enumerate(r.source_bounds_index):
            assert lo <= idx[:, axis].min() and idx[:, axis].max() < hi


def test_nonspatial_axes_must_be_identity_with_integral_offsets(tmp_path):
    axes = [{"name": "c", "type": "channel"}, {"name": "y", "type": "space"}, {"name": "x", "type": "space"}]
    ngff(tmp_path / "c.zarr", shapes=((3, 16, 24), (3, 8, 12)), scales=((1.0, 1.0, 1.0), (1.0, 2.0, 2.0)), axes=axes)
    img = load(tmp_path / "c.zarr")
    ok = img.resolve(query(eye(3), (1, 2, 4)), shape=(2, *BOX))
    assert ok.requires_resampling is False and ok.source_bounds_index == ((1, 3), (2, 6), (4, 10))
    assert img.resolve(query([[1, 0, 0], [0, 2, 0], [0, 0, 2]], (0, 0, 0)), shape=(2, *BOX)).level == 1
    for linear, offset in [([[1, 0.5, 0], [0, 1, 0], [0, 0, 1]], (0, 0, 0)), (eye(3), (0.5, 0, 0)), (eye(3, 2.0), (0, 0, 0))]:
        with pytest.raises(REFUSED):
            img.resolve(query(linear, offset), shape=(2, *BOX))


def test_coordinates_beyond_2_52_refused(image):
    far = query(eye(), (2.0**53, 0), sampler=damacy.Sampler(filter="nearest", boundary="constant"), level=0)
    with pytest.raises(REFUSED):
        image[0].resolve(far, shape=BOX)


@pytest.mark.parametrize("linear", [[[1.0, 1.0], [1.0, 1.0]], [[1.0, 1.0], [1.0, 1.0 + 1e-15]]])
def test_singular_transform_refused(image, linear):
    with pytest.raises(REFUSED):
        image[0].resolve(query(linear, (0, 0), level=0), shape=BOX)


# ---- ResolvedSpatialQuery ---------------------------------------------------------------


RESOLVED_FIELDS = [
    "uri",
    "level",
    "shape",
    "source_shape",
    "output_to_source",
    "sampler",
    "source_bounds_index",
    "read_bounds_index",
    "requires_resampling",
]


def test_resolved_query_cannot_be_constructed():
    with raises_exactly(TypeError, "use NgffImage.resolve() to create a ResolvedSpatialQuery"):
        damacy.ResolvedSpatialQuery()


def test_resolved_query_is_frozen_and_picklable(image):
    r = image[0].resolve(query(eye(), (2, 4)), shape=BOX)
    with pytest.raises(AttributeError):  # frozen
        r.level = 1
    back = pickle.loads(pickle.dumps(r))
    for name in RESOLVED_FIELDS:
        assert getattr(back, name) == getattr(r, name), name


def test_resolved_query_fields():
    assert [f.name for f in dataclasses.fields(damacy.ResolvedSpatialQuery)] == RESOLVED_FIELDS


def test_resolve_from_several_threads(image):
    img = image[0]
    qs = [query(eye(k=1.0 + (i % 2)), (i % 4, i % 4)) for i in range(16)]  # all inside the image
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda q: img.resolve(q, shape=BOX), qs))
    for q, r in zip(qs, results):
        assert r.output_to_source == img.resolve(q, shape=BOX).output_to_source


# ---- pushing resolved queries -----------------------------------------------------------


def test_aligned_crops_push_and_match_the_chosen_level(tmp_path):
    arrays = ngff(tmp_path / "img.zarr", translations=[None, (0.5, 0.5)])
    reader = damacy.FileMetadataReader(concurrency=4)
    with pipeline(BOX, dtype="u16", metadata_reader=reader) as p:
        img = damacy.NgffImage(str(tmp_path / "img.zarr"), reader=reader, multiscale_index=0)  # the reader also serves the pipeline
        crops = [img.resolve(query(eye(), (2, 4)), shape=BOX), img.resolve(query(eye(k=2.0), (2, 4)), shape=BOX)]
        assert [c.level for c in crops] == [0, 1]
        p.push(crops)
        with p.pop() as batch:
            assert_same(batch_values(batch, "u16"), np.stack([arrays[0][2:6, 4:10], arrays[1][1:5, 2:8]]))


def test_aligned_crop_shares_a_batch_with_a_sample_and_outlives_its_image(tmp_path):
    arrays = ngff(tmp_path / "img.zarr", translations=[None, (0.5, 0.5)])
    img = load(tmp_path / "img.zarr")
    r = pickle.loads(pickle.dumps(img.resolve(query(eye(k=2.0), (0, 0)), shape=BOX)))
    uri = img.levels[0].uri
    del img
    gc.collect()
    with pipeline(BOX, dtype="u16") as p:
        p.push([r, damacy.Sample(uri, [(3, 7), (5, 11)])])
        with p.pop() as batch:
            assert_same(batch_values(batch, "u16"), np.stack([arrays[1][0:4, 0:6], arrays[0][3:7, 5:11]]))


@pytest.mark.parametrize("kind", ["fractional-offset", "rotation", "residual-scale", "boundary"])
def test_resampling_query_push_unsupported_and_pipeline_keeps_running(image, kind):
    img, arrays = image
    c, s = math.cos(0.2), math.sin(0.2)
    q = {
        "fractional-offset": query(eye(), (2.5, 4)),
        "rotation": query([[c, -s], [s, c]], (6, 8)),
        "residual-scale": query(eye(k=1.5), (2, 4)),
        "boundary": query(eye(), (-2, 0), sampler=damacy.Sampler(filter="nearest", boundary="clamp")),
    }[kind]
    r = img.resolve(q, shape=BOX)
    assert r.requires_resampling is True
    with pipeline(BOX, dtype="u16") as p:
        with pytest.raises(damacy.UnsupportedOperation) as info:
            p.push([r])
        assert str(info.value) == "submit spatial query: resampling required"
        assert info.value.status == damacy.Status.UNSUPPORTED
        aligned = img.resolve(query(eye(), (2, 4)), shape=BOX)
        p.push([aligned, aligned])
        with p.pop() as batch:
            assert_same(batch_values(batch, "u16"), np.stack([arrays[0][2:6, 4:10]] * 2))


def test_resolved_shape_checked_against_batchspec_at_push(image):
    r = image[0].resolve(query(eye(), (2, 4)), shape=BOX)
    with pipeline((4, 5), dtype="u16") as p:
        with pytest.raises(damacy.InvalidArgument):
            p.push([r])
