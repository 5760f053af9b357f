"""From a plan's units to reads: nearby byte ranges merged, reads fit to the executor's
budget.

Units come in plan order per table (a :class:`~damacy_server.plan.units.UnitBlock`: the
units of one object together, by offset; those in the chunk cache were taken out before, see
the planner). Merging saves requests (one read for the units of a shard a batch touches); the
in-flight budget then shapes what the executor is asked to read. A read names its units by
index in their block: no object per unit.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from damacy_protocol.limits import PlanLimits
from damacy_server import native
from damacy_server.plan.units import UnitBlock, UnitJob
from damacy_server.store import is_remote


def take(values: list, picks: range | list[int]) -> list:
    """``values`` at ``picks`` (a range or a list of indices), by C loops."""
    if isinstance(picks, range):
        return values[picks.start : picks.stop]
    return list(map(values.__getitem__, picks))


class ReadGroup:
    """One read: a byte range (``length`` -1: the whole) of one object, holding one or more
    units of ``block`` (``picks``: their indices in it, a range or a list, in order). The
    units' views (:class:`UnitJob`) are made only when asked for (:attr:`units`)."""

    __slots__ = ("key", "offset", "length", "block", "picks", "_units")

    def __init__(self, key: str, offset: int, length: int, block: UnitBlock, picks: range | list[int]) -> None:
        self.key = key
        self.offset = offset
        self.length = length
        self.block = block
        self.picks = picks
        self._units: list[UnitJob] | None = None

    @classmethod
    def of_unit(cls, block: UnitBlock, i: int) -> ReadGroup:
        """A read of unit ``i`` of ``block`` alone."""
        return cls(block.key(i), int(block.offsets[i]), int(block.nbytes[i]), block, range(i, i + 1))

    def __len__(self) -> int:
        return len(self.picks)

    @property
    def meta(self):
        return self.block.meta

    @property
    def units(self) -> list[UnitJob]:
        """The views of its units, in order (made once)."""
        units = self._units
        if units is None:
            units = self._units = self.block.jobs(self.picks)
        return units

    def names(self) -> list:
        """Its units' names (chunk cache, units in flight)."""
        return take(self.block.names, self.picks)

    def shareds(self) -> list:
        """Its units' registrations while executed (None: none)."""
        return take(self.block.shared, self.picks)

    @property
    def decoded_nbytes(self) -> int:
        """The bytes its units decode to."""
        return len(self.picks) * self.block.decoded_nbytes

    @property
    def reserve_nbytes(self) -> int:
        """Memory this read needs while in flight: its bytes plus its decoded units."""
        decoded = self.decoded_nbytes
        encoded = self.length if self.length >= 0 else decoded + decoded // 64 + 4096
        return encoded + decoded

    def __repr__(self) -> str:
        return f"ReadGroup({self.key!r}, offset={self.offset}, length={self.length}, units={len(self.picks)})"


class Caps(NamedTuple):
    """What an executor admits, as the plan sees it: the stored and decoded bytes of one
    chunk (None: no cap), the largest read, and the most chunks one read holds (a CPU
    executor's read buffer, ``CpuLimits.chunks_per_input_buffer``)."""

    max_encoded: int | None = None
    max_decoded: int | None = None
    max_read_bytes: int | None = None
    max_units_per_read: int | None = None


def merge_reads(block: UnitBlock, limits: PlanLimits, caps: Caps | None = None) -> tuple[list[ReadGroup], int]:
    """Group a table's units into reads: ranges of one object closer than ``max_gap_bytes``
    become one, up to ``max_read_bytes`` (and the executor's ``caps``: its largest read, its
    most chunks per read); a unit stored as a whole object is a read of its own. Returns the
    reads and how many ranges merging saved. One native pass where the module is built
    (:func:`merge_reads_numpy` otherwise); Python per read, not per unit."""
    n = len(block)
    if not n:
        return [], 0
    read_cap = caps.max_read_bytes if caps is not None and caps.max_read_bytes is not None else None
    most_units = caps.max_units_per_read if caps is not None and caps.max_units_per_read is not None else 1 << 62
    if is_remote(block.key(0)):  # (an array's objects are one store's)
        gap, most = limits.remote_max_gap_bytes, limits.remote_max_read_bytes
    else:
        gap, most = limits.max_gap_bytes, limits.max_read_bytes
    if read_cap is not None:
        most = min(read_cap, most)
    args = (block.owners, block.offsets, block.nbytes, gap, most, most_units)
    found = native.merge_reads(*args)
    starts, ends = found if found is not None else merge_reads_numpy(*args)
    objects, owners, offsets = block.objects, block.owners, block.offsets
    first = starts[:-1]
    keys = take(objects, owners[first].tolist())
    los = offsets[first].tolist()
    ends_l = ends.tolist()
    bounds = starts.tolist()
    groups = [
        ReadGroup(key, 0, -1, block, range(a, b)) if end < 0 else ReadGroup(key, lo, end - lo, block, range(a, b))
        for key, lo, end, a, b in zip(keys, los, ends_l, bounds, bounds[1:])
    ]
    return groups, n - len(groups)


def merge_reads_numpy(owners: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray, gap: int, most: int, most_units: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`native.merge_reads`'s grouping, for builds without the native module: per read
    its first unit (then the count of units), and the end of its bytes (-1: a whole object)."""
    starts: list[int] = []
    ends: list[int] = []
    open_ = False
    first = end = held = owner = 0
    for i, (o, off, nb) in enumerate(zip(owners.tolist(), offsets.tolist(), nbytes.tolist())):
        if nb < 0:
            starts.append(i)
            ends.append(-1)
            open_ = False
            continue
        stop = off + nb
        if open_ and o == owner and off - end <= gap and stop - first <= most and held < most_units:
            end = max(end, stop)
            ends[-1] = end
            held += 1
            continue
        starts.append(i)
        ends.append(stop)
        first, end, held, owner, open_ = off, stop, 1, o, True
    starts.append(len(owners))
    return np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)


def shrink(group: ReadGroup, keep: list[bool]) -> ReadGroup | None:
    """``group`` holding only the units ``keep`` marks (its range shrinks to theirs); None
    when none is left."""
    if all(keep):
        return group
    picks = [i for i, y in zip(group.picks, keep) if y]
    if not picks:
        return None
    block = group.block
    if group.length < 0:
        return ReadGroup(group.key, group.offset, group.length, block, picks)
    at = np.asarray(picks, dtype=np.int64)
    start = int(block.offsets[at].min())
    end = int((block.offsets[at] + block.nbytes[at]).max())
    return ReadGroup(group.key, start, end - start, block, picks)


def fit_reads(groups: list[ReadGroup], capacity: int | None) -> list[ReadGroup]:
    """Merged reads too large for ``capacity`` bytes in flight are read unit by unit again."""
    if capacity is None:
        return groups
    out = []
    for g in groups:
        if g.reserve_nbytes > capacity and len(g) > 1:
            out.extend(ReadGroup.of_unit(g.block, i) for i in g.picks)
        else:
            out.append(g)
    return out
