"""Contract §4 (Sample, IndexQuery) and §5 (output and limit value objects); §7 (Config) is in
test_contract_config.py.

Python-side checks raise the built-in ValueError / TypeError with the messages the contract
spells; no pipeline and no data are needed here.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import damacy

U32 = (1 << 32) - 1
U64 = (1 << 64) - 1
I63 = (1 << 63) - 1


def raises_exactly(exc, message):
    """pytest.raises for ``exc`` whose str() is exactly ``message``."""
    import re

    return pytest.raises(exc, match="^" + re.escape(message) + "$")


# ---- §4.1 Sample ------------------------------------------------------------------------


def test_sample_positional_and_keyword_construction_agree():
    a = damacy.Sample("cell.zarr", [(0, 4), (2, 6)])
    b = damacy.Sample(uri="cell.zarr", aabb=[(0, 4), (2, 6)])
    assert a == b
    assert a.uri == "cell.zarr"
    assert a.aabb == ((0, 4), (2, 6))


def test_sample_uri_stored_as_given():
    uri = "some dir/../odd name.zarr/0"
    assert damacy.Sample(uri, [(0, 1)]).uri == uri


def test_sample_tuple_axis_converted_to_ints():
    s = damacy.Sample("a", [(np.int64(1), np.int32(5)), (np.uint8(0), 3)])
    assert s.aabb == ((1, 5), (0, 3))
    assert all(type(v) is int for axis in s.aabb for v in axis)


def test_sample_slice_start_none_becomes_zero():
    assert damacy.Sample("a", [slice(None, 4), slice(2, 6, 1)]).aabb == ((0, 4), (2, 6))


def test_sample_accepts_np_s():
    assert damacy.Sample("a", np.s_[0:4, 2:6]).aabb == ((0, 4), (2, 6))


def test_sample_equivalent_spellings_compare_and_hash_equal():
    a = damacy.Sample("c.zarr", [(0, 64), (0, 256)])
    b = damacy.Sample("c.zarr", [slice(0, 64), slice(0, 256)])
    c = damacy.Sample("c.zarr", [slice(None, 64), slice(None, 256)])
    d = damacy.Sample("c.zarr", np.s_[:64, :256])
    assert a == b == c == d
    assert len({hash(a), hash(b), hash(c), hash(d)}) == 1
    assert isinstance(a.aabb, tuple) and all(isinstance(x, tuple) for x in a.aabb)


def test_sample_slice_step_message():
    with raises_exactly(ValueError, "aabb axis 0: slice step must be 1 or omitted (got step=2)"):
        damacy.Sample("a", [slice(0, 64, 2), slice(0, 8)])
    with raises_exactly(ValueError, "aabb axis 1: slice step must be 1 or omitted (got step=-1)"):
        damacy.Sample("a", [slice(0, 64), slice(8, 0, -1)])


def test_sample_slice_stop_required_message():
    with raises_exactly(ValueError, "aabb axis 0: slice stop is required (got slice(0, None, None))"):
        damacy.Sample("a", [slice(0, None), slice(0, 8)])
    with raises_exactly(ValueError, "aabb axis 1: slice stop is required (got slice(None, None, None))"):
        damacy.Sample("a", [slice(0, 8), slice(None)])


@pytest.mark.parametrize(
    "axis, type_name",
    [(64, "int"), ([0, 64], "list"), ((0, 4, 8), "tuple"), ((4,), "tuple"), ("0:4", "str"), (None, "NoneType")],
)
def test_sample_other_axis_forms_type_error(axis, type_name):
    with raises_exactly(TypeError, f"aabb axis 1: expected slice or (start, stop) tuple; got {type_name}"):
        damacy.Sample("a", [(0, 4), axis])


def test_sample_geometry_not_checked_in_python():
    assert damacy.Sample("a", [(5, 2), (-3, 0)]).aabb == ((5, 2), (-3, 0))


def test_sample_is_frozen():
    s = damacy.Sample("a", [(0, 1)])
    with pytest.raises(AttributeError):  # frozen
        s.uri = "b"


# ---- §4.2 IndexQuery --------------------------------------------------------------------


def test_index_query_documented_example():
    q = damacy.IndexQuery("cell.zarr", selection=([7, 2, 7], slice(4, 8)))
    assert q.uri == "cell.zarr"
    assert q.shape == (3, 4)
    assert q.indices == ((7, 2, 7), None)
    assert q.aabb == ((2, 8), (4, 8))


def test_index_query_three_axis_example_shape():
    q = damacy.IndexQuery(uri="x", selection=([7, 2, 7], slice(16, 80), [100, 3, 40, 3]))
    assert q.shape == (3, 64, 4)
    assert q.aabb == ((2, 8), (16, 80), (3, 101))


def test_index_query_tuple_is_an_index_array():
    q = damacy.IndexQuery("x", [(7, 2)])
    assert q.indices == ((7, 2),)
    assert q.shape == (2,)


def test_index_query_range_and_array_are_index_arrays():
    q = damacy.IndexQuery("x", [range(10, 0, -3), np.array([3, 1], dtype=np.int16)])
    assert q.indices == ((10, 7, 4, 1), (3, 1))
    assert all(type(v) is int for v in q.indices[1])
    assert q.shape == (4, 2)


def test_index_query_keeps_order_duplicates_and_singletons():
    q = damacy.IndexQuery("x", [[5, 5, 1], [9]])
    assert q.indices == ((5, 5, 1), (9,))
    assert q.shape == (3, 1)


def test_index_query_slice_start_none_and_step_one():
    q = damacy.IndexQuery("x", [slice(None, 5), slice(2, 4, 1)])
    assert q.aabb == ((0, 5), (2, 4))
    assert q.indices == (None, None)
    assert q.shape == (5, 2)


def test_index_query_copies_values():
    values = [3, 1, 2]
    q = damacy.IndexQuery("x", [values])
    values[0] = 99
    assert q.indices == ((3, 1, 2),)


def test_index_query_equivalent_spellings_compare_and_hash_equal():
    a = damacy.IndexQuery("x", ([1, 2], slice(0, 3)))
    b = damacy.IndexQuery("x", (np.array([1, 2]), slice(None, 3)))
    assert a == b
    assert hash(a) == hash(b)


def test_index_query_slice_step_message():
    with raises_exactly(ValueError, "selection axis 1: slice step must be one"):
        damacy.IndexQuery("x", [[0], slice(0, 8, 2)])


def test_index_query_slice_stop_message():
    with raises_exactly(ValueError, "selection axis 0: slice stop is required"):
        damacy.IndexQuery("x", [slice(2, None)])


@pytest.mark.parametrize("bad", [slice(4, 4), slice(5, 2), slice(-1, 3), slice(0, 1 << 63)])
def test_index_query_invalid_slice_bounds_message(bad):
    with raises_exactly(ValueError, "selection axis 0: invalid slice bounds"):
        damacy.IndexQuery("x", [bad])


def test_index_query_largest_slice_stop_accepted():
    assert damacy.IndexQuery("x", [slice(0, I63)]).aabb == ((0, I63),)


@pytest.mark.parametrize("bad", [slice(0.0, 4), slice(0, 4.5)])
def test_index_query_float_slice_bounds_type_error(bad):
    with pytest.raises(TypeError):
        damacy.IndexQuery("x", [bad])


@pytest.mark.parametrize("bad", [[1.5], ["a"], 5])
def test_index_query_bad_index_values_type_error(bad):
    with pytest.raises(TypeError):
        damacy.IndexQuery("x", [slice(0, 1), bad])


def test_index_query_empty_index_array_message():
    with raises_exactly(ValueError, "selection axis 0: index array is empty"):
        damacy.IndexQuery("x", [[]])


@pytest.mark.parametrize("bad", [[-1], [0, I63]])
def test_index_query_index_range_message(bad):
    with raises_exactly(ValueError, "selection axis 0: indices must be nonnegative int64 values"):
        damacy.IndexQuery("x", [bad])


def test_index_query_largest_index_accepted():
    assert damacy.IndexQuery("x", [[I63 - 1]]).aabb == ((I63 - 1, I63),)


def test_index_query_rank_limit_message():
    assert len(damacy.IndexQuery("x", [[0]] * 31).shape) == 31
    with raises_exactly(ValueError, "selection rank must not exceed 31"):
        damacy.IndexQuery("x", [[0]] * 32)


def test_index_query_needs_an_axis_message():
    with raises_exactly(ValueError, "selection must have at least one axis"):
        damacy.IndexQuery("x", [])


def test_index_query_is_frozen():
    q = damacy.IndexQuery("x", [[1]])
    with pytest.raises(AttributeError):  # frozen
        q.indices = ((2,),)


# ---- §5 value objects -------------------------------------------------------------------


def test_batchspec_defaults_and_stored_forms():
    spec = damacy.BatchSpec(2, [4, np.int64(5)])
    assert spec.samples == 2
    assert spec.shape == (4, 5) and isinstance(spec.shape, tuple)
    assert spec.dtype is damacy.Dtype.F32
    assert damacy.BatchSpec(samples=2, shape=(4,), dtype="uint16").dtype is damacy.Dtype.U16
    assert damacy.BatchSpec(1, (4,), "BF16").dtype is damacy.Dtype.BF16
    assert damacy.BatchSpec(1, (4,), int(damacy.Dtype.I8)).dtype is damacy.Dtype.I8


@pytest.mark.parametrize("bad", [0, 65536, -1])
def test_batchspec_samples_range_message(bad):
    with raises_exactly(ValueError, "samples must be in [1, 65535]"):
        damacy.BatchSpec(samples=bad, shape=(4,))


def test_batchspec_samples_bounds_accepted():
    assert damacy.BatchSpec(65535, (1,)).samples == 65535
    assert damacy.BatchSpec(True, (1,)).samples == 1


def test_batchspec_samples_non_integer_type_error():
    with pytest.raises(TypeError):
        damacy.BatchSpec(1.5, (4,))


@pytest.mark.parametrize("bad", [0, -3, I63 + 1])
def test_batchspec_shape_extent_message(bad):
    with raises_exactly(ValueError, f"shape extent must be in [1, {I63}]"):
        damacy.BatchSpec(1, (4, bad))


@pytest.mark.parametrize("rank", [0, 32])
def test_batchspec_shape_rank_message(rank):
    with raises_exactly(ValueError, "shape must have between 1 and 31 dimensions"):
        damacy.BatchSpec(1, (1,) * rank)


def test_batchspec_rank_31_accepted():
    assert len(damacy.BatchSpec(1, (1,) * 31).shape) == 31


@pytest.mark.parametrize("bad", ["nope", "f63", "complex64"])
def test_batchspec_invalid_dtype_value_error(bad):
    with pytest.raises(ValueError, match="^unknown dtype: "):
        damacy.BatchSpec(1, (4,), bad)


@pytest.mark.parametrize("name", ["f64", "float64", "f16", "bool", "native"])
def test_batchspec_takes_damacys_extra_dtypes(name):
    """The seed API's ten Dtypes, and damacy's own names (a listed difference)."""
    spec = damacy.BatchSpec(1, (4,), name)
    assert spec.dtype == {"float64": "f64"}.get(name, name)


def test_batchspec_errors_are_not_damacy_errors():
    with pytest.raises(ValueError) as info:
        damacy.BatchSpec(samples=0, shape=(4,))
    assert not isinstance(info.value, damacy.DamacyError)


def test_queue_limits_defaults_and_required():
    assert damacy.QueueLimits(8) == damacy.QueueLimits(lookahead_samples=8, prepared_batches=2)
    with pytest.raises(TypeError):
        damacy.QueueLimits()


def test_metadata_cache_defaults():
    c = damacy.MetadataCache()
    assert (c.array_entries, c.shard_index_entries) == (256, 8192)


def test_plan_limits_defaults():
    p = damacy.PlanLimits()
    assert (p.max_chunks, p.max_chunk_bytes, p.max_shards_per_sample, p.max_plan_bytes) == (16384, 2 << 20, 64, 64 << 20)


def test_cpu_limits_defaults_and_required():
    c = damacy.CpuLimits(max_memory_bytes=1 << 30)
    assert (c.decode_workers, c.max_encoded_chunk_bytes, c.max_decoded_chunk_bytes, c.chunks_per_input_buffer) == (8, 4 << 20, 2 << 20, 256)
    with pytest.raises(TypeError):
        damacy.CpuLimits()


def test_cuda_limits_defaults_and_required():
    c = damacy.CudaLimits(max_gpu_memory_bytes=1 << 30)
    assert c.max_index_bytes == 64 << 20
    assert c.chunk_layout_entries == 256
    for name in ("max_chunk_bytes", "max_read_bytes", "max_chunks_per_wave", "max_substreams_per_chunk"):
        assert getattr(c, name) >= 1, name
    assert c.host_buffer_waves >= 2
    with pytest.raises(TypeError):
        damacy.CudaLimits()


def test_latency_model_defaults():
    m = damacy.LatencyModel()
    assert (m.baseline_ns, m.lognormal_mu_ln_ns, m.lognormal_sigma_ln_ns, m.cap_ns, m.seed) == (0, 0.0, 0.0, 0, 0)


def test_ngff_limits_defaults():
    n = damacy.NgffLimits()
    assert (n.max_levels, n.max_metadata_bytes) == (32, 4 << 20)


#: (class name, required keyword arguments, field, bad values, message, largest accepted value)
RANGES = [
    ("QueueLimits", {}, "lookahead_samples", [0, (1 << 32) - 4], "lookahead_samples must be in [1, 4294967291]", (1 << 32) - 5),
    ("QueueLimits", {"lookahead_samples": 4}, "prepared_batches", [0, 1025], "prepared_batches must be in [1, 1024]", 1024),
    ("MetadataCache", {}, "array_entries", [0, U32 + 1], f"array_entries must be in [1, {U32}]", U32),
    ("MetadataCache", {}, "shard_index_entries", [0, U32 + 1], f"shard_index_entries must be in [1, {U32}]", U32),
    ("PlanLimits", {}, "max_chunks", [0, 16385], "max_chunks must be in [1, 16384]", 16384),
    ("PlanLimits", {}, "max_chunk_bytes", [0, U32 + 1], f"max_chunk_bytes must be in [1, {U32}]", U32),
    ("PlanLimits", {}, "max_shards_per_sample", [0, U32 + 1], f"max_shards_per_sample must be in [1, {U32}]", U32),
    ("PlanLimits", {}, "max_plan_bytes", [0, U64 + 1], f"max_plan_bytes must be in [1, {U64}]", U64),
    ("CpuLimits", {}, "max_memory_bytes", [0, U64 + 1], f"max_memory_bytes must be in [1, {U64}]", U64),
    ("CpuLimits", {"max_memory_bytes": 1 << 30}, "max_encoded_chunk_bytes", [0, U32 + 1], f"max_encoded_chunk_bytes must be in [1, {U32}]", U32),
    ("CpuLimits", {"max_memory_bytes": 1 << 30}, "max_decoded_chunk_bytes", [0, U32 + 1], f"max_decoded_chunk_bytes must be in [1, {U32}]", U32),
    ("CpuLimits", {"max_memory_bytes": 1 << 30, "decode_workers": 1}, "chunks_per_input_buffer", [0, 16385], "chunks_per_input_buffer must be in [1, 16384]", 16384),
    ("CudaLimits", {}, "max_gpu_memory_bytes", [0, U64 + 1], f"max_gpu_memory_bytes must be in [1, {U64}]", U64),
    ("CudaLimits", {"max_gpu_memory_bytes": 1 << 30}, "chunk_layout_entries", [0, U32 + 1], f"chunk_layout_entries must be in [1, {U32}]", U32),
    ("CudaLimits", {"max_gpu_memory_bytes": 1 << 30}, "max_chunk_bytes", [0, U32 + 1], f"max_chunk_bytes must be in [1, {U32}]", U32),
    ("CudaLimits", {"max_gpu_memory_bytes": 1 << 30}, "max_read_bytes", [0, U32 + 1], f"max_read_bytes must be in [1, {U32}]", U32),
    ("NgffLimits", {}, "max_levels", [0, 1 << 31], "max_levels must be in [1, 2147483647]", (1 << 31) - 1),
    ("NgffLimits", {}, "max_metadata_bytes", [0, U64 + 1], f"max_metadata_bytes must be in [1, {U64}]", U64),
]
RANGE_IDS = [f"{r[0]}.{r[2]}" for r in RANGES]


@pytest.mark.parametrize("cls, base, field, bad, message, top", RANGES, ids=RANGE_IDS)
def test_limit_range_message(cls, base, field, bad, message, top):
    for value in bad:
        with raises_exactly(ValueError, message):
            getattr(damacy, cls)(**base, **{field: value})


@pytest.mark.parametrize("cls, base, field, bad, message, top", RANGES, ids=RANGE_IDS)
def test_limit_range_bounds_accepted(cls, base, field, bad, message, top):
    for value in (1, top):
        assert getattr(getattr(damacy, cls)(**base, **{field: value}), field) == value


@pytest.mark.parametrize("cls, base, field, bad, message, top", RANGES, ids=RANGE_IDS)
def test_limit_accepts_bool_as_int(cls, base, field, bad, message, top):
    getattr(damacy, cls)(**base, **{field: True})
    with pytest.raises(ValueError):
        getattr(damacy, cls)(**base, **{field: False})


@pytest.mark.parametrize("cls, base, field, bad, message, top", RANGES, ids=RANGE_IDS)
def test_limit_non_integer_type_error(cls, base, field, bad, message, top):
    with pytest.raises(TypeError):
        getattr(damacy, cls)(**base, **{field: 2.0})


def test_cpu_limits_decode_workers_range():
    with pytest.raises(ValueError, match=r"^decode_workers must be in \[1, \d+\]$"):
        damacy.CpuLimits(max_memory_bytes=1 << 30, decode_workers=0)
    with pytest.raises(ValueError):
        damacy.CpuLimits(max_memory_bytes=1 << 30, decode_workers=1 << 20, chunks_per_input_buffer=16384)


def test_cpu_limits_chunks_per_input_buffer_at_least_decode_workers_message():
    with raises_exactly(ValueError, "chunks_per_input_buffer (2) must be at least decode_workers (4)"):
        damacy.CpuLimits(max_memory_bytes=1 << 30, decode_workers=4, chunks_per_input_buffer=2)
    assert damacy.CpuLimits(max_memory_bytes=1 << 30, decode_workers=4, chunks_per_input_buffer=4).chunks_per_input_buffer == 4


@pytest.mark.parametrize("bad", [-1, 8 * U32 + 1])
def test_cuda_limits_max_index_bytes_message(bad):
    with raises_exactly(ValueError, "max_index_bytes must be between 0 and 8 * (2**32 - 1)"):
        damacy.CudaLimits(max_gpu_memory_bytes=1 << 30, max_index_bytes=bad)


def test_cuda_limits_max_index_bytes_zero_and_top_accepted():
    for value in (0, 8 * U32):
        assert damacy.CudaLimits(max_gpu_memory_bytes=1 << 30, max_index_bytes=value).max_index_bytes == value


def test_cuda_limits_host_buffer_waves_minimum_message():
    with raises_exactly(ValueError, "host_buffer_waves must be at least 2"):
        damacy.CudaLimits(max_gpu_memory_bytes=1 << 30, host_buffer_waves=1)
    assert damacy.CudaLimits(max_gpu_memory_bytes=1 << 30, host_buffer_waves=2).host_buffer_waves == 2
    for bad in (0, 1 << 20):
        with pytest.raises(ValueError):
            damacy.CudaLimits(max_gpu_memory_bytes=1 << 30, host_buffer_waves=bad)


@pytest.mark.parametrize("field", ["max_chunks_per_wave", "max_substreams_per_chunk"])
def test_cuda_limits_wave_geometry_range(field):
    for bad in (0, 1 << 40):
        with pytest.raises(ValueError, match=f"^{field} must be in "):
            damacy.CudaLimits(max_gpu_memory_bytes=1 << 30, **{field: bad})


@pytest.mark.parametrize(
    "field, bad",
    [
        ("baseline_ns", -1),
        ("lognormal_mu_ln_ns", float("inf")),
        ("lognormal_mu_ln_ns", float("nan")),
        ("lognormal_sigma_ln_ns", float("nan")),
        ("lognormal_sigma_ln_ns", -0.5),
        ("cap_ns", -1),
        ("seed", -1),
    ],
)
def test_latency_model_rejects(field, bad):
    with pytest.raises(ValueError):
        damacy.LatencyModel(**{field: bad})


def test_latency_model_accepts_valid_values():
    m = damacy.LatencyModel(baseline_ns=10, lognormal_mu_ln_ns=-2.0, lognormal_sigma_ln_ns=0.5, cap_ns=100, seed=7)
    assert (m.baseline_ns, m.lognormal_mu_ln_ns, m.seed) == (10, -2.0, 7)


VALUE_OBJECTS = [
    lambda: damacy.BatchSpec(1, (4,)),
    lambda: damacy.QueueLimits(4),
    lambda: damacy.MetadataCache(),
    lambda: damacy.PlanLimits(),
    lambda: damacy.CpuLimits(max_memory_bytes=1 << 30),
    lambda: damacy.CudaLimits(max_gpu_memory_bytes=1 << 30),
    lambda: damacy.LatencyModel(),
    lambda: damacy.NgffLimits(),
]


@pytest.mark.parametrize("make", VALUE_OBJECTS, ids=["BatchSpec", "QueueLimits", "MetadataCache", "PlanLimits", "CpuLimits", "CudaLimits", "LatencyModel", "NgffLimits"])
def test_value_object_is_frozen_and_comparable(make):
    obj = make()
    assert obj == make() and hash(obj) == hash(make())
    field = dataclasses.fields(obj)[0].name
    with pytest.raises(AttributeError):  # frozen
        setattr(obj, field, getattr(obj, field))
