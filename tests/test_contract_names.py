"""Contract §1-§3: the public names, the exception hierarchy and the enums.

Every name is looked up inside the test bodies, so this module collects even where the
package does not (yet) define it.
"""

from __future__ import annotations

import dataclasses
import doctest
import enum
import logging

import pytest

import damacy

#: the original's ``damacy.__all__`` (49 names)
ORIGINAL_ALL = [
    "Batch",
    "BatchInfo",
    "BatchSpec",
    "BudgetExceeded",
    "ChunkPlanner",
    "Config",
    "CpuExecutor",
    "CpuLimits",
    "CudaExecutor",
    "CudaLimits",
    "DamacyError",
    "DecodeError",
    "DeviceType",
    "Dtype",
    "DtypeMismatch",
    "FileMetadataReader",
    "FileReader",
    "IndexQuery",
    "InvalidArgument",
    "LatencyModel",
    "MetadataCache",
    "Metric",
    "NativeCudaError",
    "NgffAxis",
    "NgffImage",
    "NgffLevel",
    "NgffLimits",
    "NotFound",
    "NumaStrategy",
    "OutOfMemory",
    "Pipeline",
    "PlanLimits",
    "PoolStarved",
    "QueueLimits",
    "RankMismatch",
    "ResolvedSpatialQuery",
    "Sample",
    "Sampler",
    "ShutdownError",
    "SpatialQuery",
    "Stats",
    "Status",
    "StorageError",
    "TryAgain",
    "UnsupportedOperation",
    "ZarrMetadata",
    "max_concurrency",
    "set_log_level",
    "set_log_quiet",
]

EXCEPTIONS = [
    "TryAgain",
    "InvalidArgument",
    "NotFound",
    "DtypeMismatch",
    "RankMismatch",
    "StorageError",
    "DecodeError",
    "NativeCudaError",
    "OutOfMemory",
    "BudgetExceeded",
    "ShutdownError",
    "UnsupportedOperation",
    "PoolStarved",
]

FROZEN_DATACLASSES = [
    "Config",
    "Sample",
    "IndexQuery",
    "BatchInfo",
    "BatchSpec",
    "QueueLimits",
    "MetadataCache",
    "PlanLimits",
    "CpuLimits",
    "CudaLimits",
    "LatencyModel",
    "Metric",
    "Stats",
    "NgffImage",
    "NgffAxis",
    "NgffLevel",
    "NgffLimits",
    "Sampler",
    "SpatialQuery",
    "ResolvedSpatialQuery",
]

SLOTTED_CLASSES = [
    "Batch",
    "FileReader",
    "FileMetadataReader",
    "ZarrMetadata",
    "ChunkPlanner",
]

SPATIAL_NAMES = ["NgffImage", "NgffAxis", "NgffLevel", "NgffLimits", "Sampler", "SpatialQuery", "ResolvedSpatialQuery"]

LOG_NAMES = ["LOG_TRACE", "LOG_DEBUG", "LOG_INFO", "LOG_WARN", "LOG_ERROR", "LOG_FATAL"]


# ---- §1 public names --------------------------------------------------------------------


def test_original_all_has_49_names():
    assert len(ORIGINAL_ALL) == 49 == len(set(ORIGINAL_ALL))
    assert set(ORIGINAL_ALL) <= set(damacy.__all__)  # every one exported, damacy's beside them


@pytest.mark.parametrize("name", ORIGINAL_ALL)
def test_public_name_importable(name):
    assert hasattr(damacy, name), name
    namespace: dict = {}
    exec(f"from damacy import {name}", namespace)
    assert namespace[name] is getattr(damacy, name)


@pytest.mark.parametrize("name", ORIGINAL_ALL)
def test_public_name_listed_in_all(name):
    assert name in damacy.__all__


@pytest.mark.parametrize("name", FROZEN_DATACLASSES)
def test_value_type_is_frozen_dataclass(name):
    cls = getattr(damacy, name)
    assert dataclasses.is_dataclass(cls)
    assert cls.__dataclass_params__.frozen


@pytest.mark.parametrize("name", FROZEN_DATACLASSES)
def test_value_type_has_slots(name):
    cls = getattr(damacy, name)
    assert "__slots__" in cls.__dict__


@pytest.mark.parametrize("name", SLOTTED_CLASSES)
def test_component_class_has_slots(name):
    cls = getattr(damacy, name)
    assert isinstance(cls, type)
    assert not dataclasses.is_dataclass(cls)
    assert "__slots__" in cls.__dict__


def test_pipeline_is_a_context_manager_class():
    assert hasattr(damacy.Pipeline, "__enter__") and hasattr(damacy.Pipeline, "__exit__")


def test_batch_is_a_context_manager_and_dlpack_producer():
    for attr in ("__enter__", "__exit__", "__dlpack__", "__dlpack_device__", "release", "info"):
        assert hasattr(damacy.Batch, attr), attr
    assert "__slots__" in damacy.Batch.__dict__


@pytest.mark.parametrize("name", ["Dtype", "DeviceType", "Status", "NumaStrategy"])
def test_enum_is_intenum(name):
    assert issubclass(getattr(damacy, name), enum.IntEnum)


@pytest.mark.parametrize("name", SPATIAL_NAMES)
def test_spatial_names_reexported_from_spatial_module(name):
    import damacy._spatial as spatial

    assert getattr(spatial, name) is getattr(damacy, name)


def test_max_concurrency_returns_positive_int():
    n = damacy.max_concurrency()
    assert type(n) is int
    assert n >= 1


def test_version_is_a_string():
    assert isinstance(damacy.__version__, str)
    assert damacy.__version__


@pytest.mark.parametrize("name", LOG_NAMES)
def test_log_constant_is_int(name):
    assert type(getattr(damacy, name)) is int


def test_log_constants_run_trace_0_to_fatal_5():
    assert [getattr(damacy, n) for n in LOG_NAMES] == [0, 1, 2, 3, 4, 5]


def test_set_log_level_accepts_the_constants():
    for name in LOG_NAMES:
        assert damacy.set_log_level(getattr(damacy, name)) is None
    damacy.set_log_level(damacy.LOG_WARN)


def test_set_log_quiet_toggles(capfd):
    log = logging.getLogger("damacy")
    try:
        assert damacy.set_log_quiet(True) is None
        log.error("while quiet")
        assert "while quiet" not in capfd.readouterr().err
        assert damacy.set_log_quiet(False) is None
        log.error("heard again")
        assert "heard again" in capfd.readouterr().err
    finally:
        damacy.set_log_quiet(False)


def test_import_attaches_null_handler_to_damacy_logger():
    handlers = logging.getLogger("damacy").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)


def test_native_cuda_init_primary_exists():
    import damacy._native as native

    assert callable(native.cuda_init_primary)


# ---- §2 exceptions ----------------------------------------------------------------------


def test_damacy_error_is_a_runtime_error():
    assert issubclass(damacy.DamacyError, RuntimeError)


def test_damacy_error_subclasses_native_damacy_error():
    import damacy._native as native

    assert issubclass(damacy.DamacyError, native.DamacyError)
    assert issubclass(native.DamacyError, RuntimeError)


@pytest.mark.parametrize("name", EXCEPTIONS)
def test_exception_is_direct_subclass_of_damacy_error(name):
    assert getattr(damacy, name).__bases__ == (damacy.DamacyError,)


@pytest.mark.parametrize("name", EXCEPTIONS)
def test_exception_subclasses_no_other_damacy_exception(name):
    cls = getattr(damacy, name)
    for other in EXCEPTIONS:
        if other != name:
            assert not issubclass(cls, getattr(damacy, other)), (name, other)


def test_exception_count_is_13():
    assert len(EXCEPTIONS) == 13
    # the classes directly below DamacyError: the seed's 13 and damacy's own three (its
    # other errors are below the seed's)
    direct = {n for n in dir(damacy) if isinstance(c := getattr(damacy, n), type) and c.__bases__ == (damacy.DamacyError,)}
    assert direct == set(EXCEPTIONS) | {"BatchFailed", "DaemonUnavailable", "ProtocolError"}


def test_pool_starved_status_is_shutdown():
    assert damacy.PoolStarved.status == damacy.Status.SHUTDOWN
    assert damacy.PoolStarved("timed out").status == damacy.Status.SHUTDOWN


def test_pool_starved_is_not_a_shutdown_error():
    assert not issubclass(damacy.PoolStarved, damacy.ShutdownError)
    assert not issubclass(damacy.ShutdownError, damacy.PoolStarved)


def test_exception_message_is_its_args():
    err = damacy.NotFound("no such array")
    assert str(err) == "no such array"
    assert isinstance(err, RuntimeError)


def test_device_type_is_not_an_exception():
    """§17 #8: api.md lists DeviceType among the exceptions; the code has an IntEnum."""
    assert not issubclass(damacy.DeviceType, BaseException)


# ---- §3 enums ---------------------------------------------------------------------------

DTYPE_NAMES = ["F32", "BF16", "U8", "U16", "U32", "U64", "I8", "I16", "I32", "I64"]
FULL_NAMES = {
    "float32": "F32",
    "bfloat16": "BF16",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
}


def test_dtype_members():
    assert [m.name for m in damacy.Dtype] == DTYPE_NAMES


def test_dtype_formats_as_its_short_name_and_as_an_integer_with_an_integer_format():
    assert f"{damacy.Dtype.U16}" == str(damacy.Dtype.U16) == "u16" and f"{damacy.Dtype.U16:>5}" == "  u16"
    assert f"{damacy.Dtype.U16:d}" == "3" and f"{damacy.Dtype.I64:03d}" == "009"  # an IntEnum's value


def test_native_constants_are_the_documented_defaults():
    from damacy import _native

    assert (_native.DEFAULT_IO_THREADS, _native.DEFAULT_METADATA_IO_CONCURRENCY, _native.MAX_IO_THREADS) == (64, 64, 1024)
    assert _native.DEFAULT_IO_THREADS == damacy.Config(samples_per_batch=1, sample_shape=(1,)).n_io_threads
    assert damacy.__version__ == _native.__version__


def test_dtype_fixed_values_f32_0_bf16_1():
    assert damacy.Dtype.F32 == 0
    assert damacy.Dtype.BF16 == 1


def test_dtype_coerce_enum_returns_itself():
    for member in damacy.Dtype:
        assert damacy.Dtype.coerce(member) is member


def test_dtype_coerce_int_gives_member():
    for member in damacy.Dtype:
        assert damacy.Dtype.coerce(int(member)) is member


def test_dtype_coerce_bad_int_raises_value_error():
    bad = max(int(m) for m in damacy.Dtype) + 100
    with pytest.raises(ValueError):
        damacy.Dtype.coerce(bad)


@pytest.mark.parametrize("full", sorted(FULL_NAMES))
def test_dtype_coerce_full_names_any_case(full):
    member = damacy.Dtype[FULL_NAMES[full]]
    assert damacy.Dtype.coerce(full) is member
    assert damacy.Dtype.coerce(full.upper()) is member
    assert damacy.Dtype.coerce(full.capitalize()) is member


@pytest.mark.parametrize("short", DTYPE_NAMES)
def test_dtype_coerce_short_names_any_case(short):
    member = damacy.Dtype[short]
    assert damacy.Dtype.coerce(short.lower()) is member
    assert damacy.Dtype.coerce(short) is member
    assert damacy.Dtype.coerce(short.capitalize()) is member


def test_dtype_coerce_mixed_case_bfloat16():
    assert damacy.Dtype.coerce("BFloat16") is damacy.Dtype.BF16


def test_dtype_coerce_unknown_name_message():
    with pytest.raises(ValueError) as info:
        damacy.Dtype.coerce("nope")
    assert str(info.value) == "unknown dtype: 'nope'"


@pytest.mark.parametrize("name", ["float64", "f64", "bool", ""])
def test_dtype_coerce_rejects_other_names(name):
    with pytest.raises(ValueError, match="^unknown dtype: "):
        damacy.Dtype.coerce(name)


def test_device_type_members_and_values():
    assert [(m.name, int(m)) for m in damacy.DeviceType] == [("CPU", 1), ("CUDA", 2)]


def test_status_members():
    assert [m.name for m in damacy.Status] == [
        "OK",
        "AGAIN",
        "INVAL",
        "NOTFOUND",
        "DTYPE",
        "RANK",
        "IO",
        "DECODE",
        "CUDA",
        "OOM",
        "BUDGET",
        "SHUTDOWN",
        "UNSUPPORTED",
    ]


def test_status_values_are_distinct():
    assert len({int(m) for m in damacy.Status}) == 13


def test_numa_strategy_members():
    assert {m.name for m in damacy.NumaStrategy} == {"AUTO", "DISABLED", "PIN_TO"}


def test_numa_strategy_coerce_enum_and_int():
    for member in damacy.NumaStrategy:
        assert damacy.NumaStrategy.coerce(member) is member
        assert damacy.NumaStrategy.coerce(int(member)) is member


@pytest.mark.parametrize(
    "text, name",
    [
        ("auto", "AUTO"),
        ("AUTO", "AUTO"),
        ("disabled", "DISABLED"),
        ("Disabled", "DISABLED"),
        ("pin_to", "PIN_TO"),
        ("PIN_TO", "PIN_TO"),
        ("pin-to", "PIN_TO"),
        ("Pin-To", "PIN_TO"),
    ],
)
def test_numa_strategy_coerce_strings(text, name):
    assert damacy.NumaStrategy.coerce(text) is damacy.NumaStrategy[name]


def test_numa_strategy_coerce_unknown_message():
    with pytest.raises(ValueError) as info:
        damacy.NumaStrategy.coerce("nope")
    assert str(info.value) == "unknown numa strategy: 'nope'"


# ---- doctests ---------------------------------------------------------------------------


def test_doctests_in_the_package_pass():
    result = doctest.testmod(damacy, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 1
    assert result.failed == 0
