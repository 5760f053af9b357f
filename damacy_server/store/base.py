"""The interface every storage backend implements: whole objects, byte ranges, sizes.

Keys are backend paths (for local files: absolute file paths). A missing object is not an
error at this level: reads return ``None`` so the format layer can read it as fill value.
Everything else that goes wrong raises :class:`damacy_protocol.StorageError` naming the key.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence

#: (offset, length) of a byte range; a negative offset selects the last ``-offset`` bytes.
ByteRange = tuple[int, int]

#: :meth:`Store.version` of an object that does not exist
MISSING = "missing"


class Store(ABC):
    """Synchronous access to one storage backend; safe to call from many threads at once."""

    __slots__ = ()

    @abstractmethod
    def read(self, key: str) -> bytes | None:
        """The whole object, or ``None`` when it does not exist."""

    @abstractmethod
    def read_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes] | None:
        """The given byte ranges of one object (each possibly short at the object's end),
        or ``None`` when the object does not exist."""

    def read_range(self, key: str, offset: int, length: int) -> bytes | None:
        """One byte range; see :meth:`read_ranges`."""
        got = self.read_ranges(key, [(offset, length)])
        return None if got is None else got[0]

    def read_range_sized(self, key: str, offset: int, length: int) -> tuple[bytes, int] | None:
        """One byte range and the object's size, or ``None`` when the object does not exist
        (backends that can do both in one request override this)."""
        size = self.size(key)
        data = None if size is None else self.read_range(key, offset, length)
        return None if data is None else (data, size)

    @abstractmethod
    def size(self, key: str) -> int | None:
        """The object's size in bytes, or ``None`` when it does not exist."""

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def version(self, key: str) -> Hashable | None:
        """What names the object's current contents (it changes when the object is written
        again: a file's inode, size and times, an object's ETag), :data:`MISSING` when there
        is no object, ``None`` when this store cannot tell (its objects are taken never to
        change: an icechunk snapshot's); raises StorageError when asking failed."""
        return None

    @abstractmethod
    def join(self, base: str, *parts: str) -> str:
        """The key of ``parts`` below ``base``."""

    def cache_key(self, key: str) -> str:
        """``key`` as a cache that outlives this process names the object (the disk tier):
        with what the key leaves open added (the version a branch resolved to, the endpoint
        of a bucket), so a later process or another endpoint never takes it for its own."""
        return key


def join_segments(base: str, *parts: str) -> str:
    """``parts`` below ``base`` joined with "/", refusing empty, "." and ".." segments (a key
    a server or a prefix check could read two ways)."""
    from damacy_protocol.errors import InvalidArgument

    out = base.rstrip("/")
    for part in parts:
        for segment in part.split("/"):
            if segment in ("", ".", ".."):
                raise InvalidArgument(f"a path below {base} has an empty, '.' or '..' segment ({part!r})", path=base)
            out += "/" + segment
    return out
