"""``damacy.read``: one call, one selection of one array, as a numpy array.

The tool for looking at data and the oracle of damacy's own tests. It goes through the same
planner and executor as the pipeline (a one-sample plan).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import numpy as np

from damacy_protocol.dtypes import canonical_dtype, numpy_dtype
from damacy_protocol.enums import BoundsPolicy
from damacy_protocol.errors import DamacyError, InvalidArgument
from damacy_protocol.limits import (
    UINT32_MAX,
    CpuLimits,
    PlanLimits,
    chunks_per_input_buffer_for,
    host_threads,
    usable_cpus,
)
from damacy_protocol.selection import READ, normalize
from damacy_server.cpu.executor import CpuExecutor
from damacy_server.plan.items import Selected
from damacy_server.plan.planner import Planner
from damacy_server.plan.resolve import Resolver, ZarrMetadata
from damacy_server.plan.selection import resolve, selection_shape
from damacy_server.store.file import FileReader
from damacy_server.zarr.metadata import ArrayMetadata

#: one read is one request: small merged reads, so its units decode on all decode threads
#: (a read is no pipeline batch: the seed API's per-batch caps do not apply, see Planner)
READ_LIMITS = PlanLimits(max_chunk_bytes=UINT32_MAX, max_read_bytes=256 << 10)

_lock = threading.Lock()
_metadata: Resolver | None = None
_executor: CpuExecutor | None = None
_resolvers: weakref.WeakKeyDictionary[ZarrMetadata, Resolver] = weakref.WeakKeyDictionary()


def default_metadata() -> Resolver:
    """The process-wide metadata and shard-index cache used by :func:`read`."""
    global _metadata
    with _lock:
        if _metadata is None:
            _metadata = Resolver()
        return _metadata


def _resolver(metadata: ZarrMetadata | Resolver | None) -> Resolver:
    """The caches a read uses: the process's, or those kept for a caller's ZarrMetadata
    (one set per ZarrMetadata, as long as it lives)."""
    if metadata is None:
        return default_metadata()
    if isinstance(metadata, Resolver):
        return metadata
    if not isinstance(metadata, ZarrMetadata):
        raise TypeError(f"metadata must be a ZarrMetadata, got {type(metadata).__name__}")
    with _lock:
        found = _resolvers.get(metadata)
        if found is None:
            found = _resolvers[metadata] = metadata.resolver(recheckable=True)
        return found


def _read_limits() -> CpuLimits:
    workers, _ = host_threads()
    return CpuLimits(max_memory_bytes=2 << 30, decode_workers=workers, chunks_per_input_buffer=chunks_per_input_buffer_for(workers))


def _default_executor() -> CpuExecutor:
    """The process-wide executor of :func:`read` (threads start on the first read)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = CpuExecutor(reader=FileReader(workers=max(4, usable_cpus())), limits=_read_limits())
        return _executor


def read(
    uri: str,
    selection: Any = None,
    dtype: Any = None,
    *,
    out_of_bounds: BoundsPolicy | str = BoundsPolicy.ERROR,
    metadata: ZarrMetadata | None = None,
    level: int | None = None,
    scale: Any = None,
) -> np.ndarray:
    """Read ``selection`` of the Zarr array (v3 or v2) at ``uri``: a local path, ``file://``,
    or an object store (``s3://``, ``gs://``, ``az://``, ``http(s)://``; credentials from the
    environment, or ``metadata=ZarrMetadata(reader=..., cache=..., remote=RemoteStores(options))``).

    ``selection``: ``None`` (everything) or, per axis in a tuple (``np.s_[...]``), a range
    (``a:b``, ``(a, b)``, ``a:b:step``), an integer (drops the axis), an index list or a
    boolean mask (orthogonal indexing, order and duplicates kept), and ``...``: the same
    meaning as in a :class:`Sample` and an :class:`IndexQuery` (numbers are array
    coordinates; a negative one is before the array, not counted from the end).
    ``out_of_bounds``: positions outside the array are refused (``"error"``) or read as
    the fill value (``"pad"``). ``dtype``: the output dtype ("f32", "bf16", "u16", numpy
    dtypes...; default: the array's own). Errors are :class:`damacy.DamacyError`
    subclasses naming the uri and, for data errors, the file and chunk.

    An NGFF image reads its level 0, or level ``level``, or the level whose voxel size is
    closest to ``scale`` (see :meth:`Image.level_for`); the selection is in that level's
    index space.

    A read is a one-sample batch plan through the same planner and executor as a pipeline.
    With ``metadata`` that has a reader of its own, the data is read through that reader too
    (its rules, roots included).
    """
    md = _resolver(metadata)
    if level is not None and scale is not None:
        raise InvalidArgument("give level or scale, not both", uri=str(uri))
    if level is not None and (not isinstance(level, int) or isinstance(level, bool) or level < 0):
        raise InvalidArgument(f"level must be a non-negative integer (an NGFF image's level), got {level!r}", uri=str(uri))
    now = time.monotonic()  # a read sees what was written before it began
    if scale is not None:
        md.recheck([(str(uri), 0)], now)  # the image, then the level its scales pick
        level = md.image(uri).level_for(scale)
    md.recheck([(str(uri), level)], now)
    meta = md.array(uri, level=level)
    if level is not None:
        uri = meta.uri  # the level's own array, read as any array
    if out_of_bounds not in tuple(BoundsPolicy):
        raise InvalidArgument(f"out_of_bounds is 'pad' or 'error', got {out_of_bounds!r}", uri=str(uri))
    out_of_bounds = BoundsPolicy(out_of_bounds)
    axes, drop = resolve(normalize(selection, READ, str(uri)), meta.shape, out_of_bounds, str(uri))
    shape, out_dtype = selection_shape(axes), numpy_dtype(canonical_dtype(dtype), meta.dtype)
    try:
        out = np.empty(shape, dtype=out_dtype)
    except (ValueError, MemoryError) as e:  # more than numpy may (or the machine can) hold
        raise InvalidArgument(f"the selection's shape {shape} of {out_dtype.name} is too large to read into memory at once ({e})", uri=str(uri)) from None
    executor = _default_executor() if md.reader is None else CpuExecutor(reader=_StoreReads(md.reader), limits=_read_limits())
    finished = threading.Event()
    errors: dict[int, DamacyError] = {}

    def done(failed: dict[int, DamacyError]) -> None:
        errors.update(failed)
        finished.set()

    try:
        plan = Planner(md, READ_LIMITS, batch_limits=False).plan(
            [Selected(str(uri), axes)], out.shape, out_of_bounds, capacity=executor.inflight_capacity, cache=executor.chunk_cache
        )
        errors.update(plan.errors)
        if not errors:
            executor.execute(plan, [out], done)
            finished.wait()
    finally:
        if executor is not _executor:
            executor.close()
    if errors:
        raise _named_by_uri(errors[0])
    if drop:
        out = out.reshape([n for axis, n in enumerate(out.shape) if axis not in drop])
    return out


class _StoreReads(FileReader):
    """An executor's reader over a caller's store: every read goes through the store (no
    direct reads by the decode threads)."""

    direct = None  # type: ignore[assignment]

    def __init__(self, store: Any) -> None:
        super().__init__(workers=4)
        self.store = store

    def read(self, key: str) -> bytes | None:
        return self.store.read(key)

    def read_range(self, key: str, offset: int, length: int) -> bytes | None:
        return self.store.read_range(key, offset, length)

    def read_ranges(self, key: str, ranges: Any) -> list[bytes] | None:
        return self.store.read_ranges(key, ranges)


def _named_by_uri(err: DamacyError) -> DamacyError:
    """A read's error names the array (it has no sample of the caller's to name)."""
    err.sample = None
    err.args = (err._message(),)
    return err


def open_array(uri: str, *, metadata: ZarrMetadata | None = None) -> ArrayMetadata:
    """The parsed metadata of the array at ``uri`` (shape, dtype, chunks, codecs...)."""
    return _resolver(metadata).array(uri)


def open_image(uri: str, *, metadata: ZarrMetadata | None = None):
    """The OME-NGFF image at ``uri`` (0.4 on Zarr v2, 0.5 on Zarr v3): its axes (names, types,
    units) and its levels (path, uri, shape, dtype, scale and translation per axis); read a
    level with ``damacy.read(uri, selection, level=k)`` or ``scale=...``."""
    return _resolver(metadata).image(uri)


def open_plate(uri: str, *, metadata: ZarrMetadata | None = None):
    """The OME-NGFF plate at ``uri`` (0.4 or 0.5): rows, columns and wells, each well's fields
    (NGFF images) as uris; ``plate.images`` lists them all. Reads the plate's and the wells'
    metadata only: the images are opened when read (a sampler over a plate's fields reads an
    image's metadata when it first draws it)."""
    return _resolver(metadata).plate(uri)
