"""Metadata forms zarr-python does not write itself but the spec and real writers use."""

from __future__ import annotations

import math

import numpy as np
import pytest
from zarr.codecs import BytesCodec, TransposeCodec, ZstdCodec

import damacy
from damacy_server.zarr.dtypes import parse_fill_value

from conftest import edit_metadata, random_data, write_array


@pytest.mark.parametrize(
    "dtype,fill,expected",
    [
        ("float32", "NaN", math.nan),
        ("float64", "Infinity", math.inf),
        ("float16", "-Infinity", -math.inf),
        ("float32", "0x7fc00000", math.nan),
        ("float32", "0x3f800000", 1.0),
        ("float64", "0x4000000000000000", 2.0),
        ("float16", "0x3c00", 1.0),
        ("float64", 1.5, 1.5),
        ("float32", 3, 3.0),
        ("int16", -7, -7),
        ("uint64", 2**64 - 1, 2**64 - 1),
        ("int64", -(2**63), -(2**63)),
        ("bool", True, True),
        ("bool", 0, False),  # what older writers produced for false
    ],
)
def test_fill_values_read_for_missing_chunks(tmp_path, dtype, fill, expected):
    write_array(tmp_path / "f", np.zeros((6, 5), dtype), chunks=(4, 4), write=False)
    edit_metadata(tmp_path / "f", fill_value=fill)
    got = damacy.read(tmp_path / "f")
    assert got.dtype == np.dtype(dtype) and got.shape == (6, 5)
    if isinstance(expected, float) and math.isnan(expected):
        assert np.isnan(got).all()
    else:
        assert (got == np.array(expected, dtype=dtype)).all()


def test_hex_fill_keeps_the_exact_bit_pattern():
    v = parse_fill_value("0x7fc00001", np.dtype("float32"), "u")
    assert np.array(v, dtype="<f4").tobytes() == bytes.fromhex("0100c07f")


@pytest.mark.parametrize("order", ["F", "C"])
def test_legacy_transpose_order_strings(tmp_path, order):
    data = random_data((5, 6, 7), "int32", seed=9)
    perm = (2, 1, 0) if order == "F" else (0, 1, 2)
    oracle = write_array(
        tmp_path / "t", data, chunks=(3, 4, 5), filters=[TransposeCodec(order=perm)], compressors=[ZstdCodec()]
    )
    doc = edit_metadata(tmp_path / "t")
    doc["codecs"][0]["configuration"]["order"] = order
    edit_metadata(tmp_path / "t", codecs=doc["codecs"])
    assert np.array_equal(damacy.read(tmp_path / "t"), oracle[:])


def test_bytes_without_endian_for_one_byte_types(tmp_path):
    data = random_data((5, 6), "uint8", seed=1)
    write_array(tmp_path / "u", data, chunks=(2, 4), serializer=BytesCodec(endian=None))
    assert np.array_equal(damacy.read(tmp_path / "u"), data)


def test_codec_shorthand_and_null_dimension_names(tmp_path):
    data = random_data((4, 4), "uint8", seed=1)
    write_array(tmp_path / "u", data, chunks=(2, 2))
    edit_metadata(tmp_path / "u", codecs=["bytes"], dimension_names=None)
    assert np.array_equal(damacy.read(tmp_path / "u"), data)


def test_metadata_is_exposed(tmp_path):
    write_array(tmp_path / "a", np.zeros((6, 5), "u2"), chunks=(4, 4), write=False)
    meta = damacy.open_array(tmp_path / "a")
    assert meta.shape == (6, 5) and meta.dtype == np.dtype("u2") and meta.chunk_shape == (4, 4)
    assert "bytes" in meta.codecs.describe()


def test_open_array_names_chunks_and_shards_as_zarr_python(tmp_path):
    import zarr
    from zarr.codecs import BytesCodec, ShardingCodec

    write_array(tmp_path / "s", random_data((16, 12), "uint16", 1), chunks=(8, 12), serializer=ShardingCodec(chunk_shape=(4, 6), codecs=[BytesCodec()]))
    write_array(tmp_path / "p", random_data((16, 12), "float32", 1), chunks=(8, 6))
    nested = ShardingCodec(chunk_shape=(4, 6), codecs=[ShardingCodec(chunk_shape=(2, 3), codecs=[BytesCodec()])])
    write_array(tmp_path / "n", random_data((16, 12), "uint16", 1), chunks=(8, 12), serializer=nested)
    for name in ("s", "p", "n"):
        meta, ref = damacy.open_array(tmp_path / name), zarr.open_array(tmp_path / name, mode="r")
        assert meta.chunks == ref.chunks and meta.shards == ref.shards, name
    # shards in shards: zarr-python names the outer shard's chunk; damacy reads the innermost
    assert damacy.open_array(tmp_path / "n").read_unit == (2, 3) and damacy.open_array(tmp_path / "s").read_unit == (4, 6)
    assert repr(damacy.open_array(tmp_path / "s")) == f"<damacy array {tmp_path / 's'} shape=(16, 12) uint16 chunks=(4, 6) shards=(8, 12)>"
