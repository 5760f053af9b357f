"""What every pipeline offers on top of ``pop``/``close``: iteration and context management.

Shared by the embedded pipeline and the daemon client, so both behave alike.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from damacy_protocol.config import Config
from damacy_protocol.errors import DamacyError, InvalidArgument, PipelineDrained
from damacy_runtime.batch import Batch
from damacy_runtime.front import Progress, Sources


class PipelineAPI(ABC):
    """Subclasses set ``_pid`` (the process that made the pipeline) and call
    :meth:`_check_process` in ``push``/``pop``/``stats``.

    After a fork the child holds a copy of the pipeline without its threads (and, for a
    daemon client, with sockets and a session that belong to the parent): using it raises at
    once, and closing it (explicitly or when it is collected) touches nothing the parent
    still uses."""

    config: Config
    _pid: int | None = None
    _restore = 0
    _sources: Sources  # what was pushed (see the resume section below)
    _progress: Progress

    def _forked(self) -> bool:
        return self._pid is not None and self._pid != os.getpid()

    def _check_process(self) -> None:
        if self._forked():
            raise DamacyError(
                f"this pipeline was made in process {self._pid} and cannot be used in process {os.getpid()}, "
                "a fork of it: its threads and its daemon session stay with the parent. Make the pipeline in the "
                "process that uses it (in a DataLoader worker: on first use, not in Dataset.__init__; or num_workers=0)"
            )

    @abstractmethod
    def pop(self, timeout: float | None = None) -> Batch:
        """The next batch, in push order."""

    @abstractmethod
    def close(self) -> None:
        """Stop; never hangs."""

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
        if self.config.on_error == "skip":
            # a skipped sample's replacement is pulled after later batches' samples: the samples
            # seen are no prefix of the stream, which a position cannot say
            raise InvalidArgument('state_dict needs on_error="raise" or "fill" (with "skip", the samples a batch holds are not a prefix of the stream)')
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

    def batches(self, n: int | None = None) -> Iterator[Batch]:
        """Yield ``n`` batches (all, when ``n`` is None), stopping early when drained."""
        for _ in itertools.count() if n is None else range(n):
            try:
                batch = self.pop()
            except PipelineDrained:
                return
            yield batch

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
            if self._forked():
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
