"""A client's side of a GPU session's slots, shared by damacyd over CUDA IPC.

The client opens each slot's memory handle and its two interprocess events once per
session (see ``damacy_server.cuda.ipc``) and wraps the slots as device arrays, so batches
are DLPack views of the daemon's device memory. A consumer's stream waits for the slot's
``ready`` event; when the client lets a slot go, its own release stream waits for every
fence the slot's consumers left and records the slot's ``free`` event, before the Release
is sent: the daemon's next write of the slot waits for that event.

:class:`StandinLink` is the CPU stand-in (``DAMACY_DEVICE_STANDIN``): slot memory is the
daemon's shared-memory segments, and every record and wait goes to the stand-in's log.
"""

from __future__ import annotations

import ctypes
import itertools
from typing import Any

import numpy as np

from damacy_protocol import messages as m
from damacy_protocol.errors import DaemonUnavailable, InvalidArgument
from damacy_runtime.device import DeviceArray, SlotSync, StreamOrder
from damacy_runtime.devices import standin, standin_log

KDL_CUDA = 2


class SharedSync(SlotSync):
    """A shared slot's sync on the client: ``ready`` is the slot's interprocess event; the
    fences are the consumers' local events, gathered at release."""

    def __init__(self, ready: Any) -> None:
        super().__init__()
        self.ready = ready


class Link(StreamOrder):
    """The GPU a session's slots live on, from the client's side."""

    host_accessible = False

    free: list[Any]  # per slot its free event

    def open(self, infos: list[m.SlotInfo]) -> list[DeviceArray]:
        raise NotImplementedError

    def let_go(self, slot: int, array: DeviceArray) -> None:
        """Before the Release of ``slot``: the release stream waits for the fences the
        slot's consumers left and records the slot's ``free`` event."""
        for fence in array.sync.take_fences():
            self.wait_event(fence, None)
        self.record(self.free[slot], None)

    def close(self) -> None:
        pass


class StandinLink(Link):
    """The stand-in device seen from a client (memory: the daemon's segments)."""

    dlpack_device = (KDL_CUDA, 0)
    _local = itertools.count(1)

    def __init__(self) -> None:
        self._maps: list[np.ndarray] = []
        self._names: list[str] = []
        self.free: list[str] = []

    def open(self, infos: list[m.SlotInfo]) -> list[DeviceArray]:
        from damacy_client.shm import map_segment

        arrays = []
        for info in infos:
            mapped = map_segment(info.handle.decode(), info.nbytes)
            self._maps.append(mapped)
            self._names.append(info.handle.decode())
            self.free.append(info.free.decode())
            ready = info.ready.decode()
            arrays.append(DeviceArray(mapped.ctypes.data, (info.nbytes,), np.uint8, self, mapped, sync=SharedSync(ready)))
        return arrays

    def close(self) -> None:
        for info in self._names:
            standin_log("client", "unmap", info)
        self._maps, self._names = [], []

    def record_event(self, stream: int | None = None) -> Any:
        name = f"local-{next(self._local)}"
        standin_log("client", "record", name, stream)
        return name

    def record(self, event: Any, stream: int | None = None) -> None:
        standin_log("client", "record", event, stream)

    def wait_event(self, event: Any, stream: int | None = None) -> None:
        standin_log("client", "wait", event, stream)

    def copy_to_host(self, ptr: int, out: np.ndarray) -> None:
        ctypes.memmove(out.ctypes.data, ptr, out.nbytes)

    @property
    def stream_handle(self) -> int:
        return 0


class CudaLink(Link):
    """A GPU through CuPy: memory handles opened once (lazy peer access), interprocess
    events, one release stream."""

    def __init__(self, index: int) -> None:
        import cupy

        self._cupy = cupy
        self.index = index
        self.dlpack_device = (KDL_CUDA, index)
        with cupy.cuda.Device(index):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._opened: list[int] = []
        self._events: list[int] = []
        self.free = []

    def open(self, infos: list[m.SlotInfo]) -> list[DeviceArray]:
        rt = self._cupy.cuda.runtime
        arrays = []
        with self._cupy.cuda.Device(self.index):
            for info in infos:
                ptr = rt.ipcOpenMemHandle(info.handle, 1)  # cudaIpcMemLazyEnablePeerAccess
                self._opened.append(ptr)
                ready, free = rt.ipcOpenEventHandle(info.ready), rt.ipcOpenEventHandle(info.free)
                self._events += [ready, free]
                self.free.append(free)
                arrays.append(DeviceArray(ptr, (info.nbytes,), np.uint8, self, None, sync=SharedSync(ready)))
        return arrays

    def _stream(self, stream: int | None) -> int:
        return self.stream.ptr if stream is None else int(stream)

    def record_event(self, stream: int | None = None) -> Any:
        with self._cupy.cuda.Device(self.index):
            event = self._cupy.cuda.Event(block=False, disable_timing=True)
            self._cupy.cuda.runtime.eventRecord(event.ptr, self._stream(stream))
        return event

    def record(self, event: Any, stream: int | None = None) -> None:
        with self._cupy.cuda.Device(self.index):
            self._cupy.cuda.runtime.eventRecord(event, self._stream(stream))

    def wait_event(self, event: Any, stream: int | None = None) -> None:
        ptr = event if isinstance(event, int) else event.ptr
        with self._cupy.cuda.Device(self.index):
            self._cupy.cuda.runtime.streamWaitEvent(self._stream(stream), ptr, 0)

    def copy_to_host(self, ptr: int, out: np.ndarray) -> None:
        with self._cupy.cuda.Device(self.index):
            # a batch is complete when it is handed out (the daemon's stream was synchronized)
            self._cupy.cuda.runtime.memcpy(out.ctypes.data, ptr, out.nbytes, 2)  # device to host

    @property
    def stream_handle(self) -> int:
        return int(self.stream.ptr)

    def close(self) -> None:
        rt = self._cupy.cuda.runtime
        with self._cupy.cuda.Device(self.index):
            try:
                self.stream.synchronize()
                for event in self._events:
                    rt.eventDestroy(event)
                for ptr in self._opened:
                    rt.ipcCloseMemHandle(ptr)
            except Exception:  # noqa: BLE001 - the context is going; so are the mappings
                pass
        self._opened, self._events = [], []


def open_link(device: int, infos: list[m.SlotInfo]) -> tuple[Link, list[DeviceArray]]:
    """The link to ``device`` (this process's index) and the session's slots opened."""
    if standin() is not None:
        link: Link = StandinLink()
    else:
        try:
            link = CudaLink(device)
        except ImportError as e:
            raise InvalidArgument(f"Config.device={device} needs CuPy: pip install 'damacy[cuda13]' (or [cuda12]) ({e})") from e
    try:
        return link, link.open(infos)
    except DaemonUnavailable:
        raise
    except Exception as e:
        link.close()
        raise DaemonUnavailable(f"cannot open the daemon's device slots: {type(e).__name__}: {e}") from e

