"""The memory budget and the stage statistics an executor keeps.

:class:`MemoryBudget`: a fixed total shared by batch slots (reserved for an engine's life)
and chunk data in flight (reserved per read). :class:`StageStats`: seconds, counts and bytes
per stage, summed over worker threads.
"""

from __future__ import annotations

import abc
import enum
import threading
import time
from collections.abc import Callable
from typing import Any

from damacy_protocol.enums import Stage
from damacy_protocol.errors import BudgetExceeded
from damacy_protocol.stats import NO_BEST_S
from damacy_server.claim import Claim

#: the least memory for chunk data in flight that a budget must leave beside the slots
MIN_INFLIGHT_BYTES = 16 << 20
#: how long a new pipeline waits for chunk data in flight to make room for its slots
SLOT_WAIT_S = 30.0
#: how long new reads leave a waiting admission the room it waits for: long enough for the
#: reads in flight to finish, short enough that one stuck read (a stalled server) does not
#: hold every other pipeline's reads for the whole wait
ADMIT_FIRST_S = 2.0


class Reservation(enum.Enum):
    """How a wait for room in flight ended."""

    TAKEN = "taken"
    CANCELLED = "cancelled"  # the work was cancelled while it waited
    TOO_BIG = "too big"  # more than the budget leaves beside the slots, ever


class MemoryBudget:
    """A fixed total shared by batch slots (held for a pipeline's life) and chunk data in
    flight (held for a read). ``reserve`` waits for room, but never for more than the slots
    leave: a read that can never fit is refused instead of waiting forever."""

    def __init__(self, total: int, min_inflight: int = MIN_INFLIGHT_BYTES, name: str = "max_memory_bytes") -> None:
        self.total = total
        self.name = name  # the limit it is, as errors name it
        #: the least room for chunk data in flight the slots must leave (one read of the
        #: largest chunk the executor admits)
        self.min_inflight = min_inflight
        self.slots = 0
        self.used = 0  # slots + in flight
        self.peak = 0
        self.waiting = 0  # slot admissions waiting for chunk data in flight to drain
        self.admitting = 0  # the bytes they wait for
        self._first_until = 0.0  # until then new reads leave them that room (ADMIT_FIRST_S)
        self._cond = threading.Condition()

    @property
    def capacity(self) -> int:
        """Bytes that chunk data in flight may use at most (the total beside the slots)."""
        return self.total - self.slots

    def admit_slots(self, nbytes: int, what: str) -> None:
        """Take ``nbytes`` for batch slots for good, waiting (at most ``SLOT_WAIT_S``) for chunk
        data in flight to drain. For ``ADMIT_FIRST_S`` after an admission starts waiting, new
        reads in flight take only the room it leaves (they would otherwise take back every
        byte a finished read frees).
        Refused (BudgetExceeded) when the slots would leave less than ``min_inflight``
        in flight, checked again after every wait: another admission may have taken slots."""
        with self._cond:
            now = time.monotonic()
            deadline = now + SLOT_WAIT_S
            self.waiting += 1
            self.admitting += nbytes
            self._first_until = now + ADMIT_FIRST_S
            try:
                while True:
                    need = self.slots + nbytes + self.min_inflight
                    if need > self.total:
                        raise BudgetExceeded(
                            f"{self.name}={self.total} is too small: {what} need {nbytes} bytes"
                            + (f" (beside {self.slots} held by other slots)" if self.slots else "")
                            + f" plus at least {self.min_inflight} for chunk data in flight (one read of the largest "
                            f"chunk admitted); set {self.name} >= {need}"
                        )
                    if self.used + nbytes <= self.total:
                        break
                    left = deadline - time.monotonic()  # chunk data in flight must drain first
                    if left <= 0:
                        raise BudgetExceeded(
                            f"{what} need {nbytes} bytes and {self.name}={self.total} stayed full of chunk data in "
                            f"flight for {SLOT_WAIT_S:.0f} s"
                        )
                    self._cond.wait(min(left, 0.1))
            finally:
                self.waiting -= 1
                self.admitting -= nbytes
                self._cond.notify_all()
            self.slots += nbytes
            self._take(nbytes)

    def release_slots(self, nbytes: int) -> None:
        with self._cond:
            self.slots -= nbytes
            self.used -= nbytes
            self._cond.notify_all()

    def reserve(self, nbytes: int, cancelled: Callable[[], bool]) -> Reservation:
        """Wait for ``nbytes`` of room in flight: TAKEN, CANCELLED, or TOO_BIG (more than
        the slots leave, now or after waiting)."""
        with self._cond:
            while True:
                if nbytes > self.capacity:
                    return Reservation.TOO_BIG
                if self.used + nbytes + self._held() <= self.total:
                    self._take(nbytes)
                    return Reservation.TAKEN
                if cancelled():
                    return Reservation.CANCELLED
                self._cond.wait(0.05)

    def try_reserve(self, nbytes: int) -> bool:
        """Take ``nbytes`` of room in flight if there is room now (never waits)."""
        with self._cond:
            if nbytes > self.capacity or self.used + nbytes + self._held() > self.total:
                return False
            self._take(nbytes)
            return True

    def _held(self) -> int:
        """The room new reads leave waiting admissions now (the caller holds the lock)."""
        return self.admitting if self.admitting and time.monotonic() < self._first_until else 0

    def _take(self, nbytes: int) -> None:
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def release(self, nbytes: int) -> None:
        if nbytes:
            with self._cond:
                self.used -= nbytes
                self._cond.notify_all()


class BudgetedExecutor(abc.ABC):
    """The memory part of the executor interface, for an executor holding its
    :class:`MemoryBudget` as ``budget`` (slots taken for good, the rest for data in flight);
    and its lifetime as a component: a pipeline composed with it claims it (one open
    pipeline at a time) and gives it back as it closes, when its resources are closed; a
    later claim opens fresh ones (:meth:`_start`)."""

    budget: MemoryBudget
    _claim: Claim | None = None  # the pipeline that holds it
    _closed: bool = False

    @abc.abstractmethod
    def _start(self) -> None:
        """Open the executor's resources (pools, caches, budget); called by ``__init__`` and
        by a claim after a close."""

    def claim(self, owner: Any) -> None:
        """Serve ``owner`` (a pipeline) alone until :meth:`give_back`; InvalidArgument while
        another open pipeline holds it. Reopens what a previous owner's close closed."""
        if self._claim is None:
            self._claim = Claim()
        self._claim.take(
            owner,
            f"this {type(self).__name__} serves another pipeline that is still open: close that one first, "
            "or give each pipeline an executor of its own",
        )
        if self._closed:
            self._start()

    def give_back(self, owner: Any) -> None:
        """``owner`` is done with it: its resources are closed (a later claim reopens them)."""
        if self._claim is None or self._claim.give_back(owner):
            self.close()

    @abc.abstractmethod
    def close(self) -> None:
        """Close the executor's resources (its pipeline gave it back, or its owner closed it)."""

    def reserve_slots(self, nbytes: int, what: str) -> Callable[[int], None]:
        """Take ``nbytes`` for output slots for good (the rest is for data in flight); returns
        what gives bytes of them back, to the budget that admitted them (slots still held by
        a closed pipeline's batches stay in its budget, outside a later pipeline's)."""
        self.budget.admit_slots(nbytes, what)
        return self.budget.release_slots

    @property
    def inflight_capacity(self) -> int:
        """Bytes of data that may be in flight at once (the budget beside the slots)."""
        return self.budget.capacity

    # -- where batches go, and the engine's own writes to them (host memory here) ----------
    def slot_memory(self) -> Any:
        """The :class:`~damacy_server.engine.slots.SlotMemory` batches executed here go to when the
        front end names none (None: host memory)."""
        return None

    def fill(self, target: Any, value: Any) -> None:
        """Set every element of one sample's ``target`` to ``value`` (on_error="fill")."""
        target[...] = value

    def move(self, dst: Any, src: Any) -> None:
        """Copy one sample's ``src`` over ``dst`` in the same slot (on_error="skip")."""
        dst[...] = src


class StageStats:
    """Seconds, counts and bytes per stage, summed over worker threads. Units decoded and
    copied by the native path count under "decode" and again under "native"; reads that
    decode threads made themselves from the page cache under "read" and again under "direct";
    object-store bytes read back from the disk tier under "disk";
    units a batch took from another batch's decode (see :mod:`damacy_server.cpu.inflight`) under
    "shared" (their decoded bytes out, no seconds of their own); chunks ``damacy warm`` put in
    the chunk cache under "warm" (their reads and decodes under "read" and "decode")."""

    STAGES = tuple(Stage)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.data = self._empty()

    def _empty(self) -> dict[str, dict[str, float]]:
        # best: the shortest single observation (one add), in seconds
        return {s.value: {"seconds": 0.0, "count": 0, "bytes_in": 0, "bytes_out": 0, "best": NO_BEST_S} for s in self.STAGES}

    def reset(self) -> None:
        """Zero every stage."""
        with self._lock:
            self.data = self._empty()

    def add(self, stage: Stage, seconds: float, count: int = 1, bytes_in: int = 0, bytes_out: int = 0, best: float | None = None) -> None:
        """``count`` observations taking ``seconds`` in all; ``best``: the shortest of them
        (None: ``seconds``, one observation's)."""
        if best is None:
            best = seconds
        with self._lock:
            d = self.data[stage]
            d["seconds"] += seconds
            d["count"] += count
            d["bytes_in"] += bytes_in
            d["bytes_out"] += bytes_out
            if count and best < d["best"]:
                d["best"] = best

    def add_units(self, n: int, decode_s: float, encoded: int, decoded: int, assemble_s: float, assembled: int) -> None:
        """Decode and assembly of ``n`` units, under one lock."""
        with self._lock:
            d, a = self.data[Stage.DECODE], self.data[Stage.ASSEMBLE]
            d["seconds"] += decode_s
            d["count"] += n
            d["bytes_in"] += encoded
            d["bytes_out"] += decoded
            a["seconds"] += assemble_s
            a["count"] += n
            a["bytes_in"] += decoded
            a["bytes_out"] += assembled
            if n:
                d["best"] = min(d["best"], decode_s)
                a["best"] = min(a["best"], assemble_s)

    def snapshot(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {s: dict(d) for s, d in self.data.items()}
