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
from damacy_client.client import RemotePipeline
from damacy_server.pipeline import Pipeline as EmbeddedPipeline
from damacy_server.pipeline import QueueLimits
from damacy_server.plan import BatchSpec, ChunkPlanner, PlanLimits
from damacy_server.read import open_array, read
from damacy_server.resolve import MetadataCache, ZarrMetadata
from damacy_server.store.file import FileMetadataReader, FileReader

__version__ = "0.1.0"


def Pipeline(config: Config | None = None, *, endpoint: str | None = None, **parts):  # noqa: N802 - a class to its users
    """A streaming pipeline: embedded in this process, or run by damacyd.

    ``Pipeline(config)`` runs the engine here; ``Pipeline(config, endpoint="ipc://...")``
    (or with ``DAMACY_ENDPOINT`` set) is a client of the node's damacyd, with the same
    behaviour. Composed from parts (``planner=..., executor=..., output=..., queues=...``)
    it is always embedded.
    """
    import os

    if endpoint is None and not parts:
        endpoint = os.environ.get("DAMACY_ENDPOINT") or None
    if endpoint is not None:
        if parts:
            raise InvalidArgument(f"a daemon pipeline takes a Config only, not {sorted(parts)}")
        return RemotePipeline(config, endpoint)
    return EmbeddedPipeline(config, **parts)

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
    "EmbeddedPipeline",
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
