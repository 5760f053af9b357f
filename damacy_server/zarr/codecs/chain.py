"""A codec chain built from ``zarr.json``'s ``codecs`` list, and its decoder."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from damacy_protocol.errors import MetadataError, UnsupportedOperation
from damacy_server.zarr.codecs.base import (
    ArrayArrayCodec,
    ArrayBytesCodec,
    Buffer,
    BytesBytesCodec,
    ChunkSpec,
    Codec,
)


@cache
def registry() -> dict[str, type[Codec]]:
    from damacy_server.zarr.codecs.blosc import BloscCodec
    from damacy_server.zarr.codecs.bytes import BytesCodec
    from damacy_server.zarr.codecs.crc32c import Crc32cCodec
    from damacy_server.zarr.codecs.gzip import GzipCodec
    from damacy_server.zarr.codecs.numcodecs import CODECS as NUMCODECS
    from damacy_server.zarr.codecs.sharding import ShardingCodec
    from damacy_server.zarr.codecs.transpose import TransposeCodec
    from damacy_server.zarr.codecs.zstd import ZstdCodec

    classes = (BytesCodec, TransposeCodec, ZstdCodec, BloscCodec, GzipCodec, Crc32cCodec, ShardingCodec, *NUMCODECS)
    return {c.name: c for c in classes}


@dataclass(frozen=True)
class CodecChain:
    """array→array codecs, one array→bytes codec, bytes→bytes codecs (in encoding order)."""

    spec: ChunkSpec  # the decoded chunk
    a2a: tuple[ArrayArrayCodec, ...]
    a2a_specs: tuple[ChunkSpec, ...]  # the input spec of each a2a codec
    a2b: ArrayBytesCodec
    a2b_spec: ChunkSpec
    b2b: tuple[BytesBytesCodec, ...]

    def describe(self) -> str:
        return " > ".join(c.describe() for c in (*self.a2a, self.a2b, *self.b2b))

    @property
    def fixed_encoded_size(self) -> int | None:
        """The encoded size when it does not depend on the data (``bytes`` + checksums)."""
        from damacy_server.zarr.codecs.bytes import BytesCodec

        if not isinstance(self.a2b, BytesCodec):
            return None
        size = self.a2b_spec.nbytes
        for c in self.b2b:
            if c.fixed_overhead is None:
                return None
            size += c.fixed_overhead
        return size

    def decode_bytes(self, data: Buffer) -> Buffer:
        """Run the bytes→bytes codecs backwards."""
        for i in range(len(self.b2b) - 1, -1, -1):
            # Only the last stage's output size is known up front (when a2b is `bytes`).
            size = self.a2b_spec.nbytes if i == 0 and self.a2b.name == "bytes" else None
            data = self.b2b[i].decode(data, size)
        return data

    def decode(self, data: Buffer) -> np.ndarray:
        """The decoded chunk (possibly a read-only or non-native-endian view)."""
        arr = self.a2b.decode(self.decode_bytes(data), self.a2b_spec)
        for i in range(len(self.a2a) - 1, -1, -1):
            arr = self.a2a[i].decode(arr, self.a2a_specs[i])
        return arr


def build_chain(codecs: Any, spec: ChunkSpec, uri: str) -> CodecChain:
    """Parse and check a ``codecs`` list for chunks described by ``spec``."""
    if not isinstance(codecs, list) or not codecs:
        raise MetadataError(f"codecs must be a non-empty list, got {codecs!r}", uri=uri)
    a2a: list[ArrayArrayCodec] = []
    a2a_specs: list[ChunkSpec] = []
    a2b: ArrayBytesCodec | None = None
    a2b_spec = spec
    b2b: list[BytesBytesCodec] = []
    current = spec
    for entry in codecs:
        name, config = _name_and_config(entry, uri)
        cls = registry().get(name)
        if cls is None:
            known = ", ".join(sorted(registry()))
            raise UnsupportedOperation(f"codec {name!r} is not supported (supported: {known})", uri=uri)
        codec = cls.from_config(config, current, uri, build_chain) if cls.nested else cls.from_config(config, current, uri)
        if codec.kind == "a2a":
            if a2b is not None:
                raise MetadataError(f"codec {name!r} (array to array) comes after the array-to-bytes codec", uri=uri)
            a2a.append(codec)  # type: ignore[arg-type]
            a2a_specs.append(current)
            current = codec.encoded_spec(current)  # type: ignore[attr-defined]
        elif codec.kind == "a2b":
            if a2b is not None:
                raise MetadataError(f"codecs has two array-to-bytes codecs ({a2b.name!r}, {name!r})", uri=uri)
            a2b = codec  # type: ignore[assignment]
            a2b_spec = current
        else:
            if a2b is None:
                raise MetadataError(f"codec {name!r} (bytes to bytes) comes before the array-to-bytes codec", uri=uri)
            b2b.append(codec)  # type: ignore[arg-type]
    if a2b is None:
        raise MetadataError("codecs has no array-to-bytes codec (such as 'bytes')", uri=uri)
    return CodecChain(spec, tuple(a2a), tuple(a2a_specs), a2b, a2b_spec, tuple(b2b))


def _name_and_config(entry: Any, uri: str) -> tuple[str, dict[str, Any]]:
    if isinstance(entry, str):  # shorthand: a codec without configuration
        return entry, {}
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise MetadataError(f"a codec must be an object with a name, got {entry!r}", uri=uri)
    config = entry.get("configuration", {})
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise MetadataError(f"codec {entry['name']!r}: configuration must be an object", uri=uri)
    return entry["name"], config
