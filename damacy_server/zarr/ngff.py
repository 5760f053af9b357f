"""OME-NGFF images (0.5 on Zarr v3, 0.4 on Zarr v2): a multiscale group resolves to the array
of one of its levels."""

from __future__ import annotations

from typing import Any

from damacy_protocol.errors import InvalidArgument, MetadataError


def multiscale_path(group: dict[str, Any], uri: str, level: int = 0) -> str | None:
    """The path (relative to the group) of multiscale level ``level``, or ``None`` when the
    group is not an NGFF image."""
    attrs = group.get("attributes") or {}
    ome = attrs.get("ome") if isinstance(attrs, dict) else None
    multiscales = ome.get("multiscales") if isinstance(ome, dict) else None
    if multiscales is None and isinstance(attrs, dict):  # NGFF 0.4 (Zarr v2): at the top of .zattrs
        multiscales = attrs.get("multiscales")
    if multiscales is None:
        return None
    if not isinstance(multiscales, list) or not multiscales or not isinstance(multiscales[0], dict):
        raise MetadataError("NGFF attributes.ome.multiscales must be a non-empty list of objects", uri=uri)
    datasets = multiscales[0].get("datasets")
    if not isinstance(datasets, list) or not datasets:
        raise MetadataError("NGFF multiscales[0].datasets must be a non-empty list", uri=uri)
    if not 0 <= level < len(datasets):
        raise InvalidArgument(f"NGFF image has {len(datasets)} levels, level {level} asked", uri=uri)
    path = datasets[level].get("path") if isinstance(datasets[level], dict) else None
    if not isinstance(path, str) or not path or path.startswith("/") or ".." in path.split("/"):
        raise MetadataError(f"NGFF dataset path {path!r} is not a relative path inside the image", uri=uri)
    return path
