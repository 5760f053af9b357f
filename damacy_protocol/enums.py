"""The enums of the public API: output dtypes, where a batch lives, what went wrong, NUMA;
and damacy's own: what a bad sample or a position outside the array does, the engine's
stages.

The seed API's members and numbers are part of the contract (``Dtype.F32 == 0``,
``Dtype.BF16 == 1``, ``DeviceType`` the DLPack device codes); they travel in messages as
their integers. damacy's are string enums: each member is its name as ``Config`` takes it
(``ErrorPolicy.SKIP == "skip"``), so strings keep working wherever they are given.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum
from typing import Any


class Dtype(IntEnum):
    """The dtype of a batch: sources of any supported dtype are cast to it as they are
    assembled (see docs/pipeline.md, the numeric contract).

    >>> Dtype.coerce("f32") is Dtype.F32
    True
    >>> Dtype.coerce("UInt16") is Dtype.U16
    True
    >>> Dtype.coerce(1) is Dtype.BF16
    True
    >>> Dtype.coerce("nope")
    Traceback (most recent call last):
        ...
    ValueError: unknown dtype: 'nope'
    """

    F32 = 0
    BF16 = 1
    U8 = 2
    U16 = 3
    U32 = 4
    U64 = 5
    I8 = 6
    I16 = 7
    I32 = 8
    I64 = 9

    @classmethod
    def coerce(cls, value: str | int | Dtype) -> Dtype:
        """A member from itself, its number, or its short (``"u16"``) or full (``"uint16"``)
        name in any case; ``ValueError`` for anything else."""
        if isinstance(value, cls):
            return value
        if isinstance(value, int):
            return cls(value)
        text = str(value).lower()
        try:
            return cls[_FULL_NAMES.get(text, text.upper())]
        except KeyError:
            raise ValueError(f"unknown dtype: {value!r}") from None

    @property
    def short(self) -> str:
        """The short name: ``"f32"``, ``"bf16"``, ``"u8"`` ..."""
        return self.name.lower()

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZE[self]

    def __str__(self) -> str:
        return self.name.lower()

    def __format__(self, spec: str) -> str:
        if spec and spec[-1] in "bcdoxXn":  # an integer's format: the enum's value
            return format(int(self), spec)
        return format(str(self), spec)


_FULL_NAMES = {
    "float32": "F32",
    "bfloat16": "BF16",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
}
_ITEMSIZE = {
    Dtype.F32: 4, Dtype.BF16: 2, Dtype.U8: 1, Dtype.U16: 2, Dtype.U32: 4, Dtype.U64: 8,
    Dtype.I8: 1, Dtype.I16: 2, Dtype.I32: 4, Dtype.I64: 8,
}


class DeviceType(IntEnum):
    """Where a batch's memory is, as DLPack codes it."""

    CPU = 1
    CUDA = 2


class Status(IntEnum):
    """What an operation came to: ``OK``, or the cause its error names
    (:attr:`damacy.DamacyError.status`)."""

    OK = 0
    AGAIN = 1
    INVAL = 2
    NOTFOUND = 3
    DTYPE = 4
    RANK = 5
    IO = 6
    DECODE = 7
    CUDA = 8
    OOM = 9
    BUDGET = 10
    SHUTDOWN = 11
    UNSUPPORTED = 12


class NumaStrategy(IntEnum):
    """Where a GPU pipeline's host threads run: ``AUTO`` on the NUMA node of its GPU (nothing
    on a one-node host), ``PIN_TO`` the node given as ``numa_node``, ``DISABLED`` wherever the
    scheduler puts them.

    >>> NumaStrategy.coerce("pin-to") is NumaStrategy.PIN_TO
    True
    >>> NumaStrategy.coerce("nope")
    Traceback (most recent call last):
        ...
    ValueError: unknown numa strategy: 'nope'
    """

    AUTO = 0
    DISABLED = 1
    PIN_TO = 2

    @classmethod
    def coerce(cls, value: str | int | NumaStrategy) -> NumaStrategy:
        """A member from itself, its number, or ``"auto"``, ``"disabled"``, ``"pin_to"``
        (any case, ``-`` for ``_``)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, int):
            return cls(value)
        text = str(value).lower().replace("-", "_")
        if text in ("auto", "disabled", "pin_to"):
            return cls[text.upper()]
        raise ValueError(f"unknown numa strategy: {value!r}")


def as_status(value: Any) -> Status:
    """A :class:`Status` from a member or its number (an unknown one: ``SHUTDOWN``, as for an
    error that carries none)."""
    try:
        return Status(int(value))
    except (TypeError, ValueError):
        return Status.SHUTDOWN


class ErrorPolicy(StrEnum):
    """What a bad sample does to its batch (``Config.on_error``): ``STOP`` (the default) and
    ``RAISE``, the pop of its batch raises its error (``STOP`` then ends the stream);
    ``FILL``, its place holds the fill value and ``batch.info.errors`` names it; ``SKIP``,
    the next sample takes its place.

    >>> ErrorPolicy.coerce("skip") is ErrorPolicy.SKIP and ErrorPolicy.SKIP == "skip"
    True
    """

    STOP = "stop"
    RAISE = "raise"
    FILL = "fill"
    SKIP = "skip"

    @classmethod
    def coerce(cls, value: Any) -> ErrorPolicy:
        """A member from itself or its string; ``ValueError`` for anything else."""
        return _coerce(cls, value, "on_error")


class BoundsPolicy(StrEnum):
    """What a selection reaching outside its array does (``Config.out_of_bounds``):
    ``ERROR`` (the default), the sample fails with ``OutOfBounds``; ``PAD``, the positions
    outside read as the array's fill value."""

    ERROR = "error"
    PAD = "pad"

    @classmethod
    def coerce(cls, value: Any) -> BoundsPolicy:
        """A member from itself or its string; ``ValueError`` for anything else."""
        return _coerce(cls, value, "out_of_bounds")


class Stage(StrEnum):
    """A stage of the engine, as its figures name it (``StageStats``, ``damacy stats``):
    planning, reads (``DIRECT``: those decode threads made from the page cache; ``DISK``: from
    the local disk tier), decodes, copies into slots (``ASSEMBLE``), host-to-device copies
    (``UPLOAD``), the native decode-and-copy calls (``NATIVE``), units taken from another
    batch's decode (``SHARED``) and chunks ``damacy warm`` cached (``WARM``)."""

    PLAN = "plan"
    READ = "read"
    DIRECT = "direct"
    DISK = "disk"
    DECODE = "decode"
    ASSEMBLE = "assemble"
    UPLOAD = "upload"
    NATIVE = "native"
    SHARED = "shared"
    WARM = "warm"


def _coerce(cls: Any, value: Any, what: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{what} must be one of {tuple(m.value for m in cls)}, got {value!r}") from None
