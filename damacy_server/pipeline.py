"""The embedded pipeline: samples in, ready batches out, while the caller trains.

A feeder thread pulls samples lazily from what was pushed (never more than
``lookahead_samples`` ahead of what was popped), plans each batch and hands the plan to
the executor, which assembles it into a free slot in the background. ``pop`` returns the
batches in push order. A bad sample is handled per ``on_error`` and never stops the stream.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from damacy_runtime.api import PipelineAPI
from damacy_runtime.batch import Batch, BatchInfo, Slot
from damacy_protocol.config import Config
from damacy_protocol.dtypes import numpy_dtype
from damacy_protocol.errors import DamacyError, InvalidArgument, PipelineDrained, SampleError
from damacy_server.cpu import CpuExecutor, CpuLimits
from damacy_server.decode import cast_fill
from damacy_server.plan import BatchSpec, ChunkPlanner, PlanLimits
from damacy_server.resolve import MetadataCache, ZarrMetadata
from damacy_server.store.file import FileMetadataReader, FileReader

log = logging.getLogger("damacy")


@dataclass(frozen=True)
class QueueLimits:
    """``lookahead_samples``: samples in flight ahead of ``pop`` (default: two batches);
    ``prepared_batches``: batch slots."""

    lookahead_samples: int | None = None
    prepared_batches: int = 2


@dataclass(eq=False)
class _Delivery:
    batch_id: int
    slot: Slot | None
    samples: list[Any]
    errors: list[tuple[int, SampleError]]
    error: BaseException | None = None  # raised by the pop that takes this delivery
    dtype: np.dtype | None = None
    skipped: list[tuple[Any, SampleError]] = dataclasses.field(default_factory=list)


class _Pending:
    """A batch being assembled (possibly in several rounds when samples are skipped)."""

    def __init__(self, batch_id: int, slot: Slot, samples: list[Any]) -> None:
        self.batch_id = batch_id
        self.slot = slot
        self.samples = samples  # by slot position
        self.metas: list[Any] = [None] * len(samples)
        self.errors: dict[int, SampleError] = {}  # slot position -> error
        self.holes: list[int] = []  # positions whose sample failed, to refill (on_error="skip")
        self.skipped: list[tuple[Any, SampleError]] = []  # (sample, error) dropped by on_error="skip"
        self.dtype: np.dtype | None = None  # the batch's numpy dtype


class Pipeline(PipelineAPI):
    """Streams samples into batches in host memory.

    Config style::

        with damacy.Pipeline(damacy.Config(samples_per_batch=8, sample_shape=(64, 256, 256))) as p:
            p.push(samples)
            for batch in p.batches(100):
                with batch:
                    x = torch.from_dlpack(batch)

    or composed from parts (``planner``, ``executor``, ``output``, ``queues``). A planner and
    an executor may be shared by several pipelines (the daemon's sessions do): each pipeline
    reserves its own slots in the executor's memory budget and its tasks take turns with the
    others'. ``slot_factory(index, nbytes)`` supplies the slots' memory (shared memory in
    the daemon); by default they are ordinary host memory. Slots from a factory stay
    reserved in the executor's budget after :meth:`close` until their owner, who knows when
    their memory is really gone, calls ``executor.release_slots(pipeline.slot_bytes)``.
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        planner: ChunkPlanner | None = None,
        executor: CpuExecutor | None = None,
        output: BatchSpec | None = None,
        queues: QueueLimits | None = None,
        on_error: str = "raise",
        out_of_bounds: str = "pad",
        drop_last: bool = False,
        pop_timeout_s: float | None = 600.0,
        slot_factory: Callable[[int, int], np.ndarray] | None = None,
        on_skip: Callable[[list[tuple[Any, SampleError]]], None] | None = None,
    ) -> None:
        if config is None:
            if output is None:
                raise InvalidArgument("Pipeline needs a Config, or output=BatchSpec(...) with planner and executor")
            queues = queues or QueueLimits()
            executor = executor or CpuExecutor()
            config = Config(
                samples_per_batch=output.samples,
                sample_shape=output.shape,
                dtype=output.dtype,
                max_memory_bytes=executor.limits.max_memory_bytes,
                lookahead_samples=queues.lookahead_samples,
                prepared_batches=queues.prepared_batches,
                io_workers=executor.reader.workers,
                decode_workers=executor.limits.decode_workers,
                on_error=on_error,
                out_of_bounds=out_of_bounds,
                drop_last=drop_last,
                pop_timeout_s=pop_timeout_s,
            )
        elif not isinstance(config, Config):
            raise InvalidArgument(f"Pipeline takes a damacy.Config, got {type(config).__name__}")
        if config.device is not None:
            raise InvalidArgument(f"Config.device={config.device}: GPU output is not available in this version of damacy")
        self.config = config
        self._owns = executor is None or planner is None
        if planner is None:
            planner = ChunkPlanner(
                ZarrMetadata(
                    FileMetadataReader(),
                    MetadataCache(config.array_cache_entries, config.shard_index_cache_entries),
                ),
                PlanLimits(),
            )
        if executor is None:
            executor = CpuExecutor(
                FileReader(workers=config.io_workers),
                CpuLimits(
                    max_memory_bytes=config.max_memory_bytes,
                    decode_workers=config.decode_workers,
                    chunk_cache_bytes=config.chunk_cache_bytes,
                ),
            )
        self.planner = planner
        self.executor = executor

        self._dtype = numpy_dtype(config.dtype, "float32") if config.dtype != "native" else None
        self._batch_shape = (config.samples_per_batch, *config.sample_shape)
        self._slot_bytes = 0
        self._slots: list[Slot] = []
        self._free: deque[Slot] = deque()
        self._cond = threading.Condition()
        self._sources: deque[Iterator[Any]] = deque()
        self._pushed = False
        self._pulling = False
        self._next_plan = 0  # next batch id to plan
        self._next_pop = 0  # next batch id to deliver
        self._ready: dict[int, _Delivery] = {}
        self._outstanding = 0  # samples pulled and not yet popped
        self._pulled = 0
        self._delivered_batches = 0
        self._delivered_samples = 0
        self._sample_errors = 0
        self._closed = False
        self._failure: BaseException | None = None  # what stopped the feeder, if anything did
        self._feeder: threading.Thread | None = None
        self._patches: deque[_Pending] = deque()
        self._dedup = 0
        self._merged = 0
        self._slot_factory = slot_factory
        self._external_slots = slot_factory is not None
        self._on_skip = on_skip
        self._allocate_slots()
        self._switch = _SwitchInterval.lower(config.switch_interval_s)

    # -- slots --------------------------------------------------------------------
    def _allocate_slots(self) -> None:
        cfg = self.config
        if self._dtype is None:
            # "native": each batch takes the dtype of its first sample's array; slots are raw
            # bytes sized for the widest supported type (8 bytes per element)
            itemsize = 8
        else:
            itemsize = self._dtype.itemsize
        per_slot = int(np.prod(self._batch_shape, dtype=np.int64)) * itemsize
        total = per_slot * cfg.prepared_batches
        self.executor.reserve_slots(
            total, f"{cfg.prepared_batches} batch slots of {cfg.samples_per_batch} x {cfg.sample_shape} {cfg.dtype}"
        )
        try:
            for i in range(cfg.prepared_batches):
                if self._slot_factory is not None:
                    raw = self._slot_factory(i, per_slot)
                    raw.fill(0)  # map every page now (shared memory is not backed by huge pages)
                else:
                    # zeroed pages on first touch (numpy asks for transparent huge pages, so
                    # touching costs little and happens in the workers, in parallel)
                    raw = np.zeros(per_slot, dtype=np.uint8)
                arr = raw.view(self._dtype).reshape(self._batch_shape) if self._dtype is not None else raw
                slot = Slot(arr, self._slot_freed, index=i)
                self._slots.append(slot)
                self._free.append(slot)
        except BaseException:
            self.executor.release_slots(total)
            raise
        self._slot_bytes = total

    def _slot_freed(self, slot: Slot) -> None:
        with self._cond:
            if self._closed:
                return  # a batch released after close: its slot is not used again
            if slot not in self._free:  # a slot is free once, however its users let go
                self._free.append(slot)
            self._cond.notify_all()

    def _slot_view(self, slot: Slot, dtype: np.dtype) -> np.ndarray:
        if self._dtype is not None:
            return slot.array
        n = int(np.prod(self._batch_shape, dtype=np.int64)) * dtype.itemsize
        return slot.array[:n].view(dtype).reshape(self._batch_shape)

    # -- input --------------------------------------------------------------------
    def push(self, samples: Iterable[Any]) -> None:
        """Queue samples (``Sample``/``IndexQuery``; any iterable, infinite generators included).
        They are pulled lazily, as room frees up, in the order pushed."""
        if isinstance(samples, (str, bytes)) or not hasattr(samples, "__iter__"):
            raise InvalidArgument(f"push takes an iterable of samples, got {type(samples).__name__}")
        with self._cond:
            if self._closed:
                raise InvalidArgument("push on a closed pipeline")
            self._sources.append(iter(samples))
            self._pushed = True
            if self._feeder is None:
                self._feeder = threading.Thread(target=self._feed, name="damacy-feeder", daemon=True)
                self._feeder.start()
            self._cond.notify_all()

    def _pull(self, n: int) -> tuple[list[Any], BaseException | None]:
        """Up to ``n`` samples from the sources (runs the caller's generators, in this thread)."""
        out: list[Any] = []
        while len(out) < n and not self._closed:
            with self._cond:
                if not self._sources:
                    break
                source = self._sources[0]
            try:
                out.append(next(source))
                self._pulled += 1
            except StopIteration:
                with self._cond:
                    if self._sources and self._sources[0] is source:
                        self._sources.popleft()
            except BaseException as e:  # the caller's generator failed: deliver it at pop
                with self._cond:
                    if self._sources and self._sources[0] is source:
                        self._sources.popleft()
                return out, e
        return out, None

    # -- the feeder thread --------------------------------------------------------
    def _feed(self) -> None:
        try:
            while True:
                patch = None
                with self._cond:
                    while not self._closed and not self._patches and not (self._sources and self._can_start()):
                        self._cond.wait(0.5)
                    if self._closed:
                        return
                    if self._patches:
                        patch = self._patches.popleft()
                    else:
                        slot = self._free.popleft()
                        self._pulling = True
                if patch is not None:
                    self._refill(patch)
                    continue
                self._start_batch(slot)
        except BaseException as e:  # never expected: pops say so instead of waiting forever
            log.exception("damacy: the feeder thread failed")
            with self._cond:
                self._failure = e
                self._cond.notify_all()
            threading.Thread(target=self.close, name="damacy-close", daemon=True).start()

    def _can_start(self) -> bool:
        cfg = self.config
        return bool(self._free) and self._outstanding + cfg.samples_per_batch <= cfg.lookahead_samples

    def _start_batch(self, slot: Slot) -> None:
        cfg = self.config
        samples, source_error = self._pull(cfg.samples_per_batch)
        with self._cond:
            self._pulling = False
            exhausted = not self._sources
            short = len(samples) < cfg.samples_per_batch
            if not samples or (short and cfg.drop_last and exhausted and source_error is None):
                self._free.appendleft(slot)
                if source_error is not None:
                    self._deliver_error(source_error)
                self._cond.notify_all()
                return
            batch_id = self._next_plan
            self._next_plan += 1
            self._outstanding += len(samples)
            if source_error is not None:
                self._deliver_error(source_error)
        slot.acquire()  # held by the pipeline while the batch is assembled and waits in the queue
        pending = _Pending(batch_id, slot, samples)
        self._run(pending, list(range(len(samples))))

    def _run(self, pending: _Pending, positions: list[int]) -> None:
        try:
            self._plan_and_execute(pending, positions)
        except Exception as e:  # a bug, not a bad sample: this batch's pop raises it, the stream goes on
            log.exception("damacy: batch %d failed", pending.batch_id)
            e.batch_samples = tuple(pending.samples)  # type: ignore[attr-defined]
            pending.slot.release()
            with self._cond:
                self._ready[pending.batch_id] = _Delivery(pending.batch_id, None, pending.samples, [], error=e)
                self._cond.notify_all()

    def _deliver_error(self, error: BaseException) -> None:
        """Called with the lock held: the next pop after the batches before raises ``error``."""
        batch_id = self._next_plan
        self._next_plan += 1
        self._ready[batch_id] = _Delivery(batch_id, None, [], [], error=error)

    def _plan_and_execute(self, pending: _Pending, positions: list[int]) -> None:
        """Plan and execute the samples at ``positions`` of a pending batch."""
        cfg = self.config
        samples = [pending.samples[p] for p in positions]
        plan = self.planner.plan(samples, cfg.sample_shape, cfg.out_of_bounds)
        self.executor.stats.add("plan", plan.seconds, count=len(samples))
        self._dedup += plan.units_total - plan.units_unique
        self._merged += plan.reads_merged
        dtype = self._batch_dtype(pending, plan)
        view = self._slot_view(pending.slot, dtype)
        targets = [view[p : p + 1].reshape(cfg.sample_shape) for p in positions]
        for i, p in enumerate(positions):
            pending.metas[p] = plan.metas[i]

        def done(errors: dict[int, SampleError]) -> None:
            self._executed(pending, positions, plan, {**plan.errors, **errors}, targets)

        self.executor.execute(plan, targets, done, lambda: self._closed, key=id(self))

    def _batch_dtype(self, pending: _Pending, plan) -> np.dtype:
        if pending.dtype is None:
            if self._dtype is not None:
                pending.dtype = self._dtype
            else:  # "native": the dtype of the batch's first readable array
                first = next((m for m in plan.metas if m is not None), None)
                pending.dtype = first.dtype if first is not None else np.dtype("float32")
        return pending.dtype

    def _executed(self, pending: _Pending, positions, plan, errors: dict[int, SampleError], targets) -> None:
        """Called once per round when the executor is done with it."""
        if self._closed:
            pending.slot.release()
            return
        policy = self.config.on_error
        for i, err in errors.items():
            pos = positions[i]
            pending.errors[pos] = err
            if policy == "fill":
                meta = plan.metas[i]
                targets[i][...] = cast_fill(meta.fill_value if meta is not None else 0, targets[i].dtype)
            elif policy == "skip":
                pending.holes.append(pos)
        if policy == "skip" and pending.holes:
            with self._cond:
                self._patches.append(pending)
                self._cond.notify_all()
            return
        self._finish(pending)

    def _refill(self, pending: _Pending) -> None:
        """on_error="skip": drop the failed samples (the others move up, keeping their order)
        and append the next samples of the input in their place."""
        holes = set(pending.holes)
        pending.holes = []
        dropped = [(pending.samples[p], pending.errors[p]) for p in sorted(holes) if p in pending.errors]
        pending.skipped.extend(dropped)
        with self._cond:
            self._outstanding -= len(holes)  # the failed samples leave (before the owner hears of it)
        on_skip = self._on_skip
        if on_skip is not None:
            on_skip(dropped)
        keep = [p for p in range(len(pending.samples)) if p not in holes]
        view = self._slot_view(pending.slot, pending.dtype or np.dtype("float32"))
        for new, old in enumerate(keep):
            if new != old:
                view[new] = view[old]
        pending.samples = [pending.samples[p] for p in keep]
        pending.metas = [pending.metas[p] for p in keep] + [None] * len(holes)
        pending.errors = {}
        samples, source_error = self._pull(len(holes))
        with self._cond:
            self._outstanding += len(samples)
            if source_error is not None:
                self._deliver_error(source_error)  # after this batch
        positions = list(range(len(pending.samples), len(pending.samples) + len(samples)))
        pending.samples.extend(samples)
        del pending.metas[len(pending.samples) :]
        if positions:
            self._run(pending, positions)
        else:
            self._finish(pending)

    def _finish(self, pending: _Pending) -> None:
        errors = sorted(pending.errors.items())
        if self.config.on_error == "raise" and errors:
            first = errors[0][1]
            # every failure of the batch, and every sample it consumed (good ones included)
            first.batch_errors = [(pending.samples[p], e) for p, e in errors]  # type: ignore[attr-defined]
            first.batch_samples = tuple(pending.samples)  # type: ignore[attr-defined]
            delivery = _Delivery(pending.batch_id, None, pending.samples, errors, error=first)
            pending.slot.release()
        elif not pending.samples:  # every sample was skipped and the input ran out
            delivery = _Delivery(pending.batch_id, None, [], [], error=_SKIPPED)
            pending.slot.release()
        else:
            delivery = _Delivery(
                pending.batch_id, pending.slot, pending.samples, errors, dtype=pending.dtype, skipped=pending.skipped
            )
        with self._cond:
            self._sample_errors += len(errors)
            self._ready[pending.batch_id] = delivery
            self._cond.notify_all()

    # -- output -------------------------------------------------------------------
    def _drained(self) -> bool:
        return (
            not self._sources
            and not self._pulling
            and not self._patches
            and self._next_pop >= self._next_plan
        )

    def ready(self) -> bool:
        """Would :meth:`pop` return (or raise) at once?"""
        with self._cond:
            delivery = self._ready.get(self._next_pop)
            return delivery is not None and delivery.error is not _SKIPPED

    def pop(self, timeout: float | None = None) -> Batch:
        """The next batch in push order (use it as a context manager).

        Raises :class:`PipelineDrained` at once when nothing was pushed or everything pushed
        has been delivered; :class:`TimeoutError` when no batch is ready in time
        (``timeout``, default ``Config.pop_timeout_s``; ``math.inf``: no limit); a bad sample's :class:`SampleError`
        under ``on_error="raise"`` (the next pop continues).
        """
        if timeout is None:
            timeout = self.config.pop_timeout_s
        deadline = None if timeout is None or timeout == math.inf else time.monotonic() + timeout
        while True:
            with self._cond:
                while True:
                    if self._failure is not None:
                        raise DamacyError(f"the pipeline stopped: {self._failure!r}") from self._failure
                    if self._closed:
                        raise PipelineDrained("the pipeline is closed")
                    delivery = self._ready.pop(self._next_pop, None)
                    if delivery is not None:
                        self._next_pop += 1
                        self._outstanding -= len(delivery.samples)
                        self._cond.notify_all()
                        break
                    if not self._pushed:
                        raise PipelineDrained("nothing was pushed")
                    if self._drained():
                        raise PipelineDrained(f"all {self._next_pop} batches were delivered and the input is exhausted")
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(self._waiting_for(timeout))
                    self._cond.wait(0.5 if left is None else min(left, 0.5))
            if delivery.error is not _SKIPPED:
                break  # (a batch whose samples were all skipped is passed over)
        if delivery.error is not None:
            raise delivery.error
        slot = delivery.slot
        dtype = delivery.dtype
        info = BatchInfo(
            shape=(len(delivery.samples), *self.config.sample_shape),
            dtype=self.config.dtype if self._dtype is not None else dtype.name,
            device="cpu",
            batch_id=delivery.batch_id,
            samples=tuple(delivery.samples),
            errors=tuple(delivery.errors),
            skipped=tuple(delivery.skipped),
        )
        batch = Batch(slot, info, dtype, self._slot_view(slot, dtype))
        slot.release()  # the pipeline's hold; the batch holds its own
        with self._cond:
            self._delivered_batches += 1
            self._delivered_samples += len(delivery.samples)
        return batch

    def _waiting_for(self, timeout: float) -> str:
        held = sum(1 for s in self._slots if s.users > 0 and s not in self._free)
        what = f"batch {self._next_pop}"
        if not self._free and self._next_pop >= self._next_plan and not self._pulling:
            return (
                f"no {what} within {timeout}s: all {len(self._slots)} batch slots are held by batches "
                "(or arrays exported from them) that were not released"
            )
        if self._pulling or (self._sources and self._next_pop >= self._next_plan):
            return f"no {what} within {timeout}s: waiting for the pushed iterable to yield samples"
        return f"no {what} within {timeout}s: its reads and decodes are still running ({held} slots in use)"

    @property
    def closed(self) -> bool:
        """Closed, or stopped by a failure of its own."""
        return self._closed or self._failure is not None

    @property
    def slot_bytes(self) -> int:
        """Bytes of the budget reserved for this pipeline's slots."""
        return self._slot_bytes

    def outstanding(self) -> int:
        """Samples pulled from the input and not yet popped (at most ``lookahead_samples``)."""
        with self._cond:
            return self._outstanding

    # -- lifetime -----------------------------------------------------------------
    def close(self) -> None:
        """Stop: cancel work in flight and return the memory. Idempotent, never hangs."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._ready.clear()
            self._cond.notify_all()
        feeder = self._feeder
        if feeder is not None and feeder is not threading.current_thread():
            feeder.join(5.0)
        if self._owns:
            self.executor.close()
        # no references from here to the slots or to the owner's callbacks: nothing keeps
        # the slots' memory alive but the batches the caller still holds (and tasks in flight)
        with self._cond:
            self._slots.clear()
            self._free.clear()
            self._patches.clear()
            self._ready.clear()
        self._slot_factory = None
        self._on_skip = None
        if not self._external_slots:  # slots from slot_factory: their owner returns the bytes
            self.executor.release_slots(self._slot_bytes)
            self._slot_bytes = 0
        if self._switch:
            _SwitchInterval.restore()
            self._switch = False

    # -- introspection ------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        """Batches and samples delivered, sample errors, samples pulled from the input."""
        with self._cond:
            return {
                "batches": self._delivered_batches,
                "samples": self._delivered_samples,
                "sample_errors": self._sample_errors,
                "samples_pulled": self._pulled,
            }

    def stats(self) -> dict[str, Any]:
        """Per-stage time/bytes/counts, cache hits and misses, deduplicated chunks, merged
        reads, memory and delivery counters."""
        counters = self.counters()
        return {
            "stages": self.executor.stats.snapshot(),
            "cache": self.planner.metadata.cache.stats(),
            "chunks_deduplicated": self._dedup,
            "reads_merged": self._merged,
            "memory": {
                "budget_bytes": self.executor.budget.total,
                "slot_bytes": self._slot_bytes,
                "in_use_bytes": self.executor.budget.used,
                "peak_bytes": self.executor.budget.peak,
            },
            **counters,
        }


_SKIPPED = PipelineDrained("every sample of this batch was skipped")


class _SwitchInterval:
    """Lowers ``sys.setswitchinterval`` while pipelines that ask for it are open, and puts the
    previous value back when the last one closes (unless someone changed it meanwhile)."""

    _lock = threading.Lock()
    _users = 0
    _saved: float | None = None
    _set: float | None = None

    @classmethod
    def lower(cls, value: float | None) -> bool:
        if value is None:
            return False
        with cls._lock:
            current = sys.getswitchinterval()
            if cls._users == 0:
                cls._saved = current
            cls._users += 1
            if value < current:
                sys.setswitchinterval(value)
                cls._set = sys.getswitchinterval()  # as stored (it is rounded)
        return True

    @classmethod
    def restore(cls) -> None:
        with cls._lock:
            cls._users -= 1
            if cls._users == 0 and cls._saved is not None:
                if cls._set is not None and sys.getswitchinterval() == cls._set:
                    sys.setswitchinterval(cls._saved)
                cls._saved = cls._set = None

