"""Transforms at read time: flips and axis permutations of a sample, made by the copies that
assemble the batch, equal numpy's ``np.transpose(np.flip(box, flip), transpose)`` on every
executor (native, numpy, the GPU kernels' host twin, through damacyd)."""

from __future__ import annotations

import itertools
import pickle
import re

import numpy as np
import pytest
from zarr.codecs import ZstdCodec

import damacy

from conftest import padded_selection, random_data, write_array
from pipeline_helpers import composed, cpu_executor_for

FLIPS = [(), (0,), (2,), (0, 1, 2), (1, 2)]
ORDERS = list(itertools.permutations(range(3)))


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    folder = tmp_path_factory.mktemp("t")
    data = random_data((20, 30, 24), "uint16", seed=12)
    write_array(folder / "v.zarr", data, chunks=(5, 8, 6), shards=(10, 16, 12), compressors=[ZstdCodec()])
    return str(folder / "v.zarr"), data


def _expected(data, box, flip, order):
    return np.transpose(np.flip(padded_selection(data, box), flip), order if order is not None else range(data.ndim))


def _cases():
    rng = np.random.default_rng(0)
    out = []
    for flip, order in itertools.product(FLIPS, ORDERS):
        z, y, x = int(rng.integers(-3, 12)), int(rng.integers(0, 16)), int(rng.integers(0, 14))  # some reach outside
        out.append(((slice(z, z + 8), slice(y, y + 10), slice(x, x + 12)), flip, order))
    return out


def _run(pipe, samples):
    pipe.push(samples)
    return np.concatenate([b.copy() for b in pipe])


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_flips_and_permutations_equal_numpy_in_every_mode(volume, make, dtype):
    uri, data = volume
    for order in ORDERS:
        cases = [c for c in _cases() if c[2] == order]
        shape = tuple((8, 10, 12)[a] for a in order)
        cfg = damacy.Config(samples_per_batch=3, sample_shape=shape, dtype=dtype, out_of_bounds="pad", drop_last=False)
        samples = [damacy.Sample(uri, box, flip=flip, transpose=order) for box, flip, order in cases]
        with make(cfg) as pipe:
            got = _run(pipe, samples)
        for k, (box, flip, order) in enumerate(cases):
            want = _expected(data, box, flip, order)
            want = want.astype("f4") if dtype == "f32" else want.astype("f4").astype(got.dtype)
            np.testing.assert_array_equal(got[k], want, err_msg=f"flip={flip} transpose={order} box={box}")


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
def test_both_cpu_paths_make_the_same_transforms(volume, native):
    uri, data = volume
    cases = [c for c in _cases() if c[2] == (2, 0, 1)]
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(12, 8, 10), dtype="f32", out_of_bounds="pad", drop_last=False)
    executor = cpu_executor_for(cfg, max_memory_bytes=64 << 20, decode_workers=2, native=native)
    with composed(cfg, executor=executor) as pipe:
        got = _run(pipe, [damacy.Sample(uri, box, flip=flip, transpose=order) for box, flip, order in cases])
        native_units = pipe.stats_dict()["stages"].get("native", {}).get("count", 0)
    executor.close()
    assert (native_units > 0) == native  # the native path made them (strided and reversed rows), or numpy did
    for k, (box, flip, order) in enumerate(cases):
        np.testing.assert_array_equal(got[k], _expected(data, box, flip, order).astype("f4"))


def test_index_queries_take_transforms_too(volume):
    uri, data = volume
    sel = ([3, 1, 1, 19], range(2, 29, 3), [0, 23, 5])
    q = damacy.IndexQuery(uri, sel, flip=(0, 2), transpose=(2, 0, 1))
    want = data[np.ix_([3, 1, 1, 19], range(2, 29, 3), [0, 23, 5])]
    for dtype in ("native", "f32"):  # numpy's path, and the native one (index lists both sides)
        cfg = damacy.Config(samples_per_batch=1, sample_shape=(3, 4, 9), dtype=dtype)
        with damacy.Pipeline(cfg) as pipe:
            got = _run(pipe, [q])
        np.testing.assert_array_equal(got[0], np.transpose(np.flip(want, (0, 2)), (2, 0, 1)).astype(got.dtype))


def test_transforms_are_checked_and_travel(volume):
    uri, _ = volume
    s = damacy.Sample(uri, np.s_[0:2, 0:3, 0:4], flip=[2, 0, 2], transpose=(1, 2, 0))
    assert s.flip == (0, 2) and s.transpose == (1, 2, 0) and "flip=(0, 2), transpose=(1, 2, 0)" in repr(s)
    assert pickle.loads(pickle.dumps(s)) == s and s != damacy.Sample(uri, np.s_[0:2, 0:3, 0:4])
    assert damacy.Sample(uri, np.s_[0:2], transpose=(0,)).transpose is None  # the identity is no transform
    with pytest.raises(damacy.InvalidArgument, match="permutation"):
        damacy.Sample(uri, np.s_[0:2], transpose=(0, 0))
    with pytest.raises(damacy.InvalidArgument, match="non-negative"):
        damacy.Sample(uri, np.s_[0:2], flip=(-1,))
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(2, 3, 4), dtype="native", on_error="fill")
    with damacy.Pipeline(cfg) as pipe:
        # a shape known at push (the box transposed) is checked there
        with pytest.raises(damacy.InvalidArgument, match=re.escape("its shape (3, 2, 4) is not the batch's sample shape (2, 3, 4)")):
            pipe.push([damacy.Sample(uri, np.s_[0:2, 0:3, 0:4], transpose=(1, 0, 2))])
        # one that depends on the array, at pop
        pipe.push([damacy.Sample(uri, np.s_[0:2, 0:3, 0:4], flip=(3,)), damacy.Sample(uri, np.s_[0:2, ...], transpose=(1, 0, 2))])
        errors = dict(pipe.pop().info.errors)
    assert "flip names axis 3, the selection has 3 axes" in str(errors[0])
    assert "(30, 2, 24) transposed, the batch holds samples of shape (2, 3, 4)" in str(errors[1])


def test_a_selection_in_the_normal_form_is_kept_and_any_other_is_normalised():
    # int bounds without a step are the normal form (kept as given); numpy ints, a step of
    # 1, an open start and (start, stop) pairs are made into it; bools and other steps refused
    s = damacy.Sample("/a.zarr", np.s_[2:5, 0:None, 7])
    assert s.selection == (slice(2, 5), slice(0, None), 7) and s.flip == () and s.transpose is None
    t = damacy.Sample("/a.zarr", (slice(np.int64(2), np.int32(5), 1), slice(None, None), (7, 8)))
    assert t.selection == (slice(2, 5), slice(0, None), slice(7, 8))
    assert all(type(v) is int for e in t.selection[:1] for v in (e.start, e.stop))
    for bad in (slice(True, 3), slice(0, 3, 2), slice(0.0, 3)):
        with pytest.raises((TypeError, ValueError)):
            damacy.Sample("/a.zarr", (bad,))
    # no transform spelled every way is none; an axis 0 flip is one
    for flip in ((), [], None):
        assert damacy.Sample("/a.zarr", np.s_[0:1], flip=flip).flip == ()
    assert damacy.Sample("/a.zarr", np.s_[0:1], flip=0).flip == (0,)
    assert damacy.Sample("/a.zarr", np.s_[0:1, 0:2], flip=[], transpose=[1, 0]).transpose == (1, 0)


def test_random_boxes_draw_transforms_from_the_seed(volume):
    uri, data = volume
    s = damacy.RandomBoxes({uri: data.shape}, (8, 8, 8), seed=4, samples_per_epoch=40, flips=(0, 1, 2), transposes=[(0, 1, 2), (0, 2, 1), (2, 1, 0)])
    drawn = list(s)
    assert {x.flip for x in drawn} > {()} and {x.transpose for x in drawn} == {None, (0, 2, 1), (2, 1, 0)}
    assert drawn == list(damacy.RandomBoxes({uri: data.shape}, (8, 8, 8), seed=4, samples_per_epoch=40, flips=(0, 1, 2), transposes=[(0, 1, 2), (0, 2, 1), (2, 1, 0)]))
    cfg = damacy.Config(samples_per_batch=8, sample_shape=(8, 8, 8), dtype="native")
    with damacy.Pipeline(cfg) as pipe:
        got = _run(pipe, drawn)
    for k, x in enumerate(drawn):
        np.testing.assert_array_equal(got[k], _expected(data, tuple(x.selection), x.flip, x.transpose))


def test_transform_axes_are_the_results_not_the_arrays(volume, make):
    """An integer drops its axis: flip and transpose count the axes the sample has."""
    uri, data = volume
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(8, 6), dtype="f32")
    samples = [damacy.Sample(uri, np.s_[1, 0:6, 3:11], flip=(1,), transpose=(1, 0)), damacy.Sample(uri, np.s_[2:8, 5, 0:8], flip=(0,), transpose=(1, 0))]
    with make(cfg) as pipe:
        got = _run(pipe, samples)
    np.testing.assert_array_equal(got[0], np.transpose(np.flip(data[1, 0:6, 3:11], 1)).astype("f4"))
    np.testing.assert_array_equal(got[1], np.transpose(np.flip(data[2:8, 5, 0:8], 0)).astype("f4"))
