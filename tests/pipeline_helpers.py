"""Helpers for pipeline tests: expected batches from zarr-python reads."""

from __future__ import annotations

import numpy as np

from damacy_protocol.dtypes import numpy_dtype
from damacy_server.decode.contract import convert

#: damacy's own policies, where a test exercises them (the defaults are the seed API's: a bad
#: sample stops the pipeline, boxes outside the array are refused, only whole batches)
DAMACY_OWN = {"on_error": "raise", "out_of_bounds": "pad", "drop_last": False}


def expected_box(oracle, aabb, out_dtype) -> np.ndarray:
    """What a padded box of a zarr-python array holds (fill value outside the array),
    converted under damacy's numeric contract (numpy's casts where numpy defines them;
    tested on its own in test_cuda_kernels.py)."""
    shape = tuple(b - a for a, b in aabb)
    out = np.full(shape, convert(np.asarray(oracle.fill_value, dtype=oracle.dtype), out_dtype), dtype=out_dtype)
    src, dst = [], []
    for (a, b), n in zip(aabb, oracle.shape):
        lo, hi = max(a, 0), min(b, n)
        if lo >= hi:
            return out
        src.append(slice(lo, hi))
        dst.append(slice(lo - a, hi - a))
    out[tuple(dst)] = convert(oracle[tuple(src)], out_dtype)
    return out


def out_dtype(name: str, native=None) -> np.dtype:
    return numpy_dtype(name, native)


def same(got: np.ndarray, want: np.ndarray) -> bool:
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.dtype.kind == "f" or got.dtype.name == "bfloat16":
        return bool(np.array_equal(got.astype("f8"), want.astype("f8"), equal_nan=True))
    return bool(np.array_equal(got, want))
