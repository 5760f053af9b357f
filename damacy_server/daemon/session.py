"""A daemon session: one client's Push/Pop/Release messages driving a batch engine.

No thread of its own and no inner pipeline: the daemon's loop thread hands the session
each message (:meth:`Session.handle`) and calls :meth:`Session.pump` whenever the session's
engine reports a change (a batch assembled, a slot freed, a skipped sample to replace).
Samples arrive numbered by the client (``seq``); they wait in the session's queue until a
slot is free, and the client may have at most ``lookahead_samples`` of them in the session
at once (its credits, counted by the connection: a push beyond them never reaches the
session). Pops wait in order for their batch; slots are lent to the client until it
releases them.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any

from damacy_protocol import messages as m
from damacy_protocol.config import Config
from damacy_protocol.connection import ServerConnection
from damacy_protocol.dtypes import dtype_name, numpy_name
from damacy_protocol.errors import BatchFailed, DamacyError, InvalidArgument, PipelineDrained, ProtocolError
from damacy_protocol.stats import SessionFigures
from damacy_protocol.wire import error_to_wire
from damacy_runtime.batch import Slot
from damacy_runtime.core import FrontCore
from damacy_server.cuda.ipc import IpcSlots
from damacy_server.daemon.endpoint import Peer
from damacy_server.daemon.host import SessionHost
from damacy_server.daemon.warm import start_warm
from damacy_server.engine.batches import BatchEngine, Delivery
from damacy_server.engine.policy import Policy
from damacy_server.engine.slots import ShmSlots, SlotMemory
from damacy_server.plan.planner import Planner
from damacy_server.procs import pid_alive

log = logging.getLogger("damacyd")


class Session:
    """One client: its engine and slots, the samples it pushed, the pops it waits on."""

    def __init__(self, host: SessionHost, identity: bytes, conn: ServerConnection, hello: m.Hello, peer: Peer | None = None) -> None:
        self.host = host
        self.identity = identity
        self.conn = conn
        self.peer = peer
        self.pid = hello.pid
        self.rank = hello.rank
        self.sid = uuid.uuid4().hex[:12]
        self.opened = self.last_seen = time.monotonic()
        # the process watched for liveness: as the kernel names it when it can (right across
        # pid namespaces), else as the client says over an ipc socket (this machine); over
        # TCP the pid may name another machine's process: the heartbeats alone watch it
        local = str(getattr(host, "endpoint", "")).startswith("ipc://")
        self.watch_pid = peer.pid if peer is not None else hello.pid if local else 0
        self.pid_visible = self.watch_pid > 0 and pid_alive(self.watch_pid)
        prefix = f"damacy-{os.getpid()}-{self.sid}"  # a slot's segment: {prefix}-{index}
        self.slots: SlotMemory = ShmSlots(prefix, host.sharing)
        self.unmapped = False  # a GPU session's client said it closed its mappings of the slots
        self.closed = False
        self.seqs: dict[int, int] = {}  # id(sample) -> the client's number for it
        self.stream = conn.stream  # pushes, finality, pops waiting in order, batches lent: the protocol's
        self.lent: dict[int, Slot] = {}  # batch id -> the slot the client holds (the stream says which)
        self.dropped: list[int] = []  # skipped samples not yet reported to the client
        self.discarded: list[int] = []  # samples of a short last batch under drop_last
        self.pushed = 0
        self.delivered_batches = 0
        self.delivered_samples = 0
        self.slot_waits = 0  # times a full batch of samples waited for a free slot
        self._slot_blocked = False
        self.config: Config | None = None
        self.engine: BatchEngine | None = None  # a control session (the CLI) has none
        self.core: FrontCore | None = None  # the queue of pushed samples and what starts them
        if hello.config is not None:
            try:
                self.config = cfg = Config.from_dict(hello.config)
            except (TypeError, ValueError) as e:
                raise InvalidArgument(f"the client's Config was refused: {e}") from None
            if cfg.storage_options:
                raise InvalidArgument(
                    "Config.storage_options applies to embedded pipelines; damacyd reads object stores with "
                    "its own options (damacyd --storage-option PREFIX KEY=VALUE)"
                )
            executor: Any = host.executor
            if cfg.on_gpu and cfg.device is None:
                raise InvalidArgument("a GPU Config for damacyd names its device (Config(device=k)): the daemon has no current CUDA context of the client's")
            if cfg.device is not None:  # decoded and assembled on that GPU, slots shared over CUDA IPC
                if not hello.device:
                    raise InvalidArgument(f"Config.device={cfg.device}: the client did not name the GPU by its UUID")
                executor = host.gpu_executor(hello.device)
                self.slots = IpcSlots(prefix, host.sharing, executor, self._unmapped)
            limit = host.options.max_slots_per_session
            if cfg.prepared_batches > limit:
                raise InvalidArgument(
                    f"Config.prepared_batches={cfg.prepared_batches}: this damacyd gives a session at most "
                    f"{limit} slots (--max-slots-per-session)"
                )
            most = host.options.max_lookahead_samples
            if cfg.samples_per_batch > most:
                raise InvalidArgument(
                    f"Config.samples_per_batch={cfg.samples_per_batch}: this damacyd holds at most {most} samples "
                    "ahead for a session (--max-lookahead-samples), fewer than one batch"
                )
            self.lookahead = min(cfg.lookahead_samples, most)  # the credits the client gets
            with host.descriptors(cfg.prepared_batches):  # the slots' descriptors, held while they are opened
                self.engine = BatchEngine(
                    cfg.output,
                    Policy(cfg.on_error, cfg.out_of_bounds),
                    # the daemon's caches outlive sessions: what a session reads was cached after
                    # it opened, or is found unchanged in storage first (an array re-created
                    # between two runs is read anew)
                    Planner(host.metadata, host.planner.limits, fresh_after=self.opened),
                    executor,
                    cfg.prepared_batches,
                    self.slots,
                    on_change=lambda: host.wake(self),
                    on_errors=host.totals.failed,
                    plan_pool=host.plan_pool,
                    what=f"{cfg.prepared_batches} batch slots of {cfg.samples_per_batch} x {cfg.sample_shape} {cfg.dtype}",
                )
            self.core = FrontCore(self.engine, cfg.samples_per_batch, self.lookahead, cfg.drop_last)
            host.totals.session_started()

    def _unmapped(self) -> bool:
        """Whether the client no longer maps a GPU session's slots: it said so, or its process
        is gone (a process this daemon cannot see is never taken for gone)."""
        return self.unmapped or (self.pid_visible and not pid_alive(self.watch_pid))

    def welcome(self, reply_to: int) -> m.Welcome:
        engine = self.engine
        if engine is None:
            return m.Welcome(reply_to=reply_to, version=m.PROTOCOL_VERSION, session=self.sid, slots=[], credits=0)
        return m.Welcome(
            reply_to=reply_to,
            version=m.PROTOCOL_VERSION,
            session=self.sid,
            slots=self._slot_infos(),
            credits=self.lookahead,
            max_message_bytes=self.host.options.max_message_bytes,
        )

    def _slot_infos(self) -> list[m.SlotInfo]:
        if isinstance(self.slots, IpcSlots):
            return self.slots.infos
        assert isinstance(self.slots, ShmSlots)
        return [m.SlotInfo(seg.name, seg.nbytes) for seg in self.slots.segments]

    # -- requests (on the loop thread) ----------------------------------------------------
    def handle(self, msg: Any) -> None:
        self.last_seen = time.monotonic()
        if isinstance(msg, m.Attached):
            for seg in getattr(self.slots, "segments", ()):
                seg.unlink()  # the client has mapped them; nothing is left in /dev/shm
            self.reply(m.Ack(reply_to=msg.id))
        elif isinstance(msg, (m.Push, m.Pop, m.Release)) and self.engine is None:
            self.fail(msg.id, InvalidArgument("this session was opened without a Config: it has no pipeline"))
        elif isinstance(msg, m.Push):
            self._push(msg)
        elif isinstance(msg, m.Pop):  # the stream queued it behind the pops before it
            self.host.wake(self)  # pumped once the loop has read what came with it
        elif isinstance(msg, m.Release):  # of a batch the stream knows lent (answered only if refused)
            self.lent.pop(msg.batch_id).release()  # the engine hears of it, and the loop pumps this session
        elif isinstance(msg, m.Stats):
            self.reply(m.StatsReply(reply_to=msg.id, stats=self.host.stats(session=self)))
        elif isinstance(msg, m.Warm):
            start_warm(self.host, self, msg)
        elif isinstance(msg, m.Ping):
            self.reply(m.Pong(reply_to=msg.id, session=self.sid))
        elif isinstance(msg, m.Bye):
            self.unmapped = msg.unmapped
            self.reply(m.Goodbye(reply_to=msg.id))
            self.host.end_session(self, "said bye")
        else:  # pragma: no cover - the connection lets nothing else through
            self.fail(getattr(msg, "id", 0), ProtocolError(f"unexpected {type(msg).__name__}"))

    def _push(self, msg: m.Push) -> None:
        samples = []
        longest = max(self.config.sample_shape, default=1)
        for w in msg.samples:
            sample = self.host.to_sample(w, longest)
            self.seqs[id(sample)] = w.seq
            samples.append(sample)
        self.core.add(samples, final=self.stream.final, cut=msg.cut)  # the stream counted the push already
        self.pushed += len(msg.samples)  # (answered only if refused)
        self.host.wake(self)  # pumped once the loop has read what came with it (a pop, a release)

    # -- the engine's side (on the loop thread) -------------------------------------------
    def pump(self) -> None:
        """Start what can start, refill what waits (the core), answer the pops whose batch is
        ready, or that the stream says are drained."""
        engine, core = self.engine, self.core
        if engine is None or core is None or self.closed:
            return
        core.pump()
        self.dropped.extend(self.seqs.get(id(s), -1) for s, _ in core.take_dropped())
        self.discarded.extend(self._seq(s) for s in core.take_discarded())
        self._note_slot_wait(engine)
        while self.stream.pops:  # each reply below answers the first (the stream takes it off)
            pop = self.stream.pops[0]
            if self.dropped:  # skipped samples free credits at once (their batch may wait for replacements)
                self.reply(m.Consumed(reply_to=pop.id, seqs=self.dropped))
                self.dropped = []
            delivery = engine.next_delivery()
            if delivery is not None:
                core.delivered(len(delivery.samples))
                self.reply(self._delivered(pop, delivery))
                self._note_slot_wait(engine)
            elif self.stream.input_final(pop) and core.drained():
                consumed, self.discarded = self.discarded, []
                n = engine.delivered_ids
                err = PipelineDrained(f"all {n} batches were delivered and the input is exhausted")
                skipped = [error_to_wire(e, seq=self._seq(s)) for s, e in engine.take_skipped()]  # seqs reported before
                self.reply(m.Failed(reply_to=pop.id, error=error_to_wire(err), consumed=consumed, errors=skipped))
            else:
                return

    def _note_slot_wait(self, engine: BatchEngine) -> None:
        """Count a slot wait when a full batch of samples starts waiting because the client
        holds every slot (not while slots are busy being assembled)."""
        blocked = self.core is not None and self.core.waiting_for_slot() and len(self.lent) >= engine.slot_count
        if blocked and not self._slot_blocked:
            self.slot_waits += 1
        self._slot_blocked = blocked

    def _delivered(self, pop: m.Pop, d: Delivery) -> Any:
        """The reply to ``pop`` for delivery ``d``: a batch, or why its batch failed."""
        if d.error is not None:
            err = d.error
            # each sample's seq is taken once (it leaves self.seqs): the samples the batch
            # consumed, then its errors' samples among them
            used = err.batch_samples if isinstance(err, (DamacyError, BatchFailed)) else ()
            seqs = {id(s): self._seq(s) for s in used}
            pairs = err.batch_errors if isinstance(err, DamacyError) else ()
            errors = [error_to_wire(e, seq=seqs[id(s)] if id(s) in seqs else self._seq(s)) for s, e in pairs]
            if not isinstance(err, DamacyError):  # a batch that failed as a whole (its sample errors are counted as they happen)
                self.host.totals.failed([err] * max(1, len(seqs)))
            seq = errors[0].seq if errors else None  # the first failure's sample: ``err`` is its error
            return m.Failed(reply_to=pop.id, error=error_to_wire(err, seq=seq), consumed=list(seqs.values()), errors=errors)
        self.lent[d.batch_id] = d.slot  # the engine's hold passes to the client until it releases
        self.delivered_batches += 1
        self.delivered_samples += len(d.samples)
        self.host.totals.delivered(1, len(d.samples))
        slow = self.host.options.slow_batch_s
        if slow and d.seconds > slow:
            log.warning(
                "session %s: batch %d took %.1f s from its start to ready (%d samples, %d failed; --slow-batch-s %g)",
                self.sid, d.batch_id, d.seconds, len(d.samples), len(d.errors), slow,
                extra={"event": "slow_batch", "session": self.sid, "client_pid": self.pid, "rank": self.rank,
                       "batch": d.batch_id, "seconds": round(d.seconds, 3)},
            )
        errors = [error_to_wire(err, seq=self.seqs.get(id(d.samples[i]))) for i, err in d.errors]
        skipped = [error_to_wire(err, seq=self._seq(s)) for s, err in d.skipped]  # seqs reported before
        return m.BatchReady(
            reply_to=pop.id,
            batch_id=d.batch_id,
            slot=d.slot.index,
            count=len(d.samples),
            dtype=numpy_name(d.dtype),
            seqs=[self._seq(s) for s in d.samples],
            errors=errors,
            skipped=skipped,
        )

    def _seq(self, sample: Any) -> int:
        return self.seqs.pop(id(sample), -1)

    def reply(self, msg: Any) -> None:
        self.host.post(self.identity, self.conn.reply(msg))

    def fail(self, reply_to: int, err: BaseException) -> None:
        self.reply(m.Failed(reply_to=reply_to, error=error_to_wire(err)))

    # -- liveness and end ---------------------------------------------------------------
    def dead(self, now: float, timeout: float) -> str | None:
        if self.pid_visible and not pid_alive(self.watch_pid):
            return f"client process {self.pid} is gone"
        if now - self.last_seen > timeout:
            return f"no message from the client for {now - self.last_seen:.1f} s"
        return None

    def close(self) -> None:
        """Cancel the work in flight and give the slots back (the memory returns to the
        budget once no task writes into it). Idempotent."""
        if self.closed:
            return
        self.closed = True
        lent, self.lent = self.lent, {}
        for slot in lent.values():
            slot.release()
        if self.engine is not None:
            self.engine.close()
        self.seqs.clear()

    def describe(self) -> SessionFigures:
        if self.config is None:
            return SessionFigures(session=self.sid, pid=self.pid, rank=self.rank, control=True)
        return SessionFigures(
            session=self.sid,
            pid=self.pid,
            rank=self.rank,
            batches=self.delivered_batches,
            samples=self.delivered_samples,
            sample_errors=self.engine.sample_errors,
            samples_pulled=self.pushed,
            held_batches=len(self.lent),
            slot_waits=self.slot_waits,
            queued_samples=self.core.queued if self.core is not None else 0,
            slot_bytes=self.engine.slot_bytes,
            samples_per_batch=self.config.samples_per_batch,
            sample_shape=list(self.config.sample_shape),
            dtype=dtype_name(self.config.dtype),
        )
