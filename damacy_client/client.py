"""The light client of damacyd: the same Pipeline API, with the work done by the daemon.

Three threads at most: the caller's, an I/O thread that owns the ZeroMQ socket (requests,
replies, heartbeats) and a feeder that pulls the pushed iterables lazily, never more than
``lookahead_samples`` ahead of what the daemon has delivered. Batches are views of the
daemon's shared-memory slots, mapped once per session.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import zmq

from damacy_runtime.api import PipelineAPI
from damacy_runtime.batch import Batch, BatchInfo, Slot
from damacy_client.shm import map_segment
from damacy_protocol import messages as m
from damacy_protocol.config import Config
from damacy_protocol.connection import ClientConnection, error_from_wire
from damacy_protocol.dtypes import canonical_dtype, numpy_dtype
from damacy_protocol.endpoint import default_endpoint
from damacy_protocol.errors import DaemonUnavailable, DamacyError, InvalidArgument, PipelineDrained, ProtocolError
from damacy_protocol.samples import IndexQuery, Sample
from damacy_runtime.waker import Waker

log = logging.getLogger("damacy")

#: how often the client shows it is alive, and how long a silent daemon is given
HEARTBEAT_S = 1.0
DEAD_AFTER_S = 4.0
PUSH_CHUNK = 256  # samples per push message at most


class _Call:
    """A request waiting for its reply (or replies, for warm)."""

    __slots__ = ("event", "reply", "error", "on_progress", "epoch", "session")

    def __init__(self, on_progress: Callable[[Any], None] | None = None) -> None:
        self.event = threading.Event()
        self.reply: Any = None
        self.error: BaseException | None = None
        self.on_progress = on_progress
        self.epoch = 0
        self.session = ""  # for a ping: the session the client held when it was sent

    def wait(self, timeout: float | None, what: str) -> Any:
        if not self.event.wait(timeout):
            raise DaemonUnavailable(f"damacyd did not answer {what} within {timeout:.1f} s")
        if self.error is not None:
            raise self.error
        return self.reply


class Connection:
    """A session with damacyd: socket, I/O thread, heartbeats, request/reply matching."""

    def __init__(self, endpoint: str | None = None, *, rank: int | None = None, config: dict[str, Any] | None = None, connect_timeout_s: float = 10.0) -> None:
        self.endpoint = endpoint or default_endpoint()
        self._proto = ClientConnection()
        self._lock = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._deferred: queue.SimpleQueue = queue.SimpleQueue()
        self._waker = Waker()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        server_key = os.environ.get("DAMACY_CURVE_SERVER_KEY")
        if server_key:
            public, secret = zmq.curve_keypair()
            self._sock.setsockopt(zmq.CURVE_SERVERKEY, server_key.encode())
            self._sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            self._sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        self.dead: DaemonUnavailable | None = None
        self._session = ""  # set by the I/O thread when the welcome arrives
        self._closed = False
        self._last_recv = time.monotonic()
        try:
            self._sock.connect(self.endpoint)
        except zmq.ZMQError as e:
            self._teardown()
            raise DaemonUnavailable(f"cannot connect to {self.endpoint}: {e}") from e
        self._thread = threading.Thread(target=self._io_loop, name="damacy-client-io", daemon=True)
        self._thread.start()
        call = _Call()
        with self._lock:
            payload = self._proto.hello(os.getpid(), rank, config or {})
            self._calls[self._proto.hello_id] = call
        self._send(payload)
        try:
            welcome = call.wait(connect_timeout_s, "hello")
            if isinstance(welcome, m.Failed):
                raise error_from_wire(welcome.error)
        except DaemonUnavailable:
            self.close()
            raise DaemonUnavailable(
                f"no damacyd answers at {self.endpoint} (start one with `damacyd --allow-root DIR`, "
                "or set DAMACY_ENDPOINT)"
            ) from None
        except BaseException:
            self.close()
            raise
        self.welcome: m.Welcome = welcome

    # -- requests -------------------------------------------------------------------
    def request(self, make: Callable[[int], Any], on_progress: Callable[[Any], None] | None = None) -> _Call:
        """Send ``make(id)``; the returned call gets the reply (or the error)."""
        call = _Call(on_progress)
        if self.dead is not None:
            call.error = self.dead
            call.event.set()
            return call
        with self._lock:
            msg = make(self._proto.new_id())
            payload = self._proto.send(msg)
            self._calls[msg.id] = call
        self._send(payload)
        return call

    def call(self, make: Callable[[int], Any], timeout: float, what: str) -> Any:
        reply = self.request(make).wait(timeout, what)
        if isinstance(reply, m.Failed):
            raise error_from_wire(reply.error)
        return reply

    def defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the I/O thread, holding no lock (safe to call from ``__del__``)."""
        self._deferred.put(fn)
        self._waker.wake()

    def _send(self, payload: bytes) -> None:
        self._outbox.put(payload)
        self._waker.wake()

    # -- the I/O thread ---------------------------------------------------------------
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._waker.fd, zmq.POLLIN)
        last_ping = time.monotonic()
        try:
            while not self._closed:
                events = dict(poller.poll(100))
                now = time.monotonic()
                if self._sock in events:
                    self._receive_all()
                    self._last_recv = now
                if self._waker.fd in events:
                    self._waker.drain()
                while True:
                    try:
                        fn = self._deferred.get_nowait()
                    except queue.Empty:
                        break
                    try:
                        fn()
                    except Exception:  # noqa: BLE001 - deferred work must not stop the connection
                        log.exception("damacy: deferred client work failed")
                while True:
                    try:
                        payload = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    try:
                        self._sock.send(payload, zmq.NOBLOCK)
                    except zmq.ZMQError as e:
                        log.debug("damacy: send failed: %s", e)
                if now - last_ping >= HEARTBEAT_S and self.dead is None:
                    last_ping = now
                    try:
                        with self._lock:
                            ping = m.Ping(id=self._proto.new_id())
                            payload = self._proto.send(ping)
                            self._calls[ping.id] = pinged = _Call()
                            pinged.session = self._session
                        self._sock.send(payload, zmq.NOBLOCK)
                    except (zmq.ZMQError, ProtocolError):
                        pass
                if self.dead is None and now - self._last_recv > DEAD_AFTER_S:
                    self._die(f"damacyd at {self.endpoint} stopped answering ({now - self._last_recv:.1f} s of silence)")
        except Exception as e:  # the loop must never die silently
            log.exception("damacy: client I/O thread failed")
            self._die(f"the client's connection thread failed: {e}")

    def _receive_all(self) -> None:
        while True:
            try:
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                with self._lock:
                    msg = self._proto.receive(data)
                    call = self._calls.get(msg.reply_to)
                    if call is not None and not isinstance(msg, (m.WarmProgress, m.Consumed)):
                        del self._calls[msg.reply_to]
                    if isinstance(msg, m.Welcome):
                        self._session = msg.session
            except ProtocolError as e:
                log.warning("damacy: %s", e)
                if "not pending" not in str(e):
                    self._die(f"damacyd broke the protocol: {e}")
                continue
            if call is None:
                continue
            if isinstance(msg, (m.WarmProgress, m.Consumed)):
                if call.on_progress is not None:
                    call.on_progress(msg)
                continue
            if self._session_lost(msg, call):
                self._die(f"damacyd at {self.endpoint} restarted and lost this session; start a new Pipeline")
                call.error = self.dead
            else:
                call.reply = msg
            call.event.set()

    def _session_lost(self, msg: Any, call: _Call) -> bool:
        """Does this reply show that the daemon no longer holds our session (it restarted)?"""
        if isinstance(msg, m.Pong):  # pings sent once the session was known name it back
            return bool(call.session) and msg.session != call.session
        return (
            bool(self._session)
            and isinstance(msg, m.Failed)
            and msg.error.kind == "ProtocolError"
            and "unknown session" in msg.error.reason
        )

    def _die(self, why: str) -> None:
        with self._lock:
            if self.dead is None:
                self.dead = DaemonUnavailable(why)
            calls = list(self._calls.values())
            self._calls.clear()
        for call in calls:
            call.error = self.dead
            call.event.set()

    def close(self, bye: bool = True) -> None:
        if self._closed:
            return
        if bye and self.dead is None and getattr(self, "welcome", None) is not None:
            try:
                self.request(lambda i: m.Bye(id=i)).wait(1.0, "bye")
            except (DamacyError, ProtocolError):
                pass
        self._closed = True
        self._thread.join(2.0)
        self._teardown()

    def _teardown(self) -> None:
        self._sock.close(0)
        self._ctx.term()
        self._waker.close()


def to_wire(seq: int, sample: Any) -> m.WireSample:
    if isinstance(sample, Sample):
        return m.WireSample(seq=seq, uri=sample.uri, box=[tuple(e) for e in sample.aabb])
    if isinstance(sample, IndexQuery):
        axes = [
            m.WireAxis(start=s.start, stop=s.stop, step=s.step) if isinstance(s, slice) else m.WireAxis(indices=list(s))
            for s in sample.selection
        ]
        return m.WireSample(seq=seq, uri=sample.uri, index=axes)
    raise InvalidArgument(f"expected a Sample or an IndexQuery, got {type(sample).__name__}")


class RemotePipeline(PipelineAPI):
    """``damacy.Pipeline(config, endpoint=...)``: a pipeline run by damacyd.

    Same behaviour as the embedded pipeline: ``push``/``pop``/``batches``, batches in push
    order, error policies, DLPack batches (views of the daemon's shared memory). If the
    daemon dies, every call raises :class:`DaemonUnavailable` within a few seconds.
    """

    def __init__(self, config: Config, endpoint: str | None = None, *, rank: int | None = None, connect_timeout_s: float = 10.0) -> None:
        if not isinstance(config, Config):
            raise InvalidArgument(f"Pipeline takes a damacy.Config, got {type(config).__name__}")
        self.config = config
        if rank is None and os.environ.get("RANK", "").isdigit():
            rank = int(os.environ["RANK"])
        self._conn = Connection(endpoint, rank=rank, config=config.to_dict(), connect_timeout_s=connect_timeout_s)
        self.endpoint = self._conn.endpoint
        welcome = self._conn.welcome
        try:
            self._slots = [map_segment(s.name, s.nbytes) for s in welcome.slots]
            self._conn.call(lambda i: m.Attached(id=i), connect_timeout_s, "attach")
        except BaseException:
            self._conn.close()
            raise
        self._cond = threading.Condition()
        self._sources: deque[Iterator[Any]] = deque()
        self._samples: dict[int, Any] = {}  # seq -> sample, for samples not yet delivered
        self._skipped: dict[int, Any] = {}  # seq -> sample dropped by the daemon, until reported
        self._seq = itertools.count()
        self._outstanding = 0
        self._pushed = False
        self._final_sent = True
        # exceptions of the pushed iterables, each raised once the samples pulled before it
        # (numbered up to ``after``) are delivered: (after, error)
        self._source_errors: deque[tuple[int, BaseException]] = deque()
        self._last_seq = -1
        self._next_batch = 0  # the id the next batch should have (for messages)
        self._next_call: _Call | None = None  # the pop already sent for the next batch
        self._push_epoch = 0  # pushes so far (a drained answer to an older pop is stale)
        self._held = 0  # batches handed out and not yet released
        self._pushes_sent = 0
        self._push_calls: deque = deque()  # pushes not yet acknowledged
        self._closed = False
        self._feeder: threading.Thread | None = None
        self._batch_shape = (config.samples_per_batch, *config.sample_shape)

    # -- input --------------------------------------------------------------------
    def push(self, samples: Iterable[Any]) -> None:
        if isinstance(samples, (str, bytes)) or not hasattr(samples, "__iter__"):
            raise InvalidArgument(f"push takes an iterable of samples, got {type(samples).__name__}")
        self._check()
        with self._cond:
            self._sources.append(iter(samples))
            self._pushed = True
            self._push_epoch += 1
            self._final_sent = False
            if self._feeder is None:
                self._feeder = threading.Thread(target=self._feed, name="damacy-client-feeder", daemon=True)
                self._feeder.start()
            self._cond.notify_all()

    def _feed(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not (
                    (self._sources and self._outstanding < self.config.lookahead_samples) or (not self._sources and not self._final_sent)
                ):
                    self._cond.wait(0.5)
                if self._closed:
                    return
                room = self.config.lookahead_samples - self._outstanding
            batch: list[m.WireSample] = []
            while len(batch) < min(room, PUSH_CHUNK):
                with self._cond:
                    source = self._sources[0] if self._sources else None
                if source is None:
                    break
                try:
                    sample = next(source)
                except StopIteration:
                    with self._cond:
                        if self._sources and self._sources[0] is source:
                            self._sources.popleft()
                    continue
                except BaseException as e:  # the caller's generator failed: raised at a later pop
                    with self._cond:
                        if self._sources and self._sources[0] is source:
                            self._sources.popleft()
                        self._source_errors.append((batch[-1].seq if batch else self._last_seq, e))
                    break
                try:
                    wire = to_wire(next(self._seq), sample)
                except InvalidArgument as e:
                    with self._cond:
                        self._source_errors.append((batch[-1].seq if batch else self._last_seq, e))
                    break
                self._samples[wire.seq] = sample
                batch.append(wire)
            if self._closed:
                return
            with self._cond:  # counted, flagged and queued together, so a pop never misses it
                final = not self._sources
                if batch or final:
                    try:
                        call = self._conn.request(lambda i, b=batch, f=final: m.Push(id=i, samples=b, final=f))
                    except (DamacyError, ProtocolError) as e:  # closed or the daemon is gone
                        self._source_errors.append((self._last_seq, e))
                        return
                    self._pushes_sent += 1
                    self._push_calls.append(call)
                    self._outstanding += len(batch)
                    if batch:
                        self._last_seq = batch[-1].seq
                    if final:
                        self._final_sent = True
                self._cond.notify_all()

    # -- output -------------------------------------------------------------------
    def _check(self) -> None:
        if self._closed:
            raise PipelineDrained("the pipeline is closed")
        if self._conn.dead is not None:
            raise self._conn.dead
        with self._cond:
            while self._push_calls and self._push_calls[0].event.is_set():
                call = self._push_calls.popleft()
                if call.error is not None:
                    raise call.error
                if isinstance(call.reply, m.Failed):
                    raise error_from_wire(call.reply.error)

    def _request_pop(self) -> _Call:
        """Ask the daemon for the next batch. The daemon answers when it is assembled (or the
        stream drained); timeouts are the caller's, so a late answer is kept for the next pop."""
        with self._cond:
            # "final": everything this client will push (for now) is already on its way, so
            # the daemon may call the stream drained; otherwise it waits for more pushes
            final = self._final_sent and not self._sources
            epoch = self._push_epoch
            pushes = self._pushes_sent
        call = self._conn.request(
            lambda i: m.Pop(id=i, timeout_s=None, pushes=pushes, final=final), on_progress=self._consumed
        )
        call.epoch = epoch  # type: ignore[attr-defined]
        return call

    def pop(self, timeout: float | None = None) -> Batch:
        """The next batch in push order; see :meth:`damacy.EmbeddedPipeline.pop`. The next
        batch is requested as soon as this one is handed out, so a pop whose batch is ready
        costs no round trip to the daemon."""
        self._check()
        if not self._pushed:
            raise PipelineDrained("nothing was pushed")
        if timeout is None:
            timeout = self.config.pop_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            error = self._due_source_error()
        if error is not None:
            raise error
        while True:
            call, self._next_call = self._next_call, None
            if call is None:
                call = self._request_pop()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not call.event.wait(left):
                self._next_call = call  # its answer will serve the next pop
                raise TimeoutError(self._waiting_for(timeout))
            if call.error is not None:
                raise call.error
            reply = call.reply
            if isinstance(reply, m.Failed) and reply.error.kind == "PipelineDrained" and call.epoch < self._push_epoch:
                continue  # asked before the last push: ask again
            break
        if isinstance(reply, m.Failed):
            err = error_from_wire(reply.error)
            with self._cond:
                self._outstanding -= len(reply.consumed)
                consumed = [self._samples.pop(seq, None) for seq in reply.consumed]
                self._cond.notify_all()
            if isinstance(err, PipelineDrained):
                with self._cond:
                    error = self._due_source_error(drained=True)
                if error is not None:
                    raise error
            else:
                self._next_call = self._request_pop()
            if reply.error.seq is not None and hasattr(err, "sample"):
                err.batch_samples = tuple(s for s in consumed if s is not None)  # type: ignore[attr-defined]
            raise err
        batch = self._batch(reply)
        self._next_call = self._request_pop()
        return batch

    def _waiting_for(self, timeout: float) -> str:
        what = f"no batch {self._next_batch} within {timeout}s"
        with self._cond:
            held = self._held
            if self._sources and self._outstanding == 0:
                return f"{what}: waiting for the pushed iterable to yield samples"
        if held >= self.config.prepared_batches:
            return (
                f"{what}: all {self.config.prepared_batches} batch slots are held by batches "
                "(or arrays exported from them) that were not released"
            )
        return f"{what}: its reads and decodes are still running in damacyd"

    def _consumed(self, msg: m.Consumed) -> None:
        """The daemon dropped samples (skipped): they free room for new ones."""
        with self._cond:
            for seq in msg.seqs:
                self._skipped[seq] = self._samples.pop(seq, None)
            self._outstanding -= len(msg.seqs)
            self._cond.notify_all()

    def _due_source_error(self, drained: bool = False) -> BaseException | None:
        """The oldest exception of a pushed iterable, once every sample pulled before it is
        delivered (called with the lock held); each is raised once, by that pop."""
        if not self._source_errors:
            return None
        after, error = self._source_errors[0]
        if drained or not any(seq <= after for seq in self._samples):
            self._source_errors.popleft()
            return error
        return None

    def _batch(self, r: m.BatchReady) -> Batch:
        dtype = numpy_dtype(canonical_dtype(r.dtype))
        n = int(np.prod(self._batch_shape, dtype=np.int64)) * dtype.itemsize
        full = self._slots[r.slot][:n].view(dtype).reshape(self._batch_shape)
        with self._cond:
            self._next_batch = r.batch_id + 1
            samples = tuple(self._samples.pop(seq, None) for seq in r.seqs)
            skipped = tuple((self._skipped.pop(w.seq, None), error_from_wire(w)) for w in r.skipped)
            self._outstanding -= len(r.seqs)
            self._cond.notify_all()
        errors = tuple((r.seqs.index(w.seq) if w.seq in r.seqs else -1, error_from_wire(w)) for w in r.errors)
        info = BatchInfo(
            shape=(r.count, *self.config.sample_shape),
            dtype=self.config.dtype if self.config.dtype != "native" else dtype.name,
            device="cpu",
            batch_id=r.batch_id,
            samples=samples,
            errors=errors,
            skipped=skipped,
        )
        with self._cond:
            self._held += 1
        slot = Slot(full, lambda _slot, bid=r.batch_id: self._release(bid), index=r.slot)
        return Batch(slot, info, dtype, full)

    def _release(self, batch_id: int) -> None:
        """A batch's slot is free (its Batch and every array from it are gone). This can run
        inside a garbage collection in any thread, even one holding our locks, so it only
        queues the work for the I/O thread."""
        self._conn.defer(lambda: self._send_release(batch_id))

    def _send_release(self, batch_id: int) -> None:
        with self._cond:
            self._held -= 1
        if self._closed or self._conn.dead is not None:
            return
        try:
            self._conn.request(lambda i: m.Release(id=i, batch_id=batch_id))
        except (DamacyError, ProtocolError):
            pass

    def stats(self) -> dict[str, Any]:
        """The daemon's figures (stages, caches, memory, sessions) with this session's
        counters (batches, samples, sample_errors, samples_pulled) at the top level."""
        self._check()
        data = self._conn.call(lambda i: m.Stats(id=i), 10.0, "stats").stats
        mine = data.get("session", {})
        for key in ("batches", "samples", "sample_errors", "samples_pulled"):
            if key in mine:
                data[key] = mine[key]
        return data

    # -- lifetime -----------------------------------------------------------------
    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._conn.close()
        if self._feeder is not None and self._feeder is not threading.current_thread():
            self._feeder.join(2.0)
