"""The CPU executor: runs a batch plan — read, decode, assemble — into a batch slot.

Reads run on the reader's I/O threads, decodes and copies on ``decode_workers`` threads;
positional reads, the codec libraries (zstandard, C-Blosc, zlib) and numpy's copy-with-cast
all release the GIL, so the stages overlap across cores. Memory for chunk data in flight is
reserved before each read and returned as its units are assembled, so slots plus chunk data
never exceed ``max_memory_bytes``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from damacy_protocol.errors import BudgetExceeded, InvalidArgument, SampleError
from damacy_server.cache import LRUCache
from damacy_server.decode import cast_fill, check_length, decode_unit
from damacy_server.plan import BatchPlan, ReadGroup, UnitJob
from damacy_server.store.file import FileReader
from damacy_server.workers import WorkerPool

#: the least memory for chunk data in flight that a budget must leave beside the slots
MIN_INFLIGHT_BYTES = 16 << 20


@dataclass(frozen=True)
class CpuLimits:
    """``max_memory_bytes``: batch slots plus chunk data in flight; ``decode_workers``:
    decode threads (default: the CPUs); ``chunk_cache_bytes``: decoded chunks kept for
    reuse across batches (LRU by bytes, 0: off; not part of ``max_memory_bytes``)."""

    max_memory_bytes: int = 2 << 30
    decode_workers: int | None = None
    chunk_cache_bytes: int = 0

    def __post_init__(self) -> None:
        if self.decode_workers is None:
            object.__setattr__(self, "decode_workers", os.cpu_count() or 1)
        for name in ("max_memory_bytes", "decode_workers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidArgument(f"CpuLimits.{name} must be an integer >= 1, got {v!r}")
        v = self.chunk_cache_bytes
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise InvalidArgument(f"CpuLimits.chunk_cache_bytes must be an integer >= 0, got {v!r}")


class MemoryBudget:
    """Bytes reserved against a fixed total; ``reserve`` waits until the bytes are free."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self.peak = 0
        self._cond = threading.Condition()

    def try_reserve_now(self, nbytes: int) -> bool:
        with self._cond:
            if self.used + nbytes > self.total:
                return False
            self._take(nbytes)
            return True

    def reserve(self, nbytes: int, cancelled: Callable[[], bool]) -> bool:
        """Wait for ``nbytes``; False when cancelled first."""
        with self._cond:
            while self.used + nbytes > self.total:
                if cancelled():
                    return False
                self._cond.wait(0.05)
            self._take(nbytes)
            return True

    def _take(self, nbytes: int) -> None:
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.used -= nbytes
            self._cond.notify_all()


class StageStats:
    """Seconds, counts and bytes per stage, summed over worker threads."""

    STAGES = ("plan", "read", "decode", "assemble")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.data = {s: {"seconds": 0.0, "count": 0, "bytes_in": 0, "bytes_out": 0} for s in self.STAGES}

    def add(self, stage: str, seconds: float, count: int = 1, bytes_in: int = 0, bytes_out: int = 0) -> None:
        with self._lock:
            d = self.data[stage]
            d["seconds"] += seconds
            d["count"] += count
            d["bytes_in"] += bytes_in
            d["bytes_out"] += bytes_out

    def add_units(self, n: int, decode_s: float, encoded: int, decoded: int, assemble_s: float, assembled: int) -> None:
        """Decode and assembly of ``n`` units, under one lock."""
        with self._lock:
            d, a = self.data["decode"], self.data["assemble"]
            d["seconds"] += decode_s
            d["count"] += n
            d["bytes_in"] += encoded
            d["bytes_out"] += decoded
            a["seconds"] += assemble_s
            a["count"] += n
            a["bytes_in"] += decoded
            a["bytes_out"] += assembled

    def snapshot(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {s: dict(d) for s, d in self.data.items()}


#: decoded bytes per decode task (small chunks are decoded several per task)
TASK_BYTES = 1 << 20


class _GroupState:
    """Counts the decode tasks of one read still running."""

    __slots__ = ("remaining", "encoded_reserved", "lock")

    def __init__(self, tasks: int, encoded_reserved: int) -> None:
        self.remaining = tasks
        self.encoded_reserved = encoded_reserved
        self.lock = threading.Lock()

    def task_done(self) -> bool:
        with self.lock:
            self.remaining -= 1
            return self.remaining == 0


class _Run:
    """The state of one batch plan being executed."""

    __slots__ = ("plan", "views", "errors", "pending", "lock", "on_done", "cancelled", "key", "remaining", "finals", "release")

    def __init__(self, plan: BatchPlan, views: list, on_done, cancelled, key, finals, release) -> None:
        self.key = key
        self.plan = plan
        self.views = views
        self.errors: dict[int, SampleError] = {}
        self.pending = len(plan.groups)
        self.lock = threading.Lock()
        self.on_done = on_done
        self.cancelled = cancelled
        self.remaining = list(plan.copy_counts)  # per sample: copies not yet applied
        self.finals = finals  # sample -> its slot view, for samples assembled in sorted order
        self.release = release  # returns the memory of those temporary buffers

    def copied(self, units: Sequence[UnitJob] = (), samples: Sequence[int] = ()) -> None:
        """The copies of ``units`` (or one copy for each of ``samples``) are applied or given
        up; a sample assembled in sorted order is put in its caller's order once complete."""
        if not self.finals:
            return
        done = []
        with self.lock:
            for s in [s for u in units for s, _ in u.copies] + list(samples):
                self.remaining[s] -= 1
                if self.remaining[s] == 0 and s in self.finals and s not in self.errors:
                    done.append(s)
        for s in done:
            self.unsort(s)

    def unsort(self, s: int) -> None:
        src = self.views[s]
        perm = self.plan.perms[s]
        for j, (axis, inverse) in enumerate(perm):
            dst = self.finals[s] if j == len(perm) - 1 else np.empty_like(src)
            np.take(src, inverse, axis=axis, out=dst, mode="clip")
            src = dst

    def fail(self, samples, err: SampleError) -> None:
        with self.lock:
            for s in samples:
                if s not in self.errors:
                    self.errors[s] = _for_sample(err, self.plan.samples[s])

    def group_done(self) -> None:
        with self.lock:
            self.pending -= 1
            last = self.pending == 0
        if last:
            self.release()
            self.on_done(self.errors)


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


def _for_sample(err: SampleError, sample: Any) -> SampleError:
    e = type(err)(err.reason, uri=err.uri, path=err.path, chunk=err.chunk)
    e.__cause__ = err.__cause__
    return e.with_context(uri=getattr(sample, "uri", None), sample=sample)


class CpuExecutor:
    """Executes batch plans into host memory."""

    def __init__(self, reader: FileReader | None = None, limits: CpuLimits | None = None) -> None:
        self.reader = reader if reader is not None else FileReader()
        self.limits = limits if limits is not None else CpuLimits()
        self.budget = MemoryBudget(self.limits.max_memory_bytes)
        self.stats = StageStats()
        self._io = WorkerPool(self.reader.workers, "damacy-io")
        self._decode = WorkerPool(self.limits.decode_workers, "damacy-decode")
        self._io_slots = threading.BoundedSemaphore(self.reader.max_inflight_reads)
        self._closed = False
        self._slot_bytes = 0
        self._slot_lock = threading.Lock()
        self.chunk_cache: LRUCache[np.ndarray] | None = (
            LRUCache(max_bytes=self.limits.chunk_cache_bytes, sizeof=lambda a: a.nbytes)
            if self.limits.chunk_cache_bytes
            else None
        )

    # -- memory -------------------------------------------------------------------
    def reserve_slots(self, nbytes: int, what: str) -> None:
        """Take ``nbytes`` for output slots for good; the rest is for chunk data in flight."""
        with self._slot_lock:
            need = self._slot_bytes + nbytes + MIN_INFLIGHT_BYTES
            if need > self.budget.total or not self.budget.try_reserve_now(nbytes):
                raise BudgetExceeded(
                    f"max_memory_bytes={self.budget.total} is too small: {what} need {nbytes} bytes"
                    + (f" (beside {self._slot_bytes} held by other slots)" if self._slot_bytes else "")
                    + f" plus at least {MIN_INFLIGHT_BYTES} for chunk data in flight;"
                    f" set max_memory_bytes >= {need}"
                )
            self._slot_bytes += nbytes

    def release_slots(self, nbytes: int) -> None:
        with self._slot_lock:
            self._slot_bytes -= nbytes
        self.budget.release(nbytes)

    @property
    def inflight_capacity(self) -> int:
        """Bytes of chunk data that may be in flight at once (the budget beside the slots)."""
        return self.budget.total - self._slot_bytes

    # -- execution ----------------------------------------------------------------
    def execute(
        self,
        plan: BatchPlan,
        targets: Sequence[np.ndarray],
        on_done: Callable[[dict[int, SampleError]], None],
        cancelled: Callable[[], bool] = lambda: False,
        key: Any = None,
    ) -> None:
        """Assemble sample i of ``plan`` into ``targets[i]`` (a view of a batch slot).

        ``on_done(errors)`` is called once, from a worker thread (or this one), when every
        read of the plan has been assembled; ``errors`` maps sample index → error. Tasks are
        queued under ``key`` (one per pipeline), so pipelines sharing this executor take
        turns.
        """
        views = [None if shape is None else targets[i].reshape(shape) for i, shape in enumerate(plan.shapes)]
        # index queries with unsorted lists are assembled in sorted order (each read unit then
        # fills one block) in a temporary buffer, and put in the caller's order at the end
        finals = {}
        temp = 0
        for i, perm in enumerate(plan.perms):
            if perm and views[i] is not None:
                finals[i] = views[i]
                views[i] = np.empty_like(finals[i])
                temp += finals[i].nbytes * (2 if len(perm) > 1 else 1)
        if temp and not self.budget.reserve(temp, lambda: cancelled() or self._closed):
            on_done({})
            return
        t0 = time.perf_counter()
        for s, fill in plan.fills:
            views[s][...] = cast_fill(fill, views[s].dtype)
        if plan.fills:
            self.stats.add("assemble", time.perf_counter() - t0, count=0)
        groups, cached = self._from_cache(plan.groups)
        groups = self._fit(groups)
        run = _Run(plan, views, on_done, cancelled, key, finals, lambda: self.budget.release(temp) if temp else None)
        for s in finals:
            if plan.copy_counts[s] == 0:  # nothing to read: fill values only
                run.unsort(s)
        run.pending = len(groups) + (1 if cached else 0)
        if not run.pending:
            run.release()
            on_done(run.errors)
            return
        if cached:
            self._decode.submit(self._copy_cached, run, cached, key=key)
        inflight = self.inflight_capacity
        for group in groups:
            need = group.reserve_nbytes
            if need > inflight:
                run.fail(
                    {s for u in group.units for s, _ in u.copies},
                    SampleError(
                        f"reading {group.key} needs {need} bytes in flight, the memory budget leaves {inflight}; "
                        "raise max_memory_bytes",
                        path=group.key,
                    ),
                )
                run.copied(group.units)
                run.group_done()
                continue
            if not self.budget.reserve(need, lambda: cancelled() or self._closed):
                run.group_done()
                continue
            self._io_slots.acquire()
            self._io.submit(self._read, run, group, need, key=key)

    def _from_cache(self, groups: list[ReadGroup]) -> tuple[list[ReadGroup], list[tuple[UnitJob, np.ndarray]]]:
        """Units found in the chunk cache leave their reads (which shrink or go)."""
        if self.chunk_cache is None:
            return groups, []
        cached: list[tuple[UnitJob, np.ndarray]] = []
        out: list[ReadGroup] = []
        for g in groups:
            rest = []
            for u in g.units:
                arr = self.chunk_cache.get((u.meta.root, u.unit))
                if arr is None:
                    rest.append(u)
                else:
                    cached.append((u, arr))
            if len(rest) == len(g.units):
                out.append(g)
            elif rest:
                if g.length < 0:
                    out.append(ReadGroup(g.store, g.key, g.offset, g.length, rest))
                else:
                    start = min(u.offset for u in rest)
                    end = max(u.offset + u.nbytes for u in rest)
                    out.append(ReadGroup(g.store, g.key, start, end - start, rest))
        return out, cached

    def _copy_cached(self, run: _Run, cached: list[tuple[UnitJob, np.ndarray]]) -> None:
        t0 = time.perf_counter()
        assembled = 0
        try:
            if run.cancelled() or self._closed:
                return
            with np.errstate(invalid="ignore", over="ignore"):
                for u, arr in cached:
                    for s, op in u.copies:
                        target = run.views[s]
                        assembled += op.apply(target, arr) * target.itemsize
                    run.copied((u,))
        finally:
            self.stats.add("assemble", time.perf_counter() - t0, count=len(cached), bytes_out=assembled)
            run.group_done()

    def _fit(self, groups: list[ReadGroup]) -> list[ReadGroup]:
        """Merged reads too large for the in-flight budget are read unit by unit again."""
        inflight = self.inflight_capacity
        out = []
        for g in groups:
            if g.reserve_nbytes > inflight and len(g.units) > 1:
                out.extend(ReadGroup(g.store, g.key, u.offset, u.nbytes, [u]) for u in g.units)
            else:
                out.append(g)
        return out

    def _read(self, run: _Run, group: ReadGroup, reserved: int) -> None:
        self._io_slots.release()
        if run.cancelled() or self._closed:
            self.budget.release(reserved)
            run.group_done()
            return
        t0 = time.perf_counter()
        try:
            if group.length < 0:
                data = self.reader.read(group.key)
            else:
                data = self.reader.read_range(group.key, group.offset, group.length)
        except SampleError as e:
            self.budget.release(reserved)
            run.fail({s for u in group.units for s, _ in u.copies}, e.with_context(uri=group.units[0].meta.uri))
            run.copied(group.units)
            run.group_done()
            return
        self.stats.add("read", time.perf_counter() - t0, bytes_out=len(data) if data else 0)
        if data is None:
            # a chunk that was never written: its regions read as the fill value
            for u in group.units:
                for s, op in u.copies:
                    op.fill(run.views[s], cast_fill(u.meta.fill_value, run.views[s].dtype))
            run.copied(group.units)
            self.budget.release(reserved)
            run.group_done()
            return
        # Units are decoded in tasks of about TASK_BYTES of output, so small chunks do not
        # pay a thread handoff each; the group's memory is returned as its tasks finish.
        tasks: list[list[UnitJob]] = [[]]
        size = 0
        for u in group.units:
            if size >= TASK_BYTES:
                tasks.append([])
                size = 0
            tasks[-1].append(u)
            size += u.decoded_nbytes
        state = _GroupState(len(tasks), reserved - sum(u.decoded_nbytes for u in group.units))
        view = memoryview(data)
        for units in tasks:
            self._decode.submit(self._decode_units, run, group, units, view, state, key=run.key)

    def _decode_units(self, run: _Run, group: ReadGroup, units: list[UnitJob], view: memoryview, state: _GroupState) -> None:
        decode_s = assemble_s = 0.0
        encoded = decoded = assembled = 0
        try:
            if run.cancelled() or self._closed:
                return
            whole = group.length < 0
            with np.errstate(invalid="ignore", over="ignore"):  # casts follow numpy's rules
                for u in units:
                    t0 = time.perf_counter()
                    start = u.offset - group.offset
                    data = view if whole else view[start : start + u.nbytes]
                    try:
                        check_length(u.meta, data, u.nbytes, u.unit, u.key)
                        arr = decode_unit(u.meta, data, u.unit, u.key)
                    except SampleError as e:
                        run.fail({s for s, _ in u.copies}, e)
                        run.copied((u,))
                        continue
                    t1 = time.perf_counter()
                    if self.chunk_cache is not None:
                        self.chunk_cache.put((u.meta.root, u.unit), _frozen(arr))
                    for s, op in u.copies:
                        target = run.views[s]
                        assembled += op.apply(target, arr) * target.itemsize
                    run.copied((u,))
                    decode_s += t1 - t0
                    assemble_s += time.perf_counter() - t1
                    encoded += len(data)
                    decoded += arr.nbytes
        finally:
            self.stats.add_units(len(units), decode_s, encoded, decoded, assemble_s, assembled)
            self.budget.release(sum(u.decoded_nbytes for u in units))
            if state.task_done():
                self.budget.release(state.encoded_reserved)
                run.group_done()

    def close(self) -> None:
        self._closed = True
        self._io.close()
        self._decode.close()

