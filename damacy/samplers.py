"""Samplers: each rank's part of each epoch, as plain iterables of samples for any pipeline.

Every sampler defines the epoch's *global* list from (seed, epoch) alone, the same on every
rank and for every number of ranks, and hands rank ``r`` of ``W`` its part of it. The list is
never built to be shared out: its i-th entry is computed from (seed, epoch, i) (a
counter-based generator, a keyed permutation, index arithmetic; see :mod:`damacy.order`), so
a rank of an epoch of 10^8 samples starts at once, in constant memory, and a restore starts
at its offset. (Only ``window=`` and ``locality`` build the epoch's list: they sort it.)

- :class:`RandomBoxes`: ``samples_per_epoch`` boxes drawn uniformly (per array, then an
  origin in it), rank ``r`` taking entries ``r, r + W, ...``; every rank gets
  ``samples_per_epoch // W`` (the last ``samples_per_epoch % W`` are dropped, so ranks take
  the same number of steps).
- :class:`Shuffled`: a fixed list of the caller's samples in a new order each epoch; every
  rank gets ``ceil(n / W)``, the shortest ranks repeating the first samples of the order (as
  torch's ``DistributedSampler``), or ``n // W`` with ``drop_last``.
- :class:`GridBoxes`: sliding windows that cover every element of every array, each window
  once across ranks in contiguous blocks (neighbouring windows share chunks); ranks with one
  window fewer end with a :class:`Padding` sample (the last window again), so every rank
  takes the same number of steps: ``batch.info.padding`` lists their positions to drop.

``arrays`` are uris (shapes read from their metadata), ``{uri: shape}``, regions
``(uri, ((start, stop), ...))`` of arrays (a split's, see :mod:`damacy.splits`: boxes stay
inside their region; random boxes are then drawn uniformly over the regions' elements), or
groups of arrays read at one box, ``{name: uri}`` each (the samples are then
:class:`~damacy.multi.MultiSample` s, for a :class:`~damacy.multi.MultiPipeline`;
the box is drawn on the group's first array, and ``scales={name: factor}`` maps it to an array
at another resolution).

``window=`` (bytes) orders any of them chunk by chunk (see :mod:`damacy.windows`): the
epoch's samples grouped by the chunk cell they start in, the cells shuffled and packed into
windows whose decoded chunks fit ``window`` bytes, the samples shuffled within each window; a
pipeline whose chunk cache holds ``window`` bytes then decodes each chunk once per epoch
(``shuffle_quality(batch_size)`` says how much mixing that costs). The samples drawn stay the
same; each rank reads a contiguous run of the epoch packed into windows of its own (only a
cell cut by a run's edge is read by two ranks; ``share_windows=True``: the
``local_world_size`` ranks of a node take turns in the node's run, so their damacyd decodes it
once for all of them); ``GridBoxes`` keeps its cells in C order. ``chunks_of(uri, level)`` gives
(shape, chunk shape, item size) where the arrays' metadata should not be read.

``set_epoch(e)`` picks the epoch; ``rank``/``world_size`` default to torch.distributed's
environment (``RANK``, ``WORLD_SIZE``), else 0 and 1. ``state_dict()`` holds the sampler's
seed, epoch and partition, the positions read before an elastic resume (a few ranges) and the
order's version (:data:`damacy.order.ORDER_VERSION`: a state of another version names other
samples and is refused); the position within an epoch is the pipeline's to count.

(Over 400 lines: one job, the samplers; random boxes, grids and shuffled lists share the
rank partition, the per-array normalisation and the state they save.)
"""

from __future__ import annotations

import copy
import fractions
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from damacy import labels as labels_
from damacy import order
from damacy.windows import (
    WINDOW_ORDER,
    CellIndex,
    Cells,
    ChunksOf,
    batch_diversity,
    check_seed,
    check_window,
    window_order,
)
from damacy_protocol.errors import InvalidArgument
from damacy_protocol.samples import IndexQuery, Padding, Sample, normalize_pair


def _is_int(value: Any) -> bool:
    """An integer, Python's or numpy's (a count from an array), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _box_shape(sample_shape: Any) -> tuple[int, ...]:
    """A sampler's ``sample_shape``: a positive integer per axis."""
    shape = tuple(sample_shape) if isinstance(sample_shape, (Sequence, np.ndarray)) and not isinstance(sample_shape, str) else None
    if not shape or any(not _is_int(n) or n < 1 for n in shape):
        raise InvalidArgument(f"sample_shape must be a positive integer per axis, got {sample_shape!r}")
    return tuple(int(n) for n in shape)


def _axes(values: Any, what: str) -> list[int]:
    """A sequence of axis numbers (``flips``, one of ``transposes``), checked to be integers."""
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__iter__"):
        raise InvalidArgument(f"{what} must be a sequence of axis numbers, got {values!r}")
    values = list(values)
    if any(not _is_int(a) for a in values):
        raise InvalidArgument(f"{what} must be a sequence of axis numbers, got {values!r}")
    return [int(a) for a in values]


def partition(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world size): as given, else torch.distributed's environment (``RANK``,
    ``WORLD_SIZE``, set by torchrun), else (0, 1)."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if not _is_int(world_size) or world_size < 1:
        raise InvalidArgument(f"world_size must be a positive integer, got {world_size!r}")
    if not _is_int(rank) or not 0 <= rank < world_size:
        raise InvalidArgument(f"rank must be in [0, {world_size}), got {rank!r}")
    return int(rank), int(world_size)


class _Arrays(Sequence):
    """A sampler's arrays: (where, shape) each, ``where`` a uri or a group {name: uri}. A shape
    not given (``{uri: shape}``, a region) is read from the array's metadata when first asked
    for, so an epoch over 10^5 arrays reads only those it draws; iterating reads every shape
    not read yet, ``concurrency`` at a time (the metadata's readers)."""

    def __init__(
        self, entries: list[tuple[Any, tuple[int, ...] | None]], shape_of: Callable[[str], Sequence[int]] | None, level: int | None,
        ndim: int | None, box: tuple[int, ...] | None = None,
    ) -> None:
        self._entries = entries
        self._shape_of = shape_of
        self._level = level
        self._ndim = ndim
        # with ``box`` (a sampler drawing boxes as it goes), an array whose metadata cannot be
        # read stands as one box at its origin: its samples fail when read, naming it and the
        # cause, under the pipeline's error policy, and the epoch goes on
        self._box = box
        self.unreadable: dict[int, Exception] = {}
        for where, shape in entries:
            if shape is not None:
                self._check(where, shape)

    def _check(self, where: Any, shape: tuple[int, ...]) -> None:
        if self._ndim is not None and len(shape) != self._ndim:
            raise InvalidArgument(f"sample_shape has {self._ndim} axes, the array has {len(shape)} (shape {shape})", uri=str(_first_uri(where)))

    def where(self, a: int) -> Any:
        return self._entries[a][0]

    def shape(self, a: int) -> tuple[int, ...]:
        where, shape = self._entries[a]
        if shape is None:
            self._read([a])
            shape = self._entries[a][1]
        return shape

    def _read(self, indices: list[int]) -> None:
        uris = [str(_first_uri(self._entries[a][0])) for a in indices]
        if self._shape_of is not None:
            shapes = [tuple(int(n) for n in self._shape_of(u)) for u in uris]
        else:  # the metadata of them all, read concurrently (errors name their array)
            from damacy_server.read import default_metadata

            found = default_metadata().arrays((u, self._level) for u in uris)
            shapes = []
            for a, u in zip(indices, uris):
                meta = found[(u, self._level)]
                if isinstance(meta, Exception):
                    if self._box is None:
                        raise meta
                    self.unreadable[a] = meta
                    shapes.append(self._box)
                    continue
                shapes.append(tuple(meta.shape))
        for a, shape in zip(indices, shapes):
            self._check(self._entries[a][0], shape)
            self._entries[a] = (self._entries[a][0], shape)

    def __getitem__(self, a: int) -> tuple[Any, tuple[int, ...]]:  # type: ignore[override]
        return (self._entries[a][0], self.shape(a))

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[tuple[Any, tuple[int, ...]]]:
        missing = [a for a, (_, shape) in enumerate(self._entries) if shape is None]
        if missing:
            self._read(missing)
        return iter(list(self._entries))

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, (list, tuple, _Arrays)) else NotImplemented


def _first_uri(where: Any) -> Any:
    return next(iter(where.values())) if isinstance(where, dict) else where


def _shapes(
    arrays: Sequence[str] | Mapping[str, Sequence[int]],
    shape_of: Callable[[str], Sequence[int]] | None,
    level: int | None = None,
    ndim: int | None = None,
    box: tuple[int, ...] | None = None,
) -> _Arrays:
    """A sampler's ``arrays`` argument as :class:`_Arrays` (shapes given kept, others read on
    first use; ``box``: see :class:`_Arrays`)."""
    if isinstance(arrays, Mapping):
        return _Arrays([(str(u), tuple(int(n) for n in s)) for u, s in arrays.items()], shape_of, level, ndim, box)
    if isinstance(arrays, (str, os.PathLike)):
        arrays = [arrays]
    out: list[tuple[Any, tuple[int, ...] | None]] = []
    for u in arrays:
        if _is_region(u):  # a region of an array (a split's): its extent
            out.append((str(u[0]), tuple(int(b) - int(a) for a, b in u[1])))
        elif isinstance(u, Mapping):  # several arrays read at one box: the first one's shape
            if not u:
                raise InvalidArgument("a group of arrays names at least one")
            out.append((dict(u), None))
        else:
            out.append((str(u), None))
    if shape_of is None and any(shape is None for _, shape in out):
        # the metadata readers, imported now: importing them holds the interpreter for a while,
        # which must not happen in the middle of an epoch (a daemon client's heartbeats
        # would stop), only the reads of the shapes do
        import damacy_server.read  # noqa: F401
    return _Arrays(out, shape_of, level, ndim, box)


def _listed(arrays: Any) -> Any:
    """A sampler's ``arrays`` as given, an iterator made a list (they are read more than once)."""
    return arrays if isinstance(arrays, (Mapping, Sequence, str, os.PathLike)) else list(arrays)


def _is_region(entry: Any) -> bool:
    """Whether an entry of ``arrays`` is a region (uri, ((start, stop), ...)) of an array."""
    return isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], (str, os.PathLike)) and isinstance(entry[1], (tuple, list))


def _offsets(arrays: Any, align: int) -> np.ndarray | None:
    """Per entry of ``arrays``, where its region starts (None: whole arrays only)."""
    if isinstance(arrays, (Mapping, str, os.PathLike)) or not any(_is_region(u) for u in arrays):
        return None
    out = []
    for u in arrays:
        if not _is_region(u):
            raise InvalidArgument("arrays are all regions (uri, box) of arrays, or none")
        box = [(int(a), int(b)) for a, b in u[1]]
        if any(a < 0 or b <= a for a, b in box):
            raise InvalidArgument(f"a region must be a non-empty box inside its array, got {u[1]!r}", uri=str(u[0]))
        if any(a % align for a, _ in box):
            raise InvalidArgument(f"a region must start on multiples of {align} for the scales given, got {u[1]!r}", uri=str(u[0]))
        out.append([a for a, _ in box])
    if len({len(o) for o in out}) != 1:
        raise InvalidArgument("the regions have different numbers of axes")
    return np.array(out, dtype=np.int64)


def _sample(where: str | dict, box: tuple, scales: Mapping[str, float] | None, normalize: Any = None, **kw: Any) -> Any:
    """A sample of ``box``: of one array, or a MultiSample of a group {name: uri};
    ``normalize`` as the samplers take it (see :func:`_check_normalize`)."""
    if isinstance(where, dict):
        from damacy.multi import MultiSample

        level = kw.pop("level", None)
        return MultiSample.at(
            where, box, scales=scales, levels=None if level is None else dict.fromkeys(where, level), normalize=normalize, **kw
        )
    if isinstance(normalize, Mapping):
        normalize = normalize.get(where)
    return Sample(where, box, normalize=normalize, **kw)


def _check_normalize(normalize: Any, arrays: list[tuple[Any, tuple[int, ...]]]) -> Any:
    """A sampler's ``normalize``: one (offset, scale) for every array, {uri: (offset, scale)}
    for arrays given by uri (those left out are not normalised), or {name: (offset, scale)}
    for groups of arrays. Checked here, so a wrong key fails at once."""
    if normalize is None:
        return None
    groups = [where for where, _ in arrays if isinstance(where, dict)]
    if not isinstance(normalize, Mapping):
        if groups:
            raise InvalidArgument("for groups of arrays, normalize is {name: (offset, scale)}")
        return normalize_pair(normalize)
    known = set().union(*(set(g) for g in groups)) if groups else {where for where, _ in arrays}
    unknown = set(normalize) - known
    if unknown:
        raise InvalidArgument(f"normalize names {sorted(map(str, unknown))}, which are not among the {'names' if groups else 'arrays'}")
    return {key: normalize_pair(pair) for key, pair in normalize.items()}


def _alignment(scales: Mapping[str, float] | None, sample_shape: tuple[int, ...]) -> int:
    """The step box origins keep so that every scaled part lands on whole coordinates: for
    each scale p/q (a ratio of whole numbers up to 1000: 0.5, 1/3, 1.5, 4), q; the least common
    multiple of them."""
    align = 1
    for name, factor in (scales or {}).items():
        if not isinstance(factor, (int, float, np.integer, np.floating)) or isinstance(factor, bool) or factor <= 0:
            raise InvalidArgument(f"scales[{name!r}] must be a positive number, got {factor!r}")
        ratio = fractions.Fraction(float(factor)).limit_denominator(1000)
        if abs(float(ratio) - float(factor)) > 1e-9 * float(factor):
            raise InvalidArgument(f"scales[{name!r}] = {factor}: a scale must be a ratio of whole numbers (p/q, q up to 1000)")
        align = math.lcm(align, ratio.denominator)
    if any(k % align for k in sample_shape):
        raise InvalidArgument(f"sample_shape {sample_shape} must be a multiple of {align} for scales {dict(scales or {})}")
    return align


class _Sampler:
    #: how the ranks' equal shares are cut ("drop": the rest left out; "repeat": the shortest
    #: ranks repeat the first; "padding": GridBoxes' own, a Padding sample)
    _fill = "drop"
    #: RandomBoxes' option: the order groups a node's ranks' boxes by chunk
    locality = False

    def __init__(
        self,
        seed: int,
        rank: int | None,
        world_size: int | None,
        *,
        window: int | None = None,
        share_windows: bool = False,
        local_world_size: int | None = None,
        chunks_of: ChunksOf | None = None,
    ) -> None:
        self.seed = check_seed(seed)
        self.rank, self.world_size = partition(rank, world_size)
        self.epoch = 0
        self.consumed: list[tuple[int, int]] = []  # positions of this epoch read before (elastic resume)
        local = local_world_size
        if local is None:  # torchrun's, when it fits this partition (a sampler of fewer ranks: one node)
            local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
            if local < 1 or self.world_size % local:
                local = self.world_size
        if not _is_int(local) or local < 1 or self.world_size % local:
            raise InvalidArgument(f"local_world_size must divide world_size ({self.world_size}), got {local!r}")
        self.local_world_size = int(local)  # ranks per node (see RandomBoxes' locality, share_windows)
        self.window = check_window(window)
        self.share_windows = bool(share_windows)
        self._cells = CellIndex(chunks_of)  # reads the arrays' chunk shapes on first use

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration draws (its order and boxes come from (seed, epoch))."""
        if not _is_int(epoch) or epoch < 0:
            raise InvalidArgument(f"epoch must be a non-negative integer, got {epoch!r}")
        if int(epoch) != self.epoch:
            self.consumed = []  # an elastic resume applies to its own epoch only
        self.epoch = int(epoch)

    def _key(self, purpose: int = 0) -> np.uint64:
        """The key of this epoch's draws for one purpose (0: the samples, 3: a shuffle)."""
        return order.key(self.seed, self.epoch, purpose)

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed, "epoch": self.epoch, "rank": self.rank, "world_size": self.world_size,
            "local_world_size": self.local_world_size, "consumed": [list(r) for r in self.consumed],
            "window": self.window, "share_windows": self.share_windows, "order": order.ORDER_VERSION,
            "window_order": WINDOW_ORDER,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Seed, epoch and the positions of the epoch read before the last partition, from a
        saved state (this rank's, the same number of ranks; for another number see
        :meth:`resume`)."""
        self._check_seed(state)
        self._check_partition(state)
        self.set_epoch(int(state["epoch"]))
        self.consumed = order.merge_ranges(state.get("consumed", []))

    def _check_partition(self, state: Mapping[str, Any]) -> None:
        """A state restores its own rank of the same partition: the same rank and number of
        ranks, and, where the order depends on them, the same ranks per node and window
        sharing (else the saved offset names other samples)."""
        rank, world = int(state.get("rank", self.rank)), int(state.get("world_size", self.world_size))
        if (rank, world) != (self.rank, self.world_size):
            raise InvalidArgument(
                f"the state was saved by rank {rank} of {world}, this sampler is rank {self.rank} of "
                f"{self.world_size}: each rank loads its own state; for another number of ranks, gather "
                "every rank's state and call resume(states)"
            )
        local = int(state.get("local_world_size", world))
        shared = bool(state.get("share_windows", False))
        if self.window is not None and shared != self.share_windows:
            raise InvalidArgument(
                f"the state was saved with share_windows={shared}, this sampler has "
                f"share_windows={self.share_windows}: the ranks' runs differ, so the saved offset names other samples"
            )
        if ((self.window is not None and shared) or self.locality) and local != self.local_world_size:
            raise InvalidArgument(
                f"the state was saved with local_world_size={local}, this sampler has {self.local_world_size}: "
                "the order groups a node's ranks, so the saved offset names other samples"
            )

    def _check_seed(self, state: Mapping[str, Any]) -> None:
        version = state.get("order", 1)
        if version != order.ORDER_VERSION:
            raise InvalidArgument(
                f"the state was saved by samplers of order version {version}; these compute order version "
                f"{order.ORDER_VERSION} (each sample from (seed, epoch, index), no epoch list), so the saved "
                "position would name other samples: finish that epoch with the damacy that saved it, or go on "
                "from the next epoch (set_epoch) without load_state_dict"
            )
        if int(state["seed"]) != self.seed:
            raise InvalidArgument(f"the state was saved with seed {state['seed']}, this sampler has seed {self.seed}")
        window = state.get("window")
        if window != self.window:
            raise InvalidArgument(
                f"the state was saved with window={window}, this sampler has window={self.window}: "
                "the epoch's order differs, so the saved position would name other samples"
            )
        saved = state.get("window_order", 1)
        # version 1's order differs where ranks cut it or an elastic resume left positions out
        moved = int(state.get("world_size", 1)) > 1 or bool(state.get("consumed"))
        if window is not None and moved and saved != WINDOW_ORDER:
            raise InvalidArgument(
                f"the state was saved by a windowed order of version {saved}; this damacy's is version "
                f"{WINDOW_ORDER} (each rank's run packed into windows of its own), so the saved position "
                "would name other samples: finish that epoch with the damacy that saved it, or go on from "
                "the next epoch (set_epoch) without load_state_dict"
            )

    def resume(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Elastic resume: go on with the epoch that every rank of an earlier run (of any
        number of ranks) was in, over the samples none of them had read. ``states``: the
        ``pipe.state_dict()`` of every earlier rank (one each; gather them at save or at
        load). The epoch's remaining samples are then shared by this run's ranks as a fresh
        epoch would be; push this sampler to a pipeline with no ``load_state_dict``.

        What the earlier ranks read is found by index arithmetic (ranks that kept in step
        read a prefix of the shares: one range), so this costs no epoch list either."""
        sources = [st.get("source_state") for st in states]
        if not sources or any(not isinstance(x, Mapping) for x in sources):
            raise InvalidArgument("resume takes the pipeline states of every earlier rank (with their samplers' states)")
        world = {int(x["world_size"]) for x in sources}
        epochs = {int(x["epoch"]) for x in sources}
        if len(world) != 1 or len(epochs) != 1:
            raise InvalidArgument(f"the states come from different runs or epochs (world sizes {sorted(world)}, epochs {sorted(epochs)})")
        (old_world,) = world
        ranks = sorted(int(x["rank"]) for x in sources)
        if ranks != list(range(old_world)):
            raise InvalidArgument(f"resume needs the states of all {old_world} earlier ranks, got ranks {ranks}")
        for x in sources:
            self._check_seed(x)
        self.set_epoch(epochs.pop())
        before = order.merge_ranges(sources[0].get("consumed", []))
        shares = {(int(x.get("local_world_size", old_world)), bool(x.get("share_windows", False))) for x in sources}
        if len(shares) != 1:
            raise InvalidArgument(f"the states come from ranks of different partitions ((local_world_size, share_windows): {sorted(shares)})")
        (old_local, old_shared), = shares
        pool = self._pool(before, old_world, old_local, old_shared)
        share = order.equal_share(len(pool), old_world, self._fill)
        offsets = [0] * old_world
        for st, x in zip(states, sources):
            offset = st.get("offset")
            if not _is_int(offset) or not 0 <= offset <= share:
                raise InvalidArgument(
                    f"rank {x['rank']}'s state has offset {offset!r}; a pipeline state's offset counts the samples "
                    f"of that rank's share ({share}) it read, from 0 to {share}"
                )
            offsets[int(x["rank"])] = int(offset)
        read = _read_ranges(len(pool), offsets, self._fill, self._runs(old_local, old_shared))
        if pool.order is not None:  # a materialised order (windows, locality): its positions
            parts = [pool.order[a:b] for a, b in read] + [np.arange(a, b) for a, b in before]
            self.consumed = order.consumed_ranges(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))
        else:  # positions ascend with the pool index: each run of indices is one run of positions
            spans = [(int(pool.at(a)), int(pool.at(b - 1)) + 1) for a, b in read]
            self.consumed = order.merge_ranges(spans + before)

    def epoch_samples(self) -> list:
        """Every rank's samples of this epoch, in order (the global list; built whole: the
        ranks' iteration never builds it)."""
        return self._at(np.arange(self._count(), dtype=np.int64))

    def _count(self) -> int:
        """The length of the epoch's global list."""
        raise NotImplementedError

    def _at(self, positions: np.ndarray) -> list:
        """The samples at ``positions`` of the epoch's global list, from (seed, epoch,
        position) alone."""
        raise NotImplementedError

    def _order(self, consumed: Sequence[tuple[int, int]], world: int, local: int, shared: bool) -> np.ndarray | None:
        """The positions not ``consumed`` of the global list in the order they are shared out
        among ``world`` ranks (``local`` per node, ``shared``: share_windows): None for the
        list's own (computed, never built); else built, when the sampler reorders it by chunk
        windows (or for locality; positions consumed may then stay in, the pool drops them).
        Windows are packed within each rank's run (each node's, shared), so a rank reads
        whole windows."""
        if self.window is None:
            return None
        count = self._count()
        keep = np.ones(count, dtype=bool)
        for a, b in consumed:
            keep[a:b] = False
        remaining = np.flatnonzero(keep)
        cuts = order.share_cuts(len(remaining), world, self._fill, self._runs(local, shared))
        return np.asarray(self._windows(self.epoch_samples(), remaining.tolist(), cuts)[0], dtype=np.int64)

    def _pool(self, consumed: Sequence[tuple[int, int]], world: int, local: int, shared: bool | None = None) -> order.Pool:
        shared = self.share_windows if shared is None else shared
        return order.Pool(self._count(), self._order(consumed, world, local, shared), consumed)

    def _runs(self, local: int, shared: bool | None = None) -> int | None:
        """How the ranks share the pool: None for strides (entries r, r + W, ...); with a
        window, contiguous runs (so each rank reads whole windows), the ``local`` ranks of a
        node taking turns within their node's run with ``shared`` windows (default this
        sampler's ``share_windows``: for one damacyd to decode it once for all of them)."""
        if self.window is None or self._fill == "padding":
            return None
        return local if (self.share_windows if shared is None else shared) else 1

    def _windows(self, items: list, positions: list[int] | None = None, cuts: Sequence[int] = ()) -> tuple[list[int], list[int], Cells]:
        """The windowed order of ``items`` (see :mod:`damacy.windows`; ``positions`` and
        ``cuts`` as :func:`window_order` takes them), the windows' starts in it, and the
        items' cells. Shuffled from (seed, epoch) by a stream of its own, so the samples
        drawn are the same with or without a window."""
        cells = self._cells.cells(items)
        rng = np.random.default_rng([self.seed, self.epoch, 2])
        order_, starts = window_order(cells, self.window, rng, positions=positions, cuts=cuts)
        return order_, starts, cells

    def shuffle_quality(self, batch_size: int) -> dict[str, float]:
        """How this epoch's order mixes the data, for choosing ``window``: ``batch_diversity``,
        the mean number of distinct chunk cells in a batch of ``batch_size`` consecutive
        samples of the global order over a uniform permutation's (1.0: as mixed as a full
        shuffle), with the number of windows and their mean samples and decoded bytes."""
        items = self.epoch_samples()
        if self.window is not None:  # as this sampler's ranks share the epoch
            cuts = order.share_cuts(len(items), self.world_size, self._fill, self._runs(self.local_world_size))
            order_, starts, cells = self._windows(items, None, cuts)
        else:
            cells = self._cells.cells(items)
            built = self._order([], self.world_size, self.local_world_size, self.share_windows)
            order_, starts = (list(range(len(items))) if built is None else built.tolist()), [0]
        of = [cells.of[p] for p in order_]
        per_window = np.diff(starts + [len(order_)])
        window_bytes = [self._cells.window_bytes(cells, set(of[a:b])) for a, b in zip(starts, starts[1:] + [len(order_)])]
        return {
            "batch_diversity": batch_diversity(of, batch_size),
            "windows": float(len(starts)),
            "samples_per_window": float(per_window.mean()) if len(per_window) else 0.0,
            "window_bytes": float(np.mean(window_bytes)) if window_bytes else 0.0,
        }

    def rank_samples(self) -> list:
        """This rank's samples of the epoch, built whole (iterating the sampler does not)."""
        return list(self)

    def iter_from(self, offset: int) -> Iterator:
        """This rank's samples of the epoch from its ``offset``-th on, each computed when
        reached (a pipeline restoring a position starts here instead of skipping). The
        iteration is of the epoch and position the sampler has at this call: a ``set_epoch``
        or ``load_state_dict`` after it (the next epoch queued while a pipeline still pulls
        this one) leaves it as it is."""
        return copy.copy(self)._samples_from(int(offset))

    def _samples_from(self, offset: int) -> Iterator:
        pool = self._pool(self.consumed, self.world_size, self.local_world_size)
        per_rank = order.equal_share(len(pool), self.world_size, self._fill)
        runs = self._runs(self.local_world_size)
        lo, block = max(0, int(offset)), _FIRST_BLOCK
        while lo < per_rank:
            js = np.arange(lo, min(lo + block, per_rank), dtype=np.int64)
            ks, padding = order.share_positions(len(pool), self.rank, self.world_size, self._fill, js, runs=runs)
            samples = self._at(pool.at(ks))
            for s, pad in zip(samples, padding.tolist()):
                yield _padding(s) if pad else s
            lo, block = lo + len(js), min(2 * block, _BLOCK)

    def __iter__(self) -> Iterator:
        return self.iter_from(0)

    def __len__(self) -> int:
        n = self._count() - sum(b - a for a, b in self.consumed)
        return order.equal_share(n, self.world_size, self._fill)


#: samples computed at a time while a rank iterates its share: few first (a sample of an
#: array not drawn before reads its shape, so the first batch opens few arrays), more later
_FIRST_BLOCK, _BLOCK = 64, 1024


def _read_ranges(n: int, offsets: list[int], fill: str, runs: int | None) -> list[tuple[int, int]]:
    """The pool indices the ranks of a run read, as [a, b) ranges: rank r read its entries
    0 .. offsets[r] - 1 of :func:`order.share_positions`. Ranks taking turns (strides, or a
    node's ranks within its run) read a common prefix of their turns (one range) and a few
    entries past it where some ran ahead."""
    world = len(offsets)
    per_rank = order.equal_share(n, world, fill)
    out: list[tuple[int, int]] = []
    if fill == "padding":  # contiguous blocks; padding entries (past a block's end) read nothing new
        base, extra = divmod(n, world)
        for r, off in enumerate(offsets):
            real = min(off, base + (1 if r < extra else 0))
            if real:
                start = r * base + min(r, extra)
                out.append((start, start + real))
        return order.merge_ranges(out)
    stride = world if runs is None else runs
    for first in range(0, world, stride):  # one group of ranks taking turns
        group = offsets[first : first + stride]
        base = 0 if runs is None else (first // stride) * per_rank * stride
        common = min(group)
        if common:
            out.append((base, base + common * stride))
        for t, off in enumerate(group):
            out.extend((k, k + 1) for k in range(base + t + common * stride, base + t + off * stride, stride))
    if fill == "repeat":  # indices past the pool wrapped to its start (as often as they go round)
        wrapped = []
        for a, b in out:
            if b - a >= n:
                wrapped.append((0, n))
                continue
            a, b = a % n, a % n + b - a
            wrapped.extend([(a, b)] if b <= n else [(a, n), (0, b - n)])
        out = wrapped
    return order.merge_ranges(out)


def _padding(s: Any) -> Any:
    """``s`` again, marked as padding (every part of a MultiSample)."""
    if isinstance(s, Sample):
        return Padding(s.uri, s.selection, level=s.level, flip=s.flip, transpose=s.transpose, normalize=s.normalize)
    from damacy.multi import MultiSample

    return MultiSample({name: _padding(part) for name, part in s.parts.items()})


class RandomBoxes(_Sampler):
    """``samples_per_epoch`` boxes of ``sample_shape`` per epoch: an array drawn (by
    ``weights``, default equal), then an origin uniform over the positions where the box
    fits (an axis shorter than the box: origin 0, the rest padded by a pipeline with
    ``out_of_bounds="pad"``; the default, ``"error"``, fails such a sample).

    ``arrays``: uris (their shapes read from their metadata) or {uri: shape}. ``level``: the
    NGFF level the boxes are in (shapes then given, or read at that level).

    Transforms drawn from the same seed, made by the copies (no pass of their own): each
    axis in ``flips`` reversed with probability 1/2; one of ``transposes`` (axis orders, the
    identity included if wanted) per sample, the box then drawn in the array's order so that
    its transposed shape is ``sample_shape``.

    ``locality``: the ranks of one node (``local_world_size`` of them, default torchrun's
    ``LOCAL_WORLD_SIZE``; ranks are numbered node by node) read neighbouring boxes at the same
    step, so the node's damacyd decodes their chunks once for all of them: the epoch's boxes
    are sorted by array and by cell (the box origin in units of the sample shape), cut into
    groups of ``local_world_size`` in that order, and the groups shuffled from the seed; each
    group is one step of one node. The boxes drawn are the same, only who reads which when
    changes (a batch then holds boxes of several groups, still spread over the data).

    ``normalize``: (offset, scale) for every array, {uri: (offset, scale)} per array, or
    {name: (offset, scale)} for groups; the samples' values become ``(x - offset) * scale``
    in the cast (see :class:`~damacy_protocol.samples.Sample`).

    ``foreground``: where the content is, per array a mask (a numpy array, or the uri of an
    array read once here; nonzero is foreground) of any shape, each mask element standing
    for the box of the array it scales to (a label map at a coarse level serves). Given as a
    list beside ``arrays`` (None: no mask) or {uri: mask}. With probability
    ``foreground_fraction`` (default 1) a box of a masked array is centred on a point drawn
    uniformly from its foreground (then moved inside the array, if it reached out), else
    drawn as above: nnU-Net's foreground oversampling. A mask without foreground is refused.
    The sampler keeps the coordinates of every foreground element: give a coarse mask (a label
    map's low level), not a full-resolution one.

    ``labels`` (the same forms as ``foreground``: label maps, any shape) with
    ``label_ratios={class: weight}``: a box of a labelled array is centred on a point of a
    class drawn by the ratios among the classes its map holds (MONAI's crops by label
    classes; ``foreground_fraction`` of the boxes, default all). ``min_foreground``: a box of
    an array with a map (``foreground`` or ``labels``, nonzero as foreground) must hold at
    least that share of foreground, measured on the map with a summed-area table (never by
    reading labels per draw); a box short of it is drawn again, up to ``max_tries`` times,
    then the one with the most foreground of those tried is kept (gunpowder's minimum masked
    fraction). See :mod:`damacy.labels`.
    """

    def __init__(
        self,
        arrays: Sequence[str] | Mapping[str, Sequence[int]],
        sample_shape: Sequence[int],
        *,
        seed: int,
        samples_per_epoch: int,
        rank: int | None = None,
        world_size: int | None = None,
        weights: Sequence[float] | None = None,
        level: int | None = None,
        flips: Sequence[int] = (),
        transposes: Sequence[Sequence[int]] = (),
        scales: Mapping[str, float] | None = None,
        locality: bool = False,
        local_world_size: int | None = None,
        normalize: Any = None,
        foreground: Sequence[Any] | Mapping[str, Any] | None = None,
        foreground_fraction: float = 1.0,
        labels: Sequence[Any] | Mapping[str, Any] | None = None,
        label_ratios: Mapping[Any, float] | None = None,
        min_foreground: float = 0.0,
        max_tries: int = 32,
        window: int | None = None,
        share_windows: bool = False,
        shape_of: Callable[[str], Sequence[int]] | None = None,
        chunks_of: ChunksOf | None = None,
    ) -> None:
        super().__init__(
            seed, rank, world_size, window=window, share_windows=share_windows, local_world_size=local_world_size, chunks_of=chunks_of
        )
        arrays = _listed(arrays)
        sample_shape = _box_shape(sample_shape)
        self.scales = scales
        self.align = _alignment(scales, sample_shape)
        self.locality = bool(locality)
        if self.locality and self.window is not None:
            raise InvalidArgument("locality and window order the epoch two ways: take window with share_windows=True for a node's ranks")
        self.sample_shape = tuple(int(n) for n in sample_shape)
        # shapes not given are read when an array is first drawn (an epoch over a plate of
        # 10^5 images opens those it reads); weights by region sizes and masks need them all
        self.arrays = _shapes(arrays, shape_of, level, len(self.sample_shape), self.sample_shape)
        if not len(self.arrays):
            raise InvalidArgument("RandomBoxes needs at least one array")
        self.offsets = _offsets(arrays, self.align)
        if self.offsets is not None and (foreground is not None or labels is not None):
            raise InvalidArgument("foreground masks and label maps are per whole array: give arrays, not regions, with them")
        self.normalize = _check_normalize(normalize, [(self.arrays.where(a), None) for a in range(len(self.arrays))])
        if not _is_int(samples_per_epoch) or samples_per_epoch < self.world_size:
            raise InvalidArgument(f"samples_per_epoch must be an integer of at least world_size ({self.world_size}), got {samples_per_epoch!r}")
        self.samples_per_epoch = int(samples_per_epoch)
        if weights is None and self.offsets is not None:  # regions: boxes uniform over their elements
            sizes = np.array([math.prod(shape) for _, shape in self.arrays], dtype=np.float64)
            self.p = sizes / sizes.sum()
        elif weights is None:
            self.p = None
        else:
            try:
                w = np.asarray(weights, dtype=np.float64)
            except (TypeError, ValueError):
                w = np.full(0, np.nan)  # refused below
            if w.shape != (len(self.arrays),) or not np.all(np.isfinite(w)) or (w < 0).any() or w.sum() <= 0:
                raise InvalidArgument(f"weights must be {len(self.arrays)} non-negative numbers, not all 0")
            self.p = w / w.sum()
        self.level = level
        ndim = len(self.sample_shape)
        self.flips = tuple(sorted(set(_axes(flips, "flips"))))
        if any(not 0 <= a < ndim for a in self.flips):
            raise InvalidArgument(f"flips {tuple(flips)} must be axes of the {ndim}-d samples")
        if isinstance(transposes, (str, bytes, Mapping)) or not hasattr(transposes, "__iter__"):
            raise InvalidArgument(f"transposes must be a sequence of axis orders, got {transposes!r}")
        self.transposes = [tuple(_axes(t, "each of transposes")) for t in transposes]
        if any(sorted(t) != list(range(ndim)) for t in self.transposes):
            raise InvalidArgument(f"transposes must be orders of the {ndim} axes, got {self.transposes}")
        if self.offsets is not None:  # a box must fit in every region, in every axis order drawn
            extents = [tuple(self.sample_shape[i] for i in np.argsort(t)) for t in self.transposes] or [self.sample_shape]
            for uri, shape in self.arrays:
                for e in extents:
                    if any(k > n for k, n in zip(e, shape)):
                        raise InvalidArgument(
                            f"a box of {e} does not fit in the region of {shape} (it would read another region's data): "
                            "split into larger blocks (block=) or draw smaller boxes", uri=str(uri)
                        )
        if foreground is not None and labels is not None:
            raise InvalidArgument("give foreground masks or label maps, not both (label maps' nonzero elements are their foreground)")
        if label_ratios is not None and labels is None:
            raise InvalidArgument("label_ratios needs labels: the label map of each array")
        if not isinstance(foreground_fraction, (int, float)) or not 0.0 <= foreground_fraction <= 1.0:
            raise InvalidArgument(f"foreground_fraction must be a probability (0 to 1), got {foreground_fraction!r}")
        if not isinstance(min_foreground, (int, float)) or not 0.0 <= min_foreground <= 1.0:
            raise InvalidArgument(f"min_foreground must be a share (0 to 1), got {min_foreground!r}")
        if not _is_int(max_tries) or max_tries < 1:
            raise InvalidArgument(f"max_tries must be a positive integer, got {max_tries!r}")
        self.foreground_fraction = float(foreground_fraction)
        self.min_foreground = float(min_foreground)
        self.max_tries = int(max_tries)
        # the maps (foreground masks or label maps) and the classes boxes are centred on
        self.maps: labels_.LabelMaps | None = None
        self.centre: tuple[list[Any], np.ndarray] | None = None
        given = foreground if foreground is not None else labels
        loaded = labels_.load_maps(given, list(self.arrays), "foreground" if foreground is not None else "labels") if given is not None else None
        if loaded is not None:
            names = [str(self.arrays.where(a) if not isinstance(self.arrays.where(a), dict) else next(iter(self.arrays.where(a).values()))) for a in range(len(self.arrays))]
            if label_ratios is not None:
                self.centre = labels_.check_ratios(label_ratios)
                self.maps = labels_.LabelMaps(loaded, names, self.centre[0])  # its foreground (nonzero) serves min_foreground
            else:
                self.maps = labels_.LabelMaps(loaded, names)
                if foreground is not None:
                    self.centre = ([labels_.FOREGROUND], np.ones(1))

    # the streams of a sample's draws (see order.uniform): one value each, per axis from the
    # axis' stream on; fixed, so adding a draw never moves the others
    _ARRAY, _TRANSPOSE, _FLIPS, _ORIGIN, _CHOSEN, _CELL, _POINT, _CLASS, _RETRY = 0, 1, 2, 64, 128, 129, 130, 160, 256

    def _count(self) -> int:
        return self.samples_per_epoch

    def _at(self, positions: np.ndarray) -> list:
        """Sample i of the epoch from (seed, epoch, i): its array (by ``weights``), its axis
        order and flips, then an origin uniform over where the box fits."""
        k = self._key()
        idx = np.asarray(positions, dtype=np.int64)
        n = len(idx)
        if self.p is None:
            which = order.integers(k, idx, self._ARRAY, len(self.arrays))
        else:
            cum = np.cumsum(self.p)
            which = np.minimum(np.searchsorted(cum / cum[-1], order.uniform(k, idx, self._ARRAY), side="right"), len(self.arrays) - 1)
            which = np.where(self.p[which] > 0, which, np.argmax(self.p))  # rounding never picks a weight of 0
        orders = order.integers(k, idx, self._TRANSPOSE, len(self.transposes)) if self.transposes else None
        flipped = (
            np.stack([order.uniform(k, idx, self._FLIPS + f) < 0.5 for f in range(len(self.flips))], axis=1) if self.flips else None
        )
        out_shape = np.array(self.sample_shape, dtype=np.int64)
        # per sample the box's extents in the array's axis order (its transposed shape is the sample's)
        sizes = np.tile(out_shape, (n, 1))
        if orders is not None:
            inverse = np.array([np.argsort(t) for t in self.transposes], dtype=np.int64)
            sizes = out_shape[inverse[orders]]
        table = {a: self.arrays.shape(a) for a in np.unique(which).tolist()}  # the drawn arrays' shapes only
        of_which = np.array([table[a] for a in which.tolist()], dtype=np.int64).reshape(n, len(out_shape))
        top = np.maximum(0, of_which - sizes) // self.align + 1
        origins = np.stack([order.integers(k, idx, self._ORIGIN + ax, top[:, ax]) for ax in range(len(out_shape))], axis=1) * self.align
        origins = origins.reshape(n, len(out_shape))
        if self.offsets is not None:
            origins = origins + self.offsets[which]
        if self.centre is not None:
            self._centre(k, idx, which, origins, sizes)
        if self.min_foreground > 0 and self.maps is not None:
            self._enough_foreground(k, idx, which, origins, sizes, top)
        out = []
        for j, (a, o, size) in enumerate(zip(which.tolist(), origins, sizes)):
            flip = tuple(ax for ax, f in zip(self.flips, flipped[j]) if f) if flipped is not None else ()
            axes = self.transposes[orders[j]] if orders is not None else None
            out.append(_sample(self.arrays.where(a), tuple(zip(o.tolist(), (o + size).tolist())), self.scales, self.normalize, level=self.level, flip=flip, transpose=axes))
        return out

    def _centre(self, k: np.uint64, idx: np.ndarray, which: np.ndarray, origins: np.ndarray, sizes: np.ndarray) -> None:
        """Move the boxes chosen by ``foreground_fraction`` to centre on a point of a class
        drawn by the ratios (the foreground, for masks), in place."""
        chosen = order.uniform(k, idx, self._CHOSEN) < self.foreground_fraction
        classes, probs = self.centre
        for a in np.unique(which).tolist():
            if not self.maps.has(a):
                continue
            ks = np.flatnonzero(chosen & (which == a))
            if not len(ks):
                continue
            shape = np.array(self.arrays.shape(a), dtype=np.int64)
            held = [c for c in classes if c in self.maps.cells[a]]  # the classes this map holds
            p = np.array([probs[classes.index(c)] for c in held], dtype=np.float64)
            if p.sum() <= 0:
                continue  # the map holds only classes of weight 0: boxes stay uniform
            if len(held) == 1:
                picks = np.zeros(len(ks), dtype=np.int64)
            else:
                cum = np.cumsum(p) / p.sum()
                picks = np.minimum(np.searchsorted(cum, order.uniform(k, idx[ks], self._CLASS), side="right"), len(held) - 1)
            for c_index, cls in enumerate(held):
                sel = ks[picks == c_index]
                if not len(sel):
                    continue
                point = self.maps.points(k, idx[sel], a, cls, shape, self._CELL, self._POINT)
                size = sizes[sel]
                top = np.maximum(0, shape - size) // self.align
                # the aligned origin nearest the centred one (floored, a box no larger than
                # the alignment could end before the point)
                origins[sel] = np.clip((point - size // 2 + self.align // 2) // self.align, 0, top) * self.align

    def _enough_foreground(self, k: np.uint64, idx: np.ndarray, which: np.ndarray, origins: np.ndarray, sizes: np.ndarray, top: np.ndarray) -> None:
        """Boxes of arrays with a map holding less than ``min_foreground`` are drawn again
        (uniformly, a stream per try) until one holds enough; after ``max_tries`` the one
        with the most foreground stays (in place)."""
        maps = self.maps
        for a in np.unique(which).tolist():
            if not maps.has(a):
                continue
            ks = np.flatnonzero(which == a)
            shape = np.array(self.arrays.shape(a), dtype=np.int64)
            best = maps.fraction(a, origins[ks], sizes[ks], shape)
            short = best < self.min_foreground
            for t in range(self.max_tries):
                if not short.any():
                    break
                sel = ks[short]
                tried = np.stack(
                    [order.integers(k, idx[sel], self._RETRY + 16 * t + ax, top[sel, ax]) for ax in range(len(shape))], axis=1
                ) * self.align
                got = maps.fraction(a, tried, sizes[sel], shape)
                better = got > best[short]
                origins[sel[better]] = tried[better]
                best[np.flatnonzero(short)[better]] = got[better]
                short = best < self.min_foreground

    def _order(self, consumed: Sequence[tuple[int, int]], world: int, local: int, shared: bool) -> np.ndarray | None:
        if not self.locality or local <= 1:
            return super()._order(consumed, world, local, shared)
        items = self.epoch_samples()  # locality sorts the epoch's boxes: built whole
        rng = np.random.default_rng([self.seed, self.epoch, 1])
        size = self.sample_shape

        def cell(k: int) -> tuple:
            s = items[k] if isinstance(items[k], Sample) else next(iter(items[k].parts.values()))
            return (s.uri, tuple(sl.start // n for sl, n in zip(s.selection, size)))

        tiebreak = rng.permutation(len(items))
        ordered = sorted(range(len(items)), key=lambda k: (cell(k), tiebreak[k]))
        groups = [ordered[i : i + local] for i in range(0, len(ordered), local)]
        return np.array([p for g in rng.permutation(len(groups)).tolist() for p in groups[g]], dtype=np.int64)


class Shuffled(_Sampler):
    """A fixed list of samples (``Sample``/``IndexQuery``) in a new order each epoch."""

    def __init__(
        self,
        samples: Sequence[Sample | IndexQuery],
        *,
        seed: int,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        window: int | None = None,
        share_windows: bool = False,
        local_world_size: int | None = None,
        chunks_of: ChunksOf | None = None,
    ) -> None:
        super().__init__(
            seed, rank, world_size, window=window, share_windows=share_windows, local_world_size=local_world_size, chunks_of=chunks_of
        )
        self._fill = "drop" if drop_last else "repeat"
        self.samples = list(samples)
        for s in self.samples:
            if not isinstance(s, (Sample, IndexQuery)):
                raise InvalidArgument(f"Shuffled takes Sample or IndexQuery objects, got {type(s).__name__}")
        if len(self.samples) < self.world_size:
            raise InvalidArgument(f"{len(self.samples)} samples cannot be shared by {self.world_size} ranks")
        self.drop_last = drop_last

    def _count(self) -> int:
        return len(self.samples)

    def _at(self, positions: np.ndarray) -> list:
        """The list in a keyed permutation of (seed, epoch): position p holds sample perm(p)."""
        perm = order.Permutation(len(self.samples), self._key(3))
        return [self.samples[i] for i in perm(positions).tolist()]


class GridBoxes(_Sampler):
    """Windows of ``sample_shape`` every ``step`` (default: the shape, no overlap) along each
    axis of each array, covering every element: with ``edge="shift"`` (default) the last
    window of an axis is moved back to end at the array's end (it overlaps its neighbour);
    with ``edge="pad"`` it starts on the step and reaches past the end (padded by a
    pipeline with ``out_of_bounds="pad"``). Windows come array by array in C order; rank
    ``r`` takes the ``r``-th contiguous block; ranks with one window fewer end with a
    :class:`Padding` sample. Inference that must see every window reads them with
    ``drop_last=False`` (the Config's default, ``True``, leaves a short last batch out).
    ``normalize`` as for :class:`RandomBoxes`."""

    def __init__(
        self,
        arrays: Sequence[str] | Mapping[str, Sequence[int]],
        sample_shape: Sequence[int],
        *,
        step: Sequence[int] | None = None,
        edge: str = "shift",
        rank: int | None = None,
        world_size: int | None = None,
        level: int | None = None,
        scales: Mapping[str, float] | None = None,
        normalize: Any = None,
        window: int | None = None,
        shape_of: Callable[[str], Sequence[int]] | None = None,
        chunks_of: ChunksOf | None = None,
    ) -> None:
        super().__init__(0, rank, world_size, window=window, chunks_of=chunks_of)
        arrays = _listed(arrays)
        sample_shape = _box_shape(sample_shape)
        self.scales = scales
        self.align = _alignment(scales, sample_shape)
        self.sample_shape = sample_shape
        self.arrays = _shapes(arrays, shape_of, level, len(self.sample_shape))
        if not len(self.arrays):
            raise InvalidArgument("GridBoxes needs at least one array")
        list(self.arrays)  # a grid counts every array's windows: every shape, read concurrently
        self.offsets = _offsets(arrays, self.align)
        self.normalize = _check_normalize(normalize, self.arrays)
        self.step = self.sample_shape if step is None else tuple(int(n) for n in step)
        if len(self.step) != len(self.sample_shape) or any(s < 1 for s in self.step) or any(k < 1 for k in self.sample_shape):
            raise InvalidArgument(f"step {self.step} must give a positive step for each of the {len(self.sample_shape)} axes")
        if any(st % self.align for st in self.step):
            raise InvalidArgument(f"step {self.step} must be a multiple of {self.align} for scales {dict(scales or {})}")
        if any(s > k for s, k in zip(self.step, self.sample_shape)):
            raise InvalidArgument(f"step {self.step} is larger than sample_shape {self.sample_shape}: windows would leave gaps")
        if edge not in ("shift", "pad"):
            raise InvalidArgument(f"edge must be 'shift' or 'pad', got {edge!r}")
        self.edge = edge
        self._grid_cache: tuple[list[list[np.ndarray]], np.ndarray] | None = None
        self.level = level
        for uri, shape in self.arrays if self.offsets is not None else ():  # (their axes were checked as the shapes were read)
            if edge == "pad" or any(n < k for n, k in zip(shape, self.sample_shape)):
                raise InvalidArgument(
                    f"windows of {self.sample_shape} over a region of {shape} with edge={edge!r} would read past the region "
                    "(another region's data): regions take edge='shift' and windows that fit", uri=str(uri)
                )
            over = [a for a, (n, k, st) in enumerate(zip(shape, self.sample_shape, self.step)) if self._starts(n, k, st)[-1] + k > n]
            if over:  # the last window cannot shift to the region's end on the scales' grid
                raise InvalidArgument(
                    f"the last window of {self.sample_shape} over a region of {shape} (step {self.step}) would start on a "
                    f"multiple of {self.align} (scales {dict(scales or {})}) only past the region's end on axis {over[0]}, "
                    "reading another region's data: give a step that tiles the region, or scales that keep the shifted "
                    "window on their grid", uri=str(uri)
                )

    def _starts(self, n: int, k: int, step: int) -> list[int]:
        if n <= k:
            return [0]
        starts = list(range(0, n - k + 1, step))
        if starts[-1] + k < n:
            shifted = n - k
            # a scaled part must start on a whole coordinate: else the last window reaches past the end
            fits = self.edge == "shift" and shifted % self.align == 0
            starts.append(shifted if fits else starts[-1] + step)
        return starts

    def _grid(self) -> tuple[list[list[np.ndarray]], np.ndarray]:
        """Per array the window starts along each axis (a region's where it is), and where
        each array's windows begin in the epoch's list (cumulative counts, one more entry)."""
        if self._grid_cache is None:
            starts = []
            for a, (_, shape) in enumerate(self.arrays):
                axes = [np.array(self._starts(n, k, st), dtype=np.int64) for n, k, st in zip(shape, self.sample_shape, self.step)]
                if self.offsets is not None:  # a region's windows, where the region is
                    axes = [o + ax for o, ax in zip(self.offsets[a].tolist(), axes)]
                starts.append(axes)
            counts = [math.prod(len(ax) for ax in axes) for axes in starts]
            self._grid_cache = (starts, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))
        return self._grid_cache

    def _count(self) -> int:
        return int(self._grid()[1][-1])

    def _at(self, positions: np.ndarray) -> list:
        """Window i: its array (by the cumulative counts), then its place in that array's grid
        of windows, C order (index arithmetic, no list of windows)."""
        starts, first = self._grid()
        positions = np.asarray(positions, dtype=np.int64)
        which = np.searchsorted(first, positions, side="right") - 1
        out: list = [None] * len(positions)
        for a in np.unique(which).tolist():
            ks = np.flatnonzero(which == a)
            axes = starts[a]
            local = np.unravel_index(positions[ks] - first[a], tuple(len(ax) for ax in axes))
            origin = np.stack([ax[i] for ax, i in zip(axes, local)], axis=1).tolist()
            uri = self.arrays[a][0]
            for j, o in zip(ks.tolist(), origin):
                out[j] = _sample(uri, tuple((x, x + k) for x, k in zip(o, self.sample_shape)), self.scales, self.normalize, level=self.level)
        return out

    _fill = "padding"

    def _windows(self, items: list, positions: list[int] | None = None, cuts: Sequence[int] = ()) -> tuple[list[int], list[int], Cells]:
        """Sequential: the cells in the arrays' C order, each cell's windows in theirs."""
        cells = self._cells.cells(items)
        order_, starts = window_order(cells, self.window, None, keys=self._cells.cell_keys(), positions=positions, cuts=cuts)
        return order_, starts, cells
