"""The CUDA executor: a batch plan read on the host, decoded and assembled on a device.

Per batch, in two stages: on host threads, the plan's reads are made and every zstd frame and
LZ4 block is walked (nvCOMP's behaviour on corrupt input is undefined) and device memory is
reserved (see :mod:`damacy_server.cuda.units`); then on the executor's one device thread and
stream, while the next batches are read: the frames go to the device in one staging upload
per codec and are decoded by one batched nvCOMP call per codec into one arena; stored units
(no compressor) are uploaded into the arena as they are; Blosc chunks are split on the host,
their zstd and LZ4 streams join the batched decodes and their blocks are unshuffled by a
kernel; units of other codec chains (and Blosc with blosclz, zlib or snappy) are decoded on
the host and uploaded (counted in ``host_decoded``); units never written are
uploaded as the fill value. Then padded samples are filled and each array's copy table
is assembled by one kernel launch, the same table the CPU paths execute. A chunk whose frame
is refused on the host or whose status is bad after the batch fails its samples with a
:class:`DecodeError`; its rows are not assembled.

The device is a :class:`~damacy_server.cuda.device.Device`: a GPU, or the host stand-in that
runs the same orchestration with the kernels' host twin (the CPU tests use it). Targets are
device arrays, or host arrays (batch slots in host memory) the device writes over the bus
once ``Device.output_pointer`` has page-locked and mapped them.

(Over 400 lines: one job, a plan executed on a GPU; its host stage, decode stage and
assembly launches share the batch's arena, streams and errors.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from damacy_protocol.enums import NumaStrategy, Stage
from damacy_protocol.errors import BudgetExceeded, DamacyError, DecodeError
from damacy_protocol.limits import CudaLimits
from damacy_runtime.device import DeviceArray
from damacy_runtime.devices import check_gds
from damacy_server.cache import AnyCache, LRUCache
from damacy_server.cpu.run import samples_of
from damacy_server.cuda import nvcomp
from damacy_server.cuda.device import Device, DeviceBuffer, bind_device, numa_cpus, open_backend
from damacy_server.cuda.tables import check_disjoint
from damacy_server.cuda.twin import CODES, SHUFFLE_MODES, norm_table
from damacy_server.cuda.units import Unit, crash, device_dtype, fail, read_units
from damacy_server.engine.budget import BudgetedExecutor, MemoryBudget, Reservation, StageStats
from damacy_server.engine.slots import DeviceSlots
from damacy_server.plan.planner import BatchPlan
from damacy_server.plan.reads import Caps
from damacy_server.plan.transforms import sample_view
from damacy_server.store.file import FileReader
from damacy_server.workers import WorkerPool, close_with

CODECS = ("zstd", "lz4")  # what nvCOMP decodes here, one batched call each per batch
ALIGN = 256  # bytes: every unit's place in the arena (nvCOMP asks 8 at most; coalesced loads)
BLOCK = 256  # threads per block


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class CudaExecutor(BudgetedExecutor):
    """Reads chunk data on the host (``reader``'s threads), decodes it on a GPU (nvCOMP) and
    assembles batches there (one kernel launch per batch), within ``limits`` (a
    :class:`~damacy_protocol.limits.CudaLimits`). ``device=k``: GPU k; ``None``: the GPU whose
    CUDA context is current in the calling thread (none: :class:`InvalidArgument`).
    ``numa_strategy``/``numa_node``: where its host threads run (see
    :class:`~damacy_protocol.enums.NumaStrategy`). ``enable_gds``: GPUDirect Storage, which
    damacy does not have: ``True`` (or ``None`` with ``DAMACY_GDS_ENABLE=1``) is refused.
    Without a CUDA device it is refused at once, saying so.

    ``backend`` (damacy's, for the daemon and tests): the device object itself
    (:mod:`damacy_server.cuda.device`), the host stand-in included."""

    def __init__(
        self,
        *,
        reader: FileReader,
        limits: CudaLimits,
        device: int | None = None,
        numa_strategy: NumaStrategy | str | int = NumaStrategy.AUTO,
        numa_node: int = -1,
        enable_gds: bool | None = None,
        backend: Device | None = None,
    ) -> None:
        if not isinstance(reader, FileReader):
            raise TypeError(f"reader must be a FileReader, got {type(reader).__name__}")
        if not isinstance(limits, CudaLimits):
            raise TypeError(f"limits must be a CudaLimits, got {type(limits).__name__}")
        self.reader = reader
        self.limits = limits
        self.numa_strategy = NumaStrategy.coerce(numa_strategy)
        if self.numa_strategy is NumaStrategy.PIN_TO and numa_node < 0:
            raise ValueError(f"numa_node must be >= 0 when numa_strategy=PIN_TO (got {numa_node})")
        if self.numa_strategy is not NumaStrategy.PIN_TO and numa_node != -1:
            raise ValueError(f"numa_node must be -1 when numa_strategy={self.numa_strategy.name} (got {numa_node})")
        self.numa_node = int(numa_node)
        self.enable_gds = None if enable_gds is None else bool(enable_gds)
        check_gds(self.enable_gds)
        if backend is None:
            index = bind_device(device)
            backend = open_backend(index)
        else:
            index = 0 if device is None else device
        self.device = device
        self.device_index = index
        self.gpu = backend
        self._start()

    def _start(self) -> None:
        self.budget = MemoryBudget(self.limits.max_gpu_memory_bytes, 4 * self.limits.max_chunk_bytes, "max_gpu_memory_bytes")
        self.stats = StageStats()
        self.chunk_cache: AnyCache | None = None  # a device chunk cache is future work
        self.inflight = None
        self.host_decoded = 0  # units of codec chains the device does not decode
        self._readers = WorkerPool(max(2, self.reader.workers // 2), "damacy-cuda-read")
        self._pool = WorkerPool(1, "damacy-cuda")  # one stream
        self._slot_writes = threading.Lock()  # the engine's own writes (fill, move), one at a time
        # batches whose host buffers (the units read, the staged frames) are held: read ahead
        # of the device, until their device stage is done (CudaLimits.host_buffer_waves)
        self._host_waves = threading.BoundedSemaphore(self.limits.host_buffer_waves)
        #: parsed Blosc headers by chunk (CudaLimits.chunk_layout_entries): a chunk read again
        #: is split into its streams without parsing it again
        self.layout_cache: LRUCache = LRUCache(self.limits.chunk_layout_entries)
        self._closed = False
        close_with(self, self._readers, self._pool)  # closed by its owner, or once unreferenced
        self._pin_threads()

    # -- the engine's interface (with BudgetedExecutor's) ----------------------------------
    def execute(
        self,
        plan: BatchPlan,
        targets: Sequence[Any],
        on_done: Callable[[dict[int, DamacyError]], None],
        cancelled: Callable[[], bool] = lambda: False,
        key: Any = None,
    ) -> None:
        """Assemble sample i of ``plan`` into ``targets[i]`` (a device array, or host memory
        the device writes: see ``Device.output_pointer``); ``on_done`` gets the errors by
        sample once the batch is in place. A batch's reads (host threads) overlap the device
        work of the batches before it (one thread, one stream)."""
        self._readers.submit(self._host_stage, plan, list(targets), on_done, cancelled, key=key)

    def close(self) -> None:
        """Stop: the tasks queued still run, see the close and settle (the device memory
        they reserved, their batches' outcome, work queued after the device's)."""
        self._closed = True
        self._readers.close(drain=True)  # first: they hand batches to the device thread
        self._pool.close(drain=True)

    def worker_steps(self) -> int:
        """Tasks its worker threads ran."""
        return self._readers.steps + self._pool.steps

    @property
    def caps(self) -> Caps:
        """What a plan for it may hold (see :meth:`Planner.plan`): chunks of at most
        ``max_chunk_bytes`` decoded, reads of at most ``max_read_bytes``."""
        return Caps(None, self.limits.max_chunk_bytes, self.limits.max_read_bytes, None)

    def _pin_threads(self) -> None:
        """Run the host threads on the CPUs of ``numa_strategy`` (see :func:`numa_cpus`)."""
        cpus = numa_cpus(self.numa_strategy, self.numa_node, self.gpu)
        if cpus is not None:
            self._readers.cpus = self._pool.cpus = cpus

    def device_stats(self) -> dict[str, Any]:
        return {"name": self.gpu.name, "host_decoded": self.host_decoded}

    def after_device_work(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the device thread once the device stages queued before it are done."""
        self._pool.submit(fn)

    def slot_memory(self) -> DeviceSlots:
        """Batches go to the device's memory."""
        return DeviceSlots(self.gpu)

    def fill(self, target: Any, value: Any) -> None:
        """One sample set to ``value`` (on_error="fill"), in stream order."""
        if not isinstance(target, DeviceArray):
            return super().fill(target, value)
        host = np.full(target.shape, value, dtype=target.dtype)
        with self._slot_writes:
            self._before_write([target])
            self.gpu.upload(host, target.ptr)
            self._after_write([target])

    def move(self, dst: Any, src: Any) -> None:
        """One sample copied over another of the same slot (on_error="skip"), in stream order."""
        if not isinstance(dst, DeviceArray):
            return super().move(dst, src)
        with self._slot_writes:
            self._before_write([dst])
            self.gpu.copy(dst.ptr, src.ptr, dst.nbytes)
            self._after_write([dst])

    def _before_write(self, targets: Sequence[Any]) -> None:
        """The stream waits for every consumer fence of the slots about to be written."""
        for sync in _syncs(targets):
            for event in sync.take_fences():
                self.gpu.wait_event(event)

    def _after_write(self, targets: Sequence[Any]) -> None:
        """The slots' batches are complete once the stream is (their ``ready`` event); the
        executor waits too, as the batch's statuses decide what is delivered."""
        for sync in _syncs(targets):
            sync.mark_ready(self.gpu)
        self.gpu.synchronize()

    # -- one batch ------------------------------------------------------------------------------
    def _host_stage(self, plan: BatchPlan, targets: list, on_done, cancelled) -> None:
        """Reads, host checks and the device memory reservation; then the device stage."""
        errors: dict[int, DamacyError] = {}
        handed_over = waves_held = False
        try:
            if cancelled() or self._closed:
                return
            self._host_waves.acquire()  # at most host_buffer_waves batches read ahead of the device
            waves_held = True
            units, host_decoded = read_units(
                self.reader, plan, errors, self.stats,
                max_streams=self.limits.max_substreams_per_chunk, layouts=self.layout_cache,
            )
            self.host_decoded += host_decoded
            need = self._layout(units)
            status = self.budget.reserve(need, lambda: cancelled() or self._closed)
            if status is not Reservation.TAKEN:
                reason = "the batch's decoded units need more device memory than max_gpu_memory_bytes leaves beside the slots"
                if status is Reservation.TOO_BIG:
                    fail(errors, plan, samples_of([u.job for u in units]), BudgetExceeded(f"{reason} ({need} bytes)"))
                return
            self._pool.submit(self._device_stage, plan, targets, units, need, errors, on_done, cancelled)
            handed_over = True
        except Exception as e:  # a bug fails this batch's samples, never the executor
            crash(errors, plan, e)
        finally:
            if not handed_over:
                if waves_held:
                    self._host_waves.release()
                on_done(errors)

    def _device_stage(self, plan: BatchPlan, targets: list, units: list[Unit], reserved: int, errors, on_done, cancelled) -> None:
        """Decode, fill and assemble on the stream; one wait for the device at the end (and
        one after the batched decode, whose statuses decide what is assembled)."""
        keep: list = []  # device buffers and host arrays the queued work reads, until the end
        try:
            if cancelled() or self._closed:
                return
            views = [None if shape is None else sample_view(targets[i], shape, plan.transforms[i]) for i, shape in enumerate(plan.shapes)]
            arena = self.gpu.alloc(reserved)
            keep.append(arena)
            self._decode(units, arena, errors, plan, keep)
            self._before_write(targets)
            self._fill(plan, [None if shape is None else targets[i] for i, shape in enumerate(plan.shapes)], keep)  # whole samples
            self._assemble(plan, units, arena, views, keep)
            self._after_write(targets)
        except Exception as e:  # a bug fails this batch's samples, never the executor
            crash(errors, plan, e)
            try:  # what was queued must finish before its memory and the slot are reused
                self.gpu.synchronize()
            except Exception:  # noqa: BLE001 - the device is gone; nothing is running on it
                pass
        finally:
            keep.clear()
            self.budget.release(reserved)
            self._host_waves.release()  # this batch's host buffers are done with
            on_done(errors)

    def _layout(self, units: list[Unit]) -> int:
        """Arena offsets: each unit's decoded bytes (and its scratch when it is to be
        unshuffled), then the staged frames, the decoder's tables and its scratch space (all
        within the batch's reservation); total bytes."""
        pos = 0
        for u in units:
            u.offset = pos
            pos += _aligned(u.job.decoded_nbytes)
            if u.shuffle is not None:
                u.scratch = pos
                pos += _aligned(u.job.decoded_nbytes)
        for codec in CODECS:  # per codec and wave: its staged frames, the decoder's tables and scratch
            for wave in self._waves(units, codec):
                sizes = [size for _, _, _, size in wave]
                staged = sum(_aligned(len(f)) for _, f, _, _ in wave)
                pos += staged + 6 * _aligned(8 * len(sizes)) + _aligned(self._temp_bytes(codec, len(sizes), max(sizes), sum(sizes)))
        return pos

    def _waves(self, units: list[Unit], codec: str) -> list[list[tuple[Unit, Any, int, int]]]:
        """The frames of ``codec`` in decode calls of at most ``max_chunks_per_wave`` chunks
        each (a chunk's frames stay in one call)."""
        waves: list[list[tuple[Unit, Any, int, int]]] = []
        chunks = 0
        for u in units:
            frames = [(u, f, at, size) for f, at, size, c in u.frames if c == codec]
            if not frames:
                continue
            if not waves or chunks >= self.limits.max_chunks_per_wave:
                waves.append([])
                chunks = 0
            waves[-1].extend(frames)
            chunks += 1
        return waves

    def _temp_bytes(self, codec: str, n: int, max_bytes: int, total: int) -> int:
        sizing = self.gpu.zstd_temp_bytes if codec == "zstd" else self.gpu.lz4_temp_bytes
        return sizing(n, max_bytes, total)

    def _decode(self, units: list[Unit], arena: DeviceBuffer, errors, plan, keep: list) -> None:
        """Copies and the batched zstd and LZ4 decodes into the arena, then the Blosc unshuffles."""
        dev = self.gpu
        t0 = time.perf_counter()
        base = lambda u: arena.ptr + (u.scratch if u.scratch >= 0 else u.offset)  # noqa: E731
        copies = [(u, data, at) for u in units for data, at in u.copies]
        uploads = [0.0, 0, 0]  # seconds, calls, bytes of the host-to-device copies (Stats.input_transfer)
        t_up = time.perf_counter()
        if copies:  # staged in one page-locked buffer, so the uploads are asynchronous
            pieces = [
                np.ascontiguousarray(data).reshape(-1).view(np.uint8) if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
                for _, data, _ in copies
            ]
            staged = dev.host_buffer(sum(_aligned(len(p)) for p in pieces))
            keep.append(staged)
            at_stage = 0
            for (u, _, at), piece in zip(copies, pieces):
                staged[at_stage : at_stage + len(piece)] = piece
                dev.upload(staged[at_stage : at_stage + len(piece)], base(u) + at)
                at_stage += _aligned(len(piece))
            uploads[1:] = [len(pieces), sum(len(p) for p in pieces)]
        uploads[0] = time.perf_counter() - t_up
        pos = max((u.scratch if u.scratch >= 0 else u.offset) + _aligned(u.job.decoded_nbytes) for u in units) if units else 0
        for codec in CODECS:  # batched calls per codec (waves), each in its own region of the arena
            for frames in self._waves(units, codec):
                pos = self._batched(codec, frames, arena, pos, base, errors, plan, keep, uploads)
        self._unshuffle([u for u in units if u.shuffle is not None and u.error is None], arena, keep)
        self.stats.add(Stage.DECODE, time.perf_counter() - t0, count=len(units), bytes_in=sum(u.encoded for u in units))
        if uploads[1]:
            self.stats.add(Stage.UPLOAD, uploads[0], count=uploads[1], bytes_in=uploads[2])

    def _batched(self, codec: str, frames: list, arena: DeviceBuffer, pos: int, base, errors, plan, keep: list, uploads: list) -> int:
        """Frames of one codec staged at ``pos`` in the arena and decoded by one nvCOMP call;
        their statuses read back (the staging and upload counted in ``uploads``). Returns
        where the next region starts."""
        dev = self.gpu
        t_up = time.perf_counter()
        staging = dev.host_buffer(sum(_aligned(len(f)) for _, f, _, _ in frames))
        comp_ptrs, comp_bytes, out_ptrs, out_bytes = [], [], [], []
        at_stage = 0
        for u, f, at, size in frames:
            n = len(f)
            staging[at_stage : at_stage + n] = np.frombuffer(f, dtype=np.uint8)
            comp_ptrs.append(arena.ptr + pos + at_stage)
            comp_bytes.append(n)
            out_ptrs.append(base(u) + at)
            out_bytes.append(size)
            at_stage += _aligned(n)
        dev.upload(staging, arena.ptr + pos)
        uploads[0] += time.perf_counter() - t_up
        uploads[1] += 1
        uploads[2] += at_stage
        n = len(frames)
        step = _aligned(8 * n)
        addr = [arena.ptr + pos + at_stage + k * step for k in range(6)]
        for k, values in enumerate((comp_ptrs, comp_bytes, out_bytes, out_ptrs)):
            dev.upload(np.array(values, dtype=np.uint64), addr[k])
        temp_bytes = self._temp_bytes(codec, n, max(out_bytes), sum(out_bytes))
        temp = addr[5] + step  # after the tables (see _layout)
        keep.append(staging)
        decompress = dev.zstd_decompress if codec == "zstd" else dev.lz4_decompress
        decompress(addr[0], addr[1], addr[2], addr[4], n, temp if temp_bytes else 0, temp_bytes, addr[3], addr[5])
        statuses = np.zeros(n, dtype=np.int32)
        actual = np.zeros(n, dtype=np.uint64)
        dev.synchronize()
        dev.download(addr[5], statuses)
        dev.download(addr[4], actual)
        dev.synchronize()
        for (u, _, _, size), status, got in zip(frames, statuses.tolist(), actual.tolist()):
            if u.error is not None:
                continue
            job = u.job
            err = nvcomp.status_error(status, uri=job.meta.uri, path=job.key, chunk=job.unit, codec=codec)
            if err is None and got != size:
                err = DecodeError(f"{codec}: decoded {got} bytes, expected {size}", uri=job.meta.uri, path=job.key, chunk=job.unit)
            if err is not None:
                if u.kind == "blosc":
                    err = DecodeError(f"blosc: a stream: {err.reason}", uri=job.meta.uri, path=job.key, chunk=job.unit)
                u.error = err
                fail(errors, plan, samples_of((job,)), err)
        return pos + at_stage + 6 * step + _aligned(temp_bytes)

    def _unshuffle(self, units: list[Unit], arena: DeviceBuffer, keep: list) -> None:
        """One launch per (typesize, shuffle) of the batch's Blosc chunks: scratch -> unit."""
        groups: dict[tuple[int, str], list[tuple[int, int, int]]] = {}
        for u in units:
            typesize, mode, blocks = u.shuffle
            for start, size in blocks:
                groups.setdefault((typesize, mode), []).append((arena.ptr + u.scratch + start, arena.ptr + u.offset + start, size))
        for (typesize, mode), blocks in groups.items():
            host = [np.array([b[k] for b in blocks], dtype=np.uint64 if k < 2 else np.int64) for k in range(3)]
            addrs = self._tables(host, keep)
            self.gpu.launch(
                "unshuffle", len(blocks), BLOCK,
                (np.uint64(addrs[0]), np.uint64(addrs[1]), np.uint64(addrs[2]), np.int64(len(blocks)), np.int64(typesize),
                 np.int32(SHUFFLE_MODES[mode])),
            )

    def _tables(self, host: list[np.ndarray], keep: list) -> list[int]:
        """Host arrays copied into one device buffer; their device addresses."""
        buf = self.gpu.alloc(sum(_aligned(h.nbytes) for h in host))
        keep.append(buf)
        addrs, at = [], 0
        for h in host:
            h = np.ascontiguousarray(h)
            self.gpu.upload(h, buf.ptr + at)
            keep.append(h)
            addrs.append(buf.ptr + at)
            at += _aligned(h.nbytes)
        return addrs

    def _fill(self, plan: BatchPlan, views: list, keep: list) -> None:
        """Samples that reach outside their array start as the fill value: one launch per
        (source dtype, output shape), a block per sample."""
        groups: dict[tuple, list[tuple[int, np.ndarray]]] = {}
        for s, value in plan.fills:
            view, meta = views[s], plan.metas[s]
            src = np.asarray(value, dtype=meta.dtype if meta is not None else np.asarray(value).dtype)
            groups.setdefault((src.dtype.str, view.size, view.dtype.str), []).append((s, src))
        for (_, count, _), members in groups.items():
            src_dtype = members[0][1].dtype
            values = np.zeros((len(members), 8), dtype=np.uint8)
            for k, (_, src) in enumerate(members):
                values[k, : src.itemsize] = src.reshape(1).view(np.uint8)
            out_ptr = np.array([self.gpu.output_pointer(views[s]) for s, _ in members], dtype=np.uint64)
            order = np.arange(len(members), dtype=np.int64)
            norm = norm_table([plan.norm(s) for s, _ in members])
            addrs = self._tables([order, values, out_ptr] + ([] if norm is None else [norm]), keep)
            swap = int(not src_dtype.isnative and src_dtype.itemsize > 1)
            self.gpu.launch(
                "fill", len(members), BLOCK,
                (np.uint64(addrs[0]), np.int64(len(members)), np.uint64(addrs[1]), np.int32(CODES[src_dtype.newbyteorder("=")]),
                 np.int32(swap), np.uint64(addrs[2]), np.int64(len(members)), np.int64(count),
                 np.int32(CODES[views[members[0][0]].dtype]), np.uint64(0 if norm is None else addrs[3])),
            )

    def _assemble(self, plan: BatchPlan, units: list[Unit], arena: DeviceBuffer, views: list, keep: list) -> None:
        """One launch per array: the copy table's rows of the units that decoded."""
        t0 = time.perf_counter()
        by_table: dict[int, list[Unit]] = {}
        for u in units:
            if u.error is None:
                by_table.setdefault(id(u.job.table), []).append(u)
        written = 0
        for group in by_table.values():
            table = group[0].job.table
            rows = np.concatenate([table.rows[u.job.lo : u.job.hi] for u in group]) if group else table.rows[:0]
            live = [v for v in views if v is not None]
            if not len(rows) or not live:
                continue
            check_disjoint(rows, table.ndim, table.pool, [v.shape if v is not None else () for v in views])
            unit_ptr = np.zeros(len(table.spans), dtype=np.uint64)
            for u in group:
                unit_ptr[u.job.pos] = arena.ptr + u.offset
            first = live[0]
            out_ptr = np.array([self.gpu.output_pointer(v) if v is not None else 0 for v in views], dtype=np.uint64)
            # per sample its view's shape and strides (a sample without a view: zeros, no rows)
            out_shape = np.zeros((len(views), table.ndim), dtype=np.int64)
            out_strides = np.zeros((len(views), table.ndim), dtype=np.int64)
            for k, v in enumerate(views):
                if v is not None and v.ndim == table.ndim:
                    out_shape[k] = v.shape
                    out_strides[k] = [st // v.itemsize for st in v.strides]
            meta = group[0].job.meta
            stored = device_dtype(meta)
            if stored is None:  # decoded on the host, every unit in native order
                stored = group[0].copies[0][0].dtype
            src_code = CODES[stored.newbyteorder("=")]
            swap = int(not stored.isnative and stored.itemsize > 1)
            pool = table.pool if len(table.pool) else np.zeros(1, dtype=np.int64)
            unit_shape = np.array(meta.layout.leaf.spec.shape, dtype=np.int64)
            norm = norm_table(plan.norms) if plan.norms else None
            host = [np.ascontiguousarray(rows, dtype=np.int64), np.ascontiguousarray(pool, dtype=np.int64), unit_ptr, unit_shape, out_ptr, out_shape, out_strides]
            addrs = self._tables(host + ([] if norm is None else [norm]), keep)
            self.gpu.launch(
                "assemble", len(rows), BLOCK,
                (np.uint64(addrs[0]), np.int64(len(rows)), np.int32(table.ndim), np.uint64(addrs[1]), np.int64(len(pool)),
                 np.uint64(addrs[2]), np.int64(len(unit_ptr)), np.uint64(addrs[3]), np.int32(src_code), np.int32(swap),
                 np.uint64(addrs[4]), np.int64(len(views)), np.uint64(addrs[5]), np.uint64(addrs[6]), np.int32(CODES[first.dtype]),
                 np.uint64(0 if norm is None else addrs[7])),
            )
            written += int(np.prod(rows[:, 2 + 2 * table.ndim :], axis=1).sum()) * first.itemsize
        self.stats.add(Stage.ASSEMBLE, time.perf_counter() - t0, count=len(units), bytes_out=written)


def _syncs(targets: Sequence[Any]) -> list:
    """The distinct slot syncs of device-array targets."""
    seen: dict[int, Any] = {}
    for t in targets:
        if isinstance(t, DeviceArray):
            seen.setdefault(id(t.sync), t.sync)
    return list(seen.values())
