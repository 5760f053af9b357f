"""An epoch's positions without its list: counter-based draws, keyed permutations, rank shares.

The samplers compute the i-th sample of an epoch from (seed, epoch, i) alone, so a rank reads
its share of an epoch of 10^8 samples without building it:

- :func:`uniform`: the j-th uniform double of item i, a counter-based generator (splitmix64's
  finaliser over a key, the item and the stream: any item's values in O(1), vectorised);
- :class:`Permutation`: a keyed bijection of [0, n) (a balanced Feistel network over the next
  even power of two, cycle-walked into range), the order of a shuffled list;
- :class:`Pool`: an epoch's positions in share order minus those read before an elastic
  resume (ranges), indexable in O(log ranges);
- :func:`share_positions`: rank r's j-th entry of the ranks' equal shares, as index arithmetic.

The order these give is version :data:`ORDER_VERSION` of the samplers' orders (see
:mod:`damacy.samplers`); a state saved under another version names other samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: the samplers' order version: 1 built each epoch's list with numpy's Generator (damacy up
#: to 0.x); 2 computes each sample from (seed, epoch, index)
ORDER_VERSION = 2

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_STREAM = np.uint64(0xD1B54A32D192ED03)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (a bijection of uint64 with full avalanche), on arrays."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def key(*parts: int) -> np.uint64:
    """A 64-bit key from non-negative integers (a seed, an epoch, a purpose)."""
    k = np.zeros(1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for p in parts:
            k = _mix(k * _GOLDEN + np.uint64(int(p) & 0xFFFFFFFFFFFFFFFF) + _GOLDEN)
    return k[0]


def bits(k: np.uint64, items: np.ndarray, stream: int) -> np.ndarray:
    """64 random bits per item of ``items`` (int64 or uint64), for the ``stream``-th value."""
    with np.errstate(over="ignore"):
        x = np.asarray(items).astype(np.uint64) * _GOLDEN + np.uint64(k) + np.uint64(stream) * _STREAM
        return _mix(_mix(x))


def uniform(k: np.uint64, items: np.ndarray, stream: int) -> np.ndarray:
    """A double uniform in [0, 1) per item, the ``stream``-th of each."""
    return (bits(k, items, stream) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def integers(k: np.uint64, items: np.ndarray, stream: int, high: np.ndarray | int) -> np.ndarray:
    """An integer uniform in [0, high) per item (``high`` >= 1, below 2^53)."""
    return np.minimum((uniform(k, items, stream) * high).astype(np.int64), np.asarray(high, dtype=np.int64) - 1)


class Permutation:
    """A keyed bijection of [0, n): a balanced Feistel network of 6 rounds over [0, 4^h)
    (the smallest such domain holding n), cycle-walked: a value that lands at n or above is
    permuted again until it is below n (fewer than 4 steps on average)."""

    ROUNDS = 6

    def __init__(self, n: int, k: np.uint64) -> None:
        if n < 1:
            raise ValueError("a permutation needs n >= 1")
        self.n = int(n)
        half = max(1, (int(n - 1).bit_length() + 1) // 2)
        self._half = np.uint64(half)
        self._mask = np.uint64((1 << half) - 1)
        self._keys = [key(int(k), r) for r in range(self.ROUNDS)]

    def _once(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        with np.errstate(over="ignore"):
            for rk in self._keys:
                left, right = right, left ^ (_mix(right * _GOLDEN + rk) & self._mask)
        return (left << self._half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The image of each position (int64 array in [0, n))."""
        x = np.asarray(positions, dtype=np.int64).astype(np.uint64)
        out = self._once(x)
        n = np.uint64(self.n)
        todo = np.flatnonzero(out >= n)
        while len(todo):
            out[todo] = self._once(out[todo])
            todo = todo[out[todo] >= n]
        return out.astype(np.int64)


class Pool:
    """The positions of an epoch still to read, in share order: ``order`` (None: 0 .. n - 1;
    else an int64 array of positions) without those in ``consumed`` (sorted disjoint [a, b)
    ranges of positions, read before an elastic resume). ``at(k)`` is the k-th of them."""

    def __init__(self, n: int, order: np.ndarray | None, consumed: Sequence[tuple[int, int]]) -> None:
        self.order = order
        self.ranges = np.array(sorted((int(a), int(b)) for a, b in consumed), dtype=np.int64).reshape(-1, 2)
        if order is not None:
            keep = np.ones(n, dtype=bool)
            for a, b in self.ranges.tolist():
                keep[a:b] = False
            self.order = order[keep[order]] if len(self.ranges) else order
            self.n = len(self.order)
            self.ranges = np.zeros((0, 2), dtype=np.int64)
        else:
            self.n = n - int((self.ranges[:, 1] - self.ranges[:, 0]).sum())
            # gaps: the k-th remaining position is k plus the sizes of the ranges before it
            self._before = np.cumsum(self.ranges[:, 1] - self.ranges[:, 0])  # consumed up to range i
            self._free = self.ranges[:, 0] - np.concatenate([[0], self._before[:-1]])  # remaining before range i

    def __len__(self) -> int:
        return self.n

    def at(self, k: np.ndarray) -> np.ndarray:
        k = np.asarray(k, dtype=np.int64)
        if self.order is not None:
            return self.order[k]
        if not len(self.ranges):
            return k
        i = np.searchsorted(self._free, k, side="right")  # ranges wholly before the k-th
        return k + np.where(i > 0, self._before[np.maximum(i - 1, 0)], 0)


def equal_share(n: int, world: int, fill: str) -> int:
    """Entries per rank of a pool of ``n``: "drop" leaves the last ``n % world`` out; "repeat"
    and "padding" round up."""
    return n // world if fill == "drop" else -(-n // world)


def share_positions(n: int, rank: int, world: int, fill: str, js: np.ndarray, *, runs: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Pool indices of rank ``rank``'s entries ``js`` (each < :func:`equal_share`), and which
    are padding. Shares: entries ``rank, rank + world, ...`` (``runs=None``); contiguous runs,
    ``runs`` ranks taking turns within each (windows: 1, or a node's ranks); ``fill="padding"``:
    contiguous blocks of sizes differing by one, the shorter ending with its last entry again,
    marked. "repeat": indices past the pool wrap to its start (the shortest ranks repeat the
    first entries)."""
    js = np.asarray(js, dtype=np.int64)
    padding = np.zeros(len(js), dtype=bool)
    if fill == "padding":
        base, extra = divmod(n, world)
        start = rank * base + min(rank, extra)
        size = base + (1 if rank < extra else 0)
        padding = js >= size
        if not size:  # fewer entries than ranks: this rank's are all padding, the pool's last again
            return np.full(len(js), n - 1, dtype=np.int64), padding
        return start + np.minimum(js, size - 1), padding
    per_rank = equal_share(n, world, fill)
    if runs is None:
        k = rank + js * world
    else:
        node, turn = divmod(rank, runs)
        k = node * per_rank * runs + turn + js * runs
    return (k % n if fill == "repeat" else k), padding


def share_cuts(n: int, world: int, fill: str, runs: int | None) -> list[int]:
    """Where the contiguous runs of :func:`share_positions` begin in a pool of ``n`` (after the
    first; the end of the last where a "drop" leaves a tail out): the places a windowed order
    cuts before packing windows, so that each rank (each node with shared windows) reads whole
    windows. Strides (``runs=None`` without padding) have no runs: none."""
    if fill == "padding":
        base, extra = divmod(n, world)
        return [r * base + min(r, extra) for r in range(1, world)]
    if runs is None:
        return []
    per_run = equal_share(n, world, fill) * runs
    return [g * per_run for g in range(1, world // runs + 1) if g * per_run < n]


def consumed_ranges(positions: np.ndarray) -> list[tuple[int, int]]:
    """Sorted unique positions as [start, stop) ranges (a prefix is one range)."""
    p = np.unique(np.asarray(positions, dtype=np.int64))
    if not len(p):
        return []
    breaks = np.flatnonzero(np.diff(p) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [len(p)]])
    return [(int(p[a]), int(p[b - 1]) + 1) for a, b in zip(starts.tolist(), stops.tolist())]


def merge_ranges(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, overlapping or touching [a, b) ranges merged."""
    out: list[tuple[int, int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
