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
    expected_dtype = {"native": np.dtype("u2"), "bf16": np.dtype(ml_dtypes.bfloat16)}.get(out)
    want = want.astype(expected_dtype or np.dtype(damacy_protocol_dtype(out)))
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
        damacy.read(tmp_path / "a", metadata=damacy.ZarrMetadata())


@pytest.mark.parametrize("compressors", [[], ["gzip"]])
def test_a_0d_array_converts_as_every_array_does(tmp_path, compressors):
    """A 0-d array's element is cast as an array's are (numpy's wrap for integers), on the
    native path and through the Python decoders alike."""
    from zarr.codecs import GzipCodec

    arr = zarr.create_array(str(tmp_path / "z"), shape=(), dtype="u2", compressors=[GzipCodec()] if compressors else [], fill_value=0)
    arr[...] = 300
    assert int(damacy.read(str(tmp_path / "z"), dtype="i8")) == 44 == np.array(300, "u2").astype("i1")
