"""damacyd: one daemon per node serving every training rank over ZeroMQ.

The daemon owns what ranks share: the metadata and shard-index caches, the decoded-chunk
cache, the I/O and decode pools and the memory budget. Each client connection is a
:class:`Session` with its own pipeline (queue, lookahead, error policy) and its own batch
slots in POSIX shared memory; batches are handed over as (slot, batch id) and read in the
client without a copy.

Threads: one loop thread owns the ROUTER socket; other threads hand it replies through an
outbox and a wake-up pipe. Each session has a pop thread (a pop may wait for its batch).
"""

from __future__ import annotations

import gc
import logging
import math
import os
import queue
import resource
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from damacy_runtime.batch import Batch
from damacy_protocol import messages as m
from damacy_protocol.config import Config
from damacy_protocol.connection import ServerConnection, State, error_to_wire
from damacy_protocol.errors import (
    BudgetExceeded,
    DamacyError,
    InvalidArgument,
    PipelineDrained,
    ProtocolError,
    SampleError,
)
from damacy_protocol.samples import IndexQuery, Sample
from damacy_runtime.waker import Waker
from damacy_server.cpu import CpuExecutor, CpuLimits
from damacy_server.endpoint import Peer, bind_socket, cleanup_endpoint, peer_of, socket_gid
from damacy_server.pipeline import Pipeline
from damacy_server.plan import BadSample, ChunkPlanner, PlanLimits
from damacy_server.resolve import MetadataCache, ZarrMetadata
from damacy_server.shm import Segment, pid_alive, remove_stale
from damacy_server.store import resolve_uri
from damacy_server.store.file import FileMetadataReader, FileReader
from damacy_server.warm import warm

log = logging.getLogger("damacyd")

#: messages read from the socket per loop turn before replies are flushed: a client flooding
#: the daemon delays another client's answer by at most this many messages (ZeroMQ takes
#: turns between clients with messages waiting)
MESSAGES_PER_TURN = 32
#: file descriptors kept free for sockets, files being read and new sessions' handshakes
FD_RESERVE = 64


@dataclass
class DaemonOptions:
    endpoint: str
    allow_roots: list[str] = field(default_factory=list)
    memory_bytes: int = 8 << 30
    chunk_cache_bytes: int = 0
    io_workers: int = max(4, os.cpu_count() or 1)
    decode_workers: int = os.cpu_count() or 1
    array_cache_entries: int = 1024
    shard_index_cache_entries: int = 65536
    socket_mode: int = 0o600
    socket_group: str | None = None
    curve_secret_key: bytes | None = None
    heartbeat_timeout_s: float = 5.0
    max_slots_per_session: int = 64
    max_message_bytes: int = 64 << 20
    allow_uids: list[int] = field(default_factory=list)
    allow_gids: list[int] = field(default_factory=list)


class SampleFeed:
    """The samples a client pushed, as an iterator the session's pipeline pulls from; it ends
    when the client says its input is exhausted (``final``) or the session closes."""

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._head = 0
        self._cond = threading.Condition()
        self.final = False
        self.closed = False

    def put(self, samples: list[Any], final: bool) -> None:
        with self._cond:
            self._items.extend(samples)
            self.final = self.final or final
            self._cond.notify_all()

    def queued(self) -> int:
        with self._cond:
            return len(self._items) - self._head

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def __iter__(self) -> SampleFeed:
        return self

    def __next__(self) -> Any:
        with self._cond:
            while self._head >= len(self._items):
                if self.final or self.closed:
                    raise StopIteration
                self._cond.wait(0.5)
            item = self._items[self._head]
            self._head += 1
            if self._head > 4096 and self._head * 2 > len(self._items):
                del self._items[: self._head]
                self._head = 0
            return item


class Session:
    """One client: its pipeline, its slots, the batches it holds."""

    def __init__(self, daemon: Daemon, identity: bytes, conn: ServerConnection, hello: m.Hello, peer: Peer | None = None) -> None:
        self.daemon = daemon
        self.identity = identity
        self.conn = conn
        self.peer = peer
        self.pid = hello.pid
        self.rank = hello.rank
        self.sid = uuid.uuid4().hex[:12]
        self.last_seen = time.monotonic()
        # the process watched for liveness: as the kernel names it when it can (right across
        # pid namespaces), else as the client says
        self.watch_pid = peer.pid if peer is not None else hello.pid
        self.pid_visible = pid_alive(self.watch_pid)
        self.segments: list[Segment] = []
        self.seqs: dict[int, int] = {}  # id(sample) -> the client's number for it
        self.lent: dict[int, Batch] = {}
        self.feed: SampleFeed | None = None
        self.closed = False
        self._lock = threading.Lock()
        self.delivered_batches = 0
        self.delivered_samples = 0
        config = dict(hello.config)
        self.config: Config | None = None
        self.pipeline: Pipeline | None = None  # a control session (the CLI) has none
        if config:
            if config.get("device") is not None:
                raise InvalidArgument(f"Config.device={config['device']}: this damacyd serves host memory only")
            self.config = Config.from_dict(config)
            limit = daemon.options.max_slots_per_session
            if self.config.prepared_batches > limit:
                raise InvalidArgument(
                    f"Config.prepared_batches={self.config.prepared_batches}: this damacyd gives a session at most "
                    f"{limit} slots (--max-slots-per-session)"
                )
            daemon.check_descriptors(self.config.prepared_batches)
            try:
                self.pipeline = Pipeline(
                    self.config,
                    planner=daemon.planner,
                    executor=daemon.executor,
                    slot_factory=self._new_slot,
                    on_skip=self._on_skip,
                )
            except BaseException:
                daemon.retire(self.segments, budget=False)  # the pipeline returned its reservation
                self.segments = []
                raise
        self._pushed = threading.Condition()  # notified on every push
        self._pushes = 0  # pushes received
        self._final_at = -1  # the number of the last push that said the input was final
        self._pop_id: int | None = None  # the pop being answered now
        self._dropped: list[int] = []  # skipped samples not yet reported to the client
        self._pops: queue.SimpleQueue = queue.SimpleQueue()
        self._pops_queued = 0  # pops handed to the pop thread and not yet answered
        self._popper = threading.Thread(target=self._pop_loop, name=f"damacyd-pop-{self.sid}", daemon=True)
        self._popper.start()

    def _on_skip(self, dropped: list[tuple[Any, SampleError]]) -> None:
        """Skipped samples free credits at once (their batch may wait for replacements)."""
        with self._lock:
            self._dropped.extend(self.seqs.get(id(s), -1) for s, _ in dropped)
            self._report_dropped()

    def _report_dropped(self) -> None:
        """Called with the lock held: tell the waiting pop which samples were dropped."""
        if self._dropped and self._pop_id is not None:
            self.reply(m.Consumed(reply_to=self._pop_id, seqs=self._dropped))
            self._dropped = []

    def _new_slot(self, index: int, nbytes: int) -> np.ndarray:
        options = self.daemon.options
        seg = Segment(f"damacy-{os.getpid()}-{self.sid}-{index}", nbytes, options.socket_mode, self.daemon.segment_gid)
        self.segments.append(seg)
        return seg.array

    def welcome(self, reply_to: int) -> m.Welcome:
        if self.pipeline is None:
            return m.Welcome(reply_to=reply_to, version=m.PROTOCOL_VERSION, session=self.sid, slots=[], dtype="", credits=0)
        dtype = "" if self.config.dtype == "native" else self.pipeline._dtype.name
        return m.Welcome(
            reply_to=reply_to,
            version=m.PROTOCOL_VERSION,
            session=self.sid,
            slots=[m.SlotInfo(seg.name, seg.nbytes) for seg in self.segments],
            dtype=dtype,
            credits=self.config.lookahead_samples,
        )

    def credits(self) -> int:
        if self.pipeline is None:
            return 0
        queued = self.feed.queued() if self.feed is not None else 0
        return max(0, self.config.lookahead_samples - queued - self.pipeline.outstanding())

    # -- requests -------------------------------------------------------------------
    def handle(self, msg: Any) -> None:
        self.last_seen = time.monotonic()
        if isinstance(msg, m.Attached):
            for seg in self.segments:
                seg.unlink()  # the client has mapped them; nothing is left in /dev/shm
            self.reply(m.Ack(reply_to=msg.id, credits=self.credits()))
        elif isinstance(msg, (m.Push, m.Pop, m.Release)) and self.pipeline is None:
            self.fail(msg.id, InvalidArgument("this session was opened without a Config: it has no pipeline"))
        elif isinstance(msg, m.Push):
            self._push(msg)
        elif isinstance(msg, m.Pop):
            with self._lock:
                inline = self._pops_queued == 0 and self.pipeline.ready()
                if not inline:
                    self._pops_queued += 1
            if inline:  # the batch is ready: answer now, without a thread handoff
                self._answer_pop(msg)
            else:
                self._pops.put(msg)
        elif isinstance(msg, m.Release):
            with self._lock:
                batch = self.lent.pop(msg.batch_id, None)
            if batch is None:
                self.fail(msg.id, InvalidArgument(f"batch {msg.batch_id} is not held by this session"))
                return
            batch.release()
            self.reply(m.Ack(reply_to=msg.id, credits=self.credits()))
        elif isinstance(msg, m.Stats):
            self.reply(m.StatsReply(reply_to=msg.id, stats=self.daemon.stats(session=self)))
        elif isinstance(msg, m.Warm):
            self.daemon.start_warm(self, msg)
        elif isinstance(msg, m.Ping):
            self.reply(m.Pong(reply_to=msg.id, credits=self.credits(), session=self.sid))
        elif isinstance(msg, m.Bye):
            self.reply(m.Goodbye(reply_to=msg.id))
            self.daemon.end_session(self, "said bye")
        else:  # pragma: no cover - the connection lets nothing else through
            self.fail(getattr(msg, "id", 0), ProtocolError(f"unexpected {type(msg).__name__}"))

    def _push(self, msg: m.Push) -> None:
        credits = self.credits()
        if len(msg.samples) > credits:  # the client pushes only what it holds credits for
            self.fail(
                msg.id,
                ProtocolError(
                    f"a push of {len(msg.samples)} samples exceeds the {credits} credits this session holds "
                    f"(lookahead_samples={self.config.lookahead_samples})"
                ),
            )
            return
        samples = []
        for w in msg.samples:
            sample = self.daemon.to_sample(w)
            self.seqs[id(sample)] = w.seq
            samples.append(sample)
        if self.feed is None or (self.feed.final and msg.samples):
            self.feed = SampleFeed()
            self.feed.put(samples, msg.final)
            self.pipeline.push(self.feed)
        else:
            self.feed.put(samples, msg.final)
        with self._pushed:
            self._pushes += 1
            if msg.final:
                self._final_at = self._pushes
            self._pushed.notify_all()
        self.reply(m.Ack(reply_to=msg.id, credits=self.credits()))

    def _input_final(self) -> bool:
        """Has the client said that everything it will push (for now) is pushed?"""
        return self.feed is not None and self.feed.final

    def _pop_loop(self) -> None:
        while True:
            msg = self._pops.get()
            if msg is None or self.closed:
                return
            try:
                self._answer_pop(msg)
            finally:
                with self._lock:
                    self._pops_queued -= 1

    def _answer_pop(self, msg: m.Pop) -> None:
        """Wait for the next batch (or its error) and reply to ``msg``. A pop without a
        timeout waits until its batch is assembled or the session ends (the client keeps
        its own timeouts)."""
        deadline = None if msg.timeout_s is None else time.monotonic() + msg.timeout_s
        with self._lock:
            self._pop_id = msg.id
            self._report_dropped()
        batch = None
        reply = None
        while batch is None and reply is None and not self.closed:
            left = math.inf if deadline is None else max(0.0, deadline - time.monotonic())
            with self._pushed:  # what the client had said before this attempt
                input_final, final_at = self._input_final(), self._final_at
            try:
                batch = self.pipeline.pop(timeout=left)
            except PipelineDrained as e:
                if self.closed:
                    break
                if self.pipeline.closed:
                    reply = self._failed(msg.id, DamacyError(f"this session's pipeline stopped: {e}"))
                # drained, if the client's input was final when it sent this pop, or a push
                # sent after the pop said so
                elif input_final and (msg.final or final_at > msg.pushes):
                    reply = self._failed(msg.id, e)
                # the client's samples may still be on their way (its pushes and pops
                # travel separately): wait for them instead of calling the stream over
                elif left <= 0:
                    n = self.pipeline.counters()["batches"]
                    reply = self._failed(
                        msg.id,
                        TimeoutError(f"no batch {n} within {msg.timeout_s}s: waiting for the pushed iterable to yield samples"),
                    )
                else:
                    with self._pushed:
                        self._pushed.wait(min(0.2, left))
            except BaseException as e:  # a bad sample (on_error="raise"), a timeout, a failed batch
                reply = self._failed(msg.id, e, seq=self._seq(_first_failed(e)) if isinstance(e, SampleError) else None)
        with self._lock:
            self._pop_id = None  # no progress after the answer
            if batch is not None:
                if self.closed:
                    batch.release()
                    return
                info = batch.info
                self.lent[info.batch_id] = batch
                self.delivered_batches += 1
                self.delivered_samples += len(info.samples)
        if batch is not None:
            errors = [error_to_wire(err, seq=self.seqs.get(id(info.samples[i]))) for i, err in info.errors]
            skipped = [error_to_wire(err, seq=self._seq(s)) for s, err in info.skipped]  # seqs reported before
            reply = m.BatchReady(
                reply_to=msg.id,
                batch_id=info.batch_id,
                slot=batch.slot_index,
                count=len(info.samples),
                dtype=batch.numpy_dtype.name,
                seqs=[self._seq(s) for s in info.samples],
                errors=errors,
                skipped=skipped,
                credits=self.credits(),
            )
        if reply is not None:
            self.reply(reply)

    def _failed(self, reply_to: int, err: BaseException, seq: int | None = None) -> m.Failed:
        """A failure reply; the samples a failed batch used up are reported as consumed."""
        consumed = [self._seq(s) for s in getattr(err, "batch_samples", ())]
        return m.Failed(reply_to=reply_to, error=error_to_wire(err, seq=seq), credits=self.credits(), consumed=consumed)

    def _seq(self, sample: Any) -> int:
        return self.seqs.pop(id(sample), -1)

    def reply(self, msg: Any) -> None:
        self.daemon.post(self.identity, self.conn.reply(msg))

    def fail(self, reply_to: int, err: BaseException) -> None:
        self.reply(m.Failed(reply_to=reply_to, error=error_to_wire(err), credits=self.credits() if not self.closed else 0))


    # -- liveness ---------------------------------------------------------------------
    def dead(self, now: float, timeout: float) -> str | None:
        if self.pid_visible and not pid_alive(self.watch_pid):
            return f"client process {self.pid} is gone"
        if now - self.last_seen > timeout:
            return f"no message from the client for {now - self.last_seen:.1f} s"
        return None

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            lent = list(self.lent.values())
            self.lent.clear()
        if self.feed is not None:
            self.feed.close()
        self._pops.put(None)
        while lent:
            lent.pop().release()
        if self.pipeline is not None:
            self.pipeline.close()
        self._popper.join(2.0)
        self.seqs.clear()
        # unmapped now, or as soon as the last task writing into them lets go; their bytes
        # stay in the budget until then
        segments, self.segments = self.segments, []
        self.daemon.retire(segments, budget=self.pipeline is not None)

    def describe(self) -> dict[str, Any]:
        if self.config is None:
            return {"session": self.sid, "pid": self.pid, "rank": self.rank, "control": True}
        counters = self.pipeline.counters()
        return {
            "session": self.sid,
            "pid": self.pid,
            "rank": self.rank,
            "batches": self.delivered_batches,
            "samples": self.delivered_samples,
            "sample_errors": counters["sample_errors"],
            "samples_pulled": counters["samples_pulled"],
            "held_batches": len(self.lent),
            "slot_bytes": sum(s.nbytes for s in self.segments),
            "samples_per_batch": self.config.samples_per_batch,
            "sample_shape": list(self.config.sample_shape),
            "dtype": self.config.dtype,
        }


def _first_failed(err: SampleError) -> Any:
    pairs = getattr(err, "batch_errors", None)
    return pairs[0][0] if pairs else None


class Daemon:
    """The damacyd process: sockets, sessions, the shared engine."""

    def __init__(self, options: DaemonOptions) -> None:
        self.options = options
        self.started = time.time()
        remove_stale(log.info)
        roots = [os.path.realpath(r) for r in options.allow_roots]
        self.roots = roots
        if not roots:
            log.warning("no --allow-root given: every sample will be refused until damacyd serves a directory")
        self.metadata = ZarrMetadata(
            FileMetadataReader(concurrency=64, roots=roots),
            MetadataCache(options.array_cache_entries, options.shard_index_cache_entries),
        )
        self.planner = ChunkPlanner(self.metadata, PlanLimits())
        self.executor = CpuExecutor(
            FileReader(workers=options.io_workers, roots=roots),
            CpuLimits(
                max_memory_bytes=options.memory_bytes,
                decode_workers=options.decode_workers,
                chunk_cache_bytes=options.chunk_cache_bytes,
            ),
        )
        self.sessions: dict[bytes, Session] = {}
        self._sessions_lock = threading.Lock()
        self.segment_gid = socket_gid(options)
        # segments of ended sessions still mapped (a task in flight holds a view): (segment,
        # bytes to return to the budget once unmapped, when it was first tried)
        self._retiring: list[tuple[Segment, int, float]] = []
        self._retiring_lock = threading.Lock()
        self._raise_descriptor_limit()
        self._starting: set[bytes] = set()  # identities whose session is being set up
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waker = Waker()
        self._stop = threading.Event()
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.SNDHWM, 100_000)  # replies are never dropped for a busy client
        # a larger message drops its connection before it is buffered
        self.socket.setsockopt(zmq.MAXMSGSIZE, options.max_message_bytes)
        bind_socket(self.socket, options)
        self.endpoint = options.endpoint
        self.malformed = 0
        self.received = 0  # messages read from the socket

    # -- plumbing -----------------------------------------------------------------
    def post(self, identity: bytes, payload: bytes) -> None:
        """Queue a message for a client (from any thread)."""
        self._outbox.put((identity, payload))
        self._waker.wake()

    def stop(self) -> None:
        self._stop.set()
        self._waker.wake()

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._waker.fd, zmq.POLLIN)
        next_check = time.monotonic() + 0.5
        log.info("damacyd serving %s (pid %d)", self.endpoint, os.getpid())
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(250))
                if self.socket in events:
                    self._receive_all()
                if self._waker.fd in events:
                    self._waker.drain()
                self._flush()
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + 0.5
                    self._check_liveness(now)
                    self._retry_retiring(now)
        finally:
            self.shutdown()

    def _receive_all(self) -> None:
        """Handle the messages waiting, at most :data:`MESSAGES_PER_TURN` (the loop flushes
        replies and comes back for the rest)."""
        for _ in range(MESSAGES_PER_TURN):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.received += 1
            if len(frames) != 2:
                self.malformed += 1
                log.warning("dropped a message of %d frames", len(frames))
                continue
            try:
                self._handle(frames[0].bytes, frames[1].bytes, frames[1])
            except Exception:  # one bad request never takes the daemon down
                log.exception("error handling a request")

    def _flush(self) -> None:
        while True:
            try:
                identity, payload = self._outbox.get_nowait()
            except queue.Empty:
                return
            try:
                self.socket.send_multipart([identity, payload], zmq.NOBLOCK)
            except zmq.ZMQError as e:  # the peer is gone (or its queue is full)
                log.debug("dropped a reply to a gone client: %s", e)

    def _handle(self, identity: bytes, data: bytes, frame: zmq.Frame | None = None) -> None:
        with self._sessions_lock:
            session = self.sessions.get(identity)
        conn = session.conn if session is not None else ServerConnection()
        try:
            msg = conn.receive(data)
        except ProtocolError as e:
            self.malformed += 1
            log.warning("protocol error from a client: %s", e)
            self.post(identity, m.encode(m.Failed(reply_to=m.request_id(data) or 0, error=error_to_wire(e))))
            if conn.state is State.FAILED and session is not None:
                self.end_session(session, "protocol version mismatch")
            return
        if session is None and isinstance(msg, m.Ping):
            self.post(identity, m.encode(m.Pong(reply_to=msg.id, session="")))  # no session here
            return
        if session is None:
            assert isinstance(msg, m.Hello)
            peer = peer_of(frame, self.endpoint)
            refused = self._refuse(peer)
            if refused:
                log.warning("refused a client (pid %d, %s): %s", msg.pid, peer or "credentials unknown", refused)
                conn.state = State.FAILED
                self.post(identity, m.encode(m.Failed(reply_to=msg.id, error=error_to_wire(DamacyError(refused)))))
                return
            with self._sessions_lock:
                if identity in self._starting:
                    self.post(identity, m.encode(m.Failed(reply_to=msg.id, error=error_to_wire(ProtocolError("hello twice")))))
                    return
                self._starting.add(identity)
            # slots are allocated and touched off the loop thread, which keeps answering
            threading.Thread(target=self._start_session, args=(identity, conn, msg, peer), name="damacyd-start", daemon=True).start()
            return
        session.handle(msg)

    def _refuse(self, peer: Peer | None) -> str | None:
        """Why a client may not open a session (``--allow-uid``/``--allow-gid``), or None."""
        o = self.options
        if not (o.allow_uids or o.allow_gids):
            return None
        if peer is None:
            return "permission denied: this damacyd accepts listed users only, and cannot tell who this client is"
        if peer.uid == os.geteuid() or peer.uid in o.allow_uids or any(g in o.allow_gids for g in peer.gids):
            return None
        return f"permission denied: uid {peer.uid} (groups {', '.join(map(str, peer.gids))}) may not use this damacyd"

    def _start_session(self, identity: bytes, conn: ServerConnection, msg: m.Hello, peer: Peer | None = None) -> None:
        try:
            try:
                session = Session(self, identity, conn, msg, peer)
            except Exception as e:  # a bad config, no memory left, no room in /dev/shm...
                log.warning("refused a session of pid %d: %s", msg.pid, e)
                err = e if isinstance(e, DamacyError) else DamacyError(f"cannot start a session: {type(e).__name__}: {e}")
                self.post(identity, m.encode(m.Failed(reply_to=msg.id, error=error_to_wire(err))))
                return
            with self._sessions_lock:
                self.sessions[identity] = session
            log.info("session %s: pid %s rank %s, %s", session.sid, msg.pid, msg.rank, peer or "peer credentials unknown")
            self.post(identity, conn.welcome(session.welcome(msg.id)))
        finally:
            with self._sessions_lock:
                self._starting.discard(identity)

    def _check_liveness(self, now: float) -> None:
        with self._sessions_lock:
            sessions = list(self.sessions.values())
        for session in sessions:
            why = session.dead(now, self.options.heartbeat_timeout_s)
            if why:
                self.end_session(session, why)

    def end_session(self, session: Session, why: str) -> None:
        with self._sessions_lock:
            if self.sessions.get(session.identity) is session:
                del self.sessions[session.identity]
        log.info("session %s (pid %s) ended: %s", session.sid, session.pid, why)
        threading.Thread(target=session.close, name=f"damacyd-close-{session.sid}", daemon=True).start()

    # -- slot memory and descriptors ---------------------------------------------------
    def retire(self, segments: list[Segment], budget: bool) -> None:
        """Unmap the segments of an ended session, returning their bytes to the budget
        (``budget``) as each goes; one still in use is retried by the loop."""
        now = time.monotonic()
        for seg in segments:
            if seg.close():
                if budget:
                    self.executor.release_slots(seg.nbytes)
            else:
                with self._retiring_lock:
                    self._retiring.append((seg, seg.nbytes if budget else 0, now))

    def _retry_retiring(self, now: float) -> None:
        with self._retiring_lock:
            waiting, self._retiring = self._retiring, []
        if not waiting:
            return
        if any(now - since > 2.0 for _, _, since in waiting):
            gc.collect()  # a view kept only by a reference cycle
        for seg, nbytes, since in waiting:
            if seg.close():
                if nbytes:
                    self.executor.release_slots(nbytes)
                continue
            if since <= now - 30.0 < since + 0.5:
                log.warning("segment %s (%d bytes) of an ended session is still in use after 30 s", seg.name, seg.nbytes)
            with self._retiring_lock:
                self._retiring.append((seg, nbytes, since))

    def retiring_bytes(self) -> int:
        with self._retiring_lock:
            return sum(seg.nbytes for seg, _, _ in self._retiring)

    @staticmethod
    def _raise_descriptor_limit() -> None:
        """Every slot mapping keeps a file descriptor: take the hard limit."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = 1 << 20
        if soft != resource.RLIM_INFINITY and soft < hard:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            except (ValueError, OSError):
                pass

    def check_descriptors(self, slots: int) -> None:
        """Refuse a session whose slot mappings would leave too few file descriptors."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return
        try:
            open_now = len(os.listdir("/proc/self/fd"))
        except OSError:
            return
        if open_now + slots + FD_RESERVE > soft:
            raise BudgetExceeded(
                f"damacyd has {open_now} of its {soft} file descriptors open; a session of {slots} slots needs "
                f"{slots} more and {FD_RESERVE} stay free (raise `ulimit -n` for damacyd, or end other sessions)"
            )

    def shutdown(self) -> None:
        with self._sessions_lock:
            sessions = list(self.sessions.values())
            self.sessions.clear()
        for session in sessions:
            session.close()
        self._retry_retiring(time.monotonic() + 3.0)
        self.executor.close()
        self.socket.close(0)
        self.ctx.term()
        cleanup_endpoint(self.options)
        self._waker.close()
        log.info("damacyd stopped")

    # -- services -------------------------------------------------------------------
    def _session_list(self) -> list[Session]:
        with self._sessions_lock:
            return list(self.sessions.values())

    def to_sample(self, w: m.WireSample) -> Any:
        """A wire sample as a Sample/IndexQuery; one that may not be served becomes a
        :class:`BadSample` whose error its pop reports."""
        try:
            self.metadata.reader.check_allowed(resolve_uri(w.uri)[1])
            if w.box is not None:
                return Sample(w.uri, [tuple(e) for e in w.box])
            if w.index is not None:
                axes = [
                    slice(a.start, a.stop, a.step) if a.indices is None else a.indices for a in w.index
                ]
                return IndexQuery(w.uri, tuple(axes))
            raise InvalidArgument("a sample needs a box or an index selection", uri=w.uri)
        except (SampleError, ValueError, TypeError, OverflowError) as e:
            if not isinstance(e, SampleError):
                e = InvalidArgument(f"{type(e).__name__}: {e}")
            box = "" if w.box is None else ", ".join(f"{'' if a is None else a}:{'' if b is None else b}" for a, b in w.box)
            what = f"Sample({w.uri!r}, [{box}])" if w.box is not None else f"IndexQuery({w.uri!r}, ...)"
            return BadSample(w.uri, e.with_context(uri=w.uri), what)

    def start_warm(self, session: Session, msg: m.Warm) -> None:
        def run() -> None:
            last = [0.0]

            def progress(done: int, total: int, item: str) -> None:
                now = time.monotonic()
                if now - last[0] >= 0.05 or done >= total:  # at most 20 a second
                    last[0] = now
                    session.reply(m.WarmProgress(reply_to=msg.id, done=done, total=total, item=item))

            try:
                result = warm(self, msg.uris, msg.shard_indexes, msg.chunks, progress)
            except Exception as e:  # noqa: BLE001 - the client waits for WarmDone whatever happens
                log.exception("warming failed")
                result = {"arrays": 0, "shard_indexes": 0, "chunks": 0, "errors": [DamacyError(f"warming failed: {type(e).__name__}: {e}")]}
            session.reply(
                m.WarmDone(
                    reply_to=msg.id,
                    arrays=result["arrays"],
                    shard_indexes=result["shard_indexes"],
                    chunks=result["chunks"],
                    errors=[error_to_wire(e) for e in result["errors"]],
                )
            )

        threading.Thread(target=run, name=f"damacyd-warm-{session.sid}", daemon=True).start()

    def stats(self, session: Session | None = None) -> dict[str, Any]:
        ex = self.executor
        out = {
            "daemon": {
                "pid": os.getpid(),
                "endpoint": self.endpoint,
                "uptime_s": time.time() - self.started,
                "allow_roots": self.roots,
                "messages": self.received,
                "malformed_messages": self.malformed,
            },
            "stages": ex.stats.snapshot(),
            "cache": self.metadata.cache.stats(),
            "chunk_cache": ex.chunk_cache.stats() if ex.chunk_cache is not None else None,
            "memory": {
                "budget_bytes": ex.budget.total,
                "slot_bytes": ex.budget.total - ex.inflight_capacity,
                "in_use_bytes": ex.budget.used,
                "peak_bytes": ex.budget.peak,
                "chunk_cache_bytes": ex.chunk_cache.nbytes if ex.chunk_cache is not None else 0,
                "retiring_slot_bytes": self.retiring_bytes(),
            },
            "sessions": [s.describe() for s in self._session_list()],
        }
        if session is not None:
            out["session"] = session.describe()
        return out
