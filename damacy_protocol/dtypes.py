"""Output dtypes: the short names damacy accepts for batches and reads, and their numpy types.

The names are plain strings so they travel in messages; :func:`numpy_dtype` maps them to
numpy (bf16 through ml_dtypes, imported only when asked for).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from damacy_protocol.enums import Dtype
from damacy_protocol.errors import InvalidArgument

if TYPE_CHECKING:
    import numpy as np

#: canonical name → numpy dtype name ("native": the array's own dtype)
OUTPUT_DTYPES: dict[str, str] = {
    "f32": "float32",
    "bf16": "bfloat16",
    "f16": "float16",
    "f64": "float64",
    "u8": "uint8",
    "u16": "uint16",
    "u32": "uint32",
    "u64": "uint64",
    "i8": "int8",
    "i16": "int16",
    "i32": "int32",
    "i64": "int64",
    "bool": "bool",
    "native": "native",
}
_ALIASES = {v: k for k, v in OUTPUT_DTYPES.items()}


#: damacy's output dtypes beyond the seed API's :class:`Dtype` (kept as their names)
EXTRA_DTYPES = ("f16", "f64", "bool", "native")


def output_dtype(value: Any) -> Dtype | str:
    """A batch's dtype: a :class:`Dtype` for the seed API's ten (from a member, its number or
    a short or full name, as :meth:`Dtype.coerce`), else one of damacy's own names
    (:data:`EXTRA_DTYPES`: ``"f16"``/``"float16"``, ``"f64"``/``"float64"``, ``"bool"``,
    ``"native"``, the array's own); ``ValueError("unknown dtype: ...")`` otherwise."""
    if isinstance(value, str):
        name = value.strip().lower()
        name = _ALIASES.get(name, name)
        if name in EXTRA_DTYPES:
            return name
    return Dtype.coerce(value)


@functools.lru_cache(maxsize=256)
def numpy_name(dtype: np.dtype) -> str:
    """numpy's name of ``dtype`` (``"float32"``), remembered: numpy works it out in Python
    on every ask, and a front end asks per batch."""
    return dtype.name


def dtype_name(dtype: Dtype | str) -> str:
    """The short name of a batch dtype (``"f32"``, ``"f16"``, ``"native"``)."""
    return dtype.short if isinstance(dtype, Dtype) else dtype


def itemsize(dtype: Dtype | str) -> int:
    """Bytes per element of a batch dtype (0 for ``"native"``: the array decides)."""
    if isinstance(dtype, Dtype):
        return dtype.itemsize
    return 0 if dtype == "native" else numpy_dtype(dtype).itemsize


def canonical_dtype(value: Any, field: str = "dtype") -> str:
    """The canonical short name of an output dtype given as a name or a numpy dtype."""
    if isinstance(value, Dtype):
        return value.short
    if value is None:
        return "native"
    if isinstance(value, str):
        name = value.strip().lower()
        if name in OUTPUT_DTYPES:
            return name
        if name in _ALIASES:
            return _ALIASES[name]
    else:
        try:
            import numpy as np

            name = np.dtype(value).name.lower()
        except TypeError:
            name = None
        if name in _ALIASES:
            return _ALIASES[name]
    choices = ", ".join(OUTPUT_DTYPES)
    raise InvalidArgument(f"{field}: unknown dtype {value!r} (choose from {choices})")


def numpy_dtype(name: str | Dtype, native: Any = None):
    """The numpy dtype of canonical name ``name``; ``native`` is the dtype "native" means."""
    import numpy as np

    if isinstance(name, Dtype):
        name = name.short
    if name == "native":
        if native is None:
            raise InvalidArgument("dtype 'native' needs the array's dtype")
        return np.dtype(native).newbyteorder("=")
    if name == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(OUTPUT_DTYPES[name])
