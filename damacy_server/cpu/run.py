"""The state of one batch plan while an executor runs it: views, errors, what is pending."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from damacy_protocol.errors import DamacyError
from damacy_server.plan.planner import BatchPlan
from damacy_server.plan.units import UnitJob

log = logging.getLogger("damacy")


class GroupState:
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


class Run:
    """One batch plan being executed into its views (one per sample, None: nothing to write)."""

    __slots__ = (
        "plan", "views", "errors", "pending", "lock", "on_done", "cancelled", "key", "order", "dtype", "targets",
        "kernels", "all_normalized", "arrived", "copying",
    )

    def __init__(self, plan: BatchPlan, views: list, on_done, cancelled, key, order: int) -> None:
        self.key = key
        self.order = order  # runs are served oldest first within a pipeline
        self.plan = plan
        self.views = views
        self.errors: dict[int, DamacyError] = {}
        self.pending = 0  # reads, units waited for, and the cached-units task, not yet reported
        self.lock = threading.Lock()
        self.on_done = on_done
        self.cancelled = cancelled
        # for the native path: the views' common dtype (rows may step by any stride: a
        # transformed sample's view is permuted or reversed, and native code scatters them)
        # (else None), and per rank the views' addresses and strides
        live = [v for v in views if v is not None]
        dtype = live[0].dtype if live else None
        if any(v.dtype != dtype or any(st % v.itemsize for st in v.strides) for v in live):
            dtype = None
        self.dtype = dtype
        # every sample with a view normalises: the native path may use casts only its
        # normalising rows offer
        self.all_normalized = bool(live) and bool(plan.norms) and all(
            plan.norms[i] is not None for i, v in enumerate(views) if v is not None
        )
        self.targets: dict[int, np.ndarray] = {}
        self.kernels: dict[int, Any] = {}  # id(meta) -> native kernel or None, for this run
        # units other batches decoded into the chunk cache for this one, waiting to be copied in one go (see
        # CpuExecutor._waiter), and whether a task to copy them is queued
        self.arrived: list[tuple[UnitJob, np.ndarray]] = []
        self.copying = False

    def fail(self, samples, err: DamacyError) -> None:
        with self.lock:
            for s in samples:
                if s not in self.errors:
                    self.errors[s] = for_sample(err, self.plan.samples[s])

    def crash(self, units: Sequence[UnitJob], exc: BaseException) -> None:
        """An unexpected exception: the samples of ``units`` fail with it, the others go on."""
        log.exception("damacy: unexpected error assembling a batch", exc_info=exc)
        err = DamacyError(f"internal error: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        self.fail(samples_of(units), err)

    def group_done(self, n: int = 1) -> None:
        """``n`` of the reads (or units waited for) are reported."""
        with self.lock:
            self.pending -= n
            last = self.pending == 0
        if last:
            try:
                self.on_done(self.errors)
            except Exception:  # the pipeline's own bookkeeping failed; it must not stop the pool
                log.exception("damacy: error delivering a batch")


def for_sample(err: DamacyError, sample: Any) -> DamacyError:
    e = type(err)(err.reason, uri=err.uri, path=err.path, chunk=err.chunk)
    e.__cause__ = err.__cause__
    return e.with_context(uri=getattr(sample, "uri", None), sample=sample)


def samples_of(units: Sequence[UnitJob]) -> set[int]:
    return {s for u in units for s in u.samples}
