"""The front half both pipelines share: what was pushed, pulled lazily; pop deadlines and
their errors; the BatchInfo a batch carries.

The embedded pipeline (:mod:`damacy_server.pipeline`) and the daemon client
(:mod:`damacy_client.client`) differ in where batches are made, not in how the caller's
iterables are consumed or how a late pop is explained; both use these.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from damacy_protocol.dtypes import output_dtype
from damacy_protocol.enums import DeviceType
from damacy_protocol.errors import DamacyError, InvalidArgument, PoolStarved, SlotsHeld
from damacy_protocol.limits import BatchSpec
from damacy_runtime.batch import BatchInfo


class Refused(Exception):
    """A pushed sample a pipeline's checks refused (its ``error``); its iterable was dropped
    with the samples pulled from it. ``kept``: the samples the same pull took from the
    iterables before it, which go on as pulled."""

    def __init__(self, error: DamacyError, kept: list[Any]) -> None:
        super().__init__(str(error))
        self.error = error
        self.kept = kept


class _Failed:
    """The exception a generator raised when its next sample was pulled ahead."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Sources:
    """The iterables pushed and not yet exhausted, pulled lazily in push order.

    ``pull`` runs the caller's generators in the calling thread, without holding ``lock``
    (a generator may block or take long); an exception a generator raises ends that
    iterable and is returned, to be raised at the pop after the samples pulled before it.
    """

    def __init__(self, lock: threading.Condition | threading.Lock) -> None:
        self._lock = lock
        self._queue: deque[Iterator[Any]] = deque()
        # every push, for state_dict: [first stream position (None until pulled), samples of
        # the iterable skipped at a restore, the iterable's own state when pushed, exhausted]
        self.pushes: list[list[Any]] = []
        self.pulled = 0  # samples pulled so far (stream positions 0 .. pulled - 1)
        self._record: dict[int, list[Any]] = {}
        self._pull_lock = threading.RLock()  # one puller at a time
        self._peeked: tuple[Iterator[Any], Any] | None = None  # the next sample, pulled ahead

    @staticmethod
    def check(samples: Iterable[Any]) -> None:
        """TypeError when ``samples`` is not an iterable of samples (nothing is iterated)."""
        if isinstance(samples, (str, bytes)) or not hasattr(samples, "__iter__"):
            raise TypeError(f"push takes an iterable of samples, got {type(samples).__name__}")

    def add(self, samples: Iterable[Any], skip: int = 0) -> None:
        """Queue an iterable, its first ``skip`` samples left out (a restore; call with the
        lock held)."""
        state_of = getattr(samples, "state_dict", None)
        state = state_of() if callable(state_of) else None
        self.check(samples)
        source = iter(samples)
        if skip:  # a sampler computes its position; any other iterable is skipped through
            start = getattr(samples, "iter_from", None)
            source = iter(start(skip)) if callable(start) else itertools.islice(source, skip, None)
        record = [None, skip, state, False]
        self.pushes.append(record)
        self._record[id(source)] = record
        self._queue.append(source)

    def position(self, consumed: int) -> dict[str, Any]:
        """Where stream position ``consumed`` lies: the push (counted from 0) and how many of
        its iterable's samples come before it, with the iterable's state when pushed."""
        with self._lock:
            records = [list(r) for r in self.pushes]
            pulled = self.pulled
        started = [j for j, r in enumerate(records) if r[0] is not None]
        for k, j in enumerate(started):
            start, skip, state, _ = records[j]
            end = records[started[k + 1]][0] if k + 1 < len(started) else pulled
            if consumed < end:
                return {"push": j, "offset": skip + consumed - start, "state": state}
        if not started:
            j = 0
        else:  # the end of the last iterable pulled from: it, or the next one when it is exhausted
            last = started[-1]
            start, skip, state, exhausted = records[last]
            later = [j for j in range(last + 1, len(records)) if not records[j][3]]
            if not exhausted or not later:
                return {"push": last, "offset": skip + pulled - start, "state": state}
            j = later[0]
        if j >= len(records):
            return {"push": j, "offset": 0, "state": None}
        return {"push": j, "offset": records[j][1], "state": records[j][2]}

    def __bool__(self) -> bool:
        """Is anything left to pull (call with the lock held)?"""
        return bool(self._queue)

    def clear(self) -> None:
        with self._lock:
            self._queue.clear()
            self._peeked = None

    def turn(self) -> threading.RLock:
        """The pull lock, for a caller that decides how much to pull and pulls it in one turn
        (so two pullers cannot both take the same room)."""
        return self._pull_lock

    def pull(
        self,
        n: int,
        stop: Callable[[], bool] = lambda: False,
        convert: Callable[[Any], Any] | None = None,
        check: Callable[[Any], Any] | None = None,
    ) -> tuple[list[Any], BaseException | None]:
        """Up to ``n`` samples, and the exception that cut the pull short, if any: a
        generator's (its iterable is dropped), or ``convert``'s (the client's numbering: the
        iterable goes on after the sample it refused). ``check(item)`` (a pipeline's push
        checks) returns the sample an item is or raises: then the iterable is dropped with
        the samples pulled from it in this call, and :class:`Refused` carries the error (and
        the samples pulled before it from earlier iterables, which stand).
        Callers pull one at a time (the pushes and a feeder thread take turns)."""
        with self._pull_lock:
            return self._pull(n, stop, convert, check)

    def _pull(self, n, stop, convert, check) -> tuple[list[Any], BaseException | None]:
        out: list[Any] = []
        first = 0  # where the current iterable's samples start in out
        current = None
        while len(out) < n and not stop():
            with self._lock:
                if not self._queue:
                    break
                source = self._queue[0]
            if source is not current:
                current, first = source, len(out)
            peeked, self._peeked = self._peeked, None
            if peeked is not None and peeked[0] is source:
                sample = peeked[1]
                if isinstance(sample, _Failed):
                    self._drop(source)
                    return out, sample.error
            else:
                try:
                    sample = next(source)
                except StopIteration:
                    self._drop(source)
                    continue
                except BaseException as e:  # the caller's generator failed: raised at a later pop
                    self._drop(source)
                    return out, e
            if check is not None:
                try:
                    sample = check(sample)
                except DamacyError as e:
                    self._drop(source)
                    with self._lock:
                        self.pulled -= len(out) - first
                    del out[first:]
                    raise Refused(e, out) from None
            if convert is not None:
                try:
                    sample = convert(sample)
                except InvalidArgument as e:
                    return out, e
            with self._lock:
                record = self._record.get(id(source))
                if record is not None and record[0] is None:
                    record[0] = self.pulled
                self.pulled += 1
            out.append(sample)
        if out and len(out) == n and current is not None:
            self._peek(current)  # so an iterable that just ran out is known to have (``pending``)
        return out, None

    def _peek(self, source: Iterator[Any]) -> None:
        """Pull the next sample of ``source`` ahead (taken by the next pull), dropping it now
        if it is exhausted."""
        try:
            self._peeked = (source, next(source))
        except StopIteration:
            self._drop(source)
        except BaseException as e:  # raised by the next pull, in its place
            self._peeked = (source, _Failed(e))

    def _drop(self, source: Iterator[Any]) -> None:
        with self._lock:
            record = self._record.pop(id(source), None)
            if record is not None:
                record[3] = True
            if self._queue and self._queue[0] is source:
                self._queue.popleft()


class Progress:
    """How many pulled samples the training loop is done with, for ``state_dict``: a batch
    counts once it is released, and only after every batch handed out before it (a
    checkpoint never passes over a batch still held); a batch whose pop raised counts at
    once. Thread-safe; ``released`` may run inside a garbage collection."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._sizes: dict[int, int] = {}
        self._done: set[int] = set()
        self._handed = 0
        self._next = 0
        self.consumed = 0
        self.batches = 0

    def handed(self, samples: int, released: bool = False) -> int:
        """A batch (or a failed batch) of ``samples`` pulled samples was handed out; its
        ticket for :meth:`released`."""
        with self._lock:
            ticket = self._handed
            self._handed += 1
            self._sizes[ticket] = samples
        if released:
            self.released(ticket)
        return ticket

    def released(self, ticket: int) -> None:
        with self._lock:
            self._done.add(ticket)
            while self._next in self._done:
                self._done.discard(self._next)
                self.consumed += self._sizes.pop(self._next)
                self.batches += 1
                self._next += 1


now = time.monotonic


def deadline(timeout: float | None) -> float | None:
    """The monotonic time a pop gives up (None: never)."""
    return None if timeout is None or timeout == math.inf else time.monotonic() + timeout


def time_left(until: float | None) -> float | None:
    return None if until is None else max(0.0, until - time.monotonic())


# why a pop timed out
SLOTS_HELD = "slots-held"
WAITING_FOR_INPUT = "input"
WORKING = "working"


def slots_held(slots: int) -> SlotsHeld:
    """What a pop raises, at once, when every one of the ``slots`` batch slots is held by
    the caller."""
    return SlotsHeld(
        f"all {slots} batch slots are held by batches that were not released, or by arrays exported from them "
        "(np.from_dlpack, torch.from_dlpack): no batch can be assembled until one is let go. Release each batch "
        "(`with batch:` or batch.release()) and drop the arrays made from it; to keep data, take batch.copy() "
        "(or .clone() of a tensor)"
    )


def pop_timeout(batch_id: int, timeout: float, why: str, slots: int, in_use: int | None = None, where: str = "") -> PoolStarved:
    """The error of a pop that waited ``timeout`` seconds for batch ``batch_id``, because of
    ``why`` (every slot held: :func:`slots_held`, whatever the wait)."""
    if why == SLOTS_HELD:
        return slots_held(slots)
    what = f"Pipeline.pop() timed out: no batch {batch_id} within {timeout}s"
    if why == WAITING_FOR_INPUT:
        return PoolStarved(
            f"{what}: waiting for the pushed input to yield samples (a last short batch, with drop_last, waits for "
            "a later push to complete it; drop_last=False delivers it short)"
        )
    busy = "" if in_use is None else f" ({in_use} slots in use)"
    return PoolStarved(
        f"{what}: its reads and decodes are still running{where}{busy}. If the loop keeps earlier batches "
        "(or tensors made from them), their memory cannot be filled again: release them, or copy what must be kept"
    )


def batch_info(
    output: BatchSpec, count: int, dtype_name: str, batch_id: int, samples, errors=(), skipped=(), device: str = "cpu",
    device_ptr: int = 0,
) -> BatchInfo:
    """What a batch of ``count`` samples carries; ``dtype_name`` is the batch's own dtype
    (what it is when the pipeline asks for ``native``); ``device_ptr``: its first element's
    address when the caller knows it (0: the :class:`Batch` finds it)."""
    dtype = output.dtype if output.dtype != "native" else output_dtype(dtype_name)
    return BatchInfo(
        device_ptr=device_ptr,
        shape=(count, *output.shape),
        dtype=dtype,
        ready_stream=0,
        batch_id=batch_id,
        device_type=DeviceType.CPU if device == "cpu" else DeviceType.CUDA,
        device_id=0 if device == "cpu" else int(device.rpartition(":")[2] or 0),
        samples=tuple(samples),
        errors=tuple(errors),
        skipped=tuple(skipped),
        device=device,
    )


def feed_weakly(ref: weakref.ref, step: str) -> None:
    """A front end's feeder thread: ``step`` of the object ``ref`` names, called until it
    returns False or the object is gone. The thread holds the object only during a step, so
    a pipeline dropped without ``close()`` is collected (and its ``__del__`` closes it)."""
    while True:
        owner = ref()
        if owner is None:
            return
        go = getattr(owner, step)()
        del owner
        if not go:
            return


def weak_method(method: Callable[..., Any]) -> Callable[..., None]:
    """``method`` called through a weak reference to its object (a callback a connection
    keeps must not keep a pipeline dropped without ``close()`` alive)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call
