"""A thread-safe LRU cache bounded by entries (or by bytes), with hit and miss counters.

With ``admit_by_frequency`` the cache chooses between two admission rules by which does
better on the lookups it sees:

- *frequency* (TinyLFU's rule): a full cache admits a value only if its key was asked for
  clearly more often (recently) than the key it would evict. Training that re-reads data
  larger than the cache in a new order each epoch evicts most LRU entries before their next
  use; this keeps a stable part of the data and hits it every epoch.
- *recency* (plain LRU): every value is admitted. When the working set moves (volumes read
  one after another, an epoch in chunk-aware windows), the frequency rule would turn the new
  data away for as long as the old counts last, though only the new data is read again.

A key-only shadow of the cache plays the other rule on the same lookups (a dict entry per
key, no values); when over a period of lookups the shadow hits clearly more often, the cache
switches rules (and the shadow starts playing the one it left). Counts are halved every
``10 x`` entries lookups, so recent reads weigh most.

The chunk cache keeps these rules in a native index where the module is built
(:class:`IndexedCache`); :class:`LRUCache` is their reference and the form everywhere else.

(Over 400 lines: one job, the cache and its admission rules, in the two forms held equal.)
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from itertools import compress, repeat
from operator import is_not, itemgetter
from typing import Any, Generic, TypeVar

import numpy as np

V = TypeVar("V")
#: keys as the many-key methods take them: a sequence, or an int64 array of int keys (the
#: planner's, a batch's units at once: :func:`damacy_server.plan.units.unit_keys`)
Keys = Sequence[Hashable] | np.ndarray
_VALUE = itemgetter(0)  # an entry's value (entries are (value, size))

#: how many more lookups a key needs than the entry it would evict: keys read at the same
#: rate (every epoch once) differ by one whenever the newcomer's turn in an epoch comes
#: before the incumbent's, and swapping them would only churn
ADMIT_MARGIN = 1

#: the shadow must hit this much more often over a period (and by at least
#: ``SWITCH_MIN_HITS``) for the cache to switch rules: noise alone never flips it
SWITCH_RATIO = 1.25
SWITCH_MIN_HITS = 16
#: in that many periods in a row: a working set that alternates between the rules' strengths
#: must not make the cache flip back and forth. Taking the frequency rule needs the longer
#: evidence: where it is wrong (a moving working set, chunk-aware epochs) it turns every new
#: chunk away and costs a decode per read until the cache switches back, while where it is
#: right (epochs larger than the cache) its advantage holds for every period; at the turn of
#: a windowed epoch it may win a period or two, then lose.
SWITCH_PERIODS = {True: 4, False: 2}  # keyed by the rule the shadow plays: by frequency or not

#: the numbers above as a native index takes them (:class:`IndexedCache`): the margin, the
#: ratio as a fraction, the minimum hits, the periods for taking frequency and recency
INDEX_RULES = (ADMIT_MARGIN, *SWITCH_RATIO.as_integer_ratio(), SWITCH_MIN_HITS, SWITCH_PERIODS[True], SWITCH_PERIODS[False])


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
        self.switches = 0
        self._freq: Counter[Hashable] | None = Counter() if admit_by_frequency else None
        self._lookups = 0
        # the adaptive admission (admit_by_frequency): the rule in force, and a key-only
        # shadow of the cache playing the other one, with both hit counts this period
        self._by_frequency = False  # plain LRU until frequency proves better
        self._shadow: OrderedDict[Hashable, int] = OrderedDict()
        self._shadow_bytes = 0
        self._period = [0, 0, 0]  # lookups, hits, shadow hits
        self._wins = 0  # periods in a row the shadow hit clearly more

    @property
    def admission(self) -> str:
        """The admission rule in force: "frequency", "recency" (admit all) or "lru"."""
        if self._freq is None:
            return "lru"
        return "frequency" if self._by_frequency else "recency"

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            item = self._data.get(key)
            if item is None:
                self.misses += 1
            else:
                self._data.move_to_end(key)
                self.hits += 1
            if self._freq is not None:
                self._count([key], (item is not None,))
        return None if item is None else item[0]

    def get_many(self, keys: list[Hashable]) -> list[V | None]:
        """:meth:`get` of each key, under one acquisition of the lock."""
        return _spread(*self.get_hits(keys)[:2])

    def get_hits(self, keys: Keys) -> tuple[np.ndarray, list[V], np.ndarray | None]:
        """Look up ``keys`` at once (the planner asks for a batch's units, hundreds at a time:
        this is the cache's hot loop): a bool mask of the keys it holds, their values in the
        keys' order, and their addresses as :meth:`put_many` was given them (None here: this
        form keeps none, :class:`IndexedCache` does). Counted and ordered as :meth:`get` of
        each key would be, by C loops (no Python per key). ``keys``: a list, or an int64 key
        array."""
        keys = _listed(keys)
        n = len(keys)
        with self._lock:
            data = self._data
            items = list(map(data.get, keys))
            found = n - items.count(None)
            held: list[bool] | None = None  # None: every key (a cached batch's common case)
            if found == n:
                deque(map(data.move_to_end, keys), maxlen=0)
                values = list(map(_VALUE, items))
            else:
                held = list(map(is_not, items, repeat(None, n)))
                deque(map(data.move_to_end, compress(keys, held)), maxlen=0)
                values = list(map(_VALUE, compress(items, held)))
            self.hits += found
            self.misses += n - found
            if self._freq is not None:
                self._count(keys, held)
            return np.ones(n, dtype=bool) if held is None else np.array(held, dtype=bool), values, None

    def peek(self, key: Hashable) -> V | None:
        """The value under ``key`` (None: none) without counting a lookup or touching its
        place in the order."""
        with self._lock:
            item = self._data.get(key)
        return None if item is None else item[0]

    def peek_many(self, keys: Keys) -> list[V | None]:
        """:meth:`peek` of each key, under one acquisition of the lock (by C loops)."""
        keys = _listed(keys)
        with self._lock:
            items = list(map(self._data.get, keys))
        return [None if item is None else item[0] for item in items] if items.count(None) != len(items) else items

    def _count(self, keys: list[Hashable], hit: Sequence[bool] | None) -> None:
        """Count the lookups of ``keys`` (``hit``: which of them the cache holds; None: all) for
        admission, play them on the shadow, and end a period (perhaps switching rules) at its
        length. The keys go in runs that end where the counts age or a period ends (exactly
        where a key-by-key pass would), each run counted by C loops."""
        span = max(len(self._data), 64)  # a period's lookups (lookups do not change the size)
        age_at = 10 * span
        seen, hits, shadow_hits = self._period
        i, n = 0, len(keys)
        while i < n:
            step = max(1, min(n - i, age_at - self._lookups, span - seen))
            run = keys[i : i + step] if step < n else keys
            self._freq.update(run)
            self._lookups += step
            if self._lookups >= age_at:  # age: recent counts weigh most
                self._lookups = 0
                self._freq = Counter({k: c >> 1 for k, c in self._freq.items() if c > 1})
            seen += step
            hits += step if hit is None else sum(hit[i : i + step]) if step < n else sum(hit)
            shadow = self._shadow
            again = list(filter(shadow.__contains__, run))
            shadow_hits += len(again)
            deque(map(shadow.move_to_end, again), maxlen=0)
            if seen >= span:
                self._end_period(hits, shadow_hits)
                seen = hits = shadow_hits = 0
            i += step
        self._period = [seen, hits, shadow_hits]

    def _end_period(self, hits: int, shadow_hits: int) -> None:
        """A period's lookups are counted: switch rules when the shadow has hit clearly more
        for enough periods in a row."""
        won = shadow_hits >= SWITCH_MIN_HITS and shadow_hits > SWITCH_RATIO * hits
        self._wins = self._wins + 1 if won else 0
        if self._wins >= SWITCH_PERIODS[not self._by_frequency]:
            self._switch()

    def _switch(self) -> None:
        """Take the shadow's rule; the shadow starts from this cache's keys, playing the other.
        Entries the shadow did not hold go to the front of the eviction order: the shadow's
        keys are what the new rule would have kept, so the cache takes that shape at once."""
        kept = self._shadow
        self._by_frequency = not self._by_frequency
        self.switches += 1
        self._wins = 0
        for k in reversed([k for k in self._data if k not in kept]):  # (each to the front: the last first)
            self._data.move_to_end(k, last=False)
        self._shadow = OrderedDict((k, size) for k, (_, size) in self._data.items())
        self._shadow_bytes = self._bytes

    def _full(self, extra: int, entries: int, nbytes: int) -> bool:
        return (self.max_entries is not None and entries > self.max_entries) or (
            self.max_bytes is not None and nbytes + extra > self.max_bytes
        )

    def _admits(self, key: Hashable, size: int, by_frequency: bool, keys: OrderedDict, nbytes: int) -> bool:
        """Whether a cache holding ``keys`` (``nbytes``) under a rule admits ``key``."""
        if not by_frequency or key in keys or not keys or not self._full(size, len(keys) + 1, nbytes):
            return True
        return self._freq.get(key, 0) > self._freq.get(next(iter(keys)), 0) + ADMIT_MARGIN

    def _play_shadow(self, key: Hashable, size: int) -> None:
        """The shadow's answer to a value of ``key`` being offered (under the other rule)."""
        shadow = self._shadow
        if key in shadow or not self._admits(key, size, not self._by_frequency, shadow, self._shadow_bytes):
            return
        shadow[key] = size
        self._shadow_bytes += size
        while self._full(0, len(shadow), self._shadow_bytes):
            _, gone = shadow.popitem(last=False)
            self._shadow_bytes -= gone

    def has_room(self, size: int) -> bool:
        """Whether a value of ``size`` fits without evicting anything."""
        with self._lock:
            return not self._full(size, len(self._data) + 1, self._bytes)

    def would_admit(self, key: Hashable, size: int) -> bool:
        """Whether :meth:`put` would keep a value of ``size`` under ``key`` now (so a caller
        can skip preparing a value that would be turned away)."""
        if self.max_entries == 0 or (self.max_bytes is not None and size > self.max_bytes):
            return False
        with self._lock:
            if self._freq is None:
                return True
            self._play_shadow(key, size)
            return self._admits(key, size, self._by_frequency, self._data, self._bytes)

    def would_admit_many(self, keys: Keys, size: int) -> list[bool]:
        """:meth:`would_admit` of each key in turn (a batch's units of one size)."""
        return [self.would_admit(k, size) for k in _listed(keys)]

    def put_many(self, keys: Keys, values: Sequence[V], size: int | None = None, addresses: np.ndarray | None = None) -> int:
        """:meth:`put` of each (key, value) in turn; ``size``: every value's, when the caller
        knows it (a batch's units of one array), else measured; how many were kept.
        ``addresses``: the values' (kept by :class:`IndexedCache`; of no use here: no native
        copies without the native module)."""
        return sum(self.put(k, v, size) for k, v in zip(_listed(keys), values, strict=True))

    def put(self, key: Hashable, value: V, size: int | None = None) -> bool:
        """Keep ``value`` (of ``size`` bytes; None: as ``sizeof`` measures it); False when it
        was not admitted (or the cache is off)."""
        if size is None:
            size = self._sizeof(value) if self._sizeof is not None else 0
        if self.max_entries == 0 or (self.max_bytes is not None and size > self.max_bytes):
            return False
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            elif self._freq is not None:
                self._play_shadow(key, size)
                if not self._admits(key, size, self._by_frequency, self._data, self._bytes):
                    self.rejections += 1
                    return False
            self._data[key] = (value, size)
            self._bytes += size
            while self._full(0, len(self._data), self._bytes):
                _, (_, gone) = self._data.popitem(last=False)
                self._bytes -= gone
                self.evictions += 1
        return True

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0

    def discard_where(self, drop: Callable[[Hashable], bool]) -> int:
        """Forget every entry whose key ``drop`` says to (a pass over all keys: for what
        changed in storage, rare); returns how many went."""
        with self._lock:
            gone = [k for k in self._data if drop(k)]
            for k in gone:
                self._bytes -= self._data.pop(k)[1]
            for k in [k for k in self._shadow if drop(k)]:
                self._shadow_bytes -= self._shadow.pop(k)
            return len(gone)

    def items(self) -> list[tuple[Hashable, V]]:
        """The entries, (key, value) pairs from the least recently used (a snapshot)."""
        with self._lock:
            return [(k, v) for k, (v, _) in self._data.items()]

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
                "admission": self.admission,
                "switches": self.switches,
            }


def _listed(keys: Keys) -> Sequence[Hashable]:
    """Keys as this form looks them up: a key array as the ints it holds."""
    return keys.tolist() if isinstance(keys, np.ndarray) else keys


def _spread(hit: np.ndarray, values: list) -> list:
    """``get_hits``' answer as one entry per key: its value, None where not held."""
    out: list = [None] * len(hit)
    for i, v in zip(np.flatnonzero(hit).tolist(), values):
        out[i] = v
    return out


class IndexedCache(Generic[V]):
    """:class:`LRUCache`'s behaviour, rule for rule, kept by a native index (``index``: a
    ``CacheIndex`` made with :data:`INDEX_RULES`, its bounds and admission this cache's, see
    :func:`damacy_server.native.cache_index`): a batch's hundreds of lookups are one C loop
    over a hash table, not several dict passes. The chunk cache is one where the native module
    is built; the tests hold it to :class:`LRUCache` operation by operation. Thread-safe: calls
    into the index hold a lock (as LRUCache's do; a collection of garbage inside a call could
    otherwise let another thread in)."""

    def __init__(self, index: Any, *, sizeof: Callable[[V], int] | None = None) -> None:
        self._index = index
        st = index.state()
        self.max_entries: int | None = None if st["max_entries"] < 0 else st["max_entries"]
        self.max_bytes: int | None = None if st["max_bytes"] < 0 else st["max_bytes"]
        self._sizeof = sizeof
        self._adaptive = st["adaptive"]
        self._lock = threading.Lock()

    @property
    def admission(self) -> str:
        with self._lock:
            return self._rule(self._index.state())

    def _rule(self, state: dict) -> str:
        if not self._adaptive:
            return "lru"
        return "frequency" if state["by_frequency"] else "recency"

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            _, values, _ = self._index.get_hits((key,))
        return values[0] if values else None

    def get_many(self, keys: list[Hashable]) -> list[V | None]:
        return _spread(*self.get_hits(keys)[:2])

    def get_hits(self, keys: Keys) -> tuple[np.ndarray, list[V], np.ndarray]:
        """As :meth:`LRUCache.get_hits`: a bool mask of the keys held, their values in order,
        and the address :meth:`put_many` gave each (0: none). An int64 key array is looked up
        without a Python object per key."""
        with self._lock:
            mask, values, addresses = self._index.get_hits(keys)
        return np.frombuffer(mask, dtype=bool), values, np.frombuffer(addresses, dtype=np.int64)

    def peek(self, key: Hashable) -> V | None:
        with self._lock:
            return self._index.peek_many((key,))[0]

    def peek_many(self, keys: Keys) -> list[V | None]:
        with self._lock:
            return self._index.peek_many(keys)

    def has_room(self, size: int) -> bool:
        with self._lock:
            return self._index.has_room(size)

    def would_admit(self, key: Hashable, size: int) -> bool:
        with self._lock:
            return self._index.would_admit(key, size)

    def would_admit_many(self, keys: Keys, size: int) -> list[bool]:
        with self._lock:
            mask = self._index.would_admit_many(keys, size)
        return np.frombuffer(mask, dtype=bool).tolist()

    def put(self, key: Hashable, value: V, size: int | None = None) -> bool:
        if size is None:
            size = self._sizeof(value) if self._sizeof is not None else 0
        with self._lock:
            return self._index.put(key, value, size)

    def put_many(self, keys: Keys, values: Sequence[V], size: int | None = None, addresses: np.ndarray | None = None) -> int:
        """As :meth:`LRUCache.put_many`; ``addresses`` (with ``size``): the values' (an int64
        array), handed back by :meth:`get_hits`: native copies from them need no lookup of
        each value's buffer."""
        if len(keys) != len(values):
            raise ValueError("put_many: as many values as keys")
        with self._lock:
            if size is not None:
                return self._index.put_many(keys, values, size, addresses)
        return sum(self.put(k, v) for k, v in zip(_listed(keys), values))

    def clear(self) -> None:
        with self._lock:
            self._index.clear()

    def discard_where(self, drop: Callable[[Hashable], bool]) -> int:
        with self._lock:
            keys = {k for k in self._index.keys() if drop(k)} | {k for k, _ in self._index.shadow() if drop(k)}
            return self._index.discard(list(keys))

    def items(self) -> list[tuple[Hashable, V]]:
        """The entries, (key, value) pairs from the least recently used (a snapshot)."""
        with self._lock:
            return self._index.items()

    def __len__(self) -> int:
        return len(self._index)

    @property
    def nbytes(self) -> int:
        return self._index.nbytes

    def _figure(self, name: str) -> int:
        with self._lock:
            return self._index.state()[name]

    # the figures, as LRUCache's attributes
    hits = property(lambda self: self._figure("hits"))
    misses = property(lambda self: self._figure("misses"))
    evictions = property(lambda self: self._figure("evictions"))
    rejections = property(lambda self: self._figure("rejections"))
    switches = property(lambda self: self._figure("switches"))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            st = self._index.state()
        figures = {k: st[k] for k in ("entries", "bytes", "hits", "misses", "evictions", "rejections")}
        return figures | {"admission": self._rule(st), "switches": st["switches"]}


#: a cache of either form (the chunk cache is an IndexedCache where the native module is built)
AnyCache = LRUCache | IndexedCache
