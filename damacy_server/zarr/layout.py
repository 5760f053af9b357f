"""Where each piece of an array lives: chunk objects, shards within them, read units.

A *read unit* is the smallest piece damacy reads and decodes on its own: a chunk, or, when
the chunk is a shard whose bytes are not wrapped by other codecs, one of its inner chunks
(recursively for nested shards). Only the index and the inner chunks a request touches are
read then. All lookups take arrays of unit coordinates, so a plan for thousands of chunks
is a few numpy operations.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from damacy_server.zarr.codecs import CodecChain
from damacy_server.zarr.codecs.sharding import ShardingCodec


@dataclass(frozen=True)
class ChunkLayout:
    shape: tuple[int, ...]  # the array
    chunk_shape: tuple[int, ...]  # one object of the chunk grid (a chunk or a shard)
    unit_shape: tuple[int, ...]  # one read unit
    levels: tuple[ShardingCodec, ...]  # shard levels read through their index, outermost first
    leaf: CodecChain  # decodes one read unit

    @classmethod
    def build(cls, shape: tuple[int, ...], chunk_shape: tuple[int, ...], chain: CodecChain) -> ChunkLayout:
        levels = []
        unit = chunk_shape
        # A shard is read piecewise only when its bytes are the object's bytes: no codec
        # transforms the array before it, none wraps its bytes after it.
        while isinstance(chain.a2b, ShardingCodec) and not chain.a2a and not chain.b2b:
            levels.append(chain.a2b)
            unit = chain.a2b.inner_shape
            chain = chain.a2b.inner
        return cls(tuple(shape), tuple(chunk_shape), tuple(unit), tuple(levels), chain)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @functools.cached_property
    def grid(self) -> tuple[int, ...]:
        """Read units per axis (the last ones may reach past the array's end; worked out once:
        the planner asks per batch and per sample)."""
        return tuple(-(-s // u) for s, u in zip(self.shape, self.unit_shape))

    @functools.cached_property
    def units_per_chunk(self) -> tuple[int, ...]:
        return tuple(c // u for c, u in zip(self.chunk_shape, self.unit_shape))

    def chunk_coords(self, units: np.ndarray) -> np.ndarray:
        """Chunk-grid coordinates (n, ndim) of the objects holding read units ``units`` (n, ndim)."""
        return units // np.asarray(self.units_per_chunk, dtype=np.int64)

    def level_slots(self, units: np.ndarray) -> list[np.ndarray]:
        """For each shard level, the flat index-table entry (n,) of each unit's inner chunk."""
        out = []
        unit = np.asarray(self.unit_shape, dtype=np.int64)
        for level in self.levels:
            inner = np.asarray(level.inner_shape, dtype=np.int64)
            local = (units * unit // inner) % np.asarray(level.chunks_per_shard, dtype=np.int64)
            if self.ndim == 0:
                out.append(np.zeros(len(units), dtype=np.int64))
            else:
                out.append(np.ravel_multi_index(tuple(local.T), level.chunks_per_shard).astype(np.int64))
        return out
