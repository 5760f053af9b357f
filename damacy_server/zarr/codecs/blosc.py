"""``blosc``: Blosc (v1 container) with any of its compressors and shuffles.

The header says how the chunk was shuffled and compressed, so decoding does not need the
configuration; it is still checked at metadata load so an unknown compressor is refused
early. Decoding goes through numcodecs' C-Blosc binding, which releases the GIL (python-
blosc2's ``decompress`` holds it, which serialises decoding across threads).
"""

from __future__ import annotations

import struct
from typing import Any

from numcodecs import blosc as _blosc

from damacy_protocol.errors import MetadataError, UnsupportedError
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
            raise UnsupportedError(f"blosc compressor {cname!r} is not supported ({', '.join(CNAMES)} are)", uri=uri)
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
