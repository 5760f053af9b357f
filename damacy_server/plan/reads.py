"""From a plan's units to reads: nearby byte ranges merged, reads fit to the executor's
budget.

Units come in plan order (the units of one object together, by offset; those in the chunk
cache were taken out before, see the planner). Merging saves requests (one read for the
units of a shard a batch touches); the in-flight budget then shapes what the executor is
asked to read.
"""

from __future__ import annotations

from typing import NamedTuple

from damacy_protocol.limits import PlanLimits
from damacy_server.plan.units import UnitJob
from damacy_server.store import is_remote


class ReadGroup:
    """One read: a byte range (``length`` -1: the whole) of one object, holding one or more
    units (the executor's reader reads it). Its units are given at construction or by
    :meth:`add` (what it decodes to is kept, not summed anew: executors ask for it a few
    times per read, and a merged read of small units holds hundreds)."""

    __slots__ = ("key", "offset", "length", "units", "decoded_nbytes")

    def __init__(self, key: str, offset: int, length: int, units: list[UnitJob]) -> None:
        self.key = key
        self.offset = offset
        self.length = length
        self.units = units
        #: the bytes its units decode to
        self.decoded_nbytes = sum(u.decoded_nbytes for u in units)

    def add(self, unit: UnitJob) -> None:
        self.units.append(unit)
        self.decoded_nbytes += unit.decoded_nbytes

    @property
    def reserve_nbytes(self) -> int:
        """Memory this read needs while in flight: its bytes plus its decoded units."""
        decoded = self.decoded_nbytes
        encoded = self.length if self.length >= 0 else decoded + decoded // 64 + 4096
        return encoded + decoded

    def __repr__(self) -> str:
        return f"ReadGroup({self.key!r}, offset={self.offset}, length={self.length}, units={len(self.units)})"


class Caps(NamedTuple):
    """What an executor admits, as the plan sees it: the stored and decoded bytes of one
    chunk (None: no cap), the largest read, and the most chunks one read holds (a CPU
    executor's read buffer, ``CpuLimits.chunks_per_input_buffer``)."""

    max_encoded: int | None = None
    max_decoded: int | None = None
    max_read_bytes: int | None = None
    max_units_per_read: int | None = None


def merge_reads(jobs: list[UnitJob], limits: PlanLimits, caps: Caps | None = None) -> tuple[list[ReadGroup], int]:
    """Group units into reads: ranges of one object closer than ``max_gap_bytes`` become one,
    up to ``max_read_bytes`` (and the executor's ``caps``: its largest read, its most chunks
    per read). ``jobs`` come in plan order: the units of one object together, by offset."""
    groups: list[ReadGroup] = []
    merged = 0
    read_cap = caps.max_read_bytes if caps is not None and caps.max_read_bytes is not None else None
    most_units = caps.max_units_per_read if caps is not None and caps.max_units_per_read is not None else 1 << 62
    local = (limits.max_gap_bytes, limits.max_read_bytes if read_cap is None else min(read_cap, limits.max_read_bytes))
    remote = (
        limits.remote_max_gap_bytes,
        limits.remote_max_read_bytes if read_cap is None else min(read_cap, limits.remote_max_read_bytes),
    )
    current: ReadGroup | None = None
    end = 0
    key, gap, most = None, 0, 0
    for job in jobs:
        if job.nbytes < 0:
            groups.append(ReadGroup(job.key, 0, -1, [job]))
            current = None
            continue
        if job.key != key:  # jobs come by object: its limits once per object
            key = job.key
            gap, most = remote if is_remote(key) else local
        stop = job.offset + job.nbytes
        if (
            current is not None and key == current.key and job.offset - end <= gap and stop - current.offset <= most
            and len(current.units) < most_units
        ):
            if stop > end:
                end = stop
                current.length = end - current.offset
            current.add(job)
            merged += 1
            continue
        current = ReadGroup(job.key, job.offset, job.nbytes, [job])
        end = stop
        groups.append(current)
    return groups, merged


def shrink(group: ReadGroup, units: list[UnitJob]) -> ReadGroup | None:
    """``group`` holding only ``units`` (its range shrinks to theirs); None when none is left."""
    if len(units) == len(group.units):
        return group
    if not units:
        return None
    if group.length < 0:
        return ReadGroup(group.key, group.offset, group.length, units)
    start = min(u.offset for u in units)
    end = max(u.offset + u.nbytes for u in units)
    return ReadGroup(group.key, start, end - start, units)


def fit_reads(groups: list[ReadGroup], capacity: int | None) -> list[ReadGroup]:
    """Merged reads too large for ``capacity`` bytes in flight are read unit by unit again."""
    if capacity is None:
        return groups
    out = []
    for g in groups:
        if g.reserve_nbytes > capacity and len(g.units) > 1:
            out.extend(ReadGroup(g.key, u.offset, u.nbytes, [u]) for u in g.units)
        else:
            out.append(g)
    return out
