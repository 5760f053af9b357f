"""numcodecs' codecs under the names zarr-python gives them in Zarr v3 (``numcodecs.zlib``,
``numcodecs.delta``, ...): the compressors and filters Zarr v2 arrays use that v3 has no
codec of its own for. A v2 ``.zarray`` is read as the equivalent v3 chain (see
``damacy_server.zarr.v2``), so the same codecs serve both formats.

Compressors (bytes to bytes): ``zlib``, ``lz4`` (numcodecs' framing: the decoded size in 4
bytes, then an LZ4 block), ``bz2``. Filters (array to array, on the chunk as stored):
``delta``, ``fixedscaleoffset``, ``astype``. numcodecs decodes them (it is a dependency);
anything else is refused by the chain naming the codec.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from damacy_protocol.errors import MetadataError
from damacy_server.zarr.codecs.base import ArrayArrayCodec, Buffer, BytesBytesCodec, ChunkSpec, CorruptData


def _codec(id_: str, config: dict[str, Any], name: str, uri: str) -> Any:
    from numcodecs import get_codec

    try:
        return get_codec({**{k: v for k, v in config.items() if k != "id"}, "id": id_})
    except (TypeError, ValueError, KeyError) as e:
        raise MetadataError(f"codec {name!r}: configuration {config!r} is not valid: {e}", uri=uri) from e


class _Compressor(BytesBytesCodec):
    id: ClassVar[str]

    def __init__(self, codec: Any) -> None:
        self.codec = codec

    @classmethod
    def from_config(cls, config: dict[str, Any], spec: ChunkSpec, uri: str) -> _Compressor:
        return cls(_codec(cls.id, config, cls.name, uri))

    def describe(self) -> str:
        return self.id

    def decode(self, data: Buffer, decoded_size: int | None) -> Buffer:
        try:
            out = self.codec.decode(data)
        except Exception as e:  # noqa: BLE001 - each library raises its own kinds
            raise CorruptData(f"{self.id}: {e}") from e
        return memoryview(out).cast("B") if not isinstance(out, bytes) else out


class ZlibCodec(_Compressor):
    name = "numcodecs.zlib"
    id = "zlib"


class LZ4Codec(_Compressor):
    name = "numcodecs.lz4"
    id = "lz4"


class BZ2Codec(_Compressor):
    name = "numcodecs.bz2"
    id = "bz2"


class _Filter(ArrayArrayCodec):
    """A numcodecs filter on the chunk as stored (flattened in C order, as numcodecs sees
    it); ``encoded`` is the dtype it stores."""

    id: ClassVar[str]
    encoded_key: ClassVar[str]  # the configuration key naming the stored dtype

    def __init__(self, codec: Any, stored: np.dtype) -> None:
        self.codec = codec
        self.stored = stored  # with the byte order numcodecs reads it in
        self.encoded = stored.newbyteorder("=")

    @classmethod
    def from_config(cls, config: dict[str, Any], spec: ChunkSpec, uri: str) -> _Filter:
        codec = _codec(cls.id, config, cls.name, uri)
        declared = config.get("dtype")
        _check_decoded(declared, spec, cls.name, "dtype", uri)
        return cls(codec, np.dtype(config.get(cls.encoded_key) or declared or spec.dtype))

    def describe(self) -> str:
        return f"{self.id}({self.encoded})"

    def encoded_spec(self, spec: ChunkSpec) -> ChunkSpec:
        return ChunkSpec(spec.shape, self.encoded, spec.fill_value.astype(self.encoded))

    def decode(self, arr: np.ndarray, spec: ChunkSpec) -> np.ndarray:
        try:
            out = np.asarray(self.codec.decode(np.ascontiguousarray(arr, dtype=self.stored)))
        except Exception as e:  # noqa: BLE001
            raise CorruptData(f"{self.id}: {e}") from e
        return (out if out.dtype == spec.dtype else out.astype(spec.dtype)).reshape(spec.shape)


def _check_decoded(declared: Any, spec: ChunkSpec, name: str, key: str, uri: str) -> None:
    if declared is not None and np.dtype(declared).newbyteorder("=") != spec.dtype:
        raise MetadataError(f"codec {name!r}: {key} {declared!r} is not the array's {spec.dtype}", uri=uri)


class DeltaCodec(_Filter):
    name = "numcodecs.delta"
    id = "delta"
    encoded_key = "astype"


class FixedScaleOffsetCodec(_Filter):
    name = "numcodecs.fixedscaleoffset"
    id = "fixedscaleoffset"
    encoded_key = "astype"


class AsTypeCodec(_Filter):
    name = "numcodecs.astype"
    id = "astype"
    encoded_key = "encode_dtype"

    @classmethod
    def from_config(cls, config: dict[str, Any], spec: ChunkSpec, uri: str) -> _Filter:
        _check_decoded(config.get("decode_dtype"), spec, cls.name, "decode_dtype", uri)
        return cls(_codec(cls.id, config, cls.name, uri), np.dtype(config.get("encode_dtype") or spec.dtype))


CODECS = (ZlibCodec, LZ4Codec, BZ2Codec, DeltaCodec, FixedScaleOffsetCodec, AsTypeCodec)
