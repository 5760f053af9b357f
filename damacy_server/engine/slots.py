"""Batch slots: where an engine's slots live (SlotMemory).

Host memory for an embedded pipeline (:class:`HostSlots`), POSIX shared memory a client
maps for a daemon session (:class:`ShmSlots`), a GPU's memory for an embedded pipeline with
``Config(device=k)`` (:class:`DeviceSlots`; a daemon session's GPU slots are shared over
CUDA IPC: ``damacy_server.cuda.ipc.IpcSlots``). An engine allocates its slots once and reuses
them for every batch it assembles.
"""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from damacy_runtime import pinning
from damacy_server.engine.shm import Segment


class SlotMemory(ABC):
    """Where an engine's slots live. ``allocate`` returns ``nbytes`` of writable memory;
    ``close(release)`` gives it up and calls ``release(nbytes)`` for each byte range once
    its memory is really gone (at once, or later when something still maps it)."""

    @abstractmethod
    def allocate(self, index: int, nbytes: int) -> np.ndarray: ...

    @abstractmethod
    def close(self, release: Callable[[int], None]) -> None: ...


class _Tracked(SlotMemory):
    """Slots whose bytes go back to the budget when their memory is really gone: when the
    last view of a slot (a batch handed out and still held, an export) is dropped, after
    ``close``; a slot whose allocation failed was never counted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._release: Callable[[int], None] | None = None
        self._gone = 0  # bytes of slots gone before close (released at close)

    def _track(self, memory: Any, nbytes: int) -> None:
        try:
            weakref.finalize(memory, self._freed, nbytes)
        except TypeError:  # memory that cannot be watched: its bytes go back at close
            self._gone += nbytes

    def _freed(self, nbytes: int) -> None:
        with self._lock:
            release = self._release
            if release is None:
                self._gone += nbytes
                return
        release(nbytes)

    def close(self, release: Callable[[int], None]) -> None:
        with self._lock:
            self._release = release
            gone, self._gone = self._gone, 0
        if gone:
            release(gone)


class HostSlots(_Tracked):
    """Ordinary process memory (numpy asks for transparent huge pages, so first touches are
    cheap and happen in the workers, in parallel), page-locked where a GPU is present (see
    :mod:`damacy_runtime.pinning`)."""

    def allocate(self, index: int, nbytes: int) -> np.ndarray:
        array = np.zeros(nbytes, dtype=np.uint8)
        pinning.pin(array)
        self._track(array, nbytes)  # views keep their base array: gone with the last
        return array


class DeviceSlots(_Tracked):
    """Memory of the executor's device (``damacy_server.cuda.device.Device``): each slot a
    :class:`~damacy_runtime.device.DeviceArray` whose uses are ordered by events (see
    :mod:`damacy_runtime.device`). Batches handed out keep their slot's memory alive."""

    def __init__(self, device) -> None:
        super().__init__()
        self.device = device

    def allocate(self, index: int, nbytes: int):
        array = self.device.array(nbytes)
        self._track(array.owner, nbytes)  # every view of the slot holds its owner
        return array


@dataclass(frozen=True)
class SlotSharing:
    """How a daemon shares slot memory with its clients' processes: segments made with the
    socket's ``mode`` and ``gid``; ``retire(segments, release)`` unmaps each segment as soon
    as no task writes into it any more and calls ``release(nbytes)`` then;
    ``retire_when(ready, free)`` runs ``free()`` once ``ready()`` says so."""

    mode: int
    gid: int | None
    retire: Callable[[list[Segment], Callable[[int], None]], None]
    retire_when: Callable[[Callable[[], bool], Callable[[], None]], None]


class ShmSlots(SlotMemory):
    """POSIX shared-memory segments (files under /dev/shm, named ``{prefix}-{index}``) that a
    client process maps: a daemon session's slots. Closing hands them to the daemon's
    retiring (see :class:`SlotSharing`); their bytes stay in the budget until unmapped."""

    def __init__(self, prefix: str, sharing: SlotSharing) -> None:
        self.prefix = prefix
        self.sharing = sharing
        self.segments: list[Segment] = []

    def allocate(self, index: int, nbytes: int) -> np.ndarray:
        # claimed (and zeroed) by the file system at creation; its pages are mapped into this
        # process as the decode threads first write them, in parallel, as in embedded mode
        seg = Segment(f"{self.prefix}-{index}", nbytes, self.sharing.mode, self.sharing.gid)
        self.segments.append(seg)
        return seg.array

    def close(self, release: Callable[[int], None]) -> None:
        segments, self.segments = self.segments, []
        self.sharing.retire(segments, release)
