"""A lean thread pool: daemon threads pulling callables from one queue.

Lighter than ``concurrent.futures`` (no future per task): the engine submits thousands of
small tasks per second and each task reports its own outcome.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("damacy")


class WorkerPool:
    def __init__(self, workers: int, name: str) -> None:
        self.workers = workers
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def _start(self) -> None:
        with self._lock:
            if self._threads or self._closed:
                return
            for i in range(self.workers):
                t = threading.Thread(target=self._run, name=f"{self.name}-{i}", daemon=True)
                t.start()
                self._threads.append(t)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if not self._threads:
            self._start()
        self._queue.put((fn, args))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except BaseException:  # a task must report its own errors; never kill the worker
                log.exception("damacy: unhandled error in %s task", self.name)

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(None)
        for t in threads:
            t.join(timeout)
