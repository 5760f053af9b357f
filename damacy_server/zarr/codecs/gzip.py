"""``gzip``: DEFLATE in a gzip container (RFC 1952); several members are concatenated."""

from __future__ import annotations

import zlib
from typing import Any

from damacy_server.zarr.codecs.base import Buffer, BytesBytesCodec, ChunkSpec, CorruptData, config_value


class GzipCodec(BytesBytesCodec):
    name = "gzip"

    def __init__(self, level: int) -> None:
        self.level = level

    @classmethod
    def from_config(cls, config: dict[str, Any], spec: ChunkSpec, uri: str) -> GzipCodec:
        return cls(config_value(config, "level", int, cls.name, uri, default=6))

    def describe(self) -> str:
        return f"gzip({self.level})"

    def decode(self, data: Buffer, decoded_size: int | None) -> Buffer:
        parts = []
        rest: Buffer = data
        try:
            while True:
                d = zlib.decompressobj(wbits=31)
                parts.append(d.decompress(rest))
                if not d.eof:
                    raise CorruptData("gzip: truncated stream")
                rest = d.unused_data
                if not rest.strip(b"\0"):  # the end, or zero bytes padding it (gzip allows them)
                    break
        except zlib.error as e:
            raise CorruptData(f"gzip: {e}") from e
        return parts[0] if len(parts) == 1 else b"".join(parts)
