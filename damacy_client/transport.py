"""The client's transport: one session with damacyd over a ZeroMQ DEALER socket.

An I/O thread owns the socket: it sends requests, matches replies to them by id, pings the
daemon and declares it gone after a few seconds of silence (or when a pong shows that the
daemon no longer holds this session: it restarted). Callers wait on a :class:`Call`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from damacy_protocol import messages as m
from damacy_protocol.config import Config
from damacy_protocol.connection import ClientConnection
from damacy_protocol.errors import DaemonUnavailable, DamacyError, ErrorKind, ProtocolError, UnexpectedReply
from damacy_protocol.wire import error_from_wire
from damacy_runtime.endpoint import check_private_folder, default_endpoint, node_endpoint
from damacy_runtime.waker import Waker

log = logging.getLogger("damacy")

#: how often the client shows it is alive, and how long a silent daemon is given
HEARTBEAT_S = 1.0
DEAD_AFTER_S = 4.0
#: the I/O thread's poll timeout (requests and close wake it at once)
POLL_MS = 100


class Call:
    """A request waiting for its reply (or replies, for warm)."""

    __slots__ = ("event", "reply", "error", "on_progress", "session", "answers")

    def __init__(self, on_progress: Callable[[Any], None] | None = None) -> None:
        self.event = threading.Event()
        self.reply: Any = None
        self.error: BaseException | None = None
        self.on_progress = on_progress
        self.session = ""  # for a ping: the session the client held when it was sent
        self.answers: m.Pop | None = None  # for a pop's answer: that pop (as the stream counted it)

    def wait(self, timeout: float | None, what: str) -> Any:
        if not self.event.wait(timeout):
            raise DaemonUnavailable(f"damacyd did not answer {what} within {timeout:.1f} s")
        if self.error is not None:
            raise self.error
        return self.reply


class Connection:
    """A session with damacyd: socket, I/O thread, heartbeats, request/reply matching."""

    def __init__(
        self, endpoint: str | None = None, *, rank: int | None = None, config: Config | None = None, connect_timeout_s: float = 10.0,
        device: str | None = None,
    ) -> None:
        self.endpoint = endpoint or default_endpoint()
        if self.endpoint == node_endpoint():  # in /tmp: only a socket in a folder of this user's
            check_private_folder(os.path.dirname(self.endpoint[len("ipc://") :]))
        self._proto = ClientConnection()  # its pending table holds each request's Call
        self._lock = threading.Lock()
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
        self._teardown_on_exit = False  # closed from the I/O thread itself: it tears down as it ends
        self._last_recv = time.monotonic()
        try:
            self._sock.connect(self.endpoint)
        except zmq.ZMQError as e:
            self._teardown()
            raise DaemonUnavailable(f"cannot connect to {self.endpoint}: {e}") from e
        self._thread = threading.Thread(target=self._io_loop, name="damacy-client-io", daemon=True)
        self._thread.start()
        call = Call()
        with self._lock:
            payload = self._proto.hello(os.getpid(), rank, config, device, token=call)
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

    # -- flow control ---------------------------------------------------------------
    @property
    def credits(self) -> int:
        """Samples a push may carry now (see damacy_protocol.connection)."""
        with self._lock:
            return self._proto.credits

    @property
    def outstanding(self) -> int:
        """Samples pushed and not yet delivered, dropped or used up."""
        with self._lock:
            return self._proto.outstanding

    def stream(self, question):
        """Ask the session's stream (damacy_protocol.stream) a question, under the lock."""
        with self._lock:
            return question(self._proto.stream)

    # -- requests -------------------------------------------------------------------
    def request(self, make: Callable[[int], Any], on_progress: Callable[[Any], None] | None = None) -> Call:
        """Send ``make(id)``; the returned call gets the reply (or the error)."""
        call = Call(on_progress)
        with self._lock:  # (dead is set under it: a call is never added after the others were abandoned)
            if self.dead is not None or self._closed:
                call.error = self.dead if self.dead is not None else DamacyError("the connection to damacyd is closed")
                call.event.set()
                return call
            msg = make(self._proto.new_id())
            payload = self._proto.send(msg, token=call)
            # queued under the lock: requests reach the daemon in the order of their ids (an
            # answer settles the unanswered requests sent before it)
            self._outbox.put(payload)
        self._waker.wake()
        return call

    def call(self, make: Callable[[int], Any], timeout: float, what: str) -> Any:
        reply = self.request(make).wait(timeout, what)
        if isinstance(reply, m.Failed):
            raise error_from_wire(reply.error)
        return reply

    def defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the I/O thread, holding no lock (safe to call from ``__del__``); once
        the connection is closed, nothing runs (and nothing is kept)."""
        if self._closed:
            return
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
                events = dict(poller.poll(POLL_MS))
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
                    fn = None  # (what it holds, a pipeline say, is not kept until the next one)
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
                            pinged = Call()
                            pinged.session = self._session
                            payload = self._proto.send(m.Ping(id=self._proto.new_id()), token=pinged)
                        self._sock.send(payload, zmq.NOBLOCK)
                    except (zmq.ZMQError, ProtocolError):
                        pass
                if self.dead is None and now - self._last_recv > DEAD_AFTER_S:
                    self._die(f"damacyd at {self.endpoint} stopped answering ({now - self._last_recv:.1f} s of silence)")
        except Exception as e:  # the loop must never die silently
            log.exception("damacy: client I/O thread failed")
            self._die(f"the client's connection thread failed: {e}")
        finally:
            if self._teardown_on_exit:
                self._teardown()

    @staticmethod
    def _settle(calls: list) -> None:
        """Pushes and releases an answer to a later request showed were taken: done, no reply."""
        for call in calls:
            if call is not None:
                call.event.set()

    def _receive_all(self) -> None:
        while True:
            try:
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            settled: list = []
            try:
                with self._lock:
                    try:
                        msg, call = self._proto.receive(data)
                    finally:
                        settled = self._proto.settled  # pushes and releases taken (not refused)
                    if call is not None:
                        call.answers = self._proto.answered
                    if isinstance(msg, m.Welcome):
                        self._session = msg.session
            except UnexpectedReply as e:  # a late answer to a call given up on
                log.debug("damacy: %s", e)
                self._settle(settled)
                continue
            except ProtocolError as e:
                log.warning("damacy: %s", e)
                self._die(f"damacyd broke the protocol: {e}")
                continue
            self._settle(settled)
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

    def _session_lost(self, msg: Any, call: Call) -> bool:
        """Does this reply show that the daemon no longer holds our session (it restarted)?"""
        if isinstance(msg, m.Pong):  # pings sent once the session was known name it back
            return bool(call.session) and msg.session != call.session
        return bool(self._session) and isinstance(msg, m.Failed) and msg.error.kind is ErrorKind.UNKNOWN_SESSION

    def _die(self, why: str) -> None:
        with self._lock:
            if self.dead is None:
                self.dead = DaemonUnavailable(why)
            calls = [c for c in self._proto.abandon() if c is not None]
        for call in calls:
            call.error = self.dead
            call.event.set()

    def close(self, bye: bool = True, unmapped: bool = False) -> None:
        if self._closed:
            return
        if bye and self.dead is None and getattr(self, "welcome", None) is not None:
            try:
                self.request(lambda i: m.Bye(id=i, unmapped=unmapped)).wait(1.0, "bye")
            except (DamacyError, ProtocolError):
                pass
        with self._lock:
            self._closed = True
            calls = [c for c in self._proto.abandon() if c is not None]
        for call in calls:  # no answer can come now: whoever waits for one is told
            call.error = DamacyError("the connection to damacyd was closed")
            call.event.set()
        self._waker.wake()  # the loop leaves its poll now, not at its next timeout
        if threading.current_thread() is self._thread:  # (a pipeline collected on it): it tears down as it leaves
            self._teardown_on_exit = True
            return
        self._thread.join(2.0)
        self._teardown()

    def _teardown(self) -> None:
        self._sock.close(0)
        self._ctx.term()
        self._waker.close()
        while True:  # work deferred for the I/O thread can no longer run; what it holds goes now
            try:
                self._deferred.get_nowait()
            except queue.Empty:
                break


def daemon_stats(endpoint: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """The daemon's figures as plain data, asked by a control session (no pipeline): what
    ``damacy stats --json`` prints."""
    from damacy_protocol.stats import as_dict

    conn = Connection(endpoint, connect_timeout_s=timeout_s)
    try:
        conn.call(lambda i: m.Attached(id=i), timeout_s, "attach")
        return as_dict(conn.call(lambda i: m.Stats(id=i), timeout_s, "stats").stats)
    finally:
        conn.close()
