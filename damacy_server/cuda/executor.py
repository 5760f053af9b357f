"""The CUDA executor: a batch plan read on the host, decoded and assembled on a device.

Per batch, in two stages: on host threads, the plan's reads are made and every zstd frame is
walked (nvCOMP's behaviour on corrupt input is undefined) and device memory is reserved;
then on the executor's one device thread and stream, while the next batches are read: the
frames go to
the device in one staging upload and are decoded by one batched nvCOMP call into one arena;
stored units (no compressor) are uploaded into the arena as they are; Blosc chunks are
split on the host, their zstd streams join the batched decode and their blocks are
unshuffled by a kernel; units of other codec chains (and Blosc with other compressors) are
decoded on the host and uploaded (counted in ``host_decoded``); units never written are
uploaded as the fill value. Then padded samples are filled and each array's copy table
is assembled by one kernel launch, the same table the CPU paths execute. A chunk whose frame
is refused on the host or whose status is bad after the batch fails its samples with a
:class:`DecodeError`; its rows are not assembled.

The device is a :class:`~damacy_server.cuda.device.Device`: a GPU, or the host stand-in that
runs the same orchestration with the kernels' host twin (the CPU tests use it). Targets are
device arrays, or host arrays (batch slots in host memory) the device writes over the bus
once ``Device.output_pointer`` has page-locked and mapped them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from damacy_protocol.checks import Size, check_fields
from damacy_protocol.errors import DecodeError, SampleError
from damacy_runtime.device import DeviceArray
from damacy_server.budget import BudgetedExecutor, MemoryBudget, Reservation, StageStats
from damacy_server.cuda import nvcomp
from damacy_server.cuda.device import Device, DeviceBuffer
from damacy_server.cuda.tables import check_disjoint
from damacy_server.cuda.twin import CODES, SHUFFLE_MODES
from damacy_server.decode import check_length, decode_unit
from damacy_server.plan import BatchPlan, UnitJob
from damacy_server.run import for_sample, samples_of
from damacy_server.slots import DeviceSlots
from damacy_server.store.file import FileReader
from damacy_server.workers import WorkerPool
from damacy_server.zarr.codecs.base import CorruptData
from damacy_server.zarr.codecs.blosc import HEADER, parse_frame

ALIGN = 256  # bytes: every unit's place in the arena (nvCOMP asks 8 at most; coalesced loads)
BLOCK = 256  # threads per block


@dataclass(frozen=True)
class CudaLimits:
    """``max_gpu_memory_bytes``: batch slots plus each batch's arenas on the device."""

    max_gpu_memory_bytes: Size = 1 << 30

    def __post_init__(self) -> None:
        check_fields(self, {"max_gpu_memory_bytes": Size})


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Unit:
    """One unit of a batch on its way to the arena: the zstd frames to decode there and the
    bytes to copy there, each at an offset of the unit's place (or of its scratch, for a
    Blosc chunk to unshuffle afterwards)."""

    __slots__ = ("job", "kind", "frames", "copies", "shuffle", "offset", "scratch", "error")

    def __init__(self, job: UnitJob, kind: str) -> None:
        self.job = job
        self.kind = kind  # "zstd", "blosc", "stored" (bytes as stored), "host" (decoded on the host)
        self.frames: list[tuple[memoryview, int, int]] = []  # (frame, offset, decoded bytes)
        self.copies: list[tuple[Any, int]] = []  # (bytes or array, offset)
        self.shuffle: tuple[int, str, list[tuple[int, int]]] | None = None  # typesize, mode, blocks
        self.offset = 0  # of the decoded unit in the arena
        self.scratch = -1  # of its shuffled bytes, when it has some
        self.error: SampleError | None = None

    @property
    def encoded(self) -> int:
        return sum(len(f) for f, _, _ in self.frames)


class CudaExecutor(BudgetedExecutor):
    """Executes batch plans on a device; the engine's executor interface (``execute``,
    ``inflight_capacity``, ``chunk_cache``, slot reservations, ``stats``, ``close``)."""

    def __init__(self, device: Device, reader: FileReader | None = None, limits: CudaLimits | None = None) -> None:
        self.device = device
        self.reader = reader if reader is not None else FileReader()
        self.limits = limits if limits is not None else CudaLimits()
        self.budget = MemoryBudget(self.limits.max_gpu_memory_bytes)
        self.stats = StageStats()
        self.chunk_cache = None  # a device chunk cache is future work
        self.inflight = None
        self.host_decoded = 0  # units of codec chains the device does not decode
        self._readers = WorkerPool(max(2, self.reader.workers // 2), "damacy-cuda-read")
        self._pool = WorkerPool(1, "damacy-cuda")  # one stream
        self._slot_writes = threading.Lock()  # the engine's own writes (fill, move), one at a time
        self._closed = False

    # -- the engine's interface (with BudgetedExecutor's) ----------------------------------
    def execute(
        self,
        plan: BatchPlan,
        targets: Sequence[Any],
        on_done: Callable[[dict[int, SampleError]], None],
        cancelled: Callable[[], bool] = lambda: False,
        key: Any = None,
    ) -> None:
        """Assemble sample i of ``plan`` into ``targets[i]`` (a device array, or host memory
        the device writes: see ``Device.output_pointer``); ``on_done`` gets the errors by
        sample once the batch is in place. A batch's reads (host threads) overlap the device
        work of the batches before it (one thread, one stream)."""
        self._readers.submit(self._host_stage, plan, list(targets), on_done, cancelled, key=key)

    def close(self) -> None:
        self._closed = True
        self._readers.close()
        self._pool.close()

    def slot_memory(self) -> DeviceSlots:
        """Batches go to the device's memory."""
        return DeviceSlots(self.device)

    def fill(self, target: Any, value: Any) -> None:
        """One sample set to ``value`` (on_error="fill"), in stream order."""
        if not isinstance(target, DeviceArray):
            return super().fill(target, value)
        host = np.full(target.shape, value, dtype=target.dtype)
        with self._slot_writes:
            self._before_write([target])
            self.device.upload(host, target.ptr)
            self._after_write([target])

    def move(self, dst: Any, src: Any) -> None:
        """One sample copied over another of the same slot (on_error="skip"), in stream order."""
        if not isinstance(dst, DeviceArray):
            return super().move(dst, src)
        with self._slot_writes:
            self._before_write([dst])
            self.device.copy(dst.ptr, src.ptr, dst.nbytes)
            self._after_write([dst])

    def _before_write(self, targets: Sequence[Any]) -> None:
        """The stream waits for every consumer fence of the slots about to be written."""
        for sync in _syncs(targets):
            for event in sync.take_fences():
                self.device.wait_event(event)

    def _after_write(self, targets: Sequence[Any]) -> None:
        """The slots' batches are complete once the stream is (their ``ready`` event); the
        executor waits too, as the batch's statuses decide what is delivered."""
        syncs = _syncs(targets)
        if syncs:
            event = self.device.record_event()
            for sync in syncs:
                sync.ready = event
        self.device.synchronize()

    # -- one batch ------------------------------------------------------------------------------
    def _host_stage(self, plan: BatchPlan, targets: list, on_done, cancelled) -> None:
        """Reads, host checks and the device memory reservation; then the device stage."""
        errors: dict[int, SampleError] = {}
        handed_over = False
        try:
            if cancelled() or self._closed:
                return
            units = self._read(plan, errors)
            need = self._layout(units)
            status = self.budget.reserve(need, lambda: cancelled() or self._closed)
            if status is not Reservation.TAKEN:
                reason = "the batch's decoded units need more device memory than max_gpu_memory_bytes leaves beside the slots"
                if status is Reservation.TOO_BIG:
                    _fail(errors, plan, samples_of([u.job for u in units]), SampleError(f"{reason} ({need} bytes)"))
                return
            self._pool.submit(self._device_stage, plan, targets, units, need, errors, on_done, cancelled)
            handed_over = True
        except Exception as e:  # a bug fails this batch's samples, never the executor
            _crash(errors, plan, e)
        finally:
            if not handed_over:
                on_done(errors)

    def _device_stage(self, plan: BatchPlan, targets: list, units: list[_Unit], reserved: int, errors, on_done, cancelled) -> None:
        """Decode, fill and assemble on the stream; one wait for the device at the end (and
        one after the batched decode, whose statuses decide what is assembled)."""
        keep: list = []  # device buffers and host arrays the queued work reads, until the end
        try:
            if cancelled() or self._closed:
                return
            views = [None if shape is None else targets[i].reshape(shape) for i, shape in enumerate(plan.shapes)]
            arena = self.device.alloc(reserved)
            keep.append(arena)
            self._decode(units, arena, errors, plan, keep)
            self._before_write(targets)
            self._fill(plan, views, keep)
            self._assemble(plan, units, arena, views, keep)
            self._after_write(targets)
        except Exception as e:  # a bug fails this batch's samples, never the executor
            _crash(errors, plan, e)
            try:  # what was queued must finish before its memory and the slot are reused
                self.device.synchronize()
            except Exception:  # noqa: BLE001 - the device is gone; nothing is running on it
                pass
        finally:
            keep.clear()
            self.budget.release(reserved)
            on_done(errors)

    def _read(self, plan: BatchPlan, errors: dict[int, SampleError]) -> list[_Unit]:
        """Every unit's bytes, read on the host and checked there."""
        t0 = time.perf_counter()
        out: list[_Unit] = []
        nbytes = 0
        for group in plan.groups:
            try:
                data = self.reader.read(group.key) if group.length < 0 else self.reader.read_range(group.key, group.offset, group.length)
            except SampleError as e:
                _fail(errors, plan, samples_of(group.units), e.with_context(uri=group.units[0].meta.uri))
                continue
            nbytes += len(data) if data else 0
            view = memoryview(data) if data is not None else None
            for job in group.units:
                piece = None
                if view is not None:
                    piece = view if group.length < 0 else view[job.offset - group.offset : job.offset - group.offset + job.nbytes]
                out.append(self._classify(job, piece, errors, plan))
        self.stats.add("read", time.perf_counter() - t0, count=len(plan.groups), bytes_out=nbytes)
        return [u for u in out if u is not None]

    def _classify(self, job: UnitJob, piece: memoryview | None, errors, plan) -> _Unit | None:
        """How a unit reaches the arena. Units of one array all come in one byte order: the
        stored one where the device decodes the chain, native where the host does."""
        meta = job.meta
        leaf = meta.layout.leaf
        stored = _device_dtype(meta)
        nbytes = leaf.spec.nbytes
        try:
            if piece is None:  # never written: the fill value
                dtype = stored if stored is not None else meta.dtype.newbyteorder("=")
                unit = _Unit(job, "stored" if stored is not None else "host")
                unit.copies.append((np.full(leaf.spec.shape, meta.fill_value, dtype=dtype), 0))
                return unit
            check_length(meta, piece, job.nbytes, job.unit, job.key)
            names = tuple(c.name for c in leaf.b2b)
            if stored is not None and names == ("zstd",):
                nvcomp.walk_zstd_frame(piece, nbytes)
                unit = _Unit(job, "zstd")
                unit.frames.append((piece, 0, nbytes))
                return unit
            if stored is not None and names == ():
                if len(piece) != nbytes:
                    raise CorruptData(f"a stored chunk of {len(piece)} bytes, expected {nbytes}")
                unit = _Unit(job, "stored")
                unit.copies.append((piece, 0))
                return unit
            if stored is not None and names == ("blosc",):
                unit = self._blosc(job, piece, nbytes)
                if unit is not None:
                    return unit
            arr = decode_unit(meta, piece, job.unit, job.key)  # another chain: decoded here
            self.host_decoded += 1
            unit = _Unit(job, "host")
            # in the array's one byte order (a missing unit of the array comes the same way)
            unit.copies.append((np.ascontiguousarray(arr, dtype=stored if stored is not None else arr.dtype.newbyteorder("=")), 0))
            return unit
        except CorruptData as e:
            err = DecodeError(str(e), uri=meta.uri, path=job.key, chunk=job.unit)
        except SampleError as e:
            err = e
        _fail(errors, plan, samples_of((job,)), err)
        return None

    def _blosc(self, job: UnitJob, piece: memoryview, nbytes: int) -> _Unit | None:
        """A Blosc chunk split on the host: its zstd streams decoded on the device with the
        batch's other frames, its stored streams copied, its blocks unshuffled by a kernel.
        None for compressors nvCOMP is not asked to decode here (decoded on the host)."""
        frame = parse_frame(piece)
        if frame.nbytes != nbytes:
            raise CorruptData(f"blosc: header says {frame.nbytes} decoded bytes, expected {nbytes}")
        unit = _Unit(job, "blosc")
        if frame.memcpyed or frame.nbytes == 0:
            unit.copies.append((piece[HEADER.size : HEADER.size + frame.nbytes], 0))
            return unit
        if frame.compressor != "zstd" and any(not s.raw for s in frame.streams):
            return None
        shuffled = frame.shuffle != "noshuffle" and not (frame.shuffle == "shuffle" and frame.typesize == 1)
        for s in frame.streams:
            at = s.block * frame.blocksize + s.out_offset  # in the unit's (or its scratch's) bytes
            data = piece[s.offset : s.offset + s.size]
            if s.raw:
                unit.copies.append((data, at))
            else:
                nvcomp.walk_zstd_frame(data, s.out_size)
                unit.frames.append((data, at, s.out_size))
        if shuffled:
            blocks = [(j * frame.blocksize, frame.block_size(j)) for j in range(-(-frame.nbytes // frame.blocksize))]
            unit.shuffle = (frame.typesize, frame.shuffle, blocks)
        return unit

    def _layout(self, units: list[_Unit]) -> int:
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
        sizes = [size for u in units for _, _, size in u.frames]
        staged = sum(_aligned(len(f)) for u in units for f, _, _ in u.frames)
        temp = self.device.zstd_temp_bytes(len(sizes), max(sizes), sum(sizes)) if sizes else 0
        return pos + staged + 6 * _aligned(8 * max(len(sizes), 1)) + _aligned(temp)

    def _decode(self, units: list[_Unit], arena: DeviceBuffer, errors, plan, keep: list) -> None:
        """Copies and the batched zstd decode into the arena, then the Blosc unshuffles."""
        dev = self.device
        t0 = time.perf_counter()
        base = lambda u: arena.ptr + (u.scratch if u.scratch >= 0 else u.offset)  # noqa: E731
        copies = [(u, data, at) for u in units for data, at in u.copies]
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
        frames = [(u, f, at, size) for u in units for f, at, size in u.frames]
        if frames:
            pos = max((u.scratch if u.scratch >= 0 else u.offset) + _aligned(u.job.decoded_nbytes) for u in units)
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
            n = len(frames)
            step = _aligned(8 * n)
            addr = [arena.ptr + pos + at_stage + k * step for k in range(6)]
            for k, values in enumerate((comp_ptrs, comp_bytes, out_bytes, out_ptrs)):
                dev.upload(np.array(values, dtype=np.uint64), addr[k])
            temp_bytes = dev.zstd_temp_bytes(n, max(out_bytes), sum(out_bytes))
            temp = addr[5] + step  # the last region of the arena (see _layout)
            keep.append(staging)
            dev.zstd_decompress(addr[0], addr[1], addr[2], addr[4], n, temp if temp_bytes else 0, temp_bytes, addr[3], addr[5])
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
                err = nvcomp.status_error(status, uri=job.meta.uri, path=job.key, chunk=job.unit)
                if err is None and got != size:
                    err = DecodeError(f"zstd: decoded {got} bytes, expected {size}", uri=job.meta.uri, path=job.key, chunk=job.unit)
                if err is not None:
                    if u.kind == "blosc":
                        err = DecodeError(f"blosc: a stream: {err.reason}", uri=job.meta.uri, path=job.key, chunk=job.unit)
                    u.error = err
                    _fail(errors, plan, samples_of((job,)), err)
        self._unshuffle([u for u in units if u.shuffle is not None and u.error is None], arena, keep)
        self.stats.add("decode", time.perf_counter() - t0, count=len(units), bytes_in=sum(u.encoded for u in units))

    def _unshuffle(self, units: list[_Unit], arena: DeviceBuffer, keep: list) -> None:
        """One launch per (typesize, shuffle) of the batch's Blosc chunks: scratch -> unit."""
        groups: dict[tuple[int, str], list[tuple[int, int, int]]] = {}
        for u in units:
            typesize, mode, blocks = u.shuffle
            for start, size in blocks:
                groups.setdefault((typesize, mode), []).append((arena.ptr + u.scratch + start, arena.ptr + u.offset + start, size))
        for (typesize, mode), blocks in groups.items():
            host = [np.array([b[k] for b in blocks], dtype=np.uint64 if k < 2 else np.int64) for k in range(3)]
            addrs = self._tables(host, keep)
            self.device.launch(
                "unshuffle", len(blocks), BLOCK,
                (np.uint64(addrs[0]), np.uint64(addrs[1]), np.uint64(addrs[2]), np.int64(len(blocks)), np.int64(typesize),
                 np.int32(SHUFFLE_MODES[mode])),
            )

    def _tables(self, host: list[np.ndarray], keep: list) -> list[int]:
        """Host arrays copied into one device buffer; their device addresses."""
        buf = self.device.alloc(sum(_aligned(h.nbytes) for h in host))
        keep.append(buf)
        addrs, at = [], 0
        for h in host:
            h = np.ascontiguousarray(h)
            self.device.upload(h, buf.ptr + at)
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
            out_ptr = np.array([self.device.output_pointer(views[s]) for s, _ in members], dtype=np.uint64)
            order = np.arange(len(members), dtype=np.int64)
            addrs = self._tables([order, values, out_ptr], keep)
            swap = int(not src_dtype.isnative and src_dtype.itemsize > 1)
            self.device.launch(
                "fill", len(members), BLOCK,
                (np.uint64(addrs[0]), np.int64(len(members)), np.uint64(addrs[1]), np.int32(CODES[src_dtype.newbyteorder("=")]),
                 np.int32(swap), np.uint64(addrs[2]), np.int64(len(members)), np.int64(count),
                 np.int32(CODES[views[members[0][0]].dtype])),
            )

    def _assemble(self, plan: BatchPlan, units: list[_Unit], arena: DeviceBuffer, views: list, keep: list) -> None:
        """One launch per array: the copy table's rows of the units that decoded."""
        t0 = time.perf_counter()
        by_table: dict[int, list[_Unit]] = {}
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
            out_ptr = np.array([self.device.output_pointer(v) if v is not None else 0 for v in views], dtype=np.uint64)
            # per sample its view's shape and strides (a sample without a view: zeros, no rows)
            out_shape = np.zeros((len(views), table.ndim), dtype=np.int64)
            out_strides = np.zeros((len(views), table.ndim), dtype=np.int64)
            for k, v in enumerate(views):
                if v is not None and v.ndim == table.ndim:
                    out_shape[k] = v.shape
                    out_strides[k] = [st // v.itemsize for st in v.strides]
            meta = group[0].job.meta
            stored = _device_dtype(meta)
            if stored is None:  # decoded on the host, every unit in native order
                stored = group[0].copies[0][0].dtype
            src_code = CODES[stored.newbyteorder("=")]
            swap = int(not stored.isnative and stored.itemsize > 1)
            pool = table.pool if len(table.pool) else np.zeros(1, dtype=np.int64)
            unit_shape = np.array(meta.layout.leaf.spec.shape, dtype=np.int64)
            host = [np.ascontiguousarray(rows, dtype=np.int64), np.ascontiguousarray(pool, dtype=np.int64), unit_ptr, unit_shape, out_ptr, out_shape, out_strides]
            addrs = self._tables(host, keep)
            self.device.launch(
                "assemble", len(rows), BLOCK,
                (np.uint64(addrs[0]), np.int64(len(rows)), np.int32(table.ndim), np.uint64(addrs[1]), np.int64(len(pool)),
                 np.uint64(addrs[2]), np.int64(len(unit_ptr)), np.uint64(addrs[3]), np.int32(src_code), np.int32(swap),
                 np.uint64(addrs[4]), np.int64(len(views)), np.uint64(addrs[5]), np.uint64(addrs[6]), np.int32(CODES[first.dtype])),
            )
            written += int(np.prod(rows[:, 2 + 2 * table.ndim :], axis=1).sum()) * first.itemsize
        self.stats.add("assemble", time.perf_counter() - t0, count=len(units), bytes_out=written)


def _syncs(targets: Sequence[Any]) -> list:
    """The distinct slot syncs of device-array targets."""
    seen: dict[int, Any] = {}
    for t in targets:
        if isinstance(t, DeviceArray):
            seen.setdefault(id(t.sync), t.sync)
    return list(seen.values())


def _device_dtype(meta) -> np.dtype | None:
    """The dtype a unit's bytes hold when the device can take them as stored (a ``bytes``
    codec and a dtype the kernels know, no array-to-array codec), else None."""
    from damacy_server.zarr.codecs.bytes import BytesCodec

    leaf = meta.layout.leaf
    if leaf.a2a or not isinstance(leaf.a2b, BytesCodec):
        return None
    stored = leaf.a2b.stored_dtype(meta.dtype)
    return stored if stored.newbyteorder("=") in CODES else None


def _crash(errors: dict[int, SampleError], plan: BatchPlan, e: BaseException) -> None:
    err = SampleError(f"internal error: {type(e).__name__}: {e}")
    err.__cause__ = e
    _fail(errors, plan, range(len(plan.samples)), err)


def _fail(errors: dict[int, SampleError], plan: BatchPlan, samples, err: SampleError) -> None:
    for s in samples:
        if s not in errors:
            errors[s] = for_sample(err, plan.samples[s])
