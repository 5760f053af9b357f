"""The exceptions damacy raises, shared by the engine, the daemon and the client.

The hierarchy is the seed API's: :class:`DamacyError` (a ``RuntimeError``) and thirteen
classes directly below it, one per :class:`~damacy_protocol.enums.Status`, none below
another. Every error carries its ``status`` and ``what`` (the stage that failed:
``"create"``, ``"push"``, ``"pop"``, ``"closed"``); an error that concerns one sample or
array also carries the ``uri`` (and, where known, the ``sample``, the ``path`` of the file
and the ``chunk``) as attributes as well as in its message, so a training loop can log or
skip it without parsing text. The fields are strings and tuples, so the daemon sends an
error to its client and the client raises the same class again (:func:`to_wire` /
:func:`from_wire`).

damacy's own classes sit below those: :class:`OutOfBounds` is an :class:`InvalidArgument`,
:class:`MetadataError` a :class:`DecodeError`, :class:`PipelineDrained` and
:class:`SlotsHeld` are :class:`PoolStarved` (raised at once, where waiting could not help).

(Over 400 lines: one job, the exceptions; the classes, their kinds on the wire and the
conversions to and from plain data are one table's three views.)
"""

from __future__ import annotations

import enum
from typing import Any

from damacy_protocol.enums import Status, as_status


class DamacyError(RuntimeError):
    """Base class of every damacy error; ``status`` (a :class:`Status`) says what kind,
    ``what`` names the stage that failed.

    ``DamacyError(reason, *, uri=, sample=, path=, chunk=)``: the message is the reason
    after what it concerns (``"sample Sample('a.zarr', [0:8]): no zarr.json"``); the parts
    stay readable as attributes (``reason`` alone, without the context).

    >>> e = NotFound("no zarr.json", uri="/data/a.zarr")
    >>> str(e), e.status.name, e.uri
    ('/data/a.zarr: no zarr.json', 'NOTFOUND', '/data/a.zarr')
    """

    status: Status = Status.SHUTDOWN
    what: str = ""
    #: on the error a pop raises for a failed batch (``on_error="stop"`` or ``"raise"``):
    #: every (sample, error) of that batch, and every sample it consumed (good ones included)
    batch_errors: tuple[tuple[Any, DamacyError], ...] = ()
    batch_samples: tuple[Any, ...] = ()

    def __init__(
        self,
        *args: Any,
        uri: str | None = None,
        sample: Any = None,
        path: str | None = None,
        chunk: tuple[int, ...] | None = None,
        status: Status | int | None = None,
        what: str | None = None,
    ) -> None:
        self.reason = str(args[0]) if args else ""
        self.uri = None if uri is None else redact_uri(uri)
        self.sample = None if sample is None else str(sample)
        self.path = None if path is None else redact_uri(path)
        self.chunk = None if chunk is None else tuple(int(c) for c in chunk)
        if status is not None:
            self.status = as_status(status)
        if what is not None:
            self.what = what
        if len(args) > 1 and not self._has_context():
            super().__init__(*args)
        else:
            super().__init__(self._message())

    def _has_context(self) -> bool:
        return self.uri is not None or self.sample is not None or self.path is not None or self.chunk is not None

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

    def with_context(self, *, uri: str | None = None, sample: Any = None) -> DamacyError:
        """Fill in the uri and sample where they were unknown; returns ``self``."""
        if self.uri is None and uri is not None:
            self.uri = redact_uri(uri)
        if self.sample is None and sample is not None:
            self.sample = str(sample)
        self.args = (self._message(),)
        return self

    def copy(self, *, keep_sample: bool = True) -> DamacyError:
        """A fresh instance (its own traceback): for an error kept and raised again (a
        stopped pipeline's, naming its sample as before), or without its sample
        (``keep_sample=False``) for one error given to each of several samples."""
        wire = to_wire(self)
        err = from_wire(wire if keep_sample else {**wire, "sample": None})
        if type(err) is not type(self):
            err = _same_class(type(self), err)
        return err

    def __reduce__(self):
        return (_rebuild, (type(self), to_wire(self)))


def _shown(text: str) -> str:
    """``text`` as a message shows it: a NUL (which no path holds, and which ends a C string
    or a log line early) escaped; the attributes keep the text as given."""
    return text.replace("\0", "\\0") if "\0" in text else text


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


# -- the seed's classes: each directly below DamacyError, one per status -----------------


class TryAgain(DamacyError):
    """A call that must not block would have to (the lookahead is full)."""

    status = Status.AGAIN


class InvalidArgument(DamacyError):
    """A value given by the caller is wrong: a box, an index, a uri, a component setting, a
    pipeline built from parts that do not fit together (a cache below its floor)."""

    status = Status.INVAL


class NotFound(DamacyError):
    """The uri names no array (no zarr.json, no such file or directory)."""

    status = Status.NOTFOUND


class DtypeMismatch(DamacyError):
    """The array's data type cannot be read into a batch (complex, strings, raw bits)."""

    status = Status.DTYPE


class RankMismatch(DamacyError):
    """A sample names a different number of axes than its array has."""

    status = Status.RANK


class StorageError(DamacyError):
    """The storage failed to deliver bytes that exist (permission, I/O error)."""

    status = Status.IO


class DecodeError(DamacyError):
    """Chunk or shard bytes are corrupt: checksum mismatch, truncated data, a bad frame."""

    status = Status.DECODE


class NativeCudaError(DamacyError):
    """A CUDA driver or runtime call failed."""

    status = Status.CUDA


class OutOfMemory(DamacyError):
    """The system refused memory (not a configured cap: that is :class:`BudgetExceeded`)."""

    status = Status.OOM


class BudgetExceeded(DamacyError):
    """A configured cap is too small for what is asked of it: a memory budget for the
    batches it must hold, a chunk larger than the chunk caps, a batch of more chunks than
    ``PlanLimits.max_chunks``. Raise the cap (the message names it) or ask for less."""

    status = Status.BUDGET


class ShutdownError(DamacyError):
    """The pipeline was closed, or stopped after an error at ``pop`` (every later call says
    so); build a new one."""

    status = Status.SHUTDOWN


class UnsupportedOperation(DamacyError):
    """The array or the request uses something damacy does not do: a codec, a chunk grid, a
    storage scheme, a spatial query that needs resampling."""

    status = Status.UNSUPPORTED


class PoolStarved(DamacyError):
    """``pop()`` got no batch in time (``pop_timeout_s``). Usually the loop still holds
    earlier batches (or tensors made from them), so their memory cannot be filled again:
    release them, or copy what must be kept. Not terminal: the next ``pop()`` waits for the
    same batch."""

    status = Status.SHUTDOWN


# -- damacy's own, below those ---------------------------------------------------------------


class OutOfBounds(InvalidArgument, IndexError):
    """A box or index lies outside the array (and ``out_of_bounds`` does not pad)."""


class MetadataError(DecodeError):
    """The array's zarr.json (or .zarray) is malformed or contradicts the Zarr specification."""


class PipelineDrained(PoolStarved):
    """``pop()`` was called with nothing pushed, or after every pushed sample was delivered:
    no batch can come, so it is raised at once rather than after the timeout.

    ``skipped`` (``on_error="skip"``): samples skipped that no batch lists, with their errors:
    those of batches that ended with every sample skipped once the input ran out, after the
    last batch was handed out."""

    skipped: tuple[tuple[Any, DamacyError], ...] = ()


class SlotsHeld(PoolStarved):
    """``pop()`` cannot get a batch because every batch slot is held by batches that were not
    released, or by arrays exported from them: raised at once, whatever the timeout (no batch
    can come until the caller lets one go)."""


class BatchFailed(DamacyError):
    """A batch failed for a reason that is no sample's fault (a bug: the cause is chained);
    ``batch_samples`` lists the samples it consumed."""

    def __init__(self, reason: str = "", batch_samples: tuple[Any, ...] = (), **context: Any) -> None:
        super().__init__(reason, **context)
        self.batch_samples = tuple(batch_samples)


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

    DAMACY_ERROR = "DamacyError"
    TRY_AGAIN = "TryAgain"
    INVALID_ARGUMENT = "InvalidArgument"
    NOT_FOUND = "NotFound"
    DTYPE_MISMATCH = "DtypeMismatch"
    RANK_MISMATCH = "RankMismatch"
    STORAGE_ERROR = "StorageError"
    DECODE_ERROR = "DecodeError"
    NATIVE_CUDA_ERROR = "NativeCudaError"
    OUT_OF_MEMORY = "OutOfMemory"
    BUDGET_EXCEEDED = "BudgetExceeded"
    SHUTDOWN_ERROR = "ShutdownError"
    UNSUPPORTED_OPERATION = "UnsupportedOperation"
    POOL_STARVED = "PoolStarved"
    OUT_OF_BOUNDS = "OutOfBounds"
    METADATA_ERROR = "MetadataError"
    PIPELINE_DRAINED = "PipelineDrained"
    SLOTS_HELD = "SlotsHeld"
    BATCH_FAILED = "BatchFailed"
    DAEMON_UNAVAILABLE = "DaemonUnavailable"
    PROTOCOL_ERROR = "ProtocolError"
    UNKNOWN_SESSION = "UnknownSession"


#: the class of each kind (every class damacy sends over the wire)
ERRORS: dict[ErrorKind, type[DamacyError]] = {
    ErrorKind.DAMACY_ERROR: DamacyError,
    ErrorKind.TRY_AGAIN: TryAgain,
    ErrorKind.INVALID_ARGUMENT: InvalidArgument,
    ErrorKind.NOT_FOUND: NotFound,
    ErrorKind.DTYPE_MISMATCH: DtypeMismatch,
    ErrorKind.RANK_MISMATCH: RankMismatch,
    ErrorKind.STORAGE_ERROR: StorageError,
    ErrorKind.DECODE_ERROR: DecodeError,
    ErrorKind.NATIVE_CUDA_ERROR: NativeCudaError,
    ErrorKind.OUT_OF_MEMORY: OutOfMemory,
    ErrorKind.BUDGET_EXCEEDED: BudgetExceeded,
    ErrorKind.SHUTDOWN_ERROR: ShutdownError,
    ErrorKind.UNSUPPORTED_OPERATION: UnsupportedOperation,
    ErrorKind.POOL_STARVED: PoolStarved,
    ErrorKind.OUT_OF_BOUNDS: OutOfBounds,
    ErrorKind.METADATA_ERROR: MetadataError,
    ErrorKind.PIPELINE_DRAINED: PipelineDrained,
    ErrorKind.SLOTS_HELD: SlotsHeld,
    ErrorKind.BATCH_FAILED: BatchFailed,
    ErrorKind.DAEMON_UNAVAILABLE: DaemonUnavailable,
    ErrorKind.PROTOCOL_ERROR: ProtocolError,
    ErrorKind.UNKNOWN_SESSION: UnknownSession,
}
_KINDS = {cls: kind for kind, cls in ERRORS.items()}

#: the class of each status, for an error that names only its status
STATUS_ERRORS: dict[Status, type[DamacyError]] = {
    Status.AGAIN: TryAgain,
    Status.INVAL: InvalidArgument,
    Status.NOTFOUND: NotFound,
    Status.DTYPE: DtypeMismatch,
    Status.RANK: RankMismatch,
    Status.IO: StorageError,
    Status.DECODE: DecodeError,
    Status.CUDA: NativeCudaError,
    Status.OOM: OutOfMemory,
    Status.BUDGET: BudgetExceeded,
    Status.SHUTDOWN: ShutdownError,
    Status.UNSUPPORTED: UnsupportedOperation,
}


def kind_of(err: BaseException) -> ErrorKind:
    """The kind of ``err``: that of the first class in its MRO the wire knows (a subclass
    defined elsewhere is its damacy base; any other exception a DamacyError)."""
    for cls in type(err).__mro__:
        kind = _KINDS.get(cls)
        if kind is not None:
            return kind
    return ErrorKind.DAMACY_ERROR


def to_wire(err: BaseException) -> dict[str, Any]:
    """An error's fields as plain data (for the wire or for pickling); an exception that is
    no DamacyError travels as one, its message the reason."""
    if not isinstance(err, DamacyError):
        return {"kind": ErrorKind.DAMACY_ERROR.value, "reason": str(err) or type(err).__name__}
    return {
        "kind": kind_of(err).value,
        "reason": err.reason,
        "uri": err.uri,
        "sample": err.sample,
        "path": err.path,
        "chunk": None if err.chunk is None else list(err.chunk),
        "status": int(err.status),
        "what": err.what,
    }


def from_wire(data: dict[str, Any]) -> DamacyError:
    """Rebuild the error :func:`to_wire` described; an unknown kind becomes the class of its
    status (plain :class:`DamacyError` without one)."""
    try:
        cls = ERRORS[ErrorKind(data.get("kind", ""))]
    except ValueError:
        status = data.get("status")
        cls = STATUS_ERRORS.get(as_status(status), DamacyError) if status is not None else DamacyError
    chunk = data.get("chunk")
    err = cls(
        data.get("reason", "unknown error"),
        uri=data.get("uri"),
        sample=data.get("sample"),
        path=data.get("path"),
        chunk=None if chunk is None else tuple(chunk),
    )
    status = data.get("status")
    if status is not None and as_status(status) != type(err).status:
        err.status = as_status(status)
    if data.get("what"):
        err.what = data["what"]
    return err


def _same_class(cls: type[DamacyError], err: DamacyError) -> DamacyError:
    """``err``'s fields in an instance of ``cls`` (a subclass defined elsewhere)."""
    try:
        out = cls(err.reason, uri=err.uri, sample=err.sample, path=err.path, chunk=err.chunk)
    except TypeError:  # a subclass with a signature of its own
        return err
    out.status, out.what = err.status, err.what
    return out


def _rebuild(cls: type[DamacyError], data: dict[str, Any]) -> DamacyError:
    err = from_wire(data)
    return err if type(err) is cls else _same_class(cls, err)


def stage(err: DamacyError, what: str) -> DamacyError:
    """``err`` with ``what`` set to ``what`` unless it names its stage already; returns it."""
    if not err.what:
        err.what = what
    return err
