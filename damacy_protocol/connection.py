"""The protocol as state machines, without I/O (in the manner of h11).

:class:`ClientConnection` and :class:`ServerConnection` turn messages into bytes and bytes
into messages, and check that each side keeps the contract: one transition table
(:data:`ALLOWED`, :data:`NEXT`) says which requests each session state admits and where
they lead (the version handshake first, pushes and pops only once the slots are attached,
nothing but pings after ``bye``); every reply answers an outstanding request (pushes and
releases are answered only when refused: :data:`UNANSWERED`); the client pushes only
samples it holds credits for. Transport (ZeroMQ) and threads live elsewhere;
these classes are tested on their own.

Both sides apply every message of the session's stream (:mod:`damacy_protocol.stream`):
credits, pushes and finality, pops in order, batches lent and released. The client knows
exactly what the daemon will accept, and the daemon refuses what breaks the stream.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import Any

import msgspec

from damacy_protocol import messages as m
from damacy_protocol.config import Config
from damacy_protocol.errors import ProtocolError, UnexpectedReply, UnknownSession
from damacy_protocol.stream import Stream
from damacy_protocol.wire import error_to_wire


class State(enum.Enum):
    NEW = "new"  # nothing sent yet
    HELLO_SENT = "hello-sent"
    WELCOMED = "welcomed"  # slots known, not yet attached
    READY = "ready"
    CLOSED = "closed"
    FAILED = "failed"


# The session's transition table: the requests a client may send in each state, and the
# state a request moves the session to (both sides apply the same table; Hello and Welcome
# are the handshake, a version mismatch fails the session).
_ANYTIME = frozenset({m.Ping, m.Stats, m.Warm, m.Bye})
ALLOWED: dict[State, frozenset[type]] = {
    State.NEW: frozenset({m.Hello, m.Ping}),
    State.HELLO_SENT: _ANYTIME,
    State.WELCOMED: _ANYTIME | {m.Attached},
    State.READY: _ANYTIME | {m.Push, m.Pop, m.Release},
    State.CLOSED: frozenset({m.Ping}),
    State.FAILED: frozenset({m.Ping}),
}
NEXT: dict[tuple[State, type], State] = {
    (State.NEW, m.Hello): State.HELLO_SENT,
    (State.WELCOMED, m.Attached): State.READY,
    **{(s, m.Bye): State.CLOSED for s in (State.HELLO_SENT, State.WELCOMED, State.READY)},
}


#: requests the daemon answers only when it refuses them (a ``Failed`` naming the request):
#: the two a session sends per batch besides its pop. The daemon handles a client's requests
#: in the order they were sent and answers a refusal as it handles it, so any answer to a
#: later request settles the earlier ones that were not refused (:meth:`ClientConnection.receive`)
UNANSWERED = (m.Push, m.Release)


def _refused(state: State, msg: Any) -> ProtocolError:
    """Why ``msg`` may not come in ``state`` (a request outside the table)."""
    name = type(msg).__name__.lower()
    if isinstance(msg, m.Hello):
        return ProtocolError("hello twice in one session")
    if state is State.NEW:
        return UnknownSession(f"{name} before hello (unknown session: start a new Pipeline)")
    if state in (State.CLOSED, State.FAILED):
        return ProtocolError(f"{name} after the session ended")
    if isinstance(msg, m.Attached):
        return ProtocolError("attached before welcome" if state is State.HELLO_SENT else "attached twice")
    return ProtocolError(f"{name} before the slots were attached")


def _advance(state: State, msg: Any) -> State:
    """The state after request ``msg`` (ProtocolError when the table does not allow it)."""
    if type(msg) not in ALLOWED[state]:
        raise _refused(state, msg)
    return NEXT.get((state, type(msg)), state)


class _Side:
    """What both connection classes hold: the session's state and its stream."""

    def __init__(self) -> None:
        self.state = State.NEW
        self.stream = Stream()

    @property
    def credits(self) -> int:
        return self.stream.credits

    @property
    def outstanding(self) -> int:
        return self.stream.outstanding


class ClientConnection(_Side):
    """The client's side of one session. Each request may carry a ``token`` (the caller's
    handle on its reply: the transport's waiting call), given back with every message that
    answers it: the one table of requests in flight."""

    def __init__(self) -> None:
        super().__init__()
        self._next_id = 1
        self.pending: dict[int, tuple[type, Any]] = {}  # request id -> (request type, token)
        self._unanswered: deque[int] = deque()  # ids of pending UNANSWERED requests, in the order sent
        self.welcome: m.Welcome | None = None
        self.answered: m.Pop | None = None  # the pop the last message received answered, if any
        #: the tokens of UNANSWERED requests the last message received settled (not refused)
        self.settled: list[Any] = []

    def _send(self, msg: Any, token: Any) -> bytes:
        self.pending[msg.id] = (type(msg), token)
        if isinstance(msg, UNANSWERED):
            self._unanswered.append(msg.id)
        return m.encode(msg)

    def new_id(self) -> int:
        i = self._next_id
        self._next_id += 1
        return i

    def hello(self, pid: int, rank: int | None, config: Config | None, device: str | None = None, token: Any = None) -> bytes:
        if self.state is not State.NEW:
            raise ProtocolError(f"hello in state {self.state.value}")
        self.state = State.HELLO_SENT
        self.hello_id = self.new_id()
        described = None if config is None else config.to_dict()
        return self._send(m.Hello(id=self.hello_id, version=m.PROTOCOL_VERSION, pid=pid, rank=rank, config=described, device=device), token)

    def send(self, msg: Any, token: Any = None) -> bytes:
        """Encode a request (not ``Hello``) built with :meth:`new_id`."""
        if isinstance(msg, m.Hello):
            raise ProtocolError("use hello() for the handshake")
        if self.state is State.NEW or (self.state is not State.READY and isinstance(msg, (m.Push, m.Pop, m.Release))):
            raise ProtocolError(f"{type(msg).__name__.lower()} before the session is ready (state {self.state.value})")
        if isinstance(msg, m.Ping) and self.state is State.CLOSED:
            raise ProtocolError("ping in state closed")
        state = _advance(self.state, msg)
        if isinstance(msg, m.Pop):
            msg.pushes = self.stream.pushes  # the pushes sent before it, as the stream counts them
        self.stream.request(msg)
        self.state = state
        return self._send(msg, token)

    def receive(self, data: bytes) -> tuple[m.DaemonMessage, Any]:
        """Decode a daemon message, check that it answers a pending request, and return it
        with that request's token (and, for the answer to a pop, see :attr:`answered`; for the
        pushes and releases it settles, :attr:`settled`)."""
        self.settled = []
        try:
            msg = m.decode_daemon(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ProtocolError(f"malformed message from the daemon: {e}") from None
        except RecursionError:
            raise ProtocolError("malformed message from the daemon: nested too deeply") from None
        self.settled = self._settle_before(msg.reply_to)
        found = self.pending.get(msg.reply_to)
        if found is None:
            raise UnexpectedReply(f"{type(msg).__name__} answers request {msg.reply_to}, which is not pending")
        kind, token = found
        if not isinstance(msg, (m.WarmProgress, m.Consumed)):  # progress comes before the answer
            del self.pending[msg.reply_to]
        self.answered = self.stream.reply(msg)
        if kind is m.Hello:
            if isinstance(msg, m.Welcome):
                if msg.version != m.PROTOCOL_VERSION:
                    self.state = State.FAILED
                    raise ProtocolError(
                        f"the daemon speaks protocol version {msg.version}, this client {m.PROTOCOL_VERSION}"
                    )
                self.welcome = msg
                self.stream.granted = msg.credits
                self.state = State.WELCOMED
            elif isinstance(msg, m.Failed):
                self.state = State.FAILED
            else:
                raise ProtocolError(f"expected welcome, got {type(msg).__name__}")
        return msg, token

    def _settle_before(self, reply_to: Any) -> list[Any]:
        """The tokens of the UNANSWERED requests sent before request ``reply_to``, taken off
        the pending table: an answer to a request comes after the daemon handled it, and so
        after it handled (and answered the refusals of) every request sent before it."""
        queue = self._unanswered
        if not queue or not isinstance(reply_to, int) or queue[0] >= reply_to:
            return []
        out = []
        while queue and queue[0] < reply_to:
            found = self.pending.pop(queue.popleft(), None)
            if found is not None:  # (None: refused, and answered so, already)
                out.append(found[1])
        return out

    def abandon(self) -> list[Any]:
        """Forget every request in flight (the daemon is gone); returns their tokens."""
        tokens = [token for _, token in self.pending.values()]
        self.pending.clear()
        self._unanswered.clear()
        return tokens


def _other_version(version: int) -> str:
    return (
        f"the client speaks protocol version {version}, this daemon {m.PROTOCOL_VERSION}; "
        "install the same damacy version on both sides"
    )


class ServerConnection(_Side):
    """The daemon's side of one session (one client identity)."""

    def __init__(self) -> None:
        super().__init__()
        self.hello: m.Hello | None = None

    def receive(self, data: bytes) -> m.ClientMessage:
        """Decode a client message and check it may come now; :class:`ProtocolError` says why
        not (the daemon answers with it and carries on)."""
        try:
            msg = m.decode_client(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            version = m.hello_version(data)
            if version is not None and version != m.PROTOCOL_VERSION:  # another version's hello
                self.state = State.FAILED
                raise ProtocolError(_other_version(version)) from None
            raise ProtocolError(f"malformed message: {e}") from None
        except RecursionError:
            raise ProtocolError("malformed message: nested too deeply") from None
        state = _advance(self.state, msg)  # a liveness probe needs no session: Ping always passes
        if isinstance(msg, m.Hello):
            if msg.version != m.PROTOCOL_VERSION:
                self.state = State.FAILED
                raise ProtocolError(_other_version(msg.version))
            self.hello = msg
        self.stream.request(msg)  # a push beyond the credits, a release of a batch not held: refused whole
        self.state = state
        return msg

    def welcome(self, msg: m.Welcome) -> bytes:
        if self.state is not State.HELLO_SENT:
            raise ProtocolError(f"welcome in state {self.state.value}")
        self.state = State.WELCOMED
        self.stream.granted = msg.credits
        return m.encode(msg)

    def reply(self, msg: Any) -> bytes:
        self.stream.reply(msg)
        return m.encode(msg)

    def refuse(self, reply_to: int, error: BaseException) -> bytes:
        """The session ends here (a client the daemon will not serve): the reply saying why."""
        self.state = State.FAILED
        return m.encode(m.Failed(reply_to=reply_to, error=error_to_wire(error)))
