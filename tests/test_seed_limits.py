"""What the seed API's limits that describe its C memory model do in damacy's engine
(docs/seed.md): each takes effect, on real arrays written by zarr-python, with the values
read exactly as zarr-python reads them."""

from __future__ import annotations

import numpy as np
import pytest
import zarr
from zarr.codecs import BloscCodec, ZstdCodec

import damacy
from damacy_protocol.limits import CudaLimits


def _volume(path, *, compressors, chunks=(4, 8, 8), shards=(8, 16, 16), seed=0):
    data = np.random.default_rng(seed).integers(0, 12, size=(8, 16, 16), dtype=np.uint16)  # compressible
    arr = zarr.create_array(str(path), shape=data.shape, dtype="uint16", chunks=chunks, shards=shards, compressors=compressors)
    arr[...] = data
    return str(path), data


def _planner() -> damacy.ChunkPlanner:
    return damacy.ChunkPlanner(metadata=damacy.ZarrMetadata(reader=damacy.FileMetadataReader(concurrency=2), cache=damacy.MetadataCache()))


def _run(executor, uri, boxes, samples=1):
    output = damacy.BatchSpec(samples, tuple(b - a for a, b in boxes[0]), "u16")
    with damacy.Pipeline(planner=_planner(), executor=executor, output=output, queues=damacy.QueueLimits(2 * samples)) as p:
        p.push([damacy.Sample(uri, box) for box in boxes])
        got = []
        for batch in p.batches(len(boxes) // samples):
            with batch:
                got.append(np.from_dlpack(batch).copy())
        return got, p.stats()


@pytest.mark.parametrize("per_read, reads", [(256, 1), (2, 4)])
def test_chunks_per_input_buffer_is_the_most_chunks_one_read_holds(tmp_path, per_read, reads):
    """The 8 chunks of a shard that one box cuts are one merged read, or reads of at most
    ``chunks_per_input_buffer`` chunks each."""
    uri, data = _volume(tmp_path / "v.zarr", compressors=[ZstdCodec(level=1)])
    limits = damacy.CpuLimits(max_memory_bytes=64 << 20, decode_workers=2, chunks_per_input_buffer=per_read)
    executor = damacy.CpuExecutor(reader=damacy.FileReader(workers=2), limits=limits)
    got, stats = _run(executor, uri, [[(0, 8), (0, 16), (0, 16)]])
    assert np.array_equal(got[0][0], data)
    assert stats.reads_issued == reads and stats.chunks_dispatched == 8


def _cuda(limits: CudaLimits):
    from damacy_server.cuda import twin
    from damacy_server.cuda.device import HostDevice
    from damacy_server.cuda.executor import CudaExecutor

    if not twin.available():
        pytest.skip("the kernels' host twin was not built (no C compiler)")
    device = HostDevice()
    return CudaExecutor(reader=damacy.FileReader(workers=2), limits=limits, backend=device), device


@pytest.mark.parametrize("per_wave, calls", [(512, 1), (3, 3)])
def test_max_chunks_per_wave_is_the_most_chunks_one_decode_call_takes(tmp_path, per_wave, calls):
    uri, data = _volume(tmp_path / "v.zarr", compressors=[ZstdCodec(level=1)])
    executor, device = _cuda(CudaLimits(1 << 30, max_chunks_per_wave=per_wave))
    got, stats = _run(executor, uri, [[(0, 8), (0, 16), (0, 16)]])
    assert np.array_equal(got[0][0], data)
    zstd = [n for codec, n in device.decodes if codec == "zstd"]
    assert len(zstd) == calls and max(zstd) <= per_wave
    # the frames went to the device in one staging upload per call (Stats.input_transfer)
    assert stats.input_transfer.count == calls and stats.input_transfer.input_bytes >= stats.decode.input_bytes > 0


def test_a_blosc_chunk_of_more_streams_than_max_substreams_per_chunk_is_decoded_on_the_host(tmp_path):
    """blosc splits a chunk into blocks, each a stream: with at most one stream per chunk on
    the device, chunks of several are decoded on the host, and read the same."""
    blosc = BloscCodec(cname="zstd", clevel=1, shuffle="shuffle", blocksize=128)  # 512-byte chunks: 4 blocks
    uri, data = _volume(tmp_path / "v.zarr", compressors=[blosc])
    executor, _ = _cuda(CudaLimits(1 << 30, max_substreams_per_chunk=1))
    got, _ = _run(executor, uri, [[(0, 8), (0, 16), (0, 16)]])
    assert np.array_equal(got[0][0], data)
    assert executor.host_decoded == 8
    executor2, _ = _cuda(CudaLimits(1 << 30))
    got2, _ = _run(executor2, uri, [[(0, 8), (0, 16), (0, 16)]])
    assert np.array_equal(got2[0][0], data) and executor2.host_decoded == 0


def test_chunk_layout_entries_keep_parsed_blosc_headers(tmp_path):
    """The second batch of the same chunks splits them from the kept headers (hits), the
    first parsed them (misses); ``Stats.chunk_layout_*`` count them."""
    uri, data = _volume(tmp_path / "v.zarr", compressors=[BloscCodec(cname="lz4", clevel=1, shuffle="shuffle")])
    executor, _ = _cuda(CudaLimits(1 << 30, chunk_layout_entries=64))
    box = [(0, 8), (0, 16), (0, 16)]
    output = damacy.BatchSpec(1, (8, 16, 16), "u16")
    with damacy.Pipeline(planner=_planner(), executor=executor, output=output, queues=damacy.QueueLimits(2)) as p:
        for _ in range(2):  # one batch after the other: the second looks after the first kept them
            p.push([damacy.Sample(uri, box)])
            with p.pop() as batch:
                assert np.array_equal(np.from_dlpack(batch)[0], data)
        stats = p.stats()
    assert stats.chunk_layout_misses == 8 and stats.chunk_layout_hits == 8


def test_a_chunk_rewritten_in_place_is_not_split_by_its_kept_blosc_header(tmp_path):
    """The kept header is used only while the chunk's bytes still say what it was parsed
    from: chunks rewritten with other data (same array metadata) read as zarr-python reads
    them, and count as misses."""
    blosc = [BloscCodec(cname="lz4", clevel=1, shuffle="shuffle")]
    uri, data = _volume(tmp_path / "v.zarr", compressors=blosc, shards=None)
    executor, _ = _cuda(CudaLimits(1 << 30, chunk_layout_entries=64))
    box = [(0, 8), (0, 16), (0, 16)]
    output = damacy.BatchSpec(1, (8, 16, 16), "u16")
    with damacy.Pipeline(planner=_planner(), executor=executor, output=output, queues=damacy.QueueLimits(2)) as p:
        p.push([damacy.Sample(uri, box)])
        with p.pop() as batch:
            assert np.array_equal(np.from_dlpack(batch)[0], data)
        again = np.random.default_rng(5).integers(0, 60000, size=data.shape, dtype=np.uint16)
        zarr.open_array(uri, mode="r+")[...] = again
        p.push([damacy.Sample(uri, box)])
        with p.pop() as batch:
            assert np.array_equal(np.from_dlpack(batch)[0], zarr.open_array(uri)[...])
        p.push([damacy.Sample(uri, box)])
        with p.pop() as batch:
            assert np.array_equal(np.from_dlpack(batch)[0], again)
        stats = p.stats()
    assert (stats.chunk_layout_misses, stats.chunk_layout_hits) == (16, 8)  # parsed, parsed again, kept


def test_a_gpu_executors_max_read_bytes_splits_merged_reads(tmp_path):
    uri, data = _volume(tmp_path / "v.zarr", compressors=None)  # 512 stored bytes per chunk
    executor, _ = _cuda(CudaLimits(1 << 30, max_read_bytes=1024))
    got, stats = _run(executor, uri, [[(0, 8), (0, 16), (0, 16)]])
    assert np.array_equal(got[0][0], data)
    assert stats.reads_issued == 4  # 8 chunks of 512 bytes, reads of at most 1024


@pytest.mark.parametrize("cap, reads", [(2 << 20, False), (16 << 20, True)])
def test_a_configs_chunk_cap_admits_chunks_stored_as_large(tmp_path, cap, reads):
    """``Config.max_chunk_uncompressed_bytes`` is the one chunk cap a Config has: chunks that
    decode to that much, stored uncompressed (as many bytes), are read under it; above it
    their samples fail naming the cap."""
    data = np.arange(16 * 512 * 512, dtype=np.uint16).reshape(16, 512, 512)  # one 8 MiB chunk
    zarr.create_array(str(tmp_path / "v.zarr"), shape=data.shape, dtype="uint16", chunks=data.shape, compressors=None)[...] = data
    cfg = damacy.Config(
        samples_per_batch=1, sample_shape=(2, 16, 16), dtype="u16", max_chunk_uncompressed_bytes=cap, max_memory_bytes=256 << 20
    )
    assert cfg.cpu_limits.max_encoded_chunk_bytes == max(4 << 20, 2 * cap)
    with damacy.Pipeline(cfg, embedded=True) as p:
        p.push([damacy.Sample(str(tmp_path / "v.zarr"), [(1, 3), (100, 116), (7, 23)])])
        if reads:
            with p.pop() as batch:
                assert np.array_equal(np.from_dlpack(batch)[0], data[1:3, 100:116, 7:23])
        else:
            with pytest.raises(damacy.BudgetExceeded, match="max_decoded_chunk_bytes|max_chunk"):
                p.pop()


@pytest.mark.parametrize(
    "limits, error, match",
    [
        (damacy.PlanLimits(max_chunks=2), damacy.BudgetExceeded, "uses 8 chunks .*PlanLimits.max_chunks=2"),
        (damacy.PlanLimits(max_shards_per_sample=1), damacy.InvalidArgument, "touches 8 shards, more than PlanLimits.max_shards_per_sample=1"),
    ],
)
def test_a_sample_over_a_plan_limit_fails_before_anything_is_read(tmp_path, limits, error, match):
    """The plan's limits are checked before the units are located: a refused sample reads no
    shard index and no chunk (a sample touching many shards would otherwise read all their
    indexes before failing)."""
    uri, _ = _volume(tmp_path / "v.zarr", compressors=[ZstdCodec(level=1)], shards=(4, 8, 8))  # 8 shards
    planner = damacy.ChunkPlanner(metadata=_planner().metadata, limits=limits)
    executor = damacy.CpuExecutor(reader=damacy.FileReader(workers=2), limits=damacy.CpuLimits(max_memory_bytes=64 << 20, decode_workers=2))
    output = damacy.BatchSpec(1, (8, 16, 16), "u16")
    with damacy.Pipeline(planner=planner, executor=executor, output=output, queues=damacy.QueueLimits(1), on_error="raise") as p:
        p.push([damacy.Sample(uri, [(0, 8), (0, 16), (0, 16)])])
        with pytest.raises(error, match=match):
            p.pop()
        stats = p.stats()
    assert (stats.shard_index_misses, stats.reads_issued, stats.chunks_dispatched) == (0, 0, 0)


class _Counted:
    """The executor's own semaphore, recording how many holders it had at once."""

    def __init__(self, sem) -> None:
        import threading

        self._sem, self._lock = sem, threading.Lock()
        self.held = self.most = self.taken = 0

    def acquire(self) -> None:
        self._sem.acquire()
        with self._lock:
            self.held += 1
            self.taken += 1
            self.most = max(self.most, self.held)

    def release(self) -> None:
        with self._lock:
            self.held -= 1
        self._sem.release()


@pytest.mark.parametrize("waves", [2, 3])
def test_host_buffer_waves_bounds_the_batches_read_ahead_of_the_device(tmp_path, waves):
    """A GPU executor reads at most ``host_buffer_waves`` batches ahead of its device stage:
    each batch holds one of them from its reads until its device stage is done."""
    uri, data = _volume(tmp_path / "v.zarr", compressors=[ZstdCodec(level=1)])
    executor, _ = _cuda(CudaLimits(1 << 30, host_buffer_waves=waves))
    counted = executor._host_waves = _Counted(executor._host_waves)  # (the bound is the executor's)
    boxes = [[(z, z + 2), (0, 16), (0, 16)] for z in range(7)] * 2
    got, _ = _run(executor, uri, boxes)
    assert all(np.array_equal(g[0], data[b[0][0] : b[0][1]]) for g, b in zip(got, boxes))
    assert counted.taken == len(boxes) and counted.held == 0  # one per batch, all given back
    assert 1 <= counted.most <= waves
    # the semaphore holds exactly host_buffer_waves: that many taken at once, no more
    sem = counted._sem
    assert all(sem.acquire(blocking=False) for _ in range(waves)) and not sem.acquire(blocking=False)


@pytest.mark.parametrize("native", [True, False])
def test_a_chunk_over_the_stored_cap_is_never_served_from_the_chunk_cache(tmp_path, native):
    """An unsharded chunk's stored size is known once it is read: one over
    ``max_encoded_chunk_bytes`` fails its samples every time it is asked for, whether read
    from the page cache in the native call or by the I/O threads, and is never kept."""
    uri, data = _volume(tmp_path / "v.zarr", compressors=None, shards=None)  # 512 stored bytes per chunk
    limits = damacy.CpuLimits(max_memory_bytes=64 << 20, decode_workers=2, max_encoded_chunk_bytes=256, chunk_cache_bytes=1 << 20, native=native)
    executor = damacy.CpuExecutor(reader=damacy.FileReader(workers=2), limits=limits)
    output = damacy.BatchSpec(1, (4, 8, 8), "u16")
    with damacy.Pipeline(planner=_planner(), executor=executor, output=output, queues=damacy.QueueLimits(2), on_error="fill") as p:
        for _ in range(3):  # one after the other: a second read would find what the first kept
            p.push([damacy.Sample(uri, [(0, 4), (0, 8), (0, 8)])])
            with p.pop() as batch:
                (i, err), = batch.info.errors
                assert i == 0 and isinstance(err, damacy.BudgetExceeded) and "max_encoded_chunk_bytes=256" in str(err)
        assert len(p.executor.chunk_cache) == 0
