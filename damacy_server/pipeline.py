"""The embedded pipeline: samples in, ready batches out, while the caller trains.

A front end over the batch engine (:mod:`damacy_server.engine.batches`): a feeder thread pulls
samples lazily from what was pushed (never more than ``lookahead_samples`` ahead of what was
popped) and starts a batch whenever the engine has a free slot; the engine plans it and the
executor assembles it in the background. ``pop`` returns the batches in push order. A bad
sample is handled per ``on_error`` and never stops the stream.

(Over 400 lines: one job, the embedded front end; its feeder, pops and lifetime act on the
one state it shares with its engine, under the engine's lock.)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from damacy_protocol.config import Config
from damacy_protocol.dtypes import numpy_dtype
from damacy_protocol.errors import DamacyError, InvalidArgument, PipelineDrained, SampleError
from damacy_runtime import front
from damacy_runtime.api import PipelineAPI
from damacy_runtime.batch import Batch
from damacy_runtime.core import FrontCore
from damacy_server.cpu.executor import CpuExecutor, CpuLimits
from damacy_server.engine.batches import BatchEngine, Delivery
from damacy_server.engine.slots import OutputSpec, SlotMemory
from damacy_server.plan.planner import BatchSpec, ChunkPlanner
from damacy_server.plan.reads import PlanLimits
from damacy_server.plan.resolve import MetadataCache, ZarrMetadata
from damacy_server.store import RemoteStores
from damacy_server.store.file import FileMetadataReader, FileReader

log = logging.getLogger("damacy")


@dataclass(frozen=True)
class QueueLimits:
    """``lookahead_samples``: samples in flight ahead of ``pop`` (default: two batches);
    ``prepared_batches``: batch slots."""

    lookahead_samples: int | None = None
    prepared_batches: int = 2


class Pipeline(PipelineAPI):
    """Streams samples into batches in host memory.

    Config style::

        with damacy.Pipeline(damacy.Config(samples_per_batch=8, sample_shape=(64, 256, 256))) as p:
            p.push(samples)
            for batch in p.batches(100):
                with batch:
                    x = torch.from_dlpack(batch)

    or composed from parts (``planner``, ``executor``, ``output``, ``queues``). A planner and
    an executor may be shared by several pipelines: each pipeline's engine reserves its own
    slots in the executor's memory budget and its tasks take turns with the others'. A
    pipeline closes the executor it made, never one it was given (its owner closes it).
    ``slot_memory`` supplies the slots (by default ordinary host memory).
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
        slot_memory: SlotMemory | None = None,
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
        self.config = config
        self._owns = executor is None  # an executor given may serve other pipelines
        if planner is None:
            planner = ChunkPlanner(
                ZarrMetadata(
                    FileMetadataReader(),
                    MetadataCache(config.array_cache_entries, config.shard_index_cache_entries, config.shard_index_cache_bytes),
                    RemoteStores(config.storage_options) if config.storage_options else None,
                    # the pipeline's own, never older than the run; a disk tier outlives it
                    # and names its entries by the metadata's version
                    recheckable=config.chunk_cache_dir is not None,
                ),
                PlanLimits(),
            )
        if executor is None and config.device is not None:
            executor = _cuda_executor(config)
        if executor is None:
            executor = CpuExecutor(
                FileReader(workers=config.io_workers),
                CpuLimits(
                    max_memory_bytes=config.max_memory_bytes,
                    decode_workers=config.decode_workers,
                    chunk_cache_bytes=config.chunk_cache_bytes,
                    chunk_cache_dir=config.chunk_cache_dir,
                    chunk_cache_dir_bytes=config.chunk_cache_dir_bytes,
                ),
            )
        self.planner = planner
        self.executor = executor
        self._dtype = numpy_dtype(config.dtype, "float32") if config.dtype != "native" else None
        self._closed = False
        self._pid = os.getpid()
        spec = OutputSpec(config.samples_per_batch, tuple(config.sample_shape), self._dtype, config.on_error, config.out_of_bounds)
        self.engine = BatchEngine(
            spec,
            planner,
            executor,
            config.prepared_batches,
            slot_memory,
            what=f"{config.prepared_batches} batch slots of {config.samples_per_batch} x {config.sample_shape} {config.dtype}",
        )
        self._cond = self.engine.cond  # one lock for the engine, the core and this front end
        self._core = FrontCore(self.engine, config.samples_per_batch, config.lookahead_samples, config.drop_last)
        self._sources = front.Sources(self._cond)
        self._progress = front.Progress()
        self._pushed = False
        self._pulling = False  # the feeder is pulling from the input (outside the lock)
        self._pulled = 0
        self._delivered_batches = 0
        self._delivered_samples = 0
        self._failure: BaseException | None = None  # what stopped the feeder, if anything did
        self._feeder: threading.Thread | None = None
        self._on_skip = on_skip
        self._switch = _SwitchInterval.lower(config.switch_interval_s)

    # -- input --------------------------------------------------------------------
    def push(self, samples: Iterable[Any]) -> None:
        """Queue samples (``Sample``/``IndexQuery``; any iterable, infinite generators included).
        They are pulled lazily, as room frees up, in the order pushed."""
        self._check_process()
        front.Sources.check(samples)
        with self._cond:
            if self._closed:
                raise InvalidArgument("push on a closed pipeline")
            self._sources.add(samples, self._take_restore())
            self._pushed = True
            if self._feeder is None:
                self._feeder = threading.Thread(target=front.feed_weakly, args=(weakref.ref(self), "_feed"), name="damacy-feeder", daemon=True)
                self._feeder.start()
            self._cond.notify_all()

    def _pull(self, n: int) -> tuple[list[Any], BaseException | None]:
        """Up to ``n`` samples from the sources (runs the caller's generators, in this thread)."""
        out, error = self._sources.pull(n, lambda: self._closed)
        self._pulled += len(out)
        return out, error

    # -- the feeder thread --------------------------------------------------------
    def _feed(self) -> bool:
        """One round of the feeder thread (:func:`front.feed_weakly`): pull from the input
        while the core has room (lookahead), and pump the core: it starts batches as slots
        free up and refills batches whose samples were skipped. False: stop (closed)."""
        core = self._core
        n = self.config.samples_per_batch
        try:
            with self._cond:
                if not self._closed and not self._may_pull() and not core.can_pump():
                    self._cond.wait(0.5)
                    return not self._closed  # (the next round looks again)
                if self._closed:
                    return False
                want = min(core.room(), n) if self._sources else 0
                self._pulling = want > 0
            if want:
                samples, source_error = self._pull(want)
                with self._cond:
                    core.add(samples, final=not self._sources, error=source_error)
                    self._pulling = False
            core.pump()
            dropped = core.take_dropped()
            if dropped and self._on_skip is not None:
                self._on_skip(dropped)
            core.take_discarded()  # a short last batch under drop_last: left out
            with self._cond:
                self._cond.notify_all()  # a pop may be waiting to learn that the input ran out
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

    def pop(self, timeout: float | None = None) -> Batch:
        """The next batch in push order (use it as a context manager).

        Raises :class:`PipelineDrained` at once when nothing was pushed or everything pushed
        has been delivered; :class:`SlotsHeld` at once when every batch slot is held by
        batches not released (or arrays exported from them); :class:`TimeoutError` when no
        batch is ready in time (``timeout``, default ``Config.pop_timeout_s``; ``math.inf``:
        no limit); a bad sample's :class:`SampleError`
        under ``on_error="raise"`` (the next pop continues).
        """
        self._check_process()
        if timeout is None:
            timeout = self.config.pop_timeout_s
        deadline = front.deadline(timeout)
        with self._cond:
            while True:
                if self._failure is not None:
                    raise DamacyError(f"the pipeline stopped: {self._failure!r}") from self._failure
                if self._closed:
                    raise PipelineDrained("the pipeline is closed")
                delivery = self.engine.next_delivery()
                if delivery is not None:
                    self._core.delivered(len(delivery.samples))
                    self._cond.notify_all()
                    break
                if not self._pushed:
                    raise PipelineDrained("nothing was pushed")
                if self._drained():
                    drained = PipelineDrained(f"all {self.engine.delivered_ids} batches were delivered and the input is exhausted")
                    drained.skipped = tuple(self.engine.take_skipped())
                    raise drained
                if self._all_slots_held():  # nothing can come until the caller lets a batch go
                    raise front.slots_held(self.engine.slot_count)
                left = front.time_left(deadline)
                if left is not None and left <= 0:
                    raise self._waiting_for(timeout)
                self._cond.wait(0.5 if left is None else min(left, 0.5))
        if delivery.error is not None:
            self._handed(None, len(getattr(delivery.error, "batch_samples", ()) or ()))
            raise delivery.error
        batch = self._batch(delivery)
        self._handed(batch)
        with self._cond:
            self._delivered_batches += 1
            self._delivered_samples += len(delivery.samples)
        return batch

    def _batch(self, delivery: Delivery) -> Batch:
        slot, dtype = delivery.slot, delivery.dtype
        info = front.batch_info(
            self.config, len(delivery.samples), dtype.name, delivery.batch_id, delivery.samples, delivery.errors, delivery.skipped
        )
        batch = Batch(slot, info, dtype, self.engine.slot_view(slot, dtype))
        if batch.on_device:
            batch.info = dataclasses.replace(batch.info, device=self.executor.device.name)
        slot.release()  # the engine's hold; the batch holds its own
        return batch

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

    def _waiting_for(self, timeout: float) -> TimeoutError:
        engine = self.engine
        nothing_started = engine.delivered_ids >= engine.started_ids
        free = engine.free_slots()
        if not free and nothing_started and not self._pulling:
            why = front.SLOTS_HELD
        elif self._pulling or (self._sources and nothing_started):
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
    def close(self) -> None:
        """Stop: cancel work in flight and return the memory. Idempotent, never hangs."""
        if self._forked():  # the threads and memory are the parent's
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
        if self._owns:
            self.executor.close()
        self._on_skip = None
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
                "sample_errors": self.engine.sample_errors,
                "samples_pulled": self._pulled,
            }

    def stats(self) -> dict[str, Any]:
        """Per-stage time/bytes/counts, cache hits and misses, deduplicated chunks, merged
        reads, memory and delivery counters; with a GPU executor, ``device``: its name and the
        units decoded on the host because nvCOMP does not decode their codec."""
        self._check_process()
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



def _cuda_executor(config: Config):
    """The executor of ``Config(device=k)``: reads on the host, decodes and assembles on GPU k
    into device slots (CuPy, nvCOMP; the extras ``damacy[cuda12]`` / ``damacy[cuda13]``)."""
    from damacy_runtime.devices import check_device, standin
    from damacy_server.cuda.device import CupyDevice, HostDevice
    from damacy_server.cuda.executor import CudaExecutor, CudaLimits

    check_device(config.device)
    try:
        # DAMACY_DEVICE_STANDIN (tests): GPU 0 is the host stand-in (host memory, the twin)
        device = HostDevice() if standin() is not None else CupyDevice(config.device)
    except ImportError as e:
        raise InvalidArgument(
            f"Config.device={config.device} needs CuPy and nvCOMP: pip install 'damacy[cuda13]' (or [cuda12]) ({e})"
        ) from e
    limits = CudaLimits() if config.max_gpu_memory_bytes is None else CudaLimits(config.max_gpu_memory_bytes)
    return CudaExecutor(device, FileReader(workers=config.io_workers), limits)
