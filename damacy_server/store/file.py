"""Local files (and network file systems mounted as such) read with positional reads.

``os.pread`` releases the GIL, so many threads read at once; a range read never reads more
of a file than asked, which matters for shards of hundreds of megabytes.

Every open is checked on the descriptor it returns, never on a path checked earlier: a
rooted store (the daemon's) opens the path with ``O_PATH`` (which opens nothing and cannot
block), asks the kernel where that descriptor really is (``/proc/self/fd``), refuses it
unless it lies inside a root and is a regular file, and only then opens it for reading
through the descriptor itself. Symlinks anywhere in the path are followed by the kernel,
so links that stay inside the roots work, and swapping a checked folder for a link to
elsewhere between two reads (or during one) reads nothing from elsewhere. Nothing about a
path is cached across opens. Every store opens non-blocking and refuses anything that is
not a regular file (a FIFO named like a chunk must not hang a reader thread).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from damacy_protocol.errors import InvalidArgument, StorageError
from damacy_server.store.base import ByteRange, Store

_MISSING = (FileNotFoundError, NotADirectoryError)
_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
_O_PATH = getattr(os, "O_PATH", 0)
_PROC_FD = "/proc/self/fd"


def within(real: str, roots: Sequence[str]) -> bool:
    """Is the resolved path ``real`` one of ``roots`` or below one of them?"""
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


class FileStore(Store):
    """Reads files by absolute path.

    With ``roots`` set, only regular files whose real location (symlinks and ``..``
    resolved by the kernel at open time) lies inside those directories are read: a daemon
    reads files on behalf of its clients.
    """

    def __init__(self, roots: list[str] | None = None) -> None:
        self.roots = None if roots is None else [os.path.realpath(r) for r in roots]
        # what native code needs to apply the same rule itself: the roots, NUL-separated
        self._roots_blob = None if self.roots is None else b"\0".join(os.fsencode(r) for r in self.roots)

    def check_allowed(self, path: str) -> None:
        """Refuse ``path`` early, by name, unless it lies inside one of the roots (symlinks
        resolved now). A courtesy for a clear error at push time: the check that protects
        the roots is the one every open makes on its descriptor."""
        if self.roots is None:
            return
        _check_name(path)
        if not within(os.path.realpath(path), self.roots):
            raise self._outside(path)

    def _outside(self, path: str) -> InvalidArgument:
        if not self.roots:
            return InvalidArgument("this damacyd serves no paths (start it with --allow-root DIR)", path=path)
        return InvalidArgument(f"{path} is outside the daemon's allowed roots ({', '.join(self.roots)})", path=path)

    def open(self, key: str) -> int | None:
        """A descriptor open for reading a regular file, ``None`` when there is no such
        file, :class:`InvalidArgument` outside the roots, :class:`StorageError` otherwise."""
        _check_name(key)
        if self.roots is None:
            fd = _open_fd(key, _FLAGS)
            if fd is not None:
                _check_regular(fd, key)
            return fd
        if not _O_PATH:
            return self._open_rooted_portable(key)
        handle = _open_fd(key, _O_PATH | os.O_CLOEXEC)
        if handle is None:
            return None
        try:
            proc = f"{_PROC_FD}/{handle}"
            try:
                real = os.readlink(proc)
            except OSError as e:
                raise StorageError(f"cannot tell where the file is ({proc}: {e.strerror})", path=key) from e
            if not within(real, self.roots):
                raise self._outside(key)
            _check_regular(handle, key)
            # the same file, opened through the checked descriptor (no second path walk)
            return _open_fd(proc, _FLAGS, name=key)
        finally:
            os.close(handle)

    def _open_rooted_portable(self, key: str) -> int | None:
        """Where there is no ``O_PATH``: open, then check that the resolved path names the
        very file opened (same device and inode) and lies inside a root."""
        fd = _open_fd(key, _FLAGS)
        if fd is None:
            return None
        try:
            _check_regular(fd, key)
            real = os.path.realpath(key)
            st, there = os.fstat(fd), _stat_or_none(real)
            if there is None or (st.st_dev, st.st_ino) != (there.st_dev, there.st_ino) or not within(real, self.roots):
                raise self._outside(key)
            return fd
        except BaseException:
            os.close(fd)
            raise

    def direct(self, key: str) -> tuple[str, int, bytes | None]:
        """(path, open flags, roots) with which native code reads ``key`` itself, applying
        the same rule as :meth:`open` (roots: NUL-separated, or None for an unrooted store).
        Whatever it refuses or cannot do goes through :meth:`read`/:meth:`read_ranges`,
        which report every error."""
        return key, _FLAGS, self._roots_blob

    def read(self, key: str) -> bytes | None:
        fd = self.open(key)
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
        fd = self.open(key)
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            return [_pread_within(fd, size, offset, length) for offset, length in ranges]
        except OSError as e:
            raise StorageError(f"read failed: {e.strerror or e}", path=key) from e
        finally:
            os.close(fd)

    def read_range_sized(self, key: str, offset: int, length: int) -> tuple[bytes, int] | None:
        fd = self.open(key)
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            return _pread_within(fd, size, offset, length), size
        except OSError as e:
            raise StorageError(f"read failed: {e.strerror or e}", path=key) from e
        finally:
            os.close(fd)

    def size(self, key: str) -> int | None:
        fd = self.open(key)
        if fd is None:
            return None
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def exists(self, key: str) -> bool:
        try:
            return self.size(key) is not None
        except StorageError:
            return False  # something that is not a regular file (a folder, a FIFO)

    def join(self, base: str, *parts: str) -> str:
        return os.path.join(base, *parts)


def _check_name(key: str) -> None:
    if "\0" in key:
        raise InvalidArgument(f"the path {key!r} contains a NUL byte", path=key.replace("\0", "\\0"))


def _check_regular(fd: int, key: str) -> None:
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        what = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise StorageError(f"cannot read {what}", path=key)


def _stat_or_none(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


def _open_fd(key: str, flags: int, name: str | None = None) -> int | None:
    """An open file descriptor, ``None`` for a missing file, :class:`StorageError` otherwise."""
    try:
        return os.open(key, flags)
    except _MISSING:
        return None
    except OSError as e:
        raise StorageError(f"cannot open: {e.strerror or e}", path=name or key) from e


def _pread_within(fd: int, size: int, offset: int, length: int) -> bytes:
    """Bytes [offset, offset + length) of a file of ``size`` bytes (a negative offset: the
    last ``-offset`` bytes), short at the end: never asks for more than the file holds (a
    corrupt shard index may name 2**61 bytes)."""
    if offset < 0:
        length, offset = -offset, max(0, size + offset)
    return _pread_exact(fd, max(0, min(length, size - offset)), offset)


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
