"""Which CUDA devices this machine has, asked of the driver itself (``libcuda``) so a Config
naming a GPU is checked where it is made, without loading CuPy; and their UUIDs, by which
damacyd and its clients name a GPU (``CUDA_VISIBLE_DEVICES`` renumbers devices per process).

``DAMACY_DEVICE_STANDIN`` (a test hook, set in both the daemon's and the client's
environment, or an embedded pipeline's) makes this process see one stand-in device, index
0, named :data:`STANDIN_UUID`, whose memory is host memory and whose kernels are the host
twin; its value, other than ``1``, is a file
both sides append the stand-in's stream-order operations to (see
``damacy_server.cuda.ipc``)."""

from __future__ import annotations

import ctypes
import os
import threading
from functools import cache

from damacy_protocol.errors import InvalidArgument

STANDIN_ENV = "DAMACY_DEVICE_STANDIN"
STANDIN_UUID = "GPU-00000000-0000-0000-0000-standin00000"


def standin() -> str | None:
    """The stand-in's setting in this process (None: real devices only)."""
    return os.environ.get(STANDIN_ENV) or None


def cuda_devices() -> tuple[int, str]:
    """(number of CUDA devices, why there are none when there are none)."""
    if standin() is not None:
        return 1, ""
    return _driver_devices()


@cache
def _driver_devices() -> tuple[int, str]:
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


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


def device_uuid(device: int) -> str:
    """The UUID of CUDA device ``device`` as nvidia-smi prints it (``GPU-xxxxxxxx-...``)."""
    check_device(device, "device")
    if standin() is not None:
        return STANDIN_UUID
    lib = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_int(0)
    uuid = _Uuid()
    # _v2 names a MIG instance by its own UUID (the plain symbol gives its parent GPU's)
    get_uuid = getattr(lib, "cuDeviceGetUuid_v2", None) or lib.cuDeviceGetUuid
    if lib.cuDeviceGet(ctypes.byref(handle), device) != 0 or get_uuid(ctypes.byref(uuid), handle) != 0:
        raise InvalidArgument(f"the CUDA driver could not name device {device}")
    h = bytes(uuid.bytes).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def device_index(uuid: str) -> int:
    """This process's index of the CUDA device named ``uuid``."""
    count, why = cuda_devices()
    for k in range(count):
        if device_uuid(k) == uuid:
            return k
    where = f"{count} device(s)" if count else f"no device ({why})"
    raise InvalidArgument(f"no CUDA device {uuid} here: this process sees {where}")


def standin_log(who: str, op: str, event: str, stream: int | None = None) -> None:
    """Append one stream-order operation of the stand-in device to its log (when it has
    one): ``who op event stream``, one line, in one write (atomic between processes)."""
    path = standin()
    if path is None or path == "1":
        return
    line = f"{who} {op} {event} {'-' if stream is None else stream}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


# -- the CUDA context current in a thread (what a Config with no device binds to) ------------

_current = threading.local()  # the stand-in's "current context": the device made current here


def init_primary(device: int = 0) -> None:
    """Make CUDA device ``device``'s primary context current in this thread (what a program
    without a framework does before a GPU pipeline that names no device); RuntimeError when
    there is no CUDA device (the stand-in counts as device 0)."""
    count, why = cuda_devices()
    if count == 0:
        raise RuntimeError(f"no CUDA device to make current: {why}")
    if not 0 <= device < count:
        raise RuntimeError(f"CUDA device {device} does not exist here ({count} device(s))")
    if standin() is not None:
        _current.device = device
        return
    lib = ctypes.CDLL("libcuda.so.1")
    handle, ctx = ctypes.c_int(0), ctypes.c_void_p()
    for call, args in (
        ("cuDeviceGet", (ctypes.byref(handle), device)),
        ("cuDevicePrimaryCtxRetain", (ctypes.byref(ctx), handle)),
    ):
        code = getattr(lib, call)(*args)
        if code != 0:
            raise RuntimeError(f"{call} failed (CUresult {code})")
    code = lib.cuCtxSetCurrent(ctx)
    if code != 0:
        raise RuntimeError(f"cuCtxSetCurrent failed (CUresult {code})")


def current_device() -> int | None:
    """The device of the CUDA context current in this thread (None: none is)."""
    if standin() is not None:
        return getattr(_current, "device", None)
    count, _ = _driver_devices()
    if count == 0:
        return None
    lib = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or not ctx.value:
        return None
    dev = ctypes.c_int(-1)
    if lib.cuCtxGetDevice(ctypes.byref(dev)) != 0:
        return None
    return dev.value


GDS_ENV = "DAMACY_GDS_ENABLE"


def check_gds(enable_gds: bool | None) -> None:
    """GPUDirect Storage was asked for (``True``, or ``None`` with DAMACY_GDS_ENABLE=1):
    damacy reads through host memory only, so that is refused (InvalidArgument)."""
    if enable_gds is True or (enable_gds is None and os.environ.get(GDS_ENV) == "1"):
        raise InvalidArgument(
            "GPUDirect Storage (enable_gds) is not available: damacy reads chunks through host memory; "
            f"pass enable_gds=False (or unset {GDS_ENV})"
        )
