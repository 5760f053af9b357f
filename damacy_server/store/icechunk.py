"""Icechunk repositories as stores: a branch, tag or snapshot of a repository read like a
Zarr store, chunk references resolved by icechunk's own manifests (virtual chunks included).

A uri names the repository's storage, the version and the path inside::

    icechunk+file:///data/repo.icechunk?branch=main#/volumes/brain
    icechunk+s3://bucket/prefix/repo?tag=v1#/volumes/brain
    icechunk+file:///data/repo.icechunk?snapshot=45KT7CYBR0BCTGBYMX6G#/volumes/brain

(no version: ``branch=main``). A branch or tag is resolved to its snapshot when a process
first reads through it, and that snapshot is what every later read of that uri prefix sees:
a commit made meanwhile never mixes versions within a run (a new process, or
``snapshot=`` naming the new one, reads it). S3 repositories take their endpoint and
credentials from the environment as the S3 stores do (``AWS_*``). Keys are the uri prefix
``icechunk+...?...#`` followed by the path in the repository, so they never collide with
other stores' in the caches; reads go through icechunk's async store on a loop of their own.

Virtual chunks (references into other files or objects, e.g. made by VirtualiZarr) are read
by icechunk from the virtual chunk containers its repository's config declares, each only
once authorised: a process authorises every container (S3, GCS and Azure credentials from
the environment, as icechunk reads them), a daemon only those under its allowed roots and
prefixes; a chunk in any other is refused naming its container.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from urllib.parse import parse_qs, unquote, urlsplit

from damacy_protocol.errors import DamacyError, InvalidArgument, NotFound, StorageError, UnsupportedOperation
from damacy_server.store.base import ByteRange, Store, join_segments
from damacy_server.store.failures import first_line

PREFIX = "icechunk+"
#: the repositories' own storage kinds damacy opens
STORAGES = ("file", "s3")
_REFS = ("branch", "tag", "snapshot")


def is_icechunk(key: str) -> bool:
    return key.startswith(PREFIX)


def split(uri: str) -> tuple[str, str, str, str]:
    """(storage uri, version kind, version, path in the repository) of an icechunk uri; the
    base of its keys is ``PREFIX + storage uri + "?" + kind + "=" + version + "#"``."""
    parts = urlsplit(uri[len(PREFIX) :])
    kind = parts.scheme.lower()
    if kind not in STORAGES:
        raise UnsupportedOperation(f"icechunk repositories on {kind!r}:// are not supported ({', '.join(s + '://' for s in STORAGES)} are)", uri=uri)
    query = parse_qs(parts.query, keep_blank_values=True)
    given = [(k, v) for k, v in query.items() if k in _REFS]
    unknown = sorted(set(query) - set(_REFS))
    if unknown or len(given) > 1 or any(len(v) != 1 or not v[0] for _, v in given):
        raise InvalidArgument("an icechunk uri names one version: ?branch=NAME, ?tag=NAME or ?snapshot=ID", uri=uri)
    ref_kind, ref = (given[0][0], given[0][1][0]) if given else ("branch", "main")
    path = unquote(parts.fragment).strip("/")
    if any(seg in ("", ".", "..") for seg in path.split("/")) and path:
        raise InvalidArgument("a path in an icechunk repository has no empty, '.' or '..' segments", uri=uri)
    location = f"{kind}://{parts.netloc}{parts.path}".rstrip("/")
    return location, ref_kind, ref, path


class _Loop:
    """An event loop on a thread of its own, for icechunk's async store."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._pid = 0

    def get(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():  # none yet, or made before a fork
                self._loop = asyncio.new_event_loop()
                self._pid = os.getpid()
                threading.Thread(target=self._loop.run_forever, name="damacy-icechunk", daemon=True).start()
            return self._loop

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.get()).result()


_LOOP = _Loop()


def _check_location(location: str, allow: Sequence[str] | None, key: str) -> None:
    """Refuse a repository outside the allowed roots (local) and prefixes (object stores)."""
    if allow is None:
        return
    where = location
    if where.startswith("file://"):
        where = os.path.realpath(unquote(where[len("file://") :]))
    if not any(where == a or where.startswith(a.rstrip("/") + "/") for a in allow):
        raise InvalidArgument(f"{location} is outside the daemon's allowed roots and prefixes ({', '.join(allow)})", path=key)


class IcechunkStore(Store):
    """One version of one repository (its snapshot pinned when opened)."""

    remote = True  # reads go through the object-store paths (keys are uris, not files)

    def __init__(self, location: str, ref_kind: str, ref: str, allow: Sequence[str] | None = None) -> None:
        try:
            import icechunk
        except ModuleNotFoundError as e:
            raise UnsupportedOperation("reading icechunk repositories needs icechunk (pip install icechunk)", uri=location) from e
        self.location = location
        self.base = f"{PREFIX}{location}?{ref_kind}={ref}#"
        self.allow = None if allow is None else tuple(allow)
        what = f"{PREFIX}{location}"
        try:
            storage = _storage(icechunk, location)
            config = icechunk.Repository.fetch_config(storage)
            containers = list((config.virtual_chunk_containers or {}) if config is not None else {})
            self.containers = {c: self._allowed(c) for c in containers}  # url prefix -> authorised
            repo = icechunk.Repository.open(
                storage, authorize_virtual_chunk_access={c: _credentials(icechunk, c) for c, ok in self.containers.items() if ok} or None
            )
        except Exception as e:
            raise NotFound(f"no icechunk repository here ({first_line(e)})", uri=what) from None
        try:
            session = repo.readonly_session(**{"snapshot_id" if ref_kind == "snapshot" else ref_kind: ref})
        except Exception as e:
            raise NotFound(f"the repository has no {ref_kind} {ref!r} ({first_line(e)})", uri=what) from None
        self.snapshot = session.snapshot_id  # what every read of this store sees
        self._store = session.store
        self._pinned = f"{PREFIX}{location}?snapshot={self.snapshot}#"

    # -- keys ---------------------------------------------------------------------------
    def path(self, key: str) -> str:
        if not key.startswith(self.base):
            raise InvalidArgument(f"{key} is not in {self.base}", path=key)
        return key[len(self.base) :].strip("/")

    def join(self, base: str, *parts: str) -> str:
        return join_segments(base, *parts)

    def cache_key(self, key: str) -> str:
        """The key with the snapshot in place of the branch or tag (a later process may
        resolve them to a later commit)."""
        return self._pinned + key[len(self.base) :] if key.startswith(self.base) else key

    def check_allowed(self, key: str) -> None:
        """A daemon serves a repository only under one of its allowed roots (local) or
        prefixes (object stores)."""
        _check_location(self.location, self.allow, key)

    def _allowed(self, container: str) -> bool:
        """May this process read the virtual chunks of ``container`` (a url prefix)?"""
        if self.allow is None:
            return True
        if container.startswith("file://"):
            where = os.path.realpath(unquote(container[len("file://") :]))
            return any(where == a or where.startswith(a.rstrip("/") + "/") for a in self.allow)
        prefix = container.rstrip("/")
        return any(prefix == a or prefix.startswith(a.rstrip("/") + "/") for a in self.allow if "://" in a)

    # -- reads --------------------------------------------------------------------------
    async def _get(self, key: str, offset: int, length: int) -> bytes | None:
        from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
        from zarr.core.buffer import default_buffer_prototype

        if offset < 0:
            request = SuffixByteRequest(-offset)
        elif length < 0:
            request = OffsetByteRequest(offset) if offset else None
        else:
            request = RangeByteRequest(offset, offset + length)
        try:
            got = await self._store.get(self.path(key), prototype=default_buffer_prototype(), byte_range=request)
        except DamacyError:
            raise
        except Exception as e:
            text = " ".join(str(e).replace("|", " ").split())  # (icechunk's message comes folded)
            if "authorize the virtual chunk container" in text:
                refused = [c for c, ok in self.containers.items() if not ok and c in text] or [c for c, ok in self.containers.items() if not ok]
                raise InvalidArgument(
                    f"a virtual chunk of {PREFIX}{self.location} is in {', '.join(refused) or 'a container the repository does not declare'}, "
                    f"outside the daemon's allowed roots and prefixes ({', '.join(self.allow or ())})", path=key
                ) from None
            raise StorageError(f"icechunk: {first_line(e)}", path=key) from None
        return None if got is None else got.to_bytes()

    async def _size(self, key: str) -> int | None:
        try:
            return int(await self._store.getsize(self.path(key)))
        except FileNotFoundError:
            return None
        except DamacyError:
            raise
        except Exception as e:
            if "not found" in str(e).lower():
                return None
            raise StorageError(f"icechunk: {first_line(e)}", path=key) from None

    def read(self, key: str) -> bytes | None:
        return _LOOP.run(self._get(key, 0, -1))

    def read_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes] | None:
        out = []
        for offset, length in ranges:
            got = _LOOP.run(self._get(key, offset, length))
            if got is None:
                return None
            out.append(got)
        return out

    def read_range_sized(self, key: str, offset: int, length: int) -> tuple[bytes, int] | None:
        size = self.size(key)
        if size is None:
            return None
        data = _LOOP.run(self._get(key, offset, length))
        return None if data is None else (data, size)

    def size(self, key: str) -> int | None:
        return _LOOP.run(self._size(key))

    async def fetch(self, key: str, offset: int, length: int) -> bytes | None:
        """The bytes [offset, offset + length) of ``key`` (length -1: to the end), awaited
        from any event loop (the executor's fetcher)."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._get(key, offset, length), _LOOP.get()))

    def fetch_many(self, reads: Sequence[tuple[str, int, int]], most: int = 64) -> list:
        async def all_of():
            gate = asyncio.Semaphore(most)

            async def one(key: str, offset: int, length: int):
                async with gate:
                    try:
                        return await self._get(key, offset, length)
                    except DamacyError as e:
                        return e

            return await asyncio.gather(*(one(*r) for r in reads))

        return list(_LOOP.run(all_of()))


def _storage(icechunk, location: str):
    """icechunk's storage for a location (S3: endpoint and credentials from ``AWS_*``)."""
    kind, rest = location.split("://", 1)
    if kind == "file":
        return icechunk.local_filesystem_storage(unquote("/" + rest.lstrip("/")) if rest.startswith("/") else unquote(rest))
    bucket, _, prefix = rest.partition("/")
    env = os.environ
    return icechunk.s3_storage(
        bucket=bucket, prefix=prefix or None, region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
        endpoint_url=env.get("AWS_ENDPOINT_URL"), allow_http=env.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true", "yes"),
        access_key_id=env.get("AWS_ACCESS_KEY_ID"), secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
        session_token=env.get("AWS_SESSION_TOKEN"), force_path_style=bool(env.get("AWS_ENDPOINT_URL")),
    )


def _credentials(icechunk, container: str):
    """The credentials icechunk reads a virtual chunk container's objects with: from the
    environment for S3, GCS and Azure, none for local files and HTTP."""
    scheme = container.split("://", 1)[0].lower()
    if scheme in ("s3", "s3a"):
        return icechunk.s3_from_env_credentials()
    if scheme in ("gs", "gcs"):
        return icechunk.gcs_from_env_credentials()
    if scheme in ("az", "azure", "abfs", "abfss"):
        return icechunk.azure_from_env_credentials()
    return None


class IcechunkStores:
    """The icechunk stores of a process (or a daemon), one per (repository, version),
    opened on first use and kept: the snapshot a run reads stays the same."""

    def __init__(self, allow: Sequence[str] | None = None) -> None:
        self.allow = None if allow is None else list(allow)
        self._stores: dict[tuple[str, str, str], IcechunkStore] = {}
        self._lock = threading.Lock()

    def resolve(self, uri: str) -> tuple[IcechunkStore, str]:
        location, kind, ref, path = split(uri)
        _check_location(location, self.allow, uri)  # before the repository is opened: nothing of it read
        key = (location, kind, ref)
        with self._lock:
            store = self._stores.get(key)
        if store is None:
            store = IcechunkStore(location, kind, ref, self.allow)
            with self._lock:
                store = self._stores.setdefault(key, store)
        root = store.base + ("/" + path if path else "")
        return store, root
