"""Bad input: each case is a precise damacy error naming the uri (and file and chunk)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec, ZstdCodec

import damacy

from conftest import edit_metadata, random_data, write_array

LE = BytesCodec(endian="little")


def raises(cls, uri, *words):
    """Check the error class, that the uri is named and that every word is in the message."""

    class Check:
        def __enter__(self):
            self.ctx = pytest.raises(cls)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self.ctx.__exit__(*exc)
            err = self.info.value
            assert type(err).__module__.startswith("damacy"), type(err)
            assert isinstance(err, damacy.DamacyError)  # (every error may name its uri, sample, path, chunk)
            assert str(uri) in str(err), str(err)
            for w in words:
                assert w in str(err), (w, str(err))
            return handled

    return Check()


def sharded(tmp_path, location="end", name="s"):
    data = random_data((8, 8), "uint16", seed=1)
    serializer = ShardingCodec(
        chunk_shape=(4, 4), codecs=[LE, ZstdCodec(level=1)], index_codecs=[LE, Crc32cCodec()], index_location=location
    )
    write_array(tmp_path / name, data, chunks=(8, 8), serializer=serializer)
    return tmp_path / name, data


def test_missing_uri(tmp_path):
    with raises(damacy.NotFound, tmp_path / "nope", "neither zarr.json nor .zarray/.zgroup found"):
        damacy.read(tmp_path / "nope")


def test_a_file_uri_with_a_query_or_fragment_is_refused_not_read_as_another_path(tmp_path):
    data = random_data((4, 4), "uint16", seed=2)
    write_array(tmp_path / "a", np.zeros((4, 4), "uint16"), chunks=(4, 4))
    write_array(tmp_path / "a#b.zarr", data, chunks=(4, 4))
    for uri in (f"file://{tmp_path}/a#b.zarr", f"file://{tmp_path}/a?x=1", f"file://{tmp_path}/a?"):
        with pytest.raises(damacy.InvalidArgument, match="a file uri takes no query or fragment"):
            damacy.read(uri)
    assert np.array_equal(damacy.read(f"file://{tmp_path}/a%23b.zarr"), data)  # '#' spelled as a uri spells it


def test_directory_without_metadata(tmp_path):
    (tmp_path / "d").mkdir()
    with raises(damacy.NotFound, tmp_path / "d"):
        damacy.read(tmp_path / "d")


def test_group_is_not_an_array(tmp_path):
    zarr.open_group(str(tmp_path / "g"), mode="w")
    with raises(damacy.InvalidArgument, tmp_path / "g", "group, not an array"):
        damacy.read(tmp_path / "g")


def test_malformed_json(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "array", ')
    with raises(damacy.MetadataError, tmp_path / "m", "not valid JSON", "line 1"):
        damacy.read(tmp_path / "m")


@pytest.mark.parametrize(
    "field,value,cls,words",
    [
        ("shape", [4, -1], damacy.MetadataError, ["shape"]),
        ("data_type", "complex128", damacy.DtypeMismatch, ["complex128"]),
        ("data_type", "r16", damacy.DtypeMismatch, ["r16"]),
        ("data_type", {"name": "bfloat16"}, damacy.DtypeMismatch, ["bfloat16"]),
        ("fill_value", "banana", damacy.MetadataError, ["fill_value", "banana"]),
        ("fill_value", 70000, damacy.MetadataError, ["fill_value", "out of range"]),
        ("codecs", [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "lzma"}], damacy.UnsupportedOperation, ["'lzma'"]),
        ("codecs", [{"name": "zstd"}], damacy.MetadataError, ["zstd", "before the array-to-bytes"]),
        ("codecs", [{"name": "bytes"}], damacy.MetadataError, ["endian"]),
        ("chunk_grid", {"name": "rectilinear", "configuration": {}}, damacy.UnsupportedOperation, ["rectilinear"]),
        ("chunk_key_encoding", {"name": "v2", "configuration": {"separator": "-"}}, damacy.MetadataError, ["separator"]),
        ("storage_transformers", [{"name": "chunk-manifest"}], damacy.UnsupportedOperation, ["chunk-manifest"]),
        ("unknown_extension", {"must_understand": True}, damacy.UnsupportedOperation, ["unknown_extension"]),
        ("zarr_format", 4, damacy.MetadataError, ["zarr_format"]),
        ("zarr_format", 2, damacy.MetadataError, ["zarr_format 2", ".zarray"]),
    ],
)
def test_bad_metadata_fields(tmp_path, field, value, cls, words):
    write_array(tmp_path / "a", np.zeros((4, 4), "u2"), chunks=(2, 2))
    edit_metadata(tmp_path / "a", **{field: value})
    with raises(cls, tmp_path / "a", *words):
        damacy.read(tmp_path / "a")


def _v3(path, **over):
    doc = {
        "zarr_format": 3, "node_type": "array", "shape": [4, 4], "data_type": "float32",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4, 4]}},
        "chunk_key_encoding": {"name": "default"}, "fill_value": 0,
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
    }
    doc.update(over)
    path.mkdir()
    (path / "zarr.json").write_text(json.dumps(doc).replace('"HUGE"', "1" + "0" * 400))  # a 401-digit integer
    return path


@pytest.mark.parametrize(
    "name, over, words",
    [
        ("fill", {"fill_value": "HUGE"}, ["fill_value", "out of range"]),
        ("astype", {"codecs": [
            {"name": "numcodecs.astype", "configuration": {"encode_dtype": "<f4", "decode_dtype": "zz"}},
            {"name": "bytes", "configuration": {"endian": "little"}},
        ]}, ["malformed metadata", "zz"]),
        ("dims", {"shape": [1] * 64, "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1] * 64}}}, ["64 axes", "up to 63"]),
    ],
)
def test_metadata_no_check_names_is_still_a_metadata_error_of_its_sample(tmp_path, name, over, words):
    # values of a wrong type or out of range that parsing meets before any check: an error
    # of the sample naming the array, and in a pipeline only that sample fails
    bad = _v3(tmp_path / name, **over)
    cls = damacy.UnsupportedOperation if name == "dims" else damacy.MetadataError
    with raises(cls, bad, *words):
        damacy.read(bad)
    good = write_array(tmp_path / "good", np.full((4, 4), 7, "float32"), chunks=(4, 4))
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(4, 4), on_error="fill", pop_timeout_s=60)
    with damacy.Pipeline(cfg) as pipe:
        pipe.push([damacy.Sample(str(tmp_path / "good"), np.s_[0:4, 0:4]), damacy.Sample(str(bad), np.s_[0:4, 0:4])] * 2)
        for batch in pipe:
            with batch:
                np.testing.assert_array_equal(batch.numpy()[0], good[...])
                assert [(i, type(e)) for i, e in batch.info.errors] == [(1, cls)]


def test_ignorable_extension_field_is_ignored(tmp_path):
    write_array(tmp_path / "a", np.ones((4, 4), "u2"), chunks=(2, 2))
    edit_metadata(tmp_path / "a", some_extension={"must_understand": False, "x": 1})
    assert damacy.read(tmp_path / "a").sum() == 16


def test_zarr_v2_with_an_unsupported_codec_is_refused_naming_it(tmp_path):
    from numcodecs import LZMA

    arr = zarr.create_array(str(tmp_path / "v2"), shape=(4,), chunks=(2,), dtype="i4", zarr_format=2, compressors=LZMA())
    arr[:] = 1
    with raises(damacy.UnsupportedOperation, tmp_path / "v2", "v2 compressor 'lzma' is not supported"):
        damacy.read(tmp_path / "v2")


def test_truncated_shard(tmp_path):
    path, _ = sharded(tmp_path, location="start")
    shard = path / "c" / "0" / "0"
    raw = shard.read_bytes()
    shard.write_bytes(raw[: len(raw) - 10])  # the last inner chunk loses its tail
    with raises(damacy.DecodeError, path, str(shard), "truncated", "chunk [1, 1]"):
        damacy.read(path)
    # the chunks that are intact still read
    assert damacy.read(path, np.s_[0:4, 0:4]).shape == (4, 4)


def test_shard_shorter_than_its_index(tmp_path):
    path, _ = sharded(tmp_path)
    shard = path / "c" / "0" / "0"
    shard.write_bytes(b"\x00" * 7)
    with raises(damacy.DecodeError, path, str(shard), "shard index"):
        damacy.read(path)


def test_corrupt_shard_index_checksum(tmp_path):
    path, _ = sharded(tmp_path)
    shard = path / "c" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    raw[-10] ^= 0xFF  # inside the index (at the end), before its checksum
    shard.write_bytes(bytes(raw))
    with raises(damacy.DecodeError, path, str(shard), "crc32c checksum mismatch"):
        damacy.read(path)


@pytest.mark.parametrize("damage", ["truncated", "bad-magic"])
def test_corrupt_zstd_frame(tmp_path, damage):
    data = np.arange(32 * 32, dtype="float32").reshape(32, 32)
    write_array(tmp_path / "z", data, chunks=(16, 16), compressors=[ZstdCodec(level=3)])
    chunk = tmp_path / "z" / "c" / "1" / "0"
    raw = chunk.read_bytes()
    chunk.write_bytes(raw[: len(raw) // 2] if damage == "truncated" else b"\x00\x01" + raw[2:])
    with raises(damacy.DecodeError, tmp_path / "z", str(chunk), "zstd", "chunk [1, 0]"):
        damacy.read(tmp_path / "z")
    assert np.array_equal(damacy.read(tmp_path / "z", np.s_[0:16]), data[0:16])


def test_zstd_checksum_mismatch(tmp_path):
    data = np.arange(32 * 32, dtype="float32").reshape(32, 32)
    write_array(tmp_path / "z", data, chunks=(16, 16), compressors=[ZstdCodec(level=3, checksum=True)])
    chunk = tmp_path / "z" / "c" / "0" / "1"
    raw = bytearray(chunk.read_bytes())
    raw[-1] ^= 0x55  # the frame's content checksum
    chunk.write_bytes(bytes(raw))
    with raises(damacy.DecodeError, tmp_path / "z", str(chunk), "zstd"):
        damacy.read(tmp_path / "z")


def test_zstd_frames_without_a_content_size_or_several_in_a_row_decode_and_corruption_is_named():
    """The one-call decode takes one frame with its size in the header; whatever it refuses
    goes frame by frame (decided by what that finds, not by the first error's words)."""
    import zstandard

    from damacy_server.zarr.codecs.base import CorruptData
    from damacy_server.zarr.codecs.zstd import decompress

    a, b = np.arange(5000, dtype="<u2").tobytes(), np.arange(3000, dtype="<u4").tobytes()
    sized, unsized = zstandard.ZstdCompressor(), zstandard.ZstdCompressor(write_content_size=False)
    assert decompress(sized.compress(a), len(a)) == a
    assert decompress(unsized.compress(a), len(a)) == a  # no content size in the header
    assert decompress(sized.compress(a) + unsized.compress(b), len(a) + len(b)) == a + b  # two frames
    assert decompress(unsized.compress(a) + unsized.compress(b), len(a) + len(b)) == a + b  # the one call stops after the first
    assert decompress(unsized.compress(a) + unsized.compress(b)) == a + b
    frame = sized.compress(a)
    for bad in (frame[: len(frame) // 2], frame + frame[:7], b"\x00" + frame[1:]):
        with pytest.raises(CorruptData, match="zstd"):
            decompress(bad, len(a))


def test_the_stand_in_decoder_tells_a_bad_checksum_from_a_frame_it_cannot_decode():
    """As nvCOMP's statuses do: only the checksum differs (BAD_CHECKSUM), or the data is
    damaged (CANNOT_DECOMPRESS), decided by decoding the frame without its checksum."""
    import zstandard

    from damacy_server.cuda.device import _only_checksum_differs

    data = np.random.default_rng(1).integers(0, 50, 20000, dtype=np.uint8).tobytes()
    dctx = zstandard.ZstdDecompressor()
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(data)
    bad_sum = frame[:-1] + bytes([frame[-1] ^ 0x55])
    cut = frame[: len(frame) // 2] + frame[-4:]
    plain = zstandard.ZstdCompressor(write_checksum=False).compress(data)
    assert _only_checksum_differs(dctx, bad_sum, len(data))
    assert not _only_checksum_differs(dctx, cut, len(data))
    assert not _only_checksum_differs(dctx, plain[:-3], len(data))  # no checksum to blame


def test_corrupt_array_crc32c(tmp_path):
    write_array(tmp_path / "c", np.arange(16, dtype="i4").reshape(4, 4), chunks=(2, 2), compressors=[Crc32cCodec()])
    chunk = tmp_path / "c" / "c" / "0" / "1"
    raw = bytearray(chunk.read_bytes())
    raw[0] ^= 1
    chunk.write_bytes(bytes(raw))
    with raises(damacy.DecodeError, tmp_path / "c", "crc32c checksum mismatch", "chunk [0, 1]"):
        damacy.read(tmp_path / "c")


def test_chunk_of_wrong_size(tmp_path):
    write_array(tmp_path / "w", np.arange(16, dtype="i4").reshape(4, 4), chunks=(2, 2))
    chunk = tmp_path / "w" / "c" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-4])
    with raises(damacy.DecodeError, tmp_path / "w", "12 bytes, expected 16"):
        damacy.read(tmp_path / "w")


@pytest.mark.parametrize(
    "selection,cls,words",
    [
        (np.s_[0:9, 0:2], damacy.OutOfBounds, ["axis 0", "size 8"]),
        (((0, 2), (3, 9)), damacy.OutOfBounds, ["axis 1", "3:9 leaves the array"]),
        (np.s_[-1], damacy.OutOfBounds, ["axis 0", "index -1", "not counted from the end"]),
        (np.s_[-2:4], damacy.OutOfBounds, ["axis 0", "-2:4", "not counted from the end"]),
        (([0, 8], slice(None)), damacy.OutOfBounds, ["index 8"]),
        (([0, -9], slice(None)), damacy.OutOfBounds, ["index -9"]),
        ((0, 0, 0), damacy.InvalidArgument, ["names 3 axes", "has 2"]),
        (np.s_[4:2], damacy.InvalidArgument, ["stop 2 is before start 4"]),
        (np.s_[..., 0, ...], damacy.InvalidArgument, ["one '...'"]),
        ((0, None), damacy.InvalidArgument, ["new axes"]),
        (np.s_[::-1], damacy.InvalidArgument, ["step"]),
        (("a", 1), damacy.InvalidArgument, ["axis 0"]),
        (([[1, 2]], 0), damacy.InvalidArgument, ["flat list"]),
    ],
)
def test_bad_selection(tmp_path, selection, cls, words):
    write_array(tmp_path / "b", np.zeros((8, 8), "u1"), chunks=(4, 4))
    with raises(cls, tmp_path / "b", *words):
        damacy.read(tmp_path / "b", selection)


def test_selections_near_the_int64_limits_and_arrays_too_large_to_hold_are_refused_naming_why(tmp_path):
    big = 2**62 - 1
    write_array(tmp_path / "c", np.zeros((4, 4), "u2"), chunks=(2, 2))
    edit_metadata(tmp_path / "c", shape=[big, big], chunk_grid={"name": "regular", "configuration": {"chunk_shape": [5, 5]}})
    with raises(damacy.InvalidArgument, tmp_path / "c", "axis 0", "reaches past 2**62"):
        damacy.read(tmp_path / "c", ((big - 2, big + 3), (0, 2)), out_of_bounds="pad")
    with raises(damacy.InvalidArgument, tmp_path / "c", "too large to read into memory"):
        damacy.read(tmp_path / "c")
    assert (damacy.read(tmp_path / "c", ((big - 2, big + 1), (0, 2)), out_of_bounds="pad") == 0).all()
    # 63 axes: the most an array may have, read
    write_array(tmp_path / "d", np.zeros((1,) * 8, "u2"), chunks=(1,) * 8, fill_value=3)
    edit_metadata(tmp_path / "d", shape=[1] * 63, chunk_grid={"name": "regular", "configuration": {"chunk_shape": [1] * 63}})
    assert damacy.read(tmp_path / "d").shape == (1,) * 63


def test_bad_dtype(tmp_path):
    write_array(tmp_path / "b", np.zeros((8, 8), "u1"), chunks=(4, 4))
    with pytest.raises(damacy.InvalidArgument, match="unknown dtype 'f128'"):
        damacy.read(tmp_path / "b", dtype="f128")


def test_unsupported_scheme():
    with raises(damacy.UnsupportedOperation, "ftp://host/a.zarr", "'ftp'", "s3://"):
        damacy.read("ftp://host/a.zarr")


def test_errors_survive_pickling(tmp_path):
    import pickle

    with pytest.raises(damacy.NotFound) as info:
        damacy.read(tmp_path / "nope")
    e = info.value
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is damacy.NotFound and str(back) == str(e) and back.uri == e.uri
    doc = json.dumps({"kind": "DecodeError", "reason": "x", "chunk": [1, 2]})
    from damacy_protocol.errors import from_wire

    err = from_wire(json.loads(doc))
    assert isinstance(err, damacy.DecodeError) and err.chunk == (1, 2)


def test_chunk_that_cannot_be_read_is_a_storage_error(tmp_path):
    write_array(tmp_path / "p", np.ones((4, 4), "u1"), chunks=(2, 2))
    chunk = tmp_path / "p" / "c" / "0" / "0"
    chunk.unlink()
    chunk.mkdir()  # a directory where the chunk file should be: reading it fails (EISDIR)
    with raises(damacy.StorageError, tmp_path / "p", str(chunk)):
        damacy.read(tmp_path / "p")
