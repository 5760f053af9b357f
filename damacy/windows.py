"""Chunk-aware epoch orders: every chunk decoded about once per epoch, the order still random.

A thin sample (a plane, a slab of a few planes) cuts chunks far deeper than itself: in a
uniform order every sample decodes all of them again, so an epoch of planes decodes the data
as many times as a chunk has planes. Here the epoch's samples are grouped by the chunk
*cell* their selection starts in (the array, then the start // the chunk shape on every
axis), the groups are shuffled, consecutive groups are packed into *windows* whose chunks
(the union of their samples' chunks, decoded) fit ``window`` bytes, and the samples within
each window are shuffled; a cell whose samples reach into a neighbouring cell's chunks takes
that neighbour into its window (the window's bytes count each chunk once). A pipeline whose
chunk cache holds ``window`` bytes then decodes each chunk about once per epoch (a chain of
neighbours longer than a window reads the chunk where it is cut twice). The price is
randomness: a batch holds samples of one or two windows; :func:`batch_diversity` measures
it, so users can choose the window.

Sequential orders (``GridBoxes``) keep their cells in the arrays' C order instead of shuffling.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from damacy_protocol.errors import InvalidArgument
from damacy_protocol.samples import IndexQuery, Sample
from damacy_protocol.selection import expand

#: the windowed orders' version: 1 packed the whole epoch into windows, the ranks' runs cut
#: through them; 2 packs each rank's run (each node's, with shared windows) on its own
WINDOW_ORDER = 2

#: (uri, level) -> (array shape, chunk shape (the inner chunk of a sharded array), item size)
ChunksOf = Callable[[str, "int | None"], tuple[tuple[int, ...], tuple[int, ...], int]]


def metadata_chunks(uri: str, level: int | None) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """An array's (shape, decoded chunk shape, item size), from its metadata."""
    from damacy_server.read import open_array, open_image  # the arrays' metadata, read here

    if level is not None:
        uri = open_image(uri).levels[level].uri
    meta = open_array(uri)
    return tuple(meta.shape), tuple(meta.read_unit), int(meta.dtype.itemsize)


def check_seed(seed: Any) -> int:
    """A seed: a non-negative integer, Python's or numpy's, not a bool."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InvalidArgument(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


def check_window(window: Any) -> int | None:
    """A window in bytes (None: no window)."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise InvalidArgument(f"window must be a positive number of bytes (the decoded chunks a window may hold), got {window!r}")
    return int(window)


def _parts(item: Any) -> list[Sample | IndexQuery]:
    if isinstance(item, (Sample, IndexQuery)):
        return [item]
    parts = getattr(item, "parts", None)  # a MultiSample: its arrays, the first one groups
    if isinstance(parts, dict) and parts:
        return list(parts.values())
    raise InvalidArgument(f"a chunk-aware order takes samples, got {type(item).__name__}")


def _span(entry: Any, n: int) -> tuple[int, int]:
    """The [first, last] element an axis' selection touches, inside [0, n) (an empty index
    list: the first element, so its sample still has a cell)."""
    if isinstance(entry, slice):
        lo = 0 if entry.start is None else entry.start
        hi = n if entry.stop is None else entry.stop
        lo, hi = max(lo, 0), min(hi, n)
        return (lo, hi - 1) if hi > lo else (min(lo, n - 1), min(lo, n - 1))
    if isinstance(entry, int):
        values = [entry]
    else:
        values = list(entry)
        if not values:
            return 0, 0
    last = max(n - 1, 0)  # a position outside the array pads: its cell is the nearest edge's
    return min(max(min(values), 0), last), min(max(max(values), 0), last)


#: a cell whose box of chunks holds more than this is packed by its bytes alone (its chunks
#: are not listed, so windows do not see what it shares with its neighbours)
MAX_LISTED_CHUNKS = 1 << 16


@dataclass
class Cells:
    """Per position of an epoch, its cell's number; per cell, its chunks' decoded bytes and
    the box of chunks its samples read per array ([first, last] chunk, a chunk's bytes)."""

    of: list[int]
    nbytes: list[int]
    boxes: list[dict[int, list[Any]]] = field(default_factory=list)

    def chunks(self, k: int) -> dict[tuple, int] | None:
        """Cell ``k``'s chunks, (array, chunk coordinates) -> decoded bytes (None: too many
        to list)."""
        per = self.boxes[k] if self.boxes else None
        if per is None or sum(math.prod(h - lo + 1 for lo, h in zip(f, t)) for f, t, _ in per.values()) > MAX_LISTED_CHUNKS:
            return None
        out: dict[tuple, int] = {}
        for array, (first, last, chunk_bytes) in per.items():
            for coords in itertools.product(*(range(lo, h + 1) for lo, h in zip(first, last))):
                out[(array, coords)] = chunk_bytes
        return out


class CellIndex:
    """Groups samples by chunk cell, reading each array's chunk shape once."""

    def __init__(self, chunks_of: ChunksOf | None = None) -> None:
        self._chunks_of = chunks_of or metadata_chunks
        self._arrays: dict[tuple[str, int | None], tuple[int, tuple[int, ...], tuple[int, ...], int]] = {}

    def _array(self, s: Sample | IndexQuery) -> tuple[int, tuple[int, ...], tuple[int, ...], int]:
        key = (s.uri, s.level)
        got = self._arrays.get(key)
        if got is None:
            shape, chunks, itemsize = self._chunks_of(s.uri, s.level)
            if len(chunks) != len(shape):
                raise InvalidArgument(f"chunks_of gave a {len(shape)}-d shape and {len(chunks)}-d chunks", uri=s.uri)
            got = self._arrays[key] = (len(self._arrays), tuple(shape), tuple(chunks), itemsize)
        return got

    def cells(self, items: Sequence[Any]) -> Cells:
        number: dict[tuple, int] = {}
        bounds: list[dict[int, list[Any]]] = []  # per cell, per array: [lo cells, hi cells, chunk bytes]
        of = []
        for item in items:
            parts = _parts(item)
            key = None
            spans = []
            for s in parts:
                array, shape, chunks, itemsize = self._array(s)
                # a selection naming fewer axes (or with ``...``) takes the others whole
                lo, hi = zip(*(_span(e, n) for e, n in zip(expand(s.selection, len(shape), s.uri), shape)))
                first = tuple(a // c for a, c in zip(lo, chunks))
                last = tuple(b // c for b, c in zip(hi, chunks))
                spans.append((array, first, last, math.prod(chunks) * itemsize))
                if key is None:
                    key = (array, first)
            k = number.get(key)
            if k is None:
                k = number[key] = len(bounds)
                bounds.append({})
            of.append(k)
            for array, first, last, chunk_bytes in spans:
                b = bounds[k].get(array)
                if b is None:
                    bounds[k][array] = [list(first), list(last), chunk_bytes]
                else:
                    b[0] = [min(x, y) for x, y in zip(b[0], first)]
                    b[1] = [max(x, y) for x, y in zip(b[1], last)]
        nbytes = [
            sum(math.prod(h - lo + 1 for lo, h in zip(first, last)) * cb for first, last, cb in per.values())
            for per in bounds
        ]
        self._keys = sorted(number, key=lambda key: number[key])
        return Cells(of, nbytes, bounds)

    def window_bytes(self, cells: Cells, members: Iterable[int]) -> int:
        """The decoded bytes of the chunks a window of these cells reads."""
        held: dict[tuple, int] = {}
        extra = 0
        for k in members:
            chunks = cells.chunks(k)
            if chunks is None:
                extra += cells.nbytes[k]
            else:
                held.update(chunks)
        return extra + sum(held.values())

    def cell_keys(self) -> list[tuple]:
        """The cells of the last :meth:`cells` call by number: (array number, first chunk)."""
        return self._keys


def window_order(
    cells: Cells,
    window: int,
    rng: np.random.Generator | None,
    keys: list[tuple] | None = None,
    *,
    positions: Sequence[int] | None = None,
    cuts: Sequence[int] = (),
) -> tuple[list[int], list[int]]:
    """The positions of an epoch in windowed order, and where each window starts in it.

    With ``rng``: the cells shuffled; each window opens with the next cell of that order not
    yet placed, then takes the cells that read chunks it already holds (a box reaching into
    the next cell: its neighbour comes along, in the shuffled order among them), then the next
    cells of the order, while the chunks they add fit ``window`` bytes (a cell larger than
    that is a window of its own); the positions of each window are shuffled. Without (a
    sequential order): the same with the cells in the order of ``keys`` and each window's
    positions as given.

    ``positions``: those to order (None: all; an elastic resume leaves out those read).
    ``cuts``: where the ranks' runs begin, as indices into the order (their number of
    positions before each): the positions, in the cells' order, are cut there first and each
    run is packed into windows of its own, so no window spans two runs (a rank reads whole
    windows; only a cell cut by a run's edge is read by both).
    """
    n = len(cells.nbytes)
    members: list[list[int]] = [[] for _ in range(n)]
    for position in range(len(cells.of)) if positions is None else sorted(positions):
        members[cells.of[position]].append(position)
    if rng is not None:
        cell_order = rng.permutation(n).tolist()
    else:
        cell_order = sorted(range(n), key=lambda k: keys[k]) if keys is not None else list(range(n))
    listed = [cells.chunks(k) for k in range(n)]
    # the runs: per run its cells in order, with their positions in it
    runs: list[list[tuple[int, list[int]]]] = [[]]
    bounds = iter(sorted(set(int(c) for c in cuts)))
    cut = next(bounds, None)
    at = 0  # positions placed in runs so far
    for k in cell_order:
        left = members[k]
        while left:
            while cut is not None and cut <= at:
                if runs[-1]:
                    runs.append([])
                cut = next(bounds, None)
            take = len(left) if cut is None else min(len(left), cut - at)
            runs[-1].append((k, left[:take]))
            left = left[take:]
            at += take
    order: list[int] = []
    starts: list[int] = []
    for run in runs:
        _pack(run, cells, listed, window, rng, order, starts)
    return order, starts


def _pack(
    run: list[tuple[int, list[int]]],
    cells: Cells,
    listed: list[dict[tuple, int] | None],
    window: int,
    rng: np.random.Generator | None,
    order: list[int],
    starts: list[int],
) -> None:
    """Pack one run's cells (in their order, each with its positions) into windows, appended
    to ``order`` and ``starts`` (see :func:`window_order`)."""
    n = len(run)
    readers: dict[tuple, list[int]] = {}  # chunk -> the run's cells (by index in it) that read it
    for i, (k, _) in enumerate(run):
        for chunk in listed[k] or ():
            readers.setdefault(chunk, []).append(i)
    placed = [False] * n
    nxt = 0
    while True:
        while nxt < n and placed[nxt]:
            nxt += 1
        if nxt == n:
            break
        held: dict[tuple, int] = {}
        used = 0
        current: list[int] = []
        near: list[int] = []  # unplaced cells of the run reading chunks held, by place in it
        scan = nxt
        while True:
            while near and placed[near[0]]:
                heapq.heappop(near)
            if near:
                i = near[0]
            else:
                while scan < n and placed[scan]:
                    scan += 1
                if scan == n:
                    break
                i = scan
            k, mine = run[i]
            chunks = listed[k]
            cost = cells.nbytes[k] if chunks is None else sum(b for c, b in chunks.items() if c not in held)
            if current and used + cost > window:
                break
            placed[i] = True
            current.extend(mine)
            used += cost
            for chunk, b in (chunks or {}).items():
                if chunk not in held:
                    held[chunk] = b
                    for other in readers[chunk]:
                        if not placed[other]:
                            heapq.heappush(near, other)
        starts.append(len(order))
        order.extend(np.asarray(current)[rng.permutation(len(current))].tolist() if rng is not None else current)


def batch_diversity(cell_of: Sequence[int], batch_size: int) -> float:
    """How mixed the batches of an order are: the mean number of distinct chunk cells in a
    batch of ``batch_size`` consecutive samples, divided by what a uniform permutation of the
    same samples gives on average (1.0: as mixed as a full shuffle; 1/``batch_size``: every
    batch from one cell)."""
    n = len(cell_of)
    b = int(batch_size)
    if b < 1:
        raise InvalidArgument(f"batch_size must be positive, got {batch_size!r}")
    if n < b:
        return 1.0
    ids = np.asarray(cell_of)
    full = n // b
    seen = [len(np.unique(ids[i * b : (i + 1) * b])) for i in range(full)]
    counts = np.bincount(ids)
    counts = counts[counts > 0]
    # a cell of m samples is missing from a uniform batch with probability C(n - m, b) / C(n, b)
    log_all = math.lgamma(n + 1) - math.lgamma(n - b + 1)
    missing = [math.exp(math.lgamma(n - m + 1) - math.lgamma(n - m - b + 1) - log_all) if n - m >= b else 0.0 for m in counts.tolist()]
    expected = float(len(counts) - sum(missing))
    return float(np.mean(seen)) / expected


def chunk_windows(
    samples: Iterable[Any],
    *,
    window: int,
    buffer: int = 4096,
    seed: int = 0,
    chunks_of: ChunksOf | None = None,
) -> Iterator[Any]:
    """Any iterable of samples in a chunk-aware order: ``buffer`` samples at a time are
    reordered in windows of ``window`` bytes (as the samplers' ``window=`` does for a whole
    epoch), so samples of one buffer that cut the same chunks come together and a chunk cache
    of ``window`` bytes decodes them once. Deterministic from ``seed``; for exact resume, use a
    sampler's ``window=`` (this reorders a stream it cannot restart)."""
    window = check_window(window)
    if not isinstance(buffer, int) or buffer < 1:
        raise InvalidArgument(f"buffer must be a positive number of samples, got {buffer!r}")
    check_seed(seed)
    index = CellIndex(chunks_of)
    it = iter(samples)
    round_ = 0
    while True:
        chunk = []
        for item in it:
            chunk.append(item)
            if len(chunk) == buffer:
                break
        if not chunk:
            return
        order, _ = window_order(index.cells(chunk), window, np.random.default_rng([seed, round_]))
        round_ += 1
        yield from (chunk[p] for p in order)
