"""What a plan is made of: per array one copy table (the copies from read units into the
samples of a batch, in the one form executors consume), per table the units to read as
arrays (where their bytes are, their rows of the table, their names) with a view per unit
made only where one is handled alone, and per table the units the chunk cache holds (their
decoded arrays, and the head of the table that copies them)."""

from __future__ import annotations

import functools
import threading

import numpy as np

from damacy_server.zarr.metadata import ArrayMetadata


class CopyTable:
    """The copies from the read units of one array into the samples of a batch, as one int64
    array (what the native CPU path and a GPU assembly kernel consume as it is).

    Row layout (``2 + 3 * ndim`` columns): the unit's position in the plan's unit order, the
    sample, then per axis the source start (in the unit), the destination start (in the
    sample) and the extent. A negative start ``-(k + 1)``, on either side, stands for the
    index list ``pool[k : k + extent]`` (index queries: the unit's elements an index list
    selects, and where they go in the caller's order). Rows are
    grouped by unit, in unit order. ``spans[p]`` is where unit ``p``'s bytes are: offset in
    its object and length (-1: the whole object).
    """

    __slots__ = ("ndim", "rows", "pool", "spans")

    def __init__(self, ndim: int, rows: np.ndarray, pool: np.ndarray, spans: np.ndarray) -> None:
        self.ndim = ndim
        self.rows = rows
        self.pool = pool
        self.spans = spans



class UnitBlock:
    """The units of one copy table that are to be read (its positions ``first`` on, in plan
    order: by object, then offset), as arrays: no object per unit. Reads
    (:class:`~damacy_server.plan.reads.ReadGroup`) name their units by index in a block; a
    :class:`UnitJob` view of one is made only where a unit is handled alone (an error, the
    numpy path, a unit shared with another batch).

    ``objects[owners[i]]`` is unit i's object; ``offsets``/``nbytes`` where its bytes are
    (nbytes -1: the whole object); ``bounds[i]`` to ``bounds[i + 1]`` its rows of the table;
    ``names[i]`` its name in the chunk cache and among the units in flight (:func:`unit_keys`);
    ``shared[i]`` its registration while a run executes it (``inflight.Shared``, or None)."""

    __slots__ = ("meta", "table", "first", "coords", "objects", "owners", "offsets", "nbytes", "bounds", "names", "shared", "_jobs", "_lists")

    def __init__(
        self, meta: ArrayMetadata, table: CopyTable, first: int, coords: np.ndarray, objects: list[str], owners: np.ndarray,
        offsets: np.ndarray, nbytes: np.ndarray, bounds: np.ndarray, names: list,
    ) -> None:
        self.meta = meta
        self.table = table
        self.first = first
        self.coords = coords  # int64 (n, ndim)
        self.objects = objects
        self.owners = owners  # int64 (n,)
        self.offsets = offsets  # int64 (n,)
        self.nbytes = nbytes  # int64 (n,)
        self.bounds = bounds  # int64 (n + 1,): rows of the table
        self.names = names
        self.shared: list = [None] * len(names)
        self._jobs: list[UnitJob | None] | None = None
        self._lists: tuple | None = None  # the arrays as lists, for the views

    def __len__(self) -> int:
        return len(self.names)

    @property
    def decoded_nbytes(self) -> int:
        """What each of its units decodes to."""
        return self.meta.layout.leaf.spec.nbytes

    def key(self, i: int) -> str:
        return self.objects[int(self.owners[i])]

    def job(self, i: int) -> UnitJob:
        """The view of unit ``i`` (one per unit: the same object each time)."""
        jobs = self._jobs
        if jobs is None:
            jobs = self._jobs = [None] * len(self.names)
        u = jobs[i]
        if u is None:
            if self._lists is None:
                self._lists = (self.coords.tolist(), self.owners.tolist(), self.offsets.tolist(), self.nbytes.tolist(), self.bounds.tolist())
            u = jobs[i] = UnitJob(self, i)
        return u

    def jobs(self, picks) -> list[UnitJob]:
        return [self.job(i) for i in picks]

    def __repr__(self) -> str:
        return f"UnitBlock({self.meta.uri!r}, units={len(self)}, first={self.first})"


class UnitJob:
    """One read unit to decode, and where its pieces go (its rows of a :class:`CopyTable`): a
    view of unit ``i`` of a :class:`UnitBlock`."""

    __slots__ = ("block", "i", "meta", "unit", "key", "offset", "nbytes", "table", "pos", "lo", "hi", "name")

    def __init__(self, block: UnitBlock, i: int) -> None:
        coords, owners, offsets, nbytes, bounds = block._lists
        self.block = block
        self.i = i
        self.meta = block.meta
        self.unit = tuple(coords[i])
        self.key = block.objects[owners[i]]
        self.offset = offsets[i]  # within the object (-1: the whole object)
        self.nbytes = nbytes[i]  # encoded size (-1: the whole object, size unknown)
        self.table = block.table
        self.pos = block.first + i
        self.lo = bounds[i]
        self.hi = bounds[i + 1]
        self.name = block.names[i]  # in the chunk cache and among the units in flight (unit_keys)

    @property
    def shared(self):
        """While executed: the executor's registration (inflight.Shared), or None."""
        return self.block.shared[self.i]

    @shared.setter
    def shared(self, value) -> None:
        self.block.shared[self.i] = value

    @property
    def rows(self) -> np.ndarray:
        """This unit's rows of its copy table (see :class:`CopyTable`)."""
        return self.table.rows[self.lo : self.hi]

    @property
    def samples(self) -> list[int]:
        """The sample of each copy (a sample may appear more than once)."""
        return self.table.rows[self.lo : self.hi, 1].tolist()

    @property
    def decoded_nbytes(self) -> int:
        return self.block.decoded_nbytes

    def __repr__(self) -> str:
        return f"UnitJob({self.key!r}, unit={self.unit}, offset={self.offset}, nbytes={self.nbytes}, copies={self.hi - self.lo})"


#: bits of a unit key that number the units of one array (its read-unit grid, C order);
#: the bits above them name the array version (see :func:`unit_keys`)
UNIT_BITS = 40
_KEY_LIMIT = 1 << 63  # keys below it are numpy int64s, made for a whole batch at once
_tokens: dict[tuple[str, int], int] = {}
_tokens_lock = threading.Lock()


def _array_token(meta: ArrayMetadata) -> int:
    """The number naming ``meta``'s array at its version (root and generation): the same for
    every ArrayMetadata read of that version, another for a re-created array's."""
    name = (meta.root, meta.generation)
    token = _tokens.get(name)
    if token is None:
        with _tokens_lock:
            token = _tokens.setdefault(name, len(_tokens) + 1)
    return token


@functools.lru_cache(maxsize=1024)
def _grid_strides(grid: tuple[int, ...]) -> tuple[np.ndarray, int]:
    """The C-order strides of a read-unit grid, and how many units it has; worked out once
    per grid (the array is not to be written)."""
    strides = np.ones(len(grid), dtype=np.int64)
    n = 1
    for axis in range(len(grid) - 1, -1, -1):
        strides[axis] = n
        n *= max(int(grid[axis]), 1)
    strides.flags.writeable = False
    return strides, n


def unit_keys(meta: ArrayMetadata, units: np.ndarray) -> np.ndarray | list[tuple[int, int]]:
    """The names of read units ``units`` (n, ndim grid coordinates) of ``meta`` in the chunk
    cache and among the units in flight: one int each, ``token << UNIT_BITS | unit index``,
    the token naming the array and the version its metadata was read at (a re-created
    array's units are others), as an int64 array made by numpy for a whole batch (the chunk
    cache looks it up as it is: no Python object per unit; :func:`unit_names` lists them where
    Python holds them). An array of more than 2**UNIT_BITS units, or one named in a process
    past 2**(63 - UNIT_BITS) array versions, gets a list of (token, unit index) tuples
    instead, made per unit (never equal to an int)."""
    strides, n = _grid_strides(meta.layout.grid)
    base = _array_token(meta) << UNIT_BITS
    units = np.asarray(units, dtype=np.int64).reshape(len(units), len(strides))
    if n <= 1 << UNIT_BITS and base + (1 << UNIT_BITS) <= _KEY_LIMIT:
        return units @ strides + base if len(strides) else np.full(len(units), base, dtype=np.int64)
    token, st = _array_token(meta), strides.tolist()
    return [(token, sum(c * k for c, k in zip(row, st))) for row in units.tolist()]


def unit_names(keys: np.ndarray | list, picks: np.ndarray | None = None) -> list:
    """Names from :func:`unit_keys` (those at ``picks``; None: all) as a list of Python
    objects, as dicts (the units in flight) and the per-unit jobs hold them."""
    if isinstance(keys, np.ndarray):
        return (keys if picks is None else keys[picks]).tolist()
    return keys if picks is None else list(map(keys.__getitem__, picks.tolist()))


def unit_key(meta: ArrayMetadata, unit: tuple[int, ...]) -> int | tuple[int, int]:
    """One unit's name (see :func:`unit_keys`)."""
    return unit_names(unit_keys(meta, np.asarray([unit], dtype=np.int64).reshape(1, meta.ndim)))[0]


class CachedUnits:
    """The units of one copy table found in the chunk cache, with their decoded arrays: the
    table's first ``len(arrays)`` units (positions 0, 1, ...), so their copies are its first
    ``bounds[-1]`` rows, unit ``p``'s rows ``bounds[p]`` to ``bounds[p + 1]``. They are
    copied in one go: no job per unit (a thin sample cuts tens of units, a batch hundreds).
    ``sources``: each array's address as the cache keeps it (0: none; None: the cache keeps
    none), so that native code copies from them with no lookup of each array's buffer."""

    __slots__ = ("meta", "table", "arrays", "bounds", "coords", "sources")

    def __init__(
        self, meta: ArrayMetadata, table: CopyTable, arrays: list[np.ndarray], bounds: np.ndarray, coords: np.ndarray,
        sources: np.ndarray | None = None,
    ) -> None:
        self.meta = meta
        self.table = table
        self.arrays = arrays
        self.bounds = bounds  # int64 (len(arrays) + 1,)
        self.coords = coords  # int64 (len(arrays), ndim): each unit's coordinates
        self.sources = sources  # int64 (len(arrays),) or None

    @property
    def rows(self) -> np.ndarray:
        """The copies of these units (the head of their table)."""
        return self.table.rows[: int(self.bounds[-1])]

    def unit_rows(self, p: int) -> np.ndarray:
        return self.table.rows[int(self.bounds[p]) : int(self.bounds[p + 1])]

    def unit(self, p: int) -> tuple[int, ...]:
        return tuple(self.coords[p].tolist())

    @property
    def samples(self) -> list[int]:
        """The sample of each copy (a sample may appear more than once)."""
        return self.rows[:, 1].tolist()

    def __len__(self) -> int:
        return len(self.arrays)

    def __repr__(self) -> str:
        return f"CachedUnits({self.meta.uri!r}, units={len(self.arrays)}, copies={int(self.bounds[-1])})"
