"""A batch handed to training code: a view of one output slot, shared through DLPack.

The slot stays occupied while anything still refers to it: the :class:`Batch` until it is
released (or collected), and every array exported from it — ``batch.numpy()``,
``np.from_dlpack(batch)``, ``torch.from_dlpack(batch)`` — until that array is dropped. Only
then does the pipeline fill the slot again, so no live tensor is ever overwritten.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from damacy_protocol.errors import SampleError

KDL_CPU = 1
KDL_BFLOAT = 4
_VERSIONED_TENSOR_OFFSET = 32  # DLManagedTensorVersioned: version, manager_ctx, deleter, flags
_DTYPE_OFFSET = 20  # DLTensor: data, device, ndim, then dtype

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


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
        self._slot = slot
        self._view = view
        self.__array_interface__ = view.__array_interface__

    def __del__(self) -> None:
        slot, self._slot = self._slot, None
        if slot is not None:
            slot.release()


@dataclass(frozen=True)
class BatchInfo:
    """What a batch holds: ``shape`` (samples first), ``dtype`` (damacy's name), ``device``
    ("cpu" or "cuda:k"), ``batch_id`` (0, 1, ... in push order), ``samples``, ``errors``:
    (index in the batch, error) of samples that were filled instead of read
    (``on_error="fill"``), and ``skipped``: (sample, error) of samples dropped and replaced
    while this batch was assembled (``on_error="skip"``)."""

    shape: tuple[int, ...]
    dtype: str
    device: str
    batch_id: int
    samples: tuple[Any, ...]
    errors: tuple[tuple[int, SampleError], ...] = field(default=())
    skipped: tuple[tuple[Any, SampleError], ...] = field(default=())


class Batch:
    """One ready batch. Use it as a context manager (or call :meth:`release`) so its slot is
    refilled as soon as training is done with it::

        with pipe.pop() as batch:
            x = torch.from_dlpack(batch)     # zero-copy; bf16 arrives as torch.bfloat16
            y = batch.numpy()                 # a numpy view (bf16 via ml_dtypes)
    """

    def __init__(self, slot: Slot, info: BatchInfo, numpy_dtype: np.dtype, array: np.ndarray | None = None) -> None:
        slot.acquire()
        self._lock = threading.Lock()
        self._slot: Slot | None = slot
        self.info = info
        self._dtype = np.dtype(numpy_dtype)
        full = slot.array if array is None else array  # the slot as (samples, *sample shape)
        self._array = full[: info.shape[0]].reshape(info.shape)

    # -- access -------------------------------------------------------------------
    def _live(self) -> Slot:
        slot = self._slot
        if slot is None:
            raise BufferError(f"batch {self.info.batch_id} was released; its slot may hold another batch now")
        return slot

    def numpy(self) -> np.ndarray:
        """A numpy view of the batch (no copy) that keeps the slot occupied while it lives."""
        slot = self._live()
        array = self._array
        if array is None:  # released meanwhile, by another thread
            raise BufferError(f"batch {self.info.batch_id} was released; its slot may hold another batch now")
        raw = array.view(np.uint8) if array.ndim else array.reshape(1).view(np.uint8)
        out = np.asarray(_Lease(slot, raw)).view(self._dtype)
        return out.reshape(self.info.shape)

    def copy(self) -> np.ndarray:
        """The batch as a numpy array of its own (a copy): for code that keeps what it got
        (logging, accumulating) without holding the slot."""
        return np.array(self.numpy(), copy=True)

    def __array__(self, dtype=None, copy=None):
        arr = self.numpy()
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            return arr.astype(dtype)
        return arr.copy() if copy else arr

    def __dlpack__(self, *, stream: Any = None, max_version: tuple[int, int] | None = None, dl_device: Any = None, copy: bool | None = None):
        """DLPack export (a versioned v1 capsule when ``max_version`` allows it, v0 otherwise)."""
        if stream is not None and stream != -1:
            raise BufferError("a host batch takes no stream (stream must be None)")
        if dl_device is not None and tuple(dl_device) != (KDL_CPU, 0):
            raise BufferError(f"a host batch cannot be exported to device {dl_device}")
        if copy:
            raise BufferError("damacy batches are shared, not copied (copy=True is not supported)")
        arr = self.numpy()
        bf16 = arr.dtype.name == "bfloat16"
        if bf16:
            arr = arr.view(np.uint16)
        versioned = max_version is not None and tuple(max_version) >= (1, 0)
        capsule = arr.__dlpack__(max_version=max_version) if versioned else arr.__dlpack__()
        if bf16:
            name = b"dltensor_versioned" if versioned else b"dltensor"
            base = _capsule_pointer(capsule, name)
            tensor = base + (_VERSIONED_TENSOR_OFFSET if versioned else 0)
            ctypes.c_uint8.from_address(tensor + _DTYPE_OFFSET).value = KDL_BFLOAT
        return capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CPU, 0)

    # -- lifetime -----------------------------------------------------------------
    def release(self) -> None:
        """Give the slot back (once every exported array is gone too). Idempotent."""
        lock = getattr(self, "_lock", None)
        if lock is None:  # a half-built batch
            return
        with lock:
            slot, self._slot = self._slot, None
        if slot is not None:
            self._array = None  # type: ignore[assignment]
            slot.release()

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
        return self.info.shape[0]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    def __repr__(self) -> str:
        state = "released" if self._slot is None else "live"
        return f"Batch(id={self.info.batch_id}, shape={self.info.shape}, dtype={self.info.dtype}, {state}, errors={len(self.info.errors)})"
