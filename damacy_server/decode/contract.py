"""damacy's numeric contract in numpy: the value an element of one dtype becomes in another.

The rule is written down once per language: in C in ``damacy_server/cuda/kernels/convert.cuh``
(the GPU kernels, their host twin and the native CPU loop), and here in numpy, the reference
the CPU executor's numpy path runs (for the pairs the native loop leaves to it) and the tests
hold every path to. For the sources and outputs of damacy's API (integers, f16 and f32 into
the integers, f32 and bf16):

- integer to integer: values in range kept; out of range clamped to the type's range
  (negatives to 0 for an unsigned type), never through a float (numpy's ``astype`` wraps);
- float to integer: truncated toward zero, then clamped to the type's range; NaN to 0; +inf
  to the maximum, -inf to the minimum (0 for an unsigned type) (numpy's is undefined);
- integer or f16 to f32: rounded to nearest, ties to even (numpy's);
- to bf16: through f32, rounded as above and then to bf16, ties to even; for 32- and 64-bit
  integers that is two roundings (ml_dtypes' ``astype`` rounds them once, through f64).

damacy reads f64 sources and writes f16, f64 and bool outputs besides; there the result is
numpy's (ml_dtypes' for bf16), but for f64 to an integer (as float to integer above) and f64
to bf16: rounded once to nearest even, not through f32 (ml_dtypes rounds it twice).
:func:`differs` names the pairs where :func:`convert` is not ``astype``.

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
    """Whether the contract differs from numpy's ``astype`` for this pair (either byte order):
    float to integer, integer to a narrower integer range, 32- and 64-bit integers and f64 to
    bf16. A same-range or widening integer pair is a plain ``astype``."""
    src, dst = np.dtype(src).newbyteorder("="), np.dtype(dst).newbyteorder("=")
    if dst.kind in "iu":
        if src.kind == "f":
            return True
        return src.kind in "iu" and _narrows(src, dst)
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
        if dtype.kind in "iu":
            if arr.dtype.kind in "iu":
                return _clamp(arr, dtype)
            return _saturate(arr.reshape(-1), dtype).reshape(arr.shape)
        if arr.dtype.kind in "iu":  # to bf16 through f32: two roundings
            return arr.astype(np.float32).astype(dtype)
        return _f64_to_f32_odd(arr.reshape(-1)).astype(dtype).reshape(arr.shape)  # f64: once


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


def _narrows(src: np.dtype, dst: np.dtype) -> bool:
    """Whether integer type ``src`` holds values outside integer type ``dst``'s range."""
    s, d = np.iinfo(src), np.iinfo(dst)
    return s.min < d.min or s.max > d.max


def _clamp(arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """An integer array clamped to integer ``dtype``'s range, in its own type (both bounds
    are values of it), then cast: no float in between."""
    s, d = np.iinfo(arr.dtype), np.iinfo(dtype)
    lo, hi = arr.dtype.type(max(s.min, d.min)), arr.dtype.type(min(s.max, d.max))
    return np.clip(arr, lo, hi).astype(dtype)


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


def edge_values(dtype: np.dtype) -> np.ndarray:
    """The values a conversion rule can get wrong, for tests and the hardware check: bounds,
    rounding midpoints, NaN payloads, signed zeros, subnormals, infinities."""
    if dtype == np.bool_:
        return np.array([False, True])
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        vals = {0, 1, -1, -2, info.max, info.min, info.max - 1, info.min + 1, 65504, 65519, 65520}
        for b in (7, 8, 15, 16, 31, 32, 63, 64):  # every integer type's bounds and their neighbours
            vals.update({2**b - 1, 2**b, 2**b + 1, -(2**b) - 1, -(2**b), -(2**b) + 1})
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
