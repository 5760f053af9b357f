"""A DLPack producer for memory damacy owns: a batch slot on the host or on a GPU.

numpy can export host memory, but not device memory, and not with a release hook that
knows which stream the consumer used. So damacy builds the DLPack structures itself (the
ABI of ``dlpack.h``, versions 0.8 and 1.x), with a deleter that calls ``release()`` once the
consumer (torch, CuPy, numpy, JAX) lets the tensor go, or once an unconsumed capsule is
collected. Host and device batches go through the same code; only the device field differs.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import numpy as np

from damacy_runtime.extensions import optional

KDL_CPU, KDL_CUDA, KDL_CUDA_HOST = 1, 2, 3
KDL_INT, KDL_UINT, KDL_FLOAT, KDL_BFLOAT, KDL_COMPLEX, KDL_BOOL = 0, 1, 2, 4, 5, 6
VERSION = (1, 0)


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", _Deleter),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


_NAMES = {False: b"dltensor", True: b"dltensor_versioned"}  # kept alive: capsules point at them

# private prototypes: ctypes.pythonapi's function objects are shared, and other code sets
# their argtypes as it needs
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(("PyCapsule_New", ctypes.pythonapi))
# the destructor gets the raw object (it runs during the capsule's dealloc)
_capsule_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)(("PyCapsule_GetName", ctypes.pythonapi))
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(("PyCapsule_GetPointer", ctypes.pythonapi))

_live: dict[int, tuple] = {}  # address of a managed tensor -> what it keeps alive, its release
# re-entrant: a garbage collection may run a capsule's deleter (here, on this thread) while
# an export holds the lock
_lock = threading.RLock()


def _delete(address: int | None) -> None:
    """The managed tensor's deleter: the consumer is done with it (or never took it)."""
    with _lock:
        entry = _live.pop(address or 0, None)
    if entry is not None:
        entry[-1]()


# the C deleter and capsule destructor (see _dlpack.c); None: built without a C compiler, and
# ctypes callbacks stand in (which a consumer failing with an error pending, or freeing
# without the GIL, upsets)
_dlpack = optional("damacy_runtime._dlpack")

if _dlpack is not None:
    _dlpack.set_release(_delete)
    _deleter_address, _destructor_address = _dlpack.addresses()
    _deleter = _Deleter(_deleter_address)
else:

    @ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    def _capsule_destructor(capsule: int) -> None:
        # A consumer renames the capsule ("used_dltensor") and calls the deleter itself; a
        # capsule still under its own name was never consumed, so its tensor goes here.
        name = _capsule_name(capsule)
        if name in (_NAMES[False], _NAMES[True]):
            _delete(_capsule_pointer(capsule, name))

    _deleter = _Deleter(_delete)
    _destructor_address = ctypes.cast(_capsule_destructor, ctypes.c_void_p).value


def dtype_of(dtype: np.dtype) -> tuple[int, int]:
    """(DLPack type code, bits) of a numpy dtype (bfloat16 as ml_dtypes spells it)."""
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        return KDL_BFLOAT, 16
    code = {"b": KDL_BOOL, "i": KDL_INT, "u": KDL_UINT, "f": KDL_FLOAT, "c": KDL_COMPLEX}.get(dtype.kind)
    if code is None or not dtype.isnative:
        raise BufferError(f"DLPack cannot describe {dtype}")
    return code, 8 * dtype.itemsize


def export(
    ptr: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: np.dtype,
    device: tuple[int, int],
    release: Callable[[], None],
    versioned: bool,
    read_only: bool = False,
) -> object:
    """A DLPack capsule for ``shape`` elements of ``dtype`` at ``ptr`` (``strides`` in
    elements) on ``device`` = (device type, id). ``release()`` runs exactly once, when the
    consumer deletes the tensor or the capsule is collected unconsumed; until then the memory
    must stay valid. ``versioned``: a DLPack 1.x ``DLManagedTensorVersioned``."""
    code, bits = dtype_of(dtype)
    ndim = len(shape)
    c_shape = (ctypes.c_int64 * max(ndim, 1))(*shape)
    c_strides = (ctypes.c_int64 * max(ndim, 1))(*strides)
    managed = DLManagedTensorVersioned() if versioned else DLManagedTensor()
    t = managed.dl_tensor
    t.data = ptr
    t.device = DLDevice(*device)
    t.ndim = ndim
    t.dtype = DLDataType(code, bits, 1)
    t.shape = ctypes.cast(c_shape, ctypes.POINTER(ctypes.c_int64))
    t.strides = ctypes.cast(c_strides, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = 0
    managed.deleter = _deleter
    if versioned:
        managed.version = DLPackVersion(*VERSION)
        managed.flags = 1 if read_only else 0  # DLPACK_FLAG_BITMASK_READ_ONLY
    address = ctypes.addressof(managed)
    managed.manager_ctx = address
    entry = (managed, c_shape, c_strides, release)  # made before the lock (an allocation may collect)
    with _lock:
        _live[address] = entry
    try:
        return _capsule_new(address, _NAMES[versioned], _destructor_address)
    except BaseException:
        _delete(address)
        raise


def outstanding() -> int:
    """Tensors exported and not yet deleted (for tests and leak checks)."""
    with _lock:
        return len(_live)
