"""Contract §6: the injected components (readers, metadata, planner, executors).

All are keyword-only plain classes with ``__slots__``; value checks are Python's
ValueError / TypeError, native construction failures typed DamacyErrors.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import zarr
from contract_helpers import cpu_limits, gpu_available, metadata_provider, require_gpu

import damacy

# ---- FileReader -------------------------------------------------------------------------


def test_file_reader_defaults_construct():
    r = damacy.FileReader()
    assert (r.workers, r.max_inflight_reads, r.readahead) == (8, 4096, True)
    r = damacy.FileReader(workers=1, max_inflight_reads=1, readahead=False)
    assert (r.workers, r.max_inflight_reads, r.readahead) == (1, 1, False)


def test_file_reader_is_keyword_only():
    damacy.FileReader(workers=2)
    with pytest.raises(TypeError):
        damacy.FileReader(2)


@pytest.mark.parametrize("bad", [1, 0, None, "yes"])
def test_file_reader_readahead_must_be_bool_message(bad):
    with pytest.raises(TypeError) as info:
        damacy.FileReader(workers=1, readahead=bad)
    assert str(info.value) == "readahead must be a bool"
    assert not isinstance(info.value, damacy.DamacyError)


@pytest.mark.parametrize("bad", [0, -1, 1 << 20])
def test_file_reader_workers_range(bad):
    with pytest.raises(ValueError, match=r"^workers must be in \[1, \d+\]$"):
        damacy.FileReader(workers=bad)


@pytest.mark.parametrize("bad", [0, 1 << 32])
def test_file_reader_max_inflight_reads_range(bad):
    with pytest.raises(ValueError) as info:
        damacy.FileReader(workers=1, max_inflight_reads=bad)
    assert str(info.value) == "max_inflight_reads must be in [1, 4294967295]"


def test_file_reader_max_inflight_reads_top_accepted():
    assert damacy.FileReader(workers=1, max_inflight_reads=(1 << 32) - 1).max_inflight_reads == (1 << 32) - 1


def test_file_reader_workers_above_online_cpus_are_damacys_to_take(tmp_path):
    """The seed API refuses more I/O threads than online CPUs (InvalidArgument); damacy takes
    them (its I/O threads wait on storage: a listed difference, docs/seed.md) and the
    pipeline reads as any other."""
    workers = (os.cpu_count() or 1) + 1
    if workers > 1024:
        pytest.skip("more online CPUs than MAX_IO_THREADS")
    reader = damacy.FileReader(workers=workers)
    executor = damacy.CpuExecutor(reader=reader, limits=cpu_limits())
    planner = damacy.ChunkPlanner(metadata=metadata_provider())
    data = np.arange(16, dtype=np.uint16)
    zarr.create_array(str(tmp_path / "a"), shape=(16,), chunks=(4,), dtype="uint16")[...] = data
    with damacy.Pipeline(planner=planner, executor=executor, output=damacy.BatchSpec(1, (4,)), queues=damacy.QueueLimits(4)) as p:
        assert p.device == -1
        p.push([damacy.Sample(str(tmp_path / "a"), [(6, 10)])])
        with p.pop() as batch:
            assert np.array_equal(np.from_dlpack(batch)[0], data[6:10].astype(np.float32))


def test_file_reader_has_slots_and_no_extra_attributes():
    r = damacy.FileReader(workers=1)
    assert "__slots__" in damacy.FileReader.__dict__
    with pytest.raises(AttributeError):
        r.extra = 2


# ---- FileMetadataReader -----------------------------------------------------------------


def test_file_metadata_reader_defaults_construct():
    r = damacy.FileMetadataReader()
    assert (r.concurrency, r.latency) == (64, damacy.LatencyModel())  # no added latency
    latency = damacy.LatencyModel(baseline_ns=1)
    r = damacy.FileMetadataReader(concurrency=1, latency=latency)
    assert (r.concurrency, r.latency) == (1, latency)


def test_file_metadata_reader_is_keyword_only():
    damacy.FileMetadataReader(concurrency=4)
    with pytest.raises(TypeError):
        damacy.FileMetadataReader(4)


@pytest.mark.parametrize("bad", [{"baseline_ns": 1}, "fast", 5])
def test_file_metadata_reader_latency_type_message(bad):
    with pytest.raises(TypeError) as info:
        damacy.FileMetadataReader(concurrency=4, latency=bad)
    assert str(info.value) == "latency must be a LatencyModel"


@pytest.mark.parametrize("bad", [0, 4097])
def test_file_metadata_reader_concurrency_range_message(bad):
    with pytest.raises(ValueError) as info:
        damacy.FileMetadataReader(concurrency=bad)
    assert str(info.value) == "concurrency must be in [1, 4096]"


def test_file_metadata_reader_concurrency_top_accepted():
    assert damacy.FileMetadataReader(concurrency=4096).concurrency == 4096


def test_file_metadata_reader_has_no_extra_attributes():
    r = damacy.FileMetadataReader(concurrency=2)
    with pytest.raises(AttributeError):
        r.extra = 4


def test_file_metadata_reader_is_shareable():
    reader = damacy.FileMetadataReader(concurrency=4)
    a = damacy.ZarrMetadata(reader=reader, cache=damacy.MetadataCache())
    b = damacy.ZarrMetadata(reader=reader, cache=damacy.MetadataCache(array_entries=16))
    assert a.reader is reader and b.reader is reader


# ---- ZarrMetadata -----------------------------------------------------------------------


def test_zarr_metadata_attributes():
    reader, cache = damacy.FileMetadataReader(concurrency=4), damacy.MetadataCache(array_entries=32)
    m = damacy.ZarrMetadata(reader=reader, cache=cache)
    assert m.reader is reader
    assert m.cache is cache


def test_zarr_metadata_is_keyword_only():
    reader, cache = damacy.FileMetadataReader(), damacy.MetadataCache()
    with pytest.raises(TypeError):
        damacy.ZarrMetadata(reader, cache)


@pytest.mark.parametrize("missing", ["reader", "cache"])
def test_zarr_metadata_requires_reader_and_cache(missing):
    kwargs = {"reader": damacy.FileMetadataReader(), "cache": damacy.MetadataCache()}
    del kwargs[missing]
    with pytest.raises(TypeError):
        damacy.ZarrMetadata(**kwargs)


def test_zarr_metadata_has_no_extra_attributes():
    with pytest.raises(AttributeError):
        metadata_provider().extra = 1


def test_zarr_metadata_shared_by_planners():
    m = metadata_provider()
    a, b = damacy.ChunkPlanner(metadata=m), damacy.ChunkPlanner(metadata=m)
    assert a.metadata is m and b.metadata is m


# ---- ChunkPlanner -----------------------------------------------------------------------


def test_chunk_planner_attributes():
    m, limits = metadata_provider(), damacy.PlanLimits(max_chunks=8)
    p = damacy.ChunkPlanner(metadata=m, limits=limits)
    assert p.metadata is m
    assert p.limits == limits


def test_chunk_planner_limits_none_means_defaults():
    assert damacy.ChunkPlanner(metadata=metadata_provider()).limits == damacy.PlanLimits()
    assert damacy.ChunkPlanner(metadata=metadata_provider(), limits=None).limits == damacy.PlanLimits()


def test_chunk_planner_is_keyword_only_and_needs_metadata_provider():
    m = metadata_provider()
    with pytest.raises(TypeError):
        damacy.ChunkPlanner(m)
    with pytest.raises(TypeError):
        damacy.ChunkPlanner()


def test_chunk_planner_has_no_extra_attributes():
    with pytest.raises(AttributeError):
        damacy.ChunkPlanner(metadata=metadata_provider()).extra = 1


# ---- CpuExecutor ------------------------------------------------------------------------


def test_cpu_executor_attributes():
    reader, limits = damacy.FileReader(workers=2), cpu_limits()
    e = damacy.CpuExecutor(reader=reader, limits=limits)
    assert e.reader is reader
    assert e.limits == limits


def test_cpu_executor_is_keyword_only():
    reader, limits = damacy.FileReader(workers=1), cpu_limits()
    with pytest.raises(TypeError):
        damacy.CpuExecutor(reader, limits)


@pytest.mark.parametrize("missing", ["reader", "limits"])
def test_cpu_executor_requires_reader_and_limits(missing):
    kwargs = {"reader": damacy.FileReader(workers=1), "limits": cpu_limits()}
    del kwargs[missing]
    with pytest.raises(TypeError):
        damacy.CpuExecutor(**kwargs)


# ---- CudaExecutor -----------------------------------------------------------------------


def test_cuda_executor_is_keyword_only():
    reader, limits = damacy.FileReader(workers=1), damacy.CudaLimits(max_gpu_memory_bytes=1 << 30)
    with pytest.raises(TypeError):
        damacy.CudaExecutor(reader, limits)


def test_cuda_executor_refuses_without_a_gpu():
    """A CPU-only build "reports that CUDA support was not built" (type unspecified); a CUDA
    build on a host without a device cannot construct one either."""
    if gpu_available():
        pytest.skip("a CUDA GPU is present")
    reader, limits, cls = damacy.FileReader(workers=1), damacy.CudaLimits(max_gpu_memory_bytes=1 << 30), damacy.CudaExecutor
    with pytest.raises(damacy.InvalidArgument, match="no CUDA device"):  # (type unspecified by the seed)
        cls(reader=reader, limits=limits, device=0)


def test_cuda_executor_attributes_on_a_gpu():
    require_gpu()
    reader, limits = damacy.FileReader(workers=1), damacy.CudaLimits(max_gpu_memory_bytes=1 << 30)
    e = damacy.CudaExecutor(reader=reader, limits=limits, device=0)
    assert e.reader is reader
    assert e.limits == limits
    assert e.device == 0 and e.device_index == 0  # a plain class (docs/seed.md: it holds the engine's state)
    e.close()


def test_cuda_executor_device_none_captures_current_context():
    require_gpu()  # gpu_available() made the primary context current
    e = damacy.CudaExecutor(reader=damacy.FileReader(workers=1), limits=damacy.CudaLimits(max_gpu_memory_bytes=1 << 30))
    assert e.device is None


@pytest.mark.parametrize("strategy", ["auto", "disabled", "enum"])
def test_cuda_executor_numa_strategy_forms(strategy):
    require_gpu()
    if strategy == "enum":
        strategy = damacy.NumaStrategy.DISABLED
    e = damacy.CudaExecutor(
        reader=damacy.FileReader(workers=1),
        limits=damacy.CudaLimits(max_gpu_memory_bytes=1 << 30),
        device=0,
        numa_strategy=strategy,
        enable_gds=False,
    )
    assert e.numa_strategy is damacy.NumaStrategy.coerce(strategy)
    e.close()
