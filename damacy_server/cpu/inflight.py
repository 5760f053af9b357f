"""Units being decoded, shared with the batches that need them meanwhile.

Training keeps several batches in flight (every rank of a node's damacyd, and each
pipeline's lookahead), and random boxes of one volume share read units, so a unit one batch
is decoding is often needed by the next before it is done, while it is not in the chunk
cache yet. The executor registers each unit it schedules; a later batch that needs a
registered unit waits for it instead of reading and decoding it again. The owner decodes a
unit with waiters whole (else only as far as its own copies need) and settles it once:
with the decoded array, with the error every reader of that unit would get, as missing
(the fill value), or as abandoned (its batch was cancelled before decoding it; each waiter
then reads the unit itself).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from damacy_protocol.errors import DamacyError

#: a waiter: called once with (array, error, missing); all empty means abandoned
Waiter = Callable[[np.ndarray | None, DamacyError | None, bool], None]


class Shared:
    """One registered unit: its owner decodes it, its waiters get the result."""

    __slots__ = ("key", "waiters", "whole", "settled")

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.waiters: list[Waiter] = []
        self.whole = False  # the owner decodes it whole: waiters may still join
        self.settled = False

    def __repr__(self) -> str:
        return f"Shared({self.key!r}, waiters={len(self.waiters)}, whole={self.whole}, settled={self.settled})"


class InFlight:
    """The units an executor has scheduled and not yet settled, by ``(array root, unit)``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._units: dict[Hashable, Shared] = {}
        self.joined = 0  # units a batch took from another's decode

    def claim_or_join(self, key: Hashable, waiter: Waiter) -> Shared | None:
        """A new :class:`Shared` when nobody has ``key`` in flight (the caller decodes it and
        must settle it); else ``waiter`` will be called with the owner's result, and None."""
        return self.claim_or_join_many([key], lambda _: waiter)[0]

    def claim_or_join_many(self, keys: Sequence[Hashable], waiter_for: Callable[[int], Waiter]) -> list[Shared | None]:
        """For each key, a new :class:`Shared` when nobody has it in flight (the caller decodes
        it and must settle it), else None and key i's waiter ``waiter_for(i)`` (made only
        then) will be called with the owner's result; under one acquisition of the lock (a
        batch registers its units a read at a time)."""
        out: list[Shared | None] = []
        with self._lock:
            units = self._units
            if not any(map(units.__contains__, keys)) and len(set(keys)) == len(keys):
                out = list(map(Shared, keys))  # none in flight (the usual case): all claimed, by C loops
                units.update(zip(keys, out))
                return out
            for i, key in enumerate(keys):
                shared = units.get(key)
                if shared is None:
                    shared = units[key] = Shared(key)
                    out.append(shared)
                else:
                    shared.waiters.append(waiter_for(i))
                    self.joined += 1
                    out.append(None)
        return out

    def start(self, shared: Shared, whole: bool) -> bool:
        """The owner is about to decode: whether to decode whole (it would anyway, or someone
        waits). A unit decoded only in part takes no more waiters."""
        return self.start_many([shared], [whole])[0]

    def start_many(self, shareds: Sequence[Shared | None], whole: Sequence[bool]) -> list[bool]:
        """:meth:`start` for each registered unit (None: a unit not registered, decoded whole
        as ``whole`` says), under one acquisition of the lock."""
        out = list(whole)
        with self._lock:
            for i, shared in enumerate(shareds):
                if shared is None or shared.settled:
                    continue
                if out[i] or shared.waiters or shared.whole:
                    shared.whole = out[i] = True
                else:
                    self._drop(shared)
        return out

    def settle(
        self, shared: Shared, array: np.ndarray | None = None, error: DamacyError | None = None, missing: bool = False
    ) -> None:
        """The owner is done with the unit (nothing given: abandoned). Later calls do nothing."""
        self.settle_many([shared], None if array is None else [array], error, missing)

    def settle_many(
        self, shareds: Sequence[Shared | None], arrays: Sequence[np.ndarray | None] | None = None,
        error: DamacyError | None = None, missing: bool = False,
    ) -> None:
        """:meth:`settle` each registered unit (None: not registered, skipped), with its array
        ``arrays[i]`` (None: none) or all with ``error`` or as ``missing`` or abandoned, under one
        acquisition of the lock; the waiters are called after it, in order."""
        calls = []
        with self._lock:
            for i, shared in enumerate(shareds):
                if shared is None or shared.settled:
                    continue
                shared.settled = True
                self._drop(shared)
                if shared.waiters:
                    calls.append((shared.waiters, None if arrays is None else arrays[i]))
                    shared.waiters = []
        for waiters, array in calls:
            for waiter in waiters:
                waiter(array, error, missing)

    def _drop(self, shared: Shared) -> None:
        if self._units.get(shared.key) is shared:
            del self._units[shared.key]

    def __len__(self) -> int:
        return len(self._units)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"in_flight": len(self._units), "joined": self.joined}
