"""The resolve stage: uri → cached array metadata, and read units → where their bytes are.

:class:`Resolver` is shared by every pipeline of a process (and every session of the
daemon): parsed ``zarr.json`` files and shard indexes are read once and kept in bounded
LRU caches.

Units are located in the shard indexes those caches keep by :mod:`damacy_server.plan.locate`.

(Over 400 lines: one job, metadata behind uris: arrays, NGFF images and plates resolve
through the same node loading, consolidated metadata, freshness checks and caches.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from damacy_protocol.errors import DamacyError, InvalidArgument, MetadataError, NotFound, StorageError
from damacy_protocol.limits import MetadataCache
from damacy_server.cache import LRUCache
from damacy_server.plan.locate import ShardIndexes
from damacy_server.plan.versions import Generations, Seen, differs, node_version
from damacy_server.store import RemoteStores, Store, is_remote, resolve_uri
from damacy_server.store.failures import first_line
from damacy_server.store.latency import MetadataReads
from damacy_server.zarr.metadata import (
    ArrayMetadata,
    check_node,
    consolidated_entries,
    consolidated_node,
    load_node,
    parse_array_metadata,
)
from damacy_server.zarr.ngff import (
    Image,
    Level,
    Plate,
    Well,
    image_multiscale,
    multiscale_path,
    parse_axes,
    plate_wells,
    transforms,
    well_fields,
)

T = TypeVar("T")
R = TypeVar("R")


class Caches:
    """The caches a :class:`Resolver` keeps, bounded as a
    :class:`~damacy_protocol.limits.MetadataCache` says: parsed array metadata by entries (a
    parsed ``zarr.json`` is a few KiB) and shard indexes by entries and by bytes (a shard's
    index grows with its chunks, 16 bytes each, so 8192 indexes of 10^4 chunks would hold
    1.3 GiB). ``stats()`` reports the shard indexes' bytes."""

    def __init__(self, limits: MetadataCache | None = None) -> None:
        limits = limits if limits is not None else MetadataCache()
        self.limits = limits
        self.arrays: LRUCache[_Entry] = LRUCache(limits.array_entries)
        self.shard_indexes: LRUCache[tuple[np.ndarray, int]] = LRUCache(
            limits.shard_index_entries, max_bytes=limits.shard_index_bytes, sizeof=_index_nbytes
        )  # (table, shard bytes)

    def stats(self) -> dict[str, dict[str, int]]:
        return {"arrays": self.arrays.stats(), "shard_indexes": self.shard_indexes.stats()}


def _index_nbytes(entry: tuple[np.ndarray, int]) -> int:
    return int(entry[0].nbytes) + 64


#: metadata and shard-index reads in flight while planning, when the reader does not say
DEFAULT_CONCURRENCY = 64


def keys_under(roots: Iterable[str]) -> Callable[[Hashable], bool]:
    """Whether a cache key (a root or object key, or a tuple that starts with one) names one
    of ``roots`` or something below one (its own path walked up: a pass over a cache costs
    the keys' depth, not the roots' number)."""
    wanted = {r.rstrip("/") or r for r in roots}

    def test(key: Hashable) -> bool:
        k = key[0] if isinstance(key, tuple) else key
        if not isinstance(k, str):
            return False
        while True:
            if k in wanted:
                return True
            k, sep, _ = k.rpartition("/")
            if not sep or not k:
                return False

    return test


def _above(root: str) -> Iterator[str]:
    """``root`` and the folders above it."""
    while True:
        yield root
        root, sep, _ = root.rpartition("/")
        if not sep or not root:
            return


@contextlib.contextmanager
def _malformed(uri: str) -> Iterator[None]:
    """Metadata that parsing could not take (a value of a wrong type or out of range where no
    check named it) raised as :class:`MetadataError` naming the array, never as a bare
    Python error."""
    try:
        yield
    except DamacyError:
        raise
    except (TypeError, ValueError, OverflowError, KeyError, IndexError, AttributeError, RecursionError) as e:
        raise MetadataError(f"malformed metadata ({type(e).__name__}: {first_line(e)})", uri=str(uri)) from e


class _Entry:
    """What the array cache holds: an array's metadata or an image, and what it was read
    from (see :mod:`damacy_server.plan.versions`)."""

    __slots__ = ("value", "seen")

    def __init__(self, value: object, seen: Seen) -> None:
        self.value = value
        self.seen = seen


class Resolver(ShardIndexes):
    """Array metadata and shard indexes, loaded through ``reader`` and kept in ``cache``.

    While a batch is planned, the ``zarr.json`` files of the arrays it names and the outer
    shard indexes it needs that are not cached yet are read up to ``reader.concurrency``
    (``FileMetadataReader(concurrency=64)``) at a time: local files on that many threads,
    object stores as that many requests in flight."""

    def __init__(
        self,
        reader: Store | None = None,
        cache: Caches | None = None,
        remote: RemoteStores | None = None,
        *,
        recheckable: bool = True,
    ) -> None:
        """``recheckable``: ask each node's version as it is loaded (a stat, or a HEAD in an
        object store), so that :meth:`recheck` can tell a change; off where the caches live
        no longer than one run (an embedded pipeline's)."""
        #: the reads of ``reader`` counted (and slowed by its LatencyModel, where it has one)
        self.reads = MetadataReads(reader, getattr(reader, "latency", None)) if reader is not None else None
        self.reader = self.reads
        self.recheckable = recheckable
        self.cache = cache if cache is not None else Caches()
        self.remote = remote
        self.concurrency: int = getattr(reader, "concurrency", DEFAULT_CONCURRENCY)
        # the consolidated metadata of groups loaded (root -> {path below: node}); apart from
        # the array cache, whose counters say how often arrays were parsed
        self.consolidated: LRUCache[dict] = LRUCache(64)
        # the array cache holds _Entry(value, Seen): what recheck() compares (see versions.py)
        self._fresh: dict[tuple[str, int | None], float] = {}  # request -> when last rechecked
        self._generations = Generations()
        self._keep_lock = threading.Lock()
        self._forgotten: dict[str, float] = {}  # root -> when last forgotten
        self.rechecked = 0  # documents whose version was asked again
        self.changed = 0  # nodes found changed, and forgotten
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._pool_lock = threading.Lock()

    def _map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """``fn`` of each item, at most :attr:`concurrency` at once (here, for one item or a
        concurrency of 1). ``fn`` returns its errors rather than raising them."""
        if self.concurrency <= 1 or len(items) < 2:
            return [fn(x) for x in items]
        with self._pool_lock:
            if self._pool is None or self._pool_pid != os.getpid():  # none yet, or made before a fork
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="damacy-metadata")
                self._pool_pid = os.getpid()
            pool = self._pool
        return list(pool.map(fn, items))

    def arrays(
        self, requests: Iterable[tuple[str, int | None]], since: float | None = None
    ) -> dict[tuple[str, int | None], ArrayMetadata | DamacyError]:
        """:meth:`array` of each distinct ``(uri, level)``: the metadata, or the error loading
        it raised. Those not cached yet are loaded concurrently (see the class). ``since``:
        see :meth:`array`."""
        wanted = list(dict.fromkeys(requests))
        cold = [r for r in wanted if not self._cached(*r)]
        out: dict[tuple[str, int | None], ArrayMetadata | DamacyError] = {}
        if len(cold) > 1:
            out.update(zip(cold, self._map(lambda r: self._array_or_error(r, since), cold)))
        for r in wanted:
            if r not in out:
                out[r] = self._array_or_error(r, since)
        return out

    def _array_or_error(self, request: tuple[str, int | None], since: float | None = None) -> ArrayMetadata | DamacyError:
        try:
            return self.array(*request, since=since)
        except DamacyError as e:
            return e
        except Exception as e:  # never the whole batch's: the sample's, naming what failed
            return MetadataError(f"loading its metadata failed: {type(e).__name__}: {first_line(e)}", uri=str(request[0]))

    def _cached(self, uri: str, level: int | None) -> bool:
        """Is the metadata :meth:`array` would load for ``(uri, level)`` cached (a glance: no
        counter moves, nothing is read)?"""
        try:
            _, root = self.store_of(uri)
        except DamacyError:
            return True  # refused by name: nothing to read
        return self._peek(root if level is None else (root, "ngff-image")) is not None

    def recheck(self, requests: Iterable[tuple[str, int | None]], since: float) -> None:
        """Make sure what is cached for ``requests`` (``(uri, level)``) was read, or found
        unchanged in storage, at or after ``since`` (``time.monotonic()``): an entry cached
        before it is checked the first time a request names it after it, by the versions of
        the documents it was read from (see :mod:`damacy_server.plan.versions`), those of a
        batch together (as many at once as :attr:`concurrency`); what changed (an array re-
        created, its metadata rewritten) is forgotten, to be read anew. Chunks rewritten in
        place under unchanged documents are not seen."""
        began = time.monotonic()  # what is marked checked is as of before storage was asked
        fresh = self._fresh
        asked = []
        todo: dict[Hashable, tuple[str, Seen]] = {}
        for request in dict.fromkeys(requests):
            if fresh.get(request, -math.inf) >= since:
                continue
            asked.append(request)
            try:
                _, root = self.store_of(request[0])
            except Exception:  # refused by name: the planner says why
                continue
            keys: list[Hashable] = [root]
            if request[1] is not None:
                keys = [(root, "ngff-image")]
                image = self._peek(keys[0])
                if isinstance(image, Image) and isinstance(request[1], int) and 0 <= request[1] < len(image.levels):
                    with contextlib.suppress(Exception):
                        keys.append(self.store_of(image.levels[request[1]].uri)[1])
            for key in keys:
                entry = self.cache.arrays.peek(key)
                if entry is not None and entry.seen.checked < since and entry.seen.version is not None:
                    todo[key] = (key[0] if isinstance(key, tuple) else key, entry.seen)
            # the consolidated metadata of groups above it (a plate's, an image's): what a
            # node not cached yet would be read from
            for group in _above(root):
                found = self.consolidated.peek(group)
                if found is not None and found[1].checked < since and found[1].version is not None:
                    todo[("consolidated", group)] = (group, found[1])
        if todo:
            now = time.monotonic()
            docs = list({(id(seen.store), r): (seen.store, r) for _, seen in todo.values() for r, _ in seen.docs}.items())
            versions = self._map(lambda doc: node_version(*doc[1]), docs)
            current = {key: v for (key, _), v in zip(docs, versions)}
            self.rechecked += len(docs)
            gone = []
            for root, seen in todo.values():
                changed = [r for r, then in seen.docs if differs(then, current[(id(seen.store), r)])]
                if changed:
                    gone.extend([root, *changed])
                else:
                    seen.checked = now
            if gone:
                self.forget(*dict.fromkeys(gone))
        if len(fresh) > 1 << 16:
            fresh.clear()
        for request in asked:  # (a session opened while this ran checks them again)
            fresh[request] = began

    def forget(self, *roots: str) -> None:
        """Forget the metadata cached from the nodes at ``roots`` and below them (arrays,
        images, consolidated metadata of groups at or above them: it describes them). What
        caches hold of their data is named by their versions: a node read anew is not taken
        for the one forgotten, whose entries leave by the caches' own order."""
        under = keys_under(roots)
        above = {a for r in roots for a in _above(r)}
        now = time.monotonic()
        with self._keep_lock:  # (a read that began before this is not kept after it: _keep)
            if len(self._forgotten) > 1 << 16:  # a read lasts seconds, not an hour
                self._forgotten = {r: t for r, t in self._forgotten.items() if t > now - 3600}
            for root in roots:
                self._forgotten[root] = now
            self.cache.arrays.discard_where(under)
            self.consolidated.discard_where(lambda k: under(k) or k in above)
        self._fresh.clear()  # (what was checked stays so: asking again costs no request)
        self.changed += len(roots)

    def _peek(self, key: Hashable) -> object | None:
        entry = self.cache.arrays.peek(key)
        return None if entry is None else entry.value

    def store_of(self, uri: str) -> tuple[Store, str]:
        """The store that reads ``uri`` (local paths: ``reader`` when set; object-store uris:
        ``remote``'s store for the bucket) and the key of its root."""
        store, root = resolve_uri(uri, self.remote)
        if self.reader is not None and not is_remote(root):
            store = self.reader
        return store, root

    def check_allowed(self, uri: str) -> None:
        """Refuse ``uri`` early, by name, when this metadata's stores may not read it."""
        store, root = self.store_of(uri)
        check = getattr(store, "check_allowed", None)
        if check is not None:
            check(root)

    def array(self, uri: str, level: int | None = None, since: float | None = None) -> ArrayMetadata:
        """The metadata of the array at ``uri`` (an NGFF image resolves to its level 0, or to
        level ``level``). ``since``: what :meth:`recheck` made sure of for it; an entry cached
        older than that all the same (a read that began before and finished after the check)
        is checked again first."""
        if level is not None:
            image = self.image(uri, since)
            if level >= len(image.levels):
                raise InvalidArgument(f"the NGFF image has {len(image.levels)} levels (0 to {len(image.levels) - 1}), level {level} asked", uri=str(uri))
            failed = image.levels[level].error
            if failed is not None:  # that level only: the image's others read
                raise failed.copy()
            return self.array(image.levels[level].uri, since=since)
        store, root = self.store_of(uri)
        entry = self._current(root, (str(uri), None), since)
        if entry is not None:
            return entry.value
        began, docs = time.monotonic(), []
        with _malformed(uri):
            meta = self._load(store, root, str(uri), docs)
        return self._keep(root, meta, Seen(store, tuple(docs), began))

    def _keep(self, key: Hashable, value: T, seen: Seen) -> T:
        """Cache ``value`` read from ``seen``'s documents (an array's metadata stamped with
        their versions), unless an entry read later is there (a read that began before a
        re-creation must not replace what a check after it read); returns what is cached."""
        if isinstance(value, ArrayMetadata):
            version = seen.version
            value = dataclasses.replace(value, version=version, generation=self._generations.of(value.root, version))
        root = key[0] if isinstance(key, tuple) else key
        with self._keep_lock:
            if any(self._forgotten.get(a, -math.inf) > seen.checked for a in _above(root)):
                return value  # read before it (or a node above it) was found changed: not kept
            there = self.cache.arrays.peek(key)
            if there is not None and there.seen.checked > seen.checked:
                return there.value
            self.cache.arrays.put(key, _Entry(value, seen))
        return value

    def _node(self, store: Store, root: str, uri: str, docs: list, own: bool = False) -> dict:
        """The metadata document at ``root``: from the consolidated metadata of a group this
        cache loaded above it (no request), unless ``own`` (a node named directly reads its
        own document), else read; a group's consolidated metadata is remembered for its nodes.
        The document it came from, with its version, goes to ``docs``."""
        found = None if own else self._consolidated(root)
        if found is not None:
            entry, group, version = found
            docs.append((group, version))
            return consolidated_node(entry, uri)
        began = time.monotonic()
        version = node_version(store, root) if self.recheckable else None
        docs.append((root, version))  # (before it is read: a node missing now is seen when it comes)
        doc = load_node(store, root, uri)
        nodes = consolidated_entries(doc)
        if nodes:
            self.consolidated.put(root, (nodes, Seen(store, ((root, version),), began)))
        return doc

    def _consolidated(self, root: str) -> tuple[dict, str, Hashable | None] | None:
        """The entry of the node at ``root`` in the consolidated metadata of a group above it,
        that group's root, and its document's version."""
        if not len(self.consolidated):
            return None
        parent = root
        while True:
            parent, sep, _ = parent.rpartition("/")
            if not sep or not parent or parent.endswith(":/"):
                return None
            found = self.consolidated.get(parent)
            if found is not None:
                entry = found[0].get(root[len(parent) + 1 :])
                if entry is not None:
                    return entry, parent, found[1].docs[0][1]

    def _load(self, store: Store, root: str, uri: str, docs: list) -> ArrayMetadata:
        doc = self._node(store, root, uri, docs, own=True)
        if check_node(doc, uri) == "group":
            path = multiscale_path(doc, uri)
            if path is None:
                raise InvalidArgument("names a Zarr group, not an array (nor an NGFF image)", uri=uri)
            return self._level(store, root, path, 0, uri, docs)
        return parse_array_metadata(doc, uri=uri, store=store, root=root)

    def _level(
        self, store: Store, root: str, path: str, index: int, uri: str, docs: list, level_uri: str | None = None
    ) -> ArrayMetadata:
        """The array of an NGFF image's level ``index`` at ``path`` (named ``level_uri``, by
        default the image's); errors name the image and say what is there."""
        level_root = store.join(root, *path.split("/"))
        try:
            doc = self._node(store, level_root, uri, docs)
        except NotFound:
            raise NotFound(f"NGFF image level {index} ({path!r}) has no array: nothing at {path}", uri=uri) from None
        if check_node(doc, uri) == "group":
            raise InvalidArgument(f"NGFF image level {index} ({path!r}) is a Zarr group; a level must be an array", uri=uri)
        return parse_array_metadata(doc, uri=level_uri or uri, store=store, root=level_root)

    def _current(self, key: Hashable, request: tuple[str, int | None], since: float | None) -> _Entry | None:
        """The entry under ``key``, checked again first when it is older than ``since``."""
        entry = self.cache.arrays.get(key)
        if entry is not None and since is not None and entry.seen.checked < since and entry.seen.version is not None:
            self._fresh.pop(request, None)
            self.recheck([request], since)
            entry = self.cache.arrays.get(key)
        return entry

    def image(self, uri: str, since: float | None = None) -> Image:
        """The NGFF image at ``uri``: its axes and every level's array, scale and translation
        (kept in the array cache beside its levels). ``since``: as for :meth:`array`."""
        store, root = self.store_of(uri)
        entry = self._current((root, "ngff-image"), (str(uri), 0), since)
        if entry is not None:
            return entry.value
        began, docs = time.monotonic(), []
        with _malformed(uri):
            image = self._image(store, root, uri, docs, began)
        return self._keep((root, "ngff-image"), image, Seen(store, tuple(docs), began))

    def plate(self, uri: str) -> Plate:
        """The NGFF plate at ``uri``: its wells and the uris of their fields, from the plate's
        and the wells' metadata (read ``concurrency`` at a time); no image is opened."""
        store, root = self.store_of(uri)
        doc = self._node(store, root, str(uri), [])
        if check_node(doc, str(uri)) != "group":
            raise InvalidArgument("is an array, not an NGFF plate", uri=str(uri))
        version, name, rows, columns, wells = plate_wells(doc, str(uri))
        base = str(uri).rstrip("/")

        def fields(well: tuple[str, str, str]) -> tuple[str, ...] | DamacyError:
            path = well[0]
            try:
                wdoc = self._node(store, store.join(root, *path.split("/")), f"{base}/{path}", [])
                return tuple(f"{base}/{path}/{f}" for f in well_fields(wdoc, f"{base}/{path}"))
            except DamacyError as e:
                return e

        found = self._map(fields, wells)
        for f in found:
            if isinstance(f, DamacyError):
                raise f
        return Plate(str(uri), version, name, rows, columns, tuple(Well(p, r, c, f) for (p, r, c), f in zip(wells, found)))

    def _image(self, store: Store, root: str, uri: str, docs: list, began: float) -> Image:
        """The image at ``root``, its levels read anew (a level cached alone may be older than
        the image) and kept; ``docs`` takes the group's document and every level's."""
        doc = self._node(store, root, str(uri), docs, own=True)
        if check_node(doc, str(uri)) != "group" or (found := image_multiscale(doc, str(uri))) is None:
            raise InvalidArgument("is not an NGFF image (no multiscales in its group's attributes)", uri=str(uri))
        version, multiscale = found
        datasets = multiscale.get("datasets")
        if not isinstance(datasets, list) or not datasets:
            raise MetadataError("NGFF multiscales[0].datasets must be a non-empty list", uri=str(uri))
        levels = []
        axes = None
        ndim = None  # the image's axes: the first readable level's (they must list that many)
        for index in range(len(datasets)):
            path, level_uri = "", str(uri)
            level_docs: list = []
            try:  # a level that cannot be read or described fails its samples, not the others'
                path = multiscale_path(doc, str(uri), index)
                level_uri = f"{str(uri).rstrip('/')}/{path}"
                with _malformed(level_uri):
                    meta = self._level(store, root, path, index, str(uri), level_docs, level_uri)
                if ndim is not None and meta.ndim != ndim:
                    raise MetadataError(f"NGFF level {index} has {meta.ndim} axes, the image {ndim}", uri=level_uri)
                found_axes = axes if axes is not None else parse_axes(multiscale, meta.ndim, str(uri))
                scale, translation = transforms(datasets[index].get("coordinateTransformations"), meta.ndim, level_uri)
                outer, shift = transforms(multiscale.get("coordinateTransformations"), meta.ndim, str(uri))
            except StorageError:
                raise  # perhaps passing: the image is not kept with it
            except DamacyError as e:
                levels.append(Level(index, path, level_uri, (), None, (), (), error=e))
                continue
            finally:
                docs.extend(level_docs)
            axes, ndim = found_axes, meta.ndim
            meta = self._keep(store.join(root, *path.split("/")), meta, Seen(store, tuple(level_docs), began))
            levels.append(Level(
                index, path, level_uri, meta.shape, meta.dtype,
                tuple(a * b for a, b in zip(scale, outer)), tuple(a * b + c for a, b, c in zip(translation, outer, shift)),
            ))
        if axes is None:  # no level could be read: the first one's error
            raise levels[0].error.copy()
        name = multiscale.get("name") if isinstance(multiscale.get("name"), str) else None
        return Image(str(uri), version if isinstance(version, str) else None, name, axes or (), tuple(levels))


class ZarrMetadata:
    """Where array metadata and shard indexes come from, as settings: the ``reader`` that
    reads them (a :class:`~damacy_server.store.file.FileMetadataReader`), the ``cache``
    capacities (a :class:`~damacy_protocol.limits.MetadataCache`) and (damacy's) ``remote``
    object-store options (:class:`~damacy_server.store.remote.RemoteStores`). It holds no
    cache itself: each planner made with it keeps caches of its own (a fresh set each time
    a pipeline starts with it), so any number of planners may share one."""

    __slots__ = ("reader", "cache", "remote", "__weakref__")

    def __init__(self, *, reader: Store, cache: MetadataCache, remote: RemoteStores | None = None) -> None:
        from damacy_server.store.file import FileMetadataReader

        if not isinstance(reader, FileMetadataReader):
            raise TypeError(f"reader must be a FileMetadataReader, got {type(reader).__name__}")
        if not isinstance(cache, MetadataCache):
            raise TypeError(f"cache must be a MetadataCache, got {type(cache).__name__}")
        if remote is not None and not isinstance(remote, RemoteStores):
            raise TypeError(f"remote must be a RemoteStores or None, got {type(remote).__name__}")
        self.reader = reader
        self.cache = cache
        self.remote = remote

    def resolver(self, *, recheckable: bool = False) -> Resolver:
        """A new :class:`Resolver` with these settings and empty caches of its own."""
        return Resolver(self.reader, Caches(self.cache), self.remote, recheckable=recheckable)

    def __repr__(self) -> str:
        remote = "" if self.remote is None else f", remote={self.remote!r}"
        return f"ZarrMetadata(reader={self.reader!r}, cache={self.cache!r}{remote})"
