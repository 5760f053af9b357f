"""``crc32c``: a CRC-32C (Castagnoli) checksum appended as 4 little-endian bytes."""

from __future__ import annotations

from typing import Any

from crc32c import crc32c

from damacy_server.zarr.codecs.base import Buffer, BytesBytesCodec, ChunkSpec, CorruptData


class Crc32cCodec(BytesBytesCodec):
    name = "crc32c"
    fixed_overhead = 4

    @classmethod
    def from_config(cls, config: dict[str, Any], spec: ChunkSpec, uri: str) -> Crc32cCodec:
        return cls()

    def decode(self, data: Buffer, decoded_size: int | None) -> Buffer:
        if len(data) < 4:
            raise CorruptData(f"crc32c: {len(data)} bytes cannot hold a 4-byte checksum")
        view = memoryview(data)
        body = view[:-4]
        stored = int.from_bytes(view[-4:], "little")
        computed = crc32c(body)
        if stored != computed:
            raise CorruptData(f"crc32c checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")
        return body
