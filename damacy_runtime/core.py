"""The front-end core: samples taken in, batches started, skipped samples replaced, drained
decided, written once for both front ends that drive a batch engine.

The embedded pipeline's feeder adds what it pulls from the pushed iterables; a daemon
session adds what its client pushes. Either way the core holds the samples taken in and not
yet in a batch (a queue), starts a batch whenever the engine has a free slot and the queue
holds one (or the rest of an input that is final), hands a batch whose samples were skipped
(``on_error="skip"``) the next queued samples in their places, and says when nothing is left
to deliver. Lookahead is the core's one rule: the samples taken in and not yet delivered or
dropped (:attr:`outstanding`) stay within ``lookahead`` (:meth:`room`); a daemon client's
credits count the same samples over the wire.

The core locks with the engine's condition (a front end waits on it for deliveries and
slots) and calls the engine outside it, since starting a batch may plan it in the caller's
thread. An exception a pushed iterable raised is queued where it happened (:meth:`add`): the
samples before it make a batch, and the engine delivers the error after it.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import Any, Protocol


class Action(enum.Enum):
    """What the core hands the engine next (:meth:`FrontCore.pump`)."""

    START = "start"  # a batch of queued samples
    REFILL = "refill"  # a patch's replacements (on_error="skip")
    DISCARD = "discard"  # a patch too few replacements are left for, under drop_last: left out
    ERROR = "error"  # the pushed input's error, as its batch


class Patch(Protocol):
    """A batch whose failed samples were dropped and that wants ``needed`` in their place."""

    needed: int
    dropped: list[tuple[Any, BaseException]]


class Engine(Protocol):
    """What the core asks of a batch engine (damacy_server.engine.batches.BatchEngine)."""

    cond: Any  # the condition the engine and its front ends lock with

    def free_slots(self) -> int: ...
    def start(self, samples: list[Any]) -> int: ...
    def start_error(self, error: BaseException) -> int: ...
    def take_patch(self) -> Any: ...
    def refill(self, patch: Any, samples: list[Any]) -> None: ...
    def discard(self, patch: Any, samples: list[Any]) -> list[Any]: ...
    def patches_waiting(self) -> bool: ...
    def idle(self) -> bool: ...


class _Raised:
    """An exception of the pushed input, queued after the samples pulled before it."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Cut:
    """Where a pushed iterable raised, for a front end that raises the error itself (a daemon
    client): batches end there as they would at the error, and nothing is delivered for it."""

    __slots__ = ()


_CUT = _Cut()


class FrontCore:
    def __init__(self, engine: Engine, samples_per_batch: int, lookahead: int, drop_last: bool = False) -> None:
        self.engine = engine
        self.samples_per_batch = samples_per_batch
        self.lookahead = lookahead
        self.drop_last = drop_last
        self._lock = engine.cond
        self._queue: deque[Any] = deque()  # samples (and raised errors) not yet in a batch
        self._samples = 0  # samples in the queue
        self.final = False  # no more input will be added (for now)
        self._patch: Any = None  # a batch waiting for replacements of its skipped samples
        self._busy = 0  # batches taken from the queue and not yet in the engine
        self.outstanding = 0  # samples taken in and not yet delivered or dropped
        self._dropped: list[tuple[Any, BaseException]] = []  # skipped, not yet taken by the front end
        self._discarded: list[Any] = []  # a short last batch under drop_last, not yet taken

    # -- input ----------------------------------------------------------------------------
    def room(self) -> int:
        """Samples the front end may take in now (``lookahead`` minus what is outstanding)."""
        with self._lock:
            return self.lookahead - self.outstanding

    def add(self, samples: list[Any], final: bool, error: BaseException | None = None, cut: bool = False) -> None:
        """Take ``samples`` in; ``final``: no more will come (for now); ``error``: the input
        raised it after these samples; ``cut``: it raised an error the front end raises
        itself (batches end there all the same)."""
        with self._lock:
            self._queue.extend(samples)
            self._samples += len(samples)
            self.outstanding += len(samples)
            if error is not None:
                self._queue.append(_Raised(error))
            elif cut:
                self._queue.append(_CUT)
            self.final = final

    @property
    def queued(self) -> int:
        """Samples taken in and waiting for a batch."""
        return self._samples

    # -- the engine's side ----------------------------------------------------------------
    def pump(self) -> None:
        """Take the engine's patches, refill them, start every batch that can start now."""
        engine = self.engine
        while True:
            if self._patch is None and engine.patches_waiting():
                patch = engine.take_patch()  # compacts the batch's slot: outside the lock
                if patch is not None:
                    with self._lock:
                        self._patch = patch
                        self.outstanding -= len(patch.dropped)  # the failed samples leave
                        self._dropped.extend(patch.dropped)
                    continue
            with self._lock:
                action = self._next()
            if action is None:
                return
            kind, what = action
            try:
                if kind is Action.REFILL:
                    engine.refill(*what)
                elif kind is Action.DISCARD:
                    gone = engine.discard(*what)
                    with self._lock:
                        self.outstanding -= len(gone)
                        self._discarded.extend(gone)
                elif kind is Action.START:
                    engine.start(what)
                else:
                    engine.start_error(what)
            finally:
                with self._lock:
                    self._busy -= 1

    def _next(self) -> tuple[Action, Any] | None:
        """The next thing to hand the engine (called with the lock held; counted busy)."""
        n = self.samples_per_batch
        queue = self._queue
        while self._patch is None and queue and queue[0] is _CUT:  # the batches before it have ended
            queue.popleft()
        if self._patch is not None:
            need = self._patch.needed
            before = self._samples_before_error()
            cut = before < len(queue)  # an error is queued (later pushes' samples may follow it): the batch ends before it
            short = before < need
            if short and not self.final and not cut:
                return None  # wait for more input
            patch, self._patch = self._patch, None
            self._busy += 1
            if short and self.drop_last and not cut:  # it would be delivered short
                return Action.DISCARD, (patch, self._take(need))
            return Action.REFILL, (patch, self._take(need))
        if queue and isinstance(queue[0], _Raised):
            self._busy += 1
            return Action.ERROR, queue.popleft().error
        ready = self._samples_before_error()
        if not ready:
            return None
        cut = ready < len(queue)  # an error follows: the samples before it make a batch
        if (ready < n and not (self.final or cut)) or not self.engine.free_slots():
            return None
        if ready < n and self.drop_last and not cut:  # a short last batch: kept for a later push
            return None
        samples = self._take(n)
        self._busy += 1
        return Action.START, samples

    def _samples_before_error(self) -> int:
        """The samples queued before the first error (or cut): what the next batch may take."""
        for i, item in enumerate(self._queue):
            if isinstance(item, (_Raised, _Cut)):
                return i
        return len(self._queue)

    def _take(self, k: int) -> list[Any]:
        out: list[Any] = []
        while self._queue and len(out) < k and not isinstance(self._queue[0], (_Raised, _Cut)):
            out.append(self._queue.popleft())
        self._samples -= len(out)
        return out

    def delivered(self, count: int) -> None:
        """A batch of ``count`` samples (or the failure of one) was handed out."""
        with self._lock:
            self.outstanding -= count

    def take_dropped(self) -> list[tuple[Any, BaseException]]:
        """Samples skipped since the last call (``on_error="skip"``), with their errors."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
        return dropped

    def take_discarded(self) -> list[Any]:
        """Samples of a short last batch left out (``drop_last``) since the last call."""
        with self._lock:
            discarded, self._discarded = self._discarded, []
        return discarded

    # -- questions --------------------------------------------------------------------------
    def can_pump(self) -> bool:
        """Would :meth:`pump` do something now?"""
        with self._lock:
            if self._patch is None and self.engine.patches_waiting():
                return True
            if self._patch is not None:
                before = self._samples_before_error()
                return before >= self._patch.needed or self.final or before < len(self._queue)
            if self._queue and isinstance(self._queue[0], (_Raised, _Cut)):
                return True
            ready = self._samples_before_error()
            cut = ready < len(self._queue)
            whole = ready >= self.samples_per_batch or cut or (self.final and not self.drop_last)
            return bool(ready) and whole and bool(self.engine.free_slots())

    def waiting_for_slot(self) -> bool:
        """A batch's samples are queued and wait for a free slot."""
        with self._lock:
            ready = self._samples_before_error()
            whole = ready >= self.samples_per_batch or (self.final and not self.drop_last)
            return bool(ready) and whole and not self.engine.free_slots()

    def settled(self) -> bool:
        """Nothing is being handed to the engine and no patch waits for it to be taken."""
        with self._lock:
            return not self._busy and self._patch is None and not self.engine.patches_waiting()

    def drained(self) -> bool:
        """Nothing is left to deliver: the input is final, nothing is queued, nothing is in
        the engine."""
        with self._lock:
            return self.final and not self._queue and self.settled() and self.engine.idle()

    def short_tail(self) -> int:
        """With ``drop_last``, the input final and nothing in the engine: the samples queued
        that make no whole batch (they wait for a later push); else 0."""
        with self._lock:
            if not (self.drop_last and self.final and self._patch is None and self.settled() and self.engine.idle()):
                return 0
            if self._samples_before_error() != len(self._queue) or self._samples >= self.samples_per_batch:
                return 0
            return self._samples
