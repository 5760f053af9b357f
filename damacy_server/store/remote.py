"""Object stores (S3, GCS, Azure, HTTP) through obstore.

A remote key is the object's whole uri (``s3://bucket/path/c/0/0``), so keys from different
stores never collide in the caches, and a key says which store reads it. One
:class:`ObjectStore` serves one bucket (or HTTP host) with one set of options; the
:class:`RemoteStores` of a process (or of a daemon) makes them on demand.

Credentials and endpoints come from the environment as the clouds' own tools read it (for
S3: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ALLOW_HTTP``), with options per uri prefix on
top (``Config.storage_options``, ``damacyd --storage-option``). Requests that fail with a
5xx status or time out are retried with exponential backoff by obstore; what still fails
raises :class:`StorageError` naming the object and the HTTP status. obstore releases the
GIL while it waits.

A daemon lists the prefixes it serves (``--allow-prefix``); every key is checked against
them when it is read, not only the uri a client named (an NGFF level's path comes from
metadata). Dot segments and empty segments are refused in every remote uri: a server may
normalise ``a/../b`` to ``b`` where a prefix check would not.

(Over 400 lines: one job, objects behind uris: keys and their checks, options, whole, ranged
and sized reads, versions, and the event loop their requests in flight share.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import os
import threading
import time
from collections.abc import Mapping, Sequence
from urllib.parse import unquote, urlsplit

from damacy_protocol.errors import DamacyError, InvalidArgument, StorageError, UnsupportedOperation
from damacy_server.store.base import MISSING, ByteRange, Store, join_segments
from damacy_server.store.failures import first_line, http_status, storage_error, unanswered

#: uri schemes read through obstore
SCHEMES = ("s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "http", "https")
_PREFIXES = tuple(f"{s}://" for s in SCHEMES)

#: obstore's HTTP client options (the rest of a prefix's options configure the store itself)
CLIENT_OPTIONS = frozenset({
    "allow_http", "allow_invalid_certificates", "connect_timeout", "default_content_type",
    "http1_only", "http2_only", "http2_keep_alive_interval", "http2_keep_alive_timeout",
    "http2_keep_alive_while_idle", "pool_idle_timeout", "pool_max_idle_per_host", "proxy_url",
    "timeout", "user_agent",
})
#: retry options: ``max_retries`` (default 3) and ``retry_timeout`` (seconds, default 60)
RETRY_OPTIONS = frozenset({"max_retries", "retry_timeout"})
#: how long a store whose server does not take HEAD requests is not asked for versions again
NO_HEAD_S = 300.0
NO_HEAD_STATUS = (405, 501)  # a server that does not take HEAD requests says one of these
#: a request's defaults: long enough for a large range over a slow link, short enough that a
#: stalled server is reported within a minute or two rather than obstore's three
DEFAULT_CLIENT = {"timeout": "30s", "connect_timeout": "5s"}
DEFAULT_RETRY = {"max_retries": 3, "retry_timeout": 60.0}

#: where the environment holds a scheme's client options (``AWS_ALLOW_HTTP``, ...)
_ENV_PREFIX = {"s3": "AWS", "s3a": "AWS", "gs": "GOOGLE", "az": "AZURE", "azure": "AZURE", "abfs": "AZURE", "abfss": "AZURE"}
#: schemes whose stores cannot ask for the last n bytes of an object (Azure's blob API)
_NO_SUFFIX = ("az://", "azure://", "abfs://", "abfss://")


def _endpoint(options: Mapping[str, str], env: str | None) -> str | None:
    """The server a store's options or environment name in place of the cloud's own (an
    S3-compatible server, an emulator), or None."""
    def names_server(name: str) -> bool:
        name = name.upper()
        return ("ENDPOINT" in name or name.endswith("URL")) and "PROXY" not in name

    named = [str(v) for k, v in sorted(options.items()) if names_server(k)]
    if not named and env is not None:
        prefixes = (f"{env}_", "AZURITE_") if env == "AZURE" else (f"{env}_",)
        named = [os.environ[n] for n in sorted(os.environ) if n.startswith(prefixes) and names_server(n)]
    return " ".join(named) or None


def is_remote(key: str) -> bool:
    """Does ``key`` (a uri or a store key) name an object in an object store (or in an
    icechunk repository: read like one)?"""
    return key.startswith(_PREFIXES) or key.startswith("icechunk+")


def normalized(uri: str) -> str:
    """``uri`` as a key: scheme lower-cased, no trailing slash; refuses what a prefix check
    could be fooled by (dot or empty segments, queries, fragments, credentials)."""
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise UnsupportedOperation(f"storage scheme {scheme!r}:// is not supported", uri=uri)
    if not parts.netloc:
        raise InvalidArgument("the uri names no bucket or host", uri=uri)
    if parts.query or parts.fragment:
        raise InvalidArgument("a storage uri takes no query or fragment", uri=uri)
    if "@" in parts.netloc and not (scheme in ("abfs", "abfss") and ":" not in parts.netloc.split("@")[0]):
        # (abfs[s]://container@account.dfs.core.windows.net names a container, not a user)
        raise InvalidArgument("credentials do not go in the uri (use the environment or storage options)", uri=uri)
    path = parts.path.rstrip("/")
    for segment in path.split("/")[1:]:
        if unquote(segment) in ("", ".", ".."):
            raise InvalidArgument(f"the uri has an empty, '.' or '..' segment ({segment!r})", uri=uri)
    return f"{scheme}://{parts.netloc}{path}"


def _outside(key: str, allow: Sequence[str]) -> InvalidArgument:
    """The refusal of ``key``, outside every allowed prefix."""
    if not allow:
        return InvalidArgument("this damacyd serves no object stores (start it with --allow-prefix URI)", path=key)
    return InvalidArgument(f"{key} is outside the daemon's allowed prefixes ({', '.join(allow)})", path=key)


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + "/")


class ObjectStore(Store):
    """Reads the objects of one bucket (or HTTP host): keys are uris starting with ``base``."""

    remote = True

    def __init__(self, base: str, options: Mapping[str, str] | None = None, allow: Sequence[str] | None = None) -> None:
        try:
            from obstore.store import from_url
        except ModuleNotFoundError as e:
            raise UnsupportedOperation(
                "reading object stores needs obstore (pip install obstore)", uri=base
            ) from e
        self.base = base
        self.allow = None if allow is None else tuple(allow)
        self._no_head_until = 0.0  # see version()
        # Azure's blob API has no suffix ranges ("the last n bytes", how shard indexes at the
        # end are read): there the object's size is asked first and the range counted from it
        self.suffix_ranges = not base.startswith(_NO_SUFFIX)
        config: dict[str, str] = {}
        client, retry = dict(DEFAULT_CLIENT), dict(DEFAULT_RETRY)
        # client options given replace obstore's own reading of them from the environment
        env = _ENV_PREFIX.get(base.split("://", 1)[0])
        for name in CLIENT_OPTIONS:
            if env is not None and f"{env}_{name.upper()}" in os.environ:
                client[name] = os.environ[f"{env}_{name.upper()}"]
        if base.startswith("http://"):
            client["allow_http"] = "true"  # the uri says plain HTTP
        self.endpoint = _endpoint(options or {}, env)
        for name, value in (options or {}).items():
            (client if name in CLIENT_OPTIONS else retry if name in RETRY_OPTIONS else config)[name] = value
        try:
            retry_config = {
                "max_retries": int(retry["max_retries"]),
                "retry_timeout": datetime.timedelta(seconds=float(retry["retry_timeout"])),
                "backoff": {"init_backoff": datetime.timedelta(milliseconds=100), "max_backoff": datetime.timedelta(seconds=15), "base": 2.0},
            }
            self._store = from_url(base, config=config or None, client_options=client, retry_config=retry_config)
        except (ValueError, TypeError) as e:
            raise InvalidArgument(f"storage options for {base}: {e}", uri=base) from None
        except Exception as e:  # obstore's configuration errors (an unknown key, a bad value)
            raise InvalidArgument(f"storage options for {base}: {first_line(e)}", uri=base) from None

    # -- keys ---------------------------------------------------------------------
    def path(self, key: str) -> str:
        """The object's path in the store; refuses a key outside the store or the allowed
        prefixes."""
        if not _under(key, self.base) or key == self.base:
            raise InvalidArgument(f"{key} is not an object of {self.base}", path=key)
        if self.allow is not None and not any(_under(key, p) for p in self.allow):
            raise self.outside(key)
        return key[len(self.base) + 1 :]

    def outside(self, key: str) -> InvalidArgument:
        return _outside(key, self.allow or ())

    def check_allowed(self, key: str) -> None:
        if self.allow is not None and not any(_under(key, p) for p in self.allow):
            raise self.outside(key)

    def cache_key(self, key: str) -> str:
        """The key with the endpoint, where one is named: another server's bucket of the same
        name holds other objects."""
        return key if self.endpoint is None else f"{key} at {self.endpoint}"

    def join(self, base: str, *parts: str) -> str:
        return join_segments(base, *parts)

    # -- reads ----------------------------------------------------------------------
    def read(self, key: str) -> bytes | None:
        import obstore

        path = self.path(key)
        try:
            return bytes(obstore.get(self._store, path).bytes())
        except FileNotFoundError:
            return None
        except Exception as e:
            raise storage_error(e, key) from None

    def read_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes] | None:
        out = []
        for offset, length in ranges:
            got = self._range(key, offset, length)
            if got is None:
                return None
            out.append(got)
        return out

    def read_range(self, key: str, offset: int, length: int) -> bytes | None:
        return self._range(key, offset, length)

    def _from_start(self, key: str, offset: int) -> tuple[int, int] | None:
        """The last ``-offset`` bytes of ``key`` as (offset, length) from its start, for a
        store without suffix ranges; None when the object does not exist."""
        size = self.size(key)
        return None if size is None else (max(0, size + offset), min(-offset, size))

    def read_range_sized(self, key: str, offset: int, length: int) -> tuple[bytes, int] | None:
        import obstore

        path = self.path(key)
        if offset < 0 and not self.suffix_ranges:
            counted = self._from_start(key, offset)
            if counted is None:
                return None
            offset, length = counted
        try:
            got = obstore.get(self._store, path, options={"range": _range_option(offset, length)})
            return bytes(got.bytes()), got.meta["size"]
        except FileNotFoundError:
            return None
        except Exception as e:
            size = self._size_past_end(key, offset, length, e)
            return None if size is None else (b"", size)

    def read_ranges_sized(self, keys: Sequence[str], offset: int, length: int, most: int = 64) -> list:
        """:meth:`read_range_sized` of many objects, requested together (at most ``most`` in
        flight): per key the (bytes, size), ``None`` when it does not exist, or the
        :class:`DamacyError`."""

        gate = None

        async def one(key: str):
            import obstore

            nonlocal gate
            gate = gate or asyncio.Semaphore(most)
            async with gate:
                try:
                    start, count = offset, length
                    if offset < 0 and not self.suffix_ranges:
                        try:
                            size = (await obstore.head_async(self._store, self.path(key)))["size"]
                        except FileNotFoundError:
                            return None
                        start, count = max(0, size + offset), min(-offset, size)
                    got = await obstore.get_async(self._store, self.path(key), options={"range": _range_option(start, count)})
                    return bytes(await got.bytes_async()), got.meta["size"]
                except FileNotFoundError:
                    return None
                except DamacyError as e:
                    return e
                except Exception as e:  # past the end, or a failure: decided on the object's size
                    try:
                        size = await asyncio.to_thread(self._size_past_end, key, offset, length, e)
                    except DamacyError as err:
                        return err
                    return None if size is None else (b"", size)

        return _gather([one(k) for k in keys])

    def fetch_many(self, reads: Sequence[tuple[str, int, int]], most: int = 64) -> list:
        """:meth:`fetch` of many (key, offset, length), at most ``most`` in flight: per read
        the bytes, ``None`` when the object does not exist, or the :class:`DamacyError`."""
        gate = None

        async def one(key: str, offset: int, length: int):
            nonlocal gate
            gate = gate or asyncio.Semaphore(most)
            async with gate:
                try:
                    return await self.fetch(key, offset, length)
                except DamacyError as e:
                    return e

        return _gather([one(*r) for r in reads])

    def _range(self, key: str, offset: int, length: int):
        import obstore

        path = self.path(key)
        if length == 0:
            return b"" if self.size(key) is not None else None
        if offset < 0 and not self.suffix_ranges:
            counted = self._from_start(key, offset)
            if counted is None:
                return None
            offset, length = counted
        try:
            if offset >= 0:
                return bytes(obstore.get_range(self._store, path, start=offset, length=length))
            return bytes(obstore.get(self._store, path, options={"range": {"suffix": -offset}}).bytes())
        except FileNotFoundError:
            return None
        except Exception as e:  # a range past the end: short, like a file's
            return None if self._size_past_end(key, offset, length, e) is None else b""

    def size(self, key: str) -> int | None:
        import obstore

        path = self.path(key)
        try:
            return obstore.head(self._store, path)["size"]
        except FileNotFoundError:
            return None
        except Exception as e:
            raise storage_error(e, key) from None

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def version(self, key: str) -> tuple | str:
        """The object's ETag, modification time, version and size (one HEAD). A HEAD that
        fails raises StorageError; one the server does not take (405, 501) makes every call
        for the next ``NO_HEAD_S`` raise without a request (a server without HEAD would make
        each one wait out its retries). Other failures (one object's 403, a 500, a timeout)
        are that call's: the store's other objects are still asked."""
        import obstore

        if time.monotonic() < self._no_head_until:
            raise StorageError("this server refused a HEAD request lately: no versions asked", path=key)
        path = self.path(key)
        try:
            head = obstore.head(self._store, path)
        except FileNotFoundError:
            return MISSING
        except Exception as e:
            if http_status(e) in NO_HEAD_STATUS:
                self._no_head_until = time.monotonic() + NO_HEAD_S
            raise storage_error(e, key) from None
        return (head.get("e_tag"), str(head.get("last_modified")), head.get("version"), head.get("size"))

    async def fetch(self, key: str, offset: int, length: int):
        """The bytes [offset, offset + length) of ``key`` (length -1: the whole object), or
        ``None`` when it does not exist; for an event loop (many requests in flight)."""
        import obstore

        path = self.path(key)
        try:
            if length < 0:
                got = await obstore.get_async(self._store, path)
                return await got.bytes_async()
            if length == 0:
                return b""
            return await obstore.get_range_async(self._store, path, start=offset, length=length)
        except FileNotFoundError:
            return None
        except Exception as e:
            return None if await asyncio.to_thread(self._size_past_end, key, offset, length, e) is None else b""

    def _size_past_end(self, key: str, offset: int, length: int, error: BaseException) -> int | None:
        """After a ranged GET of ``key`` failed with ``error``: the object's size when the
        range lies past its end (servers refuse such a range, 416), None when the object is
        gone; otherwise ``error``, as a :class:`StorageError`. Decided by the object's size
        (one HEAD, only after a failure), not by the words of the error: obstore reports a
        refused range as a generic error. A GET that failed otherwise (another status than
        416, no answer) raises its own error at once, with no HEAD after it."""
        status = http_status(error)
        if (status is not None and status != 416) or unanswered(error):
            raise storage_error(error, key) from None
        try:
            size = self.size(key)
        except StorageError:
            raise storage_error(error, key) from None  # the GET's failure, not the HEAD's
        if size is None:
            return None
        past = offset >= size if offset >= 0 else -offset > size
        if not past:
            raise storage_error(error, key) from None
        return size


def _gather(coroutines: list) -> list:
    """The results of ``coroutines`` run together on an event loop of their own (from a
    thread running one already: on a helper thread)."""

    async def all_of():
        return await asyncio.gather(*coroutines)

    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop in this thread (the planner's, a plain caller's)
        return asyncio.run(all_of())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # called from async code
        return pool.submit(asyncio.run, all_of()).result()


def _range_option(offset: int, length: int) -> dict | tuple[int, int]:
    """obstore's range option: the last -offset bytes, from offset on, or [offset, offset + length)."""
    return {"suffix": -offset} if offset < 0 else {"offset": offset} if length < 0 else (offset, offset + length)


class RemoteStores:
    """Makes the :class:`ObjectStore` of each bucket on demand, with the options of the
    longest matching prefix in ``options`` ({uri prefix: {option: value}}). ``allow``:
    ``None`` reads any uri; a list reads only uris under one of those prefixes (a daemon).
    Icechunk repositories (``icechunk+...``) are opened by :attr:`icechunk`, under those
    prefixes or the local ``roots`` when ``allow`` is given."""

    def __init__(
        self, options: Mapping[str, Mapping[str, str]] | None = None, allow: Sequence[str] | None = None, roots: Sequence[str] = ()
    ) -> None:
        from damacy_server.store.icechunk import IcechunkStores

        self.options = {normalized(p): dict(o) for p, o in (options or {}).items()}
        self.allow = None if allow is None else [normalized(p) for p in allow]
        self.icechunk = IcechunkStores(None if allow is None else [*self.allow, *(os.path.realpath(r) for r in roots)])
        self._stores: dict[tuple[str, str | None], ObjectStore] = {}
        self._lock = threading.Lock()

    def resolve(self, uri: str) -> tuple[ObjectStore, str]:
        """The store that holds ``uri`` and the key of its root."""
        key = normalized(uri)
        if self.allow is not None and not any(_under(key, p) for p in self.allow):
            raise _outside(key, self.allow)  # before a store is made: a refusal costs nothing
        parts = urlsplit(key)
        base = f"{parts.scheme}://{parts.netloc}"
        matched = max((p for p in self.options if _under(key, p)), key=len, default=None)
        with self._lock:
            store = self._stores.get((base, matched))
            if store is None:
                store = ObjectStore(base, self.options.get(matched), self.allow)
                self._stores[(base, matched)] = store
        store.check_allowed(key)
        return store, key
