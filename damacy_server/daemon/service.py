"""damacyd: one daemon per node serving every training rank over ZeroMQ.

The daemon owns what ranks share: the metadata and shard-index caches, the decoded-chunk
cache, the I/O, decode and planning pools, the memory budget, and one CUDA executor per GPU
its sessions ask for. Each client connection is a :class:`~damacy_server.daemon.session.Session`
driving a batch engine of its own (its queue, lookahead, error policy and batch slots in
POSIX shared memory, or in GPU memory shared over CUDA IPC); batches are handed over as
(slot, batch id) and read in the client without a copy.

Threads: one loop thread owns the ROUTER socket and every session's state; the engines'
worker threads tell it that a session has news (:meth:`Daemon.wake`) and hand it replies
through an outbox, both with a wake-up pipe. Sessions have no threads of their own.

(Over 400 lines: one job, the daemon; the loop, session bookkeeping, slot-memory retiring and descriptor limits
all act on the daemon's one state, owned by the loop thread.)
"""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import os
import queue
import resource
import threading
import time
from collections.abc import Iterator
from typing import Any

import zmq

from damacy_protocol import messages as m
from damacy_protocol import stats as st
from damacy_protocol.connection import UNANSWERED, ServerConnection, State
from damacy_protocol.errors import (
    BudgetExceeded,
    DamacyError,
    InvalidArgument,
    ProtocolError,
    redact_uri,
)
from damacy_protocol.samples import PUSHED_ITEM
from damacy_protocol.wire import describe_wire, error_to_wire, longest_list, sample_from_wire, text
from damacy_runtime.waker import Waker
from damacy_server.cpu.executor import CpuExecutor
from damacy_server.cuda.ipc import gpu_executor
from damacy_server.daemon.endpoint import Peer, bind_socket, cleanup_endpoint, peer_of, socket_gid
from damacy_server.daemon.host import Totals
from damacy_server.daemon.options import DaemonOptions
from damacy_server.daemon.session import Session
from damacy_server.engine.shm import Segment, remove_stale
from damacy_server.engine.slots import SlotSharing
from damacy_server.plan.items import BadSample
from damacy_server.plan.planner import Planner
from damacy_server.plan.resolve import Caches, Resolver
from damacy_server.store import RemoteStores
from damacy_server.workers import WorkerPool
from damacy_server.zarr.codecs.chain import registry

log = logging.getLogger("damacyd")

#: the send flags as plain ints (zmq's are enum flags, combined anew on every call otherwise)
_NOW = int(zmq.NOBLOCK)
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)


def _recv_frames(socket: zmq.Socket) -> list[zmq.Frame]:
    """The next message's frames, without waiting (zmq.Again when none): recv_multipart's
    work without its socket option lookup per frame (each frame says whether more follow;
    the frames of a message arrive together)."""
    parts = [socket.recv(_NOW, copy=False)]
    while parts[-1].more:
        parts.append(socket.recv(_NOW, copy=False))
    return parts


#: messages read from the socket per loop turn before replies are flushed: a client flooding
#: the daemon delays another client's answer by at most this many messages (ZeroMQ takes
#: turns between clients with messages waiting)
MESSAGES_PER_TURN = 32
#: rounds of pumping per turn while pumps give sessions news (releases that free slots start
#: batches, whose delivery is news); what is left is pumped after the next poll
PUMP_ROUNDS = 4
#: file descriptors kept free for sockets, files being read and new sessions' handshakes
FD_RESERVE = 64


class Daemon:
    """The damacyd process: sockets, sessions, the shared engine (the :class:`SessionHost`
    its sessions see)."""

    def __init__(self, options: DaemonOptions) -> None:
        self.options = options
        self.started = time.time()
        remove_stale(lambda message: log.info(message, extra={"event": "stale_segments"}))
        roots = [os.path.realpath(r) for r in options.allow_roots]
        self.roots = roots
        self.remote = RemoteStores(options.storage_options, allow=options.allow_prefixes, roots=options.allow_roots)
        self._refusals_logged: set[str] = set()  # causes of refused samples already logged
        if not roots and not options.allow_prefixes:
            log.warning("no --allow-root or --allow-prefix given: every sample will be refused until damacyd serves data")
        self.metadata = Resolver(options.file_metadata_reader(roots), Caches(options.metadata_cache), self.remote)
        self.planner = Planner(self.metadata, options.plan_limits)
        # planning (and the metadata reads it may need) runs here, off the loop thread;
        # sessions take turns
        self.plan_pool = WorkerPool(2, "damacyd-plan")
        self.executor = CpuExecutor(reader=options.file_reader(roots), limits=options.cpu_limits)
        registry()  # the codecs load now, not in the first session's first batch
        self._gpus: dict[str, Any] = {}  # GPU UUID -> its executor (one context per GPU), made on first use
        self._gpus_lock = threading.Lock()
        self.sessions: dict[bytes, Session] = {}
        self._sessions_lock = threading.Lock()
        self._fd_lock = threading.Lock()
        self._fd_held = 0  # descriptors held for sessions opening their slots (descriptors())
        self.sharing = SlotSharing(options.socket_mode, socket_gid(options), self.retire, self.retire_when)
        # segments of ended sessions still mapped (a task in flight holds a view): (segment,
        # what returns its bytes to the budget once unmapped, when it was first tried)
        self._retiring: list[tuple[Segment, Any, float]] = []
        self._retiring_lock = threading.Lock()
        self._waiting: list[tuple[Any, Any]] = []  # (may it go now?, what frees it): GPU slots still mapped
        self._raise_descriptor_limit()
        self._starting: set[bytes] = set()  # identities whose session is being set up
        self._stopping = False  # shutdown began: a session that finishes starting closes
        self._news: set[Session] = set()  # sessions whose engine changed, to pump
        self._news_lock = threading.Lock()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # messages other threads post
        self._waker = Waker()
        self._loop_thread: int | None = None  # the thread serving the socket (serve_forever's)
        self._handling = False  # the loop is between its poll and its pump
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
        self.sent = 0  # replies written to it
        self.requests: collections.Counter[str] = collections.Counter()  # requests handled, by kind
        self.loop_cpu_s = 0.0  # the loop thread's CPU time handling messages, pumping sessions and replying
        self.totals = Totals()  # since start, all sessions (ended ones included): what --metrics exports
        self.metrics_server = None

    # -- plumbing -----------------------------------------------------------------
    def post(self, identity: bytes, payload: bytes) -> None:
        """Send a message to a client (from any thread): on the loop thread at once, after
        what other threads queued before it; from another thread queued for the loop."""
        if threading.get_ident() == self._loop_thread:
            if not self._outbox.empty():
                self._flush()
            self._send(identity, payload)
            return
        self._outbox.put((identity, payload))
        self._waker.wake()

    def wake(self, session: Session) -> None:
        """A session's engine has news (from any thread): the loop pumps it (on the loop
        thread, while it handles messages, no wake-up is written: it pumps next)."""
        with self._news_lock:
            self._news.add(session)
        if not (self._handling and threading.get_ident() == self._loop_thread):
            self._waker.wake()

    def _pump(self) -> None:
        """Pump the sessions with news, and those that have news from that (a pump's replies
        and releases may start batches), a few rounds; what is left wakes the next turn."""
        for _ in range(PUMP_ROUNDS):
            with self._news_lock:
                news, self._news = self._news, set()
            if not news:
                return
            for session in news:
                try:
                    session.pump()
                except Exception:  # a bug in one session never takes the daemon down
                    log.exception("session %s failed", session.sid)
                    self.end_session(session, "internal error")
        if self._news:
            self._waker.wake()

    def stop(self) -> None:
        self._stop.set()
        self._waker.wake()

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._waker.fd, zmq.POLLIN)
        next_check = time.monotonic() + 0.5
        o = self.options
        log.info(
            "damacyd serving %s (pid %d): roots %s, prefixes %s; memory %d MiB, chunk cache %d MiB; "
            "%d readers, %d decoders; native decode path %s",
            self.endpoint, os.getpid(), ", ".join(self.roots) or "none", ", ".join(self.remote.allow or []) or "none",
            o.cpu_limits.max_memory_bytes >> 20, o.cpu_limits.chunk_cache_bytes >> 20, o.reader.workers, o.cpu_limits.decode_workers,
            "on" if self.executor.native is not None else "off (numpy)",
            extra={"event": "start"},
        )
        self._loop_thread = threading.get_ident()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(250))
                turn = time.monotonic()  # silence is judged against this: what came during a long turn is read next
                busy = time.thread_time()
                self._handling = True  # (news from here on is pumped below: see wake)
                if self.socket in events:
                    self._receive_all()
                if self._waker.fd in events:
                    self._waker.drain()
                self._pump()
                self._handling = False
                self._flush()
                self.loop_cpu_s += time.thread_time() - busy
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + 0.5
                    self._check_liveness(turn)
                    self._retry_retiring(now)
        finally:
            self.shutdown()

    def _receive_all(self) -> None:
        """Handle the messages waiting, at most :data:`MESSAGES_PER_TURN` (the loop flushes
        replies and comes back for the rest)."""
        for _ in range(MESSAGES_PER_TURN):
            try:
                frames = _recv_frames(self.socket)
            except zmq.Again:
                return
            self.received += 1
            if len(frames) != 2:
                self.malformed += 1
                log.warning("refused a message of %d frames", len(frames))
                if len(frames) > 2:  # identity, then parts where one was expected: told, not left to time out
                    data = frames[1].bytes
                    error = ProtocolError(f"a request is one frame, this one came in {len(frames) - 1}")
                    self.post(frames[0].bytes, m.encode(m.Failed(reply_to=m.request_id(data) or 0, error=error_to_wire(error))))
                continue
            try:
                self._handle(frames[0].bytes, frames[1].bytes, frames[1])
            except Exception:  # one bad request never takes the daemon down
                log.exception("error handling a request")

    def _flush(self) -> None:
        """Send what other threads queued (on the loop thread)."""
        while not self._outbox.empty():
            try:
                identity, payload = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._send(identity, payload)

    def _send(self, identity: bytes, payload: bytes) -> None:
        """Write one message to the socket (on the loop thread, which owns it)."""
        try:
            self.socket.send(identity, _MORE)
            self.socket.send(payload, _NOW)
            self.sent += 1
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
            log.warning("protocol error from a client: %s", e, extra={"event": "protocol_error", "error": type(e).__name__})
            self.post(identity, m.encode(m.Failed(reply_to=m.request_id(data) or 0, error=error_to_wire(e))))
            if conn.state is State.FAILED and session is not None:
                self.end_session(session, "protocol version mismatch")
            return
        self.requests[type(msg).__name__] += 1
        if session is None and isinstance(msg, m.Ping):
            self.post(identity, m.encode(m.Pong(reply_to=msg.id, session="")))  # no session here
            return
        if session is None:
            assert isinstance(msg, m.Hello)
            peer = peer_of(frame, self.endpoint)
            refused = self._refuse(peer)
            if refused:
                log.warning("refused a client (pid %d, %s): %s", msg.pid, peer or "credentials unknown", refused,
                            extra={"event": "refused_client", "client_pid": msg.pid, "rank": msg.rank})
                self.post(identity, conn.refuse(msg.id, DamacyError(refused)))
                return
            with self._sessions_lock:
                if identity in self._starting:
                    self.post(identity, m.encode(m.Failed(reply_to=msg.id, error=error_to_wire(ProtocolError("hello twice")))))
                    return
                self._starting.add(identity)
            # slots are allocated and touched off the loop thread, which keeps answering
            threading.Thread(target=self._start_session, args=(identity, conn, msg, peer), name="damacyd-start", daemon=True).start()
            return
        try:
            session.handle(msg)
        except Exception as e:
            if isinstance(msg, UNANSWERED):  # its silence would say it was taken: it says why not
                session.fail(msg.id, DamacyError(f"damacyd failed handling this {type(msg).__name__.lower()}: {type(e).__name__}: {e}"))
            raise

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
                log.warning("refused a session of pid %d: %s", msg.pid, e,
                            extra={"event": "refused_session", "client_pid": msg.pid, "rank": msg.rank, "error": type(e).__name__})
                err = e if isinstance(e, DamacyError) else DamacyError(f"cannot start a session: {type(e).__name__}: {e}")
                with self._sessions_lock:  # before the refusal goes: the client may say hello again at once
                    self._starting.discard(identity)
                self.post(identity, conn.refuse(msg.id, err))
                return
            session.last_seen = time.monotonic()  # its start may have waited long (for memory): silence counts from now
            with self._sessions_lock:
                stopping = self._stopping
                if not stopping:
                    self.sessions[identity] = session
            if stopping:  # the daemon stops: this one never served
                session.close()
                return
            log.info("session %s: pid %s rank %s, %s", session.sid, msg.pid, msg.rank, peer or "peer credentials unknown",
                     extra={"event": "session_start", "session": session.sid, "client_pid": msg.pid, "rank": msg.rank})
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
                log.warning("reclaiming session %s (pid %s): %s", session.sid, session.pid, why,
                            extra={"event": "reclaimed", "session": session.sid, "client_pid": session.pid, "rank": session.rank})
                self.end_session(session, why)

    def end_session(self, session: Session, why: str) -> None:
        with self._sessions_lock:
            if self.sessions.get(session.identity) is session:
                del self.sessions[session.identity]
        log.info("session %s (pid %s) ended: %s", session.sid, session.pid, why,
                 extra={"event": "session_end", "session": session.sid, "client_pid": session.pid})
        session.close()

    def gpu_executor(self, uuid: str) -> Any:
        """The executor of the GPU named ``uuid`` (a session on it decodes and assembles
        there, into slots shared over CUDA IPC), made on first use."""
        with self._gpus_lock:
            executor = self._gpus.get(uuid)
            if executor is None:
                executor = self._gpus[uuid] = gpu_executor(uuid, self.roots, self.options)
            return executor

    # -- slot memory and descriptors ---------------------------------------------------
    def retire(self, segments: list[Segment], release) -> None:
        """Unmap the segments of an ended session, calling ``release(nbytes)`` as each goes;
        one still in use is retried by the loop."""
        now = time.monotonic()
        for seg in segments:
            if seg.close():
                release(seg.nbytes)
            else:
                with self._retiring_lock:
                    self._retiring.append((seg, release, now))

    def retire_when(self, ready, free) -> None:
        """Run ``free()`` once ``ready()`` says so (now, or on a later turn of the loop)."""
        if ready():
            free()
            return
        with self._retiring_lock:
            self._waiting.append((ready, free))

    def _retry_retiring(self, now: float) -> None:
        with self._retiring_lock:
            waiting, self._waiting = self._waiting, []
        for ready, free in waiting:
            self.retire_when(ready, free)
        with self._retiring_lock:
            waiting, self._retiring = self._retiring, []
        if not waiting:
            return
        if any(now - since > 2.0 for _, _, since in waiting):
            gc.collect()  # a view kept only by a reference cycle
        for seg, release, since in waiting:
            if seg.close():
                release(seg.nbytes)
                continue
            if since <= now - 30.0 < since + 0.5:
                log.warning("segment %s (%d bytes) of an ended session is still in use after 30 s", seg.name, seg.nbytes)
            with self._retiring_lock:
                self._retiring.append((seg, release, since))

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

    @contextlib.contextmanager
    def descriptors(self, slots: int) -> Iterator[None]:
        """Refuse a session whose slot mappings would leave too few file descriptors; else
        hold its ``slots`` descriptors for it while it opens them (sessions starting together
        are counted together)."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        with self._fd_lock:
            try:
                open_now = len(os.listdir("/proc/self/fd"))
            except OSError:
                open_now = None
            if soft != resource.RLIM_INFINITY and open_now is not None and open_now + self._fd_held + slots + FD_RESERVE > soft:
                raise BudgetExceeded(
                    f"damacyd has {open_now} of its {soft} file descriptors open"
                    + (f" and {self._fd_held} held for sessions starting" if self._fd_held else "")
                    + f"; a session of {slots} slots needs {slots} more and {FD_RESERVE} stay free (raise `ulimit -n` "
                    "for damacyd, or end other sessions)"
                )
            self._fd_held += slots
        try:
            yield
        finally:  # its slots are open now (counted as open), or it was refused
            with self._fd_lock:
                self._fd_held -= slots

    def shutdown(self) -> None:
        if self.metrics_server is not None:
            server, thread = self.metrics_server
            server.shutdown()
            server.server_close()
            thread.join(5)
        with self._sessions_lock:
            self._stopping = True
            sessions = list(self.sessions.values())
            self.sessions.clear()
        for session in sessions:
            session.close()
        deadline = time.monotonic() + 10.0  # sessions still starting: closed as they finish
        while time.monotonic() < deadline:
            with self._sessions_lock:
                if not self._starting:
                    break
            time.sleep(0.01)
        self._retry_retiring(time.monotonic() + 3.0)
        self.plan_pool.close()
        self.executor.close()
        with self._gpus_lock:
            gpus, self._gpus = list(self._gpus.values()), {}
        for executor in gpus:
            executor.close()
        self.socket.close(0)
        self.ctx.term()
        # a session still starting made segments no session list holds: none outlives us
        remove_stale(own=True)
        cleanup_endpoint(self.options)
        self._waker.close()
        log.info("damacyd stopped", extra={"event": "stop"})

    # -- services -------------------------------------------------------------------
    def _session_list(self) -> list[Session]:
        with self._sessions_lock:
            return list(self.sessions.values())

    def to_sample(self, w: m.WireSample, longest: int | None = None) -> Any:
        """A wire sample as a Sample/IndexQuery; one that may not be served becomes a
        :class:`BadSample` whose error its pop reports. ``longest``: the most indices an
        index list may hold (the longest axis of the session's samples: a longer list is
        refused before it is read, on this thread that serves every session)."""
        try:
            if w.refused is not None:
                raise InvalidArgument(w.refused)
            if longest is not None and (n := longest_list(w)) > longest:
                raise InvalidArgument(f"an index list of {n} indices selects more than the batch's samples hold (no axis is longer than {longest})")
            self.metadata.check_allowed(w.uri)
            return sample_from_wire(w)
        except (DamacyError, ValueError, TypeError, OverflowError) as e:
            if not isinstance(e, DamacyError):
                e = InvalidArgument(f"{type(e).__name__}: {e}")
            self._log_refusal(w.uri, e)
            if not w.uri:  # a pushed item that is no sample (its client says what it was)
                return BadSample(None, e, PUSHED_ITEM)
            return BadSample(w.uri, e.with_context(uri=w.uri), describe_wire(w))

    def _log_refusal(self, uri: str, e: DamacyError) -> None:
        """A refused sample, logged once per cause (its reason), not once per sample (its uri
        without the credentials or signature it may hold)."""
        cause = f"{type(e).__name__}: {e.reason.replace(uri, '<uri>') if uri else e.reason}"[:256]  # (paths apart)
        if cause in self._refusals_logged or len(self._refusals_logged) >= 1024:
            return
        self._refusals_logged.add(cause)
        shown = redact_uri(uri)
        shown = shown if len(shown) <= 512 else shown[:512] + "..."
        log.warning("refused %s: %s (said once per cause)", shown, e.reason[:1024], extra={"event": "refused_path", "uri": shown, "error": type(e).__name__})

    def queue_depths(self) -> dict[str, int]:
        """Tasks waiting for a thread, per pool."""
        return {"plan": self.plan_pool.queued(), **self.executor.queue_depths()}

    def stats(self, session: Session | None = None) -> st.DaemonStats:
        ex = self.executor
        cache = self.metadata.cache.stats()
        return st.DaemonStats(
            daemon=st.DaemonFigures(
                pid=os.getpid(),
                endpoint=self.endpoint,
                uptime_s=time.time() - self.started,
                allow_roots=[text(r) for r in self.roots],
                allow_prefixes=[text(r) for r in self.remote.allow or []],
                messages=self.received,
                malformed_messages=self.malformed,
                replies=self.sent,
                loop_cpu_s=self.loop_cpu_s,
                batches=self.totals.snapshot()["batches"],
                requests=dict(self.requests),
            ),
            stages={name: st.StageFigures(**d) for name, d in ex.stats.snapshot().items()},
            cache=st.MetadataCacheFigures(st.CacheFigures(**cache["arrays"]), st.CacheFigures(**cache["shard_indexes"])),
            chunk_cache=st.CacheFigures(**ex.chunk_cache.stats()) if ex.chunk_cache is not None else None,
            disk_cache=st.DiskTierFigures(**ex.disk_tier.stats()) if ex.disk_tier is not None else None,
            memory=st.MemoryFigures(
                budget_bytes=ex.budget.total,
                slot_bytes=ex.budget.total - ex.inflight_capacity,
                in_use_bytes=ex.budget.used,
                peak_bytes=ex.budget.peak,
                chunk_cache_bytes=ex.chunk_cache.nbytes if ex.chunk_cache is not None else 0,
                retiring_slot_bytes=self.retiring_bytes(),
            ),
            sessions=[s.describe() for s in self._session_list()],
            session=session.describe() if session is not None else None,
        )

