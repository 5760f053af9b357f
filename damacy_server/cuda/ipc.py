"""Device slots a daemon session shares with its client over CUDA IPC.

Per session, each slot is a direct device allocation (offset 0 of its own allocation, so
its IPC handle names exactly the slot) with two interprocess events: ``ready``, which the
daemon's executor records on its stream when a batch in the slot is complete (the client's
consumer streams wait for it), and ``free``, which the client records on its own stream when
it lets the slot go, after every fence of its consumers (the executor's stream waits for it
before writing the slot again). Handles go to the client once, in the session's Welcome.
When the session ends the slots are freed, after the executor's device work queued before
(a batch of the session may still be in flight), and only once the client has closed its
mappings (it says so in its Bye) or its process is gone: freeing memory another process
still maps is undefined in CUDA. Until then they wait in the daemon's retiring list.

:class:`StandinIpcDevice` is the CPU stand-in of a GPU for this protocol, selected by
``DAMACY_DEVICE_STANDIN`` in both processes: slot memory is POSIX shared memory (the
segment's name is the handle), the kernels are the host twin, events are names whose
records and waits are appended to the stand-in's log, so tests across real processes check
the order each side follows (see ``damacy_client.ipc``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from damacy_protocol import messages as m
from damacy_protocol.errors import InvalidArgument
from damacy_runtime.device import DeviceArray, SlotSync, StreamOrder
from damacy_runtime.devices import device_index, standin, standin_log
from damacy_server.cuda.device import CupyDevice, HostDevice
from damacy_server.cuda.executor import CudaExecutor
from damacy_server.engine.shm import Segment
from damacy_server.engine.slots import SlotMemory, SlotSharing

log = logging.getLogger("damacyd")


class IpcSync(SlotSync):
    """The order of one shared slot's uses in the daemon: the next write waits for the
    slot's ``free`` event (a wait on an event never recorded passes), and each batch ends by
    recording the slot's ``ready`` event again."""

    def __init__(self, ready: Any, free: Any) -> None:
        super().__init__()
        self.ready = ready
        self.free = free

    def take_fences(self) -> list[Any]:
        return [self.free, *super().take_fences()]

    def mark_ready(self, device: StreamOrder) -> None:
        device.record(self.ready)


class StandinEvent:
    """An interprocess event of the stand-in: its name is its handle."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class StandinIpcDevice(HostDevice):
    """The host stand-in device with the daemon's side of the IPC protocol."""

    def record(self, event: Any, stream: int | None = None) -> None:
        standin_log("daemon", "record", event.name, stream)

    def wait_event(self, event: Any, stream: int | None = None) -> None:
        if isinstance(event, StandinEvent):
            standin_log("daemon", "wait", event.name, stream)

    def launch(self, kernel: str, grid: int, block: int, args: tuple) -> None:
        super().launch(kernel, grid, block, args)
        if kernel in ("assemble", "fill"):
            standin_log("daemon", "write", kernel)


class IpcSlots(SlotMemory):
    """A device session's slots (see module); ``infos`` are what the Welcome sends."""

    def __init__(self, prefix: str, sharing: SlotSharing, executor: Any, unmapped: Callable[[], bool]) -> None:
        self.prefix = prefix  # slot k is named {prefix}-{k}
        self.sharing = sharing  # the daemon's shared-memory rule and retiring
        self.executor = executor
        self.device = executor.gpu
        self._unmapped = unmapped  # whether the client no longer maps the slots
        self.infos: list[m.SlotInfo] = []
        self.segments: list[Segment] = []  # the stand-in's (unlinked once the client mapped them)
        self._owned: list[tuple[Any, int]] = []  # (what frees it, bytes)

    def allocate(self, index: int, nbytes: int) -> DeviceArray:
        name = f"{self.prefix}-{index}"
        if isinstance(self.device, StandinIpcDevice):
            seg = Segment(name, nbytes, self.sharing.mode, self.sharing.gid)
            self.segments.append(seg)
            ready, free = StandinEvent(f"{name}.ready"), StandinEvent(f"{name}.free")
            array = DeviceArray(seg.array.ctypes.data, (nbytes,), np.uint8, self.device, seg, sync=IpcSync(ready, free))
            self.infos.append(m.SlotInfo(name, nbytes, handle=name.encode(), ready=ready.name.encode(), free=free.name.encode()))
            self._owned.append((seg, nbytes))
            return array
        if not isinstance(self.device, CupyDevice):
            raise TypeError(f"{type(self.device).__name__} cannot share slots with another process")
        ptr, handle, ready, free = self.device.ipc_slot(nbytes)
        array = DeviceArray(ptr, (nbytes,), np.uint8, self.device, None, sync=IpcSync(ready, free))
        self.infos.append(
            m.SlotInfo(name, nbytes, handle=handle, ready=self.device.ipc_event_handle(ready), free=self.device.ipc_event_handle(free))
        )
        self._owned.append((ptr, nbytes))
        return array

    def close(self, release: Callable[[int], None]) -> None:
        owned, self._owned = self._owned, []
        segments, self.segments = self.segments, []
        self.infos = []
        if not owned:
            return

        def free() -> None:  # on the executor's device thread, after the work queued before
            if isinstance(self.device, StandinIpcDevice):
                for seg in segments:
                    standin_log("daemon", "free", seg.name)
                self.sharing.retire(segments, release)
                return
            self.device.synchronize()
            for ptr, nbytes in owned:
                self.device.ipc_free(ptr)
                release(nbytes)

        self.sharing.retire_when(self._unmapped, lambda: self.executor.after_device_work(free))


def gpu_executor(uuid: str, roots: list[str], options: Any) -> Any:
    """The executor of damacyd's sessions on the GPU named ``uuid``, within the daemon's
    ``options.cuda_limits`` (per GPU), reading with ``options.reader``'s settings below
    ``roots``: the stand-in where ``DAMACY_DEVICE_STANDIN`` says so."""
    index = device_index(uuid)  # InvalidArgument when this daemon does not see that GPU
    if standin() is not None:
        device: Any = StandinIpcDevice()
    else:
        try:
            device = CupyDevice(index)
        except ImportError as e:
            raise InvalidArgument(f"this damacyd cannot serve GPU sessions: CuPy is not installed (pip install 'damacy[cuda13]'): {e}") from e
    log.info("GPU %s (device %d here) serves sessions", uuid, index)
    return CudaExecutor(reader=options.file_reader(roots), limits=options.cuda_limits, device=index, backend=device)
