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
    SlotsHeld,
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
    "open_image": "damacy_server.read",
    "read": "damacy_server.read",
    "MetadataCache": "damacy_server.resolve",
    "ZarrMetadata": "damacy_server.resolve",
    "FileMetadataReader": "damacy_server.store.file",
    "FileReader": "damacy_server.store.file",
    "RemoteStores": "damacy_server.store.remote",
    "RandomBoxes": "damacy_runtime.samplers",
    "GridBoxes": "damacy_runtime.samplers",
    "Shuffled": "damacy_runtime.samplers",
    "Padding": "damacy_runtime.samplers",
    "MultiSample": "damacy_runtime.multi",
    "MultiPipeline": "damacy_runtime.multi",
    "MultiBatch": "damacy_runtime.multi",
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


_chosen: set[str] = set()  # what Pipeline() chose, logged once per process


def _say_once(what: str) -> None:
    if what not in _chosen:
        _chosen.add(what)
        import logging

        logging.getLogger("damacy").info("damacy: %s", what)


def _node_daemon() -> str | None:
    """The node's default endpoint when a damacyd answers there (in a folder of this user's
    own), else None."""
    import os

    from damacy_protocol.endpoint import check_private_folder, node_endpoint

    endpoint = node_endpoint()
    path = endpoint[len("ipc://") :]
    if not os.path.exists(path):
        return None
    try:
        check_private_folder(os.path.dirname(path))
    except InvalidArgument as e:
        _say_once(f"not using the socket at {path}: {e}")
        return None
    from damacy_runtime.probe import ping

    return endpoint if ping(endpoint, 0.5) else None


class _AnyPipeline(type):
    """``isinstance(p, damacy.Pipeline)`` holds for both kinds (they share PipelineAPI)."""

    def __instancecheck__(cls, obj) -> bool:
        from damacy_runtime.api import PipelineAPI

        return isinstance(obj, PipelineAPI)

    def __subclasscheck__(cls, sub) -> bool:
        from damacy_runtime.api import PipelineAPI

        return isinstance(sub, type) and issubclass(sub, PipelineAPI)


class Pipeline(metaclass=_AnyPipeline):
    """A streaming pipeline: run by the node's damacyd when one answers, else embedded here.

    ``Pipeline(config)`` uses the damacyd at ``$DAMACY_ENDPOINT`` when that is set, else the
    one at the node's default endpoint (``ipc:///tmp/damacy-UID/damacyd.sock``) when it
    answers, else runs the engine in this process; the choice is logged once (logger
    "damacy", level INFO). ``endpoint=...`` asks for that daemon; ``embedded=True`` runs here
    whatever answers, ``embedded=False`` requires a daemon. Composed from parts
    (``planner=..., executor=..., output=..., queues=...``) it is always embedded. Both kinds
    behave the same.
    """

    def __new__(cls, config: Config | None = None, *, endpoint: str | None = None, embedded: bool | None = None, **parts):
        return _make_pipeline(config, endpoint, embedded, parts)


def _make_pipeline(config: Config | None, endpoint: str | None, embedded: bool | None, parts: dict):
    import os

    if embedded and endpoint is not None:
        raise InvalidArgument("a pipeline is embedded or has an endpoint, not both")
    if parts and (endpoint is not None or embedded is False):
        raise InvalidArgument(f"a daemon pipeline takes a Config only, not {sorted(parts)}")
    if not parts and not embedded:
        if endpoint is None:
            endpoint = os.environ.get("DAMACY_ENDPOINT") or _node_daemon()
        if endpoint is None and embedded is False:
            from damacy_protocol.endpoint import node_endpoint

            raise DaemonUnavailable(f"no damacyd answers at {node_endpoint()} (and DAMACY_ENDPOINT is not set)")
    if endpoint is not None:
        from damacy_client.client import RemotePipeline

        pipe = RemotePipeline(config, endpoint)
        _say_once(f"using damacyd at {pipe.endpoint}")
        return pipe
    from damacy_server.pipeline import Pipeline as EmbeddedPipeline

    if not parts and not embedded:
        _say_once("no damacyd answers at the node's endpoint: running embedded")
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
    "RemoteStores",
    "RandomBoxes",
    "GridBoxes",
    "Shuffled",
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
    "read",
    "__version__",
]
