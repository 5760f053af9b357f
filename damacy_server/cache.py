"""A thread-safe LRU cache bounded by entries (or by bytes), with hit and miss counters."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class LRUCache(Generic[V]):
    """Holds at most ``max_entries`` values (and, when ``max_bytes`` is given, at most that
    many bytes as measured by ``sizeof``); the least recently used value goes first.
    A bound of 0 disables the cache (every lookup misses, nothing is kept)."""

    def __init__(
        self,
        max_entries: int | None = None,
        *,
        max_bytes: int | None = None,
        sizeof: Callable[[V], int] | None = None,
    ) -> None:
        if max_entries is None and max_bytes is None:
            raise ValueError("an LRUCache needs max_entries or max_bytes")
        if max_bytes is not None and sizeof is None:
            raise ValueError("max_bytes needs a sizeof function")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._sizeof = sizeof
        self._data: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            item = self._data.get(key)
            if item is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return item[0]

    def put(self, key: Hashable, value: V) -> None:
        size = self._sizeof(value) if self._sizeof is not None else 0
        if self.max_entries == 0 or (self.max_bytes is not None and size > self.max_bytes):
            return
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._data[key] = (value, size)
            self._bytes += size
            while (self.max_entries is not None and len(self._data) > self.max_entries) or (
                self.max_bytes is not None and self._bytes > self.max_bytes
            ):
                _, (_, gone) = self._data.popitem(last=False)
                self._bytes -= gone
                self.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._data)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "entries": len(self._data),
                "bytes": self._bytes,
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
            }
