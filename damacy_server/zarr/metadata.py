"""Zarr array metadata: ``zarr.json`` (or a v2 ``.zarray``, as its v3 equivalent) parsed and
checked into an :class:`ArrayMetadata`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from damacy_protocol.errors import InvalidArgument, MetadataError, NotFound, UnsupportedOperation
from damacy_server.store import Store
from damacy_server.zarr.chunk_keys import ChunkKeyEncoding, parse_chunk_key_encoding
from damacy_server.zarr.codecs import ChunkSpec, CodecChain, build_chain
from damacy_server.zarr.dtypes import parse_data_type, parse_fill_value
from damacy_server.zarr.layout import ChunkLayout

_ARRAY_KEYS = {
    "zarr_format",
    "node_type",
    "shape",
    "data_type",
    "chunk_grid",
    "chunk_key_encoding",
    "fill_value",
    "codecs",
    "attributes",
    "storage_transformers",
    "dimension_names",
}


@dataclass(frozen=True, eq=False)
class ArrayMetadata:
    """Everything needed to read an array, checked once when it is loaded."""

    uri: str
    store: Store
    root: str  # the store key of the array's folder
    shape: tuple[int, ...]
    dtype: np.dtype  # native byte order
    chunk_shape: tuple[int, ...]  # the chunk grid's: the shard shape when the array is sharded
    fill_value: np.generic
    chunk_key_encoding: ChunkKeyEncoding
    codecs: CodecChain
    dimension_names: tuple[str | None, ...] | None
    attributes: dict[str, Any] = field(repr=False)
    layout: ChunkLayout = field(repr=False)
    #: the versions of the metadata documents it was read from, where its reader asked (see
    #: ``damacy_server.plan.versions``): caches that outlive the process name its data by
    #: them; in-memory caches by ``generation``, a number per version (0: none asked)
    version: Any = field(default=None, repr=False)
    generation: int = field(default=0, repr=False)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def chunks(self) -> tuple[int, ...]:
        """The shape of a chunk as zarr-python names it: the inner chunk of a sharded array
        (of its outer shards, where shards nest)."""
        levels = self.layout.levels
        return tuple(levels[0].inner_shape) if levels else self.layout.unit_shape

    @property
    def read_unit(self) -> tuple[int, ...]:
        """The shape of what damacy reads and decodes at once: the innermost chunk."""
        return self.layout.unit_shape

    @property
    def shards(self) -> tuple[int, ...] | None:
        """The shard shape of a sharded array (zarr-python's ``shards``), else None."""
        return self.chunk_shape if self.layout.levels else None

    def __repr__(self) -> str:
        shards = "" if self.shards is None else f" shards={self.shards}"
        return f"<damacy array {self.uri} shape={self.shape} {self.dtype.name} chunks={self.chunks}{shards}>"

    def chunk_key(self, coords: tuple[int, ...]) -> str:
        """The store key of the chunk (or shard) object at grid ``coords``."""
        return self.store.join(self.root, self.chunk_key_encoding.key(coords))


def decode_json(data: bytes, uri: str, what: str = "zarr.json") -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except UnicodeDecodeError as e:
        raise MetadataError(f"{what} is not UTF-8 text: {e}", uri=uri) from e
    except json.JSONDecodeError as e:
        raise MetadataError(f"{what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}", uri=uri) from e
    except RecursionError:
        raise MetadataError(f"{what} is nested too deeply to parse", uri=uri) from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise MetadataError(f"{what} is not valid JSON: {e}", uri=uri) from e
    if not isinstance(doc, dict):
        raise MetadataError(f"{what} must hold a JSON object, found {type(doc).__name__}", uri=uri)
    return doc


def load_node(store: Store, root: str, uri: str) -> dict[str, Any]:
    """The parsed ``zarr.json`` at ``root``, or a Zarr v2 node (``.zarray`` or ``.zgroup``,
    with ``.zattrs``) as its v3 equivalent; a clear error when there is none."""
    data = store.read(store.join(root, "zarr.json"))
    if data is not None:
        return decode_json(data, uri)
    zarray = store.read(store.join(root, ".zarray"))
    zgroup = store.read(store.join(root, ".zgroup")) if zarray is None else None
    if zarray is not None or zgroup is not None:
        from damacy_server.zarr.v2 import as_v3

        raw = store.read(store.join(root, ".zattrs"))
        attributes = decode_json(raw, uri, ".zattrs") if raw is not None else {}
        if zarray is not None:
            return as_v3(decode_json(zarray, uri, ".zarray"), attributes, uri)
        decode_json(zgroup, uri, ".zgroup")
        group: dict[str, Any] = {"zarr_format": 3, "node_type": "group", "attributes": attributes}
        raw = store.read(store.join(root, ".zmetadata"))
        if raw is not None:
            group["consolidated_metadata"] = _v2_consolidated(decode_json(raw, uri, ".zmetadata"), uri)
        return group
    raise NotFound("no Zarr array or group here (neither zarr.json nor .zarray/.zgroup found)", uri=uri)


def _v2_consolidated(doc: dict[str, Any], uri: str) -> dict[str, Any]:
    """A v2 ``.zmetadata`` in the form of v3's inline consolidated metadata, each node's v2
    documents kept as they are ({path: {".zarray": ..., ".zattrs": ...}}), translated only
    when a node is used (see :func:`consolidated_node`)."""
    entries = doc.get("metadata")
    if doc.get("zarr_consolidated_format") != 1 or not isinstance(entries, dict):
        raise MetadataError(".zmetadata: expected zarr_consolidated_format 1 and a metadata object", uri=uri)
    nodes: dict[str, dict[str, Any]] = {}
    for key, value in entries.items():
        path, _, name = str(key).rpartition("/")
        if name in (".zarray", ".zgroup", ".zattrs") and path and isinstance(value, dict):
            nodes.setdefault(path, {})[name] = value
    return {"kind": "inline", "must_understand": False, "metadata": nodes}


def consolidated_entries(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The nodes a group's consolidated metadata describes, by path below the group (zarr-
    python's inline form in a v3 ``zarr.json``, or a v2 ``.zmetadata``); empty when none."""
    found = doc.get("consolidated_metadata")
    if not isinstance(found, dict) or found.get("kind", "inline") != "inline":
        return {}
    nodes = found.get("metadata")
    return {k: v for k, v in nodes.items() if isinstance(k, str) and isinstance(v, dict)} if isinstance(nodes, dict) else {}


def consolidated_node(entry: dict[str, Any], uri: str) -> dict[str, Any]:
    """A node's document from its consolidated entry, as :func:`load_node` would read it."""
    if ".zarray" in entry or ".zgroup" in entry:
        attributes = entry.get(".zattrs", {})
        if ".zarray" in entry:
            from damacy_server.zarr.v2 import as_v3

            return as_v3(entry[".zarray"], attributes, uri)
        return {"zarr_format": 3, "node_type": "group", "attributes": attributes}
    return entry


def check_node(doc: dict[str, Any], uri: str) -> str:
    """The node type of a ``zarr.json`` document of format 3."""
    fmt = doc.get("zarr_format")
    if fmt != 3:
        if fmt == 2:
            raise MetadataError("zarr.json says zarr_format 2 (Zarr v2 keeps its metadata in .zarray)", uri=uri)
        raise MetadataError(f"zarr_format must be 3, got {fmt!r}", uri=uri)
    node_type = doc.get("node_type")
    if node_type not in ("array", "group"):
        raise MetadataError(f"node_type must be 'array' or 'group', got {node_type!r}", uri=uri)
    return node_type


def parse_array_metadata(doc: dict[str, Any], *, uri: str, store: Store, root: str) -> ArrayMetadata:
    if check_node(doc, uri) != "array":
        raise InvalidArgument("names a Zarr group, not an array", uri=uri)
    for key, value in doc.items():
        if key not in _ARRAY_KEYS and not (isinstance(value, dict) and value.get("must_understand") is False):
            raise UnsupportedOperation(f"zarr.json field {key!r} is not understood (and not marked must_understand: false)", uri=uri)
    for key in ("shape", "data_type", "chunk_grid", "chunk_key_encoding", "fill_value", "codecs"):
        if key not in doc:
            raise MetadataError(f"zarr.json has no {key!r}", uri=uri)

    shape = _int_tuple(doc["shape"], "shape", uri, minimum=0)
    if len(shape) > MAX_NDIM:
        raise UnsupportedOperation(f"the array has {len(shape)} axes; damacy reads arrays of up to {MAX_NDIM} (numpy's limit)", uri=uri)
    dtype = parse_data_type(doc["data_type"], uri)
    chunk_shape = _parse_chunk_grid(doc["chunk_grid"], len(shape), uri)
    fill_value = parse_fill_value(doc["fill_value"], dtype, uri)
    encoding = parse_chunk_key_encoding(doc["chunk_key_encoding"], uri)
    transformers = doc.get("storage_transformers") or []
    if not isinstance(transformers, list):
        raise MetadataError(f"storage_transformers must be a list, got {type(transformers).__name__}", uri=uri)
    if transformers:
        names = [t.get("name") if isinstance(t, dict) else t for t in transformers]
        raise UnsupportedOperation(f"storage transformers {names} are not supported", uri=uri)
    codecs = build_chain(doc["codecs"], ChunkSpec(chunk_shape, dtype, fill_value), uri)
    names = doc.get("dimension_names")
    if names is not None:
        if not isinstance(names, list) or len(names) != len(shape) or not all(
            n is None or isinstance(n, str) for n in names
        ):
            raise MetadataError(f"dimension_names {names!r} must list {len(shape)} strings or nulls", uri=uri)
        names = tuple(names)
    attributes = doc.get("attributes") or {}
    if not isinstance(attributes, dict):
        raise MetadataError("attributes must be an object", uri=uri)
    return ArrayMetadata(
        uri=uri,
        store=store,
        root=root,
        shape=shape,
        dtype=dtype,
        chunk_shape=chunk_shape,
        fill_value=fill_value,
        chunk_key_encoding=encoding,
        codecs=codecs,
        dimension_names=names,
        attributes=attributes,
        layout=ChunkLayout.build(shape, chunk_shape, codecs),
    )


def _parse_chunk_grid(grid: Any, ndim: int, uri: str) -> tuple[int, ...]:
    if not isinstance(grid, dict):
        raise MetadataError(f"chunk_grid must be an object, got {grid!r}", uri=uri)
    name = grid.get("name")
    if name != "regular":
        raise UnsupportedOperation(f"chunk grid {name!r} is not supported (regular is)", uri=uri)
    config = grid.get("configuration")
    if not isinstance(config, dict) or "chunk_shape" not in config:
        raise MetadataError("regular chunk_grid needs configuration.chunk_shape", uri=uri)
    chunks = _int_tuple(config["chunk_shape"], "chunk_grid.configuration.chunk_shape", uri, minimum=1)
    if len(chunks) != ndim:
        raise MetadataError(f"chunk_shape {list(chunks)} has {len(chunks)} axes, shape has {ndim}", uri=uri)
    return chunks


#: no extent of an array or a chunk reaches this (offsets and products stay within int64)
MAX_EXTENT = 1 << 62


#: the most axes an array may have (numpy's limit is 64 for an array, 63 for its index
#: arithmetic, which the planner uses on the chunk grid)
MAX_NDIM = 63


def _int_tuple(value: Any, what: str, uri: str, minimum: int) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and minimum <= v < MAX_EXTENT for v in value
    ):
        raise MetadataError(f"{what} must be a list of integers from {minimum} to 2**62 - 1, got {value!r}", uri=uri)
    return tuple(value)
