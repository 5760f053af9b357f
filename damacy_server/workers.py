"""A lean thread pool: daemon threads taking callables from per-key queues, round robin.

Lighter than ``concurrent.futures`` (no future per task): the engine submits thousands of
small tasks per second and each task reports its own outcome. Tasks are queued per key
(one key per pipeline or daemon session) and workers take from the keys in turn, so one
client with a deep queue cannot starve the others. Within a key the task with the lowest
priority number goes first (the engine numbers batches, so the batch a consumer waits for
is not held up by the ones behind it), ties in submission order.

Closing drops the tasks still queued, or, with ``drain``, lets the workers run them (tasks
that see the close return at once, settling what they hold: an executor's reservations); a
task submitted to a drained pool once its workers are gone runs in the submitting thread.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

log = logging.getLogger("damacy")


class WorkerPool:
    def __init__(self, workers: int, name: str) -> None:
        self.workers = workers
        self.name = name
        self._queues: dict[Hashable, list] = {}  # key -> heap of (priority, order, fn, args)
        self._order = itertools.count()
        self._ring: deque[Hashable] = deque()  # keys with queued tasks, in turn order
        self._cond = threading.Condition(threading.Lock())
        self._threads: list[threading.Thread] = []
        self._running = 0  # workers that have not exited
        self._closed = False
        self._drain = False
        #: the CPUs its threads run on (None: any), set before the first task
        self.cpus: set[int] | None = None
        self.steps = 0  # tasks run

    def _start(self) -> None:
        for i in range(self.workers):
            t = threading.Thread(target=self._run, name=f"{self.name}-{i}", daemon=True)
            self._running += 1
            t.start()
            self._threads.append(t)

    def submit(self, fn: Callable[..., Any], *args: Any, key: Hashable = None, priority: int = 0) -> None:
        with self._cond:
            if self._closed and not self._drain:
                return  # dropped, as the tasks queued at close were
            if self._closed and not self._running:
                inline = True  # a drained pool's workers are gone
            else:
                inline = False
                if not self._threads:
                    self._start()
                q = self._queues.get(key)
                if q is None:
                    q = self._queues[key] = []
                if not q:
                    self._ring.append(key)
                heapq.heappush(q, (priority, next(self._order), fn, args))
                self._cond.notify()
        if inline:  # runs here: it sees the close and settles what it holds
            self._call(fn, args)

    def queued(self) -> int:
        """Tasks waiting for a worker."""
        with self._cond:
            return sum(len(q) for q in self._queues.values())

    def _take(self):
        with self._cond:
            while not self._ring:
                if self._closed:
                    self._running -= 1  # under the lock: a submit after this runs its task itself
                    return None
                self._cond.wait()
            key = self._ring.popleft()
            q = self._queues[key]
            _, _, fn, args = heapq.heappop(q)
            item = (fn, args)
            if q:
                self._ring.append(key)  # its next task waits for the other keys' turns
            else:
                del self._queues[key]
            return item

    def _run(self) -> None:
        if self.cpus is not None and hasattr(os, "sched_setaffinity"):
            try:
                os.sched_setaffinity(0, self.cpus)  # (0: this thread)
            except OSError as e:
                log.warning("damacy: %s cannot run on CPUs %s: %s", self.name, sorted(self.cpus), e)
        while True:
            item = self._take()
            if item is None:
                return
            fn, args = item
            self._call(fn, args)
            # an idle worker keeps nothing of its last task alive (a slot's memory, say)
            item = fn = args = None

    def _call(self, fn: Callable[..., Any], args: tuple) -> None:
        self.steps += 1  # (a count for figures: a lost increment between threads is no harm)
        try:
            fn(*args)
        except BaseException:  # a task must report its own errors; never kill the worker
            log.exception("damacy: unhandled error in %s task", self.name)

    def close(self, timeout: float = 5.0, drain: bool = False) -> None:
        """Stop taking new work: the tasks queued are dropped (their owners are cancelled
        first), or with ``drain`` run by the workers, which then exit."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._drain = drain
            dropped = []
            if not drain:
                dropped = [item for q in self._queues.values() for item in q]  # freed below
                self._queues.clear()
                self._ring.clear()
            self._cond.notify_all()
            threads = list(self._threads)
        deadline = time.monotonic() + timeout  # for all of them together
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        del dropped


def close_with(owner: Any, *pools: WorkerPool) -> None:
    """Close ``pools`` once ``owner`` is collected: an executor nothing refers to any more (a
    pipeline closes only the executor it made) lets its idle workers exit. Nothing is queued
    then: a task refers to its executor."""
    weakref.finalize(owner, _close_all, pools)


def _close_all(pools: tuple[WorkerPool, ...]) -> None:
    for pool in pools:
        pool.close(timeout=0)
