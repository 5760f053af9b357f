"""How a metadata cache that outlives a run tells an array re-created in storage: by the
versions of the metadata documents each cached entry was read from.

A document's version is what its store says of it (a file's inode, size and times, an
object's ETag and time: ``Store.version``), asked before the document is read, so a change
in between is seen by the next check, never missed. An entry keeps the documents it was built
from (an array its ``zarr.json``, or v2's ``.zarray`` and ``.zattrs``; a level an image's
consolidated metadata describes the group's document; an image its group's and its levels')
with their versions then, and when they were last found unchanged. Caches of what the
documents describe (shard indexes, decoded chunks, the disk tier) name their entries by the
versions, so a re-created array's old entries are never taken for the new one's: they leave
by the caches' own order.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from damacy_server.store import MISSING, Store

#: a version that could not be asked (the request failed): unknown, asked again at the next
#: check, and the entry read anew once it is known
UNKNOWN = "unknown"


def node_version(store: Store, root: str) -> Hashable | None:
    """The version of the node's metadata: of its ``zarr.json``, or of v2's ``.zarray`` or
    ``.zgroup`` with ``.zattrs`` (and a group's ``.zmetadata``); MISSING when there is none;
    None when the store cannot tell (its documents are taken never to change); UNKNOWN when
    asking failed."""
    try:
        found = store.version(store.join(root, "zarr.json"))
        if found != MISSING:
            return None if found is None else ("zarr.json", found)
        for name in (".zarray", ".zgroup"):
            found = store.version(store.join(root, name))
            if found != MISSING:
                extra = (".zattrs", ".zmetadata") if name == ".zgroup" else (".zattrs",)
                return (name, found, *(store.version(store.join(root, n)) for n in extra))
        return MISSING
    except Exception:
        return UNKNOWN


def differs(then: Hashable | None, now: Hashable | None) -> bool:
    """Whether a document whose version was ``then`` changed, being ``now``: never when the
    store cannot tell (None) or asking failed now; when it failed then and is known now (the
    entry is read anew once, to know what it was read from)."""
    if then is None or now is None or now == UNKNOWN:
        return False
    return then == UNKNOWN or then != now


@dataclass
class Seen:
    """The documents (their roots, in ``store``) a cached entry was read from with their
    versions then, and when they were last found unchanged (``time.monotonic()``: the time
    the reading began, at first)."""

    store: Store
    docs: tuple[tuple[str, Hashable | None], ...]
    checked: float

    @functools.cached_property
    def version(self) -> tuple | None:
        """The documents' versions (None when no store could tell one)."""
        versions = tuple(v for _, v in self.docs)
        return None if all(v is None for v in versions) else versions


def known(version: Hashable | None) -> bool:
    """Whether every document's version in ``version`` (a :attr:`Seen.version`) was asked:
    one that could not be says nothing of what was read, so nothing may be named by it."""
    return version is not None and UNKNOWN not in version


class Generations:
    """A small number per (root, version): what in-memory caches of an array's data key its
    entries by (a version is a nested tuple, slower to hash on the hot path). The same known
    version gives the same number, so an array read again, unchanged, keeps its entries; a
    version not all asked gets a number of its own each time (two reads whose versions could
    not be asked may be of other contents). The numbers of the last ``most`` versions are
    kept: one older than that gets a new number (its entries are then missed once)."""

    def __init__(self, most: int = 1 << 16) -> None:
        self._numbers: OrderedDict[tuple[str, Hashable], int] = OrderedDict()
        self._next = itertools.count(1)
        self._lock = threading.Lock()
        self._most = most

    def of(self, root: str, version: Hashable | None) -> int:
        if version is None:
            return 0
        with self._lock:
            if not known(version):
                return next(self._next)
            key = (root, version)
            number = self._numbers.get(key)
            if number is None:
                number = self._numbers[key] = next(self._next)
                if len(self._numbers) > self._most:
                    self._numbers.popitem(last=False)
            else:
                self._numbers.move_to_end(key)
            return number
