"""What a session may ask of the daemon that hosts it.

A session drives one client's engine; the daemon owns the socket, the loop and what
sessions share. The session sees the daemon only through :class:`SessionHost`: shared
resources (the planner, the executors, the planning pool, the metadata, the slot-sharing
rule, the daemon-wide counters) and a few services (post a reply, wake the loop, end the
session, a GPU's executor, refusing a session that would exhaust descriptors, a wire sample
checked against what the daemon serves, the daemon's figures). So the two do not import
each other, and a session can be driven by a stand-in host.
"""

from __future__ import annotations

import collections
import threading
from contextlib import AbstractContextManager
from typing import Any, Protocol

from damacy_protocol import messages as m
from damacy_protocol import stats as st
from damacy_server.cpu.executor import CpuExecutor
from damacy_server.daemon.options import DaemonOptions
from damacy_server.engine.slots import SlotSharing
from damacy_server.plan.planner import Planner
from damacy_server.plan.resolve import Resolver
from damacy_server.workers import WorkerPool


class Totals:
    """Daemon-wide counts since start (ended sessions included): what ``--metrics`` exports.
    Any thread may count."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {"sessions_started": 0, "batches": 0, "samples": 0}
        self._errors: collections.Counter[str] = collections.Counter()  # failed samples by error type

    def session_started(self) -> None:
        with self._lock:
            self._counts["sessions_started"] += 1

    def delivered(self, batches: int, samples: int) -> None:
        """A session handed out ``batches`` holding ``samples``."""
        with self._lock:
            self._counts["batches"] += batches
            self._counts["samples"] += samples

    def failed(self, errors: list[BaseException]) -> None:
        """Samples that failed (each once, whatever the session's on_error does with them)."""
        with self._lock:
            for e in errors:
                self._errors[type(e).__name__] += 1

    def snapshot(self) -> dict[str, Any]:
        """Sessions started, batches and samples delivered, failed samples by error type."""
        with self._lock:
            return {**self._counts, "errors": dict(self._errors)}


class SessionHost(Protocol):
    """The daemon as its sessions see it."""

    options: DaemonOptions
    planner: Planner
    executor: CpuExecutor
    plan_pool: WorkerPool
    metadata: Resolver
    sharing: SlotSharing
    totals: Totals

    def post(self, identity: bytes, payload: bytes) -> None:
        """Queue an encoded message for a client (from any thread)."""

    def wake(self, session: Any) -> None:
        """``session``'s engine has news: the loop thread pumps it (from any thread)."""

    def end_session(self, session: Any, why: str) -> None:
        """Close ``session`` and forget it (logged with ``why``)."""

    def gpu_executor(self, uuid: str) -> Any:
        """The executor of the GPU named ``uuid``, made on first use."""

    def descriptors(self, slots: int) -> AbstractContextManager[None]:
        """Refuse (BudgetExceeded) a session whose slots would leave too few descriptors;
        else hold them for it while it opens its slots (the context)."""

    def to_sample(self, w: m.WireSample, longest: int | None = None) -> Any:
        """A wire sample as a sample, or a bad one when the daemon may not serve it (or an
        index list holds more than ``longest`` indices)."""

    def stats(self, session: Any = None) -> st.DaemonStats:
        """The daemon's figures (with ``session``'s own)."""
