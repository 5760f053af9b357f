"""The native decode-and-assemble path gives exactly what the numpy path gives."""

from __future__ import annotations

import numpy as np
import pytest
from zarr.codecs import BloscCodec, BytesCodec, ZstdCodec

import damacy
from damacy_server import native
from damacy_server.plan.planner import Planner
from damacy_server.plan.resolve import Resolver
from damacy_server.plan.units import UNIT_BITS

from conftest import DTYPES, padded_selection, random_data, write_array

pytestmark = pytest.mark.skipif(not native.available(), reason="the native extension was not built (no C compiler at install)")

OUT = ["f32", "bf16", "f16", "f64", "u8", "u16", "i16", "i32", "i64", "bool", "native"]
SHAPE = (9, 10, 11)
BOX = (4, 5, 6)


def _unit_of(meta, key: int) -> tuple[int, ...]:
    """The read unit of ``meta`` a chunk cache key names (the unit's index in its grid below
    UNIT_BITS, see unit_keys)."""
    return tuple(int(i) for i in np.unravel_index(key & ((1 << UNIT_BITS) - 1), meta.layout.grid))


def _planner(**limits):
    """A planner component with fresh metadata settings, its limits ``PlanLimits(**limits)``."""
    metadata = damacy.ZarrMetadata(reader=damacy.FileMetadataReader(), cache=damacy.MetadataCache())
    return damacy.ChunkPlanner(metadata=metadata, limits=damacy.PlanLimits(**limits))


def _executor(**limits):
    """A CPU executor reading with a default FileReader, its limits ``CpuLimits(**limits)``."""
    return damacy.CpuExecutor(reader=damacy.FileReader(), limits=damacy.CpuLimits(**limits))


def _plan(samples, sample_shape, **limits):
    """The plan of one batch, by the planning machinery itself (a planner of its own)."""
    return Planner(Resolver(), damacy.PlanLimits(**limits)).plan(samples, sample_shape)


def _queues(samples):
    """Two batches ahead (what a composed pipeline had by default)."""
    return damacy.QueueLimits(lookahead_samples=2 * samples)


def boxes(n, seed):
    rng = np.random.default_rng(seed)
    return [tuple((int(a), int(a) + b) for a, b in zip(rng.integers(-3, 8, size=3), BOX)) for _ in range(n)]


def run(uri, out, use_native, aabbs, cache_bytes=0, executor=None):
    executor = executor or _executor(max_memory_bytes=64 << 20, decode_workers=2, native=use_native, chunk_cache_bytes=cache_bytes)
    pipe = damacy.Pipeline(
        planner=_planner(),
        executor=executor,
        output=damacy.BatchSpec(3, BOX, out),
        queues=damacy.QueueLimits(lookahead_samples=3, prepared_batches=1),
        out_of_bounds="pad",  # the boxes reach out of the array
    )
    got = []
    with pipe:
        pipe.push([damacy.Sample(uri, a) for a in aabbs])
        for b in pipe.batches():
            with b:
                got.append(b.numpy().copy())
        stats = pipe.stats_dict()["stages"]
    return np.concatenate(got), stats["native"]["count"]


@pytest.mark.parametrize("codec", ["raw-big", "zstd-little", "zstd-big", "blosc-little", "bitshuffle-big"])
@pytest.mark.parametrize("src", DTYPES)
def test_native_equals_numpy(tmp_path, src, codec):
    endian = codec.split("-")[1]
    itemsize = np.dtype(src).itemsize
    compressors = {
        "zstd": [ZstdCodec(level=1)],
        "blosc": [BloscCodec(cname="lz4", shuffle="shuffle", typesize=itemsize, blocksize=64)],
        "bitshuffle": [BloscCodec(cname="zstd", shuffle="bitshuffle", typesize=itemsize, blocksize=128)],
    }.get(codec.split("-")[0], [])
    data = random_data(SHAPE, src, seed=7)
    write_array(tmp_path / "a", data, chunks=(4, 4, 5), serializer=BytesCodec(endian=endian if np.dtype(src).itemsize > 1 else None), compressors=compressors, fill_value=np.ones((), src)[()])
    aabbs = boxes(6, seed=len(src))
    # every output for the plain chunks of either byte order (the casts do not depend on the
    # codec); after the other codecs, f32, native and one more, rotating with the source
    outs = OUT if codec in ("raw-big", "zstd-little") else ["f32", "native", OUT[DTYPES.index(src) % len(OUT)]]
    for out in outs:
        want, used = run(str(tmp_path / "a"), out, False, aabbs)
        got, native_units = run(str(tmp_path / "a"), out, True, aabbs)
        assert used == 0
        assert got.dtype == want.dtype and got.shape == want.shape
        # bit for bit, NaN payloads included
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (src, out, codec)
        meta = damacy.open_array(tmp_path / "a")
        expect_native = native.kernel_for(meta, want.dtype) is not None
        assert (native_units > 0) == expect_native, (src, out, codec)


@pytest.mark.parametrize("codec", ["raw-big", "zstd-little", "zstd-big", "bitshuffle-big"])
@pytest.mark.parametrize("src", ["uint16", "float32", "int8"])
def test_native_path_fills_and_serves_the_chunk_cache(tmp_path, src, codec, monkeypatch):
    """With a chunk cache, misses are decoded whole by native code into the cache entry (which
    equals zarr-python's chunk) and hits are copied natively; results equal numpy's."""
    endian = codec.split("-")[1]
    itemsize = np.dtype(src).itemsize
    compressors = {
        "zstd": [ZstdCodec(level=1)],
        "bitshuffle": [BloscCodec(cname="zstd", shuffle="bitshuffle", typesize=itemsize, blocksize=128)],
    }.get(codec.split("-")[0], [])
    data = random_data(SHAPE, src, seed=3)
    oracle = write_array(tmp_path / "a", data, chunks=(4, 4, 5), serializer=BytesCodec(endian=endian if itemsize > 1 else None), compressors=compressors)
    aabbs = boxes(6, seed=11) * 2  # the second round finds every chunk in the cache
    calls = []
    real = native.run_decoded
    monkeypatch.setattr(native, "run_decoded", lambda *a: calls.append(len(a[1])) or real(*a))
    for out in ("f32", "native", "bf16"):
        want, _ = run(str(tmp_path / "a"), out, False, aabbs)
        executor = _executor(max_memory_bytes=64 << 20, decode_workers=2, chunk_cache_bytes=1 << 20)
        calls.clear()
        got, native_units = run(str(tmp_path / "a"), out, True, aabbs, executor=executor)
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (src, out, codec)
        cache = executor.chunk_cache
        assert native_units > 0 and sum(calls) > 0 and cache.stats()["hits"] >= sum(calls)
        # the numpy path serves the same hits the same way
        plain = _executor(max_memory_bytes=64 << 20, decode_workers=2, native=False, chunk_cache_bytes=1 << 20)
        got, _ = run(str(tmp_path / "a"), out, False, aabbs, executor=plain)
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)) and plain.chunk_cache.stats()["hits"] > 0
        meta = damacy.open_array(tmp_path / "a")
        assert len({key >> UNIT_BITS for key, _ in cache.items()}) == 1  # one array's entries, all of them
        for key, arr in cache.items():
            unit = _unit_of(meta, key)
            assert not arr.flags.writeable
            box = tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(unit, (4, 4, 5), SHAPE))
            inside = arr[tuple(slice(0, b.stop - b.start) for b in box)]
            assert np.array_equal(inside.astype(src).view(np.uint8), np.ascontiguousarray(oracle[box]).view(np.uint8)), unit


def test_a_corrupt_chunk_is_never_cached(tmp_path):
    data = np.arange(8 * 10 * 12, dtype="u2").reshape(8, 10, 12)
    write_array(tmp_path / "z", data, chunks=(4, 10, 12), compressors=[ZstdCodec(level=3)])
    chunk = tmp_path / "z" / "c" / "1" / "0" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2 :] = bytes(len(raw) - len(raw) // 2)
    chunk.write_bytes(bytes(raw))
    uri = str(tmp_path / "z")
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(4, 10, 12), on_error="fill", pop_timeout_s=30, chunk_cache_bytes=1 << 20)
    with damacy.Pipeline(cfg) as p:
        p.push([damacy.Sample(uri, np.s_[0:4, :, :]), damacy.Sample(uri, np.s_[4:8, :, :])] * 2)
        for b in p.batches():
            with b:
                (i, err), = b.info.errors  # the second time too: nothing of the bad chunk was kept
                assert i == 1 and isinstance(err, damacy.DecodeError) and "chunk [1, 0, 0]" in str(err)
                assert np.array_equal(b.numpy()[0], data[0:4].astype("f4"))
        meta = damacy.open_array(uri)
        assert [_unit_of(meta, k) for k, _ in p.executor.chunk_cache.items()] == [(0, 0, 0)]


def test_native_reports_corrupt_and_truncated_chunks(tmp_path):
    data = np.arange(8 * 10 * 12, dtype="u2").reshape(8, 10, 12)
    write_array(tmp_path / "z", data, chunks=(4, 10, 12), compressors=[ZstdCodec(level=3)])
    chunk = tmp_path / "z" / "c" / "1" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-8])
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(4, 10, 12), on_error="fill", pop_timeout_s=30)
    with damacy.Pipeline(cfg) as p:
        p.push([damacy.Sample(str(tmp_path / "z"), np.s_[0:4, :, :]), damacy.Sample(str(tmp_path / "z"), np.s_[4:8, :, :])])
        with p.pop() as b:
            (i, err), = b.info.errors
            assert i == 1 and isinstance(err, damacy.DecodeError) and "zstd" in str(err) and "chunk [1, 0, 0]" in str(err)
            assert np.array_equal(b.numpy()[0], data[0:4].astype("f4"))
        assert p.stats_dict()["stages"]["native"]["count"] > 0


def test_half_and_bfloat_rounding_edges():
    import ml_dtypes

    from damacy_server.native import _assemble

    special = np.array(
        [0.0, -0.0, 1.0, 65504.0, 65519.0, 65520.0, 1e-8, 5.96e-8, 6.1e-5, 1.00048828125, 1.0009765625, 3.4e38, np.inf, -np.inf, np.nan, -np.nan],
        dtype="f4",
    )
    bits = np.frombuffer(np.random.default_rng(0).bytes(4 * 4096), dtype="u4").view("f4")
    values = np.concatenate([special, bits])
    for name, code, ref in (("f16", 9, np.float16), ("bf16", 12, ml_dtypes.bfloat16)):
        out = np.zeros(len(values), dtype=ref)
        ops = np.array([[0, 0, 0, 0, len(values)]], dtype=np.int64)
        targets = np.array([[out.__array_interface__["data"][0], 1, len(out), 0, 0, 0]], dtype=np.int64)
        shape = np.array([len(values)], dtype=np.int64)
        assert _assemble.run(values.tobytes(), 0, _SPAN(values.nbytes), ops.tobytes(), 0, targets.tobytes(), shape.tobytes(), 10, code, 0, 0, values.nbytes, b"")[0] == []
        with np.errstate(over="ignore", invalid="ignore"):
            want = values.astype(ref)
        assert np.array_equal(out.view("u2"), want.view("u2")), name


INTEGERS = ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]


@pytest.mark.parametrize("order", ["<", ">"])
@pytest.mark.parametrize("src", INTEGERS)
def test_integer_casts_clamp_in_rows_gathers_and_scatters(src, order):
    """Integer to integer clamps to the output's range (numpy's astype would wrap), and an
    integer to bf16 rounds through f32, in all three loop kinds: a row, a gather from an
    index list and a scatter to one."""
    import ml_dtypes

    from damacy_server.decode import contract
    from damacy_server.native import _assemble

    src = np.dtype(src).newbyteorder(order)
    info = np.iinfo(src)
    vals = {int(info.min), int(info.max), -1, 0, 1, 12, 256, -300}
    for b in (7, 8, 15, 16, 31, 32, 63, 64):
        vals.update({2**b - 1, 2**b, 2**b + 1, -(2**b) - 1, -(2**b), -(2**b) + 1})
    vals.update({2**24 + 2**16 + 1, -(2**24 + 2**16 + 1)})  # a bf16 tie once rounded to f32
    values = np.array(sorted(v for v in vals if info.min <= v <= info.max), dtype=src)
    n = len(values)
    rev = np.arange(n - 1, -1, -1, dtype=np.int64)
    # target 0: a row; 1: a gather (source positions from the pool); 2: a scatter (destinations)
    ops = np.array([[0, 0, 0, 0, n], [0, 1, -1, 0, n], [0, 2, 0, -1, n]], dtype=np.int64)
    shape = np.array([n], dtype=np.int64)
    swap = int(not src.isnative and src.itemsize > 1)
    for dst in [np.dtype(t) for t in INTEGERS] + [np.dtype(ml_dtypes.bfloat16)]:
        code = native.dtype_code(dst)
        assert _assemble.supports(native.dtype_code(src), code), (src, dst)
        outs = [np.zeros(n, dtype=dst) for _ in range(3)]
        failed = _assemble.run(values.tobytes(), 0, _SPAN(values.nbytes), ops.tobytes(), 0, native.targets(outs, 1).tobytes(), shape.tobytes(),
                               native.dtype_code(src), code, swap, 0, values.nbytes, rev.tobytes())[0]
        assert failed == []
        if dst.kind in "iu":
            lo, hi = int(np.iinfo(dst).min), int(np.iinfo(dst).max)
            want = np.array([min(max(v, lo), hi) for v in values.tolist()], dtype=dst)
        else:
            want = values.astype(np.float32).astype(dst)  # through f32, each rounding to nearest even
        assert np.array_equal(want.view(np.uint8), contract.convert(values, dst).view(np.uint8)), (src, dst)
        for k, got in enumerate([outs[0], outs[1][::-1].copy(), outs[2][::-1].copy()]):
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (src, dst, k, values[got != want], got[got != want])


def test_checksummed_frames_are_decoded_whole_and_verified(tmp_path):
    data = np.arange(16 * 64 * 64, dtype="u2").reshape(16, 64, 64)
    write_array(tmp_path / "c", data, chunks=(16, 64, 64), compressors=[ZstdCodec(level=3, checksum=True)])
    chunk = tmp_path / "c" / "c" / "0" / "0" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[-1] ^= 0x5A  # the content checksum
    chunk.write_bytes(bytes(raw))
    cfg = damacy.Config(samples_per_batch=1, sample_shape=(2, 64, 64), on_error="fill", pop_timeout_s=30)
    with damacy.Pipeline(cfg) as p:
        p.push([damacy.Sample(str(tmp_path / "c"), np.s_[0:2, :, :])])  # needs only the first 16 KiB
        with p.pop() as b:
            (_, err), = b.info.errors
            assert isinstance(err, damacy.DecodeError) and "checksum" in str(err).lower()
        assert p.stats_dict()["stages"]["native"]["count"] == 1


def test_a_box_at_the_start_of_a_chunk_decodes_only_what_it_needs(tmp_path):
    # correctness of the prefix decode: values equal zarr-python's for boxes ending early
    data = random_data((32, 64, 64), "uint16", 5)
    oracle = write_array(tmp_path / "p", data, chunks=(32, 64, 64), compressors=[ZstdCodec(level=3)])
    cfg = damacy.Config(samples_per_batch=1, sample_shape=(1, 8, 64), pop_timeout_s=30)
    with damacy.Pipeline(cfg) as p:
        p.push([damacy.Sample(str(tmp_path / "p"), np.s_[z : z + 1, 0:8, :]) for z in (0, 3, 31)])
        for z, b in zip((0, 3, 31), p.batches()):
            with b:
                assert np.array_equal(b.numpy()[0], oracle[z : z + 1, 0:8, :].astype("f4"))


def test_corrupt_blosc_frames_are_decode_errors(tmp_path):
    data = np.arange(8 * 10 * 12, dtype="u2").reshape(8, 10, 12)
    write_array(tmp_path / "b", data, chunks=(4, 10, 12), compressors=[BloscCodec(cname="zstd", shuffle="shuffle", typesize=2, blocksize=128)])
    chunk = tmp_path / "b" / "c" / "1" / "0" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[16:20] = (10**6).to_bytes(4, "little")  # the first block starts outside the frame
    chunk.write_bytes(bytes(raw))
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(4, 10, 12), on_error="fill", pop_timeout_s=30)
    with damacy.Pipeline(cfg) as p:
        p.push([damacy.Sample(str(tmp_path / "b"), np.s_[0:4, :, :]), damacy.Sample(str(tmp_path / "b"), np.s_[4:8, :, :])])
        with p.pop() as b:
            (i, err), = b.info.errors
            assert i == 1 and isinstance(err, damacy.DecodeError) and "blosc" in str(err)
            assert np.array_equal(b.numpy()[0], data[0:4].astype("f4"))
        assert p.stats_dict()["stages"]["native"]["count"] > 0


@pytest.mark.parametrize("codec", ["zstd-little", "blosc-little", "raw-big"])
def test_native_index_queries_equal_numpy(tmp_path, codec):
    endian = codec.split("-")[1]
    compressors = {"zstd": [ZstdCodec(level=1)], "blosc": [BloscCodec(cname="zstd", shuffle="bitshuffle", typesize=2, blocksize=256)]}.get(codec.split("-")[0], [])
    data = random_data(SHAPE, "uint16", seed=11)
    write_array(tmp_path / "q", data, chunks=(4, 4, 5), serializer=BytesCodec(endian=endian), compressors=compressors)
    uri = str(tmp_path / "q")
    rng = np.random.default_rng(2)
    queries = [
        damacy.IndexQuery(uri, (rng.integers(0, 18, size=4).tolist(), slice(2, 7), rng.integers(0, 11, size=6).tolist()))
        for _ in range(6)
    ]

    def batches(use_native):
        executor = _executor(max_memory_bytes=64 << 20, decode_workers=2, native=use_native)
        pipe = damacy.Pipeline(
            planner=_planner(), executor=executor, output=damacy.BatchSpec(3, (4, 5, 6), "f32"), queues=_queues(3), out_of_bounds="pad"
        )
        out = []
        with pipe:
            pipe.push(queries)
            for b in pipe.batches():
                with b:
                    out.append(b.numpy().copy())
            used = pipe.stats_dict()["stages"]["native"]["count"]
        return np.concatenate(out), used

    want, used = batches(False)
    got, native_units = batches(True)
    assert used == 0 and native_units > 0
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    import zarr

    full = zarr.open_array(uri, mode="r")[...]
    for j, q in enumerate(queries):  # indices past the end of the array: padded
        sel = tuple(list(s) if isinstance(s, tuple) else s for s in q.selection)
        assert np.array_equal(got[j], padded_selection(full, sel).astype("f4"))


def _run_one(uri, box, executor=None, out="f32"):
    shape = tuple(b - a for a, b in box)
    pipe = damacy.Pipeline(
        planner=_planner(),
        executor=executor or _executor(max_memory_bytes=64 << 20, decode_workers=1),
        output=damacy.BatchSpec(1, shape, out),
        queues=_queues(1),
        on_error="fill",
    )
    with pipe:
        pipe.push([damacy.Sample(uri, box)])
        with pipe.pop() as b:
            return b.numpy()[0].copy(), b.info.errors


def test_blosc_header_with_typesize_zero_is_an_error(tmp_path):
    data = np.arange(64, dtype="u1").reshape(8, 8)
    write_array(tmp_path / "t", data, chunks=(8, 8), compressors=[BloscCodec(cname="zstd", shuffle="noshuffle", typesize=1)])
    chunk = tmp_path / "t" / "c" / "0" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[3] = 0
    chunk.write_bytes(bytes(raw))
    _, errors = _run_one(str(tmp_path / "t"), ((0, 4), (0, 8)))
    (_, err), = errors
    assert isinstance(err, damacy.DecodeError) and "blosc" in str(err)


def test_blosc_typesize_that_does_not_tile_the_chunk(tmp_path):
    data = (np.arange(10 * 100) % 251).astype("u1").reshape(10, 100)
    write_array(tmp_path / "t3", data, chunks=(10, 100), compressors=[BloscCodec(cname="lz4", shuffle="shuffle", typesize=3)])
    got, errors = _run_one(str(tmp_path / "t3"), ((3, 9), (10, 99)))
    assert errors == () and np.array_equal(got, data[3:9, 10:99].astype("f4"))


def test_truncated_zstd_frame_is_an_error_even_when_only_a_prefix_is_needed(tmp_path):
    data = random_data((64, 64, 64), "uint16", 9)  # 512 KiB chunks: four zstd blocks
    write_array(tmp_path / "z", data, chunks=(64, 64, 64), compressors=[ZstdCodec(level=3)])
    chunk = tmp_path / "z" / "c" / "0" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-1000])
    _, errors = _run_one(str(tmp_path / "z"), ((0, 2), (0, 64), (0, 64)))
    (_, err), = errors
    assert isinstance(err, damacy.DecodeError) and "chunk [0, 0, 0]" in str(err)


def _SPAN(nbytes: int) -> bytes:
    """One unit spanning the whole data."""
    return np.array([[0, nbytes]], dtype=np.int64).tobytes()


def test_ops_outside_their_unit_are_refused():
    from damacy_server.native import _assemble

    data = np.arange(16, dtype="f4")
    out = np.zeros(8, dtype="f4")
    targets = np.array([[out.__array_interface__["data"][0], 1, 8, 0, 0, 0]], dtype=np.int64)
    shape = np.array([16], dtype=np.int64)
    for row, pool in (([0, 0, 12, 0, 8], []), ([0, 0, -1, 0, 2], [3, 99]), ([0, 0, -5, 0, 2], [1, 2]), ([0, 0, 0, -2, 4], [0, 1, 2])):
        ops = np.array([row], dtype=np.int64)
        failed = _assemble.run(data.tobytes(), 0, _SPAN(64), ops.tobytes(), 0, targets.tobytes(), shape.tobytes(), 10, 10, 0, 0, 64, np.asarray(pool, dtype=np.int64).tobytes())[0]
        assert failed and failed[0][1] == native.Status.OPS
    assert not out.any()
    # destinations outside the sample, a target beyond those given or without a view, starts
    # that would overflow: refused before anything is written
    no_view = np.array([[0, 1, 8]], dtype=np.int64)
    for row, pool, tg in (
        ([0, 1, 0, 0, 8], [], targets),
        ([0, 0, 0, 4, 8], [], targets),
        ([0, 0, 0, -1, 2], [3, 8], targets),
        ([0, 0, 0, -1, 2], [-1, 2], targets),
        ([0, 0, -(2**63), 0, 2], [1, 2], targets),
        ([0, 0, 0, -(2**63), 2], [1, 2], targets),
        ([0, 0, 2**62, 0, 2**62], [], targets),
        ([0, 0, 0, 0, 8], [], no_view),
    ):
        ops = np.array([row], dtype=np.int64)
        failed = _assemble.run(data.tobytes(), 0, _SPAN(64), ops.tobytes(), 0, tg.tobytes(), shape.tobytes(), 10, 10, 0, 0, 64, np.asarray(pool, dtype=np.int64).tobytes())[0]
        assert failed and failed[0][1] == native.Status.OPS, row
    assert not out.any()
    # a unit shape that does not match the decoded size is refused outright
    with pytest.raises(ValueError, match="unit shape"):
        _assemble.run(data.tobytes(), 0, _SPAN(64), np.array([[0, 0, 0, 0, 8]], dtype=np.int64).tobytes(), 0, targets.tobytes(), shape.tobytes(), 10, 10, 0, 0, 32, b"")


def test_op_tables_out_of_unit_order_and_spans_past_the_data():
    from damacy_server.native import _assemble

    data = np.arange(16, dtype="f4")
    out = np.zeros(16, dtype="f4")
    targets = np.array([[out.__array_interface__["data"][0], 1, 16, 0, 0, 0]], dtype=np.int64)
    shape = np.array([8], dtype=np.int64)
    spans = np.array([[0, 32], [32, 32]], dtype=np.int64)
    ops = np.array([[1, 0, 0, 8, 8], [0, 0, 0, 0, 8]], dtype=np.int64)  # unit 1's op first
    with pytest.raises(ValueError, match="grouped by unit"):
        _assemble.run(data.tobytes(), 0, spans.tobytes(), ops.tobytes(), 0, targets.tobytes(), shape.tobytes(), 10, 10, 0, 0, 32, b"")[0]
    with pytest.raises(ValueError, match="negative span"):
        _assemble.run(data.tobytes(), 0, np.array([[-4, 8]], dtype=np.int64).tobytes(), ops[1:].tobytes(), 0, targets.tobytes(), shape.tobytes(), 10, 10, 0, 0, 32, b"")[0]
    # a span past the end of the data is cut there and reported as a short chunk
    spans = np.array([[0, 32], [48, 32]], dtype=np.int64)
    ops = np.array([[0, 0, 0, 0, 8], [1, 0, 0, 8, 8]], dtype=np.int64)
    failed = _assemble.run(data.tobytes(), 0, spans.tobytes(), ops.tobytes(), 0, targets.tobytes(), shape.tobytes(), 10, 10, 0, 0, 32, b"")[0]
    assert failed == [(1, native.Status.SIZE, 16)]
    assert native.Failure(*failed[0]).describe(32) == "decoded chunk has 16 bytes, expected 32"
    assert np.array_equal(out[:8], data[:8]) and not out[8:].any()
    # units numbered from a base, spans as offsets in an object whose read starts at 100
    out[...] = 0
    spans = np.array([[100, 32], [132, -1]], dtype=np.int64)  # the second: to the end of the data
    ops = np.array([[5, 0, 0, 8, 8], [6, 0, 0, 0, 8]], dtype=np.int64)
    failed, encoded, elements = _assemble.run(data.tobytes(), 100, spans.tobytes(), ops.tobytes(), 5, targets.tobytes(), shape.tobytes(), 10, 10, 0, 0, 32, b"")
    assert failed == [] and encoded == 64 and elements == 16
    assert np.array_equal(out, np.concatenate([data[8:], data[:8]]))


def test_a_rewritten_array_gets_its_own_kernel(tmp_path):
    executor = _executor(max_memory_bytes=64 << 20, decode_workers=1)
    first = np.arange(64, dtype="u2").reshape(8, 8)
    write_array(tmp_path / "r", first, chunks=(4, 4))
    got, _ = _run_one(str(tmp_path / "r"), ((0, 8), (0, 8)), executor)
    assert np.array_equal(got, first.astype("f4"))
    import shutil

    shutil.rmtree(tmp_path / "r")
    second = np.arange(64, 128, dtype="u2").reshape(8, 8)
    write_array(tmp_path / "r", second, chunks=(2, 8))  # same chunk bytes, another chunk shape
    got, _ = _run_one(str(tmp_path / "r"), ((0, 8), (0, 8)), executor)  # a new planner: fresh metadata
    assert np.array_equal(got, second.astype("f4"))


# -- reads made by decode threads from the page cache ---------------------------------


def _sharded(tmp_path, name="d"):
    data = random_data((16, 20, 24), "uint16", 11)
    write_array(tmp_path / name, data, chunks=(8, 10, 12), shards=(16, 20, 24), compressors=[ZstdCodec(level=1)])
    return str(tmp_path / name), data


def _read_all(uri, data, boxes_, executor=None):
    shape = tuple(b - a for a, b in boxes_[0])
    pipe = damacy.Pipeline(
        planner=_planner(),
        executor=executor or _executor(max_memory_bytes=64 << 20, decode_workers=2),
        output=damacy.BatchSpec(2, shape, "f32"),
        queues=_queues(2),
        on_error="fill",
    )
    with pipe:
        pipe.push([damacy.Sample(uri, b) for b in boxes_])
        for k, batch in enumerate(pipe.batches()):
            with batch:
                assert not batch.info.errors
                for j, b in enumerate(boxes_[2 * k : 2 * k + 2]):
                    assert np.array_equal(batch.numpy()[j], data[tuple(slice(a, c) for a, c in b)].astype("f4"))
        return pipe.stats_dict()["stages"]


BOXES = [((0, 8), (0, 10), (0, 12)), ((4, 12), (5, 15), (6, 18)), ((8, 16), (10, 20), (12, 24)), ((2, 10), (3, 13), (1, 13))]


def test_decode_threads_read_page_cached_groups_themselves(tmp_path):
    uri, data = _sharded(tmp_path)
    stages = _read_all(uri, data, BOXES)
    assert stages["direct"]["count"] > 0 and stages["direct"]["count"] == stages["read"]["count"]


class _Outcomes:
    """Decode threads' direct reads (``native.file_job``'s) whose outcome ``code(read, sparse)``
    decides: None, the read as made; -1, its bytes found out of the page cache (it was made,
    but its job reports it not made, as native code reports a read it cannot make without
    waiting: the executor must then read it the ordinary way). ``reads``: every direct read
    asked for, as its sparse flag."""

    def __init__(self, monkeypatch, code, build=None):
        self.reads: list[bool] = []
        real = native.file_job
        outer = self

        class Job:
            def __init__(self, handle, sparse, bounds):
                self.handle, self.bounds = handle, np.asarray(bounds)
                self.codes = [code(len(outer.reads) + i, bool(s)) for i, s in enumerate(sparse)]
                outer.reads.extend(bool(s) for s in sparse)

            def work(self, skip=False, most=-1):
                return self.handle.work(skip, most)

            def results(self):
                raw, failures = self.handle.results()
                figures = np.frombuffer(raw, dtype=np.int64).reshape(-1, 6).copy()
                for r, c in enumerate(self.codes):
                    if c is not None:
                        figures[r] = (c, 0, 0, 0, 0, 0)
                made = set(np.flatnonzero(figures[:, 0] == 0).tolist())
                bounds = self.bounds
                failures = [f for f in failures if int(np.searchsorted(bounds, f[0], side="right")) - 1 in made]
                return figures.tobytes(), failures

        def file_job(kernel, where, paths, offsets, lengths, sparse, bounds, *rest):
            if build is not None:
                build(len(outer.reads))
            return Job(real(kernel, where, paths, offsets, lengths, sparse, bounds, *rest), sparse, bounds)

        monkeypatch.setattr(native, "file_job", file_job)


def test_groups_not_in_the_page_cache_go_to_the_io_threads(tmp_path, monkeypatch):
    from damacy_server.cpu import reads as cpu

    uri, data = _sharded(tmp_path)
    direct = _Outcomes(monkeypatch, lambda r, sparse: -1)
    monkeypatch.setattr(cpu, "DIRECT_MISSES", 3)
    executor = _executor(max_memory_bytes=64 << 20, decode_workers=2)
    stages = _read_all(uri, data, BOXES * 3, executor)
    assert stages["direct"]["count"] == 0 and stages["read"]["count"] > 3
    # then it stops trying for a while (reads already handed to decode threads still try)
    assert 3 <= len(direct.reads) < stages["read"]["count"]
    assert executor._direct_skip > 0


def test_a_job_of_direct_reads_taken_by_several_threads_makes_every_read_once(tmp_path):
    # the reads of a plan's units (one a unit), one job: four threads
    # take its reads in turns of at most 2; exactly one call completes the last read, and the
    # values, bytes and elements equal the arrays' and what a read each by run_file makes
    import os
    import threading

    from damacy_server.cpu import optable

    uri, data = _sharded(tmp_path)
    plan = _plan([damacy.Sample(uri, ((3, 11), (2, 17), (5, 20)))], (8, 15, 15), max_gap_bytes=0, max_read_bytes=1)
    units = [u for g in plan.groups for u in g.units]
    assert len(plan.groups) == len(units) > 4  # a read per unit
    meta = damacy.open_array(uri)
    kernel = native.kernel_for(meta, np.dtype("f4"))
    out = np.zeros((1, 8, 15, 15), dtype="f4")
    targets = native.targets(list(out), 3)
    table = optable.build(units)
    flags = os.O_RDONLY | os.O_CLOEXEC
    n = len(units)
    job = native.file_job(
        kernel, (flags, None), tuple(os.fsencode(g.key) for g in plan.groups), np.array([g.offset for g in plan.groups]),
        np.array([g.length for g in plan.groups]), np.zeros(n, dtype=np.uint8), np.arange(n + 1), table, targets,
    )
    lasts, turns, lock = [], [0], threading.Lock()

    def worker():
        more = True
        while more:
            last, more = job.work(False, 2)
            with lock:
                lasts.append(last)
                turns[0] += 1

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert lasts.count(True) == 1 and turns[0] >= n // 2
    res = native.file_job_results(job)
    assert res.codes == [0] * n and res.failures == []
    assert np.array_equal(out[0], data[3:11, 2:17, 5:20].astype("f4"))
    assert res.nread == res.encoded == [u.nbytes for u in units]
    assert sum(res.elements) == out.size and all(a >= b for a, b in zip(res.ns, res.read_ns))
    # each read alone, by run_file: the same figures
    for r, g in enumerate(plan.groups):
        code, failures, _, nbytes, encoded, elements = native.run_file(kernel, (g.key, flags, None), g.offset, g.length, optable.build(g.units), targets)
        assert (code, failures, nbytes, encoded, elements) == (0, [], res.nread[r], res.encoded[r], res.elements[r])
    # a job skipped (its batch cancelled): nothing read or written, every read NOT_RUN
    out[...] = 0
    job = native.file_job(
        kernel, (flags, None), tuple(os.fsencode(g.key) for g in plan.groups), np.array([g.offset for g in plan.groups]),
        np.array([g.length for g in plan.groups]), np.zeros(n, dtype=np.uint8), np.arange(n + 1), table, targets,
    )
    with pytest.raises(RuntimeError, match="not all completed"):
        job.results()
    assert job.work(True) == (True, False) and job.work(False) == (False, False)
    assert native.file_job_results(job).codes == [native.NOT_RUN] * n and not out.any()
    # reads that do not hold every unit, or bounds that fall, are refused when made
    for bounds in (np.arange(n), np.r_[0, 2, 1, np.arange(3, n + 1)], np.r_[np.arange(n), n + 1]):
        with pytest.raises(ValueError):
            native.file_job(
                kernel, (flags, None), tuple(os.fsencode(g.key) for g in plan.groups)[: len(bounds) - 1],
                np.zeros(len(bounds) - 1, dtype=np.int64), np.full(len(bounds) - 1, -1), np.zeros(len(bounds) - 1, dtype=np.uint8),
                bounds, table, targets,
            )


def test_direct_reads_refuse_what_the_ordinary_path_must_report(tmp_path):
    import errno
    import os

    from damacy_server.cpu import optable
    from damacy_server.store import FileStore

    uri, data = _sharded(tmp_path)
    meta = damacy.open_array(uri)
    plan = _plan([damacy.Sample(uri, BOXES[0])], (8, 10, 12))
    (group,) = plan.groups
    kernel = native.kernel_for(meta, np.dtype("f4"))
    out = np.zeros((8, 10, 12), dtype="f4")
    targets = native.targets([out], 3)
    table = optable.build(group.units)
    flags = os.O_RDONLY | os.O_CLOEXEC

    code, failures, _, nbytes, encoded, elements = native.run_file(kernel, (group.key, flags, None), group.offset, group.length, table, targets)
    assert code == 0 and failures == [] and nbytes == group.length
    assert encoded == sum(u.nbytes for u in group.units) and elements == out.size
    assert np.array_equal(out, data[:8, :10, :12].astype("f4"))
    out[...] = 0
    # a missing file, a range past the end, a symlink where none may be followed, a FIFO,
    # a file outside the roots: nothing copied
    code, *_ = native.run_file(kernel, (group.key + ".gone", flags, None), group.offset, group.length, table, targets)
    assert code == errno.ENOENT
    size = os.path.getsize(group.key)
    code, *_ = native.run_file(kernel, (group.key, flags, None), size - 4, group.length, table, targets)
    assert code == -1
    os.symlink(group.key, tmp_path / "link")
    code, *_ = native.run_file(kernel, (str(tmp_path / "link"), flags | os.O_NOFOLLOW, None), group.offset, group.length, table, targets)
    assert code == errno.ELOOP
    os.mkfifo(tmp_path / "fifo")
    store = FileStore(roots=[str(tmp_path)])
    for roots in (None, store._roots_blob, b"-1:" + os.fsencode(tmp_path)):
        code, *_ = native.run_file(kernel, (str(tmp_path / "fifo"), flags, roots), 0, 16, table, targets)
        assert code == -1
    elsewhere = FileStore(roots=[str(tmp_path / "elsewhere"), str(tmp_path / "d" / "c" / "1")])
    code, *_ = native.run_file(kernel, (group.key, flags, elsewhere._roots_blob), group.offset, group.length, table, targets)
    assert code == -3
    assert not out.any()
    # inside a root: by openat2 from the root's descriptor, through an absolute link (decided
    # by the descriptor's location), by location alone (no root descriptor), with a trailing
    # slash, and with another root listed first
    os.symlink("0/0/0", tmp_path / "d" / "c" / "rel")
    cases = [
        (group.key, store._roots_blob),
        (str(tmp_path / "d" / "c" / "rel"), store._roots_blob),
        (str(tmp_path / "link"), store._roots_blob),
        (group.key, b"-1:" + os.fsencode(tmp_path) + b"/"),
        (group.key, b"-1:/nowhere\0" + store._roots_blob),
    ]
    for path, roots in cases:
        code, *_ = native.run_file(kernel, (path, flags, roots), group.offset, group.length, table, targets)
        assert code == 0 and np.array_equal(out, data[:8, :10, :12].astype("f4")), (path, roots)
        out[...] = 0
    # a root that is a prefix of the folder's name but not its parent
    code, *_ = native.run_file(kernel, (group.key, flags, b"-1:" + os.fsencode(str(tmp_path)[:-1])), group.offset, group.length, table, targets)
    assert code == -3


def test_a_rooted_reader_hands_native_code_its_roots(tmp_path):
    import os

    from damacy_server.store.file import FileReader

    uri, _ = _sharded(tmp_path)
    shard = str(tmp_path / "d" / "c" / "0" / "0" / "0")
    reader = FileReader(roots=[str(tmp_path), "/nowhere/"])
    path, flags, roots = reader.direct(shard)
    fd = reader._root_fds[0]
    assert fd >= 0 and reader._root_fds[1] == -1  # a root that does not exist has no descriptor
    assert path == shard and flags & os.O_NONBLOCK and roots == b"%d:%s\0-1:/nowhere" % (fd, os.fsencode(tmp_path))
    assert FileReader().direct(shard)[2] is None
    outside = FileReader(roots=[str(tmp_path / "elsewhere")])
    with pytest.raises(damacy.InvalidArgument):
        outside.read_range(shard, 0, 16)


def test_truncated_shard_read_directly_falls_back_and_is_reported(tmp_path):
    uri, data = _sharded(tmp_path)
    shard = tmp_path / "d" / "c" / "0" / "0" / "0"
    raw = shard.read_bytes()
    meta = damacy.open_array(uri)
    # cut the file inside the first inner chunk's bytes (the index stays readable at the end)
    plan = _plan([damacy.Sample(uri, BOXES[0])], (8, 10, 12))
    unit = plan.groups[0].units[0]
    index = raw[-(meta.layout.levels[0].index_range()[1]) :]
    shard.write_bytes(raw[: unit.offset + unit.nbytes // 2] + index)
    _, errors = _run_one(uri, BOXES[0])
    (_, err), = errors
    assert isinstance(err, damacy.DecodeError) and "truncated" in str(err), err


def test_direct_reads_of_whole_objects_and_empty_files(tmp_path):
    import os

    from damacy_server.cpu import optable

    data = random_data((8, 12), "uint16", 5)
    write_array(tmp_path / "w", data, chunks=(4, 6), compressors=[ZstdCodec(level=1)])
    uri = str(tmp_path / "w")
    meta = damacy.open_array(uri)
    plan = _plan([damacy.Sample(uri, ((0, 4), (0, 6)))], (4, 6))
    (group,) = plan.groups
    assert group.length == -1  # an unsharded chunk is read whole
    kernel = native.kernel_for(meta, np.dtype("f4"))
    out = np.zeros((4, 6), dtype="f4")
    targets = native.targets([out], 2)
    table = optable.build(group.units)
    flags = os.O_RDONLY | os.O_CLOEXEC
    code, failures, _, nbytes, _, elements = native.run_file(kernel, (group.key, flags, None), 0, -1, table, targets)
    assert code == 0 and failures == [] and nbytes == os.path.getsize(group.key) and elements == 24
    assert np.array_equal(out, data[:4, :6].astype("f4"))
    open(group.key, "wb").close()  # now empty: read, and reported as undecodable
    code, failures, _, nbytes, _, _ = native.run_file(kernel, (group.key, flags, None), 0, -1, table, targets)
    assert code == 0 and nbytes == 0 and [f.unit for f in failures] == [0] and failures[0].status is native.Status.SIZE


def test_every_direct_read_outcome_settles_its_memory_once(tmp_path, monkeypatch):
    # a job of direct reads that cannot be built (an unexpected error), reads out of the
    # page cache and reads made, mixed: every sample is exact or failed with the error, and
    # every read's memory comes back
    uri, data = _sharded(tmp_path)
    jobs = []

    def build(_):
        jobs.append(1)
        if len(jobs) % 3 == 0:
            raise RuntimeError("boom")

    direct = _Outcomes(monkeypatch, lambda r, sparse: -1 if r % 2 else None, build)
    executor = _executor(max_memory_bytes=64 << 20, decode_workers=2)
    pipe = damacy.Pipeline(
        planner=_planner(), executor=executor, output=damacy.BatchSpec(2, (8, 10, 12), "f32"), queues=_queues(2), on_error="fill"
    )
    errors, good = [], 0
    with pipe:
        pipe.push([damacy.Sample(uri, b) for b in BOXES * 4])
        for k, batch in enumerate(pipe.batches()):
            with batch:
                errors += [e for _, e in batch.info.errors]
                failed = dict(batch.info.errors)
                for j, b in enumerate((BOXES * 4)[2 * k : 2 * k + 2]):
                    if j not in failed:
                        good += 1
                        assert np.array_equal(batch.numpy()[j], data[tuple(slice(a, c) for a, c in b)].astype("f4"))
        assert executor.budget.used == executor.budget.slots  # nothing in flight is left behind
    assert errors and good and len(jobs) > 3 and len(direct.reads) > 1
    assert all("internal error: RuntimeError: boom" in str(e) for e in errors)


def _thin_sharded(tmp_path):
    """One shard of 2 x 2 x 2 units of 8 KiB: the units a plane cuts lie a unit apart in it
    (zarr-python writes a shard's chunks in Morton order), so each is a read of its own when
    nothing between reads is merged."""
    data = random_data((8, 64, 64), "uint16", 3)
    write_array(tmp_path / "t", data, chunks=(4, 32, 32), shards=(8, 64, 64), compressors=[ZstdCodec(level=1)])
    return str(tmp_path / "t"), data


PLANE = ((0, 1), (0, 64), (0, 64))


def test_a_sparse_direct_read_reads_the_units_and_not_the_holes(tmp_path):
    import os

    from damacy_server.cpu import optable

    uri, data = _thin_sharded(tmp_path)
    meta = damacy.open_array(uri)
    plan = _plan([damacy.Sample(uri, PLANE)], (1, 64, 64), max_gap_bytes=0)
    groups = plan.groups
    assert len(groups) == 4 and all(b.offset > a.offset + a.length for a, b in zip(groups, groups[1:]))  # holes
    units = [u for g in groups for u in g.units]
    start, length = groups[0].offset, groups[-1].offset + groups[-1].length - groups[0].offset
    kernel = native.kernel_for(meta, np.dtype("f4"))
    out = np.zeros((1, 64, 64), dtype="f4")
    targets = native.targets([out], 3)
    table = optable.build(units)
    where = (groups[0].key, os.O_RDONLY | os.O_CLOEXEC, None)
    code, failures, _, nbytes, encoded, elements = native.run_file(kernel, where, start, length, table, targets, None, True)
    # the bytes read are the units' (each run of adjacent ones a read), not the range's
    assert code == 0 and failures == [] and nbytes == encoded == sum(u.nbytes for u in units) < length
    assert elements == out.size and np.array_equal(out, data[:1].astype("f4"))
    out[...] = 0
    code, *_ = native.run_file(kernel, where, start, length - 1, table, targets, None, True)  # a unit past the range
    assert code == -1 and not out.any()


def _read_planes(uri, data, executor):
    pipe = damacy.Pipeline(
        planner=_planner(max_gap_bytes=0),
        executor=executor,
        output=damacy.BatchSpec(2, (1, 64, 64), "f32"),
        queues=_queues(2),
        on_error="raise",
    )
    with pipe:
        pipe.push([damacy.Sample(uri, ((z, z + 1), (0, 64), (0, 64))) for z in range(8)])
        for k, batch in enumerate(pipe.batches()):
            with batch:
                assert np.array_equal(batch.numpy(), data[2 * k : 2 * k + 2, None].astype("f4"))
        assert executor.budget.used == executor.budget.slots  # every read's memory returned
        return pipe.stats_dict()["stages"]


def test_reads_of_one_object_apart_are_decoded_in_one_direct_task(tmp_path):
    uri, data = _thin_sharded(tmp_path)
    executor = _executor(max_memory_bytes=64 << 20, decode_workers=2)
    stages = _read_planes(uri, data, executor)
    # 4 batches of 2 planes, each cutting the 4 units of its half of the shard, a read each
    assert stages["native"]["count"] == 16
    assert stages["direct"]["count"] == stages["read"]["count"] == 4


def test_reads_made_in_one_task_go_to_the_io_threads_one_by_one_when_not_cached(tmp_path, monkeypatch):
    uri, data = _thin_sharded(tmp_path)
    direct = _Outcomes(monkeypatch, lambda r, sparse: -1 if sparse else None)
    executor = _executor(max_memory_bytes=64 << 20, decode_workers=2)
    stages = _read_planes(uri, data, executor)
    assert direct.reads.count(True) == 4 and stages["direct"]["count"] == 0
    assert stages["read"]["count"] == 16 and stages["native"]["count"] == 16


def test_a_shard_cut_short_under_a_task_of_reads_fails_the_sample_and_returns_its_memory(tmp_path):
    # the shard index is cached from a first batch; then the file is cut inside the units a
    # second plane cuts: the task's reads come short, each read goes to the I/O threads, and
    # the sample fails naming the truncation
    uri, data = _thin_sharded(tmp_path)
    shard = tmp_path / "t" / "c" / "0" / "0" / "0"
    executor = _executor(max_memory_bytes=64 << 20, decode_workers=2)
    planner = _planner(max_gap_bytes=0)
    pipe = damacy.Pipeline(planner=planner, executor=executor, output=damacy.BatchSpec(1, (1, 64, 64), "f32"), queues=_queues(1), on_error="fill")
    with pipe:
        pipe.push([damacy.Sample(uri, PLANE)])
        with pipe.pop() as b:
            assert not b.info.errors and np.array_equal(b.numpy()[0], data[:1].astype("f4"))
        deep = pipe.planner.plan([damacy.Sample(uri, ((4, 5), (0, 64), (0, 64)))], (1, 64, 64)).groups
        assert len(deep) == 4
        with open(shard, "r+b") as f:
            f.truncate(deep[-1].offset + deep[-1].length // 2)
        pipe.push([damacy.Sample(uri, ((4, 5), (0, 64), (0, 64)))])
        with pipe.pop() as b:
            (_, err), = b.info.errors
        assert executor.budget.used == executor.budget.slots
        stages = pipe.stats_dict()["stages"]
    assert isinstance(err, damacy.DecodeError) and "truncated" in str(err), err
    assert stages["direct"]["count"] == 1 and stages["read"]["count"] == 1 + 4  # the task's reads, one by one


def test_corrupt_shard_index_values_are_decode_errors(tmp_path):
    import crc32c

    uri, _ = _sharded(tmp_path)
    shard = tmp_path / "d" / "c" / "0" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    n = 4  # inner chunks in the shard
    index = raw[-(16 * n + 4) :]
    entries = np.frombuffer(bytes(index[:-4]), dtype="<u8").copy()
    entries[1] = 2**63  # the size of inner chunk 0
    body = entries.tobytes()
    raw[-(16 * n + 4) :] = body + crc32c.crc32c(body).to_bytes(4, "little")
    shard.write_bytes(bytes(raw))
    _, errors = _run_one(uri, BOXES[0])
    (_, err), = errors
    assert isinstance(err, damacy.DecodeError) and "shard index" in str(err), err


def test_arrays_with_huge_chunk_grids(tmp_path):
    import zarr

    arr = zarr.create_array(store=str(tmp_path / "h"), shape=(2**40, 2**40), chunks=(4, 4), dtype="uint16", fill_value=7)
    arr[0:4, 0:4] = np.arange(16, dtype="uint16").reshape(4, 4)
    want = arr[0:2, 0:3]
    assert np.array_equal(damacy.read(str(tmp_path / "h"), ((0, 2), (0, 3))), want)
    got, errors = _run_one(str(tmp_path / "h"), ((0, 2), (0, 3)))
    assert not errors and np.array_equal(got, want.astype("f4"))


@pytest.mark.parametrize(
    "first", ["damacy_server.cuda.executor", "damacy_server.decode.chunks", "damacy_server.plan.planner", "damacy_server.store", "damacy", "damacy_server.daemon.service"]
)
def test_the_native_path_is_found_whichever_module_is_imported_first(first):
    """A circular import once made the file store take the extension for missing (and read
    without it) when the CUDA executor was imported first; an import error other than the
    extension's own absence now surfaces."""
    import subprocess
    import sys

    code = f"import {first}\nfrom damacy_server.store import file\nfrom damacy_server import native\nassert file._open_checked is not None and native.available()"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_cached_units_are_handed_to_native_code_by_address_only_when_they_fit():
    # a chunk cache entry is copied from by native code only when it is the unit's decoded
    # array: C order, the stored dtype, the unit's shape; otherwise the numpy path copies it
    kernel = native.NativeKernel(
        codec=native.CODEC_RAW, src=4, dst=10, swap=False, unit_shape=np.array([4, 6], dtype=np.int64),
        decoded_nbytes=48, stored=np.dtype("uint16"),
    )
    a, b = np.arange(24, dtype=np.uint16).reshape(4, 6), np.ones((4, 6), dtype=np.uint16)
    b.flags.writeable = False  # cache entries are read-only
    got = native.decoded_sources(kernel, [a, b])
    assert got.tolist() == [a.ctypes.data, b.ctypes.data]
    wide = np.zeros((4, 12), dtype=np.uint16)
    assert native.decoded_sources(kernel, [a, wide[:, ::2]]) is None  # not contiguous
    assert native.decoded_sources(kernel, [a, a.astype(np.int16)]) is None  # another dtype
    assert native.decoded_sources(kernel, [a.reshape(6, 4)]) is None  # another shape
    assert native.decoded_sources(kernel, [a, a.astype(">u2")]) is None  # another byte order
    assert native.decoded_sources(kernel, [b, a.reshape(2, 2, 6)]) is None  # another rank
    # the C side alone: per object its address, or 0 (not a buffer, not C order, other size)
    raw = np.frombuffer(native._assemble.addresses([a, wide[:, ::2], b"x" * 48, object(), a[:2]], 48), dtype=np.int64)
    assert raw[0] == a.ctypes.data and raw[1] == 0 and raw[2] != 0 and raw[3] == 0 and raw[4] == 0
    arrays, keep = native.keep_buffers(kernel, 3)
    assert keep.tolist() == [x.ctypes.data for x in arrays] and all(x.shape == (4, 6) for x in arrays)


def test_cached_units_are_copied_in_the_destinations_order_for_every_kind_of_sample(tmp_path, monkeypatch):
    """Units served from the chunk cache are copied in one native call: box copies in the
    destination's order (a strip of copies written row by row), flipped, transposed and
    index-list samples unit by unit. Every kind, normalised and padded ones too, equals what
    zarr-python reads, the same from the cache as when first decoded."""
    import zarr

    data = random_data((12, 40, 44), "uint16", 5)
    write_array(tmp_path / "a", data, chunks=(4, 8, 8), compressors=[ZstdCodec(level=1)], fill_value=7)
    uri = str(tmp_path / "a")
    z = zarr.open_array(uri, mode="r")
    norm = (100.0, 0.5)
    samples = [
        damacy.Sample(uri, np.s_[1:5, 3:19, 5:21]),
        damacy.Sample(uri, np.s_[0:4, 10:26, 20:36], flip=(1, 2)),
        damacy.Sample(uri, np.s_[6:10, 20:36, 1:17], transpose=(0, 2, 1)),
        damacy.Sample(uri, np.s_[5:9, 22:38, 26:42], normalize=norm),
        damacy.IndexQuery(uri, (np.array([11, 0, 5, 5]), slice(7, 23), slice(9, 25))),
        damacy.Sample(uri, np.s_[-1:3, 30:46, 35:51]),  # pads
    ]
    want = [
        z[1:5, 3:19, 5:21],
        np.flip(z[0:4, 10:26, 20:36], (1, 2)),
        np.transpose(z[6:10, 20:36, 1:17], (0, 2, 1)),
        (z[5:9, 22:38, 26:42].astype(np.float32) - np.float32(norm[0])) * np.float32(norm[1]),
        z.oindex[[11, 0, 5, 5], 7:23, 9:25],
        padded_selection(data, np.s_[-1:3, 30:46, 35:51], 7),
    ]
    calls = []
    real = native.run_decoded
    monkeypatch.setattr(native, "run_decoded", lambda *a: calls.append(len(a[1])) or real(*a))
    cfg = damacy.Config(
        samples_per_batch=len(samples), sample_shape=(4, 16, 16), dtype="f32", chunk_cache_bytes=8 << 20, prepared_batches=1, out_of_bounds="pad"
    )
    with damacy.Pipeline(cfg) as p:
        for rnd in range(2):  # the second round finds every unit in the cache
            p.push(samples)
            with p.pop() as batch:
                assert not batch.info.errors
                out = batch.copy()
            for got, w in zip(out, want):
                assert np.array_equal(got, np.asarray(w, dtype=np.float32)), rnd
        hits = p.stats_dict()["chunk_cache"]["hits"]
    assert sum(calls) > 0 and hits >= sum(calls)


def test_a_run_sends_the_reads_it_holds_before_it_waits_for_memory(tmp_path):
    # room in flight for two of a plane's four reads: the run must send the two it bundled
    # before it waits for room for the third, or it waits for memory only it holds
    import threading
    import time

    uri, data = _thin_sharded(tmp_path)
    plan = _plan([damacy.Sample(uri, PLANE)], (1, 64, 64), max_gap_bytes=0)
    assert len(plan.groups) == 4
    need = max(g.reserve_nbytes for g in plan.groups)
    executor = _executor(max_memory_bytes=2 * need, decode_workers=1)
    out = np.zeros((1, 64, 64), dtype="f4")
    done, gave_up, errors = threading.Event(), threading.Event(), {}
    deadline = time.monotonic() + 60  # a run that waits for memory only it holds gives up here

    def cancelled():
        if time.monotonic() > deadline:
            gave_up.set()
        return gave_up.is_set()

    def finished(errs):
        errors.update(errs)
        done.set()

    try:
        executor.execute(plan, [out], finished, cancelled)
        assert done.wait(120) and not gave_up.is_set() and not errors
        assert np.array_equal(out, data[:1].astype("f4"))
        stages = executor.stats.snapshot()
        assert stages["native"]["count"] == 4 and stages["direct"]["count"] >= 2
        assert executor.budget.used == 0
    finally:
        executor.close()


def test_a_prefix_of_a_chunk_with_a_window_past_zstds_default_limit_reads(tmp_path):
    """A box at the start of a chunk is decoded only as far as it needs, by streaming, which
    takes the frame's window: a valid frame declaring more than zstd's default limit (128
    MiB: a chunk that large compressed in one piece) reads as when decoded whole."""
    import zarr
    from zarr.codecs import ZstdCodec

    zstandard = pytest.importorskip("zstandard")
    n = 136 << 20
    uri = str(tmp_path / "w")
    zarr.create_array(uri, shape=(n,), chunks=(n,), dtype="u1", compressors=[ZstdCodec(level=1)], fill_value=0)
    data = np.zeros(n, dtype=np.uint8)
    data[:4096] = np.arange(4096) % 251
    (tmp_path / "w" / "c").mkdir()
    params = zstandard.ZstdCompressionParameters.from_level(1, window_log=28)  # one segment: its window, 136 MiB
    (tmp_path / "w" / "c" / "0").write_bytes(zstandard.ZstdCompressor(compression_params=params).compress(data.tobytes()))
    cfg = damacy.Config(
        samples_per_batch=1, sample_shape=(16,), dtype="u8", max_memory_bytes=1 << 30, chunk_cache_bytes=0, pop_timeout_s=60,
        max_chunk_uncompressed_bytes=n,  # the one chunk is the whole array
    )
    with damacy.Pipeline(cfg) as p:
        p.push([damacy.Sample(uri, ((1000, 1016),))])
        with p.pop() as b:
            assert b.info.errors == () and np.array_equal(b.numpy()[0], data[1000:1016])
