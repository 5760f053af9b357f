"""A batch handed to training code: a view of one output slot, shared through DLPack.

The slot stays occupied while anything still refers to it: the :class:`Batch` until it is
released (or collected), and every array exported from it — ``batch.numpy()``,
``np.from_dlpack(batch)``, ``torch.from_dlpack(batch)`` — until that array is dropped. Only
then does the pipeline fill the slot again, so no live tensor is ever overwritten.

A batch in device memory (``Config(device=k)``) is exported with CUDA stream semantics: the
consumer's stream waits for the batch's ``ready`` event (no host wait), and when a tensor
exported from it is deleted, an event recorded on its stream fences the slot, so the
executor writes the slot again only after the consumer's queued work has read it (see
:mod:`damacy_runtime.device`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from damacy_protocol.enums import DeviceType, Dtype
from damacy_protocol.errors import DamacyError, InvalidArgument
from damacy_protocol.samples import Padding
from damacy_runtime import dlpack
from damacy_runtime.device import LEGACY_DEFAULT_STREAM, DeviceArray, ExternalEvent, StreamOrder


class Slot:
    """Memory for one batch, with a count of who still uses it; ``on_free(slot)`` runs when the
    count drops to zero."""

    def __init__(self, array: np.ndarray, on_free: Callable[[Slot], None], index: int = 0) -> None:
        self.array = array
        self.index = index
        self._on_free = on_free
        self._users = 0
        # reentrant: a lease collected (and released) while this thread holds the lock
        self._lock = threading.RLock()
        self._address: int | None = None

    @property
    def address(self) -> int:
        """The address of the slot's first byte (a slot in host memory; found once: a batch
        in it starts there)."""
        if self._address is None:
            self._address = int(self.array.__array_interface__["data"][0])
        return self._address

    def acquire(self) -> None:
        with self._lock:
            self._users += 1

    def try_acquire(self) -> bool:
        """Take one more use, unless the slot has no user left (it is free, maybe refilled)."""
        with self._lock:
            if self._users <= 0:
                return False
            self._users += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            free = self._users == 0
        if free:
            self._on_free(self)

    @property
    def users(self) -> int:
        return self._users


class _Lease:
    """The base object of an exported array: holds the slot until the array is gone."""

    def __init__(self, slot: Slot, view: np.ndarray) -> None:
        if not slot.try_acquire():
            raise BufferError("the batch was released; its slot may hold another batch now")
        self._slot: Slot | None = slot
        self._view = view
        self.__array_interface__ = view.__array_interface__

    def __del__(self) -> None:
        slot, self._slot = self._slot, None
        if slot is not None:
            slot.release()


@dataclass(frozen=True, slots=True)
class BatchInfo:
    """What a batch is and where: ``device_ptr`` (also ``data``: the address of its first
    element, in GPU memory when ``device_type`` is CUDA), ``shape`` (samples first),
    ``dtype`` (a :class:`~damacy_protocol.enums.Dtype`, or damacy's name of a dtype beyond
    them), ``ready_stream`` (the CUDA stream a GPU batch was assembled on, which a consumer
    bypassing DLPack must wait on; 0 for a host batch, ready when ``pop`` returns),
    ``batch_id`` (0, 1, ... in push order), ``device_type`` and ``device_id``.

    damacy's: ``samples`` (``padding``: the positions of those a sampler added only to even
    out the ranks), ``errors``: (index in the batch, error) of samples filled instead of
    read (``on_error="fill"``), ``skipped``: (sample, error) of samples dropped and replaced
    while it was assembled (``on_error="skip"``), and ``device`` ("cpu" or "cuda:k")."""

    device_ptr: int
    shape: tuple[int, ...]
    dtype: Dtype | str
    ready_stream: int
    batch_id: int
    device_type: DeviceType = DeviceType.CUDA
    device_id: int = 0
    samples: tuple[Any, ...] = field(default=())
    errors: tuple[tuple[int, DamacyError], ...] = field(default=())
    skipped: tuple[tuple[Any, DamacyError], ...] = field(default=())
    device: str = "cuda:0"

    @property
    def data(self) -> int:
        """The address of the batch's first element (``device_ptr``), on either device."""
        return self.device_ptr

    @property
    def padding(self) -> tuple[int, ...]:
        """Positions in the batch of :class:`~damacy_protocol.samples.Padding` samples
        (repeated only so that every rank takes the same number of steps): drop them."""
        return tuple(i for i, s in enumerate(self.samples) if isinstance(s, Padding))


class Batch:
    """One ready batch. Use it as a context manager (or call :meth:`release`) so its slot is
    refilled as soon as training is done with it::

        with pipe.pop() as batch:
            x = torch.from_dlpack(batch)     # zero-copy; bf16 arrives as torch.bfloat16
            y = batch.numpy()                 # a numpy view (bf16 via ml_dtypes; host batches)
    """

    __slots__ = ("on_release", "_lock", "_slot", "_dtype", "_array", "_device", "_info")

    def __init__(self, slot: Slot, info: BatchInfo, numpy_dtype: np.dtype, array: Any = None) -> None:
        slot.acquire()
        self.on_release: Callable[[], None] | None = None  # the front end's, once released
        self._lock = threading.Lock()
        self._slot: Slot | None = slot
        self._dtype = np.dtype(numpy_dtype)
        full = slot.array if array is None else array  # the slot as (samples, *sample shape)
        shaped = full[: info.shape[0]].reshape(info.shape)
        self._array: Any = shaped  # a numpy array, or a DeviceArray in a GPU's memory
        device: StreamOrder | None = None
        if isinstance(shaped, DeviceArray):
            device = shaped.device
        self._device = device
        if info.device_ptr == 0:  # (its device_type and device_id are the front end's: front.batch_info)
            ptr = shaped.ptr if isinstance(shaped, DeviceArray) else int(shaped.__array_interface__["data"][0])
            info = dataclasses.replace(
                info, device_ptr=ptr, ready_stream=(device.stream_handle or 0) if device is not None else 0
            )
        self._info = info

    @property
    def info(self) -> BatchInfo:
        """What the batch is and where (:class:`BatchInfo`); BufferError once released."""
        if self._slot is None:
            raise BufferError(f"batch {self._info.batch_id} was released")
        return self._info

    # -- access -------------------------------------------------------------------
    def _live(self) -> Slot:
        slot = self._slot
        if slot is None:
            raise BufferError(f"batch {self._info.batch_id} was released; its slot may hold another batch now")
        return slot

    @property
    def on_device(self) -> bool:
        """In GPU memory (not readable as a numpy array)."""
        return self._device is not None and not self._device.host_accessible

    def numpy(self) -> np.ndarray:
        """A numpy view of the batch (no copy) that keeps the slot occupied while it lives
        (host batches; a device batch: :meth:`copy`, or DLPack)."""
        slot = self._live()
        array = self._array
        if array is None:  # released meanwhile, by another thread
            raise BufferError(f"batch {self._info.batch_id} was released; its slot may hold another batch now")
        if isinstance(array, DeviceArray):
            array = array.host_view()
        raw = array.view(np.uint8) if array.ndim else array.reshape(1).view(np.uint8)
        out = np.asarray(_Lease(slot, raw)).view(self._dtype)
        return out.reshape(self._info.shape)

    def copy(self) -> np.ndarray:
        """The batch as a numpy array of its own (a copy, from the device for a device
        batch): for code that keeps what it got (logging, accumulating) without holding the
        slot."""
        if self.on_device:
            slot = self._live()
            slot.acquire()
            try:
                return self._array.to_host().view(self._dtype)
            finally:
                slot.release()
        return np.array(self.numpy(), copy=True)

    def __array__(self, dtype=None, copy=None):
        arr = self.copy() if self.on_device else self.numpy()
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            return arr.astype(dtype)
        return arr.copy() if copy and not self.on_device else arr

    def __dlpack__(self, *, stream: Any = None, max_version: tuple[int, int] | None = None, dl_device: Any = None, copy: bool | None = None):
        """DLPack export (a versioned 1.x capsule when ``max_version`` allows it, 0.x
        otherwise), zero-copy. For a device batch, ``stream`` (DLPack's: None for the legacy
        default stream, -1 for none) is made to wait for the batch's ready event, and is
        fenced when the tensor is let go."""
        if copy:
            raise BufferError("damacy batches are shared, not copied (copy=True is not supported)")
        device = self.__dlpack_device__()
        if dl_device is not None and tuple(dl_device) != device:
            raise BufferError(f"a batch on {device} cannot be exported to device {tuple(dl_device)}")
        slot = self._live()
        array = self._array
        if array is None:
            raise BufferError(f"batch {self._info.batch_id} was released; its slot may hold another batch now")
        consumer = self._consumer_stream(stream)
        if isinstance(array, DeviceArray):
            ptr, strides = array.ptr, tuple(st // array.itemsize for st in array.strides)
        else:
            ptr, strides = int(array.__array_interface__["data"][0]), tuple(st // array.itemsize for st in array.strides)
        dlpack.dtype_of(self._dtype)  # a dtype DLPack cannot describe is refused before the slot is taken
        if not slot.try_acquire():
            raise BufferError("the batch was released; its slot may hold another batch now")
        versioned = max_version is not None and tuple(max_version) >= (1, 0)
        let_go = _fenced_release(slot, self._device, array.sync if consumer is not None else None, consumer)
        return dlpack.export(ptr, self._info.shape, strides, self._dtype, device, let_go, versioned)

    def _consumer_stream(self, stream: Any) -> int | None:
        """The stream a consumer reads on, made to wait for the batch (device batches)."""
        if not self.on_device:
            if stream is not None:
                raise BufferError(f"a CPU batch takes no stream (stream must be None, got {stream!r})")
            return None
        if stream == -1:
            return None  # the consumer orders its own work
        if stream == 0:
            raise BufferError("stream 0 is ambiguous in DLPack: pass 1 (legacy default) or 2 (per-thread default)")
        consumer = LEGACY_DEFAULT_STREAM if stream is None else int(stream)
        sync = self._array.sync
        if sync.ready is not None and self._device is not None:
            self._device.wait_event(sync.ready, consumer)
        return consumer

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device.dlpack_device if self._device is not None else (dlpack.KDL_CPU, 0)

    # -- lifetime -----------------------------------------------------------------
    def release(self, *, event: Any = None) -> None:
        """Give the slot back (once every exported array is gone too); idempotent.

        ``event`` (GPU batches): the work that still reads the batch: a CUDA event (its raw
        handle as an int, a ``torch.cuda.Event``, a ``cupy.cuda.Event``) or a stream, on
        which one is recorded now (``torch.cuda.Stream``, ``cupy.cuda.Stream``); the slot is
        written again only after it, and this returns at once. A CPU batch takes no event
        (InvalidArgument). (Each tensor exported from a GPU batch also fences the slot on
        its stream when it is deleted.)"""
        found = cuda_event(event)
        if found is not None:
            if self._device is None:  # (a GPU pipeline's batch, the host stand-in's too, takes one)
                raise InvalidArgument("a CPU batch is released without an event (event=None)")
            array = self._array
            if isinstance(array, DeviceArray) and array.sync is not None:
                array.sync.add_fence(ExternalEvent(*found))  # (it keeps the event object alive until waited on)
        lock = getattr(self, "_lock", None)
        if lock is None:  # a half-built batch
            return
        with lock:
            slot, self._slot = self._slot, None
            done, self.on_release = self.on_release, None
        if slot is not None:
            self._array = None
            slot.release()
        if done is not None:
            done()

    def __enter__(self) -> Batch:
        self._live()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()

    @property
    def numpy_dtype(self) -> np.dtype:
        return self._dtype

    @property
    def slot_index(self) -> int:
        return self._live().index

    def __len__(self) -> int:
        return self._info.shape[0]

    @property
    def shape(self) -> tuple[int, ...]:
        return self._info.shape

    def __repr__(self) -> str:
        if self._slot is None:
            return "Batch(<released>)"
        i = self._info
        name = i.dtype.name if isinstance(i.dtype, Dtype) else i.dtype
        return f"Batch(batch_id={i.batch_id}, shape={i.shape}, dtype={name})"


def _fenced_release(slot: Slot, device: Any, sync: Any, stream: int | None) -> Callable[[], None]:
    """What an exported tensor's deleter runs: fence the slot on the consumer's stream (a
    device batch), then give up the tensor's use of the slot."""

    # per-thread default streams (2) are each thread's own, and the deleter may run on another
    # thread: fence on the legacy default stream, which waits for every blocking stream's work
    fence_on = 1 if stream == 2 else stream

    def let_go() -> None:
        try:
            if sync is not None:
                sync.add_fence(device.record_event(fence_on))
        finally:  # the slot's use ends even when the fence cannot be recorded
            slot.release()

    return let_go


def cuda_event(event: Any) -> tuple[int, Any] | None:
    """The raw CUevent handle of what ``Batch.release(event=...)`` was given, and the object
    that owns it (destroying that object destroys the event: it is kept until the event is
    waited on): None; an int (owned by the caller); a stream (an object with
    ``record_event()``, as torch's, or a callable ``record()``, as cupy's), on which an event
    is recorded now; a ``torch.cuda.Event`` (``cuda_event``) or a ``cupy.cuda.Event`` (an int
    ``ptr``). TypeError for anything else."""
    if event is None:
        return None
    if isinstance(event, int) and not isinstance(event, bool):
        return event, None
    if hasattr(event, "record_event"):  # a torch stream
        return cuda_event(event.record_event())
    record = getattr(event, "record", None)
    if callable(record) and hasattr(event, "wait_event"):  # a cupy stream: record() gives its event
        return cuda_event(record())
    handle = getattr(event, "cuda_event", None)
    if handle is not None:
        return int(handle), event
    ptr = getattr(event, "ptr", None)
    if isinstance(ptr, int):
        return ptr, event
    raise TypeError(
        f"event must be a CUevent handle (int), a torch.cuda or cupy.cuda Event or Stream; got {type(event).__name__}"
    )
