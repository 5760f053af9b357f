"""Contract rows that need a CUDA GPU (§5 CudaLimits, §7 Config, §9 CUDA batches, §10
gpu_bytes_committed, §11 max_index_bytes=0, §16 device binding). Each test skips cleanly
where ``damacy._native.cuda_init_primary()`` cannot make a context current.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from contract_helpers import planner, ramp, require_gpu, write

import damacy

SHAPE, CHUNKS, BOX = (8, 12), (4, 6), (4, 6)
BOXES = [((0, 4), (0, 6)), ((2, 6), (3, 9))]
CAP = 1 << 30


@pytest.fixture
def arr(tmp_path):
    return write(tmp_path / "a.zarr", ramp(SHAPE), chunks=CHUNKS)


def samples(arr, boxes=BOXES):
    return [damacy.Sample(str(arr.store.root), b) for b in boxes]


def cuda_pipeline(**limits):
    kw = {"max_gpu_memory_bytes": CAP}
    kw.update(limits)
    return damacy.Pipeline(
        planner=planner(),
        executor=damacy.CudaExecutor(reader=damacy.FileReader(workers=2), limits=damacy.CudaLimits(**kw), device=0),
        output=damacy.BatchSpec(2, BOX),
        queues=damacy.QueueLimits(4),
        pop_timeout_s=20.0,
    )


def config(**changes):
    # explicit cache sizes: the legacy floors are (lookahead + 2 * samples) [* max_shards_per_sample]
    kw = {"samples_per_batch": 2, "sample_shape": BOX, "max_gpu_memory_bytes": CAP, "n_io_threads": 2}
    kw.update(n_array_meta_cache=64, n_chunk_layout_cache=64, n_shard_index_cache=8 * 64, max_shards_per_sample=64)
    kw.update(changes)
    return damacy.Config(**kw)


def test_cuda_batch_device_and_info(arr):
    require_gpu()
    with cuda_pipeline() as p:
        assert p.device == 0
        p.push(samples(arr))
        with p.pop() as batch:
            assert tuple(batch.__dlpack_device__()) == (2, 0)
            info = batch.info
            assert info.device_type is damacy.DeviceType.CUDA
            assert info.device_id == 0
            assert info.shape == (2, *BOX)
            assert info.data == info.device_ptr != 0


def test_cuda_batch_values_match_zarr(arr):
    require_gpu()
    cupy = pytest.importorskip("cupy")
    with cuda_pipeline() as p:
        p.push(samples(arr))
        with p.pop() as batch:
            got = cupy.asnumpy(cupy.from_dlpack(batch))
    want = np.stack([arr[a0:a1, b0:b1] for (a0, a1), (b0, b1) in BOXES]).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_cuda_gpu_bytes_committed_within_the_cap(arr):
    require_gpu()
    with cuda_pipeline() as p:
        p.push(samples(arr))
        with p.pop():
            pass
        committed = p.stats().gpu_bytes_committed
        assert 0 < committed <= CAP


def test_cuda_index_bytes_below_floor_budget_exceeded():
    require_gpu()
    with pytest.raises(damacy.BudgetExceeded):
        cuda_pipeline(max_index_bytes=8 * 2 * sum(BOX) - 1)


def test_cuda_index_bytes_at_floor_accepted():
    require_gpu()
    with cuda_pipeline(max_index_bytes=8 * 2 * sum(BOX)) as p:
        assert p.device == 0


def test_cuda_gpu_budget_too_small_budget_exceeded():
    require_gpu()
    with pytest.raises(damacy.BudgetExceeded):
        cuda_pipeline(max_gpu_memory_bytes=1 << 10)


def test_cuda_index_bytes_zero_rejects_index_query_at_push(arr):
    require_gpu()
    with cuda_pipeline(max_index_bytes=0) as p:
        with pytest.raises(damacy.BudgetExceeded):
            p.push([damacy.IndexQuery(str(arr.store.root), [[0, 1, 2, 3], slice(0, 6)])] * 2)
        p.push(samples(arr))
        with p.pop() as batch:
            assert batch.info.shape == (2, *BOX)


def test_config_pipeline_is_cuda():
    require_gpu()
    cfg = config(device=0)
    with damacy.Pipeline(cfg) as p:
        assert p.device == 0
        assert p.config is cfg
        assert p.output == damacy.BatchSpec(2, BOX)
        assert p.queues == damacy.QueueLimits(4)


def test_config_cache_floor_invalid_argument():
    """Legacy floor: n_array_meta_cache >= lookahead_samples + 2 * samples_per_batch."""
    require_gpu()
    with pytest.raises(damacy.InvalidArgument):
        damacy.Pipeline(config(device=0, n_array_meta_cache=1))


def test_config_index_bytes_below_floor_budget_exceeded():
    require_gpu()
    with pytest.raises(damacy.BudgetExceeded):
        damacy.Pipeline(config(device=0, max_index_bytes=8))


def test_local_rank_warning_without_an_explicit_device(monkeypatch):
    require_gpu()  # makes device 0's primary context current
    monkeypatch.setenv("LOCAL_RANK", "7")
    with pytest.warns(UserWarning, match="LOCAL_RANK"):
        damacy.Pipeline(config()).close()


def test_no_local_rank_warning_with_an_explicit_device(monkeypatch):
    require_gpu()
    monkeypatch.setenv("LOCAL_RANK", "5")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        damacy.Pipeline(config(device=0)).close()
    assert not [w for w in seen if "LOCAL_RANK" in str(w.message)]
