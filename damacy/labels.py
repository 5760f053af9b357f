"""Label-aware boxes: where a sampler centres its boxes, and how much foreground they hold.

Per array a coarse label map (a numpy array or the uri of an array, read once; any shape, each
element standing for the part of the array it scales to: a label image's low level serves).
From it :class:`LabelMaps` keeps, per class, the coordinates of the class's elements (to
centre a box on a point of a class drawn by ratios, as MONAI's crops by label classes do) and
a summed-area table of the foreground (nonzero), so the share of foreground in any box is a
handful of lookups, never a read of the full-resolution labels (gunpowder's minimum masked
fraction). Every draw comes from :mod:`damacy.order`'s streams: deterministic from (seed,
epoch, sample) and resumable like the rest.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from itertools import product
from typing import Any

import numpy as np

from damacy import order
from damacy_protocol.errors import InvalidArgument

#: the class a plain foreground mask gives its nonzero elements
FOREGROUND = "foreground"


def load_maps(maps: Sequence[Any] | Mapping[str, Any] | None, arrays: Sequence[tuple[Any, tuple[int, ...]]], what: str) -> list[np.ndarray | None] | None:
    """Per array its map as a numpy array (None: none), from a list beside ``arrays`` or
    {uri: map}; a uri is read here, once."""
    if maps is None:
        return None
    if isinstance(maps, Mapping):
        keys = {str(where) for where, _ in arrays if not isinstance(where, dict)}
        unknown = set(map(str, maps)) - keys
        if unknown:
            raise InvalidArgument(f"{what} names {sorted(unknown)}, which are not among the arrays")
        by_uri = {str(k): v for k, v in maps.items()}
        given = [None if isinstance(where, dict) else by_uri.get(str(where)) for where, _ in arrays]
    else:
        given = list(maps)
        if len(given) != len(arrays):
            raise InvalidArgument(f"{what} lists {len(given)} {_noun(what)} for {len(arrays)} arrays")
    out: list[np.ndarray | None] = []
    for (where, shape), m in zip(arrays, given):
        name = str(next(iter(where.values())) if isinstance(where, dict) else where)
        if m is None:
            out.append(None)
            continue
        if isinstance(m, (str, os.PathLike)):
            from damacy_server.read import read

            m = read(os.fspath(m))
        m = np.asarray(m)
        if m.ndim != len(shape):
            raise InvalidArgument(f"the {what} {_noun(what)[:-1]} has {m.ndim} axes, the array {len(shape)}", uri=name)
        if 0 in shape:
            raise InvalidArgument(f"the array has no elements (shape {tuple(shape)}): a {what} {_noun(what)[:-1]} has nothing to place boxes on", uri=name)
        out.append(m)
    return out if any(m is not None for m in out) else None


def _noun(what: str) -> str:
    return "masks" if what == "foreground" else "maps"


class LabelMaps:
    """The label maps of a sampler's arrays (None where an array has none).

    ``classes``: None to treat each map as a foreground mask (nonzero: :data:`FOREGROUND`),
    else the label values to keep coordinates of (those a sampler's ratios name)."""

    def __init__(self, maps: list[np.ndarray | None], names: list[str], classes: Sequence[Any] | None = None) -> None:
        self.cells: list[dict[Any, np.ndarray] | None] = []
        self.shapes: list[np.ndarray | None] = []
        self._sat: list[np.ndarray | None] = []
        for m, name in zip(maps, names):
            if m is None:
                self.cells.append(None)
                self.shapes.append(None)
                self._sat.append(None)
                continue
            if classes is None:
                found = {FOREGROUND: np.argwhere(m != 0)}
                if not len(found[FOREGROUND]):
                    raise InvalidArgument("the foreground mask has no foreground", uri=name)
            else:
                found = {c: cells for c in classes if len(cells := np.argwhere(m == c))}
                if not found:
                    raise InvalidArgument(f"the label map holds none of the classes {sorted(map(str, classes))}", uri=name)
            self.cells.append(found)
            self.shapes.append(np.array(m.shape, dtype=np.float64))
            sat = np.zeros(tuple(n + 1 for n in m.shape), dtype=np.int64)  # summed-area table, a zero border
            sat[tuple(slice(1, None) for _ in m.shape)] = (m != 0).astype(np.int64)
            for ax in range(m.ndim):
                np.cumsum(sat, axis=ax, out=sat)
            self._sat.append(sat)

    def has(self, a: int) -> bool:
        return self.cells[a] is not None

    def points(self, k: np.uint64, idx: np.ndarray, a: int, cls: Any, shape: np.ndarray, cell_stream: int, point_stream: int) -> np.ndarray:
        """A point of the array per sample, uniform over the elements of class ``cls`` (each
        element spread over the part of the array it stands for)."""
        cells = self.cells[a][cls]
        cell = cells[order.integers(k, idx, cell_stream, len(cells))]
        within = np.stack([order.uniform(k, idx, point_stream + ax) for ax in range(len(shape))], axis=1)
        return np.floor((cell + within) * (shape / self.shapes[a])).astype(np.int64)

    def fraction(self, a: int, origins: np.ndarray, sizes: np.ndarray, shape: np.ndarray) -> np.ndarray:
        """The share of foreground in each box (origins, sizes: (n, ndim) in the array), on
        the map's resolution: the map elements a box touches, weighted by how much of each it
        covers."""
        sat = self._sat[a]
        scale = self.shapes[a] / shape  # map elements per array element
        lo = np.clip(origins * scale, 0, self.shapes[a])
        hi = np.clip((origins + sizes) * scale, 0, self.shapes[a])
        volume = np.prod(np.maximum(hi - lo, 1e-12), axis=1)
        return np.clip(_box_sum(sat, lo, hi) / volume, 0.0, 1.0)


def _box_sum(sat: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The sum of the map over fractional boxes [lo, hi) (map coordinates), from its
    summed-area table, interpolating linearly between the table's whole-element corners."""
    ndim = lo.shape[1]
    total = np.zeros(len(lo), dtype=np.float64)
    for corner in product((0, 1), repeat=ndim):
        point = np.where(np.array(corner, dtype=bool), hi, lo)
        sign = (-1) ** (ndim - sum(corner))
        total += sign * _sat_at(sat, point)
    return total


def _sat_at(sat: np.ndarray, point: np.ndarray) -> np.ndarray:
    """The summed-area table at fractional points: multilinear between its grid values."""
    ndim = point.shape[1]
    base = np.floor(point).astype(np.int64)
    frac = point - base
    limit = np.array(sat.shape, dtype=np.int64) - 1
    out = np.zeros(len(point), dtype=np.float64)
    for corner in product((0, 1), repeat=ndim):
        c = np.array(corner, dtype=np.int64)
        at = np.minimum(base + c, limit)
        weight = np.prod(np.where(c == 1, frac, 1.0 - frac), axis=1)
        out += weight * sat[tuple(at.T)]
    return out


def check_ratios(ratios: Mapping[Any, float]) -> tuple[list[Any], np.ndarray]:
    """(classes, probabilities) of a sampler's ``label_ratios``."""
    if not isinstance(ratios, Mapping) or not ratios:
        raise InvalidArgument(f"label_ratios must be {{class: weight}} with at least one class, got {ratios!r}")
    classes = list(ratios)
    values = [ratios[c] for c in classes]
    if any(isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)) for v in values):
        raise InvalidArgument(f"label_ratios' weights must be numbers, got {dict(ratios)}")
    w = np.array(values, dtype=np.float64)
    if not np.all(np.isfinite(w)) or (w < 0).any() or w.sum() <= 0:
        raise InvalidArgument(f"label_ratios' weights must be non-negative numbers, not all 0, got {dict(ratios)}")
    return classes, w / w.sum()
