"""The messages between damacyd and its clients: msgspec Structs, msgpack on the wire.

Every request carries an ``id``; every reply names the request it answers in ``reply_to``.
The Structs are the single source of truth of the schema: a message that does not match
them fails to decode with an error naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from damacy_protocol.errors import ErrorKind
from damacy_protocol.stats import DaemonStats

#: bumped whenever a message changes incompatibly; checked at connect
PROTOCOL_VERSION = 11  # 11: pushes and releases are answered only when refused (see connection.py); 10: the seed API's errors (status, stage) and Config (as a dict), Stats; 6: samples carry flip and transpose; 7: and normalize; 8: a failed batch lists its errors, pushes fit the daemon's largest message; 9: a push says where the input raised (cut)


#: a request id: the client numbers its requests from 1; a reply names the one it answers
RequestId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=False):
    pass


# -- values inside messages -------------------------------------------------------------


class WireRange(msgspec.Struct, array_like=True, tag="r"):
    """A range of one axis: start, stop (None: the array's bound), step (None: 1)."""

    start: int | None = None
    stop: int | None = None
    step: int | None = None


class WireAt(msgspec.Struct, array_like=True, tag="i"):
    """One position of an axis (the axis is dropped)."""

    index: int


class WireList(msgspec.Struct, array_like=True, tag="l"):
    """An index list of an axis."""

    indices: list[int]


class WireRest(msgspec.Struct, array_like=True, tag="e"):
    """``...``: the axes not named."""


#: one entry of a selection (see :mod:`damacy_protocol.selection`)
WireEntry = WireRange | WireAt | WireList | WireRest


class WireSample(msgspec.Struct, array_like=True):
    """A Sample (``box`` true) or an IndexQuery, numbered by the client."""

    seq: int
    uri: str
    box: bool
    axes: list[WireEntry]
    level: int | None = None  # an NGFF image's level
    flip: list[int] = []  # axes of the result reversed
    transpose: list[int] | None = None  # the result's axes in this order
    normalize: tuple[float, float] | None = None  # (offset, scale): (x - offset) * scale
    refused: str | None = None  # why the client could not send it (too large a message): fails as a bad sample


class WireError(msgspec.Struct):
    """An error as data: ``kind`` names the exception's class (one the wire knows)."""

    kind: ErrorKind
    reason: str
    uri: str | None = None
    sample: str | None = None
    path: str | None = None
    chunk: list[int] | None = None
    seq: int | None = None  # the sample's number, for sample errors
    status: int | None = None  # its Status (None: its class's)
    what: str = ""  # the stage that failed


class SlotInfo(msgspec.Struct):
    """One batch slot, opened by the client once per session: a shared-memory segment
    ``name``; or, for a session on a GPU, device memory by its CUDA IPC ``handle`` (a direct
    allocation, offset 0; the stand-in device: the segment ``name``) with the interprocess
    events the daemon records when a batch in the slot is ready and the client records when
    it lets the slot go (``ready``, ``free``: their IPC handles)."""

    name: str
    nbytes: int
    handle: bytes = b""
    ready: bytes = b""
    free: bytes = b""


# -- client to daemon -------------------------------------------------------------------


class Hello(_Msg, tag="hello"):
    id: RequestId
    version: int
    pid: int
    rank: int | None
    config: dict[str, Any] | None = None  # Config.to_dict(); None: a control session (stats, warm), no pipeline
    device: str | None = None  # the UUID of config.device (indices differ between processes)


class Attached(_Msg, tag="attached"):
    """The client has mapped every slot segment (the daemon may unlink their names)."""

    id: RequestId


class Push(_Msg, tag="push"):
    """Answered only when refused (a ``Failed``); see :data:`damacy_protocol.connection.UNANSWERED`."""

    id: RequestId
    samples: list[WireSample]
    final: bool = False  # the client's input is exhausted (until it pushes again)
    cut: bool = False  # the input raised after these samples: batches end here (the client raises it)


class Pop(_Msg, tag="pop"):
    """Answered when the next batch is ready or the stream is drained (the client keeps its
    own timeouts and reuses a late answer for its next pop)."""

    id: RequestId
    # pushes the client had sent before this pop (they arrive before it), and whether its
    # input was exhausted then: the daemon calls the stream drained only when the last push
    # that said so is known
    pushes: int = 0
    final: bool = False


class Release(_Msg, tag="release"):
    """Answered only when refused (a ``Failed``), like :class:`Push`."""

    id: RequestId
    batch_id: int


class Stats(_Msg, tag="stats"):
    id: RequestId


class Warm(_Msg, tag="warm"):
    id: RequestId
    uris: list[str]
    shard_indexes: bool = False
    chunks: bool = False


class Ping(_Msg, tag="ping"):
    id: RequestId


class Bye(_Msg, tag="bye"):
    id: RequestId
    # a GPU session: the client has closed its mappings of the slots (the daemon may free
    # them now; otherwise only once the client's process is gone)
    unmapped: bool = False


# -- daemon to client -------------------------------------------------------------------


class Welcome(_Msg, tag="welcome"):
    reply_to: RequestId
    version: int
    session: str
    slots: list[SlotInfo]
    credits: int  # samples the client may have in the session at once (see connection.py)
    max_message_bytes: int = 0  # the largest message the daemon takes (0: not said); pushes are cut to fit


class Ack(_Msg, tag="ack"):
    reply_to: RequestId


class BatchReady(_Msg, tag="batch"):
    reply_to: RequestId
    batch_id: int
    slot: int
    count: int
    dtype: str
    seqs: list[int]
    errors: list[WireError]  # samples filled instead of read (on_error="fill")
    skipped: list[WireError]  # samples dropped and replaced (on_error="skip")


class Consumed(_Msg, tag="consumed"):
    """Progress of a pending pop: samples the daemon dropped (``on_error="skip"``), so the
    client may push as many new ones (the pop stays pending)."""

    reply_to: RequestId
    seqs: list[int]


class Failed(_Msg, tag="failed"):
    reply_to: RequestId
    error: WireError
    consumed: list[int] = []  # samples used up by the failed batch (on_error="raise")
    errors: list[WireError] = []  # every failure of that batch, each naming its sample's seq


class StatsReply(_Msg, tag="stats_reply"):
    reply_to: RequestId
    stats: DaemonStats


class WarmProgress(_Msg, tag="warm_progress"):
    reply_to: RequestId
    done: int
    total: int
    item: str


class WarmDone(_Msg, tag="warm_done"):
    """``chunks``: chunks in the chunk cache; ``left``: chunks that exist and did not fit
    (chunks never written are neither)."""

    reply_to: RequestId
    arrays: int
    shard_indexes: int
    chunks: int
    errors: list[WireError]
    left: int = 0


class Pong(_Msg, tag="pong"):
    """``session``: the session the daemon holds for the pinging client ("" for none): a
    client that holds another one knows the daemon restarted and its session is gone."""

    reply_to: RequestId
    session: str


class Goodbye(_Msg, tag="goodbye"):
    reply_to: RequestId


ClientMessage = Hello | Attached | Push | Pop | Release | Stats | Warm | Ping | Bye
DaemonMessage = Welcome | Ack | BatchReady | Consumed | Failed | StatsReply | WarmProgress | WarmDone | Pong | Goodbye

_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_daemon_decoder = msgspec.msgpack.Decoder(DaemonMessage)


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def decode_client(data: bytes) -> ClientMessage:
    """A client message; ``msgspec.DecodeError``/``ValidationError`` name what is wrong."""
    return _client_decoder.decode(data)


def decode_daemon(data: bytes) -> DaemonMessage:
    return _daemon_decoder.decode(data)


class _RequestOnly(msgspec.Struct, forbid_unknown_fields=False):
    id: RequestId


_id_decoder = msgspec.msgpack.Decoder(_RequestOnly)


class _HelloVersion(msgspec.Struct, tag_field="type", tag="hello", forbid_unknown_fields=False):
    version: int


_hello_version_decoder = msgspec.msgpack.Decoder(_HelloVersion)


def hello_version(data: bytes) -> int | None:
    """The version of a hello that did not decode as a whole (an older or newer peer's)."""
    try:
        return _hello_version_decoder.decode(data).version
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


def request_id(data: bytes) -> int | None:
    """The id of a request that did not decode as a whole, when it has a valid one."""
    try:
        return _id_decoder.decode(data).id
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
