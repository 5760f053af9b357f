"""damacy: fast, dependable n-dimensional Zarr data for GPU training.

The one import users write; everything public is re-exported here. The seed API's names
(``damacy.Pipeline``, ``Config``, ``Sample``, the components, limits, errors, enums, stats and
spatial queries) mean what its documents say; damacy's own (samplers, ``read``, the daemon
client, ``MultiPipeline``) add to them (docs/seed.md lists every difference).

>>> import damacy
>>> damacy.Sample("cell.zarr", [(0, 64), (0, 256), (0, 256)]).aabb
((0, 64), (0, 256), (0, 256))
>>> damacy.Dtype.coerce("bfloat16") is damacy.Dtype.BF16
True
"""

from typing import TYPE_CHECKING

from damacy import _native
from damacy._native import max_concurrency
from damacy.pipeline import Pipeline
from damacy_protocol.config import Config
from damacy_protocol.enums import BoundsPolicy, DeviceType, Dtype, ErrorPolicy, NumaStrategy, Status
from damacy_protocol.errors import (
    BatchFailed,
    BudgetExceeded,
    DaemonUnavailable,
    DamacyError,
    DecodeError,
    DtypeMismatch,
    InvalidArgument,
    MetadataError,
    NativeCudaError,
    NotFound,
    OutOfBounds,
    OutOfMemory,
    PipelineDrained,
    PoolStarved,
    ProtocolError,
    RankMismatch,
    ShutdownError,
    SlotsHeld,
    StorageError,
    TryAgain,
    UnsupportedOperation,
)
from damacy_protocol.limits import (
    BatchSpec,
    CpuLimits,
    CudaLimits,
    LatencyModel,
    MetadataCache,
    NgffLimits,
    PlanLimits,
    QueueLimits,
)
from damacy_protocol.samples import IndexQuery, Padding, ResolvedSpatialQuery, Sample
from damacy_protocol.stats import Metric, Stats
from damacy_runtime.batch import Batch, BatchInfo
from damacy_runtime.logsink import (  # the LOG_ levels: module attributes outside __all__, as the seed API has them
    LOG_DEBUG,  # noqa: F401
    LOG_ERROR,  # noqa: F401
    LOG_FATAL,  # noqa: F401
    LOG_INFO,  # noqa: F401
    LOG_TRACE,  # noqa: F401
    LOG_WARN,  # noqa: F401
    set_log_level,
    set_log_quiet,
)
from damacy_runtime.logsink import (
    install as _install_log_sink,
)

__version__ = _native.__version__  # (one home: the package's version, as the seed API's _native has it)

#: the rest of the API, imported on first use: a daemon client never loads the engine (nor
#: its codec libraries), and an embedded pipeline never loads the client's transport
_LAZY = {
    "RemotePipeline": "damacy_client.client",
    "EmbeddedPipeline": ("damacy_server.pipeline", "Pipeline"),
    "FileMetadataReader": "damacy_server.store.file",
    "FileReader": "damacy_server.store.file",
    "ZarrMetadata": "damacy_server.plan.resolve",
    "ChunkPlanner": "damacy_server.plan.planner",
    "CpuExecutor": "damacy_server.cpu.executor",
    "CudaExecutor": "damacy_server.cuda.executor",
    "NgffImage": "damacy_server.spatial",
    "NgffAxis": "damacy_protocol.spatial",
    "NgffLevel": "damacy_protocol.spatial",
    "Sampler": "damacy_protocol.spatial",
    "SpatialQuery": "damacy_protocol.spatial",
    "open_array": "damacy_server.read",
    "open_image": "damacy_server.read",
    "open_plate": "damacy_server.read",
    "read": "damacy_server.read",
    "RemoteStores": "damacy_server.store.remote",
    "RandomBoxes": "damacy.samplers",
    "GridBoxes": "damacy.samplers",
    "Shuffled": "damacy.samplers",
    "split_chunks": "damacy.splits",
    "Split": "damacy.splits",
    "chunk_windows": "damacy.windows",
    "MultiSample": "damacy.multi",
    "MultiPipeline": "damacy.multi",
    "MultiBatch": "damacy.multi",
}

if TYPE_CHECKING:  # the same names, for type checkers and the import contracts (tests check both agree)
    from damacy.multi import MultiBatch, MultiPipeline, MultiSample
    from damacy.samplers import GridBoxes, RandomBoxes, Shuffled
    from damacy.splits import Split, split_chunks
    from damacy.windows import chunk_windows
    from damacy_client.client import RemotePipeline
    from damacy_protocol.spatial import NgffAxis, NgffLevel, Sampler, SpatialQuery
    from damacy_server.cpu.executor import CpuExecutor
    from damacy_server.cuda.executor import CudaExecutor
    from damacy_server.pipeline import Pipeline as EmbeddedPipeline
    from damacy_server.plan.planner import ChunkPlanner
    from damacy_server.plan.resolve import ZarrMetadata
    from damacy_server.read import open_array, open_image, open_plate, read
    from damacy_server.spatial import NgffImage
    from damacy_server.store.file import FileMetadataReader, FileReader
    from damacy_server.store.remote import RemoteStores


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'damacy' has no attribute {name!r}")
    import importlib

    module, attr = where if isinstance(where, tuple) else (where, name)
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(globals()))


# the seed API's public names (its ``__all__``), then damacy's own
__all__ = [
    "Batch", "BatchInfo", "BatchSpec", "BudgetExceeded", "ChunkPlanner", "Config", "CpuExecutor", "CpuLimits",
    "CudaExecutor", "CudaLimits", "DamacyError", "DecodeError", "DeviceType", "Dtype", "DtypeMismatch",
    "FileMetadataReader", "FileReader", "IndexQuery", "InvalidArgument", "LatencyModel", "MetadataCache", "Metric",
    "NativeCudaError", "NgffAxis", "NgffImage", "NgffLevel", "NgffLimits", "NotFound", "NumaStrategy", "OutOfMemory",
    "Pipeline", "PlanLimits", "PoolStarved", "QueueLimits", "RankMismatch", "ResolvedSpatialQuery", "Sample",
    "Sampler", "ShutdownError", "SpatialQuery", "Stats", "Status", "StorageError", "TryAgain", "UnsupportedOperation",
    "ZarrMetadata", "max_concurrency", "set_log_level", "set_log_quiet",
    # damacy's own
    "BatchFailed", "BoundsPolicy", "DaemonUnavailable", "EmbeddedPipeline", "ErrorPolicy", "GridBoxes", "MetadataError", "MultiBatch",
    "MultiPipeline", "MultiSample", "OutOfBounds", "Padding", "PipelineDrained", "ProtocolError", "RandomBoxes",
    "RemotePipeline", "RemoteStores", "Shuffled", "SlotsHeld", "Split", "chunk_windows", "open_array", "open_image",
    "open_plate", "read", "split_chunks",
]

# the public classes say they are damacy's (their reprs, pickles by name and doctest find them here)
for _obj in (
    Config, DeviceType, Dtype, NumaStrategy, Status, ErrorPolicy, BoundsPolicy, BatchSpec, CpuLimits, CudaLimits, LatencyModel, MetadataCache,
    NgffLimits, PlanLimits, QueueLimits, IndexQuery, Padding, ResolvedSpatialQuery, Sample, Metric, Stats, Batch,
    BatchInfo, DamacyError, TryAgain, InvalidArgument, NotFound, DtypeMismatch, RankMismatch, StorageError,
    DecodeError, NativeCudaError, OutOfMemory, BudgetExceeded, ShutdownError, UnsupportedOperation, PoolStarved,
    OutOfBounds, MetadataError, PipelineDrained, SlotsHeld, BatchFailed, DaemonUnavailable, ProtocolError,
    set_log_level, set_log_quiet,
):
    _obj.__module__ = "damacy"
del _obj

_install_log_sink()
