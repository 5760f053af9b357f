"""Which CUDA devices this machine has, asked of the driver itself (``libcuda``) so a Config
naming a GPU is checked where it is made, without loading CuPy."""

from __future__ import annotations

import ctypes
from functools import cache

from damacy_protocol.errors import InvalidArgument


@cache
def cuda_devices() -> tuple[int, str]:
    """(number of CUDA devices, why there are none when there are none)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0, "no CUDA driver (libcuda.so.1) is installed"
    if lib.cuInit(0) != 0:
        return 0, "the CUDA driver found no usable device"
    count = ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return 0, "the CUDA driver reports no device"
    return count.value, ""


def check_device(device: int, what: str = "Config.device") -> None:
    """InvalidArgument unless CUDA device ``device`` exists here."""
    count, why = cuda_devices()
    if count == 0:
        raise InvalidArgument(f"{what}={device}: no CUDA device is available ({why}); leave it None for host memory")
    if device >= count:
        raise InvalidArgument(f"{what}={device}: this machine has {count} CUDA device(s), numbered from 0")
