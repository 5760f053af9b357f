"""NGFF images for spatial queries: an OME-Zarr 0.5 multiscale (``attributes.ome`` of a
Zarr v3 group) loaded once, synchronously, into the immutable description that spatial
queries resolve against (:class:`NgffImage`).

Loading reads the group's ``zarr.json`` and each level's, nothing else (no chunk), through
the caller's :class:`FileMetadataReader`, whose settings alone it uses: one reader serves
pipelines and loads at once. What it reads is bounded by :class:`NgffLimits` before it is
read (each file's size is asked first, the sum of the sizes is the budget), so a huge or
hostile document costs nothing. It checks what coordinate interpretation needs and
nothing more (the seed's spatial guide): the selected multiscale's axes, each dataset's
one scale and optional translation, levels going from fine to coarse, and every level's
array metadata (by the project's own Zarr parser) agreeing on rank, names and dtype. A
field read twice in a consumed object is refused (JSON keeps the last one silently).

Errors: :class:`BudgetExceeded` when the limits run out, :class:`NotFound` for a missing
``zarr.json``, :class:`UnsupportedOperation` for what the format allows and damacy does not
read (another version, custom axis types, transforms in external arrays),
:class:`MetadataError` for metadata that breaks the rules, :class:`InvalidArgument` for a
uri or index naming something that is not there.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from damacy_protocol.errors import BudgetExceeded, InvalidArgument, MetadataError, NotFound, UnsupportedOperation
from damacy_protocol.limits import NgffLimits, positive_int
from damacy_protocol.samples import ResolvedSpatialQuery
from damacy_protocol.spatial import MAX_COORDINATE, NgffAxis, NgffLevel, SpatialQuery, check_index, level_map
from damacy_protocol.spatial import resolve as _resolve
from damacy_server.store.file import FileMetadataReader
from damacy_server.zarr.metadata import check_node, decode_json, parse_array_metadata
from damacy_server.zarr.ngff import parse_axes

_KINDS = ("space", "time", "channel")


@dataclass(frozen=True, slots=True, init=False)
class NgffImage:
    """An immutable OME-Zarr 0.5 image description, loaded through ``reader`` when made.

    ``multiscale_index`` selects the entry of ``ome.multiscales`` explicitly. ``axes`` are
    in the arrays' dimension order, ``levels`` from fine (``levels[0]``, the reference) to
    coarse, each with its array's uri and its map into reference indices; ``data_type`` is
    the levels' common dtype as ``zarr.json`` spells it. :meth:`resolve` does no I/O.
    """

    axes: tuple[NgffAxis, ...]
    levels: tuple[NgffLevel, ...]
    data_type: str

    def __init__(
        self,
        uri: str | os.PathLike[str],
        *,
        reader: FileMetadataReader,
        multiscale_index: int,
        limits: NgffLimits | None = None,
    ) -> None:
        if not isinstance(reader, FileMetadataReader):
            raise TypeError("reader must be a FileMetadataReader")
        if limits is None:
            limits = NgffLimits()
        if not isinstance(limits, NgffLimits):
            raise TypeError("limits must be NgffLimits")
        path = os.fspath(uri)
        if not isinstance(path, str) or not path or "\0" in path:
            raise ValueError("uri must be a nonempty path without NUL characters")
        index = check_index(multiscale_index, "multiscale_index")
        axes, levels, data_type = _Loader(reader, limits).image(path, index)
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "levels", levels)
        object.__setattr__(self, "data_type", data_type)

    def resolve(self, query: SpatialQuery, *, shape: Iterable[int]) -> ResolvedSpatialQuery:
        """``query`` for an output grid of ``shape`` resolved into source geometry, without
        I/O, batching or output allocation (see :func:`damacy_protocol.spatial.resolve`)."""
        if not isinstance(query, SpatialQuery):
            raise TypeError("query must be a SpatialQuery")
        extents = tuple(positive_int(n, "shape extent", MAX_COORDINATE) for n in shape)
        if len(extents) != len(self.axes):
            raise ValueError("output rank must match the NGFF image")
        return _resolve(query, axes=self.axes, levels=self.levels, shape=extents)


class _Object(dict):
    """A decoded JSON object that remembers the keys it was given more than once."""

    __slots__ = ("twice",)

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        seen: set[str] = set()
        self.twice = {k for k, _ in pairs if k in seen or seen.add(k)} if len(self) < len(pairs) else set()


def _field(obj: dict[str, Any], key: str, where: str, uri: str) -> Any:
    """``obj[key]`` (None when absent) of a consumed object, refused when given twice."""
    if key in getattr(obj, "twice", ()):
        raise MetadataError(f"{where} gives {key!r} more than once", uri=uri)
    return obj.get(key)


def _no_twice(value: Any, where: str, uri: str) -> None:
    """No object in ``value`` (an array's zarr.json, all of it consumed but its attributes)
    gives a key twice."""
    if isinstance(value, dict):
        for key, item in value.items():
            _field(value, key, where, uri)
            if not (where == "zarr.json" and key == "attributes"):
                _no_twice(item, f"{where}.{key}", uri)
    elif isinstance(value, list):
        for k, item in enumerate(value):
            _no_twice(item, f"{where}[{k}]", uri)


class _Loader:
    """One load: the reader, and what is left of the metadata budget."""

    def __init__(self, reader: FileMetadataReader, limits: NgffLimits) -> None:
        self.reader = reader
        self.limits = limits
        self.left = limits.max_metadata_bytes

    def document(self, root: str) -> dict[str, Any]:
        """The decoded zarr.json at ``root``, its size charged to the budget before reading."""
        key = self.reader.join(root, "zarr.json")
        size = self.reader.size(key)
        if size is not None and size > self.left:
            raise self._over(size, root)
        data = None if size is None else self.reader.read(key)
        if data is None:
            raise NotFound("no zarr.json (an NGFF image is read from OME-Zarr 0.5 on Zarr v3)", uri=root)
        if len(data) > self.left:  # the file grew between the two calls
            raise self._over(len(data), root)
        self.left -= len(data)
        try:
            doc = json.loads(data, object_pairs_hook=_Object)
        except (ValueError, RecursionError):
            doc = None
        if not isinstance(doc, dict):
            decode_json(data, root)  # raises the project's error for this document
        return doc

    def _over(self, size: int, root: str) -> BudgetExceeded:
        return BudgetExceeded(
            f"its zarr.json of {size} bytes exceeds what is left ({self.left}) of "
            f"NgffLimits.max_metadata_bytes ({self.limits.max_metadata_bytes})",
            uri=root,
        )

    def image(self, uri: str, index: int) -> tuple[tuple[NgffAxis, ...], tuple[NgffLevel, ...], str]:
        group = self.document(uri)
        if check_node(group, uri) != "group":
            raise InvalidArgument("names a Zarr array, not an NGFF image (a group)", uri=uri)
        attributes = _field(group, "attributes", "zarr.json", uri)
        ome = _field(attributes, "ome", "attributes", uri) if isinstance(attributes, dict) else None
        if not isinstance(ome, dict) or _field(ome, "multiscales", "ome", uri) is None:
            raise InvalidArgument("is not an OME-Zarr 0.5 image (no attributes.ome.multiscales in its zarr.json)", uri=uri)
        version = _field(ome, "version", "ome", uri)
        if version != "0.5":
            raise UnsupportedOperation(f"OME-Zarr version {version!r} is not supported (0.5 is)", uri=uri)
        multiscales = ome["multiscales"]
        if not isinstance(multiscales, list) or not multiscales:
            raise MetadataError("ome.multiscales must be a non-empty list", uri=uri)
        if index >= len(multiscales):
            raise InvalidArgument(f"multiscale_index {index} asked, the image has {len(multiscales)} multiscales", uri=uri)
        where = f"ome.multiscales[{index}]"
        multiscale = multiscales[index]
        if not isinstance(multiscale, dict):
            raise MetadataError(f"{where} must be an object", uri=uri)
        axes = _axes(multiscale, where, uri)
        datasets = _field(multiscale, "datasets", where, uri)
        if not isinstance(datasets, list) or not datasets:
            raise MetadataError(f"{where}.datasets must be a non-empty list", uri=uri)
        if len(datasets) > self.limits.max_levels:
            raise BudgetExceeded(
                f"{where} has {len(datasets)} levels, more than NgffLimits.max_levels ({self.limits.max_levels})", uri=uri
            )
        parsed = [_dataset(d, f"{where}.datasets[{k}]", axes, uri) for k, d in enumerate(datasets)]
        _check_scales(parsed, axes, where, uri)
        levels: list[NgffLevel] = []
        data_type = ""
        _, scale0, translation0 = parsed[0]
        for k, (path, scale, translation) in enumerate(parsed):
            level_uri = self.reader.join(uri, path)
            doc = self.document(level_uri)
            _no_twice(doc, "zarr.json", level_uri)
            array = parse_array_metadata(doc, uri=level_uri, store=self.reader, root=level_uri)
            if array.dimension_names != tuple(a.name for a in axes):
                raise MetadataError(
                    f"dimension_names {array.dimension_names} must be the axes' names {[a.name for a in axes]}", uri=level_uri
                )
            data_type = data_type or doc["data_type"]
            if doc["data_type"] != data_type:
                raise MetadataError(f"data type {doc['data_type']!r} differs from level 0's {data_type!r}", uri=level_uri)
            if levels:
                _check_shape(array.shape, levels[-1].shape, levels[0].shape, axes, level_uri)
            ratio, origin = level_map(scale, translation, scale0, translation0)
            if not all(map(math.isfinite, ratio + origin)):
                raise MetadataError(f"{where}.datasets[{k}]: its map into level 0 is not finite", uri=uri)
            levels.append(NgffLevel(level_uri, array.shape, ratio, origin))
        return axes, tuple(levels), data_type


def _axes(multiscale: dict[str, Any], where: str, uri: str) -> tuple[NgffAxis, ...]:
    """The multiscale's axes: 2 or 3 of type space, at most one time and one channel axis."""
    raw = _field(multiscale, "axes", where, uri)
    if not isinstance(raw, list) or not all(isinstance(a, dict) for a in raw):
        raise MetadataError(f"{where}.axes must be a list of objects", uri=uri)
    for k, entry in enumerate(raw):
        kind, unit = (_field(entry, key, f"{where}.axes[{k}]", uri) for key in ("type", "unit"))
        if kind not in _KINDS:
            what = "an unspecified type" if kind is None else f"the custom type {kind!r}"
            raise UnsupportedOperation(f"{where}.axes[{k}] has {what} (space, time and channel are supported)", uri=uri)
        if unit is not None and not isinstance(unit, str):
            raise MetadataError(f"{where}.axes[{k}].unit must be a string, got {unit!r}", uri=uri)
        _field(entry, "name", f"{where}.axes[{k}]", uri)
    axes = tuple(NgffAxis(a.name, a.type, a.unit) for a in parse_axes(multiscale, len(raw), uri))
    names = [a.name for a in axes]
    if any(not n for n in names) or len(set(names)) != len(names):
        raise MetadataError(f"{where}.axes must have distinct non-empty names, got {names}", uri=uri)
    kinds = [a.kind for a in axes]
    if kinds.count("space") not in (2, 3) or kinds.count("time") > 1 or kinds.count("channel") > 1:
        raise UnsupportedOperation(
            f"{where}.axes {names} are not supported: 2 or 3 space axes, at most one time and one channel axis", uri=uri
        )
    return axes


def _dataset(entry: Any, where: str, axes: tuple[NgffAxis, ...], uri: str) -> tuple[str, list[float], list[float]]:
    """(path, scale, translation) of one dataset: a relative child path, one positive scale
    and an optional translation after it."""
    if not isinstance(entry, dict):
        raise MetadataError(f"{where} must be an object", uri=uri)
    path = _field(entry, "path", where, uri)
    segments = path.split("/") if isinstance(path, str) else [""]
    if any(s in ("", ".", "..") or "\0" in s for s in segments):
        raise MetadataError(f"{where}.path {path!r} is not a relative path below the image", uri=uri)
    steps = _field(entry, "coordinateTransformations", where, uri)
    kinds = [t.get("type") if isinstance(t, dict) else None for t in steps] if isinstance(steps, list) else None
    for k, step in enumerate(steps if isinstance(steps, list) else []):
        if isinstance(step, dict) and _field(step, "path", f"{where}.coordinateTransformations[{k}]", uri) is not None:
            raise UnsupportedOperation(f"{where}: transforms stored in external arrays are not supported", uri=uri)
    if kinds not in (["scale"], ["scale", "translation"]):
        raise MetadataError(
            f"{where}.coordinateTransformations must be one scale and an optional translation after it, got {kinds}", uri=uri
        )
    assert isinstance(steps, list)
    scale = _vector(steps[0], "scale", f"{where}.coordinateTransformations[0]", len(axes), uri)
    if not all(v > 0 for v in scale):
        raise MetadataError(f"{where}: scale {scale} must be positive", uri=uri)
    translation = [0.0] * len(axes)
    if len(steps) == 2:
        translation = _vector(steps[1], "translation", f"{where}.coordinateTransformations[1]", len(axes), uri)
    return path, scale, translation


def _vector(step: dict[str, Any], kind: str, where: str, rank: int, uri: str) -> list[float]:
    _field(step, "type", where, uri)
    values = _field(step, kind, where, uri)
    if (
        not isinstance(values, list)
        or len(values) != rank
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        or not all(math.isfinite(float(v)) for v in values)
    ):
        raise MetadataError(f"{where}.{kind} must list {rank} finite numbers, got {values!r}", uri=uri)
    return [float(v) for v in values]


def _check_scales(parsed: list[tuple[str, list[float], list[float]]], axes: tuple[NgffAxis, ...], where: str, uri: str) -> None:
    """Scales never decrease from level to level; time and channel transforms never change."""
    _, scale0, translation0 = parsed[0]
    for k in range(1, len(parsed)):
        _, scale, translation = parsed[k]
        for a, axis in enumerate(axes):
            if scale[a] < parsed[k - 1][1][a]:
                raise MetadataError(
                    f"{where}.datasets[{k}]: the scale along {axis.name!r} decreases "
                    f"({parsed[k - 1][1][a]} then {scale[a]}); levels go from fine to coarse",
                    uri=uri,
                )
            if axis.kind != "space" and (scale[a], translation[a]) != (scale0[a], translation0[a]):
                raise MetadataError(f"{where}.datasets[{k}]: the {axis.kind} axis {axis.name!r} must keep level 0's transform", uri=uri)


def _check_shape(
    shape: tuple[int, ...], previous: tuple[int, ...], first: tuple[int, ...], axes: tuple[NgffAxis, ...], uri: str
) -> None:
    """Shapes never grow from level to level; time and channel extents never change."""
    if len(shape) != len(axes):
        raise MetadataError(f"the level has {len(shape)} axes, the image {len(axes)}", uri=uri)
    for a, axis in enumerate(axes):
        if shape[a] > previous[a] or (axis.kind != "space" and shape[a] != first[a]):
            raise MetadataError(
                f"its extent {shape[a]} along {axis.name!r} does not fit the finer levels' "
                f"({previous[a]}; time and channel extents stay {first[a]})",
                uri=uri,
            )
