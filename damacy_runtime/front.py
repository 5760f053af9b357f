"""The front half both pipelines share: what was pushed, pulled lazily; pop deadlines and
their messages; the BatchInfo a batch carries.

The embedded pipeline (:mod:`damacy_server.pipeline`) and the daemon client
(:mod:`damacy_client.client`) differ in where batches are made, not in how the caller's
iterables are consumed or how a late pop is explained; both use these.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from damacy_protocol.config import Config
from damacy_protocol.errors import InvalidArgument
from damacy_runtime.batch import BatchInfo


class Sources:
    """The iterables pushed and not yet exhausted, pulled lazily in push order.

    ``pull`` runs the caller's generators in the calling thread, without holding ``lock``
    (a generator may block or take long); an exception a generator raises ends that
    iterable and is returned, to be raised at the pop after the samples pulled before it.
    """

    def __init__(self, lock: threading.Condition | threading.Lock) -> None:
        self._lock = lock
        self._queue: deque[Iterator[Any]] = deque()

    @staticmethod
    def check(samples: Iterable[Any]) -> Iterator[Any]:
        """``iter(samples)``, or InvalidArgument when ``samples`` is not an iterable of samples."""
        if isinstance(samples, (str, bytes)) or not hasattr(samples, "__iter__"):
            raise InvalidArgument(f"push takes an iterable of samples, got {type(samples).__name__}")
        return iter(samples)

    def add(self, samples: Iterable[Any]) -> None:
        """Queue an iterable (call with the lock held)."""
        self._queue.append(self.check(samples))

    def __bool__(self) -> bool:
        """Is anything left to pull (call with the lock held)?"""
        return bool(self._queue)

    def clear(self) -> None:
        self._queue.clear()

    def pull(
        self, n: int, stop: Callable[[], bool] = lambda: False, convert: Callable[[Any], Any] | None = None
    ) -> tuple[list[Any], BaseException | None]:
        """Up to ``n`` samples (``convert``-ed when given), and the exception that cut the pull
        short, if any: a generator's (its iterable is dropped) or ``convert``'s (the iterable
        goes on after the sample it refused)."""
        out: list[Any] = []
        while len(out) < n and not stop():
            with self._lock:
                if not self._queue:
                    break
                source = self._queue[0]
            try:
                sample = next(source)
            except StopIteration:
                self._drop(source)
                continue
            except BaseException as e:  # the caller's generator failed: raised at a later pop
                self._drop(source)
                return out, e
            if convert is not None:
                try:
                    sample = convert(sample)
                except InvalidArgument as e:
                    return out, e
            out.append(sample)
        return out, None

    def _drop(self, source: Iterator[Any]) -> None:
        with self._lock:
            if self._queue and self._queue[0] is source:
                self._queue.popleft()


def deadline(timeout: float | None) -> float | None:
    """The monotonic time a pop gives up (None: never)."""
    return None if timeout is None or timeout == math.inf else time.monotonic() + timeout


def time_left(until: float | None) -> float | None:
    return None if until is None else max(0.0, until - time.monotonic())


# why a pop timed out
SLOTS_HELD = "slots-held"
WAITING_FOR_INPUT = "input"
WORKING = "working"


def timeout_message(batch_id: int, timeout: float, why: str, slots: int, in_use: int | None = None, where: str = "") -> str:
    """The TimeoutError text of a pop that waited ``timeout`` seconds for batch ``batch_id``."""
    what = f"no batch {batch_id} within {timeout}s"
    if why == SLOTS_HELD:
        return f"{what}: all {slots} batch slots are held by batches (or arrays exported from them) that were not released"
    if why == WAITING_FOR_INPUT:
        return f"{what}: waiting for the pushed iterable to yield samples"
    busy = "" if in_use is None else f" ({in_use} slots in use)"
    return f"{what}: its reads and decodes are still running{where}{busy}"


def batch_info(
    config: Config, count: int, dtype_name: str, batch_id: int, samples, errors=(), skipped=(), device: str = "cpu"
) -> BatchInfo:
    """What a batch of ``count`` samples carries; ``dtype_name`` is the batch's own dtype
    (used when the Config asks for ``native``)."""
    return BatchInfo(
        shape=(count, *config.sample_shape),
        dtype=config.dtype if config.dtype != "native" else dtype_name,
        device=device,
        batch_id=batch_id,
        samples=tuple(samples),
        errors=tuple(errors),
        skipped=tuple(skipped),
    )
