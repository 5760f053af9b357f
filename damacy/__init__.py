"""damacy: fast, dependable n-dimensional Zarr v3 data for GPU training.

The one import users write; everything public is re-exported here.
"""

from typing import TYPE_CHECKING

from damacy.pipeline import Pipeline
from damacy_protocol.config import Config
from damacy_protocol.errors import (
    BatchFailed,
    BudgetExceeded,
    DaemonUnavailable,
    DamacyError,
    DecodeError,
    InvalidArgument,
    MetadataError,
    NotFound,
    OutOfBounds,
    PipelineDrained,
    ProtocolError,
    SampleError,
    SlotsHeld,
    StorageError,
    UnsupportedError,
)
from damacy_protocol.samples import IndexQuery, Padding, Sample
from damacy_runtime.batch import Batch, BatchInfo

#: the rest of the API, imported on first use: a daemon client never loads the engine (nor
#: its codec libraries), and an embedded pipeline never loads the client's transport
_LAZY = {
    "RemotePipeline": "damacy_client.client",
    "EmbeddedPipeline": ("damacy_server.pipeline", "Pipeline"),
    "QueueLimits": "damacy_server.pipeline",
    "CpuExecutor": "damacy_server.cpu.executor",
    "CpuLimits": "damacy_server.cpu.executor",
    "BatchSpec": "damacy_server.plan.planner",
    "ChunkPlanner": "damacy_server.plan.planner",
    "PlanLimits": "damacy_server.plan.reads",
    "open_array": "damacy_server.read",
    "open_image": "damacy_server.read",
    "open_plate": "damacy_server.read",
    "read": "damacy_server.read",
    "MetadataCache": "damacy_server.plan.resolve",
    "ZarrMetadata": "damacy_server.plan.resolve",
    "FileMetadataReader": "damacy_server.store.file",
    "FileReader": "damacy_server.store.file",
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
    from damacy_server.cpu.executor import CpuExecutor, CpuLimits
    from damacy_server.pipeline import Pipeline as EmbeddedPipeline
    from damacy_server.pipeline import QueueLimits
    from damacy_server.plan.planner import BatchSpec, ChunkPlanner
    from damacy_server.plan.reads import PlanLimits
    from damacy_server.plan.resolve import MetadataCache, ZarrMetadata
    from damacy_server.read import open_array, open_image, open_plate, read
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
    return sorted(__all__)


__version__ = "0.1.0"


__all__ = [
    "Batch",
    "BatchInfo",
    "BatchSpec",
    "ChunkPlanner",
    "Config",
    "CpuExecutor",
    "CpuLimits",
    "FileMetadataReader",
    "FileReader",
    "IndexQuery",
    "Pipeline",
    "PlanLimits",
    "QueueLimits",
    "RemotePipeline",
    "RemoteStores",
    "RandomBoxes",
    "GridBoxes",
    "Shuffled",
    "Split",
    "split_chunks",
    "chunk_windows",
    "Padding",
    "MultiSample",
    "MultiPipeline",
    "MultiBatch",
    "EmbeddedPipeline",
    "Sample",
    "BatchFailed",
    "BudgetExceeded",
    "DaemonUnavailable",
    "DamacyError",
    "DecodeError",
    "InvalidArgument",
    "MetadataCache",
    "MetadataError",
    "NotFound",
    "OutOfBounds",
    "PipelineDrained",
    "ProtocolError",
    "SampleError",
    "SlotsHeld",
    "StorageError",
    "UnsupportedError",
    "ZarrMetadata",
    "open_array",
    "open_image",
    "open_plate",
    "read",
    "__version__",
]
