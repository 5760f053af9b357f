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

import itertools
import threading
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

    @property
    def version(self) -> tuple | None:
        """The documents' versions (None when no store could tell one)."""
        versions = tuple(v for _, v in self.docs)
        return None if all(v is None for v in versions) else versions


class Generations:
    """A small number per (root, version): what in-memory caches of an array's data key its
    entries by (a version is a nested tuple, slower to hash on the hot path). The same
    version gives the same number, so an array read again, unchanged, keeps its entries."""

    def __init__(self) -> None:
        self._numbers: dict[tuple[str, Hashable], int] = {}
        self._next = itertools.count(1)
        self._lock = threading.Lock()

    def of(self, root: str, version: Hashable | None) -> int:
        if version is None:
            return 0
        key = (root, version)
        with self._lock:
            number = self._numbers.get(key)
            if number is None:
                number = self._numbers[key] = next(self._next)
            return number
