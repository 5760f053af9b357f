"""Local files (and network file systems mounted as such) read with positional reads.

``os.pread`` releases the GIL, so many threads read at once; a range read never reads more
of a file than asked, which matters for shards of hundreds of megabytes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from damacy_protocol.errors import StorageError
from damacy_server.store.base import ByteRange, Store

_MISSING = (FileNotFoundError, NotADirectoryError)


class FileStore(Store):
    """Reads files by absolute path."""

    def _open(self, key: str) -> int | None:
        try:
            return os.open(key, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except _MISSING:
            return None
        except OSError as e:
            raise StorageError(f"cannot open: {e.strerror or e}", path=key) from e

    def read(self, key: str) -> bytes | None:
        fd = self._open(key)
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            return _pread_exact(fd, size, 0)
        except OSError as e:
            raise StorageError(f"read failed: {e.strerror or e}", path=key) from e
        finally:
            os.close(fd)

    def read_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes] | None:
        fd = self._open(key)
        if fd is None:
            return None
        try:
            size = None
            out = []
            for offset, length in ranges:
                if offset < 0:
                    if size is None:
                        size = os.fstat(fd).st_size
                    length = -offset
                    offset = max(0, size + offset)
                out.append(_pread_exact(fd, length, offset))
            return out
        except OSError as e:
            raise StorageError(f"read failed: {e.strerror or e}", path=key) from e
        finally:
            os.close(fd)

    def size(self, key: str) -> int | None:
        try:
            st = os.stat(key)
        except _MISSING:
            return None
        except OSError as e:
            raise StorageError(f"cannot stat: {e.strerror or e}", path=key) from e
        return st.st_size

    def exists(self, key: str) -> bool:
        return os.path.isfile(key)

    def join(self, base: str, *parts: str) -> str:
        return os.path.join(base, *parts)


def _pread_exact(fd: int, length: int, offset: int) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) == length or not data:
        return data
    # A short read before the end of the file (possible on network file systems): go on.
    chunks = [data]
    got = len(data)
    while got < length:
        more = os.pread(fd, length - got, offset + got)
        if not more:
            break
        chunks.append(more)
        got += len(more)
    return b"".join(chunks)


class FileMetadataReader(FileStore):
    """The store used for ``zarr.json`` files and shard indexes; ``concurrency`` bounds how
    many of those reads run at once while planning."""

    def __init__(self, concurrency: int = 64) -> None:
        if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:
            from damacy_protocol.errors import InvalidArgument

            raise InvalidArgument(f"FileMetadataReader.concurrency must be an integer >= 1, got {concurrency!r}")
        self.concurrency = concurrency


class FileReader(FileStore):
    """The store used for chunk data: ``workers`` threads issue positional reads (the GIL is
    released while they wait) with at most ``max_inflight_reads`` queued at once."""

    def __init__(self, workers: int = 8, max_inflight_reads: int = 4096) -> None:
        from damacy_protocol.errors import InvalidArgument

        for name, v in (("workers", workers), ("max_inflight_reads", max_inflight_reads)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidArgument(f"FileReader.{name} must be an integer >= 1, got {v!r}")
        self.workers = workers
        self.max_inflight_reads = max_inflight_reads
