"""damacy: fast, dependable n-dimensional Zarr v3 data for GPU training.

The one import users write; everything public is re-exported here.
"""

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
    StorageError,
    UnsupportedError,
)
from damacy_protocol.samples import IndexQuery, Sample
from damacy_runtime.batch import Batch, BatchInfo

#: the rest of the API, imported on first use: a daemon client never loads the engine (nor
#: its codec libraries), and an embedded pipeline never loads the client's transport
_LAZY = {
    "RemotePipeline": "damacy_client.client",
    "EmbeddedPipeline": ("damacy_server.pipeline", "Pipeline"),
    "QueueLimits": "damacy_server.pipeline",
    "CpuExecutor": "damacy_server.cpu",
    "CpuLimits": "damacy_server.cpu",
    "BatchSpec": "damacy_server.plan",
    "ChunkPlanner": "damacy_server.plan",
    "PlanLimits": "damacy_server.reads",
    "open_array": "damacy_server.read",
    "read": "damacy_server.read",
    "MetadataCache": "damacy_server.resolve",
    "ZarrMetadata": "damacy_server.resolve",
    "FileMetadataReader": "damacy_server.store.file",
    "FileReader": "damacy_server.store.file",
}


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
        from damacy_client.client import RemotePipeline

        return RemotePipeline(config, endpoint)
    from damacy_server.pipeline import Pipeline as EmbeddedPipeline

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
    "StorageError",
    "UnsupportedError",
    "ZarrMetadata",
    "open_array",
    "read",
    "__version__",
]
