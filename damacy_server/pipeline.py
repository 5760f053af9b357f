"""The embedded pipeline: samples in, ready batches out, while the caller trains.

A front end over the batch engine (:mod:`damacy_server.engine.batches`): a feeder thread pulls
samples lazily from what was pushed (never more than ``lookahead_samples`` ahead of what was
popped) and starts a batch whenever the engine has a free slot; the engine plans it and the
executor assembles it in the background. ``pop`` returns the batches in push order. What a
bad sample does is ``on_error``'s (stop the pipeline, as the seed API does, by default).

(Over 400 lines: one job, the embedded front end; its feeder, pops and lifetime act on the
one state it shares with its engine, under the engine's lock.)
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from damacy_protocol.config import Config
from damacy_protocol.dtypes import numpy_name
from damacy_protocol.enums import BoundsPolicy
from damacy_protocol.errors import DamacyError, InvalidArgument, PipelineDrained, ShutdownError, stage
from damacy_protocol.limits import BatchSpec, CpuLimits, CudaLimits, QueueLimits
from damacy_protocol.samples import check_pushed
from damacy_protocol.stats import Stats
from damacy_runtime import front
from damacy_runtime.api import CLOSED, PipelineAPI, check_pop_timeout
from damacy_runtime.batch import Batch
from damacy_runtime.core import FrontCore
from damacy_runtime.warn import warn_once
from damacy_server.cpu.executor import CpuExecutor
from damacy_server.engine.batches import BatchEngine, Delivery
from damacy_server.engine.figures import Figures
from damacy_server.engine.policy import Policy
from damacy_server.engine.slots import SlotMemory
from damacy_server.plan.planner import ChunkPlanner
from damacy_server.plan.resolve import ZarrMetadata
from damacy_server.store import RemoteStores
from damacy_server.store.file import FileMetadataReader, FileReader

log = logging.getLogger("damacy")


class Pipeline(PipelineAPI):
    """Streams samples into batches, in this process.

    ``Pipeline(config)`` builds its components from a :class:`~damacy_protocol.config.Config`
    (host memory, or a GPU when the Config names a budget or a device); composed from parts,
    it takes ``planner`` (:class:`ChunkPlanner`), ``executor`` (:class:`CpuExecutor` or
    :class:`CudaExecutor`), ``output`` (:class:`BatchSpec`) and ``queues``
    (:class:`QueueLimits`), all four, and serves as their one pipeline until it is closed.
    ``pop_timeout_s`` (composed; a Config has its own): how long ``pop`` waits (None: no
    limit). damacy's, for composed pipelines (a Config has these as fields): ``on_error``,
    ``out_of_bounds``, ``drop_last``; and ``slot_memory`` (where the slots live; by default
    the executor's) and ``on_skip`` (told of skipped samples).

        with damacy.Pipeline(damacy.Config(samples_per_batch=8, sample_shape=(64, 256, 256))) as p:
            p.push(samples)
            for batch in p.batches(100):
                with batch:
                    x = torch.from_dlpack(batch)
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        planner: ChunkPlanner | None = None,
        executor: Any = None,
        output: BatchSpec | None = None,
        queues: QueueLimits | None = None,
        pop_timeout_s: float | None = 30.0,
        on_error: str = "stop",
        out_of_bounds: str = "error",
        drop_last: bool = True,
        slot_memory: SlotMemory | None = None,
        on_skip: Callable[[list[tuple[Any, DamacyError]]], None] | None = None,
    ) -> None:
        self._closed = True  # until made
        if config is not None:
            if not isinstance(config, Config):
                raise TypeError(f"Pipeline takes a damacy.Config, got {type(config).__name__}")
            if any(x is not None for x in (planner, executor, output, queues)):
                raise TypeError("supply either Config or pipeline components")
            output, queues = config.output, config.queues
            pop_timeout_s = config.pop_timeout_s
            on_error, out_of_bounds, drop_last = config.on_error, config.out_of_bounds, config.drop_last
        elif planner is None or executor is None or output is None or queues is None:
            raise TypeError("planner, executor, output, and queues are required")
        else:
            _check_parts(planner, executor, output, queues)
        self.pop_timeout_s = check_pop_timeout(pop_timeout_s)
        self.policy = Policy(on_error, out_of_bounds)
        if not isinstance(drop_last, bool):
            raise TypeError(f"drop_last must be True or False, got {drop_last!r}")
        self.config = config
        self.output = output
        self.on_error = on_error
        lookahead = queues.lookahead_samples
        self.queues = queues
        try:
            self._make(config, planner, executor, slot_memory)
        except DamacyError as e:
            raise stage(e, "create") from None
        self._closed = False
        self._pid = os.getpid()
        self._cond = self.engine.cond  # one lock for the engine, the core and this front end
        self._core = FrontCore(self.engine, output.samples, lookahead, drop_last)
        self._sources = front.Sources(self._cond)
        self._progress = front.Progress()
        self._pushed = False
        self._pulling = False  # a pull is under way, outside the lock (one at a time: Sources.turn)
        self._pulled = 0
        self._delivered_batches = 0
        self._delivered_samples = 0
        self._failure: BaseException | None = None  # what stopped the feeder, if anything did
        self._feeder: threading.Thread | None = None
        self._on_skip = on_skip
        self._switch = _SwitchInterval.lower(config.switch_interval_s if config is not None else 0.0005)

    def _make(self, config: Config | None, planner: ChunkPlanner | None, executor: Any, slot_memory: SlotMemory | None) -> None:
        """The components (a Config's, made here) claimed for this pipeline, and its engine."""
        output, lookahead = self.output, self.queues.lookahead_samples
        if lookahead < output.samples:
            raise InvalidArgument(
                f"QueueLimits.lookahead_samples={lookahead} is less than one batch ({output.samples} samples): "
                "a batch is planned as a whole"
            )
        if config is not None:
            config.check_cache_floors()
            planner, executor = _components(config)
        else:
            _check_floors(planner, lookahead + output.samples)
        self._planner = planner
        self._executor = executor
        limits = executor.limits
        recheckable = isinstance(limits, CpuLimits) and limits.chunk_cache_dir is not None
        self.planner = planner.claim(self, recheckable=recheckable)
        self._index_bytes: int | None = 0
        try:
            executor.claim(self)
            self.executor = executor
            self._index_bytes, self._release_index = _index_storage(executor, output)
            prepared = self.queues.prepared_batches
            self.engine = BatchEngine(
                output,
                self.policy,
                self.planner,
                executor,
                prepared,
                slot_memory,
                what=f"{prepared} batch slots of {output.samples} x {output.shape} {output.dtype}",
            )
        except BaseException:
            if self._index_bytes:
                self._release_index(self._index_bytes)
            planner.give_back(self)
            executor.give_back(self)
            raise
        self._figures_of = Figures(self.planner, executor, self.engine)

    # -- input --------------------------------------------------------------------
    def _push(self, samples: Iterable[Any]) -> None:
        with self._cond:
            self._sources.add(samples, self._take_restore())
            self._pushed = True
        try:
            self._take_in(deferred=False)  # a first window, checked here (its errors raise here)
        finally:  # what was pushed before a refused iterable goes on
            self._start_feeder("damacy-feeder")

    def _check_item(self, item: Any) -> Any:
        off = "CudaLimits.max_index_bytes=0" if self._index_bytes is None else None
        return check_pushed(item, self.output.shape, self.policy.out_of_bounds == BoundsPolicy.PAD, off)

    def _take_in(self, deferred: bool) -> None:
        """Pull what the lookahead has room for (at most a batch) into the core, checking each
        sample. A refused one drops its iterable and is raised (``deferred``: kept for the
        next push or pop, the feeder's way)."""
        with self._sources.turn():  # the room is counted and taken by one puller at a time
            self._take_in_turn(deferred)

    def _take_in_turn(self, deferred: bool) -> None:
        core = self._core
        with self._cond:
            if self._closed or not self._sources:
                return
            want = min(core.room(), self.output.samples)
            if want <= 0:
                return
            self._pulling = True
        try:
            samples, source_error = self._sources.pull(want, lambda: self._closed, check=self._check_item)
        except front.Refused as refused:
            with self._cond:
                self._pulling = False
                self._pulled += len(refused.kept)
                core.add(refused.kept, final=not self._sources)
                self._cond.notify_all()
                if not deferred:
                    raise refused.error from None
                self._defer(refused.error)
            return
        with self._cond:
            self._pulled += len(samples)
            core.add(samples, final=not self._sources, error=source_error)
            self._pulling = False
            self._cond.notify_all()

    # -- the feeder thread --------------------------------------------------------
    def _feed(self) -> bool:
        """One round of the feeder thread (:func:`front.feed_weakly`): pull from the input
        while the core has room (lookahead), and pump the core: it starts batches as slots
        free up and refills batches whose samples were skipped. False: stop (closed)."""
        core = self._core
        try:
            with self._cond:
                if not self._closed and not self._may_pull() and not core.can_pump():
                    self._cond.wait(0.5)
                    return not self._closed  # (the next round looks again)
                if self._closed:
                    return False
            core.pump()  # first: a batch taken in starts even while the input stalls below
            self._take_in(deferred=True)
            core.pump()
            dropped = core.take_dropped()
            if dropped and self._on_skip is not None:
                self._on_skip(dropped)
            with self._cond:
                # a pop waiting to learn that the input ran out, of an error found ahead, of
                # samples dropped or of every slot being held is woken (a delivery wakes it
                # itself): not every round, which would wake it once per batch for nothing
                if not self._sources or dropped or self._deferred is not None or self._all_slots_held():
                    self._cond.notify_all()
            return True
        except BaseException as e:  # never expected: pops say so instead of waiting forever
            log.exception("damacy: the feeder thread failed")
            with self._cond:
                self._failure = e
                self._cond.notify_all()
            threading.Thread(target=self.close, name="damacy-close", daemon=True).start()
            return False

    # -- output -------------------------------------------------------------------
    def _drained(self) -> bool:
        return not self._sources and not self._pulling and self._core.drained()

    def ready(self) -> bool:
        """Would :meth:`pop` return (or raise) at once?"""
        return self.engine.ready()

    def _pop(self, timeout: float | None, end_at_tail: bool = False) -> Batch | None:
        deadline = front.deadline(timeout)
        started = front.now()
        try:
            with self._cond:
                while True:
                    if self._failure is not None:
                        raise DamacyError(f"the pipeline stopped: {self._failure!r}") from self._failure
                    if self._closed:
                        raise ShutdownError(CLOSED, what="closed")
                    if self._deferred is not None:
                        self._raise_deferred("pop")
                    delivery = self.engine.next_delivery()
                    if delivery is not None:
                        self._core.delivered(len(delivery.samples))
                        self._cond.notify_all()
                        break
                    if not self._pushed:
                        raise PipelineDrained("nothing was pushed: pop() has no batch to wait for")
                    if self._drained():
                        drained = PipelineDrained(self._drained_why())
                        drained.skipped = tuple(self.engine.take_skipped())
                        raise drained
                    if end_at_tail and self._only_tail():
                        return None
                    if self._all_slots_held():  # nothing can come until the caller lets a batch go
                        raise front.slots_held(self.engine.slot_count)
                    left = front.time_left(deadline)
                    if left is not None and left <= 0:
                        raise self._waiting_for(timeout)
                    self._cond.wait(0.5 if left is None else min(left, 0.5))
        finally:  # a pop that raised (timed out, drained) waited too
            self._figures_of.waited(front.now() - started)
        if delivery.error is not None:
            self._handed(None, len(getattr(delivery.error, "batch_samples", ()) or ()))
            raise self._batch_failed(delivery.error)
        batch = self._batch(delivery)
        self._handed(batch)
        with self._cond:
            self._delivered_batches += 1
            self._delivered_samples += len(delivery.samples)
        return batch

    def _drained_why(self) -> str:
        return f"all {self.engine.delivered_ids} batches were delivered and the input is exhausted"

    def _only_tail(self) -> bool:
        """Nothing can come but a short last batch waiting for a later push (drop_last)."""
        with self._cond:
            return not self._sources and not self._pulling and self._core.short_tail() > 0

    def _batch(self, delivery: Delivery) -> Batch:
        slot, dtype = delivery.slot, delivery.dtype
        view = self.engine.slot_view(slot, dtype)  # (from the slot's start)
        info = front.batch_info(
            self.output, len(delivery.samples), numpy_name(dtype), delivery.batch_id, delivery.samples, delivery.errors,
            delivery.skipped, device=self._device_name(), device_ptr=slot.address if isinstance(view, np.ndarray) else 0,
        )
        batch = Batch(slot, info, dtype, view)
        slot.release()  # the engine's hold; the batch holds its own
        return batch

    def _device_name(self) -> str:
        gpu = getattr(self.executor, "gpu", None)
        return "cpu" if gpu is None else f"cuda:{self.executor.device_index}"

    def _device_index(self) -> int:
        return -1 if getattr(self.executor, "gpu", None) is None else int(self.executor.device_index)

    def _may_pull(self) -> bool:
        """Can the feeder pull from the pushed iterables now (room in the lookahead)?"""
        return bool(self._sources) and self._core.room() > 0

    def _all_slots_held(self) -> bool:
        """Every slot is held by batches handed out (or arrays exported from them), and no
        batch is being assembled or pulled, nor a failed one's slot held by the executor,
        and the feeder has nothing left to do without a slot: pulling (which may find the
        input exhausted, or raising) and an error to deliver need none (call with the lock
        held)."""
        engine = self.engine
        return (
            not engine.free_slots()
            and not engine.abandoned_slots
            and engine.delivered_ids >= engine.started_ids
            and not self._pulling
            and not self._may_pull()
            and self._core.settled()
            and not self._core.can_pump()
        )

    def _waiting_for(self, timeout: float) -> DamacyError:
        engine = self.engine
        nothing_started = engine.delivered_ids >= engine.started_ids
        free = engine.free_slots()
        if not free and nothing_started and not self._pulling:
            why = front.SLOTS_HELD
        elif self._pulling or (self._sources and nothing_started) or self._core.short_tail():
            why = front.WAITING_FOR_INPUT
        else:
            why = front.WORKING
        return front.pop_timeout(engine.delivered_ids, timeout, why, engine.slot_count, engine.slot_count - free)

    @property
    def closed(self) -> bool:
        """Closed, or stopped by a failure of its own."""
        return self._closed or self._failure is not None

    @property
    def slot_bytes(self) -> int:
        """Bytes of the budget reserved for this pipeline's slots."""
        return self.engine.slot_bytes

    def outstanding(self) -> int:
        """Samples pulled from the input and not yet popped (at most ``lookahead_samples``)."""
        with self._cond:
            return self._core.outstanding

    # -- lifetime -----------------------------------------------------------------
    def _close(self) -> None:
        if not hasattr(self, "engine"):  # never made
            return
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        feeder = self._feeder
        if feeder is not None and feeder is not threading.current_thread():
            feeder.join(5.0)
        self.engine.close()
        if self._index_bytes:
            self._release_index(self._index_bytes)
        self._planner.give_back(self)
        self._executor.give_back(self)  # its pools and caches close (a later pipeline opens fresh ones)
        self._on_skip = None
        self._sources.clear()
        if self._switch:
            _SwitchInterval.restore()
            self._switch = False

    def _stop(self) -> None:
        with self._cond:
            super()._stop()
            self._cond.notify_all()

    # -- introspection ------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        """Batches and samples delivered, sample errors, samples pulled from the input."""
        with self._cond:
            return {
                "batches": self._delivered_batches,
                "samples": self._delivered_samples,
                "sample_errors": self.engine.sample_errors,
                "samples_pulled": self._pulled,
            }

    def _figures(self) -> Stats:
        return self._figures_of.stats()

    def _reset_figures(self) -> None:
        self._figures_of.reset()

    def stats_dict(self) -> dict[str, Any]:
        """damacy's figures as plain data: per-stage time/bytes/counts, cache hits and
        misses, deduplicated chunks, merged reads, memory and delivery counters; with a GPU
        executor, ``device``: its name and the units decoded on the host because nvCOMP does
        not decode their codec."""
        self._check_process()
        self._check_open()
        counters = self.counters()
        device = getattr(self.executor, "device_stats", None)
        return {
            **({"device": device()} if device is not None else {}),
            "stages": self.executor.stats.snapshot(),
            "cache": self.planner.metadata.cache.stats(),
            **({"chunk_cache": cache.stats()} if (cache := getattr(self.executor, "chunk_cache", None)) is not None else {}),
            **({"disk_cache": disk.stats()} if (disk := getattr(self.executor, "disk_tier", None)) is not None else {}),
            "chunks_deduplicated": self.engine.deduplicated,
            "reads_merged": self.engine.merged,
            "memory": {
                "budget_bytes": self.executor.budget.total,
                "slot_bytes": self.engine.slot_bytes,
                "in_use_bytes": self.executor.budget.used,
                "peak_bytes": self.executor.budget.peak,
            },
            **counters,
        }


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



def _check_parts(planner: Any, executor: Any, output: Any, queues: Any) -> None:
    from damacy_server.cuda.executor import CudaExecutor

    if not isinstance(planner, ChunkPlanner):
        raise TypeError(f"planner must be a ChunkPlanner, got {type(planner).__name__}")
    if not isinstance(executor, (CpuExecutor, CudaExecutor)):
        raise TypeError(f"executor must be a CpuExecutor or a CudaExecutor, got {type(executor).__name__}")
    if not isinstance(output, BatchSpec):
        raise TypeError(f"output must be a BatchSpec, got {type(output).__name__}")
    if not isinstance(queues, QueueLimits):
        raise TypeError(f"queues must be a QueueLimits, got {type(queues).__name__}")


def _index_storage(executor: Any, output: BatchSpec) -> tuple[int | None, Callable[[int], None]]:
    """The device memory a GPU executor keeps for index queries, reserved for this pipeline
    (0: a CPU executor, which needs none; None: index queries are off, max_index_bytes=0).
    A nonzero ``max_index_bytes`` below what a batch can hold is refused (BudgetExceeded)."""
    limits = getattr(executor, "limits", None)
    if not isinstance(limits, CudaLimits):
        return 0, _nothing
    if not limits.takes_index_queries(output.samples, output.shape):
        return None, _nothing
    reserved = limits.index_reservation(output.samples, output.shape)
    release = executor.reserve_slots(reserved, f"index storage of {output.samples} x {output.shape} for two batches")
    return reserved, release


def _nothing(_: int) -> None:
    pass


def _check_floors(planner: ChunkPlanner, floor: int) -> None:
    """A composed pipeline's metadata caches hold at least the samples in flight (the
    lookahead and the batch being planned), and that many times the shards a sample may
    touch (InvalidArgument)."""
    cache, limits = planner.metadata.cache, planner.limits
    if cache.array_entries < floor:
        raise InvalidArgument(
            f"MetadataCache.array_entries={cache.array_entries} is below its floor "
            f"lookahead_samples + output.samples = {floor}"
        )
    need = floor * limits.max_shards_per_sample
    if cache.shard_index_entries < need:
        raise InvalidArgument(
            f"MetadataCache.shard_index_entries={cache.shard_index_entries} is below its floor "
            f"(lookahead_samples + output.samples) * PlanLimits.max_shards_per_sample = {need}"
        )


def _components(config: Config) -> tuple[ChunkPlanner, Any]:
    """The planner and executor a Config describes: the value objects it composes, a CPU
    executor, or a GPU one where it names a budget or a device."""
    remote = RemoteStores(config.storage_options) if config.storage_options else None
    reader = FileMetadataReader(concurrency=config.metadata_io_concurrency, latency=config.metadata_latency)
    planner = ChunkPlanner(
        metadata=ZarrMetadata(reader=reader, cache=config.metadata_cache, remote=remote), limits=config.plan_limits
    )
    chunks = FileReader(workers=config.n_io_threads)
    if not config.on_gpu:
        return planner, CpuExecutor(reader=chunks, limits=config.cpu_limits)
    from damacy_runtime.devices import check_device
    from damacy_server.cuda.executor import CudaExecutor

    if config.device is not None:
        check_device(config.device, "Config.device")  # (its message names the field)
    executor = CudaExecutor(
        reader=chunks,
        limits=config.cuda_limits,
        device=config.device,
        numa_strategy=config.numa_strategy,
        numa_node=config.numa_node,
        enable_gds=config.enable_gds,
    )
    _warn_binding(config.device, executor.device_index)
    return planner, executor


def _warn_binding(configured: int | None, bound: int) -> None:
    """With no device configured, a GPU pipeline bound to the current context's device
    warns (once per case) when that is not LOCAL_RANK's, or when the host has several GPUs."""
    from damacy_runtime.devices import cuda_devices

    if configured is not None:
        return
    raw = os.environ.get("LOCAL_RANK")
    if raw is not None and raw.isdigit() and int(raw) != bound:
        warn_once(
            ("rank", int(raw), bound),
            f"damacy.Pipeline bound to CUDA device {bound} but LOCAL_RANK={raw}: call torch.cuda.set_device({raw}) "
            f"before making the pipeline, or pass Config(device={raw})",
        )
        return
    count = cuda_devices()[0]
    if count > 1:
        warn_once(
            ("count", count, bound),
            f"damacy.Pipeline bound to CUDA device {bound} of {count} because its context was current: "
            "pass Config(device=...) to say which",
        )


