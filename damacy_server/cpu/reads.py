"""The CPU executor's reads: a read of a file on an I/O thread, or by a decode thread itself
in the same native call that decodes it (page-cached bytes only; after many misses in a row
the direct reads pause), an object store's through the fetcher (many requests in flight) or
the local disk tier of fetched bytes; what landed is handed to decode tasks of about
``TASK_BYTES`` each, or filled (a chunk never written), or its error given to its samples.

:class:`ReadTasks` is that part of :class:`~damacy_server.cpu.executor.CpuExecutor`: it
uses the executor's reader, pools, budget, native tasks, disk tier and decode
(``_decode_units``).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from damacy_protocol.enums import Stage
from damacy_protocol.errors import BudgetExceeded, DamacyError
from damacy_server import native
from damacy_server.cpu import optable
from damacy_server.cpu.run import GroupState, Run, samples_of
from damacy_server.plan.reads import ReadGroup
from damacy_server.plan.units import UnitJob
from damacy_server.plan.versions import known
from damacy_server.store.fetch import Fetcher

log = logging.getLogger("damacy")

#: decoded bytes per decode task (small chunks are decoded several per task)
TASK_BYTES = 1 << 20
#: direct reads that may miss the page cache in a row before reads go to the I/O threads
#: only, for the next DIRECT_BACKOFF reads
DIRECT_MISSES = 32
DIRECT_BACKOFF = 1024
#: the reads of a job a decode thread makes in one turn before it queues its turn again
#: (pipelines and daemon sessions sharing the threads take turns between them)
DIRECT_READS_PER_TURN = 4


class DirectJob:
    """A run's page-cached reads of one array, as one native job the decode threads work on
    (see :meth:`ReadTasks._read_direct`): built by the first thread to take a turn at it."""

    __slots__ = ("run", "kernel", "bundles", "lock", "native", "error")

    def __init__(self, run: Run, kernel, bundles: list[list[ReadGroup]]) -> None:
        self.run = run
        self.kernel = kernel
        self.bundles = bundles
        self.lock = threading.Lock()
        self.native = None  # the FileJob, once built
        self.error: BaseException | None = None  # why it could not be built

    def units(self) -> list[UnitJob]:
        return [u for b in self.bundles for g in b for u in g.units]


class ReadTasks:
    """The executor's part that reads (see the module's docstring)."""

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
            and self.native.kernel_of(run, group.meta) is not None
        )

    def _read_direct(self, run: Run, bundles: list[list[ReadGroup]]) -> None:
        """Hand a run's page-cached reads to the decode threads: ``bundles``, each reads of one
        object made and decoded in one go (see :func:`~damacy_server.cpu.executor._joins`),
        become a job per array (per plan table: :class:`DirectJob`), which every decode thread
        that takes one of its tasks works on, taking its reads in turn in native code. Each
        read's memory was reserved (its ``reserve_nbytes``)."""
        by_block: dict[int, list[list[ReadGroup]]] = {}
        for bundle in bundles:
            by_block.setdefault(id(bundle[0].block), []).append(bundle)
        for part in by_block.values():
            kernel = self.native.kernel_of(run, part[0][0].meta)  # (_direct_ok: not None)
            job = DirectJob(run, kernel, part)
            for _ in range(min(self._decode.workers, len(part))):
                self._decode.submit(self._direct_work, job, key=run.key, priority=run.order)

    def _direct_work(self, job: DirectJob) -> None:
        """A decode thread's turn at a job: the first builds its native job (its units' op
        table and the buffers of those it keeps, as late as possible: a unit decoded whole
        takes waiting batches until then); each takes up to DIRECT_READS_PER_TURN reads and
        queues its turn again while reads are left; the one that completes the last read
        settles the job."""
        run = job.run
        failed = False
        with job.lock:
            if job.native is None and job.error is None:
                try:
                    job.native = self._build_direct(job)
                except Exception as e:  # (its units fail, as a task's that raised)
                    job.error, failed = e, True
        if job.native is None:
            if failed:  # this thread built it: it settles it
                run.crash(job.units(), job.error)
                self._direct_finished(job, job.bundles)
            return
        last, more = job.native.handle.work(run.cancelled() or self._closed, DIRECT_READS_PER_TURN)
        if more:
            self._decode.submit(self._direct_work, job, key=run.key, priority=run.order)
        if last:
            self._direct_done(job)

    def _build_direct(self, job: DirectJob):
        wheres = [self.reader.direct(b[0].key) for b in job.bundles]  # (one array's: one store's flags and roots)
        _, flags, roots = wheres[0]
        paths = tuple(os.fsencode(path) for path, _, _ in wheres)
        return self.native.file_job(job.kernel, job.run, job.bundles, flags, roots, paths)

    def _direct_done(self, job: DirectJob) -> None:
        """Every read of a job is completed: fail, keep and hand over its units, count its
        figures, settle the reads made and skipped, and give those not made (not in the page
        cache, or refused) to the I/O threads, which read them the ordinary way."""
        run, fj = job.run, job.native
        finished: list[list[ReadGroup]] = []
        again: list[list[ReadGroup]] = []
        try:
            res = native.file_job_results(fj.handle)
            refused: dict[int, DamacyError] = {}
            n_made = units = read_ns = best_read = work_ns = nbytes = encoded = elements = 0
            for r, (bundle, code) in enumerate(zip(job.bundles, res.codes)):
                if code == 0:
                    self._direct_misses = 0
                    group = bundle[0]
                    over = self._over_cap(group, res.nread[r]) if group.length < 0 else None
                    if over is not None:  # (neither kept nor handed to waiting batches)
                        refused[r] = over
                        run.fail(samples_of(group.units), over)
                    finished.append(bundle)
                    n_made += 1
                    units += fj.bounds[r + 1] - fj.bounds[r]
                    read_ns += res.read_ns[r]
                    best_read = res.read_ns[r] if n_made == 1 else min(best_read, res.read_ns[r])
                    work_ns += res.ns[r] - res.read_ns[r]
                    nbytes += res.nread[r]
                    encoded += res.encoded[r]
                    elements += res.elements[r]
                elif code == native.NOT_RUN:
                    finished.append(bundle)
                else:
                    if code == -1:  # not in the page cache (a missing chunk or a large file is no sign of that)
                        self._direct_missed()
                    again.append(bundle)
            decoded = self.native.file_job_done(run, fj, res, refused)
            if n_made:
                read_s, work_s = read_ns / 1e9, work_ns / 1e9
                assembled = elements * run.dtype.itemsize
                self.stats.add(Stage.READ, read_s, count=n_made, bytes_out=nbytes, best=best_read / 1e9)
                self.stats.add(Stage.DIRECT, read_s, count=n_made, bytes_out=nbytes, best=best_read / 1e9)
                self.stats.add(Stage.NATIVE, work_s, count=units, bytes_in=encoded, bytes_out=assembled)
                self.stats.add_units(units, work_s, encoded, sum(decoded), 0.0, assembled)
        except Exception as e:
            done = {id(b) for b in finished}
            run.crash([u for b in job.bundles if id(b) not in done for g in b for u in g.units], e)
            finished, again = job.bundles, []
        self._direct_finished(job, finished)
        for bundle in again:  # the ordinary path reads them, reports errors fully and settles them
            for g in bundle:
                self._io_slots.acquire()
                self._io.submit(self._read, run, g, g.reserve_nbytes, key=run.key, priority=run.order)

    def _direct_finished(self, job: DirectJob, bundles: list[list[ReadGroup]]) -> None:
        """Reads of a job that are done with: their units' registrations, memory and places
        in the run."""
        groups = [g for b in bundles for g in b]
        if not groups:
            return
        try:
            self._abandon_reads(groups)
        finally:
            self.budget.release(sum(g.reserve_nbytes for g in groups))
            job.run.group_done(len(groups))

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
        meta = group.meta
        key = f"{meta.store.cache_key(group.key)}#{group.offset}+{group.length}"
        return key if meta.version is None else f"{key}@{meta.version!r}"

    def _tiered(self, group: ReadGroup) -> bool:
        """Does the disk tier take this read? Not one of an array whose metadata's versions
        could not all be asked (its entries could be taken for another content's)."""
        version = group.meta.version
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
        store = group.meta.store
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
                err = error.with_context(uri=group.meta.uri)
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
                self._abandon_reads([group])
                self.budget.release(reserved)
                run.group_done()

