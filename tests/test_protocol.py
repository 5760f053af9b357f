"""The wire contract on its own: messages, the handshake, state checks (no sockets)."""

from __future__ import annotations

import msgspec
import pytest

import damacy
from damacy_protocol import messages as m
from damacy_protocol.config import Config
from damacy_protocol.connection import ALLOWED, NEXT, ClientConnection, ServerConnection, State
from damacy_protocol.errors import (
    ERRORS,
    DamacyError,
    DecodeError,
    ErrorKind,
    PipelineDrained,
    ProtocolError,
    UnexpectedReply,
    UnknownSession,
)
from damacy_protocol.wire import error_from_wire, error_to_wire


def handshake():
    client, server = ClientConnection(), ServerConnection()
    hello = server.receive(client.hello(pid=123, rank=0, config=Config(samples_per_batch=2, sample_shape=(4,))))
    assert isinstance(hello, m.Hello) and hello.version == m.PROTOCOL_VERSION and hello.pid == 123
    assert Config.from_dict(hello.config) == Config(samples_per_batch=2, sample_shape=(4,))  # (it travels as its dict)
    data = server.welcome(m.Welcome(reply_to=hello.id, version=m.PROTOCOL_VERSION, session="s", slots=[m.SlotInfo("damacy-1-a-0", 64)], credits=4))
    welcome, _ = client.receive(data)
    assert isinstance(welcome, m.Welcome) and client.state is State.WELCOMED
    attached = m.Attached(id=client.new_id())
    assert isinstance(server.receive(client.send(attached)), m.Attached)
    assert client.state is State.READY and server.state is State.READY
    return client, server


def test_handshake_and_round_trip():
    client, server = handshake()
    push = m.Push(id=client.new_id(), samples=[m.WireSample(seq=0, uri="/a", box=True, axes=[m.WireRange(0, 4), m.WireRange(None, 8), m.WireAt(-2)]), m.WireSample(seq=1, uri="/b", box=False, axes=[m.WireList([3, 1, 1]), m.WireRest(), m.WireRange(0, 4, 2)])], final=True)
    got = server.receive(client.send(push, token="push"))
    assert got == push
    # a push is answered only if refused: the answer to a request sent after it settles it
    ping = m.Ping(id=client.new_id())
    server.receive(client.send(ping, token="ping"))
    reply, token = client.receive(server.reply(m.Pong(reply_to=ping.id, session="s")))
    assert isinstance(reply, m.Pong) and token == "ping" and client.settled == ["push"] and push.id not in client.pending


def test_pushes_and_releases_are_settled_by_an_answer_to_a_later_request_or_their_refusal():
    client, server = handshake()
    sent = []

    def send(msg, token):
        server_side = server.receive(client.send(msg, token=token))
        sent.append(server_side)
        return msg

    wire = [m.WireSample(seq=s, uri="/a", box=True, axes=[m.WireRange(0, 4)]) for s in range(2)]
    first = send(m.Push(id=client.new_id(), samples=wire[:1]), "push 1")
    pop = send(m.Pop(id=client.new_id()), "pop")
    second = send(m.Push(id=client.new_id(), samples=wire[1:]), "push 2")
    early = send(m.Ping(id=client.new_id()), "ping 1")
    # the pop's answer (it came after the daemon handled the pop) settles the push before it
    # only: the second push was sent after the pop
    ready = m.BatchReady(reply_to=pop.id, batch_id=0, slot=0, count=2, dtype="uint16", seqs=[0, 1], errors=[], skipped=[])
    _, token = client.receive(server.reply(ready))
    assert token == "pop" and client.settled == ["push 1"] and second.id in client.pending
    # a refusal answers its push itself (and settles nothing before it twice)
    refused = m.Failed(reply_to=second.id, error=m.WireError(kind="ProtocolError", reason="no"))
    _, token = client.receive(server.reply(refused))
    assert token == "push 2" and client.settled == [] and second.id not in client.pending
    release = send(m.Release(id=client.new_id(), batch_id=0), "release")
    _, token = client.receive(server.reply(m.Pong(reply_to=early.id, session="s")))
    assert token == "ping 1" and client.settled == [] and release.id in client.pending  # (sent after that ping)
    ping = send(m.Ping(id=client.new_id()), "ping 2")
    client.receive(server.reply(m.Pong(reply_to=ping.id, session="s")))
    assert client.settled == ["release"] and not {first.id, pop.id, second.id, release.id, ping.id} & set(client.pending)


def test_requests_before_the_handshake_are_refused():
    client, server = ClientConnection(), ServerConnection()
    with pytest.raises(ProtocolError, match="before the session is ready"):
        client.send(m.Pop(id=client.new_id()))
    with pytest.raises(UnknownSession, match="before hello"):
        server.receive(m.encode(m.Pop(id=1)))
    assert isinstance(server.receive(m.encode(m.Ping(id=7))), m.Ping)  # a probe needs no session
    server.receive(client.hello(1, None, None))
    with pytest.raises(ProtocolError, match="before the slots were attached"):
        server.receive(m.encode(m.Pop(id=5)))


@pytest.mark.parametrize("side", ["client", "server"])
def test_version_mismatch_is_a_clear_error_on_both_sides(side):
    client, server = ClientConnection(), ServerConnection()
    if side == "server":
        bad = m.encode(m.Hello(id=1, version=m.PROTOCOL_VERSION + 1, pid=1, rank=None, config={}))
        with pytest.raises(ProtocolError, match=f"client speaks protocol version {m.PROTOCOL_VERSION + 1}"):
            server.receive(bad)
        assert server.state is State.FAILED
    else:
        hello = server.receive(client.hello(1, None, None))
        data = m.encode(m.Welcome(reply_to=hello.id, version=m.PROTOCOL_VERSION + 1, session="s", slots=[], credits=0))
        with pytest.raises(ProtocolError, match=f"daemon speaks protocol version {m.PROTOCOL_VERSION + 1}"):
            client.receive(data)
        assert client.state is State.FAILED


@pytest.mark.parametrize(
    "payload,words",
    [
        (b"\xc1", "malformed"),
        (msgspec.msgpack.encode({"type": "pop", "id": "seven"}), "$.id"),
        (msgspec.msgpack.encode({"type": "launch", "id": 1}), "$.type"),
        (msgspec.msgpack.encode([1, 2, 3]), "malformed"),
        (msgspec.msgpack.encode({"type": "push", "id": 1, "samples": [[0, 5]]}), "$.samples[0]"),
    ],
)
def test_malformed_messages_name_what_is_wrong(payload, words):
    client, server = handshake()
    with pytest.raises(ProtocolError) as info:
        server.receive(payload)
    assert words in str(info.value)
    assert server.state is State.READY  # the session goes on


def test_replies_must_answer_a_pending_request():
    client, server = handshake()
    with pytest.raises(UnexpectedReply, match="not pending"):
        client.receive(m.encode(m.Ack(reply_to=999)))
    pop = m.Pop(id=client.new_id())
    client.send(pop)
    progress, _ = client.receive(m.encode(m.Consumed(reply_to=pop.id, seqs=[3])))
    assert isinstance(progress, m.Consumed) and pop.id in client.pending  # progress keeps it pending
    client.receive(m.encode(m.Failed(reply_to=pop.id, error=error_to_wire(PipelineDrained("done")))))
    assert pop.id not in client.pending


def test_an_older_peers_hello_gets_the_version_error_not_a_schema_error():
    # version 2 sent the config as a plain dict ({} for a control session)
    old = msgspec.msgpack.encode({"type": "hello", "id": 1, "version": 2, "pid": 1, "rank": None, "config": {}})
    server = ServerConnection()
    with pytest.raises(ProtocolError, match="client speaks protocol version 2, this daemon"):
        server.receive(old)
    assert server.state is State.FAILED
    # a Config travels as its dict, checked where it arrives by Config.from_dict (the daemon's
    # session refuses it saying so: tests/test_daemon.py), naming the field
    bad = msgspec.msgpack.encode({"type": "hello", "id": 1, "version": m.PROTOCOL_VERSION, "pid": 1, "rank": None, "config": {"samples_per_batch": 0, "sample_shape": [4]}})
    hello = ServerConnection().receive(bad)
    with pytest.raises(ValueError, match=r"samples_per_batch must be >= 1 \(got 0\)"):
        Config.from_dict(hello.config)
    with pytest.raises(ValueError, match=r"no field\(s\) \['io_workers'\]"):  # a field of another version
        Config.from_dict({"samples_per_batch": 1, "sample_shape": [4], "io_workers": 2})


def _push(client, seqs):
    return m.Push(id=client.new_id(), samples=[m.WireSample(seq=s, uri="/a", box=True, axes=[m.WireRange(0, 4)]) for s in seqs])


def test_credits_are_counted_alike_on_both_sides():
    client, server = handshake()  # 4 credits
    assert client.credits == server.credits == 4
    first = _push(client, [0, 1, 2])
    server.receive(client.send(first))
    assert client.credits == server.credits == 1
    with pytest.raises(ProtocolError, match="a push of 2 samples exceeds the 1 credits"):
        client.send(_push(client, [3, 4]))  # the client refuses to send it
    assert client.credits == 1
    server.receive(client.send(_push(client, [3])))
    assert client.credits == server.credits == 0
    pops = [m.Pop(id=client.new_id()) for _ in range(3)]
    for pop in pops:
        server.receive(client.send(pop))
    # a delivered batch, dropped samples and a failed batch each return what they name
    client.receive(server.reply(m.BatchReady(reply_to=pops[0].id, batch_id=0, slot=0, count=2, dtype="float32", seqs=[0, 1], errors=[], skipped=[])))
    assert client.credits == server.credits == 2
    client.receive(server.reply(m.Consumed(reply_to=pops[1].id, seqs=[2])))
    assert client.credits == server.credits == 3
    client.receive(server.reply(m.Failed(reply_to=pops[1].id, error=error_to_wire(DecodeError("bad")), consumed=[3])))
    assert client.credits == server.credits == 4
    client.receive(server.reply(m.Failed(reply_to=pops[2].id, error=error_to_wire(PipelineDrained("done")))))
    assert client.credits == server.credits == 4


def test_the_daemon_refuses_a_push_beyond_the_credits_and_goes_on():
    client, server = handshake()
    greedy = _push(client, range(5))  # sent around the client's own check
    with pytest.raises(ProtocolError, match="a push of 5 samples exceeds the 4 credits"):
        server.receive(m.encode(greedy))
    assert server.state is State.READY and server.credits == 4
    assert isinstance(server.receive(client.send(_push(client, range(4)))), m.Push) and server.credits == 0


def test_nothing_after_bye():
    client, server = handshake()
    server.receive(client.send(m.Bye(id=client.new_id())))
    assert client.state is State.CLOSED and server.state is State.CLOSED
    with pytest.raises(ProtocolError, match="after the session ended"):
        server.receive(m.encode(m.Pop(id=99)))
    with pytest.raises(ProtocolError):
        client.send(m.Pop(id=client.new_id()))


def test_errors_travel_as_data():
    err = DecodeError("zstd: bad frame", uri="/a", path="/a/c/0", chunk=(1, 2), sample="Sample('/a', [0:4])")
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(error_to_wire(err, seq=5)), type=m.WireError)
    back = error_from_wire(wire)
    assert type(back) is DecodeError and str(back) == str(err) and wire.seq == 5
    # a timeout is PoolStarved (the seed's status SHUTDOWN) and crosses as itself; an
    # exception that is no damacy error crosses as a DamacyError saying what it was
    starved = error_from_wire(error_to_wire(damacy.PoolStarved("late")))
    assert type(starved) is damacy.PoolStarved and starved.status is damacy.Status.SHUTDOWN
    other = error_from_wire(error_to_wire(TimeoutError("late")))
    assert type(other) is DamacyError and "late" in str(other)
    # a kind the wire does not know is a malformed message, named as such
    unknown = msgspec.msgpack.encode({"kind": "SomethingNew", "reason": "x"})
    with pytest.raises(msgspec.ValidationError, match="kind"):
        msgspec.msgpack.decode(unknown, type=m.WireError)
    # every class damacy raises travels as itself (a subclass defined elsewhere as its ancestor)
    for kind, cls in ERRORS.items():
        err = cls("why", uri="/a")  # every error may carry a sample's context
        err.what = "pop"
        back = error_from_wire(error_to_wire(err))
        assert error_to_wire(err).kind is kind and type(back) is cls
        assert back.status is err.status and back.what == "pop" and back.uri == "/a" and back.reason == "why"
    # the seed's classes among them, each with its status
    for cls, status in [
        (damacy.ShutdownError, damacy.Status.SHUTDOWN), (damacy.PoolStarved, damacy.Status.SHUTDOWN),
        (damacy.PipelineDrained, damacy.Status.SHUTDOWN), (damacy.SlotsHeld, damacy.Status.SHUTDOWN),
        (damacy.DtypeMismatch, damacy.Status.DTYPE), (damacy.RankMismatch, damacy.Status.RANK),
        (damacy.UnsupportedOperation, damacy.Status.UNSUPPORTED), (damacy.BudgetExceeded, damacy.Status.BUDGET),
    ]:
        back = error_from_wire(error_to_wire(cls("why")))
        assert type(back) is cls and back.status is status, (cls, back.status)
    assert error_to_wire(damacy.SlotsHeld("held")).kind is ErrorKind.SLOTS_HELD
    assert error_to_wire(ValueError("odd")).kind is ErrorKind.DAMACY_ERROR


REQUESTS = {
    m.Hello: m.Hello(id=1, version=m.PROTOCOL_VERSION, pid=1, rank=None),
    m.Attached: m.Attached(id=2),
    m.Push: m.Push(id=3, samples=[m.WireSample(seq=0, uri="/a", box=True, axes=[m.WireRange(0, 1)])]),
    m.Pop: m.Pop(id=4),
    m.Release: m.Release(id=5, batch_id=0),
    m.Stats: m.Stats(id=6),
    m.Warm: m.Warm(id=7, uris=[]),
    m.Ping: m.Ping(id=8),
    m.Bye: m.Bye(id=9),
}


@pytest.mark.parametrize("state", list(State))
def test_the_daemon_follows_the_transition_table(state):
    assert set(REQUESTS) == set().union(*ALLOWED.values())
    for kind, msg in REQUESTS.items():
        server = ServerConnection()
        server.state, server.stream.granted = state, 8
        server.stream.lent.add(0)  # batch 0 is the client's, so its release may come
        if kind in ALLOWED[state]:
            assert server.receive(m.encode(msg)) == msg
            assert server.state is NEXT.get((state, kind), state), (state, kind)
        else:
            with pytest.raises(ProtocolError):
                server.receive(m.encode(msg))
            assert server.state is state, (state, kind)  # a refused request changes nothing


@pytest.mark.parametrize("state", [s for s in State if s is not State.NEW])
def test_the_client_sends_only_what_the_table_allows(state):
    for kind, msg in REQUESTS.items():
        if kind is m.Hello:
            continue
        client = ClientConnection()
        client.state, client.stream.granted = state, 8
        client.stream.lent.add(0)
        ok = kind in ALLOWED[state] and not (state is State.CLOSED and kind is m.Ping)
        if ok:
            client.send(msg)
            assert client.state is NEXT.get((state, kind), state), (state, kind)
        else:
            with pytest.raises(ProtocolError):
                client.send(msg)
            assert client.state is state


def _ready(client, server, batch_id, pop, seqs):
    return client.receive(server.reply(m.BatchReady(reply_to=pop.id, batch_id=batch_id, slot=0, count=len(seqs), dtype="float32", seqs=seqs, errors=[], skipped=[])))


def test_both_sides_keep_the_same_stream():
    """Pushes and finality, pops answered in order, batches lent and released: the client
    applies what it sends and receives, the daemon what it receives and sends, and both end
    in the same state."""
    client, server = handshake()
    for side in (client, server):
        assert side.stream.pushes == 0 and not side.stream.final and not side.stream.pops and not side.stream.lent
    server.receive(client.send(_push(client, [0, 1])))
    pops = []
    for _ in range(2):
        pop = m.Pop(id=client.new_id(), pushes=99, final=False)  # the connection counts the pushes, not the caller
        pops.append(server.receive(client.send(pop, token=f"call {pop.id}")))
    assert [p.pushes for p in pops] == [1, 1] and [p.id for p in server.stream.pops] == [p.id for p in client.stream.pops]
    msg, token = _ready(client, server, 7, pops[0], [0, 1])
    assert isinstance(msg, m.BatchReady) and token == f"call {pops[0].id}" and client.answered.id == pops[0].id
    for side in (client, server):
        assert side.stream.lent == {7} and [p.id for p in side.stream.pops] == [pops[1].id]
    server.receive(client.send(m.Push(id=client.new_id(), samples=[], final=True)))
    for side in (client, server):
        assert side.stream.final and side.stream.final_at == 2 and side.stream.input_final(pops[1])  # a later push said so
        assert side.stream.pushed_since(pops[1])  # a "drained" answer to it would predate that push
    # releases: of a batch lent, once
    server.receive(client.send(m.Release(id=client.new_id(), batch_id=7)))
    assert client.stream.lent == server.stream.lent == set()
    with pytest.raises(ProtocolError, match="release of batch 7, which this session does not hold"):
        client.send(m.Release(id=client.new_id(), batch_id=7))
    with pytest.raises(ProtocolError, match="release of batch 7"):
        server.receive(m.encode(m.Release(id=50, batch_id=7)))  # sent around the client's check
    assert server.state is State.READY  # refused, and the session goes on


def test_pops_are_answered_in_the_order_sent():
    client, server = handshake()
    server.receive(client.send(_push(client, [0])))
    first, second = (server.receive(client.send(m.Pop(id=client.new_id()))) for _ in range(2))
    with pytest.raises(ProtocolError, match=f"answers pop {second.id} before the pops sent ahead of it"):
        client.receive(m.encode(m.BatchReady(reply_to=second.id, batch_id=0, slot=0, count=1, dtype="float32", seqs=[0], errors=[], skipped=[])))


def test_a_pop_asked_before_the_final_push_is_not_drained_by_it_alone():
    client, server = handshake()
    early = server.receive(client.send(m.Pop(id=client.new_id(), final=False)))
    assert not server.stream.input_final(early)
    server.receive(client.send(m.Push(id=client.new_id(), samples=[], final=True)))
    assert server.stream.input_final(early)  # the push after it said the input is exhausted
    late = server.receive(client.send(m.Pop(id=client.new_id(), final=False)))
    assert not server.stream.input_final(late) and server.stream.final


def test_a_lost_daemon_gives_back_every_waiting_token():
    client, _ = handshake()
    client.send(m.Stats(id=client.new_id()), token="stats")
    client.send(m.Ping(id=client.new_id()), token="ping")
    assert sorted(t for t in client.abandon() if t is not None) == ["ping", "stats"] and not client.pending

