"""The exceptions damacy raises, shared by the engine, the daemon and the client.

Every error that concerns one sample derives from :class:`SampleError` and carries the
uri (and, where known, the sample, the file and the chunk) as attributes as well as in its
message, so a training loop can log or skip it without parsing text. The classes hold only
strings and tuples, so the daemon can send them to a client and the client can raise the
same class again (see :func:`to_wire` / :func:`from_wire`).
"""

from __future__ import annotations

import enum
from typing import Any


class DamacyError(Exception):
    """Base class of every damacy error."""


def redact_uri(uri: str) -> str:
    """``uri`` as errors and logs show it: credentials in it (``user:secret@``) and a query or
    fragment (a signature, a token) replaced by ``***``; an icechunk uri's query and fragment
    (its version and path) and an abfs container (``container@account``) are kept."""
    if not isinstance(uri, str) or "://" not in uri:
        return uri
    scheme, rest = uri.split("://", 1)
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        if not (scheme.lower() in ("abfs", "abfss") and ":" not in user):
            netloc = f"***@{host}"
    if not scheme.lower().startswith("icechunk+"):
        for mark in "?#":
            if mark in netloc:
                netloc = netloc.split(mark, 1)[0] + f"{mark}***"
                slash = path = ""
                break
            if mark in path:
                path = path.split(mark, 1)[0] + f"{mark}***"
                break
    return f"{scheme}://{netloc}{slash}{path}"


class SampleError(DamacyError):
    """An error that concerns one sample or one array; the pipeline carries on after it.

    Attributes: ``uri`` (the array), ``sample`` (repr of the sample, when one is involved),
    ``path`` (the file or object that failed), ``chunk`` (chunk coordinates) and ``reason``
    (the cause, without the context). On the error a pop raises for a failed batch
    (``on_error="raise"``): ``batch_errors``, every (sample, error) of that batch, and
    ``batch_samples``, every sample it consumed (good ones included).
    """

    batch_errors: tuple[tuple[Any, SampleError], ...] = ()
    batch_samples: tuple[Any, ...] = ()

    def __init__(
        self,
        reason: str,
        *,
        uri: str | None = None,
        sample: Any = None,
        path: str | None = None,
        chunk: tuple[int, ...] | None = None,
    ) -> None:
        self.reason = reason
        self.uri = None if uri is None else redact_uri(uri)
        self.sample = None if sample is None else str(sample)
        self.path = None if path is None else redact_uri(path)
        self.chunk = None if chunk is None else tuple(int(c) for c in chunk)
        super().__init__(self._message())

    def _message(self) -> str:
        parts = []
        if self.sample is not None:
            parts.append(f"sample {_shown(self.sample)}")
        elif self.uri is not None:
            parts.append(_shown(self.uri))
        if self.chunk is not None:
            parts.append(f"chunk {list(self.chunk)}")
        if self.path is not None and self.path != self.uri:
            parts.append(f"file {_shown(self.path)}")
        where = ", ".join(parts)
        return f"{where}: {self.reason}" if where else self.reason

    def with_context(self, *, uri: str | None = None, sample: Any = None) -> SampleError:
        """Fill in the uri and sample where they were unknown; returns ``self``."""
        if self.uri is None and uri is not None:
            self.uri = redact_uri(uri)
        if self.sample is None and sample is not None:
            self.sample = str(sample)
        self.args = (self._message(),)
        return self

    def copy(self) -> SampleError:
        """A fresh instance (its own traceback and sample): for an error kept and raised again,
        one per sample."""
        return type(self)(self.reason, uri=self.uri, path=self.path, chunk=self.chunk)

    def __reduce__(self):
        return (_rebuild, (type(self), to_wire(self)))


def _shown(text: str) -> str:
    """``text`` as a message shows it: a NUL (which no path holds, and which ends a C string
    or a log line early) escaped; the attributes keep the text as given."""
    return text.replace("\0", "\\0") if "\0" in text else text


class NotFound(SampleError):
    """The uri names no array (no zarr.json, no such file or directory)."""


class InvalidArgument(SampleError, ValueError):
    """A value given by the caller is wrong: a box, an index, a dtype, a config field."""


class OutOfBounds(InvalidArgument, IndexError):
    """A box or index lies outside the array (and the policy does not pad)."""


class MetadataError(SampleError):
    """The array's zarr.json is malformed or contradicts the Zarr v3 specification."""


class UnsupportedError(SampleError):
    """The array uses a feature damacy does not read (a data type, codec or format version)."""


class DecodeError(SampleError):
    """Chunk or shard bytes are corrupt: checksum mismatch, truncated data, a bad frame."""


class StorageError(SampleError):
    """The storage failed to deliver bytes that exist (permission, I/O error)."""


class BatchFailed(DamacyError):
    """A batch failed for a reason that is no sample's fault (a bug: the cause is chained);
    ``batch_samples`` lists the samples it consumed. The stream goes on."""

    def __init__(self, reason: str, batch_samples: tuple[Any, ...] = ()) -> None:
        super().__init__(reason)
        self.batch_samples = batch_samples


class PipelineDrained(DamacyError):
    """``pop()`` was called with nothing pushed, or after every pushed sample was delivered.

    ``skipped`` (``on_error="skip"``): samples skipped that no batch lists, with their errors:
    those of batches that ended with every sample skipped once the input ran out, after the
    last batch was handed out."""

    skipped: tuple[tuple[Any, SampleError], ...] = ()


class SlotsHeld(DamacyError, TimeoutError):
    """``pop()`` cannot get a batch because every batch slot is held by batches that were not
    released, or by arrays exported from them. Raised at once, whatever the timeout (no
    batch can come until the caller lets one go); a :class:`TimeoutError`, as pops that
    wait out their timeout raise."""


class BudgetExceeded(DamacyError):
    """A memory budget is too small for what the configuration asks of it."""


class DaemonUnavailable(DamacyError):
    """The damacyd daemon cannot be reached or stopped answering."""


class ProtocolError(DamacyError):
    """A message broke the wire contract (malformed, unknown, or from another protocol version)."""


class UnknownSession(ProtocolError):
    """The daemon holds no session for this client (it restarted, or the client never said hello)."""


class UnexpectedReply(ProtocolError):
    """A reply to no pending request (late, after a timeout the client already gave up on)."""


class ErrorKind(enum.StrEnum):
    """What an error is, as the wire names it: its class's name. Code compares kinds, never
    messages."""

    SAMPLE_ERROR = "SampleError"
    NOT_FOUND = "NotFound"
    INVALID_ARGUMENT = "InvalidArgument"
    OUT_OF_BOUNDS = "OutOfBounds"
    METADATA_ERROR = "MetadataError"
    UNSUPPORTED_ERROR = "UnsupportedError"
    DECODE_ERROR = "DecodeError"
    STORAGE_ERROR = "StorageError"
    DAMACY_ERROR = "DamacyError"
    PIPELINE_DRAINED = "PipelineDrained"
    BATCH_FAILED = "BatchFailed"
    BUDGET_EXCEEDED = "BudgetExceeded"
    DAEMON_UNAVAILABLE = "DaemonUnavailable"
    PROTOCOL_ERROR = "ProtocolError"
    UNKNOWN_SESSION = "UnknownSession"
    TIMEOUT = "TimeoutError"


#: the class of each kind (every class damacy sends over the wire)
ERRORS: dict[ErrorKind, type[BaseException]] = {
    ErrorKind.SAMPLE_ERROR: SampleError,
    ErrorKind.NOT_FOUND: NotFound,
    ErrorKind.INVALID_ARGUMENT: InvalidArgument,
    ErrorKind.OUT_OF_BOUNDS: OutOfBounds,
    ErrorKind.METADATA_ERROR: MetadataError,
    ErrorKind.UNSUPPORTED_ERROR: UnsupportedError,
    ErrorKind.DECODE_ERROR: DecodeError,
    ErrorKind.STORAGE_ERROR: StorageError,
    ErrorKind.DAMACY_ERROR: DamacyError,
    ErrorKind.PIPELINE_DRAINED: PipelineDrained,
    ErrorKind.BATCH_FAILED: BatchFailed,
    ErrorKind.BUDGET_EXCEEDED: BudgetExceeded,
    ErrorKind.DAEMON_UNAVAILABLE: DaemonUnavailable,
    ErrorKind.PROTOCOL_ERROR: ProtocolError,
    ErrorKind.UNKNOWN_SESSION: UnknownSession,
    ErrorKind.TIMEOUT: TimeoutError,
}
_KINDS = {cls: kind for kind, cls in ERRORS.items()}


def kind_of(err: BaseException) -> ErrorKind:
    """The kind of ``err``: that of the first class in its MRO the wire knows (a
    SampleError subclass defined elsewhere is a SampleError; SlotsHeld a DamacyError; any
    other exception a DamacyError)."""
    for cls in type(err).__mro__:
        kind = _KINDS.get(cls)
        if kind is not None:
            return kind
    return ErrorKind.DAMACY_ERROR


def to_wire(err: SampleError) -> dict[str, Any]:
    """The fields of a sample error as plain data (for the wire or for pickling)."""
    return {
        "kind": kind_of(err).value,
        "reason": err.reason,
        "uri": err.uri,
        "sample": err.sample,
        "path": err.path,
        "chunk": None if err.chunk is None else list(err.chunk),
    }


def from_wire(data: dict[str, Any]) -> SampleError:
    """Rebuild the error :func:`to_wire` described; unknown kinds become :class:`SampleError`."""
    try:
        cls = ERRORS[ErrorKind(data.get("kind", ""))]
    except ValueError:
        cls = SampleError
    if not issubclass(cls, SampleError):
        cls = SampleError
    chunk = data.get("chunk")
    return cls(
        data.get("reason", "unknown error"),
        uri=data.get("uri"),
        sample=data.get("sample"),
        path=data.get("path"),
        chunk=None if chunk is None else tuple(chunk),
    )


def _rebuild(cls: type[SampleError], data: dict[str, Any]) -> SampleError:
    err = from_wire(data)
    if type(err) is not cls:  # a subclass defined elsewhere
        err = cls(err.reason, uri=err.uri, sample=err.sample, path=err.path, chunk=err.chunk)
    return err
