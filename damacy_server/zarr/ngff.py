"""OME-NGFF images (0.5 on Zarr v3, 0.4 on Zarr v2): a multiscale group resolves to the array
of one of its levels."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from damacy_protocol.errors import DamacyError, InvalidArgument, MetadataError, UnsupportedOperation


def multiscale_path(group: dict[str, Any], uri: str, level: int = 0) -> str | None:
    """The path (relative to the group) of multiscale level ``level``, or ``None`` when the
    group is not an NGFF image."""
    found = image_multiscale(group, uri)
    if found is None:
        return None
    multiscale = found[1]
    datasets = multiscale.get("datasets")
    if not isinstance(datasets, list) or not datasets:
        raise MetadataError("NGFF multiscales[0].datasets must be a non-empty list", uri=uri)
    if not 0 <= level < len(datasets):
        raise InvalidArgument(f"NGFF image has {len(datasets)} levels, level {level} asked", uri=uri)
    path = datasets[level].get("path") if isinstance(datasets[level], dict) else None
    if not isinstance(path, str) or not path or path.startswith("/") or ".." in path.split("/"):
        raise MetadataError(f"NGFF dataset path {path!r} is not a relative path inside the image", uri=uri)
    return path


# -- images: levels, axes and scales -----------------------------------------------------------


@dataclass(frozen=True)
class Axis:
    name: str
    type: str | None  # "space", "time", "channel", or None when the metadata says none
    unit: str | None


@dataclass(frozen=True)
class Level:
    """One resolution level: its array's uri and ``path`` in the image, shape and dtype, and
    the voxel size (``scale``) and offset (``translation``) per axis, in the axes' units. A
    level that cannot be read (missing, malformed) has its ``error`` instead (shape ``()``,
    dtype None, no scale): it fails the samples that read it, never the image's other levels."""

    index: int
    path: str
    uri: str
    shape: tuple[int, ...]
    dtype: np.dtype | None
    scale: tuple[float, ...]
    translation: tuple[float, ...]
    error: DamacyError | None = None


@dataclass(frozen=True)
class Image:
    """An OME-NGFF multiscale image (its first multiscale): ``damacy.open_image``."""

    uri: str
    version: str | None
    name: str | None
    axes: tuple[Axis, ...]
    levels: tuple[Level, ...]

    def level_for(self, scale: Any) -> int:
        """The level whose voxel size is closest to ``scale``: one number for every spatial
        axis, a sequence with one per spatial axis (in axis order), or a mapping from axis
        name to size. Closest means the smallest worst-axis ratio, ``max |log(level / target)|``
        over the axes given (so an anisotropic level is judged by its most distant axis);
        on a tie the finer level (the lower index) wins."""
        spatial = [k for k, a in enumerate(self.axes) if a.type == "space"] or [
            k for k, a in enumerate(self.axes) if a.name.lower() in ("x", "y", "z")
        ]
        if isinstance(scale, dict):
            names = {a.name: k for k, a in enumerate(self.axes)}
            unknown = sorted(set(scale) - set(names))
            if unknown:
                raise InvalidArgument(f"scale names axes {unknown} the image does not have ({[a.name for a in self.axes]})", uri=self.uri)
            targets = {names[n]: v for n, v in scale.items()}
        else:
            if not spatial:
                raise InvalidArgument("the image has no spatial axes to match a scale to; give scale as {axis: size}", uri=self.uri)
            values = [scale] * len(spatial) if isinstance(scale, numbers.Real) else list(scale)
            if len(values) != len(spatial):
                names = [self.axes[k].name for k in spatial]
                raise InvalidArgument(f"scale has {len(values)} values for the {len(spatial)} spatial axes {names}", uri=self.uri)
            targets = dict(zip(spatial, values))
        if not targets or not all(
            isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_)) and math.isfinite(v) and v > 0 for v in targets.values()
        ):
            raise InvalidArgument(f"scale sizes must be positive finite numbers, got {scale!r}", uri=self.uri)

        def distance(level: Level) -> float:
            ratios = [level.scale[k] / t for k, t in targets.items()]
            return max(abs(math.log(r)) if 0 < r < math.inf else math.inf for r in ratios)

        readable = [i for i, level in enumerate(self.levels) if level.error is None]
        return min(readable, key=lambda i: (distance(self.levels[i]), i))


def image_multiscale(group: dict[str, Any], uri: str) -> tuple[str | None, dict[str, Any]] | None:
    """(version, first multiscale) of an NGFF group (0.5 under ``attributes.ome``, 0.4 at the
    top of the attributes), or None when the group is not an image."""
    attrs = group.get("attributes") or {}
    if not isinstance(attrs, dict):
        return None
    ome = attrs.get("ome")
    if isinstance(ome, dict) and ome.get("multiscales") is not None:
        version, multiscales = ome.get("version"), ome["multiscales"]
    elif attrs.get("multiscales") is not None:
        multiscales = attrs["multiscales"]
        version = multiscales[0].get("version") if isinstance(multiscales, list) and multiscales and isinstance(multiscales[0], dict) else None
    else:
        return None
    if not isinstance(multiscales, list) or not multiscales or not isinstance(multiscales[0], dict):
        raise MetadataError("NGFF multiscales must be a non-empty list of objects", uri=uri)
    return version, multiscales[0]


def parse_axes(multiscale: dict[str, Any], ndim: int, uri: str) -> tuple[Axis, ...]:
    axes = multiscale.get("axes")
    if axes is None:  # 0.3 and earlier: no axes; name them as the dimensions count from the end
        return tuple(Axis(n, "space" if n in "zyx" else None, None) for n in "tczyx"[5 - ndim :]) if ndim <= 5 else ()
    if not isinstance(axes, list) or len(axes) != ndim:
        raise MetadataError(f"NGFF axes must list {ndim} axes, got {axes!r}", uri=uri)
    out = []
    for a in axes:
        if isinstance(a, str):
            out.append(Axis(a, "space" if a in "zyx" else None, None))
        elif isinstance(a, dict) and isinstance(a.get("name"), str):
            out.append(Axis(a["name"], a.get("type") if isinstance(a.get("type"), str) else None, a.get("unit") if isinstance(a.get("unit"), str) else None))
        else:
            raise MetadataError(f"an NGFF axis must be a name or an object with a name, got {a!r}", uri=uri)
    return tuple(out)


def transforms(entries: Any, ndim: int, uri: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(scale, translation) of a coordinateTransformations list (identity where absent)."""
    scale, translation = [1.0] * ndim, [0.0] * ndim
    for t in entries or []:
        if not isinstance(t, dict):
            raise MetadataError(f"an NGFF coordinate transformation must be an object, got {t!r}", uri=uri)
        kind = t.get("type")
        if kind in ("scale", "translation"):
            values = t.get(kind)
            if not isinstance(values, list) or len(values) != ndim or not all(isinstance(v, (int, float)) for v in values):
                raise MetadataError(f"NGFF {kind} must list {ndim} numbers, got {values!r}", uri=uri)
            if kind == "scale":  # applied after what came before it: a translation listed earlier scales too
                scale = [a * b for a, b in zip(scale, values)]
                translation = [a * b for a, b in zip(translation, values)]
            else:
                translation = [a + b for a, b in zip(translation, values)]
        elif kind != "identity":
            raise UnsupportedOperation(f"NGFF coordinate transformation {kind!r} is not supported (scale, translation are)", uri=uri)
    return tuple(float(v) for v in scale), tuple(float(v) for v in translation)


# -- plates (high-content screening): wells of fields, each field an image ---------------------


@dataclass(frozen=True)
class Well:
    """One well of a plate: its path (``"A/1"``), row and column names, and the uris of its
    fields (each an NGFF image)."""

    path: str
    row: str
    column: str
    fields: tuple[str, ...]


@dataclass(frozen=True)
class Plate:
    """An OME-NGFF plate (``damacy.open_plate``): its rows, columns and wells, in the plate's
    order; ``images`` lists every field of every well (NGFF images: read one with
    ``damacy.open_image``, or give them to a sampler with ``level=``)."""

    uri: str
    version: str | None
    name: str | None
    rows: tuple[str, ...]
    columns: tuple[str, ...]
    wells: tuple[Well, ...]

    @property
    def images(self) -> list[str]:
        return [f for w in self.wells for f in w.fields]


def _ome(group: dict[str, Any], key: str) -> tuple[str | None, Any] | None:
    """(version, attributes[key]) under 0.5's ``ome`` or at 0.4's top level; None if absent."""
    attrs = group.get("attributes") or {}
    if not isinstance(attrs, dict):
        return None
    ome = attrs.get("ome")
    if isinstance(ome, dict) and ome.get(key) is not None:
        return ome.get("version"), ome[key]
    if attrs.get(key) is not None:
        value = attrs[key]
        return (value.get("version") if isinstance(value, dict) else None), value
    return None


def _relative(path: Any, what: str, uri: str) -> str:
    if not isinstance(path, str) or not path or path.startswith("/") or ".." in path.split("/"):
        raise MetadataError(f"NGFF {what} path {path!r} is not a relative path inside the group", uri=uri)
    return path


def plate_wells(group: dict[str, Any], uri: str) -> tuple[str | None, str | None, tuple[str, ...], tuple[str, ...], list[tuple[str, str, str]]]:
    """(version, name, rows, columns, [(well path, row, column)]) of an NGFF plate group."""
    found = _ome(group, "plate")
    if found is None:
        raise InvalidArgument("is not an NGFF plate (no plate in its group's attributes)", uri=uri)
    version, plate = found
    if not isinstance(plate, dict):
        raise MetadataError("NGFF plate must be an object", uri=uri)
    names = {}
    for key in ("rows", "columns"):
        entries = plate.get(key)
        if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("name"), str) for e in entries):
            raise MetadataError(f"NGFF plate {key} must be a list of objects with a name", uri=uri)
        names[key] = tuple(e["name"] for e in entries)
    wells = plate.get("wells")
    if not isinstance(wells, list):
        raise MetadataError("NGFF plate wells must be a list", uri=uri)
    out = []
    for w in wells:
        if not isinstance(w, dict):
            raise MetadataError("NGFF plate wells must be objects with a path", uri=uri)
        path = _relative(w.get("path"), "well", uri)
        row, col = w.get("rowIndex"), w.get("columnIndex")
        if row is not None or col is not None:
            for key, index, axis in (("rowIndex", row, "rows"), ("columnIndex", col, "columns")):
                if type(index) is not int or not 0 <= index < len(names[axis]):
                    raise MetadataError(f"NGFF plate well {path!r}: {key} {index!r} is not an index into the plate's {len(names[axis])} {axis}", uri=uri)
            out.append((path, names["rows"][row], names["columns"][col]))
        else:  # 0.4 before rowIndex: the path is row/column
            parts = path.split("/")
            out.append((path, parts[0], parts[-1]))
    name = plate.get("name") if isinstance(plate.get("name"), str) else None
    return version, name, names["rows"], names["columns"], out


def well_fields(group: dict[str, Any], uri: str) -> list[str]:
    """The paths of a well's fields (images), relative to the well."""
    found = _ome(group, "well")
    if found is None:
        raise InvalidArgument("is not an NGFF well (no well in its group's attributes)", uri=uri)
    images = found[1].get("images") if isinstance(found[1], dict) else None
    if not isinstance(images, list) or not all(isinstance(i, dict) for i in images):
        raise MetadataError("NGFF well images must be a list of objects with a path", uri=uri)
    return [_relative(i.get("path"), "field", uri) for i in images]
