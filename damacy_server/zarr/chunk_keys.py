"""Chunk key encodings: how chunk grid coordinates name a file or object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from damacy_protocol.errors import MetadataError, UnsupportedOperation


@dataclass(frozen=True)
class ChunkKeyEncoding:
    """``default`` gives ``c/1/2`` (or ``c.1.2``), ``v2`` gives ``1.2`` (or ``1/2``)."""

    name: str
    separator: str

    def key(self, coords: tuple[int, ...]) -> str:
        if self.name == "default":
            return self.separator.join(["c", *map(str, coords)])
        # v2: a 0-d array's only chunk is "0"
        return self.separator.join(map(str, coords)) if coords else "0"


def parse_chunk_key_encoding(value: Any, uri: str) -> ChunkKeyEncoding:
    # A bare string is what some early writers produced; the spec form is an object.
    if isinstance(value, str):
        name, config = value, {}
    elif isinstance(value, dict):
        name, config = value.get("name"), value.get("configuration") or {}
    else:
        raise MetadataError(f"chunk_key_encoding must be an object, got {value!r}", uri=uri)
    if name not in ("default", "v2"):
        raise UnsupportedOperation(f"chunk_key_encoding {name!r} is not supported (default and v2 are)", uri=uri)
    if not isinstance(config, dict):
        raise MetadataError(f"chunk_key_encoding configuration must be an object, got {config!r}", uri=uri)
    separator = config.get("separator", "/" if name == "default" else ".")
    if separator not in ("/", "."):
        raise MetadataError(f"chunk_key_encoding separator must be '/' or '.', got {separator!r}", uri=uri)
    return ChunkKeyEncoding(name, separator)
