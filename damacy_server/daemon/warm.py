"""Warming the daemon's caches: array metadata, shard indexes, and (optionally) chunks."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from damacy_protocol import messages as m
from damacy_protocol.enums import Stage
from damacy_protocol.errors import DamacyError
from damacy_protocol.wire import error_to_wire
from damacy_server.decode.chunks import check_length, decode_unit
from damacy_server.plan.units import unit_keys

#: units located (and read) per step, so progress moves and memory stays small
STEP = 256

log = logging.getLogger("damacyd")


class Cancelled(BaseException):
    """The session that asked for the warm has ended (its client interrupted or gone): the
    warm stops at its next step (not an Exception: nothing on the way catches it)."""


def start_warm(daemon: Any, session: Any, msg: m.Warm) -> None:
    """Answer a Warm request from a thread of its own: WarmProgress now and then (at most 20
    a second), then WarmDone, whatever happens."""

    def run() -> None:
        last = [0.0]

        def progress(done: int, total: int, item: str) -> None:
            if session.closed:
                raise Cancelled
            now = time.monotonic()
            if now - last[0] >= 0.05 or done >= total:
                last[0] = now
                session.reply(m.WarmProgress(reply_to=msg.id, done=done, total=total, item=item))

        try:
            result = warm(daemon, msg.uris, msg.shard_indexes, msg.chunks, progress, since=session.opened)
        except Cancelled:
            log.info("warming stopped: session %s ended", session.sid)
            return
        except Exception as e:  # noqa: BLE001 - the client waits for WarmDone whatever happens
            log.exception("warming failed")
            result = {"arrays": 0, "shard_indexes": 0, "chunks": 0, "left": 0, "errors": [DamacyError(f"warming failed: {type(e).__name__}: {e}")]}
        session.reply(
            m.WarmDone(
                reply_to=msg.id,
                arrays=result["arrays"],
                shard_indexes=result["shard_indexes"],
                chunks=result["chunks"],
                errors=[error_to_wire(e) for e in result["errors"]],
                left=result["left"],
            )
        )

    threading.Thread(target=run, name=f"damacyd-warm-{session.sid}", daemon=True).start()


def warm(
    daemon: Any, uris: list[str], shard_indexes: bool, chunks: bool, progress: Callable[[int, int, str], None],
    since: float | None = None,
) -> dict[str, Any]:
    """Load ``uris``' metadata (and shard indexes, and decoded chunks into the chunk cache);
    what was cached before ``since`` is checked against storage first (see
    :meth:`Resolver.recheck`).

    ``progress(done, total, item)`` is called as arrays and chunk batches complete. Errors
    are collected per array, not raised."""
    out: dict[str, Any] = {"arrays": 0, "shard_indexes": 0, "chunks": 0, "left": 0, "errors": []}
    metas = []
    for uri in uris:
        try:
            daemon.metadata.check_allowed(uri)
            if since is not None:
                daemon.metadata.recheck([(uri, None)], since)
            metas.append(daemon.metadata.array(uri))
            out["arrays"] += 1
        except DamacyError as e:
            out["errors"].append(e.with_context(uri=uri))
    cache = daemon.executor.chunk_cache
    if chunks and cache is None:
        out["errors"].append(DamacyError("--chunks needs a chunk cache (start damacyd with --chunk-cache BYTES)"))
        chunks = False
    total = sum(int(np.prod(meta.layout.grid, dtype=np.int64)) for meta in metas) if (shard_indexes or chunks) else len(metas)
    done = 0
    progress(done, total, "")
    if not (shard_indexes or chunks):
        progress(len(metas), len(metas), "metadata")
        return out
    for meta in metas:
        before = daemon.metadata.cache.shard_indexes.misses
        grid = meta.layout.grid
        every = itertools.product(*(range(n) for n in grid))
        while True:
            units = list(itertools.islice(every, STEP))
            if not units:
                break
            arr = np.array(units, dtype=np.int64).reshape(len(units), meta.ndim)
            try:
                locs = daemon.metadata.locate(meta, arr)
                if chunks:
                    cached, left, failed = _load_chunks(meta, units, arr, locs, cache, daemon.executor.stats)
                    out["chunks"] += cached
                    out["left"] += left
                    out["errors"].extend(failed)
                out["errors"].extend(locs.errors.values())
            except DamacyError as e:
                out["errors"].append(e)
            done += len(units)
            progress(done, total, meta.uri)
        out["shard_indexes"] += daemon.metadata.cache.shard_indexes.misses - before
    return out


def _load_chunks(meta, units, coords, locs, cache, stats) -> tuple[int, int, list[DamacyError]]:
    """Read and decode ``units`` (``coords``: them as an int64 array) into the chunk cache; the work counts in the stage figures
    as a stream's does ("read", "decode"), and under "warm" (chunks cached, their bytes).
    Returns the chunks the cache holds, those that exist and did not fit (units never
    written are neither: they read as the fill value), and the errors of those that could
    not be read or decoded (each its own: the others are warmed all the same)."""
    n = 0
    failed: list[DamacyError] = []
    present = [k for k in range(len(units)) if not locs.missing[k] and k not in locs.errors]
    names = unit_keys(meta, coords)
    keys = locs.keys
    for done, k in enumerate(present):
        unit = units[k]
        key = keys[k]
        size = meta.layout.leaf.spec.nbytes
        if cache.peek(names[k]) is not None:
            n += 1
            continue
        if not cache.has_room(size):
            # a full cache keeps what it holds: warming more would only evict what was warmed
            return n, len(present) - done, failed
        offset, nbytes = int(locs.offsets[k]), int(locs.nbytes[k])
        t0 = time.perf_counter()
        try:
            data = meta.store.read(key) if nbytes < 0 else meta.store.read_range(key, offset, nbytes)
            t1 = time.perf_counter()
            stats.add(Stage.READ, t1 - t0, bytes_out=len(data) if data else 0)
            if data is None:
                continue
            check_length(meta, data, nbytes, unit, key)
            arr = decode_unit(meta, data, unit, key)
        except DamacyError as e:
            failed.append(e)
            continue
        arr = np.array(arr)
        arr.flags.writeable = False
        stats.add(Stage.DECODE, time.perf_counter() - t1, bytes_in=len(data), bytes_out=arr.nbytes)
        cached = cache.put(names[k], arr)
        if cached:
            stats.add(Stage.WARM, 0.0, bytes_out=arr.nbytes)
        n += cached
    return n, 0, failed
