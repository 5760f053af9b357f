"""Helpers for pipeline tests: expected batches from zarr-python reads."""

from __future__ import annotations

from typing import Any

import numpy as np

from damacy_protocol.config import Config
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


# -- a pipeline composed from a Config's values with parts of a test's own ------------------
# (a Config and components together are refused: tests that gave ``damacy.Pipeline(cfg,
# executor=...)`` an executor with other limits compose the pipeline the documented way,
# with the Config's settings for every part they do not give)


def planner_for(cfg: Config, *, reader: Any = None, remote: Any = None) -> Any:
    """The planner a Config pipeline makes (``reader``: a FileMetadataReader of the test's;
    ``remote``: object-store options)."""
    import damacy

    reader = reader if reader is not None else damacy.FileMetadataReader(concurrency=cfg.metadata_io_concurrency)
    metadata = damacy.ZarrMetadata(reader=reader, cache=cfg.metadata_cache, remote=remote)
    return damacy.ChunkPlanner(metadata=metadata, limits=cfg.plan_limits)


def cpu_executor_for(cfg: Config, **limits: Any) -> Any:
    """The CPU executor a Config pipeline makes, with ``limits`` (CpuLimits fields) changed."""
    import dataclasses

    import damacy

    return damacy.CpuExecutor(reader=damacy.FileReader(workers=cfg.n_io_threads), limits=dataclasses.replace(cfg.cpu_limits, **limits))


def composed(cfg: Config, *, executor: Any = None, planner: Any = None) -> Any:
    """``damacy.Pipeline(cfg)`` with ``executor`` and/or ``planner`` in place of its own (its
    policies, queues and pop timeout the Config's)."""
    import damacy

    return damacy.Pipeline(
        planner=planner if planner is not None else planner_for(cfg),
        executor=executor if executor is not None else cpu_executor_for(cfg),
        output=cfg.output,
        queues=cfg.queues,
        pop_timeout_s=cfg.pop_timeout_s,
        on_error=cfg.on_error,
        out_of_bounds=cfg.out_of_bounds,
        drop_last=cfg.drop_last,
    )


def waiting_in_pop(thread_id: int) -> bool:
    """Whether that thread waits inside a pipeline's pop."""
    import sys

    names, f = [], sys._current_frames().get(thread_id)
    while f is not None:
        names.append(f.f_code.co_name)
        f = f.f_back
    return "pop" in names and "wait" in names
