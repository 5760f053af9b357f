"""Zarr v2 arrays, written by zarr-python (``zarr_format=2``), read exactly.

Every compressor damacy reads (zstd, blosc with each cname and shuffle, gzip, zlib, lz4,
bz2, none) x dtypes with both byte orders x order C and F x both dimension separators, with
a chunk never written (the fill value); the filters (delta, fixedscaleoffset, astype); fill
values NaN/Infinity/null; the native path on v2 chunks; NGFF-style groups; and what is
refused, named.
"""

from __future__ import annotations

import json
import math

import numcodecs
import numpy as np
import pytest
import zarr

import damacy

SHAPE = (10, 13, 7)
CHUNKS = (4, 5, 3)
BOX = np.s_[1:10, 2:13, 0:7]

COMPRESSORS = {
    "none": None,
    "zstd": numcodecs.Zstd(level=3),
    "zstd-checksum": numcodecs.Zstd(level=1, checksum=True),
    "blosc-lz4-shuffle": numcodecs.Blosc(cname="lz4", shuffle=numcodecs.Blosc.SHUFFLE),
    "blosc-zstd-bitshuffle": numcodecs.Blosc(cname="zstd", shuffle=numcodecs.Blosc.BITSHUFFLE),
    "blosc-blosclz-noshuffle": numcodecs.Blosc(cname="blosclz", shuffle=numcodecs.Blosc.NOSHUFFLE),
    "blosc-zlib-auto": numcodecs.Blosc(cname="zlib", shuffle=numcodecs.Blosc.AUTOSHUFFLE),
    "blosc-lz4hc": numcodecs.Blosc(cname="lz4hc"),
    "gzip": numcodecs.GZip(level=5),
    "zlib": numcodecs.Zlib(level=3),
    "lz4": numcodecs.LZ4(),
    "bz2": numcodecs.BZ2(level=5),
}
DTYPES = ["<u2", ">u2", "<i4", ">f8", "<f4", "|u1", "|i1", "|b1", ">i8"]


def write(path, dtype, compressor=None, order="C", separator=".", filters=None, fill_value=3, shape=SHAPE, chunks=CHUNKS):
    arr = zarr.create_array(
        str(path), shape=shape, chunks=chunks, dtype=dtype, zarr_format=2, compressors=compressor, filters=filters,
        order=order, chunk_key_encoding={"name": "v2", "separator": separator}, fill_value=fill_value,
    )
    rng = np.random.default_rng(len(str(path)))
    data = rng.integers(0, 60, size=shape)
    data = (data > 30) if np.dtype(dtype).kind == "b" else data.astype(dtype)
    arr[: shape[0] - 1] = data[: shape[0] - 1]  # the last rows' chunks partly unwritten: fill
    return str(path)


#: (order, dimension separator): every one of them meets every compressor and every dtype
LAYOUTS = [(order, separator) for order in "CF" for separator in "./"]


@pytest.mark.parametrize("name", list(COMPRESSORS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_compressor_and_dtype_reads_as_zarr_python_does(tmp_path, name, dtype):
    # one layout per case, rotating: each compressor is read in all 4 (over the dtypes) and
    # each dtype in all 4 (over the compressors)
    order, separator = LAYOUTS[(DTYPES.index(dtype) + list(COMPRESSORS).index(name)) % len(LAYOUTS)]
    path = write(tmp_path / "a.zarr", dtype, COMPRESSORS[name], order, separator, fill_value=1 if dtype == "|b1" else 3)
    meta = json.loads((tmp_path / "a.zarr" / ".zarray").read_text())
    assert meta["order"] == order and meta.get("dimension_separator", ".") == separator
    got = damacy.read(path, BOX)
    want = zarr.open_array(path, mode="r")[BOX]
    assert got.dtype == want.dtype.newbyteorder("=") and np.array_equal(got, want), (order, separator)


@pytest.mark.parametrize(
    "filters,dtype",
    [
        ([numcodecs.Delta(dtype="<i4")], "<i4"),
        ([numcodecs.Delta(dtype="<i4", astype="<i2")], "<i4"),
        ([numcodecs.FixedScaleOffset(offset=10, scale=100, dtype="<f8", astype="<i4")], "<f8"),
        ([numcodecs.AsType(encode_dtype="<f4", decode_dtype="<f8")], "<f8"),
        ([numcodecs.Delta(dtype=">i4")], ">i4"),
        # what a filter stores in another byte order than the array's (a bare type: the
        # machine's, little), or wider than one-byte items
        ([numcodecs.FixedScaleOffset(offset=0, scale=10, dtype=">f8", astype="u2")], ">f8"),
        ([numcodecs.AsType(encode_dtype=">f4", decode_dtype="<f8")], "<f8"),
        ([numcodecs.Delta(dtype=">i4", astype="i4")], ">i4"),
        ([numcodecs.FixedScaleOffset(offset=0, scale=1, dtype="|u1", astype="<u2")], "|u1"),
        ([numcodecs.Delta(dtype="|i1", astype=">i2")], "|i1"),
    ],
)
@pytest.mark.parametrize("order", ["C", "F"])
def test_filters_read_as_zarr_python_does(tmp_path, filters, dtype, order):
    path = write(tmp_path / "f.zarr", dtype, numcodecs.Zstd(), order, "/", filters=filters, fill_value=0)
    assert np.array_equal(damacy.read(path, BOX), zarr.open_array(path, mode="r")[BOX])


@pytest.mark.parametrize("fill", [float("nan"), float("inf"), -float("inf"), None, -2.5])
def test_fill_values(tmp_path, fill):
    path = write(tmp_path / "n.zarr", "<f4", numcodecs.Zstd(), fill_value=fill)
    got, want = damacy.read(path, BOX), zarr.open_array(path, mode="r")[BOX]
    assert np.array_equal(got, want, equal_nan=True)
    if fill is not None and math.isnan(fill):
        assert np.isnan(got[-1]).all()  # the unwritten row


def test_the_native_path_reads_v2_chunks_in_a_pipeline(tmp_path):
    from damacy_server import native

    if not native.available():
        pytest.skip("the native extension is not built")
    path = write(tmp_path / "p.zarr", "<u2", numcodecs.Zstd(level=3), shape=(32, 32, 8), chunks=(8, 8, 8))
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(8, 12, 8), dtype="f32")
    with damacy.Pipeline(cfg, embedded=True) as pipe:
        pipe.push([damacy.Sample(path, ((0, 8), (0, 12), (0, 8))), damacy.Sample(path, ((20, 28), (3, 15), (0, 8)))])
        with pipe.pop() as batch:
            want = zarr.open_array(path, mode="r")
            assert np.array_equal(batch.numpy()[1], want[20:28, 3:15, 0:8].astype("f4"))
        assert pipe.stats_dict()["stages"]["native"]["count"] > 0  # decoded and copied in C


def test_attributes_and_groups(tmp_path):
    group = zarr.open_group(str(tmp_path / "g.zarr"), mode="w", zarr_format=2)
    group.attrs["note"] = "v2 group"
    arr = group.create_array("a", shape=(4, 4), chunks=(2, 2), dtype="<u2", compressors=numcodecs.Zstd())
    arr[:] = 7
    arr.attrs["unit"] = "mm"
    meta = damacy.open_array(str(tmp_path / "g.zarr" / "a"))
    assert meta.attributes == {"unit": "mm"} and meta.shape == (4, 4) and meta.chunks == (2, 2)
    assert (damacy.read(str(tmp_path / "g.zarr" / "a")) == 7).all()
    with pytest.raises(damacy.InvalidArgument, match="group, not an array"):
        damacy.read(str(tmp_path / "g.zarr"))


def test_an_ngff_04_image_resolves_to_its_first_level(tmp_path):
    group = zarr.open_group(str(tmp_path / "img.zarr"), mode="w", zarr_format=2)
    group.attrs["multiscales"] = [{"version": "0.4", "axes": [{"name": "y"}, {"name": "x"}], "datasets": [{"path": "0"}, {"path": "1"}]}]
    for level, n in (("0", 8), ("1", 4)):
        group.create_array(level, shape=(n, n), chunks=(4, 4), dtype="<u2")[:] = int(level) + 1
    assert (damacy.read(str(tmp_path / "img.zarr")) == 1).all()


@pytest.mark.parametrize(
    "edit,cls,words",
    [
        ({"compressor": {"id": "lzma"}}, damacy.UnsupportedOperation, "v2 compressor 'lzma' is not supported"),
        ({"filters": [{"id": "quantize", "digits": 2, "dtype": "<f8"}]}, damacy.UnsupportedOperation, "v2 filter 'quantize'"),
        ({"dtype": "<c8"}, damacy.DtypeMismatch, "complex64"),
        ({"dtype": [["a", "<i4"]]}, damacy.DtypeMismatch, "structured"),
        ({"order": "K"}, damacy.MetadataError, "order must be 'C' or 'F'"),
        ({"dimension_separator": "-"}, damacy.MetadataError, "dimension_separator"),
        ({"zarr_format": 3}, damacy.MetadataError, "zarr_format must be 2"),
        ({"storage": "x"}, damacy.UnsupportedOperation, "not understood"),
    ],
)
def test_what_is_refused_is_named(tmp_path, edit, cls, words):
    path = write(tmp_path / "r.zarr", "<f8", numcodecs.Zstd())
    zarray = tmp_path / "r.zarr" / ".zarray"
    meta = json.loads(zarray.read_text())
    meta.update(edit)
    zarray.write_text(json.dumps(meta))
    with pytest.raises(cls, match=words) as info:
        damacy.read(path, BOX)
    assert path in str(info.value)


@pytest.mark.parametrize(
    "compressor",
    [None, {"id": "zstd", "level": 3}, {"id": "blosc", "cname": "lz4", "clevel": 5, "shuffle": 2}, {"id": "zlib", "level": 4}, {"id": "gzip", "level": 4}, {"id": "bz2", "level": 5}],
)
@pytest.mark.parametrize("dtype", ["<u2", ">f4", "|u1"])
def test_arrays_tensorstore_writes_read_exactly(tmp_path, compressor, dtype):
    """Written by tensorstore's zarr (v2) driver, another implementation than zarr-python."""
    ts = pytest.importorskip("tensorstore")
    path = str(tmp_path / "t.zarr")
    metadata = {"shape": list(SHAPE), "chunks": list(CHUNKS), "dtype": dtype, "compressor": compressor, "order": "F", "fill_value": 2}
    arr = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": path}, "metadata": metadata}, create=True).result()
    data = (np.arange(np.prod(SHAPE)).reshape(SHAPE) % 200).astype(dtype)
    arr[: SHAPE[0] - 1].write(data[: SHAPE[0] - 1]).result()
    want = arr[BOX].read().result()
    got = damacy.read(path, BOX)
    assert np.array_equal(got, want) and (got[-1] == 2).all()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_numcodecs_codecs_in_zarr_v3_arrays(tmp_path):
    """zarr-python names numcodecs' codecs ``numcodecs.*`` in v3 arrays: the same codecs."""
    nz = pytest.importorskip("zarr.codecs.numcodecs")
    path = str(tmp_path / "v3.zarr")
    arr = zarr.create_array(
        path, shape=(9, 11), chunks=(4, 4), dtype="int32", filters=[nz.Delta(dtype="<i4")], compressors=[nz.Zlib(level=3)], fill_value=5,
    )
    arr[:8] = np.arange(88).reshape(8, 11)
    assert np.array_equal(damacy.read(path, np.s_[0:9, 0:11]), zarr.open_array(path, mode="r")[:])


def test_a_numcodecs_filter_before_a_big_endian_bytes_codec_reads_what_was_written(tmp_path):
    """zarr-python 3.1 writes this chunk right (the delta-encoded values, big-endian) and
    reads it wrong; damacy reads the values written, as the stored bytes say."""
    nz = pytest.importorskip("zarr.codecs.numcodecs")
    from zarr.codecs import BytesCodec

    path = str(tmp_path / "big.zarr")
    arr = zarr.create_array(path, shape=(6,), chunks=(6,), dtype="uint16", filters=[nz.Delta(dtype="uint16")],
                            serializer=BytesCodec(endian="big"), compressors=[])
    written = np.array([1, 2, 3, 10, 20, 30], dtype="u2")
    arr[...] = written
    stored = np.frombuffer((tmp_path / "big.zarr" / "c" / "0").read_bytes(), ">u2")
    assert stored.tolist() == [1, 1, 1, 7, 10, 10]  # the deltas, big-endian: written right
    assert damacy.read(path).tolist() == written.tolist()
