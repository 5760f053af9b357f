"""damacy.read against zarr-python on arrays zarr-python wrote: every codec, dtype and layout."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import zarr
from zarr.codecs import (
    BloscCodec,
    BytesCodec,
    Crc32cCodec,
    GzipCodec,
    ShardingCodec,
    TransposeCodec,
    ZstdCodec,
)

import damacy

from conftest import DTYPES, assert_same, random_data, write_array

SHAPE = (13, 17, 9)
CHUNKS = (4, 6, 5)
BOXES = [
    np.s_[:, :, :],
    np.s_[0:1, 0:1, 0:1],
    np.s_[3:11, 5:17, 2:9],
    np.s_[12:13, 16:17, 8:9],
    np.s_[4:8, 6:12, 5:9],  # exactly one chunk
]

LE = BytesCodec(endian="little")
BE = BytesCodec(endian="big")

# name -> (filters, serializer, compressors)
CHAINS = {
    "bytes-little": ((), LE, ()),
    "bytes-big": ((), BE, ()),
    "transpose": ((TransposeCodec(order=(2, 0, 1)),), LE, ()),
    "transpose-big-zstd": ((TransposeCodec(order=(1, 2, 0)),), BE, (ZstdCodec(level=1),)),
    "zstd": ((), LE, (ZstdCodec(level=3, checksum=False),)),
    "zstd-checksum": ((), LE, (ZstdCodec(level=3, checksum=True),)),
    "gzip": ((), LE, (GzipCodec(level=5),)),
    "crc32c": ((), LE, (Crc32cCodec(),)),
    "zstd-crc32c": ((), BE, (ZstdCodec(level=1), Crc32cCodec())),
    "blosc-typesize-absent": ((), LE, (BloscCodec(cname="lz4", shuffle="shuffle"),)),
}
for cname, shuffle in itertools.product(["zstd", "lz4", "lz4hc", "blosclz", "zlib"], ["noshuffle", "shuffle", "bitshuffle"]):
    CHAINS[f"blosc-{cname}-{shuffle}"] = ((), LE, (BloscCodec(cname=cname, shuffle=shuffle, typesize=4),))


def check_boxes(uri, oracle, boxes=BOXES):
    for box in boxes:
        assert_same(damacy.read(uri, box), oracle[box])


def _chain_cases() -> list[tuple[str, str]]:
    """Every chain with every dtype, but blosc's grid of cname x shuffle: each of those with one
    dtype of each item size (1, 2, 4, 8 bytes: what shuffling depends on), which dtype of a
    size rotating with the chain, so that every dtype meets every shuffle."""
    by_size: dict[int, list[str]] = {}
    for d in DTYPES:
        by_size.setdefault(np.dtype(d).itemsize, []).append(d)
    cases = []
    for k, chain in enumerate(sorted(CHAINS)):
        if chain.startswith("blosc-") and chain != "blosc-typesize-absent":
            cases += [(chain, same_size[k % len(same_size)]) for same_size in by_size.values()]
        else:
            cases += [(chain, d) for d in DTYPES]
    return cases


@pytest.mark.parametrize("chain,dtype", _chain_cases())
def test_codec_chain(tmp_path, chain, dtype):
    filters, serializer, compressors = CHAINS[chain]
    if chain.startswith("blosc-"):
        # blosc's typesize in the metadata must match the data for zarr-python to write it
        codec = compressors[0]
        if codec.typesize is not None:
            compressors = (BloscCodec(cname=codec.cname.value, shuffle=codec.shuffle.value, typesize=np.dtype(dtype).itemsize),)
    data = random_data(SHAPE, dtype, seed=len(chain))
    oracle = write_array(tmp_path / "a", data, chunks=CHUNKS, filters=filters, serializer=serializer, compressors=compressors)
    check_boxes(str(tmp_path / "a"), oracle)
    assert_same(damacy.read(tmp_path / "a"), data)


SHARD_CASES = {
    # name -> (shards, inner chunks, inner codecs, index codecs)
    "plain": ((8, 12, 10), (4, 6, 5), [LE], [LE, Crc32cCodec()]),
    "zstd-inner": ((8, 12, 10), (4, 6, 5), [LE, ZstdCodec(level=3)], [LE, Crc32cCodec()]),
    "big-endian-gzip": ((8, 12, 10), (2, 3, 5), [BE, GzipCodec(level=1)], [LE, Crc32cCodec()]),
    "index-without-crc": ((8, 12, 10), (4, 6, 5), [LE, ZstdCodec(level=1)], [LE]),
    "big-endian-index": ((8, 12, 10), (4, 6, 5), [LE], [BE, Crc32cCodec()]),
    "transpose-inner": ((8, 12, 10), (4, 6, 5), [TransposeCodec(order=(2, 1, 0)), LE, ZstdCodec(level=1)], [LE, Crc32cCodec()]),
    "blosc-inner": ((8, 12, 10), (4, 6, 5), [LE, BloscCodec(cname="zstd", shuffle="bitshuffle", typesize=2)], [LE, Crc32cCodec()]),
}


@pytest.mark.parametrize("location", ["start", "end"])
@pytest.mark.parametrize("case", sorted(SHARD_CASES))
@pytest.mark.parametrize("dtype", ["uint16", "float32", "int8", "bool", "float64"])
def test_sharded(tmp_path, case, location, dtype):
    shards, inner, codecs, index_codecs = SHARD_CASES[case]
    serializer = ShardingCodec(chunk_shape=inner, codecs=codecs, index_codecs=index_codecs, index_location=location)
    data = random_data(SHAPE, dtype, seed=3)
    oracle = write_array(tmp_path / "s", data, chunks=shards, serializer=serializer)
    check_boxes(str(tmp_path / "s"), oracle)


@pytest.mark.parametrize("outer_location,inner_location", [("end", "end"), ("start", "end"), ("end", "start"), ("start", "start")])
def test_nested_sharding(tmp_path, outer_location, inner_location):
    inner_shard = ShardingCodec(
        chunk_shape=(2, 3, 5),
        codecs=[LE, ZstdCodec(level=1)],
        index_codecs=[LE, Crc32cCodec()],
        index_location=inner_location,
    )
    outer = ShardingCodec(
        chunk_shape=(4, 6, 5), codecs=[inner_shard], index_codecs=[LE, Crc32cCodec()], index_location=outer_location
    )
    data = random_data(SHAPE, "uint16", seed=4)
    oracle = write_array(tmp_path / "n", data, chunks=(8, 12, 10), serializer=outer)
    meta = damacy.open_array(tmp_path / "n")
    assert meta.layout.unit_shape == (2, 3, 5) and len(meta.layout.levels) == 2
    check_boxes(str(tmp_path / "n"), oracle)


def test_sharding_wrapped_by_compressor_reads_whole_shards(tmp_path):
    # a bytes->bytes codec after sharding: the shard is one compressed blob, decoded whole
    serializer = ShardingCodec(chunk_shape=(4, 6, 5), codecs=[LE], index_codecs=[LE, Crc32cCodec()])
    data = random_data(SHAPE, "int32", seed=5)
    oracle = write_array(tmp_path / "w", data, chunks=(8, 12, 10), serializer=serializer, compressors=[ZstdCodec(level=1)])
    meta = damacy.open_array(tmp_path / "w")
    assert meta.layout.levels == () and meta.layout.unit_shape == (8, 12, 10)
    check_boxes(str(tmp_path / "w"), oracle)


@pytest.mark.parametrize(
    "encoding,expected_file",
    [
        ({"name": "default", "separator": "/"}, "c/1/0/0"),
        ({"name": "default", "separator": "."}, "c.1.0.0"),
        ({"name": "v2", "separator": "."}, "1.0.0"),
        ({"name": "v2", "separator": "/"}, "1/0/0"),
    ],
)
@pytest.mark.parametrize("sharded", [False, True])
def test_chunk_key_encodings(tmp_path, encoding, expected_file, sharded):
    data = random_data(SHAPE, "float32", seed=6)
    if sharded:
        serializer = ShardingCodec(chunk_shape=(2, 6, 5), codecs=[LE, ZstdCodec(level=1)])
        oracle = write_array(tmp_path / "k", data, chunks=CHUNKS, serializer=serializer, chunk_key_encoding=encoding)
    else:
        oracle = write_array(tmp_path / "k", data, chunks=CHUNKS, compressors=[GzipCodec()], chunk_key_encoding=encoding)
    # the chunk files really are named this way (so the read below is not all fill value)
    assert (tmp_path / "k" / expected_file).is_file()
    check_boxes(str(tmp_path / "k"), oracle)
    assert not np.array_equal(damacy.read(tmp_path / "k", np.s_[4:8]), np.zeros((4, 17, 9), "f4"))


def test_missing_chunks_and_inner_chunks_read_as_fill(tmp_path):
    data = np.full(SHAPE, 5, dtype="int16")
    oracle = write_array(tmp_path / "m", data, chunks=CHUNKS, fill_value=-3, write=False)
    oracle[0:4, 0:6, 0:5] = 1  # one chunk written, the rest missing
    check_boxes(str(tmp_path / "m"), oracle)
    assert (damacy.read(tmp_path / "m", np.s_[5:, 7:, :]) == -3).all()

    serializer = ShardingCodec(chunk_shape=(2, 3, 5), codecs=[LE, ZstdCodec(level=1)])
    sharded = write_array(tmp_path / "ms", data, chunks=(8, 12, 10), serializer=serializer, fill_value=-3, write=False)
    sharded[1:3, 4:5, 0:3] = 9  # a few inner chunks of one shard; other shards missing
    check_boxes(str(tmp_path / "ms"), sharded)


def test_zero_dimensional_and_empty_arrays(tmp_path):
    scalar = write_array(tmp_path / "z", np.array(42.5, dtype="f8"), chunks=())
    assert_same(damacy.read(tmp_path / "z"), scalar[()])
    assert damacy.read(tmp_path / "z").shape == ()

    empty = write_array(tmp_path / "e", np.zeros((0, 5), dtype="u1"), chunks=(2, 2))
    assert_same(damacy.read(tmp_path / "e"), empty[:])
    assert damacy.read(tmp_path / "e", np.s_[0:0, 1:3]).shape == (0, 2)


def test_index_selection_matches_oindex(tmp_path):
    data = random_data(SHAPE, "uint16", seed=7)
    serializer = ShardingCodec(chunk_shape=(2, 3, 5), codecs=[LE, ZstdCodec(level=1)])
    oracle = write_array(tmp_path / "i", data, chunks=(8, 12, 10), serializer=serializer)
    uri = str(tmp_path / "i")
    sel = ([12, 0, 5, 5, 12], slice(3, 15), [8, 0, 1, 1])
    assert_same(damacy.read(uri, sel), oracle.oindex[[12, 0, 5, 5, 12], 3:15, [8, 0, 1, 1]])
    # -1 is before the array (not the last element): refused, or the fill value when padded
    with pytest.raises(damacy.OutOfBounds, match="index -1 is outside the array"):
        damacy.read(uri, ([0, -1], slice(3, 15)))
    padded = damacy.read(uri, ([0, -1], slice(3, 15)), out_of_bounds="pad")
    assert_same(padded[0], data[0, 3:15])
    assert_same(padded[1], np.full_like(data[0, 3:15], oracle.fill_value))
    assert_same(damacy.read(uri, (slice(None), [16, 2, 2, 9], slice(1, 9, 3))), data[:, [16, 2, 2, 9], 1:9:3])
    assert_same(damacy.read(uri, (3, ..., 4)), data[3, :, 4])
    assert_same(damacy.read(uri, ((2, 5), (0, 17), (8, 9))), data[2:5, :, 8:9])
    mask = np.zeros(SHAPE[1], dtype=bool)
    mask[[1, 4, 16]] = True
    assert_same(damacy.read(uri, (slice(None), mask)), data[:, mask])


@pytest.mark.parametrize("out", ["f32", "bf16", "f16", "f64", "u8", "u16", "i16", "i32", "native"])
def test_output_dtype_cast(tmp_path, out):
    import ml_dtypes

    data = (np.arange(np.prod(SHAPE)) % 300).astype("uint16").reshape(SHAPE)
    write_array(tmp_path / "c", data, chunks=CHUNKS, compressors=[ZstdCodec()])
    got = damacy.read(tmp_path / "c", np.s_[1:12, 2:15, 0:9], dtype=out)
    want = data[1:12, 2:15, 0:9]
    expected_dtype = {"native": np.dtype("u2"), "bf16": np.dtype(ml_dtypes.bfloat16)}.get(out) or np.dtype(damacy_protocol_dtype(out))
    if expected_dtype.kind in "iu":  # integers clamp to the output's range (u8: 256..299 read as 255)
        want = np.clip(want, 0, np.iinfo(expected_dtype).max)
    want = want.astype(expected_dtype)
    assert got.dtype == want.dtype
    assert np.array_equal(got.astype("f8"), want.astype("f8"))


def damacy_protocol_dtype(name):
    from damacy_protocol.dtypes import numpy_dtype

    return numpy_dtype(name)


def test_a_gzip_chunk_padded_with_zero_bytes_reads_as_zarr_reads_it(tmp_path):
    # gzip readers (gzip(1), Python's, zarr-python's) take zero bytes after the last member
    # as padding; a byte that is not zero is still a corrupt chunk
    oracle = write_array(tmp_path / "a", np.arange(16, dtype="u1").reshape(4, 4), chunks=(4, 4), compressors=[GzipCodec()])
    chunk = tmp_path / "a" / "c" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes() + b"\0" * 8)
    np.testing.assert_array_equal(damacy.read(tmp_path / "a"), zarr.open_array(str(tmp_path / "a"), mode="r")[...])
    np.testing.assert_array_equal(damacy.read(tmp_path / "a"), oracle[...])
    chunk.write_bytes(chunk.read_bytes() + b"\1")
    with pytest.raises(damacy.DecodeError, match="gzip"):
        damacy.read(tmp_path / "a", metadata=damacy.ZarrMetadata(reader=damacy.FileMetadataReader(), cache=damacy.MetadataCache()))  # caches of its own


@pytest.mark.parametrize("compressors", [[], ["gzip"]])
def test_a_0d_array_converts_as_every_array_does(tmp_path, compressors):
    """A 0-d array's element is cast as an array's are (integers clamped to the output's
    range), on the native path and through the Python decoders alike."""
    from zarr.codecs import GzipCodec

    arr = zarr.create_array(str(tmp_path / "z"), shape=(), dtype="u2", compressors=[GzipCodec()] if compressors else [], fill_value=0)
    arr[...] = 300
    assert int(damacy.read(str(tmp_path / "z"), dtype="i8")) == 127  # int8's maximum (numpy's astype wraps to 44)
    assert int(damacy.read(str(tmp_path / "z"), dtype="u8")) == 255


# -- the conversion rules, every source dtype into every output dtype, on every path -----
#
# The expected values are computed here from the rules themselves, in exact arithmetic
# (Python integers and Fractions), not by damacy's numpy reference: integers clamp to the
# output's range; floats truncate toward zero and clamp (NaN 0, +-inf the bounds); to f32
# rounded to nearest, ties to even; to bf16 through f32 (two roundings) from integers, f16
# and f32, once from f64. Each path is held to them: the numpy reference
# (contract.convert), the CPU executor's numpy path (optable.copy_rows), the native loop
# through damacy.read on arrays zarr-python wrote (either byte order), the CUDA kernels'
# host twin, and the fill value of a chunk that was never written (damacy.read, cast_fill,
# the twin's fill kernel).

CONVERSION_SOURCES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64"]
CONVERSION_OUTPUTS = ["u8", "u16", "u32", "u64", "i8", "i16", "i32", "i64", "f32", "bf16"]
_INT_BOUNDS = [(-(2**b), 2**b - 1) for b in (7, 15, 31, 63)] + [(0, 2**b - 1) for b in (8, 16, 32, 64)]


def _out_dtype(out: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if out == "bf16" else np.dtype(damacy_protocol_dtype(out))


def _round_binary(x, precision: int, emin: int, emax: int) -> float:
    """The exact rational ``x`` rounded to the binary format of ``precision`` significand
    bits (subnormals below 2**emin), ties to even, past the largest finite value to inf."""
    from fractions import Fraction

    x = Fraction(x)
    if x == 0:
        return 0.0
    a = abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()  # 2**e <= a < 2**(e + 1)
    if Fraction(2) ** e > a:
        e -= 1
    ulp = Fraction(2) ** (max(e, emin) - precision + 1)
    k, rem = divmod(a / ulp, 1)
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and k % 2 == 1):
        k += 1
    r = k * ulp
    if r > (2 - Fraction(2) ** (1 - precision)) * Fraction(2) ** emax:
        return float("inf") if x > 0 else float("-inf")
    return float(r) if x > 0 else -float(r)


def _to_f32(x) -> float:
    return _round_binary(x, 24, -126, 127)


def _to_bf16(x) -> float:
    return _round_binary(x, 8, -126, 127)


def _expected(value, src: np.dtype, out: str):
    """What the rules say ``value`` (a Python int or float, of ``src``) becomes in ``out``:
    an int for integer outputs, a float (NaN, signed zero and inf kept) for f32 and bf16."""
    import math
    from fractions import Fraction

    dst = _out_dtype(out)
    if dst.kind in "iu":
        lo, hi = int(np.iinfo(dst).min), int(np.iinfo(dst).max)
        if isinstance(value, float):
            if math.isnan(value):
                return 0
            if math.isinf(value):
                return hi if value > 0 else lo
            value = math.trunc(value)  # exact: a float's integer part
        return min(max(value, lo), hi)
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return value
    sign = -1.0 if (isinstance(value, float) and math.copysign(1.0, value) < 0) else 1.0
    exact = Fraction(value)
    if out == "f32":
        r = _to_f32(exact)
    elif src == np.float64:
        r = _to_bf16(exact)  # f64 (damacy's own source type): rounded once
    else:
        r = _to_bf16(Fraction(_to_f32(exact)))  # through f32: two roundings
    return math.copysign(r, sign) if r == 0 else r


def _conversion_values(src: np.dtype) -> np.ndarray:
    """Edge values of ``src``: its bounds, -1, 0, each output's bounds and the values just
    outside them, NaN and infinities, ties and near-ties of rounding to f32 and bf16."""
    from damacy_server.decode.contract import edge_values

    if src.kind in "iu":
        info = np.iinfo(src)
        vals = {int(info.min), int(info.max), int(info.min) + 1, int(info.max) - 1, -1, 0, 1, 2, 12, 256, -300}
        for lo, hi in _INT_BOUNDS:
            vals.update({lo - 1, lo, lo + 1, hi - 1, hi, hi + 1})
        # ties to even: f32 (2**24 + 1 and + 3), bf16 (257, 259, 2**24 + 2**17 * 3), and values
        # where f32's rounding makes a bf16 tie of a value above it (two roundings differ
        # from one: 2**24 + 2**16 + 1 reads as 2**24, rounded once it would be 2**24 + 2**17)
        for v in (2**24 + 1, 2**24 + 3, 257, 259, 2**24 + 3 * 2**16, 2**24 + 2**16 + 1, 2**24 + 2**16 - 1,
                  2**31 - 2**22 - 1, 2**31 - 2**22 + 1, 2**40 + 2**32 + 1, 2**62 + 2**54 + 1, 112984063, 2**63 + 2**55 + 1):
            vals.update({v, -v})
        vals = sorted(v for v in vals if info.min <= v <= info.max)
        return np.concatenate([np.array(vals, dtype=src), edge_values(src)])
    f = np.finfo(src)
    vals = [0.0, -0.0, 1.0, -1.0, -1.9, 12.9, -0.5, 0.99, -0.99, 0.5, 1.5, 2.5, -2.5, 127.5, 127.9, 128.0, -128.9, -129.0,
            255.9, 256.0, 256.5, 32767.9, 32768.0, -32768.9, -32769.0, 65535.9, 65536.0, 65504.0, 2.0**31, -(2.0**31) - 1,
            2.0**31 - 1, 2.0**32, 2.0**32 - 1, 2.0**63, -(2.0**63), 2.0**64, 1e30, -1e30, float(f.max), float(f.min),
            float(f.tiny), float(f.smallest_subnormal), -float(f.smallest_subnormal),
            1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 1 + 2.0**-8 + 2.0**-30, 1 + 2.0**-24, 1 + 3 * 2.0**-24,
            1 + 2.0**-24 + 2.0**-50, 3.3961775e38, 3.4028235677973366e38, float("nan"), float("inf"), float("-inf")]
    with np.errstate(over="ignore"):
        return np.concatenate([np.array(vals, dtype=np.float64).astype(src), edge_values(src)])


def _check_expected(got: np.ndarray, values: np.ndarray, src: np.dtype, out: str, what: str) -> None:
    import math

    assert got.dtype == _out_dtype(out) and got.shape == values.shape, (what, got.dtype, got.shape)
    bad = []
    with np.errstate(invalid="ignore"):
        got_values = got.tolist() if got.dtype.kind in "iu" else got.astype(np.float64).tolist()
    for v, g in zip(values.tolist(), got_values):
        want = _expected(v, src, out)
        if isinstance(want, int):
            ok = g == want
        elif math.isnan(want):
            ok = math.isnan(g)
        else:
            ok = g == want and math.copysign(1.0, g) == math.copysign(1.0, want)
        if not ok:
            bad.append((v, g, want))
    assert not bad, (what, src.name, out, bad[:8])


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def test_the_documented_conversion_examples():
    from damacy_server.decode import contract

    assert contract.convert(np.array([-1, 12, 256], dtype="int16"), np.uint8).tolist() == [0, 12, 255]
    assert contract.convert(np.array([-1.9, 12.9, np.nan, np.inf], dtype="float32"), np.int16).tolist() == [-1, 12, 0, 32767]
    assert [_expected(v, np.dtype("int16"), "u8") for v in (-1, 12, 256)] == [0, 12, 255]
    assert [_expected(v, np.dtype("float32"), "i16") for v in (-1.9, 12.9, float("nan"), float("inf"))] == [-1, 12, 0, 32767]
    # integer to bf16 rounds twice, through f32; f64 to bf16 once
    assert _expected(2**24 + 2**16 + 1, np.dtype("int32"), "bf16") == 2.0**24
    assert _expected(2**24 + 2**16 + 1.0, np.dtype("float64"), "bf16") == 2.0**24 + 2**17


@pytest.mark.parametrize("order", ["<", ">"])
@pytest.mark.parametrize("source", CONVERSION_SOURCES)
def test_every_source_dtype_converts_to_every_output_dtype_by_the_rules_on_every_path(tmp_path, source, order):
    from damacy_server import native
    from damacy_server import read as read_module
    from damacy_server.cpu import optable
    from damacy_server.cuda import twin
    from damacy_server.decode import contract

    src = np.dtype(source)
    values = _conversion_values(src)
    stored = values.astype(src.newbyteorder(order))
    uri = str(tmp_path / "a")
    write_array(uri, stored, chunks=(16,), serializer=BytesCodec(endian="little" if order == "<" else "big"))
    stats = read_module._default_executor().stats
    for out in CONVERSION_OUTPUTS:
        dst = _out_dtype(out)
        reference = contract.convert(stored, dst)
        _check_expected(reference, values, src, out, "numpy reference")
        # the CPU executor's numpy path: one copy row over the whole array
        target = np.zeros(values.shape, dtype=dst)
        rows = np.array([[0, 0, 0, 0, len(values)]], dtype=np.int64)
        with np.errstate(invalid="ignore", over="ignore"):
            optable.copy_rows(rows, 1, np.zeros(0, dtype=np.int64), [target], stored)
        assert _same_bits(target, reference), ("numpy path", source, out)
        # the native loop (where it offers the pair; else the numpy path) through damacy.read
        offered = native.available() and native._assemble.supports(native.dtype_code(src), native.dtype_code(dst))
        before = stats.snapshot()["native"]["count"]
        got = damacy.read(uri, dtype=out)
        assert (stats.snapshot()["native"]["count"] > before) == offered, (source, out, offered)
        _check_expected(got, values, src, out, "damacy.read")
        assert _same_bits(got, reference), ("damacy.read", source, out)
        # the CUDA kernels' host twin
        if twin.available():
            assert _same_bits(twin.convert(stored, dst), reference), ("twin", source, out)


@pytest.mark.parametrize("source", CONVERSION_SOURCES)
def test_a_missing_chunks_fill_value_converts_by_the_same_rules(tmp_path, source):
    from damacy_server.cuda import twin
    from damacy_server.decode.chunks import cast_fill

    src = np.dtype(source)
    if src.kind in "iu":
        info = np.iinfo(src)
        fills = [int(info.min), int(info.max), -1, 300, 2**24 + 2**16 + 1, 0]
    else:
        fills = [-1.9, 12.9, float("nan"), float("inf"), float("-inf"), 1 + 2.0**-8, 70000.5, -0.0]
    fills = [v for v in fills if src.kind not in "iu" or np.iinfo(src).min <= v <= np.iinfo(src).max]
    for k, fill in enumerate(fills):
        uri = str(tmp_path / f"f{k}")
        with np.errstate(over="ignore"):
            value = np.array(fill, dtype=np.float64).astype(src) if src.kind == "f" else np.array(fill, dtype=src)
        arr = zarr.create_array(uri, shape=(8,), chunks=(4,), dtype=src, fill_value=value.item())
        arr[0:4] = value  # equal to the fill value: zarr-python writes no chunk; 4:8 was never written
        for out in CONVERSION_OUTPUTS:
            dst = _out_dtype(out)
            got = damacy.read(uri, dtype=out)
            values = np.full(8, value, dtype=src)
            _check_expected(got, values, src, out, f"fill {fill!r}")
            cast = cast_fill(value, dst)
            assert _same_bits(np.full(8, cast, dtype=dst), got), ("cast_fill", source, out, fill)
            if twin.available():
                filled = np.zeros(8, dtype=dst)
                twin.fill([0], value.reshape(1), [filled])
                assert _same_bits(filled, got), ("twin fill", source, out, fill)
