"""Where read units' bytes are: each unit's chunk object, and in a sharded array its place
in the shard, read from the shard indexes (each read once, an object store's outer indexes
together, then kept in the metadata caches); an index entry past its shard is a DecodeError
of the units it names, an absent object or entry a unit that reads as the fill value.

:class:`ShardIndexes` is that part of :class:`~damacy_server.plan.resolve.Resolver`: it uses
the resolver's caches (``cache.shard_indexes``), its concurrency and its thread pool
(``_map``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from damacy_protocol.errors import DamacyError, DecodeError, InvalidArgument
from damacy_server import native
from damacy_server.zarr.codecs import CorruptData
from damacy_server.zarr.codecs.sharding import EMPTY
from damacy_server.zarr.metadata import ArrayMetadata


@dataclass(frozen=True)
class UnitLocations:
    """Where the bytes of each of n read units are.

    ``nbytes[i] == -1`` means unit i is a whole object; ``missing[i]`` means it was never
    written (its chunk object or its shard-index entry is absent) and reads as fill value.
    """

    owners: np.ndarray  # int64 (n,): each unit's object, an index into ``objects`` (-1: not located)
    objects: list[str]  # the objects' keys, in chunk-grid order
    offsets: np.ndarray  # int64 (n,)
    nbytes: np.ndarray  # int64 (n,)
    missing: np.ndarray  # bool (n,)
    errors: dict[int, DamacyError]  # units whose shard index could not be read

    @classmethod
    def none(cls, n: int) -> UnitLocations:
        """``n`` units none of which is located (all in the chunk cache, or needed by no sample
        still standing): no object, no bytes."""
        return cls(np.full(n, -1, dtype=np.int64), [], np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool), {})

    @property
    def keys(self) -> list[str]:
        """Each unit's object ("" for one not located)."""
        objects = self.objects
        return [objects[o] if o >= 0 else "" for o in self.owners.tolist()]

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[min(self.errors)]


class ShardIndexes:
    """The resolver's part that locates units (see the module's docstring)."""

    def locate(self, meta: ArrayMetadata, units: np.ndarray) -> UnitLocations:
        """Where the read units ``units`` (n, ndim) of ``meta`` are stored; reads the shard
        indexes it needs (each once, then from the cache)."""
        layout = meta.layout
        units = np.asarray(units, dtype=np.int64)
        if units.ndim != 2 or units.shape[1] != layout.ndim:
            raise InvalidArgument(f"units must have shape (n, {layout.ndim}), got {units.shape}", uri=meta.uri)
        n = len(units)
        chunk_coords = layout.chunk_coords(units)
        grid = tuple(-(-s // c) for s, c in zip(layout.shape, layout.chunk_shape))
        found = native.unique_units(chunk_coords, 0, grid) if layout.ndim and n and math.prod(grid) < 1 << 62 else None
        if found is not None:  # one native pass
            chunks, owners = found
        elif layout.ndim and n and math.prod(grid) < 1 << 62:
            ids = np.ravel_multi_index(tuple(chunk_coords.T), grid)
            uniq, owners = np.unique(ids, return_inverse=True)
            chunks = np.stack(np.unravel_index(uniq, grid), axis=1)
            owners = owners.reshape(-1).astype(np.int64, copy=False)
        elif layout.ndim and n:  # a grid too large for flat ids
            chunks, owners = np.unique(chunk_coords, axis=0, return_inverse=True)
            owners = owners.reshape(-1).astype(np.int64, copy=False)
        else:
            chunks = np.zeros((1 if n else 0, layout.ndim), dtype=np.int64)
            owners = np.zeros(n, dtype=np.int64)
        chunk_list = [tuple(c) for c in chunks.tolist()]
        objects = [meta.chunk_key(c) for c in chunk_list]
        offsets = np.zeros(n, dtype=np.int64)
        nbytes = np.full(n, -1, dtype=np.int64)
        missing = np.zeros(n, dtype=bool)
        errors: dict[int, DamacyError] = {}
        if not layout.levels or not n:
            return UnitLocations(owners, objects, offsets, nbytes, missing, errors)

        prefetched = self._prefetch_indexes(meta, objects)  # (every object holds a unit: owners index them all)
        for depth, slots in enumerate(layout.level_slots(units)):
            # the units of each container (a shard object, or a shard within an outer shard)
            live = np.flatnonzero(~missing)
            if not len(live):
                break
            o, b, z = owners[live], offsets[live], nbytes[live]
            order = np.lexsort((z, b, o))
            o, b, z = o[order], b[order], z[order]
            new = np.ones(len(o), dtype=bool)
            new[1:] = (o[1:] != o[:-1]) | (b[1:] != b[:-1]) | (z[1:] != z[:-1])
            starts = np.flatnonzero(new)
            counts = np.empty_like(starts)  # units per container
            counts[:-1] = starts[1:] - starts[:-1]
            counts[-1] = len(order) - starts[-1]
            # each container's index table (read once, then cached): the Python per container,
            # the lookups of its units below in one pass over all of them
            tables, sizes, first_entry = [], [], []
            read = np.zeros(len(starts), dtype=bool)
            n_entries = 0
            for c, (owner, base, size) in enumerate(zip(o[starts].tolist(), b[starts].tolist(), z[starts].tolist())):
                try:
                    found = self.shard_index(meta, objects[owner], base, size, depth, chunk_list[owner], prefetched if depth == 0 else None)
                except DamacyError as e:
                    idx = live[order[starts[c] : starts[c] + counts[c]]]
                    errors.update((i, e) for i in idx.tolist())  # nothing more to read for them
                    continue
                if found is None:  # the shard was never written
                    continue
                table, container = found
                read[c] = True
                tables.append(table)
                sizes.append(container)
                first_entry.append(n_entries)
                n_entries += len(table)
            in_read = np.repeat(read, counts)  # per unit (in container order): its container read
            missing[live[order[~in_read]]] = True
            if not tables:
                continue
            idx = live[order[in_read]]
            which = np.repeat(np.cumsum(read) - 1, counts)[in_read]  # each unit's index among the tables read
            entries = (np.concatenate(tables) if len(tables) > 1 else tables[0])[np.asarray(first_entry, dtype=np.int64)[which] + slots[idx]]
            empty = entries[:, 0] == EMPTY
            # an entry that reaches past the end of its shard is corrupt (entries are below
            # 2**62, so the sum cannot overflow)
            shard_bytes = np.asarray(sizes, dtype=np.uint64)[which]
            past = ~empty & (entries[:, 0] + entries[:, 1] > shard_bytes)
            for i, (off, n), size in zip(idx[past].tolist(), entries[past].tolist(), shard_bytes[past].tolist()):
                errors[i] = DecodeError(
                    f"shard index: the inner chunk at bytes [{off}, {off + n}) ends past the shard's {size} bytes",
                    uri=meta.uri,
                    path=objects[int(owners[i])],
                    chunk=tuple(units[i].tolist()),
                )
            missing[idx[empty | past]] = True
            ok = ~empty & ~past
            full = idx[ok]
            offsets[full] = offsets[full] + entries[ok, 0].astype(np.int64)
            nbytes[full] = entries[ok, 1].astype(np.int64)
        return UnitLocations(owners, objects, offsets, nbytes, missing, errors)

    def _prefetch_indexes(self, meta: ArrayMetadata, keys: list[str]) -> dict[str, object] | None:
        """The (index bytes, object size) of the outer shards among ``keys`` not yet cached,
        read :attr:`concurrency` at a time (an object store's requests together, in one
        round trip's time rather than one each); ``None`` (missing) or the exception per key."""
        if not meta.layout.levels or len(keys) < 2:
            return None
        want = [k for k in keys if self.cache.shard_indexes.peek((k, 0, 0, meta.generation)) is None]
        if len(want) < 2:
            return None
        start, length = meta.layout.levels[0].index_range()
        store = meta.store
        fetch_many = getattr(store, "read_ranges_sized", None)
        if fetch_many is not None:
            return dict(zip(want, fetch_many(want, start, length, most=self.concurrency)))

        def one(key: str) -> object:
            try:
                return store.read_range_sized(key, start, length)
            except DamacyError as e:
                return e

        return dict(zip(want, self._map(one, want)))

    def shard_index(
        self, meta: ArrayMetadata, key: str, base: int, size: int, depth: int, chunk: tuple[int, ...],
        prefetched: dict[str, object] | None = None,
    ) -> tuple[np.ndarray, int] | None:
        """The index table of the shard at ``key`` bytes [base, base+size) (size -1: the whole
        object) and the shard's size in bytes, or ``None`` when the shard object does not
        exist (``prefetched``: outer shards' reads already made, see :meth:`_prefetch_indexes`)."""
        cache_key = (key, base, depth, meta.generation)  # the array's version: a re-created one's are other entries
        found = self.cache.shard_indexes.get(cache_key)
        if found is not None:
            return found
        level = meta.layout.levels[depth]
        start, length = level.index_range()
        try:
            if size >= 0:
                if size < length:
                    raise CorruptData(f"truncated shard: {size} bytes cannot hold its {length}-byte index")
                data = meta.store.read_range(key, base + (start if start >= 0 else size - length), length)
                container = size
            else:
                if prefetched is not None and key in prefetched:
                    got = prefetched[key]
                    if isinstance(got, BaseException):
                        raise got
                else:
                    got = meta.store.read_range_sized(key, start, length)
                data, container = (None, 0) if got is None else got
            if data is None:
                return None
            found = (level.parse_index(data), container)
        except CorruptData as e:
            raise DecodeError(f"shard index: {e}", uri=meta.uri, path=key, chunk=chunk) from e
        except DamacyError as e:
            raise e.with_context(uri=meta.uri) from None
        self.cache.shard_indexes.put(cache_key, found)
        return found
