"""The CPU executor: runs a batch plan — read, decode, assemble — into a batch slot.

Reads run on the reader's I/O threads, decodes and copies on ``decode_workers`` threads;
positional reads, the codec libraries (zstandard, C-Blosc, zlib), numpy's copy-with-cast and
the native decode-and-assemble path all release the GIL, so the stages overlap across cores.
Memory for chunk data in flight is reserved before each read and returned as its units are
assembled, so slots plus chunk data never exceed ``max_memory_bytes``. Whatever goes wrong
in a task — a corrupt chunk or an unexpected exception — fails the samples concerned and
nothing else: every read reports back, every reservation is returned.

Where the native path applies (:mod:`damacy_server.cpu.tasks`), a decode task is one C
call; groups whose bytes are in the page cache are read by that call too, on a decode thread.
The rest goes through numpy. The executor's parts share its pools, budget and figures and
hand work to each other: this module dispatches a plan's reads, decodes and copies; its reads
(files, the page cache, object stores through a :class:`~damacy_server.store.fetch.Fetcher`,
the disk tier) are :mod:`damacy_server.cpu.reads`; a unit another batch is decoding is not
read again, the batch waits for it (:mod:`damacy_server.cpu.sharing`, over the registry of
:mod:`damacy_server.cpu.inflight`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from damacy_protocol.enums import Stage
from damacy_protocol.errors import BudgetExceeded, DamacyError
from damacy_protocol.limits import CpuLimits
from damacy_server import native
from damacy_server.cache import INDEX_RULES, AnyCache, IndexedCache, LRUCache
from damacy_server.cpu import optable
from damacy_server.cpu.inflight import InFlight
from damacy_server.cpu.reads import TASK_BYTES, ReadTasks
from damacy_server.cpu.run import GroupState, Run, samples_of
from damacy_server.cpu.sharing import SharedUnits
from damacy_server.cpu.tasks import NativeTasks
from damacy_server.decode.chunks import cast_fill, check_length, decode_unit
from damacy_server.engine.budget import BudgetedExecutor, MemoryBudget, Reservation, StageStats
from damacy_server.plan.planner import BatchPlan
from damacy_server.plan.reads import Caps, ReadGroup
from damacy_server.plan.transforms import sample_view
from damacy_server.plan.units import CachedUnits, UnitJob
from damacy_server.store import is_remote
from damacy_server.store.disk import DiskTier
from damacy_server.store.fetch import Fetcher
from damacy_server.store.file import FileReader
from damacy_server.workers import WorkerPool, close_with

log = logging.getLogger("damacy")

def _joins(bundle: list[ReadGroup], group: ReadGroup, decoded: int, units: int, most_units: int) -> bool:
    """May ``group`` be read and decoded in the same task as the reads in ``bundle``, all of
    them decoding to ``decoded`` bytes and holding ``units`` units? Reads of one object, each a byte range, in order, that
    together decode to at most TASK_BYTES, span at most RUN_FILE_MAX and hold at most
    ``most_units`` units (a read buffer's: ``CpuLimits.chunks_per_input_buffer``): the units of
    a thin sample lie a unit or more apart in their shard (chunks in Morton or C order), a read
    each, and one task per read would cost more in bookkeeping than the decode of a small unit."""
    first, last = bundle[0], bundle[-1]
    return (
        group.key == first.key
        and first.length >= 0
        and group.length >= 0
        and group.offset >= last.offset + last.length
        and group.offset + group.length - first.offset <= native.RUN_FILE_MAX
        and decoded <= TASK_BYTES
        and units <= most_units
    )


def _frozen(arr: np.ndarray) -> np.ndarray:
    """A read-only array holding only its own bytes (a view into a larger read is copied)."""
    base = arr.base
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, (bytes, bytearray)) and len(base) == arr.nbytes or arr.flags.owndata:
        out = arr.view()
    else:
        out = arr.copy()
    out.flags.writeable = False
    return out


def chunk_cache(max_bytes: int, *, native_index: bool = True) -> AnyCache | None:
    """The chunk cache of decoded units: ``max_bytes`` of them (0: none), admitted adaptively;
    kept by the native index where the module is built (and ``native_index``), else by
    :class:`LRUCache` (the same rules)."""
    if not max_bytes:
        return None
    index = native.cache_index(None, max_bytes, True, INDEX_RULES) if native_index else None
    if index is None:
        return LRUCache(max_bytes=max_bytes, sizeof=_nbytes, admit_by_frequency=True)
    return IndexedCache(index, sizeof=_nbytes)


def _nbytes(a: np.ndarray) -> int:
    return a.nbytes


class CpuExecutor(SharedUnits, ReadTasks, BudgetedExecutor):
    """Reads, decodes and assembles batches in host memory: chunk data through ``reader`` (a
    :class:`~damacy_server.store.file.FileReader`: its I/O threads), decodes and copies on
    ``limits.decode_workers`` threads, everything within ``limits`` (a
    :class:`~damacy_protocol.limits.CpuLimits`). Each distinct chunk a batch needs is decoded
    once for all its samples (and kept across batches when ``limits.chunk_cache_bytes`` is
    set). A composed pipeline claims it as its own while open (see
    :class:`~damacy_server.engine.budget.BudgetedExecutor`)."""

    def __init__(self, *, reader: FileReader, limits: CpuLimits) -> None:
        if not isinstance(reader, FileReader):
            raise TypeError(f"reader must be a FileReader, got {type(reader).__name__}")
        if not isinstance(limits, CpuLimits):
            raise TypeError(f"limits must be a CpuLimits, got {type(limits).__name__}")
        self.reader = reader
        self.limits = limits
        self._start()

    def _start(self) -> None:
        self.budget = MemoryBudget(self.limits.max_memory_bytes, self.limits.min_inflight_bytes)
        self.stats = StageStats()
        self._io = WorkerPool(self.reader.workers, "damacy-io")
        self._decode = WorkerPool(self.limits.decode_workers, "damacy-decode")
        self._io_slots = threading.BoundedSemaphore(self.reader.max_inflight_reads)
        self._closed = False
        self._runs = itertools.count()
        self.chunk_cache = chunk_cache(self.limits.chunk_cache_bytes, native_index=self.limits.native)
        # units scheduled and not yet decoded: a batch that needs one waits for it
        self.inflight = InFlight()
        self._deferred = threading.local()  # per thread: copies for waiting runs held to the end of a settling
        self.native = (
            NativeTasks(self.chunk_cache, self.inflight, self._copies_deferred) if native.available() and self.limits.native else None
        )
        # decode threads read page-cached groups themselves (see ReadTasks._read_direct)
        self._direct = self.native is not None and getattr(self.reader, "direct", None) is not None
        self._direct_misses = 0
        self._direct_skip = 0
        # reads from object stores: started with the first remote read
        self._fetcher: Fetcher | None = None
        self._fetcher_lock = threading.Lock()
        self.disk_tier = DiskTier(self.limits.chunk_cache_dir, self.limits.chunk_cache_dir_bytes) if self.limits.chunk_cache_dir else None
        # closed by its owner, or once nothing refers to it (a pipeline closes only the
        # executor it made; one given inline goes with the pipeline that held it)
        close_with(self, self._io, self._decode)

    def worker_steps(self) -> int:
        """Tasks its worker threads ran."""
        return self._io.steps + self._decode.steps

    @property
    def caps(self) -> Caps:
        """What a plan for it may hold (see :meth:`Planner.plan`): chunks of at most
        ``max_encoded_chunk_bytes`` stored and ``max_decoded_chunk_bytes`` decoded, and reads
        of at most ``chunks_per_input_buffer`` chunks (a read buffer's)."""
        lim = self.limits
        return Caps(lim.max_encoded_chunk_bytes, lim.max_decoded_chunk_bytes, None, lim.chunks_per_input_buffer)

    def queue_depths(self) -> dict[str, int]:
        """Tasks waiting for a thread: reads and decodes."""
        return {"io": self._io.queued(), "decode": self._decode.queued()}

    # -- execution ----------------------------------------------------------------
    def execute(
        self,
        plan: BatchPlan,
        targets: Sequence[np.ndarray],
        on_done: Callable[[dict[int, DamacyError]], None],
        cancelled: Callable[[], bool] = lambda: False,
        key: Any = None,
    ) -> None:
        """Assemble sample i of ``plan`` into ``targets[i]`` (a view of a batch slot). The plan
        was made with this executor's ``inflight_capacity`` and ``chunk_cache`` (see
        :meth:`Planner.plan`): its reads fit the budget, and the units found in the
        cache come with their arrays; a read that still does not fit fails its samples. Units
        another batch is decoding are not read again: the run waits for them.

        ``on_done(errors)`` is called once, from a worker thread (or this one), when every
        read of the plan has been assembled; ``errors`` maps sample index → error. Tasks are
        queued under ``key`` (one per pipeline), so pipelines sharing this executor take
        turns.
        """
        views = [None if shape is None else sample_view(targets[i], shape, plan.transforms[i]) for i, shape in enumerate(plan.shapes)]
        run = Run(plan, views, on_done, cancelled, key, next(self._runs))
        t0 = time.perf_counter()
        for s, fill in plan.fills:
            views[s][...] = cast_fill(fill, views[s].dtype, plan.norm(s))
        if plan.fills:
            self.stats.add(Stage.ASSEMBLE, time.perf_counter() - t0, count=0)
        run.pending = 2  # this call, until all is queued, and the copies from the chunk cache
        groups, late = self._share(run, plan.groups)
        with run.lock:
            run.pending += len(groups)
        if plan.cached or late:
            self._decode.submit(self._copy_cached, run, plan.cached, late, key=key, priority=run.order)
        else:
            run.group_done()  # no copies from the cache
        stop = lambda: cancelled() or self._closed  # noqa: E731
        bundle: list[ReadGroup] = []  # direct reads of one object, made in one go
        bundled = bundled_units = 0  # the bytes their units decode to, and how many units
        direct: list[list[ReadGroup]] = []  # the bundles not yet handed to the decode threads

        def send() -> None:
            nonlocal bundle, bundled, bundled_units
            direct.append(bundle)
            bundle, bundled, bundled_units = [], 0, 0

        def flush() -> None:  # the bundles so far, as one job per array
            nonlocal direct
            if bundle:
                send()
            if direct:
                self._read_direct(run, direct)
                direct = []

        needs = [g.reserve_nbytes for g in groups]
        # every read's memory at once when there is room for all now (else read by read)
        prepaid = bool(groups) and self.budget.try_reserve(sum(needs))
        for group, need in zip(groups, needs):
            if prepaid or ((bundle or direct) and self.budget.try_reserve(need)):
                status = Reservation.TAKEN
            else:
                flush()  # before waiting for memory: the reads held here free theirs once made
                status = self.budget.reserve(need, stop)
            if status is Reservation.TAKEN:
                if is_remote(group.key):
                    self._fetch(run, group, need)
                    continue
                if self._direct_ok(run, group):
                    decoded = group.decoded_nbytes
                    n = len(group)
                    if bundle and not _joins(bundle, group, bundled + decoded, bundled_units + n, self.limits.chunks_per_input_buffer):
                        send()
                    bundle.append(group)
                    bundled += decoded
                    bundled_units += n
                    continue
                self._io_slots.acquire()
                self._io.submit(self._read, run, group, need, key=key, priority=run.order)
                continue
            self._abandon_reads([group])  # a batch waiting for one of them reads it itself
            if status is Reservation.TOO_BIG:
                run.fail(samples_of(group.units), self._too_big(group.key, need))
            run.group_done()
        flush()
        run.group_done()

    def _too_big(self, key: str, need: int) -> BudgetExceeded:
        return BudgetExceeded(
            f"reading {key} needs {need} bytes in flight, the memory budget leaves "
            f"{self.budget.capacity} beside the batch slots; raise max_memory_bytes",
            path=key,
        )

    def _apply(self, run: Run, u: UnitJob, arr: np.ndarray) -> int:
        """Make every copy of unit ``u`` from its decoded array; returns the bytes written."""
        return optable.copy_rows(u.rows, u.table.ndim, u.table.pool, run.views, arr, run.plan.norms)

    def _copy_cached(
        self, run: Run, blocks: Sequence[CachedUnits], late: list[tuple[UnitJob, np.ndarray]], reports: int = 1,
        release: int = 0,
    ) -> None:
        """Copy units found in the chunk cache: the plan's (``blocks``, each a plan table's, in
        one native call where the native path applies) and those the cache took after the plan
        looked or another batch decoded (``late``, grouped by table the same way); the rest
        with numpy. Returns ``release`` bytes to the budget, then reports ``reports`` of the
        run's pending items done."""
        t0 = time.perf_counter()
        assembled = count = 0
        by_table: dict[int, list[tuple[UnitJob, np.ndarray]]] = {}
        for item in sorted(late, key=lambda item: item[0].pos):  # in table order: views of it
            by_table.setdefault(id(item[0].table), []).append(item)
        parts: list = [*blocks, *by_table.values()]
        done = 0  # parts whose copies are made
        try:
            if run.cancelled() or self._closed:
                return
            with np.errstate(invalid="ignore", over="ignore"):
                for part in parts:
                    if isinstance(part, CachedUnits):
                        written = self.native.copy_cached(run, part) if self.native is not None else None
                        if written is None:
                            table = part.table
                            written = sum(
                                optable.copy_rows(part.unit_rows(p), table.ndim, table.pool, run.views, a, run.plan.norms)
                                for p, a in enumerate(part.arrays)
                            )
                    else:
                        written = self.native.copy_decoded(run, part) if self.native is not None else None
                        if written is None:
                            written = sum(self._apply(run, u, arr) for u, arr in part)
                    assembled += written
                    count += len(part)
                    done += 1
        except Exception as e:
            run.crash([x for part in parts[done:] for x in ([part] if isinstance(part, CachedUnits) else [u for u, _ in part])], e)
        finally:
            self.stats.add(Stage.ASSEMBLE, time.perf_counter() - t0, count=count, bytes_out=assembled)
            self.budget.release(release)
            run.group_done(reports)

    def _decode_units(self, run: Run, group: ReadGroup, units: list[UnitJob], view: memoryview, state: GroupState) -> None:
        decode_s = assemble_s = 0.0
        encoded = decoded = assembled = 0
        done: list[UnitJob] = []  # units whose copies are made or given up
        try:
            if run.cancelled() or self._closed:
                return
            kernel = self.native.kernel(run, units) if self.native is not None else None
            if kernel is not None:
                t0 = time.perf_counter()
                encoded, decoded, assembled = self.native.decode(kernel, run, group, units, view)
                done = units
                decode_s = time.perf_counter() - t0  # decode and copies, in one call
                self.stats.add(Stage.NATIVE, decode_s, count=len(units), bytes_in=encoded, bytes_out=assembled)
                return
            whole = group.length < 0
            with np.errstate(invalid="ignore", over="ignore"), self._copies_deferred():  # casts follow numpy's rules
                for u in units:
                    t0 = time.perf_counter()
                    start = u.offset - group.offset
                    data = view if whole else view[start : start + u.nbytes]
                    try:
                        check_length(u.meta, data, u.nbytes, u.unit, u.key)
                        arr = decode_unit(u.meta, data, u.unit, u.key)
                    except DamacyError as e:
                        run.fail(samples_of((u,)), e)
                        if u.shared is not None:
                            self.inflight.settle(u.shared, error=e)
                        done.append(u)
                        continue
                    t1 = time.perf_counter()
                    if self.chunk_cache is not None or u.shared is not None:
                        arr = _frozen(arr)
                    if self.chunk_cache is not None:
                        self.chunk_cache.put(u.name, arr)
                    if u.shared is not None:
                        self.inflight.settle(u.shared, array=arr)
                    assembled += self._apply(run, u, arr)
                    done.append(u)
                    decode_s += t1 - t0
                    assemble_s += time.perf_counter() - t1
                    encoded += len(data)
                    decoded += arr.nbytes
        except Exception as e:
            rest = [u for u in units if u not in done]
            run.crash(rest, e)
        finally:
            self._abandon(units)
            self.stats.add_units(len(units), decode_s, encoded, decoded, assemble_s, assembled)
            self.budget.release(sum(u.decoded_nbytes for u in units))
            if state.task_done():
                self.budget.release(state.encoded_reserved)
                run.group_done()

    def close(self) -> None:
        """Stop: every task queued still runs, sees the close and settles what it holds
        (its reservation, the units it registered as in flight), so the budget is whole
        again and no waiter is left behind."""
        self._closed = True
        if self._fetcher is not None:  # first: what it cancels lands in the pools, drained below
            self._fetcher.close()
        self._io.close(drain=True)
        self._decode.close(drain=True)
