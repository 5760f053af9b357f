"""Decode tasks through the native path: a task's units decoded and copied in one C call.

:class:`NativeTasks` serves one executor: it picks the kernel for a task (per array and
output dtype), builds the op table, decodes from bytes in memory, from the page cache
(``file_job``: a batch's page-cached reads of one array, which the decode threads take in
turn in native code) or from chunk cache entries (``copy_cached`` for a plan's, ``copy_decoded``
for units the cache took while a batch was planned), fills the chunk cache with
the units it would admit and hands units other batches wait for to them (both decoded
whole, straight into their buffer), and turns the units that failed into errors of their
samples.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from itertools import accumulate, chain, compress, repeat
from operator import is_not
from typing import Any, NamedTuple

import numpy as np

from damacy_protocol.errors import DamacyError, DecodeError
from damacy_server import native
from damacy_server.cache import AnyCache
from damacy_server.cpu import optable
from damacy_server.cpu.inflight import InFlight
from damacy_server.cpu.run import Run, samples_of
from damacy_server.plan.reads import ReadGroup, take
from damacy_server.plan.units import CachedUnits, UnitBlock, UnitJob


class FileJob(NamedTuple):
    """A run's page-cached reads of one array as one native job (:meth:`NativeTasks.file_job`):
    the native handle, the kernel, the reads (``bundles``: groups read together), their units
    (``idx``: indices in ``block``, in read order) with the job's op table, the buffers of
    the units kept whole (None: none) and their addresses (``keep``, 0 for the others), and
    per read its units' bounds, offset, length and sparse flag."""

    handle: Any
    kernel: native.NativeKernel
    bundles: list[list[ReadGroup]]
    block: UnitBlock
    idx: list[int]
    table: native.OpTable
    kept: list[np.ndarray | None] | None
    keep: np.ndarray | None
    bounds: list[int]
    offsets: list[int]
    lengths: list[int]
    sparse: list[bool]


class NativeTasks:
    def __init__(
        self, chunk_cache: AnyCache | None, inflight: InFlight | None = None,
        settling: Callable[[], AbstractContextManager] = nullcontext,
    ) -> None:
        """``settling()``: the context units decoded together are settled in, for the runs
        waiting for them (the executor's: their copies made together at its end)."""
        self.chunk_cache = chunk_cache
        self.inflight = inflight
        self._settling = settling
        self._kernels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def kernel(self, run: Run, units: list[UnitJob]) -> native.NativeKernel | None:
        """The native kernel for this task, when it applies (one array, plain views)."""
        meta = units[0].meta
        if units[-1].meta is not meta:  # a task's units are one object's, so one array's
            return None
        return self.kernel_of(run, meta)

    def kernel_of(self, run: Run, meta) -> native.NativeKernel | None:
        """The native kernel for ``meta``'s units in this run, when it applies (plain views)."""
        if run.dtype is None:
            return None
        kernel = run.kernels.get(id(meta), False)  # the run holds its metas: ids are stable
        if kernel is False:
            kernel = run.kernels[id(meta)] = self._kernel(meta, run.dtype, run.all_normalized)
        return kernel

    def _kernel(self, meta, dtype: np.dtype, normalized: bool) -> native.NativeKernel | None:
        per_meta = self._kernels.get(meta)  # keyed by the metadata object: a reloaded array gets its own
        if per_meta is None:
            per_meta = self._kernels.setdefault(meta, {})
        key = (dtype.str, dtype.name, normalized)
        kernel = per_meta.get(key, False)
        if kernel is False:
            kernel = per_meta[key] = native.kernel_for(meta, dtype, normalized)
        return kernel

    # -- the three sources --------------------------------------------------------------
    def decode(self, kernel, run: Run, group: ReadGroup, units: list[UnitJob], view: memoryview) -> tuple[int, int, int]:
        """Decode and copy ``units`` from ``view`` (the bytes of ``group``); returns
        (encoded, decoded, assembled) bytes of the units that did not fail."""
        table, targets = self._tables(run, units)
        offset = max(group.offset, 0)
        names, shareds = [u.name for u in units], [u.shared for u in units]
        kept, keep = self._keep(kernel, names, shareds)
        failures, encoded, elements = native.run(kernel, view, offset, table, targets, keep)
        if kept is not None:
            bad = {f.unit for f in failures}
            ok = [k for k in range(len(units)) if k not in bad] if bad else range(len(units))
            self._cache_kept(take(names, ok), take(shareds, ok), take(kept, ok), keep[ok], kernel.decoded_nbytes)
        return self._done(kernel, run, units, table, failures, encoded, elements, offset, len(view))

    def file_job(self, kernel, run: Run, bundles: list[list[ReadGroup]], flags: int, roots: bytes | None, paths: tuple[bytes, ...]) -> FileJob:
        """The page-cached reads ``bundles`` (each reads of one file, see
        :func:`~damacy_server.cpu.executor._joins`; their units one block's, of ``kernel``) as
        one native job the decode threads take in turn (see :func:`native.file_job`): one op
        table, one pass choosing the units to keep, for all of them, from the block's arrays
        (no Python per unit)."""
        block = bundles[0][0].block
        groups = [g for b in bundles for g in b]
        idx = list(chain.from_iterable(g.picks for g in groups))
        table = optable.build_block(block, np.asarray(idx, dtype=np.int64))
        targets = self._targets(run, table.ndim)
        kept, keep = self._keep(kernel, take(block.names, idx), take(block.shared, idx))
        counts = [sum(map(len, b)) for b in bundles]
        bounds = [0, *accumulate(counts)]
        offsets = [b[0].offset for b in bundles]
        lengths = [b[0].length if len(b) == 1 else b[-1].offset + b[-1].length - b[0].offset for b in bundles]
        sparse = [len(b) > 1 for b in bundles]
        handle = native.file_job(
            kernel, (flags, roots), paths, np.array(offsets, dtype=np.int64), np.array(lengths, dtype=np.int64),
            np.array(sparse, dtype=np.uint8), np.array(bounds, dtype=np.int64), table, targets, keep,
        )
        return FileJob(handle, kernel, bundles, block, idx, table, kept, keep, bounds, offsets, lengths, sparse)

    def file_job_done(self, run: Run, job: FileJob, results: native.FileJobResults, refused: dict[int, DamacyError]) -> list[int]:
        """Settle the units of a finished job's reads that were made (``results.codes`` 0):
        the failed ones fail their samples (and the batches waiting for them), the kept ones
        go to the chunk cache and to those batches; the units of a read in ``refused`` (read
        index -> error: a chunk over the stored cap) are neither kept nor handed over, their
        waiters get the error. Returns per read the bytes its units decoded to (0 for a read
        not made)."""
        block, idx, bounds, kernel = job.block, job.idx, job.bounds, job.kernel
        failed = {f.unit: f for f in results.failures}
        decoded = [0] * len(job.bundles)
        made: list[int] = []  # the reads made and not refused
        for r, code in enumerate(results.codes):
            if code != 0:
                continue
            lo, hi = bounds[r], bounds[r + 1]
            bad = [k for k in failed if lo <= k < hi] if failed else ()
            decoded[r] = (hi - lo - len(bad)) * kernel.decoded_nbytes
            for k in bad:
                data_len = job.lengths[r] if job.sparse[r] else results.nread[r]
                self._fail_unit(kernel, run, block.job(idx[k]), failed[k], job.table.spans[k], max(job.offsets[r], 0), data_len)
            if r in refused:
                self.inflight.settle_many(take(block.shared, idx[lo:hi]), error=refused[r])
            else:
                made.append(r)
        if job.kept is None or not made:
            return decoded
        if len(made) == len(job.bundles) and not failed:  # (the usual case: every unit, by C loops)
            ks: range | list[int] = range(len(idx))
        else:
            ks = [k for r in made for k in range(bounds[r], bounds[r + 1]) if k not in failed]
        at = take(idx, ks)
        self._cache_kept(take(block.names, at), take(block.shared, at), take(job.kept, ks), job.keep[ks], kernel.decoded_nbytes)
        return decoded

    def copy_decoded(self, run: Run, items: list[tuple[UnitJob, np.ndarray]]) -> int | None:
        """Copy units of one plan table from their decoded arrays (chunk cache entries) in one
        call; returns the bytes written, or None when the native path does not apply."""
        units = [u for u, _ in items]
        return self._from_arrays(
            run, self.kernel(run, units), units[0].meta, [a for _, a in items], lambda: optable.build(units),
            lambda k: (samples_of((units[k],)), units[k].key, units[k].unit),
        )

    def copy_cached(self, run: Run, block: CachedUnits) -> int | None:
        """Copy the units of a plan table found in the chunk cache (the head of the table) in
        one call; returns the bytes written, or None when the native path does not apply."""
        t = block.table
        return self._from_arrays(
            run, self.kernel_of(run, block.meta), block.meta, block.arrays,
            lambda: native.OpTable(block.rows, t.ndim, t.pool, 0, t.spans[: len(block)]),
            lambda k: (set(block.unit_rows(k)[:, 1].tolist()), None, block.unit(k)), block.sources,
        )

    def _from_arrays(self, run: Run, kernel, meta, arrays: list[np.ndarray], ops, unit, sources: np.ndarray | None = None) -> int | None:
        """Copy units of ``meta`` from their decoded ``arrays`` in one native call: ``ops()``
        their op table, ``unit(k)`` unit k's samples, object key and coordinates (for a
        failure); ``sources``: the arrays' addresses as the chunk cache kept them (those this
        executor's kernels decoded into; None, or a 0 among them: each array's buffer is
        checked). The bytes written, or None when the native path does not apply."""
        if kernel is None:
            return None
        if sources is None or not sources.all():
            sources = native.decoded_sources(kernel, arrays)
        if sources is None:
            return None
        table = ops()
        failures, _, elements = native.run_decoded(kernel, sources, table, self._targets(run, table.ndim))
        for f in failures:  # only a planning error can fail a copy here
            samples, path, chunk = unit(f.unit)
            run.fail(samples, DecodeError(f.describe(kernel.decoded_nbytes), uri=meta.uri, path=path, chunk=chunk))
        return elements * run.dtype.itemsize

    # -- helpers ------------------------------------------------------------------------
    def _tables(self, run: Run, units: list[UnitJob]) -> tuple[native.OpTable, np.ndarray]:
        """The ops of ``units`` and the run's targets, for native code."""
        table = optable.build(units)
        return table, self._targets(run, table.ndim)

    @staticmethod
    def _targets(run: Run, ndim: int) -> np.ndarray:
        targets = run.targets.get(ndim)
        if targets is None:
            targets = run.targets.setdefault(ndim, native.targets(run.views, ndim, run.plan.norms))
        return targets

    def _keep(self, kernel, names: list, shareds: list) -> tuple[list[np.ndarray | None] | None, np.ndarray | None]:
        """A buffer for each unit (``names``, ``shareds``: their names and registrations) the
        chunk cache would admit or another batch waits for, which native code decodes the unit
        into whole (the others are decoded only as far as the copies need)."""
        cache = self.chunk_cache
        size = kernel.decoded_nbytes
        wanted = cache.would_admit_many(names, size) if cache is not None else [False] * len(names)
        if self.inflight is not None and shareds.count(None) != len(shareds):
            wanted = self.inflight.start_many(shareds, wanted)
        if not any(wanted):
            return None, None
        arrays, addresses = native.keep_buffers(kernel, sum(wanted))
        it = iter(arrays)
        kept = [next(it) if w else None for w in wanted]
        keep = np.zeros(len(names), dtype=np.int64)
        keep[np.flatnonzero(wanted)] = addresses
        return kept, keep

    def _cache_kept(self, names: list, shareds: list, arrays: list[np.ndarray | None], addresses: np.ndarray, size: int) -> None:
        """Units made (``names``, ``shareds`` and their buffers, ``arrays``: None for a unit
        not decoded whole; each buffer ``size`` bytes, a kernel's decoded unit, at
        ``addresses``, as :meth:`_keep` made them): those decoded whole to the chunk cache,
        and to the batches waiting for them."""
        held = list(map(is_not, arrays, repeat(None)))
        if not any(held):
            return
        if not all(held):
            names, shareds, arrays = list(compress(names, held)), list(compress(shareds, held)), list(compress(arrays, held))
            addresses = addresses[np.array(held)]
        for arr in arrays:
            arr.flags.writeable = False
        if self.chunk_cache is not None:
            # with their addresses: native copies read a cached unit where it was decoded
            self.chunk_cache.put_many(names, arrays, size, addresses)
        if self.inflight is not None and shareds.count(None) != len(shareds):
            with self._settling():
                self.inflight.settle_many(shareds, arrays)

    def _done(self, kernel, run: Run, units, table, failures, encoded: int, elements: int, offset: int, data_len: int) -> tuple[int, int, int]:
        """Fail the samples of units native code could not decode; returns (encoded,
        decoded, assembled) bytes of the others."""
        for f in failures:
            self._fail_unit(kernel, run, units[f.unit], f, table.spans[f.unit], offset, data_len)
        return encoded, (len(units) - len(failures)) * kernel.decoded_nbytes, elements * run.dtype.itemsize

    def _fail_unit(self, kernel, run: Run, u: UnitJob, f: native.Failure, table_span: np.ndarray, offset: int, data_len: int) -> None:
        """Unit ``u`` failed in native code (``f``): its samples fail, and the batches waiting
        for it. ``table_span``: its (offset, length) in its object; ``offset``, ``data_len``:
        where the bytes read start in the object, and how many there were."""
        start, length = table_span.tolist()
        got = max(0, min(length if length >= 0 else data_len, data_len - (start - offset)))
        if u.nbytes >= 0 and got != u.nbytes:  # the read came short: the file was cut off
            reason = f"truncated data: expected {u.nbytes} bytes, the file has {got} there"
        else:
            reason = f.describe(kernel.decoded_nbytes)
        err = DecodeError(reason, uri=u.meta.uri, path=u.key, chunk=u.unit)
        run.fail(samples_of((u,)), err)
        if u.shared is not None:
            self.inflight.settle(u.shared, error=err)
