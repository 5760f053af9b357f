"""Samplers: each rank's part of each epoch, as plain iterables of samples for any pipeline.

Every sampler builds the epoch's *global* list from (seed, epoch) alone, the same on every
rank and for every number of ranks, and hands rank ``r`` of ``W`` its part of it:

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
same; each rank reads a contiguous run of windows (``share_windows=True``: the
``local_world_size`` ranks of a node take turns in one run, so their damacyd decodes it once
for all of them); ``GridBoxes`` keeps its cells in C order. ``chunks_of(uri, level)`` gives
(shape, chunk shape, item size) where the arrays' metadata should not be read.

``set_epoch(e)`` picks the epoch; ``rank``/``world_size`` default to torch.distributed's
environment (``RANK``, ``WORLD_SIZE``), else 0 and 1. ``state_dict()`` holds the sampler's
seed, epoch and partition; the position within an epoch is the pipeline's to count.

(Over 400 lines: one job, the samplers; random boxes, grids and shuffled lists share the
rank partition, the per-array normalisation and the state they save.)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from damacy.windows import CellIndex, Cells, ChunksOf, batch_diversity, check_window, window_order
from damacy_protocol.errors import InvalidArgument
from damacy_protocol.samples import IndexQuery, Padding, Sample, normalize_pair


def partition(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world size): as given, else torch.distributed's environment (``RANK``,
    ``WORLD_SIZE``, set by torchrun), else (0, 1)."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgument(f"world_size must be a positive integer, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidArgument(f"rank must be in [0, {world_size}), got {rank!r}")
    return rank, world_size


def _shapes(arrays: Sequence[str] | Mapping[str, Sequence[int]], shape_of: Callable[[str], Sequence[int]] | None) -> list[tuple[str, tuple[int, ...]]]:
    if isinstance(arrays, Mapping):
        return [(str(u), tuple(int(n) for n in s)) for u, s in arrays.items()]
    if isinstance(arrays, (str, os.PathLike)):
        arrays = [arrays]
    if shape_of is None:
        from damacy_server.read import open_array  # the array's metadata, read here

        def shape_of(uri: str) -> tuple[int, ...]:
            return open_array(uri).shape

    out = []
    for u in arrays:
        if _is_region(u):  # a region of an array (a split's): its extent
            out.append((str(u[0]), tuple(int(b) - int(a) for a, b in u[1])))
        elif isinstance(u, Mapping):  # several arrays read at one box: the first one's shape
            if not u:
                raise InvalidArgument("a group of arrays names at least one")
            out.append((dict(u), tuple(shape_of(str(next(iter(u.values())))))))
        else:
            out.append((str(u), tuple(shape_of(str(u)))))
    return out


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
    """The step box origins keep so that every scaled part lands on whole coordinates: 1/s
    for each scale s < 1 (which must be 1/integer), the least common multiple of them."""
    align = 1
    for name, factor in (scales or {}).items():
        if factor <= 0:
            raise InvalidArgument(f"scales[{name!r}] must be positive, got {factor}")
        if factor < 1:
            inverse = round(1 / factor)
            if abs(inverse * factor - 1) > 1e-9:
                raise InvalidArgument(f"scales[{name!r}] = {factor}: a scale below 1 must be 1/n for a whole n")
            align = math.lcm(align, inverse)
    if any(k % align for k in sample_shape):
        raise InvalidArgument(f"sample_shape {sample_shape} must be a multiple of {align} for scales {dict(scales or {})}")
    return align


class _Sampler:
    #: how the ranks' equal shares are cut ("drop": the rest left out; "repeat": the shortest
    #: ranks repeat the first; "padding": GridBoxes' own, a Padding sample)
    _fill = "drop"

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
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise InvalidArgument(f"seed must be a non-negative integer, got {seed!r}")
        self.seed = int(seed)
        self.rank, self.world_size = partition(rank, world_size)
        self.epoch = 0
        self.consumed: list[tuple[int, int]] = []  # positions of this epoch read before (elastic resume)
        local = local_world_size
        if local is None:  # torchrun's, when it fits this partition (a sampler of fewer ranks: one node)
            local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
            if local < 1 or self.world_size % local:
                local = self.world_size
        if not isinstance(local, int) or local < 1 or self.world_size % local:
            raise InvalidArgument(f"local_world_size must divide world_size ({self.world_size}), got {local!r}")
        self.local_world_size = local  # ranks per node (see RandomBoxes' locality, share_windows)
        self.window = check_window(window)
        self.share_windows = bool(share_windows)
        self._cells = CellIndex(chunks_of)  # reads the arrays' chunk shapes on first use

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration draws (its order and boxes come from (seed, epoch))."""
        if not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise InvalidArgument(f"epoch must be a non-negative integer, got {epoch!r}")
        if int(epoch) != self.epoch:
            self.consumed = []  # an elastic resume applies to its own epoch only
        self.epoch = int(epoch)

    def _rng(self) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.epoch])

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed, "epoch": self.epoch, "rank": self.rank, "world_size": self.world_size,
            "local_world_size": self.local_world_size, "consumed": [list(r) for r in self.consumed],
            "window": self.window, "share_windows": self.share_windows,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Seed, epoch and the positions of the epoch read before the last partition, from a
        saved state (this rank's, the same number of ranks; for another number see
        :meth:`resume`)."""
        self._check_seed(state)
        self.set_epoch(int(state["epoch"]))
        self.consumed = [tuple(r) for r in state.get("consumed", [])]

    def _check_seed(self, state: Mapping[str, Any]) -> None:
        if int(state["seed"]) != self.seed:
            raise InvalidArgument(f"the state was saved with seed {state['seed']}, this sampler has seed {self.seed}")
        window = state.get("window")
        if window != self.window:
            raise InvalidArgument(
                f"the state was saved with window={window}, this sampler has window={self.window}: "
                "the epoch's order differs, so the saved position would name other samples"
            )

    def resume(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Elastic resume: go on with the epoch that every rank of an earlier run (of any
        number of ranks) was in, over the samples none of them had read. ``states``: the
        ``pipe.state_dict()`` of every earlier rank (one each; gather them at save or at
        load). The epoch's remaining samples are then shared by this run's ranks as a fresh
        epoch would be; push this sampler to a pipeline with no ``load_state_dict``."""
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
        before = [tuple(r) for r in sources[0].get("consumed", [])]
        items = self.epoch_samples()
        old_local = int(sources[0].get("local_world_size", old_world))
        pool = _pool(self._order(items, old_world, old_local), before)
        seen = set(_expand(before))
        for st, x in zip(states, sources):
            seen.update(p for p, _ in self._share_of(pool, int(x["rank"]), old_world, old_local)[: int(st["offset"])])
        self.consumed = _ranges(sorted(seen))

    def epoch_samples(self) -> list:
        """Every rank's samples of this epoch, in order (the global list)."""
        raise NotImplementedError

    def _share(self, pool: list[int], rank: int, world: int) -> list[tuple[int, bool]]:
        """Rank ``rank``'s part of the positions ``pool``: (position, is padding) each;
        entries ``rank, rank + world, ...`` of the equal shares (see :func:`_equal_shares`)."""
        pool, per_rank = _equal_shares(pool, world, self._fill)
        return [(p, False) for p in pool[rank::world][:per_rank]]

    def _order(self, items: list, world: int, local: int) -> list[int]:
        """The global list's positions in the order they are shared out (the list's own,
        unless the sampler reorders it for locality or by chunk windows)."""
        if self.window is not None:
            return self._windows(items)[0]
        return list(range(len(items)))

    def _windows(self, items: list) -> tuple[list[int], list[int], Cells]:
        """The windowed order of ``items`` (see :mod:`damacy.windows`), the windows' starts
        in it, and the items' cells. Shuffled from (seed, epoch) by a stream of its own, so the
        samples drawn are the same with or without a window."""
        cells = self._cells.cells(items)
        rng = np.random.default_rng([self.seed, self.epoch, 2])
        order, starts = window_order(cells, self.window, rng)
        return order, starts, cells

    def _share_of(self, pool: list[int], rank: int, world: int, local: int) -> list[tuple[int, bool]]:
        """Rank ``rank``'s part of ``pool``: with a window, contiguous runs of the windowed order
        (so each rank reads whole windows; with ``share_windows`` the ``local`` ranks of a node
        take turns within their node's run, for one damacyd to decode once for all of them);
        else the sampler's own share."""
        if self.window is None or self._fill == "padding":
            return self._share(pool, rank, world)
        pool, per_rank = _equal_shares(pool, world, self._fill)
        share = local if self.share_windows else 1
        node, turn = divmod(rank, share)
        run = pool[node * per_rank * share : (node + 1) * per_rank * share]
        return [(p, False) for p in run[turn::share][:per_rank]]

    def shuffle_quality(self, batch_size: int) -> dict[str, float]:
        """How this epoch's order mixes the data, for choosing ``window``: ``batch_diversity``,
        the mean number of distinct chunk cells in a batch of ``batch_size`` consecutive
        samples of the global order over a uniform permutation's (1.0: as mixed as a full
        shuffle), with the number of windows and their mean samples and decoded bytes."""
        items = self.epoch_samples()
        if self.window is not None:
            order, starts, cells = self._windows(items)
        else:
            cells = self._cells.cells(items)
            order, starts = self._order(items, self.world_size, self.local_world_size), [0]
        of = [cells.of[p] for p in order]
        per_window = np.diff(starts + [len(order)])
        window_bytes = [self._cells.window_bytes(cells, set(of[a:b])) for a, b in zip(starts, starts[1:] + [len(order)])]
        return {
            "batch_diversity": batch_diversity(of, batch_size),
            "windows": float(len(starts)),
            "samples_per_window": float(per_window.mean()) if len(per_window) else 0.0,
            "window_bytes": float(np.mean(window_bytes)) if window_bytes else 0.0,
        }

    def rank_samples(self) -> list:
        items = self.epoch_samples()
        out = []
        order = self._order(items, self.world_size, self.local_world_size)
        for position, padding in self._share_of(_pool(order, self.consumed), self.rank, self.world_size, self.local_world_size):
            s = items[position]
            out.append(_padding(s) if padding else s)
        return out

    def __iter__(self) -> Iterator:
        return iter(self.rank_samples())

    def __len__(self) -> int:
        return len(self.rank_samples())


def _equal_shares(pool: list[int], world: int, fill: str) -> tuple[list[int], int]:
    """``pool`` made into ``world`` equal shares, and their length: "drop" leaves the last
    ``len % world`` out; "repeat" extends it with its first positions (cyclically: a short
    pool after a resume), so the shortest ranks repeat them."""
    n = len(pool)
    per_rank = n // world if fill == "drop" else -(-n // world)
    if fill == "repeat" and pool:
        need = per_rank * world - n
        pool = pool + (pool * -(-need // n))[:need]
    return pool, per_rank


def _pool(order: list[int], consumed: Sequence[tuple[int, int]]) -> list[int]:
    """The positions of an epoch, in ``order``, not in the ``consumed`` ranges."""
    if not consumed:
        return order
    seen = set(_expand(consumed))
    return [p for p in order if p not in seen]


def _padding(s: Any) -> Any:
    """``s`` again, marked as padding (every part of a MultiSample)."""
    if isinstance(s, Sample):
        return Padding(s.uri, s.selection, level=s.level, flip=s.flip, transpose=s.transpose, normalize=s.normalize)
    from damacy.multi import MultiSample

    return MultiSample({name: _padding(part) for name, part in s.parts.items()})


def _expand(ranges: Sequence[tuple[int, int]]) -> Iterator[int]:
    for a, b in ranges:
        yield from range(a, b)


def _ranges(positions: list[int]) -> list[tuple[int, int]]:
    """Sorted positions as [start, stop) ranges (a prefix is one range: the state stays small)."""
    out: list[tuple[int, int]] = []
    for p in positions:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def _foreground(foreground: Any, arrays: list[tuple[Any, tuple[int, ...]]]) -> list[tuple[np.ndarray | None, np.ndarray]] | None:
    """Per array (the foreground elements' coordinates, the mask's shape), or None."""
    if foreground is None:
        return None
    if isinstance(foreground, Mapping):
        keys = {str(where) for where, _ in arrays if not isinstance(where, dict)}
        unknown = set(map(str, foreground)) - keys
        if unknown:
            raise InvalidArgument(f"foreground names {sorted(unknown)}, which are not among the arrays")
        by_uri = {str(k): v for k, v in foreground.items()}
        masks = [None if isinstance(where, dict) else by_uri.get(str(where)) for where, _ in arrays]
    else:
        masks = list(foreground)
        if len(masks) != len(arrays):
            raise InvalidArgument(f"foreground lists {len(masks)} masks for {len(arrays)} arrays")
    out: list[tuple[np.ndarray | None, np.ndarray]] = []
    for (where, shape), mask in zip(arrays, masks):
        name = str(next(iter(where.values())) if isinstance(where, dict) else where)
        if mask is None:
            out.append((None, np.zeros(0)))
            continue
        if isinstance(mask, (str, os.PathLike)):
            from damacy_server.read import read

            mask = read(os.fspath(mask))
        mask = np.asarray(mask)
        if mask.ndim != len(shape):
            raise InvalidArgument(f"the foreground mask has {mask.ndim} axes, the array {len(shape)}", uri=name)
        cells = np.argwhere(mask != 0)
        if not len(cells):
            raise InvalidArgument("the foreground mask has no foreground", uri=name)
        out.append((cells, np.array(mask.shape, dtype=np.float64)))
    return out if any(cells is not None for cells, _ in out) else None


class RandomBoxes(_Sampler):
    """``samples_per_epoch`` boxes of ``sample_shape`` per epoch: an array drawn (by
    ``weights``, default equal), then an origin uniform over the positions where the box
    fits (an axis shorter than the box: origin 0, the rest padded by the pipeline).

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
        window: int | None = None,
        share_windows: bool = False,
        shape_of: Callable[[str], Sequence[int]] | None = None,
        chunks_of: ChunksOf | None = None,
    ) -> None:
        super().__init__(
            seed, rank, world_size, window=window, share_windows=share_windows, local_world_size=local_world_size, chunks_of=chunks_of
        )
        self.scales = scales
        self.align = _alignment(scales, tuple(int(n) for n in sample_shape))
        self.locality = bool(locality)
        if self.locality and self.window is not None:
            raise InvalidArgument("locality and window order the epoch two ways: take window with share_windows=True for a node's ranks")
        if level is not None and shape_of is None and not isinstance(arrays, Mapping):
            from damacy_server.read import open_image

            def shape_of(uri: str) -> tuple[int, ...]:
                return open_image(uri).levels[level].shape

        self.arrays = _shapes(arrays, shape_of)
        if not self.arrays:
            raise InvalidArgument("RandomBoxes needs at least one array")
        self.offsets = _offsets(arrays, self.align)
        if self.offsets is not None and foreground is not None:
            raise InvalidArgument("foreground masks are per whole array: give arrays, not regions, with foreground")
        self.normalize = _check_normalize(normalize, self.arrays)
        self.sample_shape = tuple(int(n) for n in sample_shape)
        for uri, shape in self.arrays:
            if len(shape) != len(self.sample_shape):
                raise InvalidArgument(f"sample_shape {self.sample_shape} has {len(self.sample_shape)} axes, the array has {len(shape)}", uri=str(uri))
        if not isinstance(samples_per_epoch, int) or samples_per_epoch < self.world_size:
            raise InvalidArgument(f"samples_per_epoch must be an integer of at least world_size ({self.world_size}), got {samples_per_epoch!r}")
        self.samples_per_epoch = samples_per_epoch
        if weights is None and self.offsets is not None:  # regions: boxes uniform over their elements
            sizes = np.array([math.prod(shape) for _, shape in self.arrays], dtype=np.float64)
            self.p = sizes / sizes.sum()
        elif weights is None:
            self.p = None
        else:
            w = np.asarray(weights, dtype=np.float64)
            if w.shape != (len(self.arrays),) or not np.all(np.isfinite(w)) or (w < 0).any() or w.sum() <= 0:
                raise InvalidArgument(f"weights must be {len(self.arrays)} non-negative numbers, not all 0")
            self.p = w / w.sum()
        self.level = level
        ndim = len(self.sample_shape)
        self.flips = tuple(sorted({int(a) for a in flips}))
        if any(not 0 <= a < ndim for a in self.flips):
            raise InvalidArgument(f"flips {tuple(flips)} must be axes of the {ndim}-d samples")
        self.transposes = [tuple(int(a) for a in t) for t in transposes]
        if any(sorted(t) != list(range(ndim)) for t in self.transposes):
            raise InvalidArgument(f"transposes must be orders of the {ndim} axes, got {list(transposes)}")
        if self.offsets is not None:  # a box must fit in every region, in every axis order drawn
            extents = [tuple(self.sample_shape[i] for i in np.argsort(t)) for t in self.transposes] or [self.sample_shape]
            for uri, shape in self.arrays:
                for e in extents:
                    if any(k > n for k, n in zip(e, shape)):
                        raise InvalidArgument(
                            f"a box of {e} does not fit in the region of {shape} (it would read another region's data): "
                            "split into larger blocks (block=) or draw smaller boxes", uri=str(uri)
                        )
        self.foreground = _foreground(foreground, self.arrays)
        if not isinstance(foreground_fraction, (int, float)) or not 0.0 <= foreground_fraction <= 1.0:
            raise InvalidArgument(f"foreground_fraction must be a probability (0 to 1), got {foreground_fraction!r}")
        self.foreground_fraction = float(foreground_fraction)

    def epoch_samples(self) -> list[Sample]:
        rng = self._rng()
        n = self.samples_per_epoch
        which = rng.choice(len(self.arrays), size=n, p=self.p)
        orders = rng.integers(0, len(self.transposes), size=n) if self.transposes else None
        flipped = rng.random((n, len(self.flips))) < 0.5 if self.flips else None
        out_shape = np.array(self.sample_shape, dtype=np.int64)
        # per sample the box's extents in the array's axis order (its transposed shape is the sample's)
        sizes = np.tile(out_shape, (n, 1))
        if orders is not None:
            inverse = np.array([np.argsort(t) for t in self.transposes], dtype=np.int64)
            sizes = out_shape[inverse[orders]]
        shapes = np.array([shape for _, shape in self.arrays], dtype=np.int64)
        origins = rng.integers(0, np.maximum(0, shapes[which] - sizes) // self.align + 1) * self.align
        if self.offsets is not None:
            origins = origins + self.offsets[which]
        if self.foreground is not None:  # drawn only when masks are given: other seeds' boxes stay as they were
            self._centre_on_foreground(rng, which, origins, sizes, shapes)
        out = []
        for k, (a, o, size) in enumerate(zip(which.tolist(), origins, sizes)):
            flip = tuple(ax for ax, f in zip(self.flips, flipped[k]) if f) if flipped is not None else ()
            order = self.transposes[orders[k]] if orders is not None else None
            out.append(_sample(self.arrays[a][0], tuple(zip(o.tolist(), (o + size).tolist())), self.scales, self.normalize, level=self.level, flip=flip, transpose=order))
        return out

    def _centre_on_foreground(self, rng: np.random.Generator, which: np.ndarray, origins: np.ndarray, sizes: np.ndarray, shapes: np.ndarray) -> None:
        """Move the boxes chosen by ``foreground_fraction`` to centre on foreground (in place)."""
        chosen = rng.random(len(which)) < self.foreground_fraction
        for a, (cells, mask_shape) in enumerate(self.foreground):
            if cells is None:
                continue
            ks = np.flatnonzero(chosen & (which == a))
            if not len(ks):
                continue
            shape = shapes[a]
            cell = cells[rng.integers(0, len(cells), size=len(ks))]  # a foreground element each
            extent = shape / mask_shape  # of the array per mask element
            point = np.floor((cell + rng.random((len(ks), len(shape)))) * extent).astype(np.int64)
            size = sizes[ks]
            top = np.maximum(0, shape - size) // self.align
            origins[ks] = np.clip((point - size // 2) // self.align, 0, top) * self.align


    def _order(self, items: list, world: int, local: int) -> list[int]:
        if not self.locality or local <= 1:
            return super()._order(items, world, local)
        rng = np.random.default_rng([self.seed, self.epoch, 1])
        size = self.sample_shape

        def cell(k: int) -> tuple:
            s = items[k] if isinstance(items[k], Sample) else next(iter(items[k].parts.values()))
            return (s.uri, tuple(sl.start // n for sl, n in zip(s.selection, size)))

        tiebreak = rng.permutation(len(items))
        ordered = sorted(range(len(items)), key=lambda k: (cell(k), tiebreak[k]))
        groups = [ordered[i : i + local] for i in range(0, len(ordered), local)]
        return [p for g in rng.permutation(len(groups)).tolist() for p in groups[g]]

    def __len__(self) -> int:
        return (self.samples_per_epoch - sum(b - a for a, b in self.consumed)) // self.world_size


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

    def epoch_samples(self) -> list:
        order = self._rng().permutation(len(self.samples))
        return [self.samples[i] for i in order.tolist()]

    def __len__(self) -> int:
        n, w = len(self.samples) - sum(b - a for a, b in self.consumed), self.world_size
        return n // w if self.drop_last else -(-n // w)


class GridBoxes(_Sampler):
    """Windows of ``sample_shape`` every ``step`` (default: the shape, no overlap) along each
    axis of each array, covering every element: with ``edge="shift"`` (default) the last
    window of an axis is moved back to end at the array's end (it overlaps its neighbour);
    with ``edge="pad"`` it starts on the step and reaches past the end (padded by the
    pipeline). Windows come array by array in C order; rank ``r`` takes the ``r``-th
    contiguous block; ranks with one window fewer end with a :class:`Padding` sample.
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
        self.scales = scales
        self.align = _alignment(scales, tuple(int(n) for n in sample_shape))
        self.arrays = _shapes(arrays, shape_of)
        self.offsets = _offsets(arrays, self.align)
        self.normalize = _check_normalize(normalize, self.arrays)
        self.sample_shape = tuple(int(n) for n in sample_shape)
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
        self.level = level
        for uri, shape in self.arrays:
            if len(shape) != len(self.sample_shape):
                raise InvalidArgument(f"sample_shape {self.sample_shape} has {len(self.sample_shape)} axes, the array has {len(shape)}", uri=str(uri))
            if self.offsets is not None and (edge == "pad" or any(n < k for n, k in zip(shape, self.sample_shape))):
                raise InvalidArgument(
                    f"windows of {self.sample_shape} over a region of {shape} with edge={edge!r} would read past the region "
                    "(another region's data): regions take edge='shift' and windows that fit", uri=str(uri)
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

    def epoch_samples(self) -> list[Sample]:
        out = []
        for a, (uri, shape) in enumerate(self.arrays):
            axes = [self._starts(n, k, s) for n, k, s in zip(shape, self.sample_shape, self.step)]
            if self.offsets is not None:  # a region's windows, where the region is
                axes = [[o + start for start in starts] for o, starts in zip(self.offsets[a].tolist(), axes)]
            for origin in np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, len(shape)).tolist():
                out.append(_sample(uri, tuple((o, o + k) for o, k in zip(origin, self.sample_shape)), self.scales, self.normalize, level=self.level))
        return out

    _fill = "padding"

    def _windows(self, items: list) -> tuple[list[int], list[int], Cells]:
        """Sequential: the cells in the arrays' C order, each cell's windows in theirs."""
        cells = self._cells.cells(items)
        order, starts = window_order(cells, self.window, None, keys=self._cells.cell_keys())
        return order, starts, cells

    def _share(self, pool: list[int], rank: int, world: int) -> list[tuple[int, bool]]:
        n = len(pool)
        start = rank * (n // world) + min(rank, n % world)
        mine = [(p, False) for p in pool[start : start + n // world + (1 if rank < n % world else 0)]]
        if len(mine) < -(-n // world) and pool:
            mine.append((mine[-1][0] if mine else pool[-1], True))
        return mine
