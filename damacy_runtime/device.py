"""Device memory as batches see it: where a device slot lives and how its use is ordered.

A device batch is assembled on the executor's stream and ends with an event (``ready``);
a consumer's stream waits for that event before it reads the batch (no host wait), and when
the consumer lets the batch go an event recorded on the consumer's stream (a *fence*) must
complete before the executor writes the slot again (deferred release). :class:`StreamOrder`
is what that needs of a device; :class:`DeviceArray` is a typed view of device memory with
the little of numpy's array interface the engine and the executors use (slicing along the
first axis, reshape, dtype views).

Streams are integers as DLPack passes them (a ``cudaStream_t`` address; 1 is the legacy
default stream, 2 the per-thread default stream).
"""

from __future__ import annotations

import ctypes
import threading
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

LEGACY_DEFAULT_STREAM = 1


class StreamOrder(ABC):
    """What batches in a device's memory need of it. ``dlpack_device``: (DLPack device type,
    id); ``host_accessible``: its memory is host memory (the CPU stand-in), so batches also
    read as numpy arrays."""

    dlpack_device: tuple[int, int]
    host_accessible: bool = False

    @abstractmethod
    def record_event(self, stream: int | None = None) -> Any:
        """An event recorded now on ``stream`` (None: the device's own stream)."""

    def record(self, event: Any, stream: int | None = None) -> None:
        """Record an existing event (an interprocess one) on ``stream`` (None: the device's own)."""
        raise NotImplementedError(f"{type(self).__name__} records no existing events")

    @abstractmethod
    def wait_event(self, event: Any, stream: int | None = None) -> None:
        """Make ``stream`` (None: the device's own) wait for ``event`` without a host wait."""

    @abstractmethod
    def copy_to_host(self, ptr: int, out: np.ndarray) -> None:
        """Copy ``out.nbytes`` from ``ptr`` into ``out`` once the device's stream has done
        everything queued on it (a host wait)."""

    @property
    @abstractmethod
    def stream_handle(self) -> int:
        """The device's own stream, as an integer (``BatchInfo.ready_stream``)."""


class SlotSync:
    """The events that order one slot's uses: ``ready``, recorded on the executor's stream
    when the batch in the slot was complete, and the fences its next writer must wait for
    (one per consumer stream at each release)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fences: list[Any] = []
        self.ready: Any = None

    def add_fence(self, event: Any) -> None:
        if event is not None:
            with self._lock:
                self._fences.append(event)

    def take_fences(self) -> list[Any]:
        with self._lock:
            events, self._fences = self._fences, []
        return events

    def mark_ready(self, device: StreamOrder) -> None:
        """The batch just written is complete once ``device``'s stream is this far."""
        self.ready = device.record_event()


class ExternalEvent:
    """A CUDA event the caller made (``Batch.release(event=...)``): its raw handle, as
    ``ptr`` (what a device's ``wait_event`` reads), and the object that owns it (a torch or
    cupy event, None for a raw handle), held so the event outlives the wait on it."""

    __slots__ = ("ptr", "owner")

    def __init__(self, handle: int, owner: Any = None) -> None:
        self.ptr = int(handle)
        self.owner = owner


class DeviceArray:
    """``shape`` elements of ``dtype`` at ``ptr`` in ``device``'s memory, ``strides`` in
    bytes; ``owner`` keeps the memory alive and ``sync`` (:class:`SlotSync`) is shared by every
    view of one allocation."""

    __slots__ = ("ptr", "shape", "strides", "dtype", "device", "owner", "sync")

    def __init__(
        self, ptr: int, shape: tuple[int, ...], dtype: Any, device: StreamOrder, owner: Any,
        strides: tuple[int, ...] | None = None, sync: SlotSync | None = None,
    ) -> None:
        self.ptr = int(ptr)
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.strides = tuple(strides) if strides is not None else _c_strides(self.shape, self.dtype.itemsize)
        self.device = device
        self.owner = owner
        self.sync = sync if sync is not None else SlotSync()

    # -- numpy's shape vocabulary ------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def contiguous(self) -> bool:
        return self.strides == _c_strides(self.shape, self.itemsize) or self.size <= 1

    def _derived(self, ptr: int, shape: tuple[int, ...], dtype: Any, strides: tuple[int, ...] | None = None) -> DeviceArray:
        return DeviceArray(ptr, shape, dtype, self.device, self.owner, strides, self.sync)

    def __getitem__(self, key: Any) -> DeviceArray:
        """An integer or a step-1 slice along the first axis (what slots and samples need)."""
        if not self.ndim:
            raise IndexError("a 0-d device array takes no index")
        n = self.shape[0]
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step != 1:
                raise IndexError("device arrays slice with step 1 only")
            stop = max(stop, start)
            return self._derived(self.ptr + start * self.strides[0], (stop - start, *self.shape[1:]), self.dtype, (self.strides[0], *self.strides[1:]))
        if isinstance(key, (int, np.integer)):
            k = int(key) + (n if key < 0 else 0)
            if not 0 <= k < n:
                raise IndexError(f"index {key} is out of bounds for axis 0 with size {n}")
            return self._derived(self.ptr + k * self.strides[0], self.shape[1:], self.dtype, self.strides[1:])
        raise IndexError(f"device arrays take an integer or a slice, not {type(key).__name__}")

    def transpose(self, axes: tuple[int, ...]) -> DeviceArray:
        """The same memory with its axes in the order ``axes`` (as numpy's)."""
        return self._derived(self.ptr, tuple(self.shape[a] for a in axes), self.dtype, tuple(self.strides[a] for a in axes))

    def flip(self, axes: tuple[int, ...]) -> DeviceArray:
        """The same memory read backwards along ``axes`` (negative strides, as ``np.flip``)."""
        if not self.size:
            return self
        ptr = self.ptr + sum((self.shape[a] - 1) * self.strides[a] for a in axes)
        return self._derived(ptr, self.shape, self.dtype, tuple(-st if a in axes else st for a, st in enumerate(self.strides)))

    def expand_dims(self, axes: tuple[int, ...]) -> DeviceArray:
        """The same memory with length-1 axes inserted at ``axes`` (as ``np.expand_dims``)."""
        shape, strides = list(self.shape), list(self.strides)
        for a in sorted(axes):
            shape.insert(a, 1)
            strides.insert(a, 0)
        return self._derived(self.ptr, tuple(shape), self.dtype, tuple(strides))

    def reshape(self, *shape: Any) -> DeviceArray:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = tuple(int(n) for n in shape)
        if -1 in shape:
            known = int(np.prod([n for n in shape if n != -1], dtype=np.int64))
            shape = tuple(self.size // max(known, 1) if n == -1 else n for n in shape)
        if int(np.prod(shape, dtype=np.int64)) != self.size:
            raise ValueError(f"cannot reshape a device array of size {self.size} into shape {shape}")
        if not self.contiguous:
            raise ValueError("only a contiguous device array can be reshaped")
        return self._derived(self.ptr, shape, self.dtype)

    def view(self, dtype: Any) -> DeviceArray:
        dtype = np.dtype(dtype)
        if not self.contiguous:
            raise ValueError("only a contiguous device array can be viewed as another dtype")
        if self.ndim == 0 or (self.shape[-1] * self.itemsize) % dtype.itemsize:
            raise ValueError(f"the last axis of {self.shape} {self.dtype} does not divide into {dtype}")
        shape = (*self.shape[:-1], self.shape[-1] * self.itemsize // dtype.itemsize)
        return self._derived(self.ptr, shape, dtype)

    # -- the host side ----------------------------------------------------------------------
    def host_view(self) -> np.ndarray:
        """The memory as a numpy array, where the device's memory is host memory (the
        caller keeps ``owner`` alive while the array lives)."""
        if not self.device.host_accessible:
            raise BufferError("this batch is in GPU memory: use torch.from_dlpack(batch) or cupy.from_dlpack(batch), or batch.copy()")
        span = self._span()
        if span == 0:
            return np.empty(self.shape, dtype=self.dtype)
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(self.ptr)).view(self.dtype)
        return np.lib.stride_tricks.as_strided(raw, self.shape, self.strides)

    def _span(self) -> int:
        """Bytes from ptr to the end of the last element."""
        if self.size == 0:
            return 0
        return sum((n - 1) * s for n, s in zip(self.shape, self.strides)) + self.itemsize

    def to_host(self) -> np.ndarray:
        """A numpy copy (a host wait for the device's queued work)."""
        if not self.contiguous:
            raise ValueError("only a contiguous device array can be copied to the host")
        out = np.empty(self.shape, dtype=self.dtype)
        if out.nbytes:
            self.device.copy_to_host(self.ptr, out.reshape(-1).view(np.uint8))
        return out

    @property
    def __cuda_array_interface__(self) -> dict:
        if self.device.host_accessible:
            raise AttributeError("host memory has no CUDA array interface")
        if self.dtype.name == "bfloat16":
            raise AttributeError("the CUDA array interface has no bfloat16: use DLPack")
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.ptr, False),
            "strides": None if self.contiguous else self.strides,
            "version": 3,
            "stream": None,  # the batch's DLPack export orders streams; see damacy_runtime.batch
        }

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, ptr={self.ptr:#x})"


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))
