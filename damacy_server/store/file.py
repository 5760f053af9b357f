"""Local files (and network file systems mounted as such) read with positional reads.

``os.pread`` releases the GIL, so many threads read at once; a range read never reads more
of a file than asked, which matters for shards of hundreds of megabytes.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

from damacy_protocol.errors import InvalidArgument, StorageError
from damacy_server.store.base import ByteRange, Store

_MISSING = (FileNotFoundError, NotADirectoryError)
_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


class FileStore(Store):
    """Reads files by absolute path.

    With ``roots`` set, only files inside those directories are read, after resolving
    symlinks and ``..`` (a daemon reads files on behalf of its clients).
    """

    def __init__(self, roots: list[str] | None = None) -> None:
        self.roots = None if roots is None else [os.path.realpath(r) for r in roots]
        self._dirs_ok: dict[str, bool] = {}

    def check_allowed(self, path: str) -> None:
        """Refuse ``path`` unless it lies inside one of the roots (symlinks resolved)."""
        if self.roots is None:
            return
        real = os.path.realpath(path)
        if not any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in self.roots):
            if not self.roots:
                raise InvalidArgument("this damacyd serves no paths (start it with --allow-root DIR)", path=path)
            raise InvalidArgument(f"{path} is outside the daemon's allowed roots ({', '.join(self.roots)})", path=path)

    def _open(self, key: str) -> int | None:
        if self.roots is not None:
            return self._open_rooted(key)
        return _open_fd(key, _FLAGS)

    def _open_rooted(self, key: str) -> int | None:
        folder = os.path.dirname(key)
        ok = self._dirs_ok.get(folder)
        if ok is None:
            try:
                self.check_allowed(folder)
                ok = True
            except InvalidArgument:
                ok = False
            if len(self._dirs_ok) > 65536:
                self._dirs_ok.clear()
            self._dirs_ok[folder] = ok
        if not ok:
            self.check_allowed(folder)  # raises, naming the path
        try:
            return _open_fd(key, _FLAGS | os.O_NOFOLLOW, symlink_ok=False)
        except _Symlink:
            # the file itself is a symlink: follow it only into an allowed root
            self.check_allowed(key)
            return _open_fd(key, _FLAGS)

    def direct(self, key: str) -> tuple[str, int] | None:
        """(path, open flags) with which native code may read ``key`` itself, or None when
        it must go through :meth:`read`/:meth:`read_ranges` (which report every error). A
        rooted store refuses symlinks there (``O_NOFOLLOW``): those take the ordinary path."""
        if self.roots is None:
            return key, _FLAGS
        ok = self._dirs_ok.get(os.path.dirname(key))
        return (key, _FLAGS | os.O_NOFOLLOW) if ok else None

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
        if self.roots is not None:
            self.check_allowed(key)
        try:
            st = os.stat(key)
        except _MISSING:
            return None
        except OSError as e:
            raise StorageError(f"cannot stat: {e.strerror or e}", path=key) from e
        return st.st_size

    def exists(self, key: str) -> bool:
        if self.roots is not None:
            self.check_allowed(key)
        return os.path.isfile(key)

    def join(self, base: str, *parts: str) -> str:
        return os.path.join(base, *parts)


class _Symlink(Exception):
    pass


def _open_fd(key: str, flags: int, symlink_ok: bool = True) -> int | None:
    """An open file descriptor, ``None`` for a missing file, :class:`StorageError` otherwise."""
    try:
        return os.open(key, flags)
    except _MISSING:
        return None
    except OSError as e:
        if not symlink_ok and e.errno == errno.ELOOP:
            raise _Symlink from None
        raise StorageError(f"cannot open: {e.strerror or e}", path=key) from e


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

    def __init__(self, concurrency: int = 64, roots: list[str] | None = None) -> None:
        super().__init__(roots)
        if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:
            raise InvalidArgument(f"FileMetadataReader.concurrency must be an integer >= 1, got {concurrency!r}")
        self.concurrency = concurrency


class FileReader(FileStore):
    """The store used for chunk data: ``workers`` threads issue positional reads (the GIL is
    released while they wait) with at most ``max_inflight_reads`` queued at once. Reads whose
    bytes the page cache holds are made by the decode threads themselves (see :meth:`direct`)
    and do not count."""

    def __init__(self, workers: int = 8, max_inflight_reads: int = 4096, roots: list[str] | None = None) -> None:
        super().__init__(roots)
        for name, v in (("workers", workers), ("max_inflight_reads", max_inflight_reads)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidArgument(f"FileReader.{name} must be an integer >= 1, got {v!r}")
        self.workers = workers
        self.max_inflight_reads = max_inflight_reads
