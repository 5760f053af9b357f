"""The decode stage: the bytes of one read unit → its decoded array, errors named."""

from __future__ import annotations

import numpy as np

from damacy_protocol.errors import DecodeError
from damacy_server.decode import contract
from damacy_server.zarr.metadata import ArrayMetadata


def decode_unit(meta: ArrayMetadata, data, unit: tuple[int, ...], key: str) -> np.ndarray:
    """Decode the read unit ``unit`` of ``meta`` from ``data`` (read from ``key``).

    The result has the unit's full shape (edge units reach past the array's end) and may be
    a read-only view of ``data`` in the stored byte order. Any failure is a
    :class:`DecodeError` naming the array, the file and the chunk.
    """
    try:
        return meta.layout.leaf.decode(data)
    except Exception as e:  # every codec library has its own error types; all mean "corrupt"
        raise DecodeError(str(e) or type(e).__name__, uri=meta.uri, path=key, chunk=unit) from e


def cast_fill(value, dtype: np.dtype, norm: tuple[float, float] | None = None) -> np.ndarray:
    """A fill value (of the array's dtype) converted to the output dtype as any element is
    (:mod:`damacy_server.decode.contract`: NaN to an integer type is 0, not an exception), and
    normalised as the sample's elements are when ``norm`` = (offset, scale) is given."""
    if norm is not None:
        return contract.normalize(np.asarray(value), dtype, *norm)
    return contract.convert(np.asarray(value), dtype)


def check_length(meta: ArrayMetadata, data, expected: int, unit: tuple[int, ...], key: str) -> None:
    """A byte range read short means the object was cut off after its index was written."""
    if expected >= 0 and len(data) != expected:
        raise DecodeError(
            f"truncated data: expected {expected} bytes, the file has {len(data)} there",
            uri=meta.uri,
            path=key,
            chunk=unit,
        )
