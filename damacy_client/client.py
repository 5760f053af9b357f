"""The light client of damacyd: the same Pipeline API, with the work done by the daemon.

Three threads at most: the caller's, the transport's I/O thread (:mod:`damacy_client.transport`)
and a feeder that pulls the pushed iterables lazily, pushing only as many samples as the
session holds credits for (``lookahead_samples`` ahead of what the daemon has delivered;
the connection's state machine counts them).
Batches are views of the daemon's shared-memory slots, mapped once per session.

(Over 400 lines: one job, the daemon client's pipeline; its feeder, pops, releases and
figures act on the one session and its connection.)
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
from collections import deque
from collections.abc import Iterable
from typing import Any

import numpy as np

from damacy_client.ipc import Link, open_link
from damacy_client.shm import map_segment
from damacy_client.transport import Call, Connection
from damacy_protocol import messages as m
from damacy_protocol.config import Config
from damacy_protocol.dtypes import canonical_dtype, numpy_dtype, numpy_name
from damacy_protocol.enums import BoundsPolicy
from damacy_protocol.errors import (
    DamacyError,
    ErrorKind,
    PipelineDrained,
    ProtocolError,
    ShutdownError,
    stage,
)
from damacy_protocol.samples import check_pushed
from damacy_protocol.stats import Stats, as_dict, session_stats, since
from damacy_protocol.wire import error_from_wire, fit_pushes, sample_to_wire
from damacy_runtime import front, pinning
from damacy_runtime.api import CLOSED, PipelineAPI, check_pop_timeout
from damacy_runtime.batch import Batch, Slot
from damacy_runtime.devices import check_gds, device_uuid
from damacy_runtime.warn import warn_once

log = logging.getLogger("damacy")

PUSH_CHUNK = 256  # samples per push message at most



def _say_daemon_owned(config: Config) -> None:
    """Warn (once per set of fields in a process) that a Config's component limits are not
    this session's: damacyd's components serve it with the daemon's own."""
    owned = tuple(config.daemon_owned())
    if owned:
        warn_once(
            ("daemon-owned", owned),
            f"damacy.Pipeline served by damacyd: Config's {', '.join(owned)} are damacyd's to set (its flags, "
            "for every session), and this session runs with the daemon's; pass embedded=True to use them here",
        )


class RemotePipeline(PipelineAPI):
    """``damacy.Pipeline(config, endpoint=...)``: a pipeline run by damacyd.

    Same behaviour as the embedded pipeline: ``push``/``pop``/``batches``, batches in push
    order, error policies, DLPack batches (views of the daemon's shared memory). If the
    daemon dies, every call raises :class:`DaemonUnavailable` within a few seconds.
    """

    def __init__(self, config: Config, endpoint: str | None = None, *, rank: int | None = None, connect_timeout_s: float = 10.0) -> None:
        self._closed = True  # until connected
        if not isinstance(config, Config):
            raise TypeError(f"Pipeline takes a damacy.Config, got {type(config).__name__}")
        self.config = config
        self.output = config.output
        self.queues = config.queues
        self.pop_timeout_s = check_pop_timeout(config.pop_timeout_s)
        self.on_error = config.on_error
        try:
            config.check_cache_floors()
            self._index_queries = _index_queries(config)
            if config.on_gpu:
                check_gds(config.enable_gds)
        except DamacyError as e:
            raise stage(e, "create") from None
        _say_daemon_owned(config)
        self._reference: Stats | None = None  # the figures at the last stats_reset (subtracted)
        if rank is None and os.environ.get("RANK", "").isdigit():
            rank = int(os.environ["RANK"])
        # a GPU is named by its UUID: the daemon may number the node's GPUs differently
        uuid = device_uuid(config.device) if config.device is not None else None
        self._conn = Connection(endpoint, rank=rank, config=config, connect_timeout_s=connect_timeout_s, device=uuid)
        self.endpoint = self._conn.endpoint
        welcome = self._conn.welcome
        self._max_message = welcome.max_message_bytes  # pushes are cut to fit it
        self._link: Link | None = None  # the GPU of a device session's slots
        try:
            if config.device is not None:
                self._link, self._slots = open_link(config.device, welcome.slots)
            else:
                self._slots = [map_segment(s.name, s.nbytes) for s in welcome.slots]
                for mapped in self._slots:  # where a GPU is present: copies of batches to it run async
                    pinning.pin(mapped)
            self._conn.call(lambda i: m.Attached(id=i), connect_timeout_s, "attach")
        except BaseException:
            self._conn.close()
            if self._link is not None:
                self._link.close()
            raise
        self._cond = threading.Condition()
        self._sources = front.Sources(self._cond)
        self._progress = front.Progress()
        self._samples: dict[int, Any] = {}  # seq -> sample, for samples not yet delivered
        self._skipped: dict[int, Any] = {}  # seq -> sample dropped by the daemon, until reported
        self._unlisted: list[tuple[Any, BaseException]] = []  # skipped ones a drain answered and a pop did not raise
        self._seq = itertools.count()
        self._pushed = False
        self._final_sent = True
        # exceptions of the pushed iterables, each raised once the samples pulled before it
        # (numbered up to ``after``) are delivered: (after, error)
        self._source_errors: deque[tuple[int, BaseException]] = deque()
        self._last_seq = -1
        self._next_batch = 0  # the id the next batch should have (for messages)
        self._next_call: Call | None = None  # the pop already sent for the next batch
        self._lent: dict[int, Slot] = {}  # batch id -> its slot, until the release is sent
        self._push_calls: deque = deque()  # pushes not yet settled (a refusal answers one; an answer to a later request settles it)
        self._closed = False
        self._pid = os.getpid()
        self._feeder: threading.Thread | None = None
        self._batch_shape = (config.samples_per_batch, *config.sample_shape)
        self._pop_seconds = 0.0  # time callers waited in pop, and how many pops
        self._pops = 0
        self._pop_best = math.inf  # the shortest wait

    # -- input --------------------------------------------------------------------
    def _push(self, samples: Iterable[Any]) -> None:
        self._check()
        with self._cond:
            self._sources.add(samples, self._take_restore())
            self._pushed = True
            self._final_sent = False
        with self._cond:
            room = self._conn.credits
        try:
            self._send(min(room, PUSH_CHUNK), deferred=False)  # a first window, checked here
        finally:  # what was pushed before a refused iterable goes on
            self._start_feeder("damacy-client-feeder")

    def _check_item(self, item: Any) -> Any:
        off = None if self._index_queries else "Config.max_index_bytes=0"
        return check_pushed(item, self.output.shape, self.config.out_of_bounds == BoundsPolicy.PAD, off)

    def _feed(self) -> bool:
        """One round of the feeder thread (:func:`front.feed_weakly`): pull what the credits
        allow and push it. False: stop (closed, or the daemon is gone)."""
        with self._cond:
            if not self._closed and not (self._may_pull() or (not self._sources and not self._final_sent)):
                self._cond.wait(0.5)
                return not self._closed  # (the next round looks again)
            if self._closed:
                return False
            room = self._conn.credits
        return self._send(min(room, PUSH_CHUNK), deferred=True)

    def _send(self, most: int, deferred: bool) -> bool:
        """Pull up to ``most`` samples, and no more than the credits allow (checked), and push
        them; a refused sample drops its iterable and is raised (``deferred``: kept for the
        next push or pop). One caller at a time (a push and the feeder take turns): the
        credits read are the ones the push spends. False: stop."""
        with self._sources.turn():  # (held across the pull and the push of what it pulled)
            return self._send_now(most, deferred)

    def _send_now(self, most: int, deferred: bool) -> bool:
        with self._cond:
            room = min(most, self._conn.credits)
        refused: DamacyError | None = None
        try:
            pulled, error = self._sources.pull(room, lambda: self._closed, self._numbered, check=self._check_item)
        except front.Refused as r:  # sent as pulled: the samples before the refused iterable, the end of the input
            refused, pulled, error = r.error, r.kept, None
            if deferred:
                with self._cond:
                    self._defer(refused)
                    self._cond.notify_all()
        going = self._push_pulled(pulled, error)
        if refused is not None and not deferred:
            raise refused
        return going

    def _push_pulled(self, pulled: list[tuple[m.WireSample, Any]], error: BaseException | None) -> bool:
        """Push what a pull took (and the end of the input, when nothing is left to pull).
        False: stop (closed, or the daemon is gone)."""
        batch = [wire for wire, _ in pulled]
        with self._cond:
            for wire, sample in pulled:
                self._samples[wire.seq] = sample
            if error is not None:  # raised by the pop after the samples pulled before it
                self._source_errors.append((batch[-1].seq if batch else self._last_seq, error))
        if self._closed:
            return False
        with self._cond:  # counted, flagged and queued together, so a pop never misses it
            final = not self._sources
            if batch or final or error is not None:
                parts = fit_pushes(batch, self._max_message)
                for k, part in enumerate(parts):
                    last = final and k == len(parts) - 1
                    cut = error is not None and k == len(parts) - 1  # batches end where the input raised, as embedded
                    try:
                        call = self._conn.request(lambda i, b=part, f=last, c=cut: m.Push(id=i, samples=b, final=f, cut=c))
                    except (DamacyError, ProtocolError) as e:  # closed or the daemon is gone
                        self._source_errors.append((self._last_seq, e))
                        return False
                    self._push_calls.append(call)
                    if part:
                        self._last_seq = part[-1].seq
                if final:
                    self._final_sent = True
            self._cond.notify_all()
        return True

    def _numbered(self, sample: Any) -> tuple[m.WireSample, Any]:
        return sample_to_wire(next(self._seq), sample), sample

    # -- output -------------------------------------------------------------------
    def _check(self) -> None:
        if self._closed:
            raise ShutdownError(CLOSED, what="closed")
        if self._conn.dead is not None:
            raise self._conn.dead
        with self._cond:
            while self._push_calls and self._push_calls[0].event.is_set():
                call = self._push_calls.popleft()
                if call.error is not None:
                    raise call.error
                if isinstance(call.reply, m.Failed):
                    raise error_from_wire(call.reply.error)

    def _request_pop(self) -> Call:
        """Ask the daemon for the next batch. The daemon answers when it is assembled (or the
        stream drained); timeouts are the caller's, so a late answer is kept for the next pop."""
        with self._cond:
            # "final": everything this client will push (for now) is already on its way, so
            # the daemon may call the stream drained; otherwise it waits for more pushes (the
            # connection adds how many pushes were sent before this pop). Sent under the lock
            # the feeder sends its pushes under: a final push cannot go out between the flag
            # and the pop (the pop would count it and still say not final, and wait for ever)
            final = self._input_final()
            return self._conn.request(lambda i: m.Pop(id=i, final=final), on_progress=front.weak_method(self._consumed))

    def _input_final(self) -> bool:
        """Everything this client will push (for now) was sent (call with the lock held)."""
        return self._final_sent and not self._sources

    def _pop(self, timeout: float | None, end_at_tail: bool = False) -> Batch | None:
        """The next batch in push order (see :meth:`PipelineAPI.pop`). The next batch is
        requested as soon as this one is handed out, so a pop whose batch is ready costs no
        round trip to the daemon."""
        self._check()
        if not self._pushed:
            raise PipelineDrained("nothing was pushed: pop() has no batch to wait for")
        deadline = front.deadline(timeout)
        started = front.now()
        try:
            return self._pop_batch(deadline, timeout, end_at_tail)
        finally:
            waited = front.now() - started
            self._pop_seconds += waited
            self._pops += 1
            self._pop_best = min(self._pop_best, waited)

    def _pop_batch(self, deadline: float | None, timeout: float | None, end_at_tail: bool) -> Batch | None:
        with self._cond:
            error = self._due_source_error()
        if error is not None:
            raise error
        while True:
            call, self._next_call = self._next_call, None
            if call is None:
                call = self._request_pop()
            if not call.event.is_set() and self._held() >= self.config.prepared_batches and not self._all_delivered():
                # every slot is held here: no batch can come until one is released, so say so
                # now (a stream with nothing left to deliver is answered, drained, at once),
                # unless the feeder may yet find the input's end or its error (no slot needed)
                self._next_call = call
                if self._closed:
                    raise ShutdownError(CLOSED, what="closed")
                if not self._may_pull():
                    raise front.slots_held(self.config.prepared_batches)
                left = front.time_left(deadline)
                if left is not None and left <= 0:
                    raise self._waiting_for(timeout)
                call.event.wait(0.05 if left is None else min(left, 0.05))
                continue
            try:
                answered = self._wait(call, deadline, end_at_tail)
            except BaseException:  # interrupted (Ctrl-C): the batch it asked for is the next pop's
                self._next_call = call
                raise
            if answered is None:  # iterating, and only a short last batch waits for a push
                self._next_call = call
                return None
            if not answered:
                self._next_call = call  # its answer will serve the next pop
                raise self._waiting_for(timeout)
            if self._closed:  # closed (by another thread) while it waited
                raise ShutdownError(CLOSED, what="closed")
            if call.error is not None:
                raise call.error
            reply = call.reply
            if isinstance(reply, m.Failed) and reply.error.kind is ErrorKind.PIPELINE_DRAINED and self._stale_drain(call):
                with self._cond:  # skipped samples it reports go with the next batch (or drain)
                    self._unlisted.extend(self._skipped_of(reply.errors))
                continue
            break
        if isinstance(reply, m.Failed):
            err = error_from_wire(reply.error)
            with self._cond:
                by_seq = {seq: self._samples.pop(seq, None) for seq in reply.consumed}
                self._cond.notify_all()
            consumed = list(by_seq.values())
            if isinstance(err, PipelineDrained):
                if self._deferred is not None:  # an input error found ahead goes first
                    self._raise_deferred("pop")
                with self._cond:
                    error = self._due_source_error(drained=True)
                    err.skipped = (*self._unlisted, *self._skipped_of(reply.errors))
                    self._unlisted = []
                if error is not None:
                    raise error
            else:
                self._next_call = self._request_pop()
            if consumed and hasattr(err, "batch_samples"):  # as embedded: the batch's samples and failures
                err.batch_samples = tuple(s for s in consumed if s is not None)
                if isinstance(err, DamacyError):
                    err.batch_errors = tuple(
                        (by_seq.get(w.seq) if w.seq is not None else None, err if w.seq == reply.error.seq else error_from_wire(w))
                        for w in reply.errors
                    )
            if not isinstance(err, PipelineDrained):
                self._handed(None, len(consumed))
                raise self._batch_failed(err)
            raise err
        batch = self._batch(reply)
        self._handed(batch)
        self._next_call = self._request_pop()
        return batch

    def _wait(self, call: Call, deadline: float | None, end_at_tail: bool) -> bool | None:
        """Wait for ``call``'s answer until ``deadline``: True when it came, False when the
        time ran out, None when (``end_at_tail``) nothing can come but a short last batch
        waiting for a later push. An input error found ahead meanwhile is raised."""
        while True:
            left = front.time_left(deadline)
            if call.event.wait(0.1 if left is None else min(left, 0.1)):
                return True
            if self._deferred is not None:
                self._next_call = call
                self._raise_deferred("pop")
            if end_at_tail and self._only_tail():
                return None
            if left is not None and left <= 0.1:
                return call.event.is_set()

    def _stale_drain(self, call: Call) -> bool:
        """A "drained" answer that predates input this client has pushed, or will push, since
        its pop was sent: the pop is asked again."""
        pop = call.answers
        with self._cond:
            later_input = not self._input_final()
        return later_input or (pop is not None and self._conn.stream(lambda s: s.pushed_since(pop)))

    def _may_pull(self) -> bool:
        """Can the feeder still pull from the pushed iterables (credits left)?"""
        with self._cond:
            return bool(self._sources) and self._conn.credits > 0

    def _all_delivered(self) -> bool:
        """Every sample pushed so far was delivered (or dropped) and no pushed iterable is left."""
        with self._cond:
            return not self._sources and not self._samples

    def _waiting_for(self, timeout: float) -> DamacyError:
        slots = self.config.prepared_batches
        held = self._held()
        with self._cond:
            if self._sources and self._conn.outstanding == 0:
                why = front.WAITING_FOR_INPUT
            elif held >= slots:
                why = front.SLOTS_HELD
            else:
                why = front.WORKING
        return front.pop_timeout(self._next_batch, timeout, why, slots, where=" in damacyd")

    def _consumed(self, msg: m.Consumed) -> None:
        """The daemon dropped samples (skipped): they free room for new ones."""
        with self._cond:
            for seq in msg.seqs:
                self._skipped[seq] = self._samples.pop(seq, None)
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
            skipped = (*self._unlisted, *self._skipped_of(r.skipped))
            self._unlisted = []
            self._cond.notify_all()
        errors = tuple((r.seqs.index(w.seq) if w.seq in r.seqs else -1, error_from_wire(w)) for w in r.errors)
        device = f"cuda:{self.config.device}" if self._link is not None else "cpu"
        info = front.batch_info(self.output, r.count, numpy_name(dtype), r.batch_id, samples, errors, skipped, device=device)
        slot = Slot(full, lambda _slot, bid=r.batch_id: self._release(bid), index=r.slot)
        batch = Batch(slot, info, dtype, full)
        with self._cond:
            self._lent[r.batch_id] = slot
        return batch

    def _skipped_of(self, errors: list[m.WireError]) -> list[tuple[Any, BaseException]]:
        """The (sample, error) of skipped samples the daemon reports (the lock held)."""
        return [(self._skipped.pop(w.seq, None), error_from_wire(w)) for w in errors]

    def _held(self) -> int:
        """Batches handed out that are still held (by the Batch or arrays exported from it)."""
        with self._cond:
            slots = list(self._lent.values())
        return sum(1 for s in slots if s.users > 0)

    def _release(self, batch_id: int) -> None:
        """A batch's slot is free (its Batch and every array from it are gone). This can run
        inside a garbage collection in any thread, even one holding our locks, so it only
        queues the work for the I/O thread."""
        self._conn.defer(lambda: self._send_release(batch_id))

    def _send_release(self, batch_id: int) -> None:
        with self._cond:
            slot = self._lent.pop(batch_id, None)
        if self._closed or self._conn.dead is not None:
            return
        if self._link is not None and slot is not None:  # fenced on the GPU before the daemon hears of it
            self._link.let_go(slot.index, self._slots[slot.index])
        try:
            self._conn.request(lambda i: m.Release(id=i, batch_id=batch_id))
        except (DamacyError, ProtocolError):
            pass

    def stats_dict(self) -> dict[str, Any]:
        """The daemon's figures (stages, caches, memory, sessions) with this session's
        counters (batches, samples, sample_errors, samples_pulled) at the top level."""
        self._check_process()
        self._check()
        data = as_dict(self._conn.call(lambda i: m.Stats(id=i), 10.0, "stats").stats)
        mine = data.get("session", {})
        for key in ("batches", "samples", "sample_errors", "samples_pulled"):
            if key in mine:
                data[key] = mine[key]
        return data

    def _figures(self) -> Stats:
        if self._closed:  # (a failed push stays for the next pop to raise)
            raise ShutdownError(CLOSED, what="closed")
        if self._conn.dead is not None:
            raise self._conn.dead
        reply = self._conn.call(lambda i: m.Stats(id=i), 10.0, "stats")
        figures = session_stats(reply.stats, self._pop_seconds, self._pops, self._pop_best)
        return figures if self._reference is None else since(figures, self._reference)

    def _reset_figures(self) -> None:
        self._pop_seconds, self._pops, self._pop_best = 0.0, 0, math.inf
        self._reference = None
        self._reference = self._figures()

    def _only_tail(self) -> bool:
        with self._cond:
            short = 0 < len(self._samples) < self.config.samples_per_batch
            return self.config.drop_last and self._input_final() and short

    def _device_index(self) -> int:
        return int(self.config.device) if self._link is not None else -1

    # -- lifetime -----------------------------------------------------------------
    def _close(self) -> None:
        if not hasattr(self, "_conn"):  # never connected
            return
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        link, unmapped = self._link, False
        if link is not None and not self._held():  # no tensor reads the slots: unmap before the daemon frees them
            link.close()
            unmapped = True
        self._conn.close(unmapped=unmapped)
        # slots still read by tensors stay mapped (the daemon frees them once this process is gone)
        if self._feeder is not None and self._feeder is not threading.current_thread():
            self._feeder.join(2.0)


def _index_queries(config: Config) -> bool:
    """Does a session of ``config`` take index queries? A GPU Config's ``max_index_bytes``
    is 0 (none: refused at push) or holds a batch's indices (else BudgetExceeded now)."""
    if not config.on_gpu:
        return True
    return config.cuda_limits.takes_index_queries(config.samples_per_batch, config.sample_shape, "Config.max_index_bytes")
