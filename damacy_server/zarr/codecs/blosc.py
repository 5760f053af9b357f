"""``blosc``: Blosc (v1 container) with any of its compressors and shuffles.

The header says how the chunk was shuffled and compressed, so decoding does not need the
configuration; it is still checked at metadata load so an unknown compressor is refused
early. Decoding goes through numcodecs' C-Blosc binding, which releases the GIL (python-
blosc2's ``decompress`` holds it, which serialises decoding across threads).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from numcodecs import blosc as _blosc

from damacy_protocol.errors import MetadataError, UnsupportedOperation
from damacy_server.zarr.codecs.base import Buffer, BytesBytesCodec, ChunkSpec, CorruptData, config_value

CNAMES = ("blosclz", "lz4", "lz4hc", "zlib", "zstd")
SHUFFLES = ("noshuffle", "shuffle", "bitshuffle")
HEADER = struct.Struct("<BBBBIII")  # version, versionlz, flags, typesize, nbytes, blocksize, cbytes


class BloscCodec(BytesBytesCodec):
    name = "blosc"

    def __init__(self, cname: str, clevel: int, shuffle: str, typesize: int | None) -> None:
        self.cname = cname
        self.clevel = clevel
        self.shuffle = shuffle
        self.typesize = typesize

    @classmethod
    def from_config(cls, config: dict[str, Any], spec: ChunkSpec, uri: str) -> BloscCodec:
        cname = config_value(config, "cname", str, cls.name, uri, default="zstd")
        if cname not in CNAMES:
            raise UnsupportedOperation(f"blosc compressor {cname!r} is not supported ({', '.join(CNAMES)} are)", uri=uri)
        clevel = config_value(config, "clevel", int, cls.name, uri, default=5)
        shuffle = config_value(config, "shuffle", str, cls.name, uri, default="noshuffle")
        if shuffle not in SHUFFLES:
            raise MetadataError(f"codec 'blosc': shuffle {shuffle!r} is not one of {', '.join(SHUFFLES)}", uri=uri)
        typesize = config_value(config, "typesize", (int, type(None)), cls.name, uri, default=None)
        return cls(cname, clevel, shuffle, typesize)

    def describe(self) -> str:
        return f"blosc({self.cname},{self.shuffle})"

    def decode(self, data: Buffer, decoded_size: int | None) -> Buffer:
        nbytes, cbytes = parse_header(data)
        if cbytes != len(data):
            raise CorruptData(f"blosc: header says {cbytes} compressed bytes, the chunk has {len(data)}")
        if decoded_size is not None and nbytes != decoded_size:
            raise CorruptData(f"blosc: header says {nbytes} decoded bytes, expected {decoded_size}")
        parse_frame(data)  # every block's streams inside the frame: C-Blosc 1 reads them unchecked
        try:
            out = _blosc.decompress(data)
        except Exception as e:  # corruption is reported as RuntimeError/ValueError
            raise CorruptData(f"blosc: {e}") from e
        if len(out) != nbytes:
            raise CorruptData(f"blosc: decoded {len(out)} bytes, header says {nbytes}")
        return out


def parse_header(data: Buffer) -> tuple[int, int]:
    """(decoded bytes, compressed bytes) from a Blosc v1 header."""
    if len(data) < HEADER.size:
        raise CorruptData(f"blosc: {len(data)} bytes cannot hold a {HEADER.size}-byte header")
    _, _, _, _, nbytes, _, cbytes = HEADER.unpack_from(data)
    return nbytes, cbytes


# -- the Blosc 1 frame, laid out for decoders that work stream by stream (GPU) -------------

FLAG_SHUFFLE, FLAG_MEMCPYED, FLAG_BITSHUFFLE, FLAG_DONT_SPLIT = 0x01, 0x02, 0x04, 0x10
FORMATS = {0: "blosclz", 1: "lz4", 2: "snappy", 3: "zlib", 4: "zstd"}
MAX_SPLITS, MIN_BUFFERSIZE = 16, 128
VERSION_FORMAT, VERSIONLZ_FORMAT = 2, 1  # the frame's and every compressor's format version in C-Blosc 1


@dataclass(frozen=True)
class BloscStream:
    """One compressed stream of a block: ``size`` bytes at ``offset`` in the frame decode to
    ``out_size`` bytes at ``out_offset`` of the block's (still shuffled) bytes; ``raw``
    streams are stored as they are."""

    block: int
    offset: int
    size: int
    out_offset: int
    out_size: int
    raw: bool


@dataclass(frozen=True)
class BloscFrame:
    typesize: int
    nbytes: int
    blocksize: int
    cbytes: int
    compressor: str
    shuffle: str  # "noshuffle", "shuffle" or "bitshuffle"
    memcpyed: bool  # the data follows the header as it is
    streams: tuple[BloscStream, ...]

    def block_size(self, j: int) -> int:
        """Bytes of block ``j`` (the last one may be short)."""
        return min(self.blocksize, self.nbytes - j * self.blocksize)


def parse_frame(data: Buffer) -> BloscFrame:
    """The layout of a Blosc 1 frame: its header and every stream of every block."""
    nbytes, cbytes = parse_header(data)
    version, versionlz, flags, typesize, _, blocksize, _ = HEADER.unpack_from(data)
    if (version, versionlz) != (VERSION_FORMAT, VERSIONLZ_FORMAT):  # what C-Blosc 1 writes, and all it reads
        raise CorruptData(f"blosc: format version {version}.{versionlz}; C-Blosc 1 frames are {VERSION_FORMAT}.{VERSIONLZ_FORMAT}")
    if cbytes != len(data):
        raise CorruptData(f"blosc: header says {cbytes} compressed bytes, the chunk has {len(data)}")
    if typesize < 1 or nbytes < 0:
        raise CorruptData(f"blosc: header says items of {typesize} bytes, {nbytes} bytes in all")
    fmt = (flags & 0xE0) >> 5
    if fmt not in FORMATS:
        raise CorruptData(f"blosc: unknown compressor format {fmt}")
    # C-Blosc 1's order: a byte shuffle where both flags are set, a bit shuffle of blocks
    # at least an item long
    if flags & FLAG_SHUFFLE and typesize > 1:
        shuffle = "shuffle"
    elif flags & FLAG_BITSHUFFLE and blocksize >= typesize:
        shuffle = "bitshuffle"
    else:
        shuffle = "noshuffle"
    memcpyed = bool(flags & FLAG_MEMCPYED)
    if memcpyed or nbytes == 0:
        if HEADER.size + nbytes > len(data):
            raise CorruptData("blosc: truncated uncompressed frame")
        return BloscFrame(typesize, nbytes, blocksize, cbytes, FORMATS[fmt], shuffle, memcpyed, ())
    if blocksize <= 0:
        raise CorruptData(f"blosc: block size {blocksize}")
    nblocks = -(-nbytes // blocksize)
    starts_end = HEADER.size + 4 * nblocks
    if starts_end > len(data):
        raise CorruptData("blosc: truncated block table")
    starts = struct.unpack_from(f"<{nblocks}i", data, HEADER.size)
    dont_split = bool(flags & FLAG_DONT_SPLIT)
    view = memoryview(data)
    streams = []
    for j, start in enumerate(starts):
        bsize = min(blocksize, nbytes - j * blocksize)
        leftover = bsize < blocksize
        split = not dont_split and typesize <= MAX_SPLITS and blocksize // typesize >= MIN_BUFFERSIZE and not leftover
        if split and bsize % typesize:  # its streams would leave bytes of the block unwritten
            raise CorruptData(f"blosc: block {j} of {bsize} bytes does not split into {typesize} streams")
        nsplits = typesize if split else 1
        neblock = bsize // nsplits
        pos = start
        for k in range(nsplits):
            if pos < starts_end or pos + 4 > len(data):
                raise CorruptData(f"blosc: block {j} points outside the frame")
            (size,) = struct.unpack_from("<i", view, pos)
            pos += 4
            if size < 0 or pos + size > len(data):
                raise CorruptData(f"blosc: block {j} stream {k} of {size} bytes runs past the frame")
            streams.append(BloscStream(j, pos, size, k * neblock, neblock, size == neblock))
            pos += size
    return BloscFrame(typesize, nbytes, blocksize, cbytes, FORMATS[fmt], shuffle, memcpyed, tuple(streams))


def unshuffle_block(block: np.ndarray, typesize: int, shuffle: str) -> np.ndarray:
    """Undo a block's shuffle (numpy reference for the assembly kernel): bytes ``(n,)`` in."""
    if shuffle == "noshuffle" or typesize == 1 and shuffle == "shuffle":
        return block
    n = len(block) // typesize
    out = block.copy()
    if shuffle == "shuffle":
        out[: n * typesize] = block[: n * typesize].reshape(typesize, n).T.reshape(-1)
        return out
    if n % 8:  # Blosc bit-shuffles only blocks of a multiple of 8 elements; others are as they are
        return out
    if n:
        planes = np.unpackbits(block[: n * typesize].reshape(typesize * 8, n // 8), axis=1, bitorder="little")
        out[: n * typesize] = np.packbits(planes.T, axis=1, bitorder="little").reshape(-1)
    return out


def decode_frame(data: Buffer, decompress_stream) -> bytes:
    """Decode a frame stream by stream with ``decompress_stream(bytes, out_size)`` and the
    numpy unshuffle: the reference a stream-wise (GPU) decoder must agree with."""
    frame = parse_frame(data)
    raw = np.frombuffer(data, dtype=np.uint8)
    if frame.memcpyed or frame.nbytes == 0:
        return raw[HEADER.size : HEADER.size + frame.nbytes].tobytes()
    out = np.empty(frame.nbytes, dtype=np.uint8)
    blocks: dict[int, np.ndarray] = {}
    for s in frame.streams:
        block = blocks.get(s.block)
        if block is None:
            block = blocks[s.block] = np.empty(frame.block_size(s.block), dtype=np.uint8)
        src = raw[s.offset : s.offset + s.size]
        piece = src if s.raw else np.frombuffer(decompress_stream(src.tobytes(), s.out_size), dtype=np.uint8)
        if len(piece) != s.out_size:
            raise CorruptData(f"blosc: block {s.block} stream decoded to {len(piece)} bytes, expected {s.out_size}")
        block[s.out_offset : s.out_offset + s.out_size] = piece
    for j, block in blocks.items():
        start = j * frame.blocksize
        out[start : start + len(block)] = unshuffle_block(block, frame.typesize, frame.shuffle)
    return out.tobytes()
