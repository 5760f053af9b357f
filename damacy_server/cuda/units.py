"""A batch's units on their way to the device: read on the host, checked there (nvCOMP's
behaviour on corrupt input is undefined, so every zstd frame is walked first), and sorted by
how each reaches the arena: a zstd frame to decode there, a Blosc chunk split into streams
to decode and blocks to unshuffle, bytes stored as they are, or a unit decoded on the host
(codec chains the device does not decode). A unit that fails fails its samples here.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from damacy_protocol.enums import Stage
from damacy_protocol.errors import DamacyError, DecodeError
from damacy_server.cache import LRUCache
from damacy_server.cpu.run import for_sample, samples_of
from damacy_server.cuda import nvcomp
from damacy_server.cuda.twin import CODES
from damacy_server.decode.chunks import check_length, decode_unit
from damacy_server.engine.budget import StageStats
from damacy_server.plan.planner import BatchPlan
from damacy_server.plan.units import UnitJob
from damacy_server.store import is_remote
from damacy_server.store.file import FileReader
from damacy_server.zarr.codecs.base import CorruptData
from damacy_server.zarr.codecs.blosc import HEADER, parse_frame


class Unit:
    """One unit of a batch on its way to the arena: the zstd frames to decode there and the
    bytes to copy there, each at an offset of the unit's place (or of its scratch, for a
    Blosc chunk to unshuffle afterwards)."""

    __slots__ = ("job", "kind", "frames", "copies", "shuffle", "offset", "scratch", "error")

    def __init__(self, job: UnitJob, kind: str) -> None:
        self.job = job
        self.kind = kind  # "zstd", "blosc", "stored" (bytes as stored), "host" (decoded on the host)
        self.frames: list[tuple[memoryview, int, int, str]] = []  # (frame, offset, decoded bytes, "zstd" or "lz4")
        self.copies: list[tuple[Any, int]] = []  # (bytes or array, offset)
        self.shuffle: tuple[int, str, list[tuple[int, int]]] | None = None  # typesize, mode, blocks
        self.offset = 0  # of the decoded unit in the arena
        self.scratch = -1  # of its shuffled bytes, when it has some
        self.error: DamacyError | None = None

    @property
    def encoded(self) -> int:
        return sum(len(f) for f, _, _, _ in self.frames)


def read_units(
    reader: FileReader, plan: BatchPlan, errors: dict[int, DamacyError], stats: StageStats, *,
    max_streams: int | None = None, layouts: LRUCache | None = None,
) -> tuple[list[Unit], int]:
    """Every unit's bytes, read on the host and checked there; with how many units were
    decoded on the host (chains the device does not decode, Blosc chunks of more than
    ``max_streams`` compressed streams). ``layouts``: parsed Blosc headers by chunk, reused
    when a chunk is read again. Failed samples go to ``errors``."""
    t0 = time.perf_counter()
    out: list[Unit] = []
    decoded_here: list[int] = []
    nbytes = 0
    fetched = _fetch_remote(plan.groups)
    for k, group in enumerate(plan.groups):
        try:
            if k in fetched:
                data = fetched[k]
                if isinstance(data, DamacyError):
                    raise data
            else:
                data = reader.read(group.key) if group.length < 0 else reader.read_range(group.key, group.offset, group.length)
        except DamacyError as e:
            fail(errors, plan, samples_of(group.units), e.with_context(uri=group.units[0].meta.uri))
            continue
        nbytes += len(data) if data else 0
        view = memoryview(data) if data is not None else None
        for job in group.units:
            piece = None
            if view is not None:
                piece = view if group.length < 0 else view[job.offset - group.offset : job.offset - group.offset + job.nbytes]
            out.append(_classify(job, piece, errors, plan, decoded_here, max_streams, layouts))
    stats.add(Stage.READ, time.perf_counter() - t0, count=len(plan.groups), bytes_out=nbytes)
    return [u for u in out if u is not None], len(decoded_here)

def _fetch_remote(groups) -> dict[int, object]:
    """The bytes of the groups in object stores (by index in ``groups``), requested together
    per store rather than one round trip each."""
    by_store: dict[int, tuple[object, list[int]]] = {}
    for k, g in enumerate(groups):
        if is_remote(g.key):
            store = g.units[0].meta.store
            by_store.setdefault(id(store), (store, []))[1].append(k)
    out: dict[int, object] = {}
    for store, idx in by_store.values():
        got = store.fetch_many([(groups[k].key, groups[k].offset, groups[k].length) for k in idx])
        out.update(zip(idx, got))
    return out


def _classify(
    job: UnitJob, piece: memoryview | None, errors, plan, decoded_here: list[int], max_streams: int | None = None,
    layouts: LRUCache | None = None,
) -> Unit | None:
    """How a unit reaches the arena. Units of one array all come in one byte order: the
    stored one where the device decodes the chain, native where the host does."""
    meta = job.meta
    leaf = meta.layout.leaf
    stored = device_dtype(meta)
    nbytes = leaf.spec.nbytes
    try:
        if piece is None:  # never written: the fill value
            dtype = stored if stored is not None else meta.dtype.newbyteorder("=")
            unit = Unit(job, "stored" if stored is not None else "host")
            unit.copies.append((np.full(leaf.spec.shape, meta.fill_value, dtype=dtype), 0))
            return unit
        check_length(meta, piece, job.nbytes, job.unit, job.key)
        names = tuple(c.name for c in leaf.b2b)
        if stored is not None and names == ("zstd",) and nbytes <= nvcomp.MAX_CHUNK_BYTES:  # (larger: nvCOMP refuses it)
            nvcomp.walk_zstd_frame(piece, nbytes)
            unit = Unit(job, "zstd")
            unit.frames.append((piece, 0, nbytes, "zstd"))
            return unit
        if stored is not None and names == ():
            if len(piece) != nbytes:
                raise CorruptData(f"a stored chunk of {len(piece)} bytes, expected {nbytes}")
            unit = Unit(job, "stored")
            unit.copies.append((piece, 0))
            return unit
        if stored is not None and names == ("blosc",):
            unit = _blosc(job, piece, nbytes, max_streams, layouts)
            if unit is not None:
                return unit
        arr = decode_unit(meta, piece, job.unit, job.key)  # another chain: decoded here
        decoded_here.append(1)
        unit = Unit(job, "host")
        # in the array's one byte order (a missing unit of the array comes the same way)
        unit.copies.append((np.ascontiguousarray(arr, dtype=stored if stored is not None else arr.dtype.newbyteorder("=")), 0))
        return unit
    except CorruptData as e:
        err = DecodeError(str(e), uri=meta.uri, path=job.key, chunk=job.unit)
    except DamacyError as e:
        err = e
    fail(errors, plan, samples_of((job,)), err)
    return None

#: Blosc compressors whose streams nvCOMP decodes, and the host check of a stream of each
DEVICE_CODECS = {"zstd": nvcomp.walk_zstd_frame, "lz4": nvcomp.walk_lz4_block}


class _Layout:
    """A parsed Blosc header kept for a chunk, with what it was parsed from: the header and
    block table bytes and the positions of the streams' size words. A frame whose bytes
    there are the same has the same layout (the parse reads nothing else), so a chunk
    rewritten in place is parsed again, not split by a stale layout."""

    __slots__ = ("frame", "head", "size_at", "sizes")

    def __init__(self, frame: Any, piece: memoryview) -> None:
        self.frame = frame
        nblocks = -(-frame.nbytes // frame.blocksize) if frame.streams else 0
        self.head = bytes(piece[: HEADER.size + 4 * nblocks])
        self.size_at = np.array([s.offset - 4 for s in frame.streams], dtype=np.int64)
        self.sizes = np.array([s.size for s in frame.streams], dtype="<i4")

    def fits(self, piece: memoryview) -> bool:
        if len(piece) != self.frame.cbytes or piece[: len(self.head)] != self.head:
            return False
        if not len(self.size_at):
            return True
        raw = np.frombuffer(piece, dtype=np.uint8)
        words = raw[self.size_at[:, None] + np.arange(4)].copy().view("<i4").ravel()
        return bool(np.array_equal(words, self.sizes))


def _frame(job: UnitJob, piece: memoryview, layouts: LRUCache | None) -> Any:
    """The chunk's Blosc layout: from ``layouts`` when it was split before and its bytes
    still say so, else parsed (and kept)."""
    if layouts is None:
        return parse_frame(piece)
    meta = job.meta
    key = (meta.root, meta.generation, job.unit, job.offset, job.nbytes)
    kept = layouts.get(key)
    if kept is not None:
        if kept.fits(piece):
            return kept.frame
        layouts.hits, layouts.misses = layouts.hits - 1, layouts.misses + 1  # a stale one: parsed again
    frame = parse_frame(piece)
    layouts.put(key, _Layout(frame, piece))
    return frame


def _blosc(job: UnitJob, piece: memoryview, nbytes: int, max_streams: int | None = None, layouts: LRUCache | None = None) -> Unit | None:
    """A Blosc chunk split on the host: its zstd and LZ4 streams (lz4hc writes LZ4 too)
    decoded on the device with the batch's other frames, its stored streams copied, its
    blocks unshuffled by a kernel. None for compressors nvCOMP is not asked to decode here
    (blosclz, zlib, snappy) and for chunks of more than ``max_streams`` compressed streams:
    decoded on the host. Its parsed header comes from ``layouts`` when the chunk (the same
    bytes of the same array) was split before."""
    frame = _frame(job, piece, layouts)
    if frame.nbytes != nbytes:
        raise CorruptData(f"blosc: header says {frame.nbytes} decoded bytes, expected {nbytes}")
    unit = Unit(job, "blosc")
    if frame.memcpyed or frame.nbytes == 0:
        unit.copies.append((piece[HEADER.size : HEADER.size + frame.nbytes], 0))
        return unit
    if frame.compressor not in DEVICE_CODECS and any(not s.raw for s in frame.streams):
        return None
    if max_streams is not None and sum(1 for s in frame.streams if not s.raw) > max_streams:
        return None
    shuffled = frame.shuffle != "noshuffle" and not (frame.shuffle == "shuffle" and frame.typesize == 1)
    for s in frame.streams:
        at = s.block * frame.blocksize + s.out_offset  # in the unit's (or its scratch's) bytes
        data = piece[s.offset : s.offset + s.size]
        if s.raw:
            unit.copies.append((data, at))
        else:
            DEVICE_CODECS[frame.compressor](data, s.out_size)  # checked here: nvCOMP's behaviour on corrupt input is undefined
            unit.frames.append((data, at, s.out_size, frame.compressor))
    if shuffled:
        blocks = [(j * frame.blocksize, frame.block_size(j)) for j in range(-(-frame.nbytes // frame.blocksize))]
        unit.shuffle = (frame.typesize, frame.shuffle, blocks)
    return unit


def device_dtype(meta) -> np.dtype | None:
    """The dtype a unit's bytes hold when the device can take them as stored (a ``bytes``
    codec and a dtype the kernels know, no array-to-array codec), else None."""
    from damacy_server.zarr.codecs.bytes import BytesCodec

    leaf = meta.layout.leaf
    if leaf.a2a or not isinstance(leaf.a2b, BytesCodec):
        return None
    stored = leaf.a2b.stored_dtype(meta.dtype)
    return stored if stored.newbyteorder("=") in CODES else None


def crash(errors: dict[int, DamacyError], plan: BatchPlan, e: BaseException) -> None:
    err = DamacyError(f"internal error: {type(e).__name__}: {e}")
    err.__cause__ = e
    fail(errors, plan, range(len(plan.samples)), err)


def fail(errors: dict[int, DamacyError], plan: BatchPlan, samples, err: DamacyError) -> None:
    for s in samples:
        if s not in errors:
            errors[s] = for_sample(err, plan.samples[s])
