"""Intensity normalisation fused into the cast: a sample's ``normalize=(offset, scale)``
writes ``(x - offset) * scale``, rounded as the numeric contract says (in f32, f64 for f64
outputs; each step once), the same on every executor: numpy's path, the native loop, the
GPU kernels' host twin, through damacyd. Values, fills and padding alike."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from zarr.codecs import BloscCodec, ZstdCodec

import damacy
from damacy_server.cuda import twin
from damacy_server.decode import contract

from conftest import padded_selection, random_data, write_array
from pipeline_helpers import composed, cpu_executor_for

NORMS = [(0.0, 1.0), (1000.0, 1 / 3), (-2.5, 0.1), (0.1, 7.0), (3e4, -1e-3)]
FLOAT_OUT = ["float16", "float32", "float64", "bfloat16"]


def _dtype(name):
    return contract.BF16 if name == "bfloat16" else np.dtype(name)


def _bits(a):
    """NaN-aware bits: every NaN alike (its payload is not part of the contract)."""
    a = np.asarray(a)
    u = a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]).copy()
    with np.errstate(invalid="ignore"):
        nan = np.isnan(a.astype(np.float64))
    u[nan] = 0
    return u, nan


def _assert_same(got, want, what=""):
    gb, gn = _bits(got)
    wb, wn = _bits(want)
    assert np.array_equal(gn, wn), f"NaNs differ {what}"
    mismatch = np.flatnonzero(gb != wb)
    assert not len(mismatch), f"{what}: {len(mismatch)} values differ, first at {mismatch[:5]}: {np.asarray(got).reshape(-1)[mismatch[:5]]} vs {np.asarray(want).reshape(-1)[mismatch[:5]]}"


def _values(src: np.dtype) -> np.ndarray:
    rng = np.random.default_rng(7)
    edges = contract.edge_values(src)
    if src.kind == "b":
        return np.tile(edges, 64)
    if src.kind in "iu":
        info = np.iinfo(src)
        rand = rng.integers(info.min, info.max, size=2048, dtype=src, endpoint=True)
    else:
        rand = np.frombuffer(rng.bytes(src.itemsize * 2048), dtype=src)
    return np.concatenate([edges, rand, np.arange(-50, 50).astype(src)])


def test_the_contract_computes_in_f32_with_each_step_rounded_once():
    x = np.array([3, 65535, 1 << 24 | 1], dtype=np.uint32)
    got = contract.normalize(x, np.float32, 0.1, 1 / 3)
    o, k = np.float32(0.1), np.float32(1 / 3)
    want = np.array([(np.float32(v) - o) * k for v in x.tolist()], dtype=np.float32)  # 2**24 + 1 rounds first
    assert np.array_equal(got, want)
    f64 = contract.normalize(x, np.float64, 0.1, 1 / 3)
    assert np.array_equal(f64, (x.astype(np.float64) - 0.1) * (1 / 3))
    assert contract.normalize(np.array([1.0], ">f8"), np.float16, 1.0, 2.0).dtype == np.float16
    with pytest.raises(ValueError, match="float type"):
        contract.normalize(x, np.uint8, 0.0, 1.0)


@pytest.mark.skipif(not twin.available(), reason="the kernels' host twin was not built (no C compiler)")
@pytest.mark.parametrize("src", ["bool", "int8", "uint8", "int16", "uint16", ">u2", "int32", "uint32", "int64", "uint64", "float16", "float32", ">f4", "float64"])
def test_the_kernel_twin_equals_the_contract(src):
    src = np.dtype(src)
    values = _values(src.newbyteorder("=")).astype(src)
    n = len(values)
    rows = np.array([[0, 0, 0, 0, n]], dtype=np.int64)
    for out in FLOAT_OUT:
        for norm in NORMS:
            got = np.zeros(n, dtype=_dtype(out))
            twin.assemble(rows, 1, np.zeros(1, dtype=np.int64), [values], [got], norms=[norm])
            _assert_same(got, contract.normalize(values, _dtype(out), *norm), f"{src} -> {out} {norm}")
        filled = np.zeros(5, dtype=_dtype(out))
        twin.fill([0], values[3:4], [filled], norms=[(2.0, 0.5)])
        _assert_same(filled, contract.normalize(np.repeat(values[3:4], 5), _dtype(out), 2.0, 0.5), f"fill {src} -> {out}")


@pytest.mark.parametrize("src", ["bool", "int8", "uint8", "int16", "uint16", ">u2", "int32", "uint32", "int64", "uint64", "float16", "float32", ">f8", "float64"])
def test_the_native_loop_equals_the_contract(src):
    from damacy_server import native

    if not native.available():
        pytest.skip("the native extension was not built (no C compiler)")
    from damacy_server.native import _assemble

    src = np.dtype(src)
    values = _values(src.newbyteorder("=")).astype(src)
    n = len(values)
    ops = np.array([[0, 0, 0, 0, n], [0, 1, 0, 0, n]], dtype=np.int64)  # a normalised sample and a plain one
    shape = np.array([n], dtype=np.int64)
    swap = int(not src.isnative and src.itemsize > 1)
    for out in FLOAT_OUT:
        code = native.dtype_code(_dtype(out))
        assert _assemble.supports(native.dtype_code(src), code, True)  # every source to every float output, normalised
        plain_too = _assemble.supports(native.dtype_code(src), code)  # else the plain cast is numpy's (tested below)
        for norm in NORMS:
            got, plain = np.zeros(n, dtype=_dtype(out)), np.zeros(n, dtype=_dtype(out))
            targets = native.targets([got, plain] if plain_too else [got], 1, [norm, None])
            failed = _assemble.run(values.tobytes(), 0, np.array([[0, values.nbytes]], dtype=np.int64).tobytes(), (ops if plain_too else ops[:1]).tobytes(), 0,
                                   targets.tobytes(), shape.tobytes(), native.dtype_code(src), code, swap, 0, values.nbytes, b"")[0]
            assert failed == []
            _assert_same(got, contract.normalize(values, _dtype(out), *norm), f"{src} -> {out} {norm}")
            if plain_too:
                _assert_same(plain, contract.convert(values, _dtype(out)), f"{src} -> {out} unnormalised")
            else:  # a plain target of this pair is refused, never written
                with pytest.raises(ValueError, match="only for normalised targets"):
                    _assemble.run(values.tobytes(), 0, np.array([[0, values.nbytes]], dtype=np.int64).tobytes(), ops.tobytes(), 0,
                                  native.targets([got, plain], 1, [norm, None]).tobytes(), shape.tobytes(), native.dtype_code(src), code, swap, 0,
                                  values.nbytes, b"")
                assert not plain.view(np.uint8).any()
    # an integer or bool output is refused, never written
    out = np.zeros(n, dtype=np.int32 if src == np.bool_ else np.bool_)  # a cast the plain rows offer
    targets = native.targets([out], 1, [(0.0, 1.0)])
    with pytest.raises(ValueError, match="float outputs"):
        _assemble.run(values.tobytes(), 0, np.array([[0, values.nbytes]], dtype=np.int64).tobytes(), ops[:1].tobytes(), 0,
                      targets.tobytes(), shape.tobytes(), native.dtype_code(src), native.dtype_code(out.dtype), swap, 0, values.nbytes, b"")
    assert not out.any()


@pytest.fixture(scope="module")
def volumes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("n")
    u16 = random_data((20, 30, 24), "uint16", seed=3)
    write_array(folder / "u16.zarr", u16, chunks=(5, 8, 6), shards=(10, 16, 12), compressors=[ZstdCodec()], fill_value=7)
    f32 = random_data((20, 30, 24), "float32", seed=4)
    write_array(folder / "f32.zarr", f32, chunks=(10, 10, 8), compressors=[BloscCodec(cname="lz4", shuffle="shuffle")], fill_value=-1.5)
    return {"u16": (str(folder / "u16.zarr"), u16, 7), "f32": (str(folder / "f32.zarr"), f32, -1.5)}


BOXES = [np.s_[0:6, 0:10, 0:12], np.s_[-3:3, 25:35, 18:30], np.s_[4:10, 3:13, 5:17], np.s_[15:21, 22:32, 0:12]]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_pipelines_write_normalised_samples_in_every_mode(volumes, make, dtype):
    """Normalised and plain samples in one batch, boxes reaching outside (the fill value
    normalised too), a flip on top: equal to the contract on zarr-python's values."""
    for name in ("u16", "f32"):
        uri, data, fill = volumes[name]
        samples = []
        for k, box in enumerate(BOXES):
            norm = None if k == 2 else NORMS[k + 1]
            samples.append(damacy.Sample(uri, box, normalize=norm, flip=(1,) if k == 3 else ()))
        cfg = damacy.Config(samples_per_batch=2, sample_shape=(6, 10, 12), dtype=dtype, out_of_bounds="pad")
        with make(cfg) as pipe:
            pipe.push(samples)
            got = np.concatenate([b.copy() for b in pipe])
        for k, s in enumerate(samples):
            box = padded_selection(data, BOXES[k], fill=fill)
            if s.flip:
                box = np.flip(box, s.flip)
            want = contract.convert(box, _dtype(dtype)) if s.normalize is None else contract.normalize(box, _dtype(dtype), *s.normalize)
            _assert_same(got[k], want, f"{name} sample {k} as {dtype}")


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
def test_both_cpu_paths_normalise_alike_with_missing_chunks_and_the_chunk_cache(tmp_path, native):
    data = random_data((16, 16), "int16", seed=9)
    data[8:, :8] = 0  # a chunk never written (zarr-python leaves it out: the fill value)
    write_array(tmp_path / "a.zarr", data, chunks=(8, 8), compressors=[ZstdCodec()], fill_value=0)
    uri = str(tmp_path / "a.zarr")
    samples = [damacy.Sample(uri, np.s_[0:16, 0:16], normalize=(100.0, 0.01)), damacy.Sample(uri, np.s_[4:20, 0:16], normalize=(-3.0, 2.0))]
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(16, 16), dtype="float32", out_of_bounds="pad")
    executor = cpu_executor_for(cfg, max_memory_bytes=64 << 20, decode_workers=2, native=native)
    with composed(cfg, executor=executor) as pipe:
        for _ in range(2):  # the second time from the chunk cache
            pipe.push(samples)
            with pipe.pop() as b:
                got = b.copy()
            for k, s in enumerate(samples):
                _assert_same(got[k], contract.normalize(padded_selection(data, s.selection), np.float32, *s.normalize))
        native_units = pipe.stats_dict()["stages"].get("native", {}).get("count", 0)
    executor.close()
    assert (native_units > 0) == native


def test_index_queries_and_fills_on_error_are_normalised(volumes):
    uri, data, _ = volumes["u16"]
    q = damacy.IndexQuery(uri, ([3, 1, 19], range(2, 29, 3), [0, 23, 5]), normalize=(500.0, 0.5))
    want = contract.normalize(data[np.ix_([3, 1, 19], range(2, 29, 3), [0, 23, 5])], np.float32, 500.0, 0.5)
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(3, 9, 3), dtype="float32", on_error="fill")
    with damacy.Pipeline(cfg) as pipe:
        pipe.push([q, damacy.Sample(uri + "-missing", np.s_[0:3, 0:9, 0:3], normalize=(500.0, 0.5))])
        with pipe.pop() as b:
            _assert_same(b.numpy()[0], want)
            assert dict(b.info.errors).keys() == {1}
            assert np.all(b.numpy()[1] == np.float32(-250.0))  # the 0 a missing array reads as, normalised


def test_a_normalised_sample_needs_a_float_batch(volumes, make):
    uri, data, _ = volumes["u16"]
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(2, 3, 4), dtype="uint16", on_error="fill")
    with make(cfg) as pipe:
        pipe.push([damacy.Sample(uri, np.s_[0:2, 0:3, 0:4], normalize=(1.0, 2.0)), damacy.Sample(uri, np.s_[2:4, 0:3, 0:4])])
        with pipe.pop() as b:
            (i, err), = b.info.errors
            assert i == 0 and isinstance(err, damacy.InvalidArgument) and "normalize writes a float type" in str(err) and "uint16" in str(err)
            assert np.array_equal(b.numpy()[1], data[2:4, 0:3, 0:4])


def test_index_lists_on_both_sides_take_the_normalising_gather_and_scatter(volumes):
    """An unsorted list along the last axis spanning chunks: each unit's elements go to
    scattered positions (the native scatter rows), a flip makes strided gathers."""
    uri, data, _ = volumes["u16"]
    sel = ([7, 2, 2, 15], [19, 1, 20, 2, 13, 0, 23])
    # (an IndexQuery keeps every axis: the first one of one position)
    queries = [damacy.IndexQuery(uri, ([3],) + sel, normalize=(100.0, 0.5)), damacy.IndexQuery(uri, ([9],) + sel, normalize=(7.0, -2.0), flip=(1, 2))]
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(1, 4, 7), dtype="float32")
    executor = cpu_executor_for(cfg, max_memory_bytes=64 << 20, decode_workers=2, native=True)
    with composed(cfg, executor=executor) as pipe:
        pipe.push(queries)
        with pipe.pop() as b:
            got = b.copy()
        assert pipe.stats_dict()["stages"]["native"]["count"] > 0
    executor.close()
    for k, q in enumerate(queries):
        box = data[np.ix_(list(q.indices[0]), *sel)]
        _assert_same(got[k], contract.normalize(np.flip(box, q.flip) if q.flip else box, np.float32, *q.normalize))


def test_an_offset_or_scale_the_compute_type_cannot_hold_fails_the_sample(volumes):
    uri, data, _ = volumes["u16"]
    box = np.s_[0:2, 0:3, 0:4]
    for dtype, ok in (("float32", False), ("bfloat16", False), ("float64", True)):
        cfg = damacy.Config(samples_per_batch=3, sample_shape=(2, 3, 4), dtype=dtype, on_error="fill")
        with damacy.Pipeline(cfg) as pipe:
            pipe.push([damacy.Sample(uri, box, normalize=(1e39, 1.0)), damacy.Sample(uri, box, normalize=(0.0, 1e-46)), damacy.Sample(uri, box, normalize=(0.0, 0.0))])
            with pipe.pop() as b:
                errors = dict(b.info.errors)
                got = b.copy()
        if ok:
            assert errors == {}
        else:
            assert set(errors) == {0, 1} and "offset 1e+39 is outside what float32 holds" in str(errors[0]) and "scale 1e-46" in str(errors[1])
        assert np.all(got[2].astype("f8") == 0)  # a zero scale is a constant batch, not an error


def test_normalize_is_checked_and_travels(volumes):
    uri, _, _ = volumes["u16"]
    s = damacy.Sample(uri, np.s_[0:2], normalize=(1, 0.5))
    assert s.normalize == (1.0, 0.5) and "normalize=(1.0, 0.5)" in repr(s)
    assert pickle.loads(pickle.dumps(s)) == s and s != damacy.Sample(uri, np.s_[0:2])
    from damacy_protocol import wire

    assert wire.sample_from_wire(wire.sample_to_wire(1, s)) == s
    for bad in [(1.0,), "ab", (float("nan"), 1.0), (0.0, float("inf")), (True, 1.0)]:
        with pytest.raises(damacy.InvalidArgument, match="normalize must be a pair"):
            damacy.Sample(uri, np.s_[0:2], normalize=bad)


def test_samplers_and_multi_samples_carry_normalisation(volumes):
    u16, data16, _ = volumes["u16"]
    f32, data32, _ = volumes["f32"]
    shapes = {u16: data16.shape, f32: data32.shape}
    s = damacy.RandomBoxes(shapes, (4, 6, 8), seed=3, samples_per_epoch=12, normalize={u16: (3e4, 1e-4)})
    drawn = list(s)
    assert {x.normalize for x in drawn if x.uri == u16} == {(3e4, 1e-4)} and {x.normalize for x in drawn if x.uri == f32} == {None}
    assert {x.normalize for x in damacy.GridBoxes(shapes, (10, 15, 12), normalize=(1.0, 2.0))} == {(1.0, 2.0)}
    with pytest.raises(damacy.InvalidArgument, match="not among the arrays"):
        damacy.RandomBoxes(shapes, (4, 6, 8), seed=3, samples_per_epoch=12, normalize={"elsewhere": (0.0, 1.0)})
    with pytest.raises(damacy.InvalidArgument, match="finite"):
        damacy.GridBoxes(shapes, (10, 15, 12), normalize=(0.0, float("nan")))

    # a group: the image normalised, its labels not, through a MultiPipeline
    group = [{"image": f32, "label": u16}]
    s = damacy.RandomBoxes(group, (4, 6, 8), seed=5, samples_per_epoch=6, normalize={"image": (-1.0, 0.25)})
    with pytest.raises(damacy.InvalidArgument, match="for groups of arrays"):
        damacy.RandomBoxes(group, (4, 6, 8), seed=5, samples_per_epoch=6, normalize=(0.0, 1.0))
    cfgs = {"image": damacy.Config(samples_per_batch=3, sample_shape=(4, 6, 8), dtype="bfloat16"),
            "label": damacy.Config(samples_per_batch=3, sample_shape=(4, 6, 8), dtype="native")}
    drawn = list(s)
    with damacy.MultiPipeline(cfgs) as pipe:
        pipe.push(drawn)
        got = {"image": [], "label": []}
        for multi in pipe:
            with multi:
                for name in got:
                    got[name].extend(multi[name].copy())
    for k, m in enumerate(drawn):
        box = m["image"].selection
        _assert_same(got["image"][k], contract.normalize(padded_selection(data32, box, fill=-1.5), contract.BF16, -1.0, 0.25))
        assert np.array_equal(got["label"][k], padded_selection(data16, box, fill=7))
    with pytest.raises(damacy.InvalidArgument, match="normalize names"):
        damacy.MultiSample.at({"image": f32}, np.s_[0:1], normalize={"mask": (0.0, 1.0)})


def test_the_readme_example_runs(tmp_path):
    from test_readme import block

    data = random_data((48, 80, 96), "int16", seed=21)
    write_array(tmp_path / "ct.zarr", data, chunks=(16, 32, 32), compressors=[ZstdCodec()])
    scope: dict = {}
    exec(compile(block("normalize").replace('"data/', f'"{tmp_path}/'), "README normalize", "exec"), scope)
    drawn = list(scope["train"])
    assert scope["x"].shape == (8, 32, 64, 64)
    for k, s in enumerate(drawn):
        _assert_same(scope["x"][k], contract.normalize(padded_selection(data, s.selection), np.float32, -1000.0, 1 / 2000))


@pytest.mark.parametrize("out", ["bfloat16", "float16"])
def test_casts_the_native_loop_offers_only_normalised_take_it_when_every_sample_normalises(tmp_path, out):
    """f64 -> bf16/f16 is numpy's without normalisation (the plain cast would round twice
    through f32); normalised, every step is the contract's own, so the native loop takes the
    batch when all its samples normalise, and numpy's path when one does not."""
    data = random_data((16, 24), "float64", seed=13)
    write_array(tmp_path / "d.zarr", data, chunks=(8, 8), compressors=[ZstdCodec()])
    uri = str(tmp_path / "d.zarr")
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(8, 12), dtype=out)
    for plain_too, native_expected in ((False, True), (True, False)):
        samples = [damacy.Sample(uri, np.s_[0:8, 0:12], normalize=(1.5, 0.25)),
                   damacy.Sample(uri, np.s_[5:13, 9:21], normalize=None if plain_too else (-2.0, 3.0))]
        executor = cpu_executor_for(cfg, max_memory_bytes=64 << 20, decode_workers=2, native=True)
        with composed(cfg, executor=executor) as pipe:
            pipe.push(samples)
            with pipe.pop() as b:
                got = b.copy()
            native_units = pipe.stats_dict()["stages"].get("native", {}).get("count", 0)
        executor.close()
        assert (native_units > 0) == native_expected
        for k, s in enumerate(samples):
            box = padded_selection(data, s.selection)
            want = contract.convert(box, _dtype(out)) if s.normalize is None else contract.normalize(box, _dtype(out), *s.normalize)
            _assert_same(got[k], want, f"sample {k}")


def test_a_native_batch_normalises_as_the_dtype_its_first_array_fixed(tmp_path, make):
    # dtype="native": the first array (float32) fixes the batch's dtype; a later uint8 sample
    # (it casts safely) normalises into float32, not refused as if the batch were uint8
    write_array(tmp_path / "f", np.arange(4, dtype="float32"), chunks=(4,))
    write_array(tmp_path / "u", np.arange(4, dtype="uint8") + 10, chunks=(4,))
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(4,), dtype="native", on_error="fill")
    with make(cfg) as pipe:
        pipe.push([damacy.Sample(str(tmp_path / "f"), np.s_[0:4]), damacy.Sample(str(tmp_path / "u"), np.s_[0:4], normalize=(10.0, 0.5))])
        with pipe.pop() as batch:
            assert batch.info.dtype == damacy.Dtype.F32 and not batch.info.errors
            np.testing.assert_array_equal(batch.copy()[1], np.array([0.0, 0.5, 1.0, 1.5], dtype="float32"))
