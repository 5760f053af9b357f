"""Metadata reads counted, and slowed by a synthetic latency where asked.

A planner reads zarr.json files and shard indexes through its
:class:`~damacy_server.store.file.FileMetadataReader`; :class:`MetadataReads` wraps that store
for one planner: it counts the reads (all of them, and those in flight at once) and, when the
reader carries an active :class:`~damacy_protocol.limits.LatencyModel`, sleeps before each
one for a baseline plus a log-normal tail (capped), drawn from a generator of the model's
seed. Benchmarks use it to see how much planning ahead hides metadata latency (an NFS, an
object store) on a fast local disk.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from damacy_protocol.limits import LatencyModel
from damacy_server.store.base import ByteRange, Store


class MetadataReads(Store):
    """``store``'s reads, counted (and delayed per ``latency``)."""

    def __init__(self, store: Store, latency: LatencyModel | None = None) -> None:
        self.store = store
        self.latency = latency if latency is not None else LatencyModel()
        self._rng = random.Random(self.latency.seed)
        self._lock = threading.Lock()
        self._figures = dict.fromkeys(
            ("ops", "stat_ops", "submit_ops", "active", "max_active", "total_sleep_ns", "max_sleep_ns",
             "read_jobs", "read_active", "read_max_active"),
            0,
        )

    def __getattr__(self, name: str) -> Any:  # the store's own settings (concurrency, roots...)
        return getattr(self.store, name)

    def figures(self) -> dict[str, int]:
        with self._lock:
            return dict(self._figures)

    def reset_latency(self) -> None:
        """Zero the latency counters (those in flight stay counted as active)."""
        with self._lock:
            for k in ("ops", "stat_ops", "submit_ops", "max_active", "total_sleep_ns", "max_sleep_ns"):
                self._figures[k] = 0

    def _delay_ns(self) -> int:
        model = self.latency
        ns = model.baseline_ns
        if model.lognormal_mu_ln_ns or model.lognormal_sigma_ln_ns:
            with self._lock:
                ns += int(math.exp(self._rng.gauss(model.lognormal_mu_ln_ns, model.lognormal_sigma_ln_ns)))
        if model.cap_ns:
            ns = min(ns, model.cap_ns)
        return ns

    def _call(self, stat: bool, fn: Callable[..., Any], *args: Any) -> Any:
        f = self._figures
        delayed = self.latency.active
        with self._lock:
            f["read_jobs"] += 1
            f["read_active"] += 1
            f["read_max_active"] = max(f["read_max_active"], f["read_active"])
            if delayed:
                f["ops"] += 1
                f["stat_ops" if stat else "submit_ops"] += 1
                f["active"] += 1
                f["max_active"] = max(f["max_active"], f["active"])
        try:
            if delayed:
                ns = self._delay_ns()
                if ns > 0:
                    time.sleep(ns / 1e9)
                with self._lock:
                    f["total_sleep_ns"] += ns
                    f["max_sleep_ns"] = max(f["max_sleep_ns"], ns)
            return fn(*args)
        finally:
            with self._lock:
                f["read_active"] -= 1
                if delayed:
                    f["active"] -= 1

    # -- the Store interface ----------------------------------------------------------------
    def read(self, key: str) -> bytes | None:
        return self._call(False, self.store.read, key)

    def read_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes] | None:
        return self._call(False, self.store.read_ranges, key, ranges)

    def read_range(self, key: str, offset: int, length: int) -> bytes | None:
        return self._call(False, self.store.read_range, key, offset, length)

    def read_range_sized(self, key: str, offset: int, length: int) -> tuple[bytes, int] | None:
        return self._call(False, self.store.read_range_sized, key, offset, length)

    def size(self, key: str) -> int | None:
        return self._call(True, self.store.size, key)

    def exists(self, key: str) -> bool:
        return self._call(True, self.store.exists, key)

    def version(self, key: str) -> Any:
        return self._call(True, self.store.version, key)

    def join(self, base: str, *parts: str) -> str:
        return self.store.join(base, *parts)
