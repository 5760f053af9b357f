"""damacy: fast, dependable n-dimensional Zarr v3 data for GPU training.

The one import users write; everything public is re-exported here.
"""

from damacy_protocol.errors import (
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
    StorageError,
    UnsupportedError,
)
from damacy_client.batch import Batch, BatchInfo
from damacy_protocol.config import Config
from damacy_protocol.samples import IndexQuery, Sample
from damacy_server.cpu import CpuExecutor, CpuLimits
from damacy_server.pipeline import Pipeline, QueueLimits
from damacy_server.plan import BatchSpec, ChunkPlanner, PlanLimits
from damacy_server.read import open_array, read
from damacy_server.resolve import MetadataCache, ZarrMetadata
from damacy_server.store.file import FileMetadataReader, FileReader

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
    "Sample",
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
    "StorageError",
    "UnsupportedError",
    "ZarrMetadata",
    "open_array",
    "read",
    "__version__",
]
