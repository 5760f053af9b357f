"""Many ranged GETs in flight on one event loop, as many as the link needs and no more.

Object stores answer each request after a round trip of milliseconds; a reader that keeps
a few requests in flight waits most of the time. :class:`Fetcher` runs requests on one
event loop thread (obstore's futures wait without the GIL) and sizes its window from
bandwidth × latency, the bytes the link holds in flight: every few completions it sets

    window = 2 × throughput × base latency / mean request size

(throughput over the recent completions, base latency the least seen lately), within
``[min_inflight, max_inflight]``. While the window limits the rate, throughput is
window × size / latency, so the window doubles each round trip until the link is full;
once it is, throughput stops growing and the window settles at twice the link's
bandwidth-delay product (requests queue at the server rather than at the link). Requests
wait in order of priority (the executor's batch order) and the memory they land in is
bounded by the executor's budget, not here.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import math
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

#: completions over which throughput and latency are measured
WINDOW_SAMPLES = 64
#: the base latency is the least seen in this long (it follows a link that got slower)
BASE_LATENCY_S = 10.0


class Fetcher:
    """Runs ``request()`` coroutines on one loop thread, at most :attr:`window` at once."""

    def __init__(self, min_inflight: int = 16, max_inflight: int = 1024, name: str = "damacy-fetch") -> None:
        if not 1 <= min_inflight <= max_inflight:
            raise ValueError("need 1 <= min_inflight <= max_inflight")
        self.min_inflight = min_inflight
        self.max_inflight = max_inflight
        self.window = min_inflight
        self.inflight = 0
        self.most_inflight = 0  # the largest number in flight at once (stats, tests)
        self._queue: list[tuple[Any, int, Callable, Callable]] = []
        self._order = itertools.count()
        self._recent: collections.deque[tuple[float, float, int]] = collections.deque(maxlen=WINDOW_SAMPLES)
        self._base = math.inf
        self._base_at = 0.0
        self._since_resize = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._closed = False
        # at exit too: requests in flight are cancelled, not dropped with the loop
        self._finalizer = weakref.finalize(self, _stop, self._loop, self._thread)

    def submit(self, priority: Any, request: Callable[[], Awaitable[Any] | None], done: Callable[[Any, BaseException | None], None]) -> None:
        """Queue ``request`` (called on the loop when its turn comes; it returns an awaitable,
        or ``None`` to skip, e.g. when its batch was cancelled); ``done(result, error)`` runs
        on the loop thread afterwards (not for a skipped request). Thread-safe."""
        if self._closed:
            raise RuntimeError("the fetcher is closed")
        self._loop.call_soon_threadsafe(self._enqueue, (priority, next(self._order), request, done))

    def _enqueue(self, item) -> None:
        heapq.heappush(self._queue, item)
        self._pump()

    def _pump(self) -> None:
        while self._queue and self.inflight < self.window:
            _, _, request, done = heapq.heappop(self._queue)
            try:
                awaitable = request()
            except BaseException as e:
                done(None, e)
                continue
            if awaitable is None:
                continue
            self.inflight += 1
            self.most_inflight = max(self.most_inflight, self.inflight)
            self._loop.create_task(self._run(awaitable, done))

    async def _run(self, awaitable: Awaitable[Any], done: Callable[[Any, BaseException | None], None]) -> None:
        t0 = time.perf_counter()
        result, error = None, None
        try:
            result = await awaitable
        except BaseException as e:  # handed to done, which reports it per sample
            error = e
        t1 = time.perf_counter()
        self.inflight -= 1
        if error is None and result is not None:
            self._measure(t0, t1, len(result))
        try:
            done(result, error)
        finally:
            self._pump()

    def _measure(self, start: float, end: float, nbytes: int) -> None:
        latency = end - start
        if latency < self._base or end - self._base_at > BASE_LATENCY_S:
            self._base, self._base_at = latency, end
        self._recent.append((start, end, nbytes))
        self._since_resize += 1
        if len(self._recent) < 8 or self._since_resize < max(4, self.window // 4):
            return
        self._since_resize = 0
        first = min(s for s, _, _ in self._recent)
        total = sum(n for _, _, n in self._recent)
        span = end - first
        if span <= 0 or total <= 0:
            return
        mean = total / len(self._recent)
        wanted = 2.0 * (total / span) * max(self._base, 1e-6) / mean
        self.window = max(self.min_inflight, min(self.max_inflight, math.ceil(wanted)))

    def close(self) -> None:
        """Cancel what is queued or in flight (their ``done`` sees the cancellation) and
        stop the loop."""
        self._closed = True
        self._finalizer()


def _stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    async def drain() -> None:
        tasks = [t for t in asyncio.all_tasks(loop) if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    if loop.is_running():
        try:
            asyncio.run_coroutine_threadsafe(drain(), loop).result(timeout=5)
        except Exception:  # noqa: BLE001 - stopping regardless
            pass
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
