"""Zarr v3 data types and fill values, as numpy dtypes and scalars."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from damacy_protocol.errors import DtypeMismatch, MetadataError

#: The data types damacy reads, by their Zarr v3 name.
SUPPORTED_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
}

_HEX = re.compile(r"^0x[0-9a-fA-F]+$")
_RAW_BITS = re.compile(r"^r\d+$")


def parse_data_type(value: Any, uri: str) -> np.dtype:
    """The native-endian numpy dtype of a ``data_type`` entry; unsupported types are refused."""
    if isinstance(value, dict):
        name = value.get("name")
        if not isinstance(name, str):
            raise MetadataError(f"data_type {value!r} has no name", uri=uri)
        raise DtypeMismatch(f"data type {name!r} (an extension data type) is not supported", uri=uri)
    if not isinstance(value, str):
        raise MetadataError(f"data_type must be a string, got {value!r}", uri=uri)
    dtype = SUPPORTED_DTYPES.get(value)
    if dtype is not None:
        return dtype
    if value in ("complex64", "complex128"):
        what = f"complex data type {value!r}"
    elif _RAW_BITS.match(value):
        what = f"raw-bits data type {value!r}"
    elif value in ("string", "bytes"):
        what = f"variable-length data type {value!r}"
    else:
        what = f"data type {value!r}"
    supported = ", ".join(SUPPORTED_DTYPES)
    raise DtypeMismatch(f"{what} is not supported (supported: {supported})", uri=uri)


def parse_fill_value(value: Any, dtype: np.dtype, uri: str) -> np.generic:
    """The fill value as a numpy scalar of ``dtype``, from any form the v3 spec allows."""

    def bad(why: str) -> MetadataError:
        return MetadataError(f"fill_value {value!r} is not valid for {dtype.name}: {why}", uri=uri)

    if value is None:
        raise MetadataError("fill_value is required (got null)", uri=uri)
    if dtype.kind == "b":
        # true/false per the spec; 0/1 as written by some older writers.
        if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
            return np.bool_(bool(value))
        raise bad("expected true or false")
    if dtype.kind in "iu":
        if isinstance(value, bool):
            raise bad("expected an integer")
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, str) and _HEX.match(value):
            return _from_bits(value, dtype, bad)
        if not isinstance(value, int):
            raise bad("expected an integer")
        info = np.iinfo(dtype)
        if not info.min <= value <= info.max:
            raise bad(f"out of range [{info.min}, {info.max}]")
        return dtype.type(value)
    # floats
    if isinstance(value, bool):
        raise bad("expected a number")
    if isinstance(value, (int, float)):
        try:
            with np.errstate(over="ignore"):
                out = dtype.type(value)
        except OverflowError:  # an integer beyond any float
            raise bad("out of range") from None
        if math.isinf(float(out)) and math.isfinite(float(value)):
            raise bad("out of range")
        return out
    if isinstance(value, str):
        special = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
        if value in special:
            return dtype.type(special[value])
        if _HEX.match(value):
            return _from_bits(value, dtype, bad)
    raise bad('expected a number, "NaN", "Infinity", "-Infinity" or a hex bit pattern')


def _from_bits(text: str, dtype: np.dtype, bad) -> np.generic:
    digits = text[2:]
    if len(digits) != 2 * dtype.itemsize:
        raise bad(f"a hex bit pattern for {dtype.name} has {2 * dtype.itemsize} digits")
    raw = bytes.fromhex(digits)  # big-endian, as written
    return np.frombuffer(raw, dtype=dtype.newbyteorder(">"))[0].astype(dtype)
