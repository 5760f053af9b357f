"""The CPU executor: runs a batch plan — read, decode, assemble — into a batch slot.

Reads run on the reader's I/O threads, decodes and copies on ``decode_workers`` threads;
positional reads, the codec libraries (zstandard, C-Blosc, zlib), numpy's copy-with-cast and
the native decode-and-assemble path all release the GIL, so the stages overlap across cores.
Memory for chunk data in flight is reserved before each read and returned as its units are
assembled, so slots plus chunk data never exceed ``max_memory_bytes``. Whatever goes wrong
in a task — a corrupt chunk or an unexpected exception — fails the samples concerned and
nothing else: every read reports back, every reservation is returned.

Where the native path applies (:mod:`damacy_server.cpu.tasks`), a decode task is one C
call; groups whose bytes are in the page cache are read by that call too, on a decode thread
(see ``_read_direct``). The rest goes through numpy. A unit another batch is decoding is not
read again: the batch waits for it (:mod:`damacy_server.cpu.inflight`). Reads from object stores
go to a :class:`~damacy_server.store.fetch.Fetcher` (many requests in flight on one event
loop) and land in the same code as a file's.

(Over 400 lines: one job, a plan executed on the CPU; its task bodies (read, fetch, direct
read, decode, cached copy, shared unit) share its pools, budget and statistics and hand work
to each other.)
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from damacy_protocol.enums import Stage
from damacy_protocol.errors import BudgetExceeded, DamacyError
from damacy_protocol.limits import CpuLimits
from damacy_server import native
from damacy_server.cache import LRUCache
from damacy_server.cpu import optable
from damacy_server.cpu.inflight import InFlight
from damacy_server.cpu.run import GroupState, Run, samples_of
from damacy_server.cpu.tasks import NativeTasks
from damacy_server.decode.chunks import cast_fill, check_length, decode_unit
from damacy_server.engine.budget import BudgetedExecutor, MemoryBudget, Reservation, StageStats
from damacy_server.plan.planner import BatchPlan
from damacy_server.plan.reads import Caps, ReadGroup, shrink
from damacy_server.plan.transforms import sample_view
from damacy_server.plan.units import CachedUnits, UnitJob
from damacy_server.plan.versions import known
from damacy_server.store import is_remote
from damacy_server.store.disk import DiskTier
from damacy_server.store.fetch import Fetcher
from damacy_server.store.file import FileReader
from damacy_server.workers import WorkerPool, close_with

log = logging.getLogger("damacy")

#: decoded bytes per decode task (small chunks are decoded several per task)
TASK_BYTES = 1 << 20
#: direct reads that may miss the page cache in a row before reads go to the I/O threads
#: only, for the next DIRECT_BACKOFF reads
DIRECT_MISSES = 32
DIRECT_BACKOFF = 1024
#: units decoding to fewer bytes are not shared between batches in flight: their decode costs
#: less than the bookkeeping (and the whole decode a shared unit needs); bench small-chunks
#: (32 KiB units) lost a fifth of its rate to sharing, default (256 KiB) gains
SHARE_MIN_BYTES = 128 << 10


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


class CpuExecutor(BudgetedExecutor):
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
        self.chunk_cache: LRUCache[np.ndarray] | None = (
            LRUCache(max_bytes=self.limits.chunk_cache_bytes, sizeof=lambda a: a.nbytes, admit_by_frequency=True)
            if self.limits.chunk_cache_bytes
            else None
        )
        # units scheduled and not yet decoded: a batch that needs one waits for it
        self.inflight = InFlight()
        self._deferred = threading.local()  # per thread: copies for waiting runs held to the end of a settling
        self.native = (
            NativeTasks(self.chunk_cache, self.inflight, self._copies_deferred) if native.available() and self.limits.native else None
        )
        # decode threads read page-cached groups themselves (see _read_direct)
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
        bundle: list[ReadGroup] = []  # direct reads of one object, made in one task
        bundled = bundled_units = 0  # the bytes their units decode to, and how many units

        def send() -> None:
            nonlocal bundle, bundled, bundled_units
            self._decode.submit(self._read_direct, run, bundle, key=key, priority=run.order)
            bundle, bundled, bundled_units = [], 0, 0

        for group in groups:
            need = group.reserve_nbytes
            if bundle and self.budget.try_reserve(need):
                status = Reservation.TAKEN
            else:
                if bundle:  # before waiting for memory: the reads held here free theirs once made
                    send()
                status = self.budget.reserve(need, stop)
            if status is Reservation.TAKEN:
                if is_remote(group.key):
                    self._fetch(run, group, need)
                    continue
                if self._direct_ok(run, group):
                    decoded = group.decoded_nbytes
                    n = len(group.units)
                    if bundle and not _joins(bundle, group, bundled + decoded, bundled_units + n, self.limits.chunks_per_input_buffer):
                        send()
                    bundle.append(group)
                    bundled += decoded
                    bundled_units += n
                    continue
                self._io_slots.acquire()
                self._io.submit(self._read, run, group, need, key=key, priority=run.order)
                continue
            self._abandon(group.units)  # a batch waiting for one of them reads it itself
            if status is Reservation.TOO_BIG:
                run.fail(samples_of(group.units), self._too_big(group.key, need))
            run.group_done()
        if bundle:
            send()
        run.group_done()

    # -- units in flight ------------------------------------------------------------
    def _share(self, run: Run, groups: list[ReadGroup]) -> tuple[list[ReadGroup], list[tuple[UnitJob, np.ndarray]]]:
        """The run's reads without the units another batch is decoding (the run waits for
        those) or decoded into the chunk cache since the plan looked (returned, with their
        arrays, to be copied from there); the units left are registered as this run's to
        decode and settle."""
        out = []
        late: list[tuple[UnitJob, np.ndarray]] = []
        cache = self.chunk_cache
        for g in groups:
            units = g.units
            if cache is not None:
                found = cache.peek_many([u.name for u in units])
                if any(a is not None for a in found):
                    late.extend((u, a) for u, a in zip(units, found) if a is not None)
                    units = [u for u, a in zip(units, found) if a is None]
            # a read's units decode to one size (one array's): shared all, or none
            if units and units[0].decoded_nbytes >= SHARE_MIN_BYTES:
                with run.lock:
                    run.pending += len(units)  # the waiters', for those that become one
                claimed = self.inflight.claim_or_join_many([u.name for u in units], lambda i, units=units: self._waiter(run, units[i]))
                mine = []
                for u, shared in zip(units, claimed):
                    if shared is not None:
                        u.shared = shared
                        mine.append(u)
                with run.lock:
                    run.pending -= len(mine)
            else:
                mine = units
            kept = g if len(mine) == len(g.units) else shrink(g, mine)
            if kept is not None:
                out.append(kept)
        return out, late

    def _waiter(self, run: Run, u: UnitJob):
        """What a run does with a unit another batch decoded (see :mod:`damacy_server.cpu.inflight`)."""

        def take(array: np.ndarray | None, error: DamacyError | None, missing: bool) -> None:
            if array is not None:
                # a cache entry waits to be copied with the others that arrive meanwhile, by one
                # task, the memory budget counting it meanwhile (the cache may evict it before
                # that task runs, leaving it held by this run alone); copied now, in the owner's
                # task, is an array the cache did not take (its memory goes with that task) or
                # one the budget has no room for
                if not self._cached(u, array) or not self.budget.try_reserve(array.nbytes):
                    held = getattr(self._deferred, "copies", None)
                    if held is not None:  # the owner is settling several: copied with the others
                        held.setdefault(id(run), (run, []))[1].append((u, array))
                    else:
                        self._copy_items(run, [(u, array)], reserved=0)
                    return
                with run.lock:
                    run.arrived.append((u, array))
                    if run.copying:
                        return
                    run.copying = True
                self._decode.submit(self._copy_arrived, run, key=run.key, priority=run.order)
                return
            if error is None and not missing:  # abandoned: read it alone
                self._decode.submit(self._read_alone, run, u, key=run.key, priority=run.order)
                return
            try:
                if error is not None:
                    run.fail(samples_of((u,)), error)
                elif missing and not (run.cancelled() or self._closed):
                    optable.fill_rows(u.rows, u.table.ndim, u.table.pool, run.views, u.meta.fill_value, run.plan.norms)
            except Exception as e:
                run.crash([u], e)
            finally:
                run.group_done()

        return take

    @contextmanager
    def _copies_deferred(self) -> Iterator[None]:
        """Within it, a unit this thread settles that a waiting run copies at once (see
        ``_waiter``) is copied at its end, with the others settled meanwhile for that run: one
        task's units go to a waiting run in one native call per plan table, not one each. The
        owner's task holds the arrays (and their memory) until then."""
        local = self._deferred
        if getattr(local, "copies", None) is not None:  # (nested: the outer one copies)
            yield
            return
        local.copies = held = {}
        try:
            yield
        finally:
            local.copies = None
            for run, items in held.values():
                self._copy_items(run, items, reserved=0)

    def _cached(self, u: UnitJob, array: np.ndarray) -> bool:
        """Is ``array`` the chunk cache's entry for ``u`` (memory the cache accounts for)? A
        unit's array that is not stays within the memory budget only while its owner's task
        holds it, so it is copied then, not queued."""
        return self.chunk_cache is not None and self.chunk_cache.peek(u.name) is array

    def _copy_arrived(self, run: Run) -> None:
        """Copy the units other batches decoded for ``run`` into the chunk cache since the last
        such task: one task (and one native call per plan table) for as many as arrived while
        it was queued, not one per unit (a thin sample waits for tens of units, a windowed
        epoch for thousands)."""
        with run.lock:
            items, run.arrived = run.arrived, []
            run.copying = False
        self._copy_items(run, items, reserved=sum(a.nbytes for _, a in items))

    def _copy_items(self, run: Run, items: list[tuple[UnitJob, np.ndarray]], reserved: int) -> None:
        """Copy units waited for that arrived in the chunk cache and report each done, the
        budget's ``reserved`` bytes (what counted them while they waited) returned first."""
        self.stats.add(Stage.SHARED, 0.0, count=len(items), bytes_out=sum(a.nbytes for _, a in items))
        self._copy_cached(run, [], items, reports=len(items), release=reserved)

    def _abandon(self, units: Sequence[UnitJob]) -> None:
        """Units this run registered and did not settle: their waiters read them alone."""
        for u in units:
            if u.shared is not None:
                self.inflight.settle(u.shared)

    def _too_big(self, key: str, need: int) -> BudgetExceeded:
        return BudgetExceeded(
            f"reading {key} needs {need} bytes in flight, the memory budget leaves "
            f"{self.budget.capacity} beside the batch slots; raise max_memory_bytes",
            path=key,
        )

    def _read_alone(self, run: Run, u: UnitJob) -> None:
        """Read, decode and copy one unit another batch abandoned (numpy path). A unit more
        than the budget can ever hold fails as it failed its owner; otherwise it is rare (the
        owner's batch was cancelled first) and a decode thread must not wait for memory, so
        without room now it reads outside the memory budget: one unit."""
        need = ReadGroup(u.key, u.offset, u.nbytes, [u]).reserve_nbytes  # as its owner counted it
        held = 0
        try:
            if run.cancelled() or self._closed:
                return
            if need > self.budget.capacity:
                run.fail(samples_of((u,)), self._too_big(u.key, need).with_context(uri=u.meta.uri))
                return
            held = need if self.budget.try_reserve(need) else 0
            store = u.meta.store if is_remote(u.key) else self.reader
            if u.nbytes < 0:
                data = store.read(u.key)
            else:
                data = store.read_range(u.key, u.offset, u.nbytes)
            with np.errstate(invalid="ignore", over="ignore"):
                if data is None:
                    optable.fill_rows(u.rows, u.table.ndim, u.table.pool, run.views, u.meta.fill_value, run.plan.norms)
                    return
                check_length(u.meta, data, u.nbytes, u.unit, u.key)
                self._apply(run, u, decode_unit(u.meta, memoryview(data), u.unit, u.key))
        except DamacyError as e:
            run.fail(samples_of((u,)), e.with_context(uri=u.meta.uri))
        except Exception as e:
            run.crash([u], e)
        finally:
            self.budget.release(held)
            run.group_done()

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

    def _over_cap(self, group: ReadGroup, nbytes: int) -> BudgetExceeded | None:
        """A whole-object read (a chunk of an unsharded array) of more stored bytes than
        ``CpuLimits.max_encoded_chunk_bytes`` admits (a shard's chunks are checked in the
        plan, where their sizes are known)."""
        cap = self.limits.max_encoded_chunk_bytes
        if nbytes <= cap:
            return None
        unit = group.units[0]
        return BudgetExceeded(
            f"a chunk is stored in {nbytes} bytes, more than CpuLimits.max_encoded_chunk_bytes={cap}",
            uri=unit.meta.uri, path=group.key, chunk=unit.unit,
        )

    def _direct_ok(self, run: Run, group: ReadGroup) -> bool:
        """Should a decode thread try to read this group itself (from the page cache)?"""
        if self._direct_skip > 0:
            self._direct_skip -= 1
            return False
        return (
            self._direct
            and run.dtype is not None
            and group.length <= native.RUN_FILE_MAX
            and self.native.kernel(run, group.units) is not None
        )

    def _read_direct(self, run: Run, groups: list[ReadGroup]) -> None:
        """Read, decode and copy reads of one object (see :func:`_joins`) in one native call
        when their bytes are in the page cache (no I/O thread, no GIL between the steps; of
        several reads only their units' bytes are read); otherwise hand them to the I/O
        threads. Each read's memory was reserved (its ``reserve_nbytes``)."""
        finished = True
        first, last = groups[0], groups[-1]
        group = first if len(groups) == 1 else ReadGroup(
            first.key, first.offset, last.offset + last.length - first.offset, [u for g in groups for u in g.units]
        )
        try:
            if run.cancelled() or self._closed:
                return
            units = group.units
            kernel = self.native.kernel(run, units)
            where = self.reader.direct(group.key)
            if kernel is None:
                finished = False
                return
            t0 = time.perf_counter()
            code, read_ns, nbytes, (encoded, decoded, assembled), over = self.native.read_file(
                kernel, run, group, where, sparse=len(groups) > 1,
                refuse=(lambda n: self._over_cap(group, n)) if group.length < 0 else None,
            )
            if code != 0:
                if code == -1:  # not in the page cache (a missing chunk or a large file is no sign of that)
                    self._direct_missed()
                finished = False
                return
            self._direct_misses = 0
            if over is not None:  # (neither kept nor handed to waiting batches)
                run.fail(samples_of(units), over)
            seconds = time.perf_counter() - t0
            read_s = read_ns / 1e9
            self.stats.add(Stage.READ, read_s, bytes_out=nbytes)
            self.stats.add(Stage.DIRECT, read_s, bytes_out=nbytes)
            self.stats.add(Stage.NATIVE, seconds - read_s, count=len(units), bytes_in=encoded, bytes_out=assembled)
            self.stats.add_units(len(units), seconds - read_s, encoded, decoded, 0.0, assembled)
        except Exception as e:
            run.crash(group.units, e)
        finally:
            if finished:
                self._abandon(group.units)
                self.budget.release(sum(g.reserve_nbytes for g in groups))
                run.group_done(len(groups))
            else:  # the ordinary path reads them, reports errors fully and settles the groups
                for g in groups:
                    self._io_slots.acquire()
                    self._io.submit(self._read, run, g, g.reserve_nbytes, key=run.key, priority=run.order)

    def _direct_missed(self) -> None:
        """After many direct reads in a row found their data out of the page cache (or a file
        system that cannot tell), stop trying for a while."""
        self._direct_misses += 1
        if self._direct_misses >= DIRECT_MISSES:
            self._direct_misses = 0
            self._direct_skip = DIRECT_BACKOFF

    def _read(self, run: Run, group: ReadGroup, reserved: int) -> None:
        self._io_slots.release()
        if run.cancelled() or self._closed:
            self._landed(run, group, reserved, skip=True)
            return
        t0 = time.perf_counter()
        try:
            if group.length < 0:
                data = self.reader.read(group.key)
            else:
                data = self.reader.read_range(group.key, group.offset, group.length)
        except Exception as e:  # reported per sample (a DamacyError) or as a crash
            self._landed(run, group, reserved, error=e)
            return
        self.stats.add(Stage.READ, time.perf_counter() - t0, bytes_out=len(data) if data else 0)
        self._landed(run, group, reserved, data)

    def _fetch(self, run: Run, group: ReadGroup, reserved: int) -> None:
        """Read a group from an object store: from the disk tier when it holds the bytes (an
        I/O thread reads them), else the request waits its turn in the fetcher (many in
        flight, by batch order) and lands like a read of a file (and goes to the tier)."""
        if self._tiered(group):
            self._io.submit(self._from_disk, run, group, reserved, key=run.key, priority=run.order)
            return
        self._fetch_remote(run, group, reserved)

    @staticmethod
    def _disk_key(group: ReadGroup) -> str:
        """A read's name in the disk tier: its object as the store names it for caches that
        outlive the process (a branch's snapshot, a bucket's endpoint), its range, and the
        version of its array's metadata where it was asked (an array written again under the
        same name is not read from the old one's entries)."""
        meta = group.units[0].meta
        key = f"{meta.store.cache_key(group.key)}#{group.offset}+{group.length}"
        return key if meta.version is None else f"{key}@{meta.version!r}"

    def _tiered(self, group: ReadGroup) -> bool:
        """Does the disk tier take this read? Not one of an array whose metadata's versions
        could not all be asked (its entries could be taken for another content's)."""
        version = group.units[0].meta.version
        return self.disk_tier is not None and (version is None or known(version))

    def _from_disk(self, run: Run, group: ReadGroup, reserved: int) -> None:
        if run.cancelled() or self._closed:
            self._landed(run, group, reserved, skip=True)
            return
        t0 = time.perf_counter()
        try:
            data = self.disk_tier.get(self._disk_key(group))
        except Exception as e:  # a cache: a read it cannot make is a miss
            log.warning("the disk tier could not read %s: %s", group.key, e)
            data = None
        if data is None:
            try:
                self._fetch_remote(run, group, reserved)
            except Exception as e:  # reported per sample, as a failed fetch is
                self._landed(run, group, reserved, error=e)
            return
        self.stats.add(Stage.DISK, time.perf_counter() - t0, bytes_out=len(data))
        self._landed(run, group, reserved, data)

    def _to_disk(self, key: str, data: bytes) -> None:
        if not self._closed:
            self.disk_tier.put(key, data)

    def _fetch_remote(self, run: Run, group: ReadGroup, reserved: int) -> None:
        if self._fetcher is None:
            with self._fetcher_lock:
                if self._fetcher is None:
                    self._fetcher = Fetcher(max_inflight=self.limits.max_inflight_requests)
        store = group.units[0].meta.store
        t0 = [0.0]

        def request():
            if run.cancelled() or self._closed:
                self._landed(run, group, reserved, skip=True)
                return None
            t0[0] = time.perf_counter()
            return store.fetch(group.key, group.offset, group.length)

        def done(data, error) -> None:
            if error is None:
                self.stats.add(Stage.READ, time.perf_counter() - t0[0], bytes_out=len(data) if data else 0)
                if data is not None and self._tiered(group):  # written off the fetcher's loop
                    self._io.submit(self._to_disk, self._disk_key(group), data, key=run.key, priority=run.order)
            self._landed(run, group, reserved, data, error)

        self._fetcher.submit((run.order, group.offset), request, done)

    def _landed(self, run: Run, group: ReadGroup, reserved: int, data=None, error: BaseException | None = None, skip: bool = False) -> None:
        """A group's bytes arrived (``None``: the object does not exist), or its read failed
        with ``error``, or it was not read (``skip``): decode it, fill it, or report it, and
        settle the group."""
        handed_over = False
        try:
            if skip or run.cancelled() or self._closed:
                return
            if error is None and data is not None and group.length < 0:
                error = self._over_cap(group, len(data))
            if isinstance(error, DamacyError):
                err = error.with_context(uri=group.units[0].meta.uri)
                run.fail(samples_of(group.units), err)
                for u in group.units:
                    if u.shared is not None:
                        self.inflight.settle(u.shared, error=err)
                return
            if error is not None:
                raise error
            if data is None:
                # a chunk that was never written: its regions read as the fill value
                for u in group.units:
                    optable.fill_rows(u.rows, u.table.ndim, u.table.pool, run.views, u.meta.fill_value, run.plan.norms)
                    if u.shared is not None:
                        self.inflight.settle(u.shared, missing=True)
                return
            # Units are decoded in tasks of about TASK_BYTES of output, so small chunks do
            # not pay a thread handoff each; the group's memory is returned as tasks finish.
            tasks: list[list[UnitJob]] = [[]]
            size = 0
            for u in group.units:
                if size >= TASK_BYTES:
                    tasks.append([])
                    size = 0
                tasks[-1].append(u)
                size += u.decoded_nbytes
            state = GroupState(len(tasks), reserved - group.decoded_nbytes)
            view = memoryview(data)
            for units in tasks:
                self._decode.submit(self._decode_units, run, group, units, view, state, key=run.key, priority=run.order)
            handed_over = True
        except Exception as e:
            run.crash(group.units, e)
        finally:
            if not handed_over:
                self._abandon(group.units)
                self.budget.release(reserved)
                run.group_done()

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
