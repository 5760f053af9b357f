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
from damacy_server.read import open_array, read
from damacy_server.resolve import MetadataCache, ZarrMetadata

__version__ = "0.1.0"

__all__ = [
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
