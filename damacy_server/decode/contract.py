"""damacy's numeric contract in numpy: the value an element of one dtype becomes in another.

The rule is written down once, in ``damacy_server/cuda/kernels/convert.cuh``; this module is
its numpy reference, used by the CPU executor's numpy path (the native CPU loop leaves the
pairs below to it) and by the tests of the GPU kernels' host twin. Where numpy defines a
result it is numpy's (ml_dtypes' for bf16) and :func:`convert` is ``astype``; it differs
where numpy's result is platform-defined or rounded twice:

- float to integer: truncated toward zero; NaN to 0; out of range (infinities included) to
  the type's minimum or maximum (CUDA's saturating conversions; numpy's is undefined);
- f64, 32- and 64-bit integers to bf16: rounded once to nearest even (ml_dtypes rounds
  through f32, twice).

Intensity normalisation, ``(x - offset) * scale`` fused into the cast (:func:`normalize`),
is defined for float outputs only. It computes in f32 (f64 for an f64 output): ``x``,
``offset`` and ``scale`` are each rounded once to that type (nearest even), the difference
and the product each rounded once (never a fused multiply-add), and the result is stored as
that type's value is (to f16 and bf16 rounded to nearest even). A NaN stays a NaN, its sign
and payload not kept (a GPU's arithmetic makes every NaN its canonical one, the CPU's keeps
them).
"""

from __future__ import annotations

import numpy as np


def __getattr__(name: str) -> np.dtype:
    """``BF16``, ml_dtypes' bfloat16 as a numpy dtype, imported on first use: ml_dtypes takes
    over a second of CPU to import (it registers its types' ufunc loops), which every process
    that reads data would pay, and a bf16 array can only exist once it is imported (the
    checks below go by the dtype's name)."""
    if name == "BF16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_bf16(dtype: np.dtype) -> bool:
    return dtype.name == "bfloat16"


def differs(src: np.dtype, dst: np.dtype) -> bool:
    """Whether the contract differs from numpy's ``astype`` for this pair (either byte order)."""
    src, dst = np.dtype(src).newbyteorder("="), np.dtype(dst).newbyteorder("=")
    if src.kind == "f" and dst.kind in "iu":
        return True
    return _is_bf16(dst) and (src == np.float64 or (src.kind in "iu" and src.itemsize >= 4))


def convert(arr, dtype) -> np.ndarray:
    """``arr`` as ``dtype`` under the contract (a new array, native byte order)."""
    arr = np.asarray(arr)
    dtype = np.dtype(dtype)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    with np.errstate(invalid="ignore", over="ignore"):
        if not differs(arr.dtype, dtype):
            return arr.astype(dtype)
        flat = arr.reshape(-1)
        if dtype.kind in "iu":
            return _saturate(flat, dtype).reshape(arr.shape)
        if flat.dtype.kind in "iu":
            flat = _int_to_f64_odd(flat)
        return _f64_to_f32_odd(flat.astype(np.float64)).astype(dtype).reshape(arr.shape)


def is_float(dtype) -> bool:
    """Whether ``dtype`` is a float type (bf16 included): what normalisation may write."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or _is_bf16(dtype)


def compute_dtype(dtype) -> np.dtype:
    """The type normalisation computes in for an output of ``dtype`` (a float type)."""
    dtype = np.dtype(dtype)
    if not is_float(dtype):
        raise ValueError(f"normalisation writes a float type, not {dtype}")
    return np.dtype(np.float64) if dtype.newbyteorder("=") == np.float64 else np.dtype(np.float32)


def normalize(arr, dtype, offset: float, scale: float) -> np.ndarray:
    """``(arr - offset) * scale`` as ``dtype`` under the contract (a new array, native byte
    order): in :func:`compute_dtype`, each step rounded once."""
    arr = np.asarray(arr)
    ct = compute_dtype(dtype)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    with np.errstate(invalid="ignore", over="ignore"):
        x = arr.astype(ct)
        y = (x - ct.type(offset)) * ct.type(scale)
        return y.astype(np.dtype(dtype).newbyteorder("="))


def _saturate(arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
    a = arr.astype(np.float64)  # exact for f16, f32 and f64
    info = np.iinfo(dtype)
    nan = np.isnan(a)
    low = a <= float(info.min) - 1.0
    high = a >= float(info.max) + 1.0
    if dtype == np.int64:  # float(min) - 1 rounds to min: only values below it saturate
        low = a < float(info.min)
    out = np.trunc(np.where(nan | low | high, 0.0, a)).astype(dtype)
    out[low] = info.min
    out[high] = info.max
    return out


def _f64_to_f32_odd(a: np.ndarray) -> np.ndarray:
    """f64 to f32 rounded to odd (the last bit set when anything was lost): rounding the
    result once more to a format at least two bits narrower is rounding once."""
    f = a.astype(np.float32)  # nearest even; past the range: inf
    back = f.astype(np.float64)
    bits = f.view(np.uint32).copy()
    lost = (back != a) & np.isfinite(a) & np.isfinite(f) & ((bits & 1) == 0)
    toward_plus = back < a
    negative = (bits >> 31).astype(bool)
    step = np.where(toward_plus != negative, np.uint32(1), np.uint32(0xFFFFFFFF))  # +1 or -1
    bits[lost] = bits[lost] + step[lost]
    return bits.view(np.float32)


def _int_to_f64_odd(v: np.ndarray) -> np.ndarray:
    """An integer array as f64 rounded to odd (exact below 2**53)."""
    if v.dtype.itemsize < 8:
        return v.astype(np.float64)
    negative = v < 0 if v.dtype.kind == "i" else np.zeros(v.shape, dtype=bool)
    m = v.astype(np.uint64)
    m = np.where(negative, np.uint64(0) - m, m)  # |v| (2**63 for the minimum)
    d = m.astype(np.float64)
    top = d >= 2.0**64
    back = np.where(top, 0.0, d).astype(np.uint64)
    bits = d.view(np.uint64).copy()
    lost = (top | (back != m)) & ((bits & np.uint64(1)) == 0)
    down = top | (back > m)
    bits[lost & down] -= np.uint64(1)
    bits[lost & ~down] += np.uint64(1)
    d = bits.view(np.float64)
    return np.where(negative, -d, d)


def edge_values(dtype: np.dtype) -> np.ndarray:
    """The values a conversion rule can get wrong, for tests and the hardware check: bounds,
    rounding midpoints, NaN payloads, signed zeros, subnormals, infinities."""
    if dtype == np.bool_:
        return np.array([False, True])
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        vals = {0, 1, info.max, info.min, info.max - 1, info.min + 1, 127, 128, 255, 256, 32767, 32768, 65504, 65519, 65520, 65535, 65536}
        for p in (24, 31, 32, 53, 54, 62, 63):
            for d in (-1, 0, 1, 2**(p - 8) if p > 8 else 1, 2**(p - 9) if p > 9 else 1, 3 * 2**(p - 9) if p > 9 else 3):
                vals.update({2**p + d, -(2**p + d), 2**p - d, -(2**p - d)})
        return np.array(sorted(v for v in vals if info.min <= v <= info.max), dtype=dtype)
    f = np.finfo(dtype)
    vals = [0.0, -0.0, 1.0, -1.0, 0.5, 1.5, 2.5, -2.5, 0.49999997, 127.9, 128.0, 128.5, -128.5, -128.9, -129.0, 255.5, 256.0,
            -1.0, -0.99, 32767.5, 65535.9, 65536.0, 65504.0, 65519.99, 65520.0, 2.0**31, -2.0**31 - 1, 2.0**32, 2.0**63, -2.0**63,
            2.0**64, 1e30, -1e30, 3.3895314e38, 3.3961775e38, 3.4028234e38, float(f.max), float(f.min), float(f.tiny),
            float(f.tiny) / 3, float(f.smallest_subnormal), 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-133, 2.0**-134,
            1 + 2.0**-8, 1 + 2.0**-9, 1 + 2.0**-9 + 2.0**-30, 1 + 3 * 2.0**-9, 1 + 2.0**-11, 1 + 2.0**-12 + 2.0**-40,
            float("inf"), float("-inf")]
    with np.errstate(over="ignore"):
        out = np.array(vals, dtype=np.float64).astype(dtype)
    nbits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize]
    exp_all = {2: 0x7C00, 4: 0x7F800000, 8: 0x7FF0000000000000}[dtype.itemsize]
    mant = {2: 0x3FF, 4: 0x7FFFFF, 8: 0xFFFFFFFFFFFFF}[dtype.itemsize]
    quiet = (mant + 1) >> 1
    sign = {2: 0x8000, 4: 0x80000000, 8: 0x8000000000000000}[dtype.itemsize]
    # quiet, signalling, with payloads, negative
    nans = [exp_all | quiet, exp_all | 1, exp_all | quiet | 5, exp_all | mant, sign | exp_all | quiet, sign | exp_all | 1, exp_all | (mant >> 1)]
    return np.concatenate([out, np.array(nans, dtype=nbits).view(dtype)])
