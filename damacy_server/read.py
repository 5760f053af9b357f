"""``damacy.read``: one call, one selection of one array, as a numpy array.

The tool for looking at data and the oracle of damacy's own tests. It goes through the same
resolve (metadata, shard indexes), store and decode code as the pipeline.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from damacy_protocol.dtypes import canonical_dtype, numpy_dtype
from damacy_protocol.errors import SampleError
from damacy_server.decode import cast_fill, check_length, decode_unit
from damacy_server.resolve import ZarrMetadata
from damacy_server.selection import iter_parts, parse_read_selection, selection_shape
from damacy_server.zarr.metadata import ArrayMetadata

_lock = threading.Lock()
_metadata: ZarrMetadata | None = None
_pool: ThreadPoolExecutor | None = None


def default_metadata() -> ZarrMetadata:
    """The process-wide metadata and shard-index cache used by :func:`read`."""
    global _metadata
    with _lock:
        if _metadata is None:
            _metadata = ZarrMetadata()
        return _metadata


def _thread_pool() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=min(32, 2 * (os.cpu_count() or 1)), thread_name_prefix="damacy-read")
        return _pool


def read(uri: str, selection: Any = None, dtype: Any = None, *, metadata: ZarrMetadata | None = None) -> np.ndarray:
    """Read ``selection`` of the Zarr v3 array at ``uri``.

    ``selection``: ``None`` (everything) or, per axis, a slice (numpy semantics, but bounds
    past the array are refused, not clipped), a ``(start, stop)`` box edge, an integer (drops
    the axis) or an index list / boolean mask (orthogonal indexing, order and duplicates
    kept); ``np.s_[...]`` works. ``dtype``: the output dtype ("f32", "bf16", "u16",
    numpy dtypes...; default: the array's own). Errors are :class:`damacy.SampleError`
    subclasses naming the uri and, for data errors, the file and chunk.
    """
    md = metadata if metadata is not None else default_metadata()
    meta = md.array(uri)
    axes, drop = parse_read_selection(selection, meta.shape, str(uri))
    out_dtype = numpy_dtype(canonical_dtype(dtype), meta.dtype)
    out = np.empty(selection_shape(axes), dtype=out_dtype)
    parts = list(iter_parts(axes, meta.shape, meta.layout.unit_shape))
    if parts:
        units = np.array([p[0] for p in parts], dtype=np.int64).reshape(len(parts), meta.ndim)
        locs = md.locate(meta, units)
        locs.raise_first()

        def work(i: int) -> None:
            unit, op = parts[i]
            key = locs.keys[i]
            data = None
            if not locs.missing[i]:
                offset, nbytes = int(locs.offsets[i]), int(locs.nbytes[i])
                data = meta.store.read(key) if nbytes < 0 else meta.store.read_range(key, offset, nbytes)
            if data is None:
                op.fill(out, cast_fill(meta.fill_value, out.dtype))
                return
            check_length(meta, data, nbytes, unit, key)
            chunk = decode_unit(meta, data, unit, key)
            with np.errstate(invalid="ignore", over="ignore"):
                op.apply(out, chunk)

        try:
            if len(parts) == 1:
                work(0)
            else:
                for f in [_thread_pool().submit(work, i) for i in range(len(parts))]:
                    f.result()
        except SampleError as e:
            raise e.with_context(uri=str(uri))
    if drop:
        out = out.reshape([n for axis, n in enumerate(out.shape) if axis not in drop])
    return out


def open_array(uri: str, *, metadata: ZarrMetadata | None = None) -> ArrayMetadata:
    """The parsed metadata of the array at ``uri`` (shape, dtype, chunks, codecs...)."""
    return (metadata if metadata is not None else default_metadata()).array(uri)
