"""Page-locking host batch slots for a GPU (``DAMACY_PIN_HOST_SLOTS=1``), so a copy of a
batch to the GPU (``tensor.to("cuda", non_blocking=True)``) is truly asynchronous.

The process that issues the copy registers the slot's memory with the CUDA runtime it has
already loaded (``cudaHostRegister``, portable and mapped; a runtime not yet loaded is not
loaded for this, so no context is made on a device the process does not use): the embedded
pipeline its host slots, a daemon client its mapping of the daemon's shared-memory slots.
Registration is undone just before the memory goes (a finalizer on the array that owns it).

Opt-in, because an asynchronous copy reads the slot after the call returns: the batch must
be held until the copy is done (released after the step that used the copy, or after
``torch.cuda.current_stream().synchronize()``); a slot released earlier may be refilled
under the copy. Device batches (``Config(device=k)``) are ordered by events instead.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import weakref
from typing import Any

import numpy as np

log = logging.getLogger("damacy")

_RUNTIMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")
_FLAGS = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped: every context, device-addressable


class Pinner:
    """Registers host arrays with a CUDA runtime (``lib``: its ``cudaHostRegister`` and
    ``cudaHostUnregister``, or an object with the same two functions)."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self._warned = False
        self.pinned = 0  # arrays registered and not yet unregistered

    def pin(self, array: np.ndarray) -> bool:
        """Register the whole allocation behind ``array``; unregister it when that goes."""
        base = array
        while isinstance(base.base, np.ndarray):
            base = base.base
        addr, nbytes = int(base.ctypes.data), int(base.nbytes)
        if not nbytes:
            return False
        rc = self._lib.cudaHostRegister(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), ctypes.c_uint(_FLAGS))
        if rc != 0:
            if not self._warned:
                self._warned = True
                log.warning("damacy: could not page-lock a %d-byte batch slot (CUDA error %d); copies to the GPU will be synchronous", nbytes, rc)
            return False
        self.pinned += 1
        weakref.finalize(base, self._unpin, addr)  # runs before the array's memory is freed
        return True

    def _unpin(self, addr: int) -> None:
        self.pinned -= 1
        self._lib.cudaHostUnregister(ctypes.c_void_p(addr))


_lock = threading.Lock()
_pinner: Pinner | None = None
_decided = False


def pinner() -> Pinner | None:
    """This process's pinner, or None (no CUDA device or runtime, or turned off)."""
    global _pinner, _decided
    with _lock:
        if not _decided:
            _decided = True
            _pinner = _load()
        return _pinner


def use(p: Pinner | None) -> None:
    """Replace this process's pinner (None: pin nothing)."""
    global _pinner, _decided
    with _lock:
        _pinner, _decided = p, True


def pin(array: np.ndarray) -> bool:
    """Page-lock ``array``'s memory if this process pins host slots."""
    p = pinner()
    return p.pin(array) if p is not None else False


def _load() -> Pinner | None:
    if os.environ.get("DAMACY_PIN_HOST_SLOTS", "0") != "1":
        return None
    from damacy_runtime.devices import cuda_devices, standin

    if standin() is not None or cuda_devices()[0] == 0:
        return None
    for name in _RUNTIMES:
        try:  # only a runtime the process has loaded (torch or CuPy did): its current device is the user's
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD)
        except OSError:
            continue
        lib.cudaHostRegister.restype = ctypes.c_int
        lib.cudaHostUnregister.restype = ctypes.c_int
        return Pinner(lib)
    return None
