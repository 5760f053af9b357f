"""The CUDA kernels' host twin, called from Python: the kernel source compiled as C
(``_twin.c``) and launched block by block, thread by thread, on numpy arrays.

What the twin computes is what the GPU computes (same source, explicit conversions, each
output element written by one thread); the tests compare it bit for bit with the numpy
reference and the CPU paths. A launch whose bounds checks fail raises :class:`TwinFault`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from damacy_server.decode import contract

#: dtype codes of the kernels (convert.cuh: DT_BOOL ... DT_BF16), by numpy dtype
CODES: dict[np.dtype, int] = {
    np.dtype(t): k
    for k, t in enumerate(["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64"])
}
CODES[contract.BF16] = 12  # the CUDA path converts to bf16: ml_dtypes is imported with it

SHUFFLE_MODES = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}
BLOCK = 128  # threads per block the twin runs (any count gives the same result)


class TwinFault(RuntimeError):
    """A kernel's bounds check failed in the twin: an index outside its buffer."""


_lib: ctypes.CDLL | None = None


def available() -> bool:
    try:
        _load()
    except (ImportError, OSError):
        return False
    return True


def _load() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        from damacy_server.cuda import _twin

        lib = ctypes.CDLL(_twin.__file__)
        p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.damacy_twin_assemble.argtypes = [i64, i64, p, i64, i, p, i64, p, i64, p, i, i, p, i64, p, p, i, p]
        lib.damacy_twin_fill.argtypes = [i64, i64, p, i64, p, i, i, p, i64, i64, i, p]
        lib.damacy_twin_convert.argtypes = [i64, i64, p, i, i, p, i, i64]
        lib.damacy_twin_unshuffle.argtypes = [i64, i64, p, p, p, i64, i64, i]
        for f in (lib.damacy_twin_assemble, lib.damacy_twin_fill, lib.damacy_twin_convert, lib.damacy_twin_unshuffle):
            f.restype = ctypes.c_int
        _lib = lib
    return _lib


def dtype_code(dtype: np.dtype) -> tuple[int, int]:
    """(dtype code, byte swap) of a numpy dtype."""
    dtype = np.dtype(dtype)
    swap = int(not dtype.isnative and dtype.itemsize > 1)
    return CODES[dtype.newbyteorder("=")], swap


def _addr(a: np.ndarray) -> int:
    return a.ctypes.data


def norm_table(norms: Sequence[tuple[float, float] | None]) -> np.ndarray | None:
    """The kernels' ``norm`` argument: per entry (flag, offset, scale) as f64, None when no
    entry normalises."""
    if not any(n is not None for n in norms):
        return None
    return np.array([(0.0, 0.0, 0.0) if n is None else (1.0, n[0], n[1]) for n in norms], dtype=np.float64)


def _check(fault: int, what: str) -> None:
    if fault:
        raise TwinFault(f"{what}: an index outside its buffer")


def convert(arr: np.ndarray, dtype, grid: int = 3) -> np.ndarray:
    """``arr`` converted element by element by the conversion kernel."""
    src = np.ascontiguousarray(arr)
    out = np.empty(src.shape, dtype=np.dtype(dtype).newbyteorder("="))
    code, swap = dtype_code(src.dtype)
    _check(_load().damacy_twin_convert(grid, BLOCK, _addr(src), code, swap, _addr(out), CODES[out.dtype], src.size), "convert")
    return out


def assemble(
    rows: np.ndarray,
    ndim: int,
    pool: np.ndarray,
    units: Sequence[np.ndarray],
    outputs: Sequence[np.ndarray],
    norms: Sequence[tuple[float, float] | None] = (),
) -> None:
    """Run the assembly kernel: copy-table ``rows`` (unit positions index ``units``, samples
    index ``outputs``) from the decoded ``units`` (one array's: one shape, one dtype) into
    ``outputs`` (one dtype, as many axes as the table, each its own shape and strides),
    normalised per ``norms[sample]`` (offset, scale) where given."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    pool = np.ascontiguousarray(pool, dtype=np.int64)
    units = [np.ascontiguousarray(u) for u in units]
    unit_ptr = np.array([_addr(u) for u in units] or [0], dtype=np.uint64)
    out_ptr = np.array([_addr(o) for o in outputs] or [0], dtype=np.uint64)
    unit_shape = np.array(units[0].shape if units else (1,) * ndim, dtype=np.int64)
    first = outputs[0]
    if any(o.dtype != first.dtype or o.ndim != ndim for o in outputs):
        raise ValueError("the outputs of one launch share their dtype and the table's rank")
    out_shape = np.array([o.shape for o in outputs], dtype=np.int64).reshape(-1)
    out_strides = np.array([[s // o.itemsize for s in o.strides] for o in outputs], dtype=np.int64).reshape(-1)
    src_code, swap = dtype_code(units[0].dtype) if units else (0, 0)
    norm = norm_table(norms)
    fault = _load().damacy_twin_assemble(
        len(rows), BLOCK, _addr(rows), len(rows), ndim, _addr(pool), len(pool), _addr(unit_ptr), len(units),
        _addr(unit_shape), src_code, swap, _addr(out_ptr), len(outputs), _addr(out_shape), _addr(out_strides),
        CODES[first.dtype.newbyteorder("=")], None if norm is None else _addr(norm),
    )
    _check(fault, "assemble")


def fill(samples: Sequence[int], values: np.ndarray, outputs: Sequence[np.ndarray], norms: Sequence = ()) -> None:
    """Run the fill kernel: ``outputs[samples[k]]`` (contiguous) all set to ``values[k]``
    (in the array's dtype) converted to the outputs' dtype, normalised per ``norms[k]``."""
    samples_ = np.array(samples, dtype=np.int64)
    packed = np.zeros((len(samples_), 8), dtype=np.uint8)
    raw = np.ascontiguousarray(values).view(np.uint8).reshape(len(samples_), -1)
    packed[:, : raw.shape[1]] = raw
    out_ptr = np.array([_addr(o) for o in outputs], dtype=np.uint64)
    code, swap = dtype_code(values.dtype)
    first = outputs[0]
    norm = norm_table(norms)
    fault = _load().damacy_twin_fill(
        len(samples_), BLOCK, _addr(samples_), len(samples_), _addr(packed), code, swap, _addr(out_ptr), len(outputs),
        first.size, CODES[first.dtype.newbyteorder("=")], None if norm is None else _addr(norm),
    )
    _check(fault, "fill")


def unshuffle(blocks: Sequence[np.ndarray], typesize: int, shuffle: str) -> list[np.ndarray]:
    """Run the unshuffle kernel on Blosc blocks (uint8 arrays of their decoded streams)."""
    src = [np.ascontiguousarray(b, dtype=np.uint8) for b in blocks]
    dst = [np.empty_like(b) for b in src]
    src_ptr = np.array([_addr(b) for b in src], dtype=np.uint64)
    dst_ptr = np.array([_addr(b) for b in dst], dtype=np.uint64)
    size = np.array([len(b) for b in src], dtype=np.int64)
    fault = _load().damacy_twin_unshuffle(
        len(src), BLOCK, _addr(src_ptr), _addr(dst_ptr), _addr(size), len(src), typesize, SHUFFLE_MODES[shuffle]
    )
    _check(fault, "unshuffle")
    return dst
