"""``bytes``: the array's elements in C order, little or big endian."""

from __future__ import annotations

from typing import Any

import numpy as np

from damacy_protocol.errors import MetadataError
from damacy_server.zarr.codecs.base import ArrayBytesCodec, Buffer, ChunkSpec, CorruptData


class BytesCodec(ArrayBytesCodec):
    name = "bytes"

    def __init__(self, endian: str | None) -> None:
        self.endian = endian

    @classmethod
    def from_config(cls, config: dict[str, Any], spec: ChunkSpec, uri: str) -> BytesCodec:
        endian = config.get("endian")
        if endian is None:
            if spec.dtype.itemsize > 1:
                raise MetadataError(
                    f"codec 'bytes' needs configuration.endian for the {spec.dtype.name} data type",
                    uri=uri,
                )
        elif endian not in ("little", "big"):
            raise MetadataError(f"codec 'bytes': endian must be 'little' or 'big', got {endian!r}", uri=uri)
        return cls(endian)

    def describe(self) -> str:
        return f"bytes({self.endian or 'no endian'})"

    def stored_dtype(self, dtype: np.dtype) -> np.dtype:
        if dtype.itemsize == 1 or self.endian is None:
            return dtype
        return dtype.newbyteorder("<" if self.endian == "little" else ">")

    def decode(self, data: Buffer, spec: ChunkSpec) -> np.ndarray:
        if len(data) != spec.nbytes:
            raise CorruptData(f"decoded chunk has {len(data)} bytes, expected {spec.nbytes}")
        return np.frombuffer(data, dtype=self.stored_dtype(spec.dtype)).reshape(spec.shape)
