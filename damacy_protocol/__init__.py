"""damacy's wire contract: messages and errors shared by the daemon and its clients.

This package does no I/O and imports nothing heavy, so a client can import it cheaply.
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
    StorageError,
    UnsupportedOperation,
)

__all__ = [
    "BudgetExceeded",
    "DaemonUnavailable",
    "DamacyError",
    "DecodeError",
    "InvalidArgument",
    "MetadataError",
    "NotFound",
    "OutOfBounds",
    "PipelineDrained",
    "ProtocolError",
    "StorageError",
    "UnsupportedOperation",
]
