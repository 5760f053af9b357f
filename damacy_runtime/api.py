"""What every pipeline offers, written once for the embedded pipeline and the daemon client:
the seed API's contract around ``push`` and ``pop`` (closed pipelines, errors that stop a
pipeline, errors found ahead), iteration, context management, resume.

A subclass implements ``_push`` (queue an iterable and pull a first window of it, checking
its samples), ``_pop`` (the next batch, or the error of its batch, which it passes through
:meth:`_batch_failed`), ``_close``, ``_figures`` and ``_reset_figures`` (the
:class:`~damacy_protocol.stats.Stats` and what ``stats_reset`` zeroes), ``_device_index``
and ``stats_dict``.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import Any

from damacy_protocol.config import Config
from damacy_protocol.enums import ErrorPolicy
from damacy_protocol.errors import DamacyError, InvalidArgument, PipelineDrained, PoolStarved, ShutdownError, stage
from damacy_protocol.limits import BatchSpec, QueueLimits
from damacy_protocol.stats import Stats
from damacy_runtime.batch import Batch
from damacy_runtime.front import Progress, Sources, feed_weakly

CLOSED = "damacy: pipeline has been closed"


def check_pop_timeout(value: Any) -> float | None:
    """A pipeline's ``pop_timeout_s``: None (no limit), or positive and finite seconds."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError("pop_timeout_s must be positive and finite, or None")
    return float(value)


class PipelineAPI(ABC):
    """Subclasses set ``config`` (None: composed from parts), ``output``, ``queues``,
    ``pop_timeout_s``, ``on_error`` and ``_pid`` (the process that made the pipeline), and
    call :meth:`_check_process` where they are used.

    After a fork the child holds a copy of the pipeline without its threads (and, for a
    daemon client, with sockets and a session that belong to the parent): using it raises at
    once, and closing it (explicitly or when it is collected) touches nothing the parent
    still uses."""

    config: Config | None = None
    output: BatchSpec
    queues: QueueLimits
    pop_timeout_s: float | None = 30.0
    on_error: ErrorPolicy = ErrorPolicy.STOP
    _pid: int | None = None
    _restore = 0
    _closed = False
    _terminal: DamacyError | None = None  # the error that stopped it (on_error="stop")
    _deferred: BaseException | None = None  # an input error found ahead, for the next push or pop
    _cond: threading.Condition  # the front end's lock (reentrant), which guards ``_deferred``
    _sources: Sources  # what was pushed (see the resume section below)
    _progress: Progress
    _feeder: threading.Thread | None = None  # pulls the pushed iterables after the first push

    # -- the seed API ---------------------------------------------------------------------
    def push(self, samples: Iterable[Any]) -> None:
        """Queue ``samples`` (any iterable of :class:`~damacy.Sample`, :class:`~damacy.IndexQuery`
        or aligned :class:`~damacy.ResolvedSpatialQuery`; generators and endless ones too),
        pulled lazily as batches are delivered, in push order. A first window is pulled and
        checked here: a sample that cannot fit the batch (its shape, an empty or negative
        box, a query that needs resampling) raises here, and its iterable is dropped with
        the samples pulled with it; what was pushed before goes on. A later window's error is
        raised by the next ``push`` or ``pop``. Errors that depend on the arrays come at
        ``pop``. On a closed or stopped pipeline: :class:`ShutdownError`."""
        self._check_process()
        self._check_open()
        if self._terminal is not None:
            raise ShutdownError(
                f"the pipeline stopped after an error at pop ({type(self._terminal).__name__}: {self._terminal}): "
                "close it and build a new one",
                what="push",
            )
        Sources.check(samples)  # (TypeError before anything is queued or raised)
        earlier = self._take_deferred()  # an earlier iterable's error: raised once this one is queued
        try:
            self._push(samples)
        except DamacyError as e:
            if earlier is None:
                raise stage(e, "push") from None
            self._defer(e)  # this iterable's own, for the next push or pop
        if earlier is not None:
            raise stage(earlier, "push") if isinstance(earlier, DamacyError) else earlier

    def pop(self, timeout: float | None = None) -> Batch:
        """The next batch in push order (use it as a context manager: its slot is refilled
        once it and the arrays made from it are let go).

        Raises :class:`PoolStarved` when no batch comes within ``timeout`` (default
        ``pop_timeout_s``; not terminal: the next ``pop`` waits for the same batch), at once
        as :class:`SlotsHeld` when every batch slot is held by batches (or arrays) not let go,
        and at once as :class:`PipelineDrained` when nothing more can come (nothing pushed,
        or everything delivered: the samples of a last short batch stay queued until more
        are pushed, unless ``drop_last=False`` delivers it short). A bad sample's error
        (naming the sample) is raised at the pop that would have held it: with
        ``on_error="stop"`` the pipeline stops there, and every later pop raises it again
        (``push``: :class:`ShutdownError`); with ``"raise"`` the next pop goes on."""
        batch = self._checked_pop(timeout, end_at_tail=False)
        assert batch is not None
        return batch

    def _checked_pop(self, timeout: float | None, end_at_tail: bool) -> Batch | None:
        """:meth:`pop`; with ``end_at_tail``, None once nothing can come but a short last
        batch waiting for a later push (how iterating ends)."""
        self._check_process()
        self._check_open()
        if self._terminal is not None:
            raise stage(self._terminal.copy(), "pop")
        self._raise_deferred("pop")
        if timeout is None:
            timeout = self.pop_timeout_s
        try:
            return self._pop(timeout, end_at_tail)
        except DamacyError as e:
            if self._closed and not isinstance(e, ShutdownError):  # closed while it waited
                raise ShutdownError(CLOSED, what="closed") from None
            raise stage(e, "pop")  # noqa: B904 - the same error, its stage named

    def batches(self, n: int | None = None) -> Iterator[Batch]:
        """``n`` batches, one ``pop()`` each, lazily (``None``: every batch, until the
        pipeline is drained)."""
        if n is None:
            while True:
                try:
                    batch = self._checked_pop(None, end_at_tail=True)
                except PipelineDrained:
                    return
                if batch is None:
                    return
                yield batch
        for _ in range(n):
            yield self.pop()

    def stats(self) -> Stats:
        """The pipeline's figures now (see :class:`~damacy_protocol.stats.Stats`); they keep
        accumulating."""
        self._check_process()
        self._check_open()
        return self._figures()

    def stats_reset(self) -> None:
        """Zero the timings, the stages' totals and the synthetic-latency counters; the
        caches' hits and misses and the memory committed stay."""
        self._check_process()
        self._check_open()
        self._reset_figures()

    @property
    def device(self) -> int:
        """The CUDA device the batches are on, or -1 (host memory)."""
        self._check_open()
        return self._device_index()

    @property
    def pending(self) -> bool:
        """Are pushed samples still waiting in their iterables (not yet taken in)?"""
        return bool(self._sources)

    def close(self) -> None:
        """Stop: cancel the work in flight, give back the memory and the components.
        Idempotent, never hangs; every later call raises :class:`ShutdownError` (batches and
        arrays already handed out stay valid)."""
        if self._forked():  # the threads and memory are the parent's
            return
        self._close()

    @property
    def closed(self) -> bool:
        """Closed (or stopped by a failure of its own)."""
        return self._closed

    # -- for subclasses ----------------------------------------------------------------
    @abstractmethod
    def _push(self, samples: Iterable[Any]) -> None: ...

    @abstractmethod
    def _pop(self, timeout: float | None, end_at_tail: bool = False) -> Batch | None: ...

    @abstractmethod
    def _close(self) -> None: ...

    @abstractmethod
    def _figures(self) -> Stats: ...

    @abstractmethod
    def _reset_figures(self) -> None: ...

    @abstractmethod
    def _device_index(self) -> int: ...


    def _start_feeder(self, name: str) -> None:
        """Start the thread that pulls the pushed iterables from now on (rounds of ``_feed``:
        :func:`front.feed_weakly`), once; wake the waiters either way."""
        with self._cond:
            if self._feeder is None and not self._closed:
                feeder = threading.Thread(target=feed_weakly, args=(weakref.ref(self), "_feed"), name=name, daemon=True)
                self._feeder = feeder
                feeder.start()
            self._cond.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise ShutdownError(CLOSED, what="closed")

    def _batch_failed(self, error: BaseException) -> BaseException:
        """``error`` is what a batch's pop raises: with ``on_error="stop"`` a damacy error
        stops the pipeline (every later pop raises it again; push raises ShutdownError).
        Returns it, to be raised."""
        if self.on_error == ErrorPolicy.STOP and isinstance(error, DamacyError) and not isinstance(error, PoolStarved):
            self._terminal = error
            self._stop()
        return error

    def _stop(self) -> None:
        """The pipeline stopped (on_error="stop"): no more input is taken."""
        self._sources.clear()

    def _defer(self, error: BaseException) -> None:
        """An input error found ahead (a sample of a later window refused): the next push or
        pop raises it."""
        with self._cond:
            if self._deferred is None:
                self._deferred = error

    def _take_deferred(self) -> BaseException | None:
        with self._cond:
            error, self._deferred = self._deferred, None
        return error

    def _raise_deferred(self, what: str) -> None:
        error = self._take_deferred()
        if error is not None:
            raise stage(error, what) if isinstance(error, DamacyError) else error

    def _forked(self) -> bool:
        return self._pid is not None and self._pid != os.getpid()

    def _check_process(self) -> None:
        if self._forked():
            raise DamacyError(
                f"this pipeline was made in process {self._pid} and cannot be used in process {os.getpid()}, "
                "a fork of it: its threads and its daemon session stay with the parent. Make the pipeline in the "
                "process that uses it (in a DataLoader worker: on first use, not in Dataset.__init__; or num_workers=0)"
            )

    # -- resume -------------------------------------------------------------------
    # subclasses hold ``_sources`` (front.Sources), ``_progress`` (front.Progress) and
    # ``_restore`` (samples of the next push to leave out) and call :meth:`_handed` for
    # every batch (or failed batch) a pop hands out

    def _handed(self, batch: Batch | None = None, consumed: int = 0) -> None:
        if batch is None:  # a failed batch: done with at once
            self._progress.handed(consumed, released=True)
            return
        ticket = self._progress.handed(len(batch.info.samples) + len(batch.info.skipped))
        batch.on_release = lambda: self._progress.released(ticket)

    def _take_restore(self) -> int:
        skip, self._restore = self._restore, 0
        return skip

    def state_dict(self) -> dict[str, Any]:
        """Where the training loop is, for an exact resume: the push (counted from 0) and the
        number of its iterable's samples in batches released so far (a batch still held, and
        every batch after it, counts as not seen), with the iterable's ``state_dict()`` taken
        when it was pushed (a sampler's seed and epoch). Plain data (JSON- and
        msgpack-able); see :meth:`load_state_dict`."""
        self._check_process()
        if self.on_error == ErrorPolicy.SKIP:
            # a skipped sample's replacement is pulled after later batches' samples: the samples
            # seen are no prefix of the stream, which a position cannot say
            raise InvalidArgument('state_dict needs on_error="stop", "raise" or "fill" (with "skip", the samples a batch holds are not a prefix of the stream)')
        if not self._sources.pushes and self._restore:  # restored, nothing pushed yet: that same place
            return {"version": 1, "push": 0, "offset": self._restore, "source_state": None, "batches": 0}
        position = self._sources.position(self._progress.consumed)
        return {
            "version": 1,
            "push": position["push"],
            "offset": position["offset"],
            "source_state": position["state"],
            "batches": self._progress.batches,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` (from :meth:`state_dict`, maybe in another process) left
        off: the next push leaves out the first ``state["offset"]`` samples of its iterable.
        Push the iterable that was at ``state["push"]`` (restore a sampler from
        ``state["source_state"]`` first) and the batches are those the first run would have
        made, bit for bit. Only before the first push."""
        self._check_process()
        if not isinstance(state, dict) or state.get("version") != 1 or not isinstance(state.get("offset"), int) or state["offset"] < 0:
            raise InvalidArgument(f"not a damacy pipeline state (version 1): {state!r}")
        if self._sources.pushes:
            raise InvalidArgument("load_state_dict comes before the first push")
        self._restore = state["offset"]

    def __iter__(self) -> Iterator[Batch]:
        return self.batches()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        """Dropped without ``close()``: closed on a thread of its own (the collector may run
        this on any thread, one of the pipeline's own holding its locks included); at
        interpreter exit, where no thread starts any more, here."""
        try:
            if self._forked() or self._closed:
                return
            if sys.is_finalizing():
                self._close_quietly()
            else:
                threading.Thread(target=self._close_quietly, name="damacy-close", daemon=True).start()
        except Exception:  # noqa: BLE001 - half-built object
            pass

    def _close_quietly(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - what a pipeline nobody holds met as it closed
            pass
