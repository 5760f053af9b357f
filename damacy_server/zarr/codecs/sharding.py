"""``sharding_indexed``: many inner chunks in one object, located by an index.

The fast read path (``damacy_server.zarr.layout``) reads only the index and the inner
chunks a request needs; :meth:`ShardingCodec.decode` decodes a whole shard, which is what
happens when other codecs wrap the shard and it must be read whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from damacy_protocol.errors import MetadataError, UnsupportedOperation
from damacy_server.zarr.codecs.base import ArrayBytesCodec, Buffer, ChunkSpec, CorruptData

#: offset and nbytes of an inner chunk that was never written
EMPTY = np.uint64(2**64 - 1)


class ShardingCodec(ArrayBytesCodec):
    name = "sharding_indexed"

    def __init__(self, inner_shape, chunks_per_shard, inner, index, index_location, index_nbytes) -> None:
        self.inner_shape: tuple[int, ...] = inner_shape
        self.chunks_per_shard: tuple[int, ...] = chunks_per_shard
        self.inner = inner  # CodecChain of an inner chunk
        self.index = index  # CodecChain of the index
        self.index_location: str = index_location
        self.index_nbytes: int = index_nbytes

    nested = True

    @classmethod
    def from_config(cls, config: dict[str, Any], spec: ChunkSpec, uri: str, build_chain: Callable[..., Any]) -> ShardingCodec:  # type: ignore[override]
        inner_shape = config.get("chunk_shape")
        if (
            not isinstance(inner_shape, list)
            or len(inner_shape) != len(spec.shape)
            or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in inner_shape)
        ):
            raise MetadataError(
                f"codec 'sharding_indexed': chunk_shape {inner_shape!r} must be {len(spec.shape)} positive integers",
                uri=uri,
            )
        if any(s % i for s, i in zip(spec.shape, inner_shape)):
            raise MetadataError(
                f"codec 'sharding_indexed': inner chunk shape {inner_shape} does not divide the shard shape "
                f"{list(spec.shape)}",
                uri=uri,
            )
        inner_shape = tuple(inner_shape)
        cps = tuple(s // i for s, i in zip(spec.shape, inner_shape))
        location = config.get("index_location", "end")
        if location not in ("start", "end"):
            raise MetadataError(f"codec 'sharding_indexed': index_location {location!r} is not 'start' or 'end'", uri=uri)
        if "codecs" not in config:
            raise MetadataError("codec 'sharding_indexed' needs configuration.codecs", uri=uri)
        if "index_codecs" not in config:
            raise MetadataError("codec 'sharding_indexed' needs configuration.index_codecs", uri=uri)
        inner = build_chain(config["codecs"], ChunkSpec(inner_shape, spec.dtype, spec.fill_value), uri)
        index = build_chain(config["index_codecs"], ChunkSpec((*cps, 2), np.dtype("uint64"), EMPTY), uri)
        index_nbytes = index.fixed_encoded_size
        if index_nbytes is None:
            raise UnsupportedOperation(
                f"shard index codecs {index.describe()} have no fixed size (bytes and crc32c do)", uri=uri
            )
        return cls(inner_shape, cps, inner, index, location, index_nbytes)

    def describe(self) -> str:
        return (
            f"sharding_indexed(inner {list(self.inner_shape)}: {self.inner.describe()}; "
            f"index {self.index_location}: {self.index.describe()})"
        )

    def index_range(self) -> tuple[int, int]:
        """(offset, length) of the index within the shard; a negative offset counts from the end."""
        n = self.index_nbytes
        return (0, n) if self.index_location == "start" else (-n, n)

    def parse_index(self, data: Buffer) -> np.ndarray:
        """The index as a (chunks, 2) uint64 array of (offset, nbytes), in C order of the inner grid."""
        if len(data) != self.index_nbytes:
            raise CorruptData(
                f"truncated shard: the index needs {self.index_nbytes} bytes, found {len(data)}"
            )
        table = np.ascontiguousarray(self.index.decode(data), dtype=np.uint64).reshape(-1, 2)
        offsets, sizes = table[:, 0], table[:, 1]
        half_empty = (offsets == EMPTY) != (sizes == EMPTY)
        if half_empty.any():
            raise CorruptData("corrupt shard index: an entry has only one of offset/nbytes set to empty")
        used = offsets != EMPTY
        limit = np.uint64(1 << 62)  # no object is that large; sums of larger values overflow
        if used.any() and (bool((offsets[used] >= limit).any()) or bool((sizes[used] >= limit).any())):
            raise CorruptData("corrupt shard index: an entry's offset or size is impossibly large")
        return table

    def decode(self, data: Buffer, spec: ChunkSpec) -> np.ndarray:
        start, n = self.index_range()
        size = len(data)
        if size < n:
            raise CorruptData(f"truncated shard: {size} bytes cannot hold its {n}-byte index")
        table = self.parse_index(memoryview(data)[start:] if start < 0 else memoryview(data)[:n])
        out = np.full(spec.shape, spec.fill_value, dtype=spec.dtype)
        view = memoryview(data)
        for flat, coords in enumerate(np.ndindex(*self.chunks_per_shard)):
            offset, nbytes = table[flat]
            if offset == EMPTY:
                continue
            offset, nbytes = int(offset), int(nbytes)
            if offset + nbytes > size:
                raise CorruptData(
                    f"truncated shard: inner chunk {list(coords)} ends at byte {offset + nbytes}, the shard has {size}"
                )
            region = tuple(slice(c * s, (c + 1) * s) for c, s in zip(coords, self.inner_shape))
            out[region] = self.inner.decode(view[offset : offset + nbytes])
        return out
