"""``zstd``: Zstandard frames (content checksum verified when the writer stored one)."""

from __future__ import annotations

import threading
from typing import Any

import zstandard

from damacy_server.zarr.codecs.base import Buffer, BytesBytesCodec, ChunkSpec, CorruptData, config_value

_local = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    # A decompression context is not thread-safe; one per thread is reused.
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


class ZstdCodec(BytesBytesCodec):
    name = "zstd"

    def __init__(self, level: int, checksum: bool) -> None:
        self.level = level
        self.checksum = checksum

    @classmethod
    def from_config(cls, config: dict[str, Any], spec: ChunkSpec, uri: str) -> ZstdCodec:
        level = config_value(config, "level", int, cls.name, uri, default=0)
        checksum = config_value(config, "checksum", bool, cls.name, uri, default=False)
        return cls(level, checksum)

    def describe(self) -> str:
        return f"zstd(level={self.level})"

    def decode(self, data: Buffer, decoded_size: int | None) -> Buffer:
        return decompress(data, decoded_size)


def decompress(data: Buffer, decoded_size: int | None = None) -> bytes:
    """Decompress one or more concatenated zstd frames.

    One frame with its content size in its header is the common, fastest case (one call);
    anything else it refuses or decodes short (frames without a content size, several
    frames, or corrupt data) goes frame by frame, which reports corruption as
    :class:`CorruptData`."""
    d = _decompressor()
    try:
        out = d.decompress(data, max_output_size=decoded_size or 0, allow_extra_data=False)
        # frames without a content size: the one call stops after the first, as if it were all
        if decoded_size is None or len(out) == decoded_size:
            return out
    except zstandard.ZstdError:
        pass
    try:
        parts = []
        rest = bytes(data)
        while rest:
            obj = d.decompressobj()
            parts.append(obj.decompress(rest))
            if not obj.eof:
                raise CorruptData("zstd: truncated frame")
            rest = obj.unused_data
        return b"".join(parts)
    except zstandard.ZstdError as e:
        raise CorruptData(f"zstd: {e}") from e
