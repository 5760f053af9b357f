"""The Blosc frame layout (for stream-wise decoders) against numcodecs' own decoder."""

from __future__ import annotations

import zlib

import numcodecs
import numpy as np
import pytest
import zstandard

from damacy_server.zarr.codecs.blosc import CorruptData, decode_frame, parse_frame, unshuffle_block


def zstd_stream(data: bytes, size: int) -> bytes:
    return zstandard.ZstdDecompressor().decompress(data, max_output_size=size)


def zlib_stream(data: bytes, size: int) -> bytes:
    return zlib.decompress(data)


@pytest.mark.parametrize("cname,stream", [("zstd", zstd_stream), ("zlib", zlib_stream)])
@pytest.mark.parametrize("shuffle", [0, 1, 2])
@pytest.mark.parametrize("dtype", ["u1", "u2", "f4", "i8"])
@pytest.mark.parametrize("n", [1, 7, 1000, 100_003])
def test_stream_by_stream_decode_equals_numcodecs(cname, stream, shuffle, dtype, n):
    rng = np.random.default_rng(n)
    data = (rng.poisson(50, size=n) + np.arange(n) % 7).astype(dtype)
    for clevel, blocksize in ((1, 0), (5, 0), (9, 4096)):
        frame = numcodecs.Blosc(cname=cname, clevel=clevel, shuffle=shuffle, blocksize=blocksize).encode(data)
        layout = parse_frame(frame)
        assert layout.nbytes == data.nbytes and layout.compressor == cname
        assert decode_frame(frame, stream) == numcodecs.blosc.decompress(frame)


def test_incompressible_frames_are_stored_as_they_are():
    data = np.frombuffer(np.random.default_rng(0).bytes(300), dtype="u1")
    frame = numcodecs.Blosc(cname="zstd", clevel=5, shuffle=0).encode(data)
    layout = parse_frame(frame)
    assert layout.memcpyed or all(s.raw for s in layout.streams)
    assert decode_frame(frame, zstd_stream) == data.tobytes()


def test_split_streams_cover_each_block():
    data = np.arange(50_000, dtype="u4")
    frame = numcodecs.Blosc(cname="blosclz", clevel=5, shuffle=1).encode(data)  # blosclz splits blocks
    layout = parse_frame(frame)
    per_block = {}
    for s in layout.streams:
        per_block.setdefault(s.block, []).append(s)
    for j, streams in per_block.items():
        assert sum(s.out_size for s in streams) == layout.block_size(j)
        assert len(streams) in (1, layout.typesize)


def test_bitshuffle_reference_matches_a_hand_made_example():
    # 8 elements of 1 byte: bit plane k holds bit k of every element, element i at bit i
    elements = np.array([1, 0, 0, 0, 0, 0, 0, 0x80], dtype="u1")
    planes = np.packbits(np.unpackbits(elements[:, None], axis=1, bitorder="little").T, axis=1, bitorder="little").reshape(-1)
    assert planes[0] == 0x01 and planes[7] == 0x80
    assert np.array_equal(unshuffle_block(planes, 1, "bitshuffle"), elements)


def test_truncated_and_corrupt_frames_are_errors():
    frame = numcodecs.Blosc(cname="zstd", clevel=5, shuffle=1).encode(np.arange(10_000, dtype="u2"))
    with pytest.raises(CorruptData, match="compressed bytes"):
        parse_frame(frame[:-5])
    bad = bytearray(frame)
    bad[16:20] = (10**6).to_bytes(4, "little")  # the first block starts far outside
    with pytest.raises(CorruptData, match="outside"):
        parse_frame(bytes(bad))


def test_the_python_decoder_checks_the_frame_before_c_blosc_reads_it():
    """C-Blosc 1 follows a frame's block offsets unchecked: a corrupt one must be refused
    by damacy's frame check first (a CorruptData, never a read out of the buffer)."""
    import struct

    from damacy_server.zarr.codecs.blosc import BloscCodec

    data = np.arange(4096, dtype="u4")
    frame = bytearray(numcodecs.Blosc(cname="lz4", clevel=5, shuffle=1, blocksize=4096).encode(data))
    assert BloscCodec("lz4", 5, "shuffle", 4).decode(bytes(frame), data.nbytes) == data.tobytes()
    struct.pack_into("<i", frame, 16 + 4, 1 << 30)  # past the block table: a start or a stream size far past the end
    with pytest.raises(CorruptData, match="blosc: block .* (points outside|runs past) the frame"):
        BloscCodec("lz4", 5, "shuffle", 4).decode(bytes(frame), data.nbytes)
