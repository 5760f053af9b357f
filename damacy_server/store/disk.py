"""A disk tier for bytes fetched from object stores: chunks read once from a bucket are read
again from local disk (an NVMe scratch folder), for data whose epoch does not fit in memory.

Each entry is one file, named by a hash of its key (the object's uri and byte range), in a
folder of 256 subfolders. A file holds a header (magic, payload length, CRC-32 of the payload,
the key) and the payload. An entry is written to a temporary file beside its place and renamed
into it when whole, so a process killed mid-write leaves a temporary file (removed by the next
tier opened on the folder) and never a torn entry; a reader checks length, key and CRC before
it serves an entry, and deletes one that fails (a file cut short by a crash of the machine
itself). The tier is bounded in bytes: the least recently used entries go first. Several
processes may share a folder (each keeps its own index; an entry another one evicted is a
miss); damacyd shares one tier among all the ranks of a node.

Objects are taken to be immutable (training data): an entry is never checked against the
store again. Clear the folder when the data is rewritten in place.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import zlib
from collections import OrderedDict
from pathlib import Path

MAGIC = b"DMCYDSK1"
_HEADER = struct.Struct("<8sQII")  # magic, payload length, crc32, key length
TMP_SUFFIX = ".part"


class DiskTier:
    """Bytes by key on local disk, at most ``max_bytes`` of them (payloads and headers)."""

    def __init__(self, folder: str | os.PathLike, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError("a disk tier needs a positive byte bound")
        self.folder = Path(folder)
        self.max_bytes = int(max_bytes)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, least recent first
        self._bytes = 0
        self.hits = self.misses = self.writes = self.evictions = self.refused = 0
        self.folder.mkdir(parents=True, exist_ok=True)
        self._scan()

    def _scan(self) -> None:
        """Index what earlier processes left (oldest first by modification time); remove
        temporary files, which are writes that never finished."""
        found = []
        for sub in self.folder.iterdir():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                try:
                    if path.name.endswith(TMP_SUFFIX):
                        path.unlink(missing_ok=True)
                        continue
                    st = path.stat()
                except OSError:  # another process removed it meanwhile
                    continue
                found.append((st.st_mtime, f"{sub.name}/{path.name}", st.st_size))
        for _, name, size in sorted(found):
            self._index[name] = size
            self._bytes += size
        self._evict()

    @staticmethod
    def _name(key: str) -> str:
        digest = hashlib.blake2b(key.encode(), digest_size=20).hexdigest()
        return f"{digest[:2]}/{digest[2:]}"

    def get(self, key: str) -> bytes | None:
        """The bytes kept under ``key``, or None (never kept, evicted, or failed its checks)."""
        name = self._name(key)
        path = self.folder / name
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            self._forget(name)
            with self._lock:
                self.misses += 1
            return None
        payload = self._check(data, key)
        with self._lock:
            if payload is None:
                self.refused += 1
                self.misses += 1
            else:
                self.hits += 1
                if name in self._index:
                    self._index.move_to_end(name)
        if payload is None:
            path.unlink(missing_ok=True)
            self._forget(name)
        return payload

    @staticmethod
    def _check(data: bytes, key: str) -> bytes | None:
        if len(data) < _HEADER.size:
            return None
        magic, length, crc, key_len = _HEADER.unpack_from(data)
        start = _HEADER.size + key_len
        if magic != MAGIC or len(data) != start + length or data[_HEADER.size : start] != key.encode():
            return None
        payload = data[start:]
        return payload if zlib.crc32(payload) == crc else None

    def put(self, key: str, payload: bytes | memoryview) -> bool:
        """Keep ``payload`` under ``key`` (False: larger than the whole tier, or the disk
        refused it; a tier is a cache, so that is never an error)."""
        payload = bytes(payload)
        key_bytes = key.encode()
        size = _HEADER.size + len(key_bytes) + len(payload)
        if size > self.max_bytes:
            return False
        name = self._name(key)
        final = self.folder / name
        tmp = final.with_name(f"{final.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
        try:
            final.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(MAGIC, len(payload), zlib.crc32(payload), len(key_bytes)))
                f.write(key_bytes)
                f.write(payload)
            os.replace(tmp, final)  # whole, or not there at all
        except OSError:
            tmp.unlink(missing_ok=True)
            return False
        with self._lock:
            old = self._index.pop(name, None)
            if old is not None:
                self._bytes -= old
            self._index[name] = size
            self._bytes += size
            self.writes += 1
        self._evict()
        return True

    def _forget(self, name: str) -> None:
        with self._lock:
            size = self._index.pop(name, None)
            if size is not None:
                self._bytes -= size

    def _evict(self) -> None:
        while True:
            with self._lock:
                if self._bytes <= self.max_bytes or not self._index:
                    return
                name, size = self._index.popitem(last=False)
                self._bytes -= size
                self.evictions += 1
            (self.folder / name).unlink(missing_ok=True)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "entries": len(self._index), "bytes": self._bytes, "hits": self.hits, "misses": self.misses,
                "writes": self.writes, "evictions": self.evictions, "refused": self.refused,
            }
