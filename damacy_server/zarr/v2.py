"""Zarr v2 arrays: ``.zarray`` (and ``.zattrs``) read as the equivalent Zarr v3 metadata.

A v2 chunk is the array's chunk in ``order`` (C, or F: a transpose), passed through the
``filters`` and then the ``compressor``, with the dtype's byte order. That is a v3 codec
chain: ``transpose`` (F only), the filters as array-to-array codecs, ``bytes`` with the
dtype's endianness, the compressor. Chunk keys are v3's ``v2`` encoding with the
``dimension_separator``. So one reader serves both formats, native decode path included
(v2 zstd and blosc chunks are the same frames as v3's).

Compressors: zstd, blosc (all cnames and shuffles), gzip, zlib, lz4, bz2; filters: delta,
fixedscaleoffset, astype. Anything else is refused naming it.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from damacy_protocol.errors import DtypeMismatch, MetadataError, UnsupportedOperation
from damacy_server.zarr.dtypes import SUPPORTED_DTYPES

#: v2 compressor id -> the v3 codec reading the same bytes
_COMPRESSORS = {"zstd": "zstd", "blosc": "blosc", "gzip": "gzip", "zlib": "numcodecs.zlib", "lz4": "numcodecs.lz4", "bz2": "numcodecs.bz2"}
_FILTERS = {"delta": "numcodecs.delta", "fixedscaleoffset": "numcodecs.fixedscaleoffset", "astype": "numcodecs.astype"}
_BLOSC_SHUFFLES = {0: "noshuffle", 1: "shuffle", 2: "bitshuffle", -1: "shuffle"}  # -1: auto (the frame says which)
_ZARRAY_KEYS = {"zarr_format", "shape", "chunks", "dtype", "compressor", "fill_value", "order", "filters", "dimension_separator"}


def as_v3(zarray: dict[str, Any], attributes: dict[str, Any], uri: str) -> dict[str, Any]:
    """The ``zarr.json`` document equivalent to a v2 ``.zarray`` (checked)."""
    if zarray.get("zarr_format") != 2:
        raise MetadataError(f".zarray: zarr_format must be 2, got {zarray.get('zarr_format')!r}", uri=uri)
    for key in ("shape", "chunks", "dtype", "compressor", "fill_value", "order"):
        if key not in zarray:
            raise MetadataError(f".zarray has no {key!r}", uri=uri)
    unknown = sorted(set(zarray) - _ZARRAY_KEYS)
    if unknown:
        raise UnsupportedOperation(f".zarray fields {unknown} are not understood", uri=uri)
    dtype, endian = _dtype(zarray["dtype"], uri)
    shape, chunks = zarray["shape"], zarray["chunks"]
    if not isinstance(shape, list) or not isinstance(chunks, list):
        raise MetadataError(".zarray: shape and chunks must be lists", uri=uri)
    order = zarray["order"]
    if order not in ("C", "F"):
        raise MetadataError(f".zarray: order must be 'C' or 'F', got {order!r}", uri=uri)
    separator = zarray.get("dimension_separator") or "."
    if separator not in (".", "/"):
        raise MetadataError(f".zarray: dimension_separator must be '.' or '/', got {separator!r}", uri=uri)
    codecs: list[dict[str, Any]] = []
    if order == "F" and len(shape) > 1:
        codecs.append({"name": "transpose", "configuration": {"order": list(range(len(shape)))[::-1]}})
    filters = zarray.get("filters")
    if filters is not None and not isinstance(filters, list):
        raise MetadataError(f".zarray: filters must be a list or null, got {filters!r}", uri=uri)
    for f in filters or []:
        codecs.append(_filter(f, uri))
    if filters:  # what is stored is the last filter's output, in its type's byte order
        endian = _stored_endian(filters[-1], endian, uri)
    codecs.append({"name": "bytes", "configuration": {"endian": endian}} if endian else {"name": "bytes"})
    if zarray["compressor"] is not None:
        codecs.append(_compressor(zarray["compressor"], dtype, uri))
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": shape,
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
        "chunk_key_encoding": {"name": "v2", "configuration": {"separator": separator}},
        "fill_value": _fill_value(zarray["fill_value"], np.dtype(dtype)),
        "codecs": codecs,
        "attributes": attributes,
    }


def _dtype(value: Any, uri: str) -> tuple[str, str | None]:
    """(v3 data type name, byte order of the stored items: "little", "big" or None)."""
    if not isinstance(value, str) or len(value) < 3 or value[0] not in "<>|":
        what = "structured" if isinstance(value, list) else repr(value)
        raise DtypeMismatch(f".zarray dtype {what} is not supported (a numeric typestr such as '<u2' is)", uri=uri)
    try:
        dtype = np.dtype(value)
    except TypeError as e:
        raise MetadataError(f".zarray dtype {value!r} is not a numpy type string: {e}", uri=uri) from e
    name = dtype.newbyteorder("=").name
    if name not in SUPPORTED_DTYPES:
        raise DtypeMismatch(f".zarray dtype {value!r} ({name}) is not supported (supported: {', '.join(SUPPORTED_DTYPES)})", uri=uri)
    endian = None if dtype.itemsize == 1 else ("big" if value[0] == ">" else "little")
    return name, endian


#: the field of a v2 filter naming the type it stores (numcodecs': the type it decodes from)
_STORED_TYPE = {"delta": "astype", "fixedscaleoffset": "astype", "astype": "encode_dtype"}


def _stored_endian(config: dict[str, Any], endian: str | None, uri: str) -> str | None:
    """The byte order of what a v2 filter stores (its ``astype``, which numcodecs reads in
    the order it names, a bare one in the machine's: little on every platform damacy runs),
    ``endian`` when it keeps the array's type; None for one-byte items."""
    field = _STORED_TYPE.get(config["id"])
    value = config.get(field) if field else None
    if value is None:
        value = config.get("dtype") if field else None
    if value is None:
        return endian
    try:
        stored = np.dtype(value)
    except TypeError as e:
        raise MetadataError(f"v2 filter {config['id']!r}: {field} {value!r} is not a numpy type: {e}", uri=uri) from e
    if stored.itemsize == 1:
        return None
    big = stored.byteorder == ">" or (stored.byteorder in "=|" and sys.byteorder == "big")
    return "big" if big else "little"


def _compressor(config: Any, dtype: str, uri: str) -> dict[str, Any]:
    if not isinstance(config, dict) or not isinstance(config.get("id"), str):
        raise MetadataError(f".zarray: compressor must be an object with an id, got {config!r}", uri=uri)
    cid = config["id"]
    name = _COMPRESSORS.get(cid)
    if name is None:
        raise UnsupportedOperation(f"v2 compressor {cid!r} is not supported (supported: {', '.join(_COMPRESSORS)})", uri=uri)
    rest = {k: v for k, v in config.items() if k != "id"}
    if cid == "blosc":
        shuffle = rest.get("shuffle", 1)
        if not isinstance(shuffle, int) or isinstance(shuffle, bool) or shuffle not in _BLOSC_SHUFFLES:
            raise MetadataError(f".zarray: blosc shuffle must be -1, 0, 1 or 2, got {shuffle!r}", uri=uri)
        rest = {
            "cname": rest.get("cname", "lz4"),
            "clevel": rest.get("clevel", 5),
            "shuffle": _BLOSC_SHUFFLES[shuffle],
            "typesize": np.dtype(dtype).itemsize,
            "blocksize": rest.get("blocksize", 0),
        }
    elif cid == "zstd":
        rest = {"level": rest.get("level", 0), "checksum": bool(rest.get("checksum", False))}
    elif cid == "gzip":
        rest = {"level": rest.get("level", 1)}
    return {"name": name, "configuration": rest}


def _filter(config: Any, uri: str) -> dict[str, Any]:
    if not isinstance(config, dict) or not isinstance(config.get("id"), str):
        raise MetadataError(f".zarray: a filter must be an object with an id, got {config!r}", uri=uri)
    name = _FILTERS.get(config["id"])
    if name is None:
        raise UnsupportedOperation(f"v2 filter {config['id']!r} is not supported (supported: {', '.join(_FILTERS)})", uri=uri)
    return {"name": name, "configuration": {k: v for k, v in config.items() if k != "id"}}


def _fill_value(value: Any, dtype: np.dtype) -> Any:
    """v2's fill value in v3's form (null: no fill value was set; zarr-python reads 0)."""
    if value is None:
        return False if dtype.kind == "b" else 0
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value
