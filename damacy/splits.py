"""Train/validation/test splits along chunk boundaries: no chunk feeds two splits.

Boxes drawn from a split's regions read only that split's chunks, so neither a sample nor a
decoded chunk of one split ever holds data of another (samples cut at random from whole
volumes would leak neighbouring voxels of the validation set into training).
:func:`split_chunks` cuts each array along ``axis`` into blocks of ``block`` chunks (the
decoded chunks: the inner chunks of a sharded array), or takes whole arrays (``axis=None``),
shuffles the blocks of all arrays from ``seed`` and deals them out by ``fractions``;
neighbouring blocks of one split merge into one region. The samplers take the regions
(``RandomBoxes(regions=split.regions("train"), ...)``, ``GridBoxes(regions=...)``);
:meth:`Split.owner` and :meth:`Split.filter` place samples of any other kind. A split is plain
data: ``state_dict()`` / ``Split.from_state`` keep it with a checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from damacy.windows import ChunksOf, check_seed, metadata_chunks
from damacy_protocol.errors import InvalidArgument
from damacy_protocol.samples import IndexQuery, Sample
from damacy_protocol.selection import expand

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Split:
    """Per split name, per array, its regions ([start, stop) per axis), in array order."""

    parts: dict[str, dict[str, list[Box]]]
    params: dict[str, Any] = field(default_factory=dict)

    def regions(self, name: str) -> list[tuple[str, Box]]:
        """The regions of split ``name`` as (uri, box) pairs, for the samplers' ``regions=``."""
        if name not in self.parts:
            raise InvalidArgument(f"no split named {name!r}; the splits are {sorted(self.parts)}")
        return [(uri, box) for uri, boxes in self.parts[name].items() for box in boxes]

    def owner(self, sample: Any) -> str | None:
        """The split whose regions hold every element ``sample`` reads (None: it reads from
        more than one split, or outside them all). Axes the selection leaves open (``a:``,
        ``...``, axes not named) reach the array's edges, known from the shapes
        :func:`split_chunks` records. A MultiSample (arrays read at one box) belongs where
        its parts of the split's arrays do (its label maps and masks, arrays the split does
        not name, follow them); None where they differ or none is the split's."""
        parts = getattr(sample, "parts", None)
        if isinstance(parts, Mapping):
            known = [p for p in parts.values() if any(p.uri in arrays for arrays in self.parts.values())]
            owners = {self.owner(p) for p in known}
            return owners.pop() if len(owners) == 1 else None
        if not isinstance(sample, (Sample, IndexQuery)):
            raise InvalidArgument(f"a split places samples (Sample, IndexQuery, MultiSample), got {type(sample).__name__}")
        spans = None
        for name, arrays in self.parts.items():
            for box in arrays.get(sample.uri, ()):
                if spans is None:
                    spans = _spans(sample, len(box), self._shape(sample.uri))
                if all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(spans, box)):
                    return name
        return None

    def _shape(self, uri: str) -> tuple[int, ...] | None:
        """The array's shape, where the split recorded it (states saved before it did: None)."""
        shapes = self.params.get("shapes")
        arrays = self.params.get("arrays")
        if not shapes or not arrays or uri not in arrays:
            return None
        return tuple(int(n) for n in shapes[list(arrays).index(uri)])

    def filter(self, samples: Iterable[Any], name: str) -> list[Any]:
        """The samples that read only split ``name``'s data."""
        if name not in self.parts:
            raise InvalidArgument(f"no split named {name!r}; the splits are {sorted(self.parts)}")
        return [s for s in samples if self.owner(s) == name]

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "params": self.params,
            "parts": {n: {u: [[list(r) for r in box] for box in boxes] for u, boxes in arrays.items()} for n, arrays in self.parts.items()},
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Split:
        if state.get("version") != 1:
            raise InvalidArgument(f"a split state of version {state.get('version')!r}; this damacy reads version 1")
        parts = {n: {u: [tuple((int(a), int(b)) for a, b in box) for box in boxes] for u, boxes in arrays.items()} for n, arrays in state["parts"].items()}
        return cls(parts, dict(state.get("params", {})))


def _spans(sample: Sample | IndexQuery, ndim: int, shape: tuple[int, ...] | None) -> list[tuple[int, int]]:
    """Per axis of the ``ndim``-d array, the [start, stop) the sample's selection reaches."""
    out = []
    for axis, entry in enumerate(expand(sample.selection, ndim, sample.uri)):
        if isinstance(entry, slice):
            stop = entry.stop if entry.stop is not None else shape[axis] if shape is not None else None
            if stop is None:
                raise InvalidArgument(
                    f"axis {axis}: the selection reaches the array's end, whose place this split did not record "
                    "(made before split_chunks kept shapes); give the box's stop on every axis",
                    uri=sample.uri,
                )
            out.append((entry.start or 0, stop))
        elif isinstance(entry, int):
            out.append((entry, entry + 1))
        else:
            values = list(entry)
            out.append((min(values), max(values) + 1) if values else (0, 0))
    return out


def split_chunks(
    arrays: Sequence[str],
    fractions: Mapping[str, float],
    *,
    seed: int,
    axis: int | None = 0,
    block: int = 1,
    chunks_of: ChunksOf | None = None,
) -> Split:
    """Split ``arrays`` by ``fractions`` ({name: share}, shares summing to 1) along chunk
    boundaries: blocks of ``block`` chunks along ``axis`` (None: whole arrays), shuffled from
    ``seed`` and dealt out so each split gets its share of the blocks (rounded; every split
    named gets at least one block when there are enough)."""
    if not fractions:
        raise InvalidArgument("fractions names at least one split")
    shares = {str(k): float(v) for k, v in fractions.items()}
    if any(not math.isfinite(v) or v < 0 for v in shares.values()) or abs(sum(shares.values()) - 1) > 1e-6:
        raise InvalidArgument(f"fractions must be non-negative shares summing to 1, got {dict(fractions)}")
    if not isinstance(block, int) or block < 1:
        raise InvalidArgument(f"block must be a positive number of chunks, got {block!r}")
    check_seed(seed)
    if axis is not None and (isinstance(axis, bool) or not isinstance(axis, (int, np.integer))):
        raise InvalidArgument(f"axis must be an axis number or None (whole arrays), got {axis!r}")
    chunks_of = chunks_of or metadata_chunks
    uris = [str(u) for u in arrays]
    if len(set(uris)) != len(uris) or not uris:
        raise InvalidArgument("split_chunks takes a list of distinct arrays")
    blocks: list[tuple[int, int, int]] = []  # (array, start, stop) along the axis
    shapes = []
    for k, uri in enumerate(uris):
        shape, chunks, _ = chunks_of(uri, None)
        shapes.append(tuple(shape))
        if axis is None:
            blocks.append((k, 0, 0))
            continue
        if not -len(shape) <= axis < len(shape):
            raise InvalidArgument(f"axis {axis} is not an axis of the {len(shape)}-d array", uri=uri)
        a = axis % len(shape)
        step = chunks[a] * block
        blocks.extend((k, lo, min(lo + step, shape[a])) for lo in range(0, shape[a], step))
    order = np.random.default_rng([int(seed), 7]).permutation(len(blocks)).tolist()
    names = list(shares)
    counts = _deal(len(blocks), [shares[n] for n in names])
    parts: dict[str, dict[str, list[Box]]] = {n: {} for n in names}
    at = 0
    for name, count in zip(names, counts):
        mine = sorted(blocks[i] for i in order[at : at + count])
        at += count
        for k, lo, hi in mine:
            shape = shapes[k]
            boxes = parts[name].setdefault(uris[k], [])
            if axis is None:
                boxes.append(tuple((0, n) for n in shape))
                continue
            a = axis % len(shape)
            if boxes and boxes[-1][a][1] == lo:  # the block after the last: one region
                last = list(boxes[-1])
                last[a] = (last[a][0], hi)
                boxes[-1] = tuple(last)
            else:
                boxes.append(tuple((lo, hi) if d == a else (0, n) for d, n in enumerate(shape)))
    params = {
        "arrays": uris, "fractions": shares, "seed": int(seed), "axis": axis, "block": block,
        "shapes": [list(shape) for shape in shapes],
    }
    return Split(parts, params)


def _deal(n: int, shares: list[float]) -> list[int]:
    """``n`` blocks by ``shares``: largest remainders, then at least one for every non-zero
    share while another split can spare one."""
    raw = [s * n for s in shares]
    counts = [int(math.floor(r)) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - counts[i], reverse=True)[: n - sum(counts)]:
        counts[i] += 1
    for i, s in enumerate(shares):
        if s > 0 and counts[i] == 0:
            donor = max(range(len(counts)), key=lambda j: counts[j])
            if counts[donor] > 1:
                counts[donor] -= 1
                counts[i] += 1
    return counts
