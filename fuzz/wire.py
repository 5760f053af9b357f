"""The wire-protocol target: random, mutated and out-of-order messages sent to a real damacyd
over its socket. Every input must leave the daemon alive and answering; what it replies is
its business (a ProtocolError, a refusal, a batch), as long as it replies to a control
connection's ping afterwards. The caller starts the daemon and checks, at the end, that it
serves a correct batch and that its memory came back near where it started."""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

import msgspec
import zmq
from hypothesis import strategies as st

from damacy_protocol import messages as m

TYPES = ["hello", "attached", "push", "pop", "release", "stats", "warm", "ping", "bye"]

_ints = st.one_of(st.integers(-3, 70), st.integers(-(2**63), 2**64 - 1), st.sampled_from([0, 1, 2**31, 2**63 - 1]))
_values = st.one_of(st.none(), st.booleans(), _ints, st.floats(), st.text(max_size=8), st.binary(max_size=8))


def _config(folder: str) -> st.SearchStrategy:
    shape = st.lists(st.one_of(st.integers(0, 9), _ints), max_size=4)
    return st.one_of(
        st.none(),
        st.fixed_dictionaries(
            {},
            optional={
                "samples_per_batch": st.one_of(st.integers(1, 4), _ints),
                "sample_shape": shape,
                "dtype": st.sampled_from(["native", "float32", "u16", "bf16", "nonsense", ""]),
                "prepared_batches": st.one_of(st.integers(1, 3), _ints),
                "on_error": st.sampled_from(["raise", "fill", "skip", "explode"]),
                "out_of_bounds": st.sampled_from(["pad", "error", "x"]),
                "max_memory_bytes": st.one_of(st.integers(1, 1 << 30), _ints),
                "device": st.one_of(st.none(), st.integers(-1, 3)),
                "pop_timeout_s": st.one_of(st.floats(), _ints),
            },
        ),
    )


def _sample(folder: str) -> st.SearchStrategy:
    uri = st.one_of(st.just(f"{folder}/a.zarr"), st.just("/etc/passwd"), st.text(max_size=12), st.just(f"{folder}/../a.zarr"), st.just("s3://b/k"))
    entry = st.one_of(
        st.tuples(st.just("r"), _ints, _ints, st.one_of(st.none(), _ints)).map(list),
        st.tuples(st.just("i"), _ints).map(list),
        st.tuples(st.just("l"), st.lists(_ints, max_size=4)).map(list),
        st.just(["e"]),
        _values,
    )
    return st.tuples(_ints, uri, st.booleans(), st.lists(entry, max_size=4), st.one_of(st.none(), _ints),
                     st.lists(_ints, max_size=3), st.one_of(st.none(), st.lists(_ints, max_size=3)),
                     st.one_of(st.none(), st.tuples(st.floats(), st.floats()).map(list))).map(list)


def message(folder: str) -> st.SearchStrategy:
    """One message: a plausible request with random fields, or raw bytes."""
    fields = {
        "id": _ints,
        "version": st.one_of(st.just(m.PROTOCOL_VERSION), _ints),
        "pid": st.one_of(st.just(os.getpid()), _ints),
        "rank": st.one_of(st.none(), _ints),
        "config": _config(folder),
        "samples": st.lists(_sample(folder), max_size=5),
        "final": st.booleans(),
        "pushes": _ints,
        "batch_id": _ints,
        "uris": st.lists(st.one_of(st.just(f"{folder}/a.zarr"), st.text(max_size=8)), max_size=3),
        "shard_indexes": st.booleans(),
        "chunks": st.booleans(),
        "unmapped": st.booleans(),
        "device": st.one_of(st.none(), st.text(max_size=8)),
    }
    request = st.builds(
        lambda kind, chosen, extra: msgspec.msgpack.encode({"type": kind, **chosen, **extra}),
        st.sampled_from(TYPES),
        st.fixed_dictionaries({}, optional=fields),
        st.dictionaries(st.text(max_size=6), _values, max_size=2),
    )
    return st.one_of(request, request, st.binary(max_size=64), request.flatmap(lambda b: _flipped(b)))


def _flipped(data: bytes) -> st.SearchStrategy:
    n = len(data)
    return st.lists(st.tuples(st.integers(0, max(0, n - 1)), st.integers(0, 255)), max_size=4).map(
        lambda flips: bytes(_apply(bytearray(data), flips))
    )


def _apply(buf: bytearray, flips) -> bytearray:
    for i, v in flips:
        if i < len(buf):
            buf[i] = v
    return buf


def messages(folder: str) -> st.SearchStrategy:
    """A conversation: a few messages, some on fresh connections; often a valid hello first."""
    hello = msgspec.msgpack.encode({"type": "hello", "id": 1, "version": m.PROTOCOL_VERSION, "pid": os.getpid(), "rank": None,
                                    "config": {"samples_per_batch": 2, "sample_shape": [2, 3], "dtype": "float32"}})
    start = st.one_of(st.just([hello]), st.just([]))
    body = st.lists(st.tuples(st.booleans(), message(folder)), min_size=1, max_size=8)
    return st.tuples(start, body)


class WireTarget:
    """Sends conversations to the damacyd at ``endpoint``; after each, a ping on a control
    connection must be answered (the daemon is alive and its loop is not stuck)."""

    def __init__(self, endpoint: str, pid: int) -> None:
        self.endpoint = endpoint
        self.pid = pid
        self.ctx = zmq.Context()
        self.ids = itertools.count(1)
        self.sent = 0

    def _socket(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDTIMEO, 2000)
        s.connect(self.endpoint)
        return s

    def check(self, item) -> None:
        start, body = item
        socks = [self._socket()]
        try:
            for data in start:
                socks[-1].send(data)
            for fresh, data in body:
                if fresh:
                    socks.append(self._socket())
                try:
                    socks[-1].send(data)
                    self.sent += 1
                except zmq.Again:  # the daemon dropped this connection (a message over its limit): a new one
                    socks.append(self._socket())
            for s in socks:  # read what came back (not required: the daemon may drop a peer)
                while s.poll(0):
                    s.recv()
            self.alive()
        finally:
            for s in socks:
                s.close(0)

    def alive(self, timeout_s: float = 20.0) -> None:
        """A ping on a fresh connection is answered, and the process is running."""
        assert os.path.exists(f"/proc/{self.pid}"), "damacyd is gone"
        s = self._socket()
        try:
            rid = next(self.ids)
            s.send(m.encode(m.Ping(id=rid)))
            assert s.poll(int(timeout_s * 1000)), "damacyd did not answer a ping"
            reply = m.decode_daemon(s.recv())
            assert isinstance(reply, m.Pong) and reply.reply_to == rid, reply
        finally:
            s.close(0)

    def close(self) -> None:
        self.ctx.term()


def rss_bytes(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024
