"""Helpers for the contract tests (test_contract_*.py): arrays written by zarr-python,
CPU pipelines composed from the documented components, and the documented numeric
conversion rules (contract §14) written out independently of damacy.

Every damacy name is looked up when a helper runs, never at import.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import zarr
from zarr.codecs import BloscCodec, ZstdCodec

import damacy

#: output dtype short name -> numpy dtype of the batch (bf16 through ml_dtypes)
OUT_NAMES = ["f32", "bf16", "u8", "u16", "u32", "u64", "i8", "i16", "i32", "i64"]
OUT_BYTES = {"f32": 4, "bf16": 2, "u8": 1, "u16": 2, "u32": 4, "u64": 8, "i8": 1, "i16": 2, "i32": 4, "i64": 8}


def out_numpy_dtype(name: str) -> np.dtype:
    if name == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"f32": "float32", "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64"}[name])


def compressors_for(codec):
    if codec == "zstd":
        return [ZstdCodec(level=1)]
    if codec == "blosc":
        return [BloscCodec(cname="zstd", clevel=1, shuffle="shuffle")]
    return None


def write(path, data, *, chunks, shards=None, codec="zstd", fill_value=None, dimension_names=None) -> zarr.Array:
    """Write ``data`` as a little-endian Zarr v3 array with zarr-python; returns the array."""
    data = np.asarray(data)
    kwargs = {}
    if fill_value is not None:
        kwargs["fill_value"] = fill_value
    if dimension_names is not None:
        kwargs["dimension_names"] = dimension_names
    arr = zarr.create_array(
        str(path), shape=data.shape, dtype=data.dtype, chunks=chunks, shards=shards, compressors=compressors_for(codec), **kwargs
    )
    arr[...] = data
    return arr


def ramp(shape, dtype="int16", start=0) -> np.ndarray:
    """Distinct values, so that a misplaced voxel shows."""
    n = int(np.prod(shape))
    return (np.arange(start, start + n) % 30000).astype(dtype).reshape(shape)


def metadata_provider(*, reader=None, cache=None):
    return damacy.ZarrMetadata(reader=reader or damacy.FileMetadataReader(concurrency=4), cache=cache or damacy.MetadataCache())


def planner(*, reader=None, cache=None, limits=None):
    return damacy.ChunkPlanner(metadata=metadata_provider(reader=reader, cache=cache), limits=limits or damacy.PlanLimits())


def cpu_limits(**changes):
    kw = {"max_memory_bytes": 64 << 20, "decode_workers": 2, "chunks_per_input_buffer": 2}
    kw.update(changes)
    return damacy.CpuLimits(**kw)


def executor(*, file_reader=None, limits=None):
    return damacy.CpuExecutor(reader=file_reader or damacy.FileReader(workers=2), limits=limits or cpu_limits())


def pipeline(shape, *, samples=2, dtype="f32", lookahead=4, prepared=2, pop_timeout_s=20.0, planner_=None, executor_=None, **parts):
    """A CPU pipeline composed the documented way. ``parts``: plan_limits, cpu_limits, cache,
    metadata_reader, file_reader (used where ``planner_`` / ``executor_`` are not given)."""
    p = planner_ or planner(reader=parts.get("metadata_reader"), cache=parts.get("cache"), limits=parts.get("plan_limits"))
    e = executor_ or executor(file_reader=parts.get("file_reader"), limits=parts.get("cpu_limits"))
    return damacy.Pipeline(
        planner=p,
        executor=e,
        output=damacy.BatchSpec(samples=samples, shape=tuple(shape), dtype=dtype),
        queues=damacy.QueueLimits(lookahead_samples=lookahead, prepared_batches=prepared),
        pop_timeout_s=pop_timeout_s,
    )


def box(arr, aabb) -> np.ndarray:
    """zarr-python's read of an in-bounds box."""
    return arr[tuple(slice(a, b) for a, b in aabb)]


# ---- §14 conversion rules, written out --------------------------------------------------


def _int_to_f32(v: int) -> float:
    """Round an integer to the nearest float32, ties to even (exact integer arithmetic)."""
    a = abs(v)
    if a.bit_length() <= 24:
        return float(v)
    shift = a.bit_length() - 24
    q, r = divmod(a, 1 << shift)
    half = 1 << (shift - 1)
    if r > half or (r == half and q & 1):
        q += 1
    return math.copysign(float(q << shift), v)


def to_f32(values: np.ndarray) -> np.ndarray:
    values = np.asarray(values)
    if values.dtype.kind in "iu":
        return np.array([_int_to_f32(int(v)) for v in values.reshape(-1).tolist()], dtype=np.float32).reshape(values.shape)
    return values.astype(np.float32)  # float16 -> float32 is exact; float32 is kept


def convert(values, out: str) -> np.ndarray:
    """What the contract says a source value becomes in output type ``out``."""
    values = np.asarray(values)
    if out == "f32":
        return to_f32(values)
    if out == "bf16":
        return to_f32(values).astype(out_numpy_dtype("bf16"))  # ml_dtypes rounds ties to even
    dst = out_numpy_dtype(out)
    lo, hi = int(np.iinfo(dst).min), int(np.iinfo(dst).max)
    result = []
    for v in (values.reshape(-1).tolist() if values.dtype.kind in "iu" else values.astype(np.float64).reshape(-1).tolist()):
        if isinstance(v, float):
            if math.isnan(v):
                v = 0
            elif math.isinf(v):
                v = hi if v > 0 else lo
            else:
                v = math.trunc(v)
        result.append(min(max(int(v), lo), hi))
    return np.array(result, dtype=dst).reshape(values.shape)


def batch_values(batch, out: str) -> np.ndarray:
    """A copy of a CPU batch's values: NumPy through DLPack, bf16 through torch."""
    if out == "bf16":
        torch = pytest.importorskip("torch")
        t = torch.from_dlpack(batch)
        assert t.dtype == torch.bfloat16
        bits = t.view(torch.int16).numpy().copy()
        del t
        return bits.view(out_numpy_dtype("bf16"))
    view = np.from_dlpack(batch)
    values = view.copy()
    del view
    return values


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    if got.dtype.kind == "f" or got.dtype.name == "bfloat16":
        np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))  # NaN == NaN
    else:
        np.testing.assert_array_equal(got, want)


def expected_batch(parts, out: str) -> np.ndarray:
    """Stack of converted zarr-python reads: ``parts`` is a list of numpy arrays."""
    return np.stack([convert(p, out) for p in parts])


def gpu_available() -> bool:
    """True where ``damacy._native.cuda_init_primary()`` makes a CUDA context current."""
    try:
        import damacy._native as native

        native.cuda_init_primary()
    except Exception:  # RuntimeError: no GPU (or no native module at all)
        return False
    return True


def require_gpu():
    if not gpu_available():
        pytest.skip("needs a CUDA GPU (damacy._native.cuda_init_primary() failed)")
