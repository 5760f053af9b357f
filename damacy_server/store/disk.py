"""A disk tier for bytes fetched from object stores: chunks read once from a bucket are read
again from local disk (an NVMe scratch folder), for data whose epoch does not fit in memory.

Each entry is one file, named by a hash of its key (the object's uri, its version where the
store has one, and the byte range), in a folder of 256 subfolders. A file holds a header (magic,
payload length, CRC-32 of the payload, the key) and the payload. An entry is written to a
temporary file beside its place and renamed into it when whole, so a process killed mid-write
leaves a temporary file (removed by the next scan of the folder once its writer is gone)
and never a torn entry; a reader checks length, key and CRC before it serves an entry, and
deletes one that fails (a file cut short by a crash of the machine itself).

The tier is bounded in bytes (the disk space its files take, whole blocks): the least recently
used entries go first (a hit touches its file, so the order survives a restart). The folder is
the tier's own: a marker file names it, a folder holding anything else is refused, and only
names of the tier's own forms are ever read or removed. Several processes may share a folder:
each keeps an index of the entries, and rescans the folder whenever it has written a sixteenth
of the bound since its last scan, so the bound holds for them together within that margin per
process; damacyd shares one tier among all the ranks of a node.

Objects are taken to be immutable (training data): an entry is never checked against the
store again. Clear the folder when the data is rewritten in place.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import struct
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path

from damacy_protocol.errors import InvalidArgument
from damacy_server.procs import pid_alive

MAGIC = b"DMCYDSK1"
_HEADER = struct.Struct("<8sQII")  # magic, payload length, crc32, key length
TMP_SUFFIX = ".part"
#: the file naming a folder as a disk tier
MARKER = "damacy-disk-tier"
_STARTED = time.time() - 1.0  # (about) when this process started: a temporary file of its pid older than that is an earlier process's
_SUB = re.compile(r"[0-9a-f]{2}")
_ENTRY = re.compile(r"[0-9a-f]{38}")
_PART = re.compile(r"([0-9a-f]{38})\.(\d+)\.(\d+)" + re.escape(TMP_SUFFIX))


class DiskTier:
    """Bytes by key on local disk, at most ``max_bytes`` of them (the space their files take)."""

    def __init__(self, folder: str | os.PathLike, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError("a disk tier needs a positive byte bound")
        self.folder = Path(folder)
        self.max_bytes = int(max_bytes)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> bytes on disk, least recent first
        self._bytes = 0
        self.hits = self.misses = self.writes = self.evictions = self.refused = 0
        self._claim()
        self._block = max(512, os.statvfs(self.folder).f_frsize)
        self._rescan_every = max(1, self.max_bytes // 16)
        self._written = 0  # bytes written since the last scan
        self._scanning = False
        self._scan()

    def _claim(self) -> None:
        """Make the folder a tier, or check that it is one (an empty folder becomes one)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        marker = self.folder / MARKER
        if marker.is_file():
            return
        # a tier made before the marker was: its subfolders only (a filesystem's own
        # lost+found aside: a tier at the root of an NVMe mount); the marker, or one being
        # written, is another process making the folder a tier at the same time
        foreign = sorted(
            p.name for p in self.folder.iterdir()
            if p.name != "lost+found" and not p.name.startswith(MARKER)
            and not (_SUB.fullmatch(p.name) and p.is_dir() and not p.is_symlink())
        )
        if foreign:
            raise InvalidArgument(
                f"the disk tier's folder {self.folder} holds files that are not a damacy disk tier "
                f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); give an empty folder "
                "or one a disk tier made"
            )
        tmp = self.folder / f"{MARKER}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"
        tmp.write_text("a damacy disk tier: entries of fetched object-store bytes, safe to delete whole\n")
        os.replace(tmp, marker)  # whole or not there: another process opening the folder never reads half

    def _size(self, st: os.stat_result) -> int:
        return max(st.st_blocks * 512, self._on_disk(st.st_size))

    def _on_disk(self, size: int) -> int:
        """The space a file of ``size`` bytes takes: whole blocks."""
        return -(-size // self._block) * self._block

    def _scan(self) -> None:
        """Index the folder's entries (least recently used first, by modification time: a hit
        touches its file); remove temporary files whose writer is gone (writes that never
        finished). Only names of the tier's own forms are looked at; links are not followed."""
        found = []
        with os.scandir(self.folder) as subs:
            subs = [sub.path for sub in subs if _SUB.fullmatch(sub.name) and sub.is_dir(follow_symlinks=False)]
        for sub in subs:
            with os.scandir(sub) as entries:
                entries = list(entries)
            for entry in entries:
                try:
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    part = _PART.fullmatch(entry.name)
                    if part is not None:
                        pid = int(part.group(2))
                        gone = not pid_alive(pid) if pid != os.getpid() else entry.stat(follow_symlinks=False).st_mtime < _STARTED
                        if gone:  # a write that never finishes (an earlier process of this pid's too: a restarted container)
                            os.unlink(entry.path)
                        continue
                    if not _ENTRY.fullmatch(entry.name):
                        continue
                    st = entry.stat(follow_symlinks=False)
                except OSError:  # another process removed it meanwhile
                    continue
                found.append((st.st_mtime, f"{os.path.basename(sub)}/{entry.name}", self._size(st)))
        found.sort()
        with self._lock:  # an entry written while the scan ran is found by the next one
            self._index = OrderedDict((name, size) for _, name, size in found)
            self._bytes = sum(self._index.values())
            self._written = 0
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
            with self._lock:
                self.misses += 1
                if not path.exists():  # evicted by another process
                    self._unindex(name)
            return None
        payload = self._check(data, key)
        with self._lock:
            if payload is None:
                self.refused += 1
                self.misses += 1
                # removed with its index entry, under the lock: a put of the key meanwhile is
                # removed too, never left on disk outside the index
                path.unlink(missing_ok=True)
                self._unindex(name)
                return None
            self.hits += 1
            if name in self._index:
                self._index.move_to_end(name)
        try:
            os.utime(path)  # the use, for the order after a restart or in another process
        except OSError:
            pass
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
        size = self._on_disk(_HEADER.size + len(key_bytes) + len(payload))
        if size > self.max_bytes:
            return False
        name = self._name(key)
        final = self.folder / name
        tmp = final.with_name(f"{final.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
        for attempt in range(2):
            try:
                final.parent.mkdir(exist_ok=True)
                with open(tmp, "wb") as f:
                    f.write(_HEADER.pack(MAGIC, len(payload), zlib.crc32(payload), len(key_bytes)))
                    f.write(key_bytes)
                    f.write(payload)
                break
            except OSError as e:
                _remove(tmp)
                if attempt or e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    return False
                self._evict(free=2 * size)  # the disk is fuller than the bound allowed for: make room, once

        with self._lock:  # the file and its index entry change together
            try:
                os.replace(tmp, final)  # whole, or not there at all
            except OSError:
                _remove(tmp)
                return False
            self._unindex(name)
            self._index[name] = size
            self._bytes += size
            self.writes += 1
            self._written += size
            rescan = self._written >= self._rescan_every and not self._scanning
            if rescan:
                self._scanning = True
        if rescan:  # what the folder's other processes wrote counts against the bound too
            try:
                self._scan()
            finally:
                self._scanning = False
        else:
            self._evict()
        return True

    def _unindex(self, name: str) -> None:
        """Forget ``name`` (its file gone or replaced); the caller holds the lock."""
        size = self._index.pop(name, None)
        if size is not None:
            self._bytes -= size

    def _evict(self, free: int = 0) -> None:
        """Remove the least recently used entries until the tier is within its bound and
        ``free`` bytes of entries are gone (a disk that filled up before the bound did)."""
        with self._lock:
            while (self._bytes > self.max_bytes or free > 0) and self._index:
                name, size = self._index.popitem(last=False)
                free -= size
                self._bytes -= size
                self.evictions += 1
                try:
                    (self.folder / name).unlink(missing_ok=True)
                except OSError:  # a tier is a cache: a file it cannot remove is left
                    pass

    @property
    def nbytes(self) -> int:
        return self._bytes

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "entries": len(self._index), "bytes": self._bytes, "hits": self.hits, "misses": self.misses,
                "writes": self.writes, "evictions": self.evictions, "refused": self.refused,
            }


def _remove(path: Path) -> None:
    """Remove a file written in part, if the disk lets us (a read-only one refuses even to
    look: nothing was written there)."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)
