"""Units in flight shared between batches, the CPU executor's side (the registry is
:mod:`damacy_server.cpu.inflight`): a batch's reads register the units they will decode and
wait for those another batch is decoding (or copy them from the chunk cache, where they
landed since the plan looked); a unit that arrives is copied for its waiting batch (with the
others that arrived meanwhile, by one task, or at the end of the owner's task that settled
it); an abandoned one is read alone.

:class:`SharedUnits` is that part of :class:`~damacy_server.cpu.executor.CpuExecutor`: it
uses the executor's registry (``inflight``), chunk cache, memory budget, decode pool,
figures and copies (``_copy_cached``, ``_apply``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import accumulate, chain, compress, repeat
from operator import is_, not_

import numpy as np

from damacy_protocol.enums import Stage
from damacy_protocol.errors import DamacyError
from damacy_server.cpu import optable
from damacy_server.cpu.run import Run, samples_of
from damacy_server.decode.chunks import check_length, decode_unit
from damacy_server.plan.reads import ReadGroup, shrink, take
from damacy_server.plan.units import UnitJob
from damacy_server.store import is_remote

#: units decoding to fewer bytes are not shared between batches in flight: their decode costs
#: less than the bookkeeping (and the whole decode a shared unit needs); bench small-chunks
#: (32 KiB units) lost a fifth of its rate to sharing, default (256 KiB) gains
SHARE_MIN_BYTES = 128 << 10


class SharedUnits:
    """The executor's part that shares units in flight (see the module's docstring)."""

    def _share(self, run: Run, groups: list[ReadGroup]) -> tuple[list[ReadGroup], list[tuple[UnitJob, np.ndarray]]]:
        """The run's reads without the units another batch is decoding (the run waits for
        those) or decoded into the chunk cache since the plan looked (returned, with their
        arrays, to be copied from there); the units left are registered as this run's to
        decode and settle. The reads' units are taken by name from their blocks (a view is
        made only for a unit taken from the cache or waited for)."""
        late: list[tuple[UnitJob, np.ndarray]] = []
        cache = self.chunk_cache
        names = [g.names() for g in groups]
        flat = list(chain.from_iterable(names))  # every read's units, in order: one pass each
        starts = [0, *accumulate(map(len, names))]
        keep: list[bool] | None = None  # per unit: still this run's to read (None: all)
        where: tuple[list[int], list[int]] | None = None  # per unit its read and its place in it

        def locate() -> tuple[list[int], list[int]]:
            nonlocal where
            if where is None:
                where = (
                    list(chain.from_iterable(map(repeat, range(len(names)), map(len, names)))),
                    list(chain.from_iterable(map(range, map(len, names)))),
                )
            return where

        def unit(k: int) -> UnitJob:
            read, place = locate()
            g = groups[read[k]]
            return g.block.job(g.picks[place[k]])

        if cache is not None and flat:
            found = cache.peek_many(flat)
            keep = list(map(is_, found, repeat(None)))  # (arrays: compared by identity, never by value)
            if all(keep):
                keep = None
            else:
                late.extend((unit(k), found[k]) for k in compress(range(len(flat)), map(not_, keep)))
        # a read's units decode to one size (one array's): shared all, or none
        share: list[int] = []
        sharing: list[int] = []  # the reads whose units are shared
        for j, g in enumerate(groups):
            if g.block.decoded_nbytes >= SHARE_MIN_BYTES:
                span = range(starts[j], starts[j + 1])
                share.extend(span if keep is None else compress(span, keep[span.start : span.stop]))
                sharing.append(j)
        if not share:
            return self._shrunk(groups, keep, starts), late
        with run.lock:
            run.pending += len(share)  # the waiters', for those that become one
        claimed = self.inflight.claim_or_join_many(take(flat, share), lambda i: self._waiter(run, unit(share[i])))
        if keep is None and claimed.count(None) == 0:  # every unit of those reads claimed: set a read at a time
            c = 0
            for j in sharing:
                g = groups[j]
                n = len(g)
                if isinstance(g.picks, range):
                    g.block.shared[g.picks.start : g.picks.stop] = claimed[c : c + n]
                else:
                    for i, shared in zip(g.picks, claimed[c : c + n]):
                        g.block.shared[i] = shared
                c += n
            with run.lock:
                run.pending -= len(share)
            return groups, late
        read, place = locate()
        mine = 0
        for k, shared in zip(share, claimed):
            g = groups[read[k]]
            if shared is not None:
                g.block.shared[g.picks[place[k]]] = shared
                mine += 1
            else:
                if keep is None:
                    keep = [True] * len(flat)
                keep[k] = False
        with run.lock:
            run.pending -= mine
        return self._shrunk(groups, keep, starts), late

    @staticmethod
    def _shrunk(groups: list[ReadGroup], keep: list[bool] | None, starts: list[int]) -> list[ReadGroup]:
        """``groups`` holding only the units ``keep`` marks (None: all)."""
        if keep is None or all(keep):
            return groups
        out = []
        for j, g in enumerate(groups):
            kept = shrink(g, keep[starts[j] : starts[j + 1]])  # (the group itself when whole)
            if kept is not None:
                out.append(kept)
        return out

    def _waiter(self, run: Run, u: UnitJob):
        """What a run does with a unit another batch decoded (see :mod:`damacy_server.cpu.inflight`)."""

        def take(array: np.ndarray | None, error: DamacyError | None, missing: bool) -> None:
            if array is not None:
                # a cache entry waits to be copied with the others that arrive meanwhile, by one
                # task, the memory budget counting it meanwhile (the cache may evict it before
                # that task runs, leaving it held by this run alone); copied now, in the owner's
                # task, is an array the cache did not take (its memory goes with that task) or
                # one the budget has no room for
                if not self._cached(u, array) or not self.budget.try_reserve(array.nbytes):
                    held = getattr(self._deferred, "copies", None)
                    if held is not None:  # the owner is settling several: copied with the others
                        held.setdefault(id(run), (run, []))[1].append((u, array))
                    else:
                        self._copy_items(run, [(u, array)], reserved=0)
                    return
                with run.lock:
                    run.arrived.append((u, array))
                    if run.copying:
                        return
                    run.copying = True
                self._decode.submit(self._copy_arrived, run, key=run.key, priority=run.order)
                return
            if error is None and not missing:  # abandoned: read it alone
                self._decode.submit(self._read_alone, run, u, key=run.key, priority=run.order)
                return
            try:
                if error is not None:
                    run.fail(samples_of((u,)), error)
                elif missing and not (run.cancelled() or self._closed):
                    optable.fill_rows(u.rows, u.table.ndim, u.table.pool, run.views, u.meta.fill_value, run.plan.norms)
            except Exception as e:
                run.crash([u], e)
            finally:
                run.group_done()

        return take

    @contextmanager
    def _copies_deferred(self) -> Iterator[None]:
        """Within it, a unit this thread settles that a waiting run copies at once (see
        ``_waiter``) is copied at its end, with the others settled meanwhile for that run: one
        task's units go to a waiting run in one native call per plan table, not one each. The
        owner's task holds the arrays (and their memory) until then."""
        local = self._deferred
        if getattr(local, "copies", None) is not None:  # (nested: the outer one copies)
            yield
            return
        local.copies = held = {}
        try:
            yield
        finally:
            local.copies = None
            for run, items in held.values():
                self._copy_items(run, items, reserved=0)

    def _cached(self, u: UnitJob, array: np.ndarray) -> bool:
        """Is ``array`` the chunk cache's entry for ``u`` (memory the cache accounts for)? A
        unit's array that is not stays within the memory budget only while its owner's task
        holds it, so it is copied then, not queued."""
        return self.chunk_cache is not None and self.chunk_cache.peek(u.name) is array

    def _copy_arrived(self, run: Run) -> None:
        """Copy the units other batches decoded for ``run`` into the chunk cache since the last
        such task: one task (and one native call per plan table) for as many as arrived while
        it was queued, not one per unit (a thin sample waits for tens of units, a windowed
        epoch for thousands)."""
        with run.lock:
            items, run.arrived = run.arrived, []
            run.copying = False
        self._copy_items(run, items, reserved=sum(a.nbytes for _, a in items))

    def _copy_items(self, run: Run, items: list[tuple[UnitJob, np.ndarray]], reserved: int) -> None:
        """Copy units waited for that arrived in the chunk cache and report each done, the
        budget's ``reserved`` bytes (what counted them while they waited) returned first."""
        self.stats.add(Stage.SHARED, 0.0, count=len(items), bytes_out=sum(a.nbytes for _, a in items))
        self._copy_cached(run, [], items, reports=len(items), release=reserved)

    def _abandon(self, units: Sequence[UnitJob]) -> None:
        """Units this run registered and did not settle: their waiters read them alone."""
        self.inflight.settle_many([u.shared for u in units])

    def _abandon_reads(self, groups: Sequence[ReadGroup]) -> None:
        """:meth:`_abandon` of the units of ``groups`` (taken from their blocks)."""
        shareds = list(chain.from_iterable(g.shareds() for g in groups))
        if shareds.count(None) != len(shareds):
            self.inflight.settle_many(shareds)

    def _read_alone(self, run: Run, u: UnitJob) -> None:
        """Read, decode and copy one unit another batch abandoned (numpy path). A unit more
        than the budget can ever hold fails as it failed its owner; otherwise it is rare (the
        owner's batch was cancelled first) and a decode thread must not wait for memory, so
        without room now it reads outside the memory budget: one unit."""
        need = ReadGroup.of_unit(u.block, u.i).reserve_nbytes  # as its owner counted it
        held = 0
        try:
            if run.cancelled() or self._closed:
                return
            if need > self.budget.capacity:
                run.fail(samples_of((u,)), self._too_big(u.key, need).with_context(uri=u.meta.uri))
                return
            held = need if self.budget.try_reserve(need) else 0
            store = u.meta.store if is_remote(u.key) else self.reader
            if u.nbytes < 0:
                data = store.read(u.key)
            else:
                data = store.read_range(u.key, u.offset, u.nbytes)
            with np.errstate(invalid="ignore", over="ignore"):
                if data is None:
                    optable.fill_rows(u.rows, u.table.ndim, u.table.pool, run.views, u.meta.fill_value, run.plan.norms)
                    return
                check_length(u.meta, data, u.nbytes, u.unit, u.key)
                self._apply(run, u, decode_unit(u.meta, memoryview(data), u.unit, u.key))
        except DamacyError as e:
            run.fail(samples_of((u,)), e.with_context(uri=u.meta.uri))
        except Exception as e:
            run.crash([u], e)
        finally:
            self.budget.release(held)
            run.group_done()

