"""The codec interface: one small class per codec, decode only (damacy reads).

A Zarr v3 codec chain is zero or more array→array codecs, exactly one array→bytes codec
and zero or more bytes→bytes codecs. Decoding runs it backwards. Codecs raise
:class:`CorruptData` with the cause; the caller adds the uri, file and chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from damacy_protocol.errors import MetadataError

Buffer = bytes | bytearray | memoryview


class CorruptData(Exception):
    """The encoded bytes of a chunk cannot be decoded (checksum, truncation, bad frame)."""


@dataclass(frozen=True)
class ChunkSpec:
    """What a codec sees: the shape and dtype of the (decoded) array it produces."""

    shape: tuple[int, ...]
    dtype: np.dtype
    fill_value: np.generic
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", math.prod(self.shape) * self.dtype.itemsize)


class Codec:
    name: ClassVar[str]
    kind: ClassVar[str]  # "a2a", "a2b" or "b2b"
    #: its configuration holds codec chains of its own: ``from_config`` then takes the chain
    #: builder as a fourth argument (so no codec module imports the chain module)
    nested: ClassVar[bool] = False

    @classmethod
    def from_config(cls, config: dict[str, Any], spec: ChunkSpec, uri: str) -> Codec:
        raise NotImplementedError  # each codec implements it

    def describe(self) -> str:
        return self.name


class ArrayArrayCodec(Codec):
    kind = "a2a"

    def encoded_spec(self, spec: ChunkSpec) -> ChunkSpec:
        """The spec of the array this codec encodes ``spec`` into."""
        return spec

    def decode(self, arr: np.ndarray, spec: ChunkSpec) -> np.ndarray:
        """Undo the codec; ``spec`` describes the decoded array."""
        raise NotImplementedError  # each codec implements it


class ArrayBytesCodec(Codec):
    kind = "a2b"

    def decode(self, data: Buffer, spec: ChunkSpec) -> np.ndarray:
        raise NotImplementedError  # each codec implements it


class BytesBytesCodec(Codec):
    kind = "b2b"
    #: Bytes the codec adds to any input, for codecs whose output size is fixed
    #: (``None``: the encoded size depends on the data).
    fixed_overhead: ClassVar[int | None] = None

    def decode(self, data: Buffer, decoded_size: int | None) -> Buffer:
        """Undo the codec; ``decoded_size`` is the size of the result when known."""
        raise NotImplementedError  # each codec implements it


def config_value(config: dict[str, Any], key: str, kinds, codec: str, uri: str, default: Any = ...) -> Any:
    """``config[key]`` checked against ``kinds``; a missing or mistyped value is a MetadataError."""
    if key not in config:
        if default is ...:
            raise MetadataError(f"codec {codec!r} needs configuration.{key}", uri=uri)
        return default
    value = config[key]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _as_tuple(kinds)):
        raise MetadataError(f"codec {codec!r}: configuration.{key} = {value!r} has the wrong type", uri=uri)
    return value


def _as_tuple(kinds) -> tuple:
    return kinds if isinstance(kinds, tuple) else (kinds,)
