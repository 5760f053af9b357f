"""A thread-safe LRU cache bounded by entries (or by bytes), with hit and miss counters.

With ``admit_by_frequency`` a full cache admits a value only if its key was asked for
clearly more often (recently) than the key it would evict (TinyLFU's admission rule). Training re-reads
the same data each epoch in a new order; plain LRU over data larger than the cache then
evicts most entries before their next use, while this keeps a stable part of the data and
hits it every epoch. Counts are halved every ``10 x`` entries lookups, so a new working set
displaces an old one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

V = TypeVar("V")

#: how many more lookups a key needs than the entry it would evict: keys read at the same
#: rate (every epoch once) differ by one whenever the newcomer's turn in an epoch comes
#: before the incumbent's, and swapping them would only churn
ADMIT_MARGIN = 1


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
        admit_by_frequency: bool = False,
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
        self.rejections = 0
        self._freq: dict[Hashable, int] | None = {} if admit_by_frequency else None
        self._lookups = 0

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            if self._freq is not None:
                self._count(key)
            item = self._data.get(key)
            if item is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return item[0]

    def peek(self, key: Hashable) -> V | None:
        """The value under ``key`` (None: none) without counting a lookup or touching its
        place in the order."""
        with self._lock:
            item = self._data.get(key)
        return None if item is None else item[0]

    def _count(self, key: Hashable) -> None:
        freq = self._freq
        freq[key] = freq.get(key, 0) + 1
        self._lookups += 1
        if self._lookups >= 10 * max(len(self._data), 64):  # age: recent counts weigh most
            self._lookups = 0
            self._freq = {k: n >> 1 for k, n in freq.items() if n > 1}

    def _full(self, extra: int, entries: int) -> bool:
        return (self.max_entries is not None and entries > self.max_entries) or (
            self.max_bytes is not None and self._bytes + extra > self.max_bytes
        )

    def would_admit(self, key: Hashable, size: int) -> bool:
        """Whether :meth:`put` would keep a value of ``size`` under ``key`` now (so a caller
        can skip preparing a value that would be turned away)."""
        if self.max_entries == 0 or (self.max_bytes is not None and size > self.max_bytes):
            return False
        with self._lock:
            if self._freq is None or key in self._data or not self._data or not self._full(size, len(self._data) + 1):
                return True
            return self._freq.get(key, 0) > self._freq.get(next(iter(self._data)), 0) + ADMIT_MARGIN

    def put(self, key: Hashable, value: V) -> bool:
        """Keep ``value``; False when it was not admitted (or the cache is off)."""
        size = self._sizeof(value) if self._sizeof is not None else 0
        if self.max_entries == 0 or (self.max_bytes is not None and size > self.max_bytes):
            return False
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            elif self._freq is not None and self._data and self._full(size, len(self._data) + 1):
                victim = next(iter(self._data))
                if self._freq.get(key, 0) <= self._freq.get(victim, 0) + ADMIT_MARGIN:
                    self.rejections += 1
                    return False
            self._data[key] = (value, size)
            self._bytes += size
            while (self.max_entries is not None and len(self._data) > self.max_entries) or (
                self.max_bytes is not None and self._bytes > self.max_bytes
            ):
                _, (_, gone) = self._data.popitem(last=False)
                self._bytes -= gone
                self.evictions += 1
        return True

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
                "rejections": self.rejections,
            }
