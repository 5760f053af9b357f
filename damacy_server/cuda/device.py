"""What the CUDA executor asks of a device, and two devices that answer it.

:class:`CupyDevice` is a GPU: memory from CuPy's allocator, the kernels of ``kernels/``
compiled by NVRTC (``cupy.RawModule``), nvCOMP's batched zstd decoder, one stream.
:class:`HostDevice` stands in for it on the CPU: its "device memory" is host memory, its
kernels are the host twin (the same source, run thread by thread), its zstd decoder is
zstandard with nvCOMP's per-chunk statuses. The executor's orchestration (what is read,
checked, staged, decoded, assembled, and which errors reach which samples) is the same code
on both, so the CPU tests run all of it.

Every pointer here is an integer address in the device's memory; kernel arguments are typed
numpy scalars (``np.int64``, ``np.int32``, ``np.uint64`` for pointers).

(Over 400 lines: one job, the device the executor runs on, as one interface with two
implementations that must answer alike: a GPU, and the host stand-in.)
"""

from __future__ import annotations

import ctypes
import os
import weakref
from abc import abstractmethod
from pathlib import Path
from typing import Any

import numpy as np

from damacy_protocol.errors import InvalidArgument
from damacy_runtime.device import DeviceArray, SlotSync, StreamOrder
from damacy_server.cuda import nvcomp

KERNELS = Path(__file__).resolve().parent / "kernels"


class DeviceBuffer:
    """``nbytes`` of device memory at ``ptr``; ``owner`` keeps it alive. A slot's buffer
    knows its uses' order (``sync``, on ``device``): the fences consumers left when they let
    its last batch go are waited for before the memory goes back to the allocator (another
    allocation may be written on the executor's stream while a consumer's kernel still
    reads this one)."""

    __slots__ = ("ptr", "nbytes", "owner", "sync", "device", "__weakref__")  # (slot memory is counted gone by a finalizer)

    def __init__(self, ptr: int, nbytes: int, owner: Any) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.owner = owner
        self.sync: SlotSync | None = None
        self.device: Device | None = None

    def __del__(self) -> None:
        sync, device = self.sync, self.device
        if sync is None or device is None:
            return
        for event in sync.take_fences():
            try:
                device.synchronize_event(event)
            except Exception:  # a finalizer raises nothing; a failed wait leaves the memory as the allocator takes it
                pass


class Device(StreamOrder):
    """The operations the CUDA executor needs, in stream order: each call is queued after
    the previous ones and :meth:`synchronize` waits for all of them. As a
    :class:`~damacy_runtime.device.StreamOrder` it also orders batches' uses of its slots
    with their consumers' streams."""

    name: str

    @abstractmethod
    def alloc(self, nbytes: int) -> DeviceBuffer: ...

    @abstractmethod
    def upload(self, host: np.ndarray, dst: int) -> None:
        """Copy a contiguous host array to ``dst``; ``host`` must live until the next sync."""

    @abstractmethod
    def download(self, src: int, host: np.ndarray) -> None:
        """Copy ``host.nbytes`` from ``src`` into a contiguous host array (after a sync)."""

    @abstractmethod
    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` within the device's memory."""

    @abstractmethod
    def launch(self, kernel: str, grid: int, block: int, args: tuple) -> None:
        """Run ``damacy_<kernel>`` (kernels/*.cuh) on a 1-d grid."""

    @abstractmethod
    def zstd_decompress(
        self, comp_ptrs: int, comp_bytes: int, out_bytes: int, actual_bytes: int, n: int, temp: int, temp_bytes: int,
        out_ptrs: int, statuses: int,
    ) -> None:
        """nvcompBatchedZstdDecompressAsync: every argument a device address (tables of n)."""

    @abstractmethod
    def zstd_temp_bytes(self, n: int, max_chunk_bytes: int, total_bytes: int) -> int: ...

    @abstractmethod
    def lz4_decompress(
        self, comp_ptrs: int, comp_bytes: int, out_bytes: int, actual_bytes: int, n: int, temp: int, temp_bytes: int,
        out_ptrs: int, statuses: int,
    ) -> None:
        """nvcompBatchedLZ4DecompressAsync on raw LZ4 blocks (Blosc's streams), as zstd."""

    @abstractmethod
    def lz4_temp_bytes(self, n: int, max_chunk_bytes: int, total_bytes: int) -> int: ...

    @abstractmethod
    def synchronize(self) -> None: ...

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """A host staging buffer of ``nbytes`` uploads can read asynchronously (page-locked
        on a GPU)."""
        return np.empty(max(nbytes, 1), dtype=np.uint8)

    def output_pointer(self, array: Any) -> int:
        """Where kernels write ``array``: a device array's own address; a host array's
        address once the device may write it (see :class:`CupyDevice`)."""
        if isinstance(array, DeviceArray):
            return array.ptr
        if isinstance(array, np.ndarray):
            return int(array.ctypes.data)
        return int(array.data.ptr)

    def array(self, nbytes: int) -> DeviceArray:
        """``nbytes`` of the device's memory as a byte array (a batch slot)."""
        buf = self.alloc(nbytes)
        buf.sync, buf.device = SlotSync(), self
        return DeviceArray(buf.ptr, (nbytes,), np.uint8, self, buf, sync=buf.sync)

    def synchronize_event(self, event: Any) -> None:
        """Wait on the host until ``event`` has happened (the stand-in's have at once)."""


class HostDevice(Device):
    """The stand-in device: host memory, the kernels' host twin, zstandard (see module)."""

    name = "host"
    dlpack_device = (1, 0)  # kDLCPU: batches in its memory are host arrays
    host_accessible = True

    def __init__(self) -> None:
        from damacy_server.cuda import twin

        self._twin = twin._load()
        self.launches: list[str] = []  # the kernels run, in order (for the tests)
        self.decodes: list[tuple[str, int]] = []  # batched decoder calls: (codec, chunks)

    # every call is done when it returns: events are complete when recorded
    def record_event(self, stream: int | None = None) -> Any:
        return HostEvent(stream)

    def wait_event(self, event: Any, stream: int | None = None) -> None:
        pass

    def copy_to_host(self, ptr: int, out: np.ndarray) -> None:
        ctypes.memmove(out.ctypes.data, ptr, out.nbytes)

    @property
    def stream_handle(self) -> int:
        return 0

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def alloc(self, nbytes: int) -> DeviceBuffer:
        buf = np.zeros(max(nbytes, 1), dtype=np.uint8)
        return DeviceBuffer(buf.ctypes.data, nbytes, buf)

    def upload(self, host: np.ndarray, dst: int) -> None:
        src = np.ascontiguousarray(host)
        ctypes.memmove(dst, src.ctypes.data, src.nbytes)

    def download(self, src: int, host: np.ndarray) -> None:
        ctypes.memmove(host.ctypes.data, src, host.nbytes)

    def launch(self, kernel: str, grid: int, block: int, args: tuple) -> None:
        self.launches.append(kernel)
        fault = getattr(self._twin, f"damacy_twin_{kernel}")(grid, block, *(int(a) for a in args))
        if fault:
            raise RuntimeError(f"kernel {kernel}: an index outside its buffer")

    def zstd_decompress(self, comp_ptrs, comp_bytes, out_bytes, actual_bytes, n, temp, temp_bytes, out_ptrs, statuses) -> None:
        import zstandard

        dctx = zstandard.ZstdDecompressor()

        def decode(frame: bytes, cap: int) -> bytes:
            try:
                return dctx.decompress(frame, max_output_size=cap + 1)
            except zstandard.ZstdError as e:
                status = nvcomp.Status.BAD_CHECKSUM if _only_checksum_differs(dctx, frame, cap) else nvcomp.Status.CANNOT_DECOMPRESS
                raise _Refused(status) from e

        self.decodes.append(("zstd", n))
        self._decompress(decode, comp_ptrs, comp_bytes, out_bytes, actual_bytes, n, out_ptrs, statuses)

    def lz4_decompress(self, comp_ptrs, comp_bytes, out_bytes, actual_bytes, n, temp, temp_bytes, out_ptrs, statuses) -> None:
        import struct

        from numcodecs import lz4

        def decode(block: bytes, cap: int) -> bytes:
            try:  # numcodecs' LZ4 frames are a raw block after its decoded size (4 bytes, little-endian)
                return lz4.decompress(struct.pack("<I", cap) + block)
            except (RuntimeError, ValueError) as e:
                raise _Refused(nvcomp.Status.CANNOT_DECOMPRESS) from e

        self.decodes.append(("lz4", n))
        self._decompress(decode, comp_ptrs, comp_bytes, out_bytes, actual_bytes, n, out_ptrs, statuses)

    @staticmethod
    def _decompress(decode, comp_ptrs, comp_bytes, out_bytes, actual_bytes, n, out_ptrs, statuses) -> None:
        """nvCOMP's batched contract on the host: tables of n device addresses, per chunk a
        status and the bytes it decoded to."""

        def table(addr: int, dtype) -> np.ndarray:
            return np.ctypeslib.as_array(ctypes.cast(addr, ctypes.POINTER(np.ctypeslib.as_ctypes_type(dtype))), (n,))

        src, size, cap = table(comp_ptrs, np.uint64), table(comp_bytes, np.uint64), table(out_bytes, np.uint64)
        dst, got, status = table(out_ptrs, np.uint64), table(actual_bytes, np.uint64), table(statuses, np.int32)
        for k in range(n):
            try:
                out = decode(ctypes.string_at(int(src[k]), int(size[k])), int(cap[k]))
            except _Refused as e:
                got[k], status[k] = 0, e.status
                continue
            if len(out) > int(cap[k]):
                got[k], status[k] = 0, nvcomp.Status.OUTPUT_BUFFER_TOO_SMALL
                continue
            ctypes.memmove(int(dst[k]), out, len(out))
            got[k], status[k] = len(out), nvcomp.Status.SUCCESS

    def zstd_temp_bytes(self, n: int, max_chunk_bytes: int, total_bytes: int) -> int:
        return 0

    def lz4_temp_bytes(self, n: int, max_chunk_bytes: int, total_bytes: int) -> int:
        return 0

    def synchronize(self) -> None:
        pass


def _only_checksum_differs(dctx: Any, frame: bytes, cap: int) -> bool:
    """Whether a zstd frame that failed to decode would decode without its content
    checksum: its data is intact and only the checksum differs (nvCOMP's bad-checksum
    status, as against a frame it cannot decompress). The frame header's descriptor (the
    byte after the magic number) flags the checksum with bit 2; the checksum is the last
    4 bytes."""
    import zstandard

    if len(frame) < 9 or not frame[4] & 0x04:
        return False
    unchecked = frame[:4] + bytes([frame[4] & ~0x04]) + frame[5:-4]
    try:
        dctx.decompress(unchecked, max_output_size=cap + 1)
    except zstandard.ZstdError:
        return False
    return True


class _Refused(Exception):
    """A chunk the stand-in's decoder refused, with nvCOMP's status for it."""

    def __init__(self, status: int) -> None:
        self.status = status


class HostEvent:
    """An event of the stand-in device (complete when recorded): the stream it was
    recorded on."""

    __slots__ = ("stream",)

    def __init__(self, stream: int | None) -> None:
        self.stream = stream


class CupyDevice(Device):
    """A GPU through CuPy: its memory pool, NVRTC for the kernels, nvCOMP for zstd, one
    non-blocking stream per device object."""

    def __init__(self, device: int = 0) -> None:
        import cupy

        if not cupy.cuda.is_available():
            raise RuntimeError("no CUDA device is available")
        self._cupy = cupy
        self.index = device
        self.name = f"cuda:{device}"
        with cupy.cuda.Device(device):
            self.stream = cupy.cuda.Stream(non_blocking=True)
            source = (KERNELS / "kernels.cu").read_text()
            self.module = cupy.RawModule(code=source, options=("-std=c++17", f"-I{KERNELS}"))
        self._functions: dict[str, Any] = {}
        self._registered: dict[int, weakref.finalize] = {}  # host allocations registered, by address
        self.dlpack_device = (2, device)  # kDLCUDA
        self.pci_bus_id = cupy.cuda.Device(device).pci_bus_id  # for its NUMA node (numa_cpus)

    # -- stream order ------------------------------------------------------------------------
    def _stream(self, stream: int | None) -> int:
        return int(self.stream.ptr) if stream is None else int(stream)

    # events through the runtime with raw stream handles (CuPy's ExternalStream is deprecated)
    def record_event(self, stream: int | None = None) -> Any:
        with self._cupy.cuda.Device(self.index):
            event = self._cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)
            self._cupy.cuda.runtime.eventRecord(event.ptr, self._stream(stream))
        return event

    def wait_event(self, event: Any, stream: int | None = None) -> None:
        with self._cupy.cuda.Device(self.index):
            self._cupy.cuda.runtime.streamWaitEvent(self._stream(stream), event.ptr, 0)

    def synchronize_event(self, event: Any) -> None:
        with self._cupy.cuda.Device(self.index):
            self._cupy.cuda.runtime.eventSynchronize(event.ptr)

    def record(self, event: Any, stream: int | None = None) -> None:
        with self._cupy.cuda.Device(self.index):
            self._cupy.cuda.runtime.eventRecord(event.ptr, self._stream(stream))

    # -- slots shared with another process (damacyd's sessions on this GPU) -----------------
    def ipc_slot(self, nbytes: int) -> tuple[int, bytes, Any, Any]:
        """A direct allocation (its IPC handle names offset 0) and its two interprocess
        events: (address, memory handle, ready, free)."""
        rt = self._cupy.cuda.runtime
        with self._cupy.cuda.Device(self.index):
            ptr = rt.malloc(max(nbytes, 1))
            try:
                handle = bytes(rt.ipcGetMemHandle(ptr))
                events = [self._cupy.cuda.Event(block=False, disable_timing=True, interprocess=True) for _ in range(2)]
            except BaseException:
                rt.free(ptr)
                raise
        return ptr, handle, events[0], events[1]

    def ipc_event_handle(self, event: Any) -> bytes:
        return bytes(self._cupy.cuda.runtime.ipcGetEventHandle(event.ptr))

    def ipc_free(self, ptr: int) -> None:
        with self._cupy.cuda.Device(self.index):
            self._cupy.cuda.runtime.free(ptr)

    def copy_to_host(self, ptr: int, out: np.ndarray) -> None:
        with self._cupy.cuda.Device(self.index):
            self.stream.synchronize()
            self._cupy.cuda.runtime.memcpy(out.ctypes.data, ptr, out.nbytes, 2)  # device to host

    @property
    def stream_handle(self) -> int:
        return int(self.stream.ptr)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self._cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, 3, self.stream.ptr)  # device to device

    def alloc(self, nbytes: int) -> DeviceBuffer:
        with self._cupy.cuda.Device(self.index):
            mem = self._cupy.cuda.alloc(max(nbytes, 1))
        return DeviceBuffer(int(mem.ptr), nbytes, mem)

    def upload(self, host: np.ndarray, dst: int) -> None:
        src = np.ascontiguousarray(host)
        self._cupy.cuda.runtime.memcpyAsync(dst, src.ctypes.data, src.nbytes, 1, self.stream.ptr)  # host to device

    def download(self, src: int, host: np.ndarray) -> None:
        self._cupy.cuda.runtime.memcpyAsync(host.ctypes.data, src, host.nbytes, 2, self.stream.ptr)  # device to host

    def launch(self, kernel: str, grid: int, block: int, args: tuple) -> None:
        fn = self._functions.get(kernel)
        if fn is None:
            fn = self._functions[kernel] = self.module.get_function(f"damacy_{kernel}")
        with self._cupy.cuda.Device(self.index):
            fn((grid,), (block,), args, stream=self.stream)

    def zstd_decompress(self, comp_ptrs, comp_bytes, out_bytes, actual_bytes, n, temp, temp_bytes, out_ptrs, statuses) -> None:
        lib = nvcomp.load()
        with self._cupy.cuda.Device(self.index):  # nvCOMP launches in the current device's context
            status = lib.nvcompBatchedZstdDecompressAsync(
                comp_ptrs, comp_bytes, out_bytes, actual_bytes, n, temp, temp_bytes, out_ptrs,
                nvcomp.ZstdDecompressOpts(backend=int(nvcomp.DecompressBackend.DEFAULT)), statuses, self.stream.ptr,
            )
        if status != nvcomp.Status.SUCCESS:
            raise nvcomp.NvcompError("nvcompBatchedZstdDecompressAsync", status)

    def zstd_temp_bytes(self, n: int, max_chunk_bytes: int, total_bytes: int) -> int:
        return nvcomp.zstd_temp_bytes(n, max_chunk_bytes, total_bytes)

    def lz4_decompress(self, comp_ptrs, comp_bytes, out_bytes, actual_bytes, n, temp, temp_bytes, out_ptrs, statuses) -> None:
        lib = nvcomp.load()
        with self._cupy.cuda.Device(self.index):
            status = lib.nvcompBatchedLZ4DecompressAsync(
                comp_ptrs, comp_bytes, out_bytes, actual_bytes, n, temp, temp_bytes, out_ptrs,
                nvcomp.LZ4DecompressOpts(backend=int(nvcomp.DecompressBackend.DEFAULT)), statuses, self.stream.ptr,
            )
        if status != nvcomp.Status.SUCCESS:
            raise nvcomp.NvcompError("nvcompBatchedLZ4DecompressAsync", status)

    def lz4_temp_bytes(self, n: int, max_chunk_bytes: int, total_bytes: int) -> int:
        return nvcomp.lz4_temp_bytes(n, max_chunk_bytes, total_bytes)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def host_buffer(self, nbytes: int) -> np.ndarray:
        mem = self._cupy.cuda.alloc_pinned_memory(max(nbytes, 1))  # from CuPy's pinned pool
        return np.frombuffer(mem, dtype=np.uint8, count=max(nbytes, 1))

    # cudaHostRegisterPortable | cudaHostRegisterMapped; cudaDevAttrCanUseHostPointerForRegisteredMem
    _REGISTER_FLAGS = 1 | 2
    _HOST_POINTER_ATTR = 91

    def output_pointer(self, array: Any) -> int:
        """A host array (a batch slot in host memory) is page-locked and mapped once, by its
        whole allocation, so kernels write the batch straight into it over the bus; on
        64-bit Linux with unified addressing its host address is its device address."""
        if not isinstance(array, np.ndarray):
            return super().output_pointer(array)  # a device slot's, or a CuPy array's
        base = array
        while isinstance(base.base, np.ndarray):
            base = base.base
        start = int(base.ctypes.data)
        if start not in self._registered:
            rt = self._cupy.cuda.runtime
            if not rt.deviceGetAttribute(self._HOST_POINTER_ATTR, self.index):
                raise RuntimeError(f"{self.name} cannot use host pointers of registered memory")
            try:
                with self._cupy.cuda.Device(self.index):  # not a context on whichever device is current
                    rt.hostRegister(start, base.nbytes, self._REGISTER_FLAGS)
            except rt.CUDARuntimeError as e:
                if e.status != 712:  # cudaErrorHostMemoryAlreadyRegistered: pinned as a host slot, same flags
                    raise
            else:
                self._registered[start] = weakref.finalize(base, self._unregister, start)  # before its memory goes
        return int(array.ctypes.data)

    def _unregister(self, start: int) -> None:
        self._registered.pop(start, None)
        try:
            self._cupy.cuda.runtime.hostUnregister(start)
        except Exception:  # noqa: BLE001 - the context is gone at exit; so is the registration
            pass


# -- binding a GPU pipeline to a device -----------------------------------------------------------

def bind_device(device: int | None, what: str = "CudaExecutor") -> int:
    """The CUDA device a GPU pipeline uses: ``device`` itself (which must exist here), or with
    ``None`` that of the CUDA context current in the calling thread (InvalidArgument when
    there is none, or when ``device`` and the current context disagree)."""
    from damacy_runtime.devices import check_device, cuda_devices, current_device

    count, why = cuda_devices()
    if count == 0:
        raise InvalidArgument(f"{what}: no CUDA device is available ({why}); use CpuExecutor for host memory")
    current = current_device()
    if device is None:
        if current is None:
            raise InvalidArgument(
                "no CUcontext is current: pass device=k (Config(device=k)), or make a context current first "
                "(torch.cuda.set_device(k) and any CUDA call, or damacy._native.cuda_init_primary())"
            )
        return current
    check_device(device, f"{what} device")
    if current is not None and current != device:
        raise InvalidArgument(
            f"device={device} (Config.device, or CudaExecutor(device=)) but the CUDA context current on this "
            f"thread is on device {current}: "
            f"make them agree (torch.cuda.set_device({device}))"
        )
    return device


def open_backend(index: int) -> Device:
    """The device object of CUDA device ``index`` (the host stand-in under
    DAMACY_DEVICE_STANDIN); InvalidArgument when CuPy or nvCOMP are missing."""
    from damacy_runtime.devices import standin

    if standin() is not None:
        return HostDevice()
    try:
        return CupyDevice(index)
    except ImportError as e:
        raise InvalidArgument(f"CUDA device {index} needs CuPy and nvCOMP: pip install 'damacy[cuda13]' (or [cuda12]) ({e})") from e


def numa_cpus(strategy: int, node: int, backend: Device) -> set[int] | None:
    """The CPUs a GPU pipeline's host threads run on: those of NUMA node ``node``
    (``PIN_TO``), of the GPU's node (``AUTO``; None on a one-node host, or where the GPU's
    node is unknown: the stand-in), or None (``DISABLED``: wherever the scheduler puts them)."""
    from damacy_protocol.enums import NumaStrategy

    strategy = NumaStrategy(strategy)
    if strategy is NumaStrategy.DISABLED:
        return None
    nodes = sorted(int(n[4:]) for n in _listdir("/sys/devices/system/node") if n.startswith("node") and n[4:].isdigit())
    if not nodes:
        return None  # no NUMA topology to read (a container without it): nothing to pin, as without libnuma
    if strategy is NumaStrategy.AUTO:
        if len(nodes) <= 1:
            return None
        pci = getattr(backend, "pci_bus_id", None)
        node = _read_int(f"/sys/bus/pci/devices/{pci.lower()}/numa_node") if pci else None
        if node is None or node < 0:
            return None
    if node not in nodes:
        if strategy is NumaStrategy.PIN_TO:
            raise InvalidArgument(f"numa_node={node}: this machine has NUMA node(s) {nodes}")
        return None
    cpus = _cpulist(f"/sys/devices/system/node/node{node}/cpulist")
    return cpus or None


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _cpulist(path: str) -> set[int]:
    """The CPUs a sysfs cpulist names (``0-3,8``)."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return set()
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out
