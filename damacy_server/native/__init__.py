"""The native decode-and-assemble path: a whole decode task in one call without the GIL.

Read units whose chain is ``bytes`` (either byte order) optionally followed by ``zstd`` or
``blosc``, copied as boxes into a batch with a cast numpy would make the same way, are decoded
and copied by ``_assemble.run`` (C), so decode threads do not queue for the GIL between
units. Only what the boxes read is decoded: zstd up to the block holding the last element
used (frames with a checksum whole), blosc only the blocks holding used elements. Everything
else goes through the Python path; the values are identical (the tests compare both). What is
not decoded is not checked: a chunk corrupt only past what its boxes read is read where the
Python path (or a unit decoded whole for the chunk cache) reports it corrupt; a checksum,
where the frame has one, is always verified.

(Over 400 lines: one job, the Python face of the one native module: what each of its entry
points takes and gives, beside the numpy forms they are held to.)
"""

from __future__ import annotations

import enum
import functools
import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from damacy_runtime.extensions import optional

_assemble = optional("damacy_server.native._assemble")  # None: built without a C compiler

#: ``open_checked(path, flags, roots) -> (fd, error code, size)``: a file opened under the
#: file store's confinement rule, in C (see :mod:`damacy_server.store.file`); None: not built
open_checked = _assemble.open_checked if _assemble is not None else None

#: dtype codes of the extension (native.h)
_CODES = {
    np.dtype("bool"): 0,
    np.dtype("int8"): 1,
    np.dtype("uint8"): 2,
    np.dtype("int16"): 3,
    np.dtype("uint16"): 4,
    np.dtype("int32"): 5,
    np.dtype("uint32"): 6,
    np.dtype("int64"): 7,
    np.dtype("uint64"): 8,
    np.dtype("float16"): 9,
    np.dtype("float32"): 10,
    np.dtype("float64"): 11,
}
CODEC_RAW, CODEC_ZSTD, CODEC_BLOSC = 0, 1, 2
MAX_NDIM = 8


@dataclass(frozen=True)
class OpTable:
    """The copies a native call makes (built from a plan's copy table by
    :func:`damacy_server.cpu.optable.build`): rows as in the plan's table, but for the unit
    number in the first column, counted from ``base``."""

    ops: np.ndarray  # int64 (n_ops, 2 + 3 * ndim)
    ndim: int
    pool: np.ndarray  # int64: the index lists the rows point to
    base: int  # the unit number of the first unit (units are numbered base, base + 1, ...)
    spans: np.ndarray  # int64 (n_units, 2): each unit's offset in its object and length (-1: whole)


class Status(enum.IntEnum):
    """Why native code could not decode a unit (the status codes of native.h)."""

    ZSTD = 1  # libzstd refused the frame (detail: its error name)
    SIZE = 2  # the unit decoded to the wrong size (detail: the bytes it gave)
    NO_CODEC = 3  # the codec library could not be loaded
    BLOSC = 4  # a corrupt or truncated blosc frame (detail: blosc's return code)
    OPS = 5  # a copy reaches outside its unit or its sample (a planning error)
    MEMORY = 6  # no memory for the decode buffer


class Failure(NamedTuple):
    """A unit native code could not decode: its index in the task, why, and the detail."""

    unit: int
    status: Status
    detail: str | int | None

    def describe(self, decoded_nbytes: int) -> str:
        status, detail = Status(self.status), self.detail
        if status is Status.ZSTD:
            return f"zstd: {detail}"
        if status is Status.SIZE:
            return f"decoded chunk has {detail} bytes, expected {decoded_nbytes}"
        if status is Status.BLOSC:
            return "blosc: corrupt or truncated frame"
        if status is Status.OPS:
            return "a copy reaches outside its chunk or its sample (planning error)"
        if status is Status.MEMORY:
            return "out of memory for the decode buffer"
        return "the codec library is not available"


def _failures(raw: list[tuple[int, int, str | int | None]]) -> list[Failure]:
    return [Failure(u, Status(code), detail) for u, code, detail in raw]


def available() -> bool:
    return _assemble is not None


def cache_index(max_entries: int | None, max_bytes: int | None, adaptive: bool, rules: tuple[int, ...]) -> Any:
    """A native cache index (``CacheIndex``, cache.c) with these bounds (None: none), adaptive
    admission or not and its ``rules`` (:data:`damacy_server.cache.INDEX_RULES`), for an
    :class:`~damacy_server.cache.IndexedCache`; None without the native module."""
    if _assemble is None:
        return None
    bounds = (-1 if max_entries is None else max_entries, -1 if max_bytes is None else max_bytes)
    return _assemble.CacheIndex(*bounds, adaptive, rules)


def _blosc_available() -> bool:
    """C-Blosc as numcodecs ships it (blosc_getitem decodes only the blocks a copy needs)."""
    try:
        from numcodecs import blosc
    except ImportError:
        return False
    return bool(_assemble.use_blosc(blosc.__file__))


def dtype_code(dtype: np.dtype) -> int | None:
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        return 12
    return _CODES.get(dtype.newbyteorder("="))


@dataclass(frozen=True)
class NativeKernel:
    """How the native path handles units of one array into one output dtype."""

    codec: int
    src: int
    dst: int
    swap: bool
    unit_shape: np.ndarray  # int64
    decoded_nbytes: int
    stored: np.dtype  # of a decoded unit (a chunk cache entry)

    @functools.cached_property
    def unit_dims(self) -> tuple[int, ...]:
        """``unit_shape`` as a tuple (what native code checks cached units' shapes against)."""
        return tuple(self.unit_shape.tolist())

    @functools.cached_property
    def buffer_format(self) -> str | None:
        """The buffer format string of a decoded unit's array (``stored``), as its buffer
        reports it; None for a dtype without one (bfloat16: numpy exports no buffer of it)."""
        try:
            return memoryview(np.empty(0, dtype=self.stored)).format
        except (TypeError, ValueError):
            return None


def kernel_for(meta, out_dtype: np.dtype, normalized: bool = False) -> NativeKernel | None:
    """The native kernel for units of ``meta`` cast to ``out_dtype``, or None (Python path).
    ``normalized``: every target normalises, so the normalising conversion suffices (it
    covers pairs the plain one leaves to numpy, such as f64 to bf16)."""
    if _assemble is None:
        return None
    leaf = meta.layout.leaf  # codecs are told apart by name, as zarr.json names them
    if leaf.a2a or leaf.a2b.name != "bytes" or meta.ndim > MAX_NDIM:
        return None
    names = tuple(c.name for c in leaf.b2b)
    if names == ():
        codec = CODEC_RAW
    elif names == ("zstd",) and _assemble.has_zstd():
        codec = CODEC_ZSTD
    elif names == ("blosc",) and _blosc_available():
        codec = CODEC_BLOSC
    else:
        return None
    stored = leaf.a2b.stored_dtype(meta.dtype)
    src, dst = dtype_code(stored), dtype_code(out_dtype)
    if src is None or dst is None or not (_assemble.supports(src, dst) or (normalized and _assemble.supports(src, dst, True))):
        return None
    native_order = "<" if sys.byteorder == "little" else ">"
    swap = stored.itemsize > 1 and stored.byteorder not in ("=", "|", native_order)
    return NativeKernel(codec, src, dst, swap, np.asarray(leaf.spec.shape, dtype=np.int64), leaf.spec.nbytes, stored)


def targets(views: list, ndim: int, norms=()) -> np.ndarray:
    """Per sample the destination's address, strides (elements) and shape, for ops of rank
    ``ndim``, then its normalisation: a flag and the f64 bits of offset and scale
    (``norms[sample]``, None: none). Samples of another rank, or without a view, get a zero
    row, which native code refuses to write to."""
    out = np.zeros((len(views), 4 + 2 * ndim), dtype=np.int64)
    for s, view in enumerate(views):
        if view is not None and view.ndim == ndim:
            out[s, 0] = view.__array_interface__["data"][0]
            out[s, 1 : 1 + ndim] = [st // view.itemsize for st in view.strides]
            out[s, 1 + ndim : 1 + 2 * ndim] = view.shape
            norm = norms[s] if norms else None
            if norm is not None:
                out[s, 1 + 2 * ndim] = 1
                out[s, 2 + 2 * ndim :] = np.array(norm, dtype=np.float64).view(np.int64)
    return out


#: the largest read :func:`run_file` makes (larger reads go through the reader's threads)
RUN_FILE_MAX = _assemble.RUN_FILE_MAX if _assemble is not None else 0
#: a flag of ``open_checked`` (and the direct reads): advise the kernel of random access
NO_READAHEAD = 1 << 30


_NO_KEEP = np.zeros(0, dtype=np.int64)


def _task(kernel: NativeKernel, table: OpTable, targets: np.ndarray, keep: np.ndarray | None = None) -> tuple:
    return (
        table.spans,
        table.ops,
        table.base,
        targets,
        kernel.unit_shape,
        kernel.src,
        kernel.dst,
        int(kernel.swap),
        kernel.codec,
        kernel.decoded_nbytes,
        table.pool,
        _NO_KEEP if keep is None else keep,
    )


def run_file(
    kernel: NativeKernel,
    where: tuple[str, int, bytes | None],
    offset: int,
    length: int,
    table: OpTable,
    targets: np.ndarray,
    keep: np.ndarray | None = None,
    sparse: bool = False,
) -> tuple[int, list[Failure] | None, int, int, int, int]:
    """As :func:`run`, reading ``length`` bytes at ``offset`` (-1: the whole file) of the file
    ``where`` = (path, open flags, roots) from :meth:`FileStore.direct` first, in the same
    call, only if the page cache holds them, opened by the same rule as ``FileStore.open``.
    ``sparse``: read only the units' spans in that range (each run of adjacent ones in one
    read), not the holes between them.
    Returns (code, failures, read_ns, nbytes, encoded, elements): code 0 when done, else -1
    (not cached, short, not a regular file, or the file system cannot read without
    waiting), -2 (larger than RUN_FILE_MAX), -3 (outside the roots) or an errno from open;
    then nothing was copied and the caller reads the ordinary way."""
    path, flags, roots = where
    code, failures, read_ns, nbytes, encoded, elements = _assemble.run_file(path, flags, roots, offset, length, sparse, *_task(kernel, table, targets, keep))
    return code, None if failures is None else _failures(failures), read_ns, nbytes, encoded, elements


class FileJobResults(NamedTuple):
    """What a :func:`file_job`'s reads did, per read (lists of ints): run_file's code (or
    :data:`NOT_RUN`), the ns spent reading, the bytes read, the bytes decoded, the elements
    written and the ns of the whole read; and the units that failed, numbered over the job."""

    codes: list[int]
    read_ns: list[int]
    nread: list[int]
    encoded: list[int]
    elements: list[int]
    ns: list[int]
    failures: list[Failure]


#: a job's read that was not made (its batch was cancelled: ``work(skip=True)``)
NOT_RUN = 1


def file_job(
    kernel: NativeKernel,
    where: tuple[int, bytes | None],
    paths: tuple[bytes, ...],
    offsets: np.ndarray,
    lengths: np.ndarray,
    sparse: np.ndarray,
    bounds: np.ndarray,
    table: OpTable,
    targets: np.ndarray,
    keep: np.ndarray | None = None,
):
    """A job of reads of one store's files, made as :func:`run_file` makes one, each by
    whichever thread calling its ``work(skip=False, most=-1)`` takes it next, without the GIL
    between the reads: ``paths`` (file system encoded) with ``where`` = (open flags, roots) of
    their store, per read its offset, length (-1: the whole file) and sparse flag (uint8),
    ``bounds`` (n_reads + 1): read r holds units ``bounds[r]:bounds[r + 1]`` of ``table`` (the
    job's units, in read order) and of ``keep``. ``work`` returns (last, more): whether that
    call completed the job's last read (then :func:`file_job_results`), and whether reads are
    left to take. The caller keeps ``targets``' memory alive until the job is done."""
    flags, roots = where
    return _assemble.file_job(
        paths, flags, roots, np.ascontiguousarray(offsets, dtype=np.int64), np.ascontiguousarray(lengths, dtype=np.int64),
        np.ascontiguousarray(sparse, dtype=np.uint8), np.ascontiguousarray(bounds, dtype=np.int64),
        *_task(kernel, table, targets, keep),
    )


def file_job_results(job) -> FileJobResults:
    """The results of a :func:`file_job` whose reads are all completed."""
    raw, failures = job.results()
    cols = np.frombuffer(raw, dtype=np.int64).reshape(-1, 6).T.tolist()
    return FileJobResults(*cols, _failures(failures))


def run(
    kernel: NativeKernel, data, offset: int, table: OpTable, targets: np.ndarray, keep: np.ndarray | None = None
) -> tuple[list[Failure], int, int]:
    """Decode the units of ``table`` from ``data`` (bytes read from ``offset`` of their
    object) and make every copy into ``targets`` (from :func:`targets`). Returns (failures,
    encoded, elements): the units that could not be decoded (their copies are not made),
    and the bytes decoded and elements written for the rest.

    ``keep`` (from :func:`keep_buffers`), when given, names per unit a buffer the unit is
    decoded into whole (for the chunk cache); the copies are then made from it."""
    failures, encoded, elements = _assemble.run(data, offset, *_task(kernel, table, targets, keep))
    return _failures(failures), encoded, elements


def keep_buffers(kernel: NativeKernel, count: int) -> tuple[list[np.ndarray], np.ndarray]:
    """``count`` fresh arrays of one decoded unit (the stored dtype, unit shape) and their
    addresses, the ``keep`` argument of :func:`run` and :func:`run_file`."""
    arrays = [np.empty(kernel.unit_dims, dtype=kernel.stored) for _ in range(count)]
    return arrays, np.frombuffer(_assemble.addresses(arrays, kernel.decoded_nbytes), dtype=np.int64)


def decoded_sources(kernel: NativeKernel, arrays: list[np.ndarray]) -> np.ndarray | None:
    """The addresses of ``arrays`` when native code can copy from each as a decoded unit of
    ``kernel`` (C order, the stored dtype, the unit's shape), else None."""
    fmt = kernel.buffer_format
    if fmt is None:
        return None
    sources = np.frombuffer(_assemble.addresses(arrays, kernel.decoded_nbytes, fmt, kernel.unit_dims), dtype=np.int64)
    return sources if sources.all() else None


def run_decoded(kernel: NativeKernel, sources: np.ndarray, table: OpTable, targets: np.ndarray) -> tuple[list[Failure], int, int]:
    """As :func:`run` for units already decoded: ``sources`` holds each unit's address (from
    :func:`decoded_sources`; the caller keeps the arrays alive through the call)."""
    failures, encoded, elements = _assemble.run_decoded(sources, *_task(kernel, table, targets))
    return _failures(failures), encoded, elements


# -- the planner's array passes (plan.c) ----------------------------------------------------


def box_rows(boxes: np.ndarray, shape: tuple[int, ...], unit_shape: tuple[int, ...]) -> np.ndarray | None:
    """The copy rows of ``boxes`` as :func:`damacy_server.plan.rows.box_rows_numpy` makes
    them, in one pass; None without the native module, or for a 0-d array or one of more than
    :data:`MAX_NDIM` axes (numpy's form takes any)."""
    if _assemble is None or not 0 < len(shape) <= MAX_NDIM:
        return None
    out = _assemble.box_rows(
        np.ascontiguousarray(boxes, dtype=np.int64), np.asarray(shape, dtype=np.int64), np.asarray(unit_shape, dtype=np.int64)
    )
    return np.frombuffer(out, dtype=np.int64).reshape(-1, 1 + 4 * len(shape))


def unique_units(rows: np.ndarray, column: int, grid: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray] | None:
    """The distinct units (C order) whose coordinates are columns ``column`` on of ``rows``
    (in a grid of ``grid`` units, fewer than 2**62), and each row's index in them, as
    ``np.unique`` gives them; None without the native module, or for a grid of more than
    :data:`MAX_NDIM` axes."""
    if _assemble is None or not 0 < len(grid) <= MAX_NDIM:
        return None
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    units, inverse = _assemble.unique_units(rows, rows.shape[1], column, np.asarray(grid, dtype=np.int64))
    return np.frombuffer(units, dtype=np.int64).reshape(-1, len(grid)), np.frombuffer(inverse, dtype=np.int64)


def merge_reads(
    owners: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray, gap: int, most: int, most_units: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """A table's units grouped into reads as :func:`damacy_server.plan.reads.merge_reads_numpy`
    groups them (per read its first unit, then the count; per read the end of its bytes, -1
    for a whole object), in one pass; None without the native module."""
    if _assemble is None:
        return None
    as_i64 = lambda a: np.ascontiguousarray(a, dtype=np.int64)  # noqa: E731
    starts, ends = _assemble.merge_reads(as_i64(owners), as_i64(offsets), as_i64(nbytes), gap, most, most_units)
    return np.frombuffer(starts, dtype=np.int64), np.frombuffer(ends, dtype=np.int64)


def plan_table(
    rows: np.ndarray, ndim: int, inverse: np.ndarray, hit: np.ndarray | None, dropped: np.ndarray | None,
    missing: np.ndarray, owners: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int] | None:
    """One array's copy table as :func:`damacy_server.plan.rows.plan_table_numpy` makes it
    (order, table rows, spans, bounds, fill samples, cached units), in one pass; None without
    the native module, or for an array of more than :data:`MAX_NDIM` axes (numpy's form
    takes any)."""
    if _assemble is None or ndim > MAX_NDIM:
        return None
    empty = b""
    order, table, spans, bounds, fills, n_hit = _assemble.plan_table(
        np.ascontiguousarray(rows, dtype=np.int64), ndim, np.ascontiguousarray(inverse, dtype=np.int64),
        empty if hit is None else np.ascontiguousarray(hit, dtype=np.bool_),
        empty if dropped is None else np.ascontiguousarray(dropped, dtype=np.bool_),
        np.ascontiguousarray(missing, dtype=np.bool_), np.ascontiguousarray(owners, dtype=np.int64),
        np.ascontiguousarray(offsets, dtype=np.int64), np.ascontiguousarray(nbytes, dtype=np.int64),
    )
    as_int = np.frombuffer
    return (
        as_int(order, dtype=np.int64), as_int(table, dtype=np.int64).reshape(-1, 2 + 3 * ndim),
        as_int(spans, dtype=np.int64).reshape(-1, 2), as_int(bounds, dtype=np.int64), as_int(fills, dtype=np.int64), n_hit,
    )
