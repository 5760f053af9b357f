"""Contract §7: Config, the legacy CUDA convenience adapter (validation needs no GPU)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

import damacy

U32 = (1 << 32) - 1


def raises_exactly(exc, message):
    """pytest.raises for ``exc`` whose str() is exactly ``message``."""
    return pytest.raises(exc, match="^" + re.escape(message) + "$")


# ---- §7 Config --------------------------------------------------------------------------

BASE = {"samples_per_batch": 8, "sample_shape": (8, 16), "max_gpu_memory_bytes": 1 << 30}


def config(**changes):
    return damacy.Config(**{**BASE, **changes})


def test_config_is_keyword_only():
    with pytest.raises(TypeError):
        damacy.Config(8, (8, 16), 1 << 30)


@pytest.mark.parametrize("missing", ["samples_per_batch", "sample_shape"])
def test_config_required_fields(missing):
    kwargs = {k: v for k, v in BASE.items() if k != missing}
    with pytest.raises(TypeError):
        damacy.Config(**kwargs)


def test_config_without_a_gpu_budget_is_damacys_host_pipeline():
    """The seed API requires max_gpu_memory_bytes (TypeError) and always builds a GPU
    pipeline; damacy's Config without it (and without a device) streams into host memory
    (a listed difference, docs/seed.md)."""
    c = damacy.Config(samples_per_batch=2, sample_shape=(4,))
    assert c.max_gpu_memory_bytes is None and not c.on_gpu
    assert config().on_gpu


def test_config_defaults():
    c = config()
    assert c.dtype is damacy.Dtype.F32
    assert c.lookahead_samples == 16
    assert c.max_index_bytes == 64 << 20
    assert c.n_io_threads == 64
    assert c.device is None
    assert c.pop_timeout_s == 30.0
    assert c.enable_gds is None
    assert c.numa_strategy is damacy.NumaStrategy.AUTO
    assert c.numa_node == -1
    assert c.metadata_latency == damacy.LatencyModel()
    assert 2 <= c.host_buffer_waves <= 8
    for name in ("max_chunk_uncompressed_bytes", "max_read_op_bytes", "max_chunks_per_wave", "max_substreams_per_chunk", "metadata_io_concurrency"):
        assert getattr(c, name) >= 1, name


def test_config_stores_shape_as_int_tuple_and_coerces_dtype():
    c = config(sample_shape=[np.int64(4), 5], dtype="bf16", numa_strategy="disabled")
    assert c.sample_shape == (4, 5) and all(type(v) is int for v in c.sample_shape)
    assert c.dtype is damacy.Dtype.BF16
    assert c.numa_strategy is damacy.NumaStrategy.DISABLED


def test_config_samples_per_batch_message():
    with raises_exactly(ValueError, "samples_per_batch must be >= 1 (got 0)"):
        config(samples_per_batch=0)


def test_config_lookahead_must_cover_a_batch():
    with pytest.raises(ValueError, match="lookahead_samples"):
        config(lookahead_samples=7)
    assert config(lookahead_samples=8).lookahead_samples == 8


@pytest.mark.parametrize(
    "changes",
    [
        {"sample_shape": ()},
        {"sample_shape": (8, 0)},
        {"sample_shape": (-1,)},
        {"max_gpu_memory_bytes": 0},
        {"max_chunk_uncompressed_bytes": 0},
        {"max_read_op_bytes": 0},
        {"max_index_bytes": -1},
        {"host_buffer_waves": 1},
        {"host_buffer_waves": 1 << 20},
        {"max_chunks_per_wave": 0},
        {"max_chunks_per_wave": 1 << 30},
        {"max_substreams_per_chunk": 0},
        {"max_substreams_per_chunk": 1 << 30},
        {"n_io_threads": 0},
        {"n_io_threads": 1 << 20},
        {"metadata_io_concurrency": 0},
        {"pop_timeout_s": 0},
        {"pop_timeout_s": -1.0},
        {"numa_strategy": "pin_to"},
        {"numa_strategy": "auto", "numa_node": 0},
        {"numa_strategy": "disabled", "numa_node": 3},
        {"dtype": "nope"},
    ],
    ids=repr,
)
def test_config_rejects_value(changes):
    with pytest.raises(ValueError):
        config(**changes)


def test_config_max_index_bytes_message():
    with raises_exactly(ValueError, "max_index_bytes must be between 0 and 8 * (2**32 - 1)"):
        config(max_index_bytes=8 * U32 + 1)
    assert config(max_index_bytes=0).max_index_bytes == 0


def test_config_n_io_threads_none_is_a_type_error():
    """§17 #3: the code compares ``1 <= n_io_threads``, so None fails with TypeError."""
    with pytest.raises(TypeError):
        config(n_io_threads=None)


def test_config_metadata_latency_type_error():
    with pytest.raises(TypeError):
        config(metadata_latency={"baseline_ns": 5})
    m = damacy.LatencyModel(baseline_ns=5)
    assert config(metadata_latency=m).metadata_latency == m


def test_config_numa_pin_to_needs_node():
    c = config(numa_strategy=damacy.NumaStrategy.PIN_TO, numa_node=0)
    assert (c.numa_strategy, c.numa_node) == (damacy.NumaStrategy.PIN_TO, 0)
    assert config(numa_strategy="pin-to", numa_node=1).numa_strategy is damacy.NumaStrategy.PIN_TO


def test_config_enable_gds_stored_as_bool_or_none():
    assert config(enable_gds=1).enable_gds is True
    assert config(enable_gds=0).enable_gds is False
    assert config(enable_gds=None).enable_gds is None


def test_config_pop_timeout_none_accepted():
    assert config(pop_timeout_s=None).pop_timeout_s is None


def test_config_is_frozen():
    c = config()
    with pytest.raises(AttributeError):  # frozen
        c.samples_per_batch = 2


def test_config_dataclasses_replace():
    c = config()
    big = dataclasses.replace(c, samples_per_batch=64, lookahead_samples=128)
    assert (big.samples_per_batch, big.lookahead_samples, big.sample_shape) == (64, 128, (8, 16))
    assert c.samples_per_batch == 8
    with pytest.raises(ValueError):
        dataclasses.replace(c, samples_per_batch=0)


def test_config_equality_and_hash():
    assert config() == config()
    assert hash(config()) == hash(config())
    assert config() != config(samples_per_batch=4)


def test_config_default_is_constructor_sugar():
    assert damacy.Config.default(**BASE) == config()
    assert damacy.Config.default(**BASE, dtype="u16", lookahead_samples=32) == config(dtype="u16", lookahead_samples=32)


def test_config_adapter_applies_batchspec_samples_limit():
    with raises_exactly(ValueError, "samples must be in [1, 65535]"):
        damacy.Pipeline(config(samples_per_batch=65536))


def test_config_adapter_applies_batchspec_rank_limit():
    with raises_exactly(ValueError, "shape must have between 1 and 31 dimensions"):
        damacy.Pipeline(config(sample_shape=(1,) * 32))


def test_config_adapter_requires_finite_pop_timeout():
    with raises_exactly(ValueError, "pop_timeout_s must be positive and finite, or None"):
        damacy.Pipeline(config(pop_timeout_s=float("inf")))


def test_a_configs_caches_not_given_rise_to_their_floors_and_given_ones_are_held_to_them(tmp_path):
    """The metadata caches hold at least the samples in flight (lookahead plus two batches;
    the shard indexes that many times ``max_shards_per_sample``): a Config of large batches
    builds with the defaults raised to those floors, while a cache given below its floor is
    refused at ``Pipeline(...)`` (InvalidArgument)."""
    big = damacy.Config(samples_per_batch=64, sample_shape=(4, 4))  # floor: (128 + 128) samples
    assert (big.n_array_meta_cache, big.n_chunk_layout_cache, big.n_shard_index_cache) == (256, 256, 256 * 64)
    small = damacy.Config(samples_per_batch=4, sample_shape=(4, 4))
    assert (small.n_array_meta_cache, small.n_chunk_layout_cache, small.n_shard_index_cache) == (256, 256, 8192)
    wide = damacy.Config(samples_per_batch=100, sample_shape=(4, 4), max_shards_per_sample=2)
    assert (wide.n_array_meta_cache, wide.n_shard_index_cache) == (400, 8192)
    damacy.Pipeline(big, embedded=True).close()
    with pytest.raises(damacy.InvalidArgument, match="n_shard_index_cache=8192 is below its floor"):
        damacy.Pipeline(damacy.Config(samples_per_batch=64, sample_shape=(4, 4), n_shard_index_cache=8192), embedded=True)
    again = damacy.Config.from_dict(big.to_dict())
    assert again == big


def test_a_variant_from_dataclasses_replace_chooses_its_cache_sizes_again():
    """Cache sizes a Config chose (not given) follow a variant's batches; given ones stay."""
    small = damacy.Config(samples_per_batch=8, sample_shape=(8, 16))
    big = dataclasses.replace(small, samples_per_batch=64, lookahead_samples=128)
    assert big == damacy.Config(samples_per_batch=64, sample_shape=(8, 16), lookahead_samples=128)
    assert big.n_shard_index_cache == 256 * 64
    damacy.Pipeline(big, embedded=True).close()  # within its floors
    given = dataclasses.replace(damacy.Config(samples_per_batch=8, sample_shape=(8, 16), n_shard_index_cache=9000), samples_per_batch=64, lookahead_samples=128)
    assert given.n_shard_index_cache == 9000
    with pytest.raises(damacy.InvalidArgument, match="n_shard_index_cache=9000 is below its floor"):
        damacy.Pipeline(given, embedded=True)
    # a size it chose is not one the caller set for damacyd to ignore
    assert damacy.Config(samples_per_batch=8, sample_shape=(8, 16), max_shards_per_sample=2).daemon_owned() == ["max_shards_per_sample"]
    assert dataclasses.replace(small, samples_per_batch=64, lookahead_samples=128).daemon_owned() == []


def test_max_shards_per_sample_below_one_is_refused_where_the_pipeline_is_made():
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(4,), max_shards_per_sample=0)  # (checked natively by the seed)
    with raises_exactly(damacy.InvalidArgument, "Config.max_shards_per_sample must be > 0 (got 0)"):
        damacy.Pipeline(cfg, embedded=True)


def test_error_and_bounds_policies_are_string_enums_taken_from_their_strings():
    # damacy's on_error and out_of_bounds are ErrorPolicy and BoundsPolicy members, each equal
    # to its string: programs that give and compare strings keep working, the wire form is
    # the string, and anything else is refused with the choices
    import json

    import msgspec

    from damacy_protocol.enums import BoundsPolicy, ErrorPolicy

    cfg = damacy.Config(samples_per_batch=2, sample_shape=(4,), on_error="skip", out_of_bounds="pad")
    assert cfg.on_error is ErrorPolicy.SKIP and cfg.on_error == "skip" and cfg.out_of_bounds is BoundsPolicy.PAD
    default = damacy.Config(samples_per_batch=2, sample_shape=(4,))
    assert default.on_error is ErrorPolicy.STOP and default.out_of_bounds is BoundsPolicy.ERROR
    assert damacy.Config(samples_per_batch=2, sample_shape=(4,), on_error=ErrorPolicy.FILL).on_error is ErrorPolicy.FILL
    assert dataclasses.replace(cfg, on_error="raise").on_error is ErrorPolicy.RAISE
    wire = cfg.to_dict()
    assert json.loads(json.dumps(wire))["on_error"] == "skip" and msgspec.msgpack.decode(msgspec.msgpack.encode(wire))["out_of_bounds"] == "pad"
    assert damacy.Config.from_dict(wire) == cfg
    with pytest.raises(ValueError, match=r"on_error must be one of \('stop', 'raise', 'fill', 'skip'\), got 'ignore'"):
        damacy.Config(samples_per_batch=2, sample_shape=(4,), on_error="ignore")
    with pytest.raises(ValueError, match=r"out_of_bounds must be one of \('error', 'pad'\), got 'clip'"):
        damacy.Config(samples_per_batch=2, sample_shape=(4,), out_of_bounds="clip")
