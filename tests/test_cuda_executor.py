"""The CUDA executor's orchestration on the host stand-in device (host memory, the kernels'
host twin, zstandard in nvCOMP's place): the batches it assembles equal the CPU
executor's, bit for bit, and its errors reach the same samples."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest
from zarr.codecs import BloscCodec, BytesCodec, ShardingCodec, ZstdCodec

import damacy
from damacy_protocol.errors import DecodeError
from damacy_protocol.limits import DEFAULT_GPU_MEMORY_BYTES
from damacy_server.cuda import twin
from damacy_server.plan.planner import Planner

from conftest import random_data, write_array

pytestmark = pytest.mark.skipif(not twin.available(), reason="the kernels' host twin was not built (no C compiler)")

SHAPE = (12, 16, 20)


@pytest.fixture(scope="module")
def arrays(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda-exec")
    specs = {
        "zstd-u16": ("uint16", {"compressors": [ZstdCodec(level=3, checksum=True)]}),
        "stored-f32-big": ("float32", {"serializer": BytesCodec(endian="big")}),
        "sharded-i16": ("int16", {"serializer": ShardingCodec(chunk_shape=(3, 4, 5), codecs=[BytesCodec(), ZstdCodec(level=1)])}),
        "blosc-lz4-f64": ("float64", {"compressors": [BloscCodec(cname="lz4", shuffle="bitshuffle", typesize=8)]}),
        "blosc-lz4-byte-u16": ("uint16", {"compressors": [BloscCodec(cname="lz4", shuffle="shuffle", typesize=2, blocksize=512)]}),
        "blosc-lz4hc-bit-i32": ("int32", {"compressors": [BloscCodec(cname="lz4hc", shuffle="bitshuffle", typesize=4, blocksize=1024)]}),
        "blosc-blosclz-u16": ("uint16", {"compressors": [BloscCodec(cname="blosclz", shuffle="shuffle", typesize=2)]}),
        "blosc-zstd-bit-u16": ("uint16", {"compressors": [BloscCodec(cname="zstd", shuffle="bitshuffle", typesize=2, blocksize=512)]}),
        "blosc-zstd-byte-f32-big": ("float32", {"serializer": BytesCodec(endian="big"), "compressors": [BloscCodec(cname="zstd", shuffle="shuffle", typesize=4, blocksize=256)]}),
        "zstd-f32-big": ("float32", {"serializer": BytesCodec(endian="big"), "compressors": [ZstdCodec(level=1)]}),
    }
    out = {}
    for k, (name, (dtype, kw)) in enumerate(specs.items()):
        data = random_data(SHAPE, dtype, seed=k)
        if name.startswith(("blosc-zstd", "blosc-lz4-byte", "blosc-lz4hc", "blosc-blosclz")):  # compressible: Blosc would store random bytes as they are
            data = (np.indices(SHAPE).sum(axis=0) * 7 % 500).astype(dtype)
        if dtype.startswith("float"):
            data.flat[::29] = np.nan
            data.flat[3::31] = 1e30
        write_array(root / name, data, chunks=(6, 8, 10), fill_value=5, **kw)
        out[name] = (str(root / name), data)
    return out


def execute(executor, plan, out_dtype):
    outs = [np.full(shape, 77, dtype=out_dtype) for shape in plan.shapes]
    done = threading.Event()
    errors = {}

    def finished(errs):
        errors.update(errs)
        done.set()

    executor.execute(plan, outs, finished)
    assert done.wait(30)
    return outs, {**plan.errors, **errors}


def cuda_executor(device, reader=None, **limits):
    """The CUDA executor on ``device`` (a HostDevice or a fake: ``backend=``), with the
    default GPU budget unless ``limits`` says otherwise."""
    limits = {"max_gpu_memory_bytes": DEFAULT_GPU_MEMORY_BYTES, **limits}
    return damacy.CudaExecutor(reader=reader or damacy.FileReader(), limits=damacy.CudaLimits(**limits), backend=device)


def composed(executor, samples, shape, dtype="f32", prepared=2, lookahead=None, **kw):
    """A pipeline composed with ``executor`` (which it claims, and closes as it closes)."""
    planner = damacy.ChunkPlanner(metadata=damacy.ZarrMetadata(reader=damacy.FileMetadataReader(), cache=damacy.MetadataCache()))
    return damacy.Pipeline(
        planner=planner,
        executor=executor,
        output=damacy.BatchSpec(samples, shape, dtype),
        queues=damacy.QueueLimits(lookahead_samples=lookahead or 2 * samples, prepared_batches=prepared),
        pop_timeout_s=60,
        **kw,
    )


def both(plan, out_dtype):
    cpu = damacy.CpuExecutor(reader=damacy.FileReader(), limits=damacy.CpuLimits(max_memory_bytes=2 << 30, decode_workers=2))
    from damacy_server.cuda.device import HostDevice

    device = HostDevice()
    gpu = cuda_executor(device)
    try:
        return execute(cpu, plan, out_dtype), execute(gpu, plan, out_dtype), gpu, device
    finally:
        cpu.close()
        gpu.close()


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("out", ["float32", "bfloat16", "int16", "float16", "native"])
def test_boxes_equal_the_cpu_executor(arrays, out):
    rng = np.random.default_rng(5)
    for name, (uri, data) in arrays.items():
        dtype = data.dtype if out == "native" else np.dtype(ml_dtypes.bfloat16 if out == "bfloat16" else out)
        boxes = [tuple((int(a), int(a) + n) for a, n in zip(rng.integers(-4, 14, size=3), (6, 9, 11))) for _ in range(5)]
        plan = Planner().plan([damacy.Sample(uri, b) for b in boxes], (6, 9, 11))
        (cpu_out, cpu_err), (gpu_out, gpu_err), gpu, device = both(plan, dtype)
        assert not cpu_err and not gpu_err
        assert all(same(a, b) for a, b in zip(gpu_out, cpu_out)), name
        if plan.fills:
            assert device.launches.index("fill") < device.launches.index("assemble")  # fills first
        assert (gpu.host_decoded > 0) == name.startswith("blosc-blosclz")  # only what nvCOMP lacks
        codecs = [c for c, _ in device.decodes]
        assert ("lz4" in codecs) == name.startswith("blosc-lz4") and codecs.count("lz4") <= 1  # one batched call
        assert ("unshuffle" in device.launches) == (name.startswith("blosc-") and not name.startswith("blosc-blosclz"))


def test_index_queries_equal_the_cpu_executor(arrays):
    uri, _ = arrays["sharded-i16"]
    # an index past the end (13, 25) is padded by this plan (out_of_bounds="pad"); the seed's
    # IndexQuery takes no negative index
    queries = [damacy.IndexQuery(uri, ([11, 0, 5, 5, 13], np.s_[3:9], [19, 2, 2, 7, 0, 25])) for _ in range(2)]
    plan = Planner().plan(queries, (5, 6, 6))
    (cpu_out, _), (gpu_out, _), _, _ = both(plan, np.dtype("float32"))
    assert all(same(a, b) for a, b in zip(gpu_out, cpu_out))


def test_missing_chunks_read_as_the_fill_value(arrays, tmp_path):
    for name in ("zstd-u16", "stored-f32-big"):
        uri, data = arrays[name]
        src = tmp_path / name
        import shutil

        shutil.copytree(uri, src)
        (src / "c" / "1" / "1" / "1").unlink()
        plan = Planner().plan([damacy.Sample(str(src), np.s_[4:10, 6:12, 8:14])], (6, 6, 6))
        (cpu_out, _), (gpu_out, _), _, _ = both(plan, np.dtype("float32"))
        assert same(gpu_out[0], cpu_out[0])
        assert (gpu_out[0][2:, 2:, 2:] == 5).all()  # the part in chunk (1, 1, 1)


def test_bad_frames_fail_their_samples_only(arrays, tmp_path):
    import shutil

    uri, data = arrays["zstd-u16"]
    src = tmp_path / "bad"
    shutil.copytree(uri, src)
    cut = src / "c" / "0" / "0" / "0"
    cut.write_bytes(cut.read_bytes()[:-9])  # truncated: refused by the host walk
    flipped = src / "c" / "1" / "0" / "0"
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # inside a block: passes the walk, fails the decode (checksum)
    flipped.write_bytes(bytes(raw))
    samples = [damacy.Sample(str(src), np.s_[0:6, 0:8, 0:10]), damacy.Sample(str(src), np.s_[6:12, 0:8, 0:10]), damacy.Sample(str(src), np.s_[0:6, 8:16, 10:20])]
    plan = Planner().plan(samples, (6, 8, 10))
    (cpu_out, cpu_err), (gpu_out, gpu_err), _, _ = both(plan, np.dtype("float32"))
    assert set(gpu_err) == set(cpu_err) == {0, 1}
    assert all(isinstance(e, DecodeError) for e in gpu_err.values())
    assert gpu_err[0].chunk == (0, 0, 0) and gpu_err[1].chunk == (1, 0, 0)
    assert "truncated" in gpu_err[0].reason  # caught on the host, before the device sees it
    assert gpu_err[1].reason.startswith("zstd:")  # the decoder's status, as the sample's error
    assert same(gpu_out[2], cpu_out[2]) and np.array_equal(gpu_out[2], data[0:6, 8:16, 10:20].astype("f4"))


def test_a_batch_larger_than_the_device_budget_fails_its_samples(arrays):
    from damacy_server.cuda.device import HostDevice

    uri, _ = arrays["zstd-u16"]
    plan = Planner().plan([damacy.Sample(uri, np.s_[0:12, 0:16, 0:20])], (12, 16, 20))
    # chunks of at most 1 KiB (these decode to 960 bytes): the slots must leave 4 KiB beside them
    gpu = cuda_executor(HostDevice(), max_gpu_memory_bytes=1 << 20, max_chunk_bytes=1024)
    assert gpu.budget.min_inflight == 4096
    try:
        gpu.reserve_slots((1 << 20) - 4096, "slots")  # 4 KiB left: less than the batch's units
        _, errors = execute(gpu, plan, np.dtype("float32"))
        assert set(errors) == {0} and "device memory" in str(errors[0])
    finally:
        gpu.close()


def test_a_pipeline_naming_a_missing_gpu_is_refused_when_made(tmp_path):
    """A Config is a plain value (made anywhere, sent anywhere); the pipeline made with it
    checks that this machine has the GPU it names, embedded and through a daemon alike."""
    from damacy_runtime.devices import cuda_devices

    count, _ = cuda_devices()
    missing = damacy.Config(samples_per_batch=1, sample_shape=(2,), device=count)
    if count == 0:
        with pytest.raises(damacy.InvalidArgument, match="Config.device=0: no CUDA device is available"):
            damacy.Pipeline(missing, embedded=True)
        with pytest.raises(damacy.InvalidArgument, match="no CUDA device is available"):
            damacy.Pipeline(missing, endpoint=f"ipc://{tmp_path}/nobody.sock")
    else:
        with pytest.raises(damacy.InvalidArgument, match=f"this machine has {count} CUDA device"):
            damacy.Pipeline(missing, embedded=True)
    assert damacy.Config(samples_per_batch=1, sample_shape=(2,)).device is None


def test_a_bad_blosc_stream_fails_its_sample_only(arrays, tmp_path):
    import shutil

    uri, data = arrays["blosc-zstd-bit-u16"]
    src = tmp_path / "blosc"
    shutil.copytree(uri, src)
    chunk = src / "c" / "0" / "0" / "0"
    raw = bytearray(chunk.read_bytes())
    from damacy_server.zarr.codecs.blosc import parse_frame

    last = parse_frame(bytes(raw)).streams[-1]
    raw[last.offset] ^= 0xFF  # the last stream's zstd magic number
    chunk.write_bytes(bytes(raw))
    samples = [damacy.Sample(str(src), np.s_[0:6, 0:8, 0:10]), damacy.Sample(str(src), np.s_[6:12, 8:16, 10:20])]
    plan = Planner().plan(samples, (6, 8, 10))
    (cpu_out, cpu_err), (gpu_out, gpu_err), _, device = both(plan, np.dtype("float32"))
    assert set(gpu_err) == set(cpu_err) == {0}
    assert gpu_err[0].chunk == (0, 0, 0) and "magic" in gpu_err[0].reason  # refused on the host
    assert np.array_equal(gpu_out[1], data[6:12, 8:16, 10:20].astype("f4"))


@pytest.mark.parametrize("name, byte, bits", [
    ("blosc-zstd-byte-f32-big", 0, 0x01),  # another frame format version
    ("blosc-zstd-byte-f32-big", 1, 0x02),  # another compressor format version
    ("blosc-zstd-byte-f32-big", 2, 0x04),  # bit and byte shuffle both flagged: the byte shuffle wins
    ("blosc-lz4-f64", 2, 0x01),  # the same on a bit-shuffled frame
])
def test_a_blosc_header_reads_alike_on_both_paths(arrays, tmp_path, name, byte, bits):
    """A frame whose header the CPU path (C-Blosc 1) refuses, the GPU path refuses too; one
    it reads, the GPU path reads to the same values."""
    import shutil

    uri, _ = arrays[name]
    src = tmp_path / "blosc"
    shutil.copytree(uri, src)
    chunk = src / "c" / "0" / "0" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[byte] ^= bits
    chunk.write_bytes(bytes(raw))
    plan = Planner().plan([damacy.Sample(str(src), np.s_[0:6, 0:8, 0:10])], (6, 8, 10))
    (cpu_out, cpu_err), (gpu_out, gpu_err), _, _ = both(plan, np.dtype("float32"))
    assert set(cpu_err) == set(gpu_err)
    if byte < 2:
        assert set(gpu_err) == {0} and "format version" in gpu_err[0].reason
    else:
        assert not gpu_err and same(gpu_out[0], cpu_out[0])


def test_host_decoded_and_missing_units_of_a_big_endian_array_agree(tmp_path):
    """A gzip array (decoded on the host) stored big-endian, with a chunk never written: both
    kinds of unit reach the kernel in the array's one byte order."""
    from zarr.codecs import GzipCodec

    data = np.arange(8 * 10, dtype=">f4").reshape(8, 10)
    write_array(tmp_path / "g", data, chunks=(4, 5), serializer=BytesCodec(endian="big"), compressors=[GzipCodec()], fill_value=-1.5)
    (tmp_path / "g" / "c" / "0" / "0").unlink()
    plan = Planner().plan([damacy.Sample(str(tmp_path / "g"), np.s_[0:8, 0:10])], (8, 10))
    (cpu_out, _), (gpu_out, _), gpu, _ = both(plan, np.dtype("float32"))
    assert gpu.host_decoded > 0 and same(gpu_out[0], cpu_out[0])
    assert (gpu_out[0][:4, :5] == -1.5).all() and np.array_equal(gpu_out[0][4:], data[4:].astype("f4"))


def test_a_zero_dimensional_array_never_written_is_its_fill_value(tmp_path):
    import zarr

    zarr.create_array(str(tmp_path / "z"), shape=(), dtype="uint16", fill_value=9)
    plan = Planner().plan([damacy.Sample(str(tmp_path / "z"), ())], ())
    (cpu_out, cpu_err), (gpu_out, gpu_err), _, _ = both(plan, np.dtype("float32"))
    assert not gpu_err and same(gpu_out[0], cpu_out[0]) and float(gpu_out[0]) == 9.0


def test_a_failing_batch_waits_for_its_queued_work_before_letting_go(arrays, monkeypatch):
    from damacy_server.cuda.device import HostDevice

    uri, _ = arrays["zstd-u16"]
    device = HostDevice()
    synced = []
    real = device.synchronize
    monkeypatch.setattr(device, "synchronize", lambda: (synced.append(1), real())[1])

    def boom(*a, **k):
        raise RuntimeError("table check failed")

    monkeypatch.setattr("damacy_server.cuda.executor.check_disjoint", boom)
    gpu = cuda_executor(device)
    try:
        plan = Planner().plan([damacy.Sample(uri, np.s_[-2:4, 0:8, 0:10])], (6, 8, 10))
        before = len(synced)
        _, errors = execute(gpu, plan, np.dtype("float32"))
        assert set(errors) == {0} and "table check failed" in str(errors[0])
        assert "fill" in device.launches and len(synced) > before  # the fill was queued, then waited for
    finally:
        gpu.close()


def test_units_decoded_on_the_host_are_counted_in_the_pipelines_stats(arrays):
    from damacy_server.cuda.device import HostDevice

    for name, host in (("blosc-blosclz-u16", True), ("blosc-lz4-byte-u16", False)):
        uri, data = arrays[name]
        with composed(cuda_executor(HostDevice()), 2, (6, 9, 11), dtype=str(data.dtype)) as pipe:
            pipe.push([damacy.Sample(uri, ((0, 6), (0, 9), (0, 11)))] * 2)
            with pipe.pop() as batch:
                assert np.array_equal(batch.numpy()[0], data[:6, :9, :11])
            stats = pipe.stats_dict()["device"]
        assert stats["name"] == "host" and (stats["host_decoded"] > 0) == host, name


def test_zstd_chunks_larger_than_nvcomp_decodes_are_decoded_on_the_host(arrays, monkeypatch):
    """nvCOMP's zstd takes chunks up to 2 GiB - 1; a larger one is decoded on the host
    (here the limit is lowered below the test's chunks), not refused with the whole batch."""
    from damacy_server.cuda import nvcomp

    monkeypatch.setattr(nvcomp, "MAX_CHUNK_BYTES", 900)  # the chunks decode to 960 bytes
    uri, _ = arrays["zstd-u16"]
    other, _ = arrays["blosc-lz4-byte-u16"]
    plan = Planner().plan([damacy.Sample(uri, ((0, 6), (0, 9), (0, 11))), damacy.Sample(other, ((0, 6), (0, 9), (0, 11)))], (6, 9, 11))
    (cpu_out, cpu_err), (gpu_out, gpu_err), gpu, device = both(plan, np.dtype("float32"))
    assert not cpu_err and not gpu_err and all(same(a, b) for a, b in zip(gpu_out, cpu_out))
    assert gpu.host_decoded > 0 and "zstd" not in [c for c, _ in device.decodes]


def test_closing_the_cuda_executor_mid_stream_returns_its_device_memory(arrays):
    # batches queued for the host stage and the device thread when it closes: each still
    # runs, sees the close and gives back the device memory it reserved
    import gc
    import time

    from damacy_server.cuda.device import HostDevice

    uri = arrays["zstd-u16"][0]
    for _ in range(3):
        # two reader threads, four batches in flight: batches wait in the readers' queue
        executor = cuda_executor(HostDevice(), reader=damacy.FileReader(workers=2))
        pipe = composed(executor, 1, (2, 16, 20), prepared=4, lookahead=8)
        pipe.push([damacy.Sample(uri, np.s_[z : z + 2, 0:16, 0:20]) for z in range(0, 10)] * 20)
        deadline = time.monotonic() + 60
        while executor._readers.queued() + executor._pool.queued() < 1 and time.monotonic() < deadline:
            time.sleep(0.0005)  # until a batch waits in a queue
        assert time.monotonic() < deadline, "no batch waited in the executor's queues"
        pipe.close()  # closes the executor it claimed
        assert executor._closed
        del pipe
        gc.collect()
        assert executor.budget.used == executor.budget.slots == 0


# -- making a CUDA executor: the device it binds, what it refuses ------------------------------


def test_a_cuda_executor_without_a_cuda_device_is_refused_saying_why(monkeypatch):
    from damacy_runtime import devices

    monkeypatch.delenv(devices.STANDIN_ENV, raising=False)
    reader, limits = damacy.FileReader(), damacy.CudaLimits(max_gpu_memory_bytes=1 << 20)
    monkeypatch.setattr(devices, "cuda_devices", lambda: (0, "the CUDA driver reports no device"))
    for device in (None, 0):
        with pytest.raises(damacy.InvalidArgument, match=r"no CUDA device is available \(the CUDA driver reports no device\)"):
            damacy.CudaExecutor(reader=reader, limits=limits, device=device)
    monkeypatch.undo()
    monkeypatch.delenv(devices.STANDIN_ENV, raising=False)
    count, why = devices.cuda_devices()
    if count == 0:  # this machine, as it is
        with pytest.raises(damacy.InvalidArgument, match=r"no CUDA device is available") as refused:
            damacy.CudaExecutor(reader=reader, limits=limits)
        assert why in str(refused.value)


def test_a_cuda_executor_takes_its_arguments_by_keyword_and_its_backend_as_gpu(monkeypatch):
    from damacy_server.cuda.device import HostDevice

    reader, limits = damacy.FileReader(), damacy.CudaLimits(max_gpu_memory_bytes=1 << 24)
    with pytest.raises(TypeError):
        damacy.CudaExecutor(HostDevice())  # the device object goes in backend=
    with pytest.raises(TypeError, match="limits must be a CudaLimits"):
        damacy.CudaExecutor(reader=reader, limits=damacy.CpuLimits(max_memory_bytes=1 << 24), backend=HostDevice())
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'max_gpu_memory_bytes'"):
        damacy.CudaLimits()
    backend = HostDevice()
    gpu = damacy.CudaExecutor(reader=reader, limits=limits, backend=backend)
    try:
        assert gpu.gpu is backend and gpu.device is None and gpu.device_index == 0
        assert gpu.reader is reader and gpu.limits is limits and gpu.budget.total == 1 << 24
    finally:
        gpu.close()
    monkeypatch.setenv("DAMACY_DEVICE_STANDIN", "1")  # GPU 0 is the stand-in: device=0 binds it
    gpu = damacy.CudaExecutor(reader=reader, limits=limits, device=0)
    try:
        assert isinstance(gpu.gpu, HostDevice) and gpu.device == gpu.device_index == 0
    finally:
        gpu.close()
    with pytest.raises(damacy.InvalidArgument, match="this machine has 1 CUDA device"):
        damacy.CudaExecutor(reader=reader, limits=limits, device=1)


def test_gpudirect_storage_is_refused(monkeypatch):
    from damacy_server.cuda.device import HostDevice

    reader, limits = damacy.FileReader(), damacy.CudaLimits(max_gpu_memory_bytes=1 << 24)
    monkeypatch.delenv("DAMACY_GDS_ENABLE", raising=False)
    with pytest.raises(damacy.InvalidArgument, match=r"GPUDirect Storage \(enable_gds\) is not available"):
        damacy.CudaExecutor(reader=reader, limits=limits, enable_gds=True, backend=HostDevice())
    monkeypatch.setenv("DAMACY_GDS_ENABLE", "1")  # None defers to the environment
    with pytest.raises(damacy.InvalidArgument, match="enable_gds"):
        damacy.CudaExecutor(reader=reader, limits=limits, backend=HostDevice())
    gpu = damacy.CudaExecutor(reader=reader, limits=limits, enable_gds=False, backend=HostDevice())  # False wins
    gpu.close()
    monkeypatch.setenv("DAMACY_DEVICE_STANDIN", "1")
    with pytest.raises(damacy.InvalidArgument, match="enable_gds"):
        damacy.Pipeline(damacy.Config(samples_per_batch=1, sample_shape=(2,), device=0, enable_gds=True))


def test_max_index_bytes_zero_turns_index_queries_off_at_push_and_too_little_is_refused_when_made(arrays, monkeypatch):
    from damacy_server.cuda.device import HostDevice

    uri, data = arrays["sharded-i16"]
    monkeypatch.setenv("DAMACY_DEVICE_STANDIN", "1")
    off = damacy.Config(samples_per_batch=2, sample_shape=(3, 4, 5), dtype="i16", device=0, max_index_bytes=0)
    with damacy.Pipeline(off) as pipe:
        with pytest.raises(damacy.BudgetExceeded, match="max_index_bytes=0"):
            pipe.push([damacy.IndexQuery(uri, ([0, 2, 4], slice(0, 4), range(5)))])
        pipe.push([damacy.Sample(uri, np.s_[0:3, 0:4, 0:5]), damacy.Sample(uri, np.s_[3:6, 4:8, 5:10])])  # it keeps running
        with pipe.pop() as batch:
            assert np.array_equal(batch.numpy(), np.stack([data[0:3, 0:4, 0:5], data[3:6, 4:8, 5:10]]))
    # a batch's indices: 8 bytes * 2 samples * (3 + 4 + 5) = 192
    for cfg in (
        damacy.Config(samples_per_batch=2, sample_shape=(3, 4, 5), device=0, max_index_bytes=191),
        damacy.Config(samples_per_batch=2, sample_shape=(3, 4, 5), max_gpu_memory_bytes=1 << 26, device=0, max_index_bytes=1),
    ):
        with pytest.raises(damacy.BudgetExceeded, match=r"max_index_bytes=(191|1) cannot hold a batch's indices: .* = 192 bytes"):
            damacy.Pipeline(cfg)
    executor = cuda_executor(HostDevice(), max_index_bytes=191)
    with pytest.raises(damacy.BudgetExceeded, match="192 bytes"):
        composed(executor, 2, (3, 4, 5))
    with composed(executor, 2, (3, 4, 4)) as pipe:  # 8 * 2 * 11 = 176: fits, and the executor was given back
        queries = [damacy.IndexQuery(uri, ([0, 2, 4], slice(0, 4), range(0, 8, 2))) for _ in range(2)]
        pipe.push(queries)
        with pipe.pop() as batch:
            want = data[[0, 2, 4]][:, 0:4][:, :, 0:8:2].astype("f4")
            assert np.array_equal(batch.numpy(), np.stack([want, want]))


def test_cuda_init_primary_makes_device_0_current_for_a_config_without_a_device(arrays, monkeypatch):
    """The seed API's way for a program without a framework: a Config with a GPU budget and
    no device binds the CUDA context current in the calling thread (each test runs it in a
    thread of its own: the current context is the thread's)."""
    from damacy_runtime import devices

    uri, data = arrays["zstd-u16"]
    cfg = damacy.Config(samples_per_batch=1, sample_shape=(6, 8, 10), max_gpu_memory_bytes=1 << 26, dtype="u16")

    def in_a_thread(fn):
        out: list = []

        def run():
            try:
                out.append(("ok", fn()))
            except BaseException as e:  # noqa: BLE001 - returned to the test
                out.append(("error", e))

        t = threading.Thread(target=run)
        t.start()
        t.join(60)
        kind, value = out[0]
        if kind == "error":
            raise value
        return value

    monkeypatch.delenv(devices.STANDIN_ENV, raising=False)
    if devices.cuda_devices()[0] == 0:  # this machine, without the stand-in
        with pytest.raises(RuntimeError, match="no CUDA device to make current"):
            in_a_thread(damacy._native.cuda_init_primary)
    monkeypatch.setattr(devices, "cuda_devices", lambda: (0, "the CUDA driver reports no device"))
    with pytest.raises(RuntimeError, match="no CUDA device to make current: the CUDA driver reports no device"):
        in_a_thread(damacy._native.cuda_init_primary)
    monkeypatch.undo()

    monkeypatch.setenv(devices.STANDIN_ENV, "1")
    with pytest.raises(damacy.InvalidArgument, match="no CUcontext is current"):
        in_a_thread(lambda: damacy.Pipeline(cfg))  # no context current: refused

    def made_current():
        damacy._native.cuda_init_primary()
        assert devices.current_device() == 0
        with damacy.Pipeline(cfg) as pipe:
            assert isinstance(pipe.executor, damacy.CudaExecutor) and pipe.executor.device is None
            assert pipe.executor.device_index == 0 and pipe.device == 0
            pipe.push([damacy.Sample(uri, np.s_[0:6, 0:8, 0:10])])
            with pipe.pop() as batch:
                assert batch.info.device_type is damacy.DeviceType.CUDA and batch.info.device == "cuda:0"
                return batch.copy()

    got = in_a_thread(made_current)
    assert np.array_equal(got[0], data[0:6, 0:8, 0:10])
    with pytest.raises(RuntimeError, match="CUDA device 1 does not exist here"):
        in_a_thread(lambda: damacy._native.cuda_init_primary(1))


def test_a_pipeline_bound_to_the_current_context_warns_once_when_local_rank_names_another_gpu(monkeypatch):
    """With no device in its Config, a GPU pipeline takes the current context's device; when
    LOCAL_RANK names another (a rank that forgot torch.cuda.set_device), or the host has
    several GPUs, it warns once per case, at the line that made the pipeline; a Config
    naming its device never warns."""
    import warnings

    from damacy_runtime import devices, warn

    monkeypatch.setattr(warn, "_said", set())
    monkeypatch.setenv(devices.STANDIN_ENV, "1")
    cfg = damacy.Config(samples_per_batch=1, sample_shape=(4, 4), max_gpu_memory_bytes=1 << 26)

    def made(config, *, local_rank=None, gpus=1):
        """The warnings of making (and closing) a pipeline of ``config`` in a thread whose
        current context is device 0's."""
        if local_rank is None:
            monkeypatch.delenv("LOCAL_RANK", raising=False)
        else:
            monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        monkeypatch.setattr(devices, "cuda_devices", lambda: (gpus, ""))
        out: list = []

        def run():
            damacy._native.cuda_init_primary()
            with warnings.catch_warnings(record=True) as got:
                warnings.simplefilter("always")
                damacy.Pipeline(config).close()
            out.extend(got)

        t = threading.Thread(target=run)
        t.start()
        t.join(60)
        return [(str(w.message), w.filename) for w in out if issubclass(w.category, UserWarning)]

    first = made(cfg, local_rank=3)
    assert len(first) == 1, first
    message, filename = first[0]
    assert "bound to CUDA device 0 but LOCAL_RANK=3: call torch.cuda.set_device(3)" in message
    assert filename == __file__  # the line that made the pipeline
    assert made(cfg, local_rank=3) == []  # once per case
    assert made(damacy.Config(samples_per_batch=1, sample_shape=(4, 4), device=0), local_rank=3) == []
    several = made(cfg, gpus=8)
    assert [m for m, _ in several] == [
        "damacy.Pipeline bound to CUDA device 0 of 8 because its context was current: pass Config(device=...) to say which"
    ]
    assert several[0][1] == __file__
    assert made(cfg, local_rank=0) == [] and made(cfg) == []  # its own rank's GPU, one GPU
