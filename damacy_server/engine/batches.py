"""The batch engine: samples in, assembled batches out, in batch order.

One engine per pipeline (embedded) or per daemon session. It owns the batch slots, plans
each batch, hands the plan to the executor, applies the error policy (raise, fill, skip:
:mod:`damacy_server.engine.policy`) and delivers finished batches by batch id. It pulls no iterables and knows no sockets: a
front end starts batches with the samples it has (:meth:`BatchEngine.start`), supplies
replacements for skipped samples when asked (:meth:`take_patch` / :meth:`refill`) and takes
deliveries in order (:meth:`next_delivery`). ``on_change`` tells the front end, from
whatever thread made the change, that a delivery is ready, a slot is free or a patch waits.
Planning runs in the caller's thread, or on a shared ``plan_pool`` (the daemon's, so its
loop thread never plans).

Behind two small interfaces: the executor (:class:`damacy_server.cpu.executor.CpuExecutor`, or
:class:`damacy_server.cuda.executor.CudaExecutor`), which also makes the engine's own writes
to a slot (fill, move), and the slot memory (:class:`damacy_server.engine.slots.SlotMemory`: host
memory, shared memory in the daemon, device memory; by default where the executor says).

(Over 400 lines: one job, the batches of one pipeline from start to delivery; starting,
refilling skipped samples and delivering all act on the engine's one state, under its lock.)
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from damacy_protocol.dtypes import numpy_dtype
from damacy_protocol.enums import ErrorPolicy, Stage
from damacy_protocol.errors import BatchFailed, DamacyError, InvalidArgument
from damacy_protocol.limits import BatchSpec
from damacy_runtime.batch import Slot
from damacy_server.cache import AnyCache
from damacy_server.engine.budget import StageStats
from damacy_server.engine.policy import SKIPPED, Policy, PolicyRounds
from damacy_server.engine.slots import HostSlots, SlotMemory
from damacy_server.plan.planner import BatchPlan
from damacy_server.plan.reads import Caps

log = logging.getLogger("damacy")


class Executor(Protocol):
    """What the engine asks of an executor (:class:`~damacy_server.cpu.executor.CpuExecutor`,
    :class:`~damacy_server.cuda.executor.CudaExecutor`)."""

    stats: StageStats
    chunk_cache: AnyCache | None

    @property
    def inflight_capacity(self) -> int: ...
    @property
    def caps(self) -> Caps: ...
    def reserve_slots(self, nbytes: int, what: str) -> Callable[[int], None]: ...
    def slot_memory(self) -> SlotMemory | None: ...
    def execute(
        self, plan: BatchPlan, targets: Sequence[Any], on_done: Callable[[dict[int, DamacyError]], None],
        cancelled: Callable[[], bool] = ..., key: Any = None,
    ) -> None: ...
    def fill(self, target: Any, value: Any) -> None: ...
    def move(self, dst: Any, src: Any) -> None: ...


class Planner(Protocol):
    """What the engine asks of a planner (:class:`~damacy_server.plan.planner.Planner`)."""

    def plan(
        self, samples: Sequence[Any], sample_shape: tuple[int, ...], out_of_bounds: str = "pad", *,
        capacity: int | None = None, cache: AnyCache | None = None, accept: Callable[[Any], Any] | None = None,
        dtype: np.dtype | None = None, caps: Caps | None = None,
    ) -> BatchPlan: ...


@dataclass(eq=False)
class Delivery:
    """A finished batch (or the error its pop raises), in batch-id order."""

    batch_id: int
    slot: Slot | None
    samples: list[Any]
    errors: list[tuple[int, DamacyError]]
    error: BaseException | None = None
    dtype: np.dtype | None = None
    skipped: list[tuple[Any, DamacyError]] = dataclasses.field(default_factory=list)
    seconds: float = 0.0  # from its start to ready (the front end may call a batch slow)


class _Pending:
    """A batch being assembled (possibly in several rounds when samples are skipped)."""

    def __init__(self, batch_id: int, slot: Slot, samples: list[Any]) -> None:
        self.batch_id = batch_id
        self.slot = slot
        self.samples = samples  # by slot position
        self.metas: list[Any] = [None] * len(samples)
        self.errors: dict[int, DamacyError] = {}  # slot position -> error
        self.holes: list[int] = []  # positions whose sample failed, to refill (on_error="skip")
        self.skipped: list[tuple[Any, DamacyError]] = []
        self.dtype: np.dtype | None = None
        self.started = time.monotonic()
        # the executor raised after taking the batch: it was delivered as failed, its slot
        # kept until the executor reports the round (tasks it queued may still write there)
        self.abandoned = False


class BatchEngine(PolicyRounds):
    def __init__(
        self,
        output: BatchSpec,
        policy: Policy,
        planner: Planner,
        executor: Executor,
        slots: int,
        memory: SlotMemory | None = None,
        *,
        on_change: Callable[[], None] | None = None,
        on_errors: Callable[[list[DamacyError]], None] | None = None,
        plan_pool: Any = None,
        what: str = "",
    ) -> None:
        self.output = output
        self.policy = policy
        #: the batches' numpy dtype (None: "native", each batch in its first readable array's)
        self.dtype = None if output.dtype == "native" else numpy_dtype(output.dtype)
        self.planner = planner
        self.executor = executor
        self._on_errors = on_errors  # told of each failed sample once (skipped and refilled ones too)
        if memory is None:
            memory = executor.slot_memory() or HostSlots()  # where the executor's batches go
        self.memory = memory
        self.cond = threading.Condition()  # front ends wait on it for deliveries and slots
        self._on_change = on_change
        self._plan_pool = plan_pool  # a WorkerPool to plan on; None: in the caller's thread
        self._batch_shape = (output.samples, *output.shape)
        self._slots: list[Slot] = []
        self._free: deque[Slot] = deque()
        self._ready: dict[int, Delivery] = {}
        self.abandoned_slots = 0  # slots of failed batches the executor still holds
        self._patches: deque[_Pending] = deque()
        self._next_id = 0  # the next batch id to start
        self._next_out = 0  # the next batch id to deliver
        # on_error="skip": the input had no sample left to replace a skipped one (until a
        # batch starts again), and samples of batches that ended all skipped, passed over,
        # waiting for a batch to list them
        self._dry = False
        self._carried: list[tuple[Any, DamacyError]] = []
        self._native: np.dtype | None = None  # dtype="native": the first array's, for every batch
        # dtype="native" until an array fixes it: batches started and not yet planned. On a
        # plan pool batches plan side by side; the first array must be the first batch's, so
        # a batch waits for the ones before it to be planned (the pool takes the earliest first)
        self._unplanned: list[int] = []
        self.closed = False
        self.sample_errors = 0
        self.deduplicated = 0
        self.merged = 0
        self.batches_delivered = 0
        self.units_planned = 0  # unit uses of the batches planned (before deduplication)
        self.units_to_load = 0  # distinct units not in the chunk cache
        # "native" slots are raw bytes sized for the widest supported type (8 bytes)
        one_slot = int(np.prod(self._batch_shape, dtype=np.int64)) * (8 if self.dtype is None else self.dtype.itemsize)
        self.slot_bytes = one_slot * slots
        self._release_slots = executor.reserve_slots(self.slot_bytes, what or f"{slots} batch slots of {output.samples} x {output.shape}")
        try:
            for i in range(slots):
                raw = self.memory.allocate(i, one_slot)
                arr = raw.view(self.dtype).reshape(self._batch_shape) if self.dtype is not None else raw
                slot = Slot(arr, self._slot_freed, index=i)
                self._slots.append(slot)
                self._free.append(slot)
        except BaseException:
            allocated = one_slot * len(self._slots)
            self._slots.clear()
            self._free.clear()
            self._release_slots(self.slot_bytes - allocated)  # what was never allocated
            self.memory.close(self._release_slots)
            raise

    # -- slots --------------------------------------------------------------------------
    @property
    def slot_count(self) -> int:
        return len(self._slots)

    def free_slots(self) -> int:
        with self.cond:
            return len(self._free)

    def held_slots(self) -> int:
        """Slots held by batches handed out (or arrays exported from them)."""
        with self.cond:
            return sum(1 for s in self._slots if s.users > 0 and s not in self._free)

    def _slot_freed(self, slot: Slot) -> None:
        with self.cond:
            if self.closed:
                return  # released after close: never used again
            if slot not in self._free:  # a slot is free once, however its users let go
                self._free.append(slot)
            self.cond.notify_all()
        self._changed()

    def slot_view(self, slot: Slot, dtype: np.dtype) -> np.ndarray:
        """The slot as (samples, *sample_shape) of ``dtype``."""
        if self.dtype is not None:
            return slot.array
        n = int(np.prod(self._batch_shape, dtype=np.int64)) * dtype.itemsize
        return slot.array[:n].view(dtype).reshape(self._batch_shape)

    def _changed(self) -> None:
        callback = self._on_change
        if callback is not None:
            callback()

    # -- starting batches ---------------------------------------------------------------
    def start(self, samples: list[Any]) -> int:
        """Assemble ``samples`` (at most ``samples_per_batch``) into a free slot; returns the
        batch id. The caller checked :meth:`free_slots`."""
        with self.cond:
            if self.closed:
                raise InvalidArgument("the engine is closed")
            slot = self._free.popleft()
            batch_id = self._next_id
            self._next_id += 1
            self._dry = False
            if self.dtype is None and self._native is None:
                self._unplanned.append(batch_id)
        slot.acquire()  # held while the batch is assembled and waits to be delivered
        pending = _Pending(batch_id, slot, list(samples))
        self._run(pending, list(range(len(pending.samples))))
        return batch_id

    def start_error(self, error: BaseException) -> int:
        """Take the next batch id for ``error``: the pop after the batches before it raises it."""
        with self.cond:
            batch_id = self._next_id
            self._next_id += 1
            self._ready[batch_id] = Delivery(batch_id, None, [], [], error=error)
            self.cond.notify_all()
        self._changed()
        return batch_id

    def _run(self, pending: _Pending, positions: list[int]) -> None:
        if self._plan_pool is not None:  # engines take turns on the pool, earlier batches first
            self._plan_pool.submit(self._run_now, pending, positions, key=id(self), priority=pending.batch_id)
        else:
            self._run_now(pending, positions)

    def _run_now(self, pending: _Pending, positions: list[int]) -> None:
        if self.closed:
            pending.slot.release()
            return
        try:
            self._plan_and_execute(pending, positions)
        except Exception as e:  # a bug, not a bad sample: this batch's pop raises it, the stream goes on
            log.exception("damacy: batch %d failed", pending.batch_id)
            failed = BatchFailed(f"batch {pending.batch_id} failed: {type(e).__name__}: {e}", tuple(pending.samples))
            failed.__cause__ = e
            if not pending.abandoned:  # (else the executor's report of the round frees it)
                pending.slot.release()
            self._deliver(Delivery(pending.batch_id, None, pending.samples, [], error=failed))

    def _plan_and_execute(self, pending: _Pending, positions: list[int]) -> None:
        samples = [pending.samples[p] for p in positions]
        executor = self.executor
        dtype = self.dtype
        if dtype is None:
            self._native_turn(pending.batch_id)
        try:
            plan = self.planner.plan(
                samples,
                self.output.shape,
                self.policy.out_of_bounds,
                capacity=executor.inflight_capacity,
                cache=executor.chunk_cache,
                accept=self._accept_native if dtype is None else None,
                dtype=dtype,
                caps=executor.caps,
            )
        finally:
            if dtype is None:
                with self.cond:
                    if pending.batch_id in self._unplanned:
                        self._unplanned.remove(pending.batch_id)
                        self.cond.notify_all()
        self.executor.stats.add(Stage.PLAN, plan.seconds, count=len(samples))
        with self.cond:
            self.deduplicated += plan.units_total - plan.units_unique
            self.merged += plan.reads_merged
            self.units_planned += plan.units_total
            self.units_to_load += plan.units_unique - sum(len(c.arrays) for c in plan.cached)
        dtype = self._batch_dtype(pending, plan)
        view = self.slot_view(pending.slot, dtype)
        targets = [view[p : p + 1].reshape(self.output.shape) for p in positions]
        for i, p in enumerate(positions):
            pending.metas[p] = plan.metas[i]

        def done(errors: dict[int, DamacyError]) -> None:
            self._executed(pending, positions, plan, {**plan.errors, **errors}, targets)

        try:
            self.executor.execute(plan, targets, done, lambda: self.closed, key=id(self))
        except Exception:
            # what it queued before raising may still write into the slot: another batch must
            # not have it before the round is reported (a slot that never is stays taken)
            with self.cond:
                pending.abandoned = True
                self.abandoned_slots += 1
            raise

    def _native_turn(self, batch_id: int) -> None:
        """dtype="native" before an array fixed it: wait until the batches started before this
        one are planned (the first array read is the first batch's, whichever thread plans)."""
        with self.cond:
            while self._native is None and not self.closed and self._unplanned and min(self._unplanned) < batch_id:
                self.cond.wait()
            if self._native is not None:
                self._unplanned.clear()

    def _accept_native(self, meta: Any) -> np.dtype:
        """dtype="native": the first array read fixes the dtype of every batch; an array that
        cannot be cast to it safely is refused (its sample's error), never wrapped. Returns
        that dtype (what a normalised sample is written as)."""
        dtype = meta.dtype.newbyteorder("=")
        with self.cond:
            if self._native is None:
                self._native = dtype
            native = self._native
        if not np.can_cast(dtype, native, "safe"):
            raise InvalidArgument(
                f"the array holds {dtype.name}, which does not cast safely to {native.name}, the pipeline's dtype "
                "(dtype='native' takes the first array's); give the Config an explicit dtype to cast"
            )
        return native

    def _batch_dtype(self, pending: _Pending, plan: Any) -> np.dtype:
        if pending.dtype is None:
            if self.dtype is not None:
                pending.dtype = self.dtype
            else:  # "native": fixed by the first array read (float32 until one is)
                with self.cond:
                    native = self._native
                if native is None and self.policy.on_error is ErrorPolicy.SKIP:
                    # every sample of this round failed before an array was read: nothing of
                    # it is written, and the samples that fill its holes say the dtype
                    return np.dtype("float32")
                pending.dtype = native if native is not None else np.dtype("float32")
        return pending.dtype

    def _executed(self, pending: _Pending, positions: list[int], plan: Any, errors: dict[int, DamacyError], targets: list) -> None:
        """Called once per round when the executor is done with it."""
        if pending.abandoned:  # delivered as failed already: only its slot goes back
            with self.cond:
                self.abandoned_slots -= 1
            pending.slot.release()
            return
        if self.closed:
            pending.slot.release()
            return
        if not self._apply_policy(pending, positions, plan, errors, targets):  # (else it waits for replacements)
            self._finish(pending)

    # -- delivering ---------------------------------------------------------------------
    def _finish(self, pending: _Pending) -> None:
        errors = sorted(pending.errors.items())
        if self._failed_whole(pending):
            first = errors[0][1]
            # every failure of the batch, and every sample it consumed (good ones included)
            first.batch_errors = tuple((pending.samples[p], e) for p, e in errors)
            first.batch_samples = tuple(pending.samples)
            delivery = Delivery(pending.batch_id, None, pending.samples, errors, error=first)
            pending.slot.release()
        elif not pending.samples:  # every sample was skipped and the input ran out
            delivery = Delivery(pending.batch_id, None, [], [], error=SKIPPED, skipped=pending.skipped)  # type: ignore[arg-type]
            pending.slot.release()
        else:
            delivery = Delivery(
                pending.batch_id, pending.slot, pending.samples, errors, dtype=pending.dtype, skipped=pending.skipped
            )
        delivery.seconds = time.monotonic() - pending.started
        self._deliver(delivery)

    def _pass_over(self, pending: _Pending) -> None:
        """Deliver ``pending`` as a batch all skipped: passed over in order, the next batch
        handed out listing its skipped samples."""
        self._deliver(Delivery(pending.batch_id, None, [], [], error=SKIPPED, skipped=pending.skipped))  # type: ignore[arg-type]

    def _deliver(self, delivery: Delivery) -> None:
        with self.cond:
            if self.closed:
                if delivery.slot is not None:
                    delivery.slot.release()
                return
            self._ready[delivery.batch_id] = delivery
            self.cond.notify_all()
        self._changed()

    def next_delivery(self) -> Delivery | None:
        """The next delivery in batch order if it is ready, else None. The delivery's slot
        stays held by the engine until the caller releases it (see :meth:`hand_over`).

        Batches whose samples were all skipped (``on_error="skip"``, where the input ran
        out) are passed over; the next batch handed out lists their samples with its own
        skipped ones. Once the input has run out, a batch waits for the batches started
        after it, so that the last one handed out lists those that end all skipped."""
        with self.cond:
            self._pass_skipped()
            if not self._head_ready():
                return None
            delivery = self._ready.pop(self._next_out)
            self._next_out += 1
            self._pass_skipped()  # (those right after it: only at the end of the input)
            if self._carried and delivery.slot is not None:
                delivery.skipped = [*delivery.skipped, *self._carried]
                self._carried = []
            if delivery.error is None:
                self.batches_delivered += 1
            self.cond.notify_all()
            return delivery

    def _pass_skipped(self) -> None:
        """Pass over the batches next in order that ended all skipped, keeping their samples
        for the next batch handed out (the lock held)."""
        while (delivery := self._ready.get(self._next_out)) is not None and delivery.error is SKIPPED:
            del self._ready[self._next_out]
            self._next_out += 1
            self._carried.extend(delivery.skipped)
            self.cond.notify_all()

    def _head_ready(self) -> bool:
        """Is the next delivery due (the lock held, batches all skipped passed over)? See
        :meth:`next_delivery`."""
        delivery = self._ready.get(self._next_out)
        if delivery is None:
            return False
        if self._dry and delivery.slot is not None:
            return all(later in self._ready for later in range(self._next_out + 1, self._next_id))
        return True

    def take_skipped(self) -> list[tuple[Any, DamacyError]]:
        """Samples of batches that ended all skipped that no batch handed out lists (every
        batch before them was handed out already, and the input ended with them)."""
        with self.cond:
            self._pass_skipped()
            carried, self._carried = self._carried, []
            return carried

    def ready(self) -> bool:
        """Would :meth:`next_delivery` return one now?"""
        with self.cond:
            self._pass_skipped()
            return self._head_ready()

    def idle(self) -> bool:
        """Everything started has been delivered and nothing waits for a refill."""
        with self.cond:
            self._pass_skipped()
            return not self._patches and self._next_out >= self._next_id

    @property
    def delivered_ids(self) -> int:
        """How many batch ids were delivered (the next delivery's id)."""
        return self._next_out

    @property
    def started_ids(self) -> int:
        return self._next_id

    # -- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Cancel the work in flight, drop every reference to the slots, and give their
        memory back (the slot memory returns the bytes to the budget once really gone).
        Batches already handed out stay valid while their holders keep them."""
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self._ready.clear()
            self._patches.clear()
            self._slots.clear()
            self._free.clear()
            self.cond.notify_all()
        self._on_change = None
        self.memory.close(self._release_slots)
