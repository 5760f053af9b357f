"""Local files (and network file systems mounted as such) read with positional reads.

``os.pread`` releases the GIL, so many threads read at once; a range read never reads more
of a file than asked, which matters for shards of hundreds of megabytes.

Every open is checked on the file it opens, never on a path checked earlier. A rooted
store (the daemon's) keeps a descriptor of each root and opens a file below one with
``openat2(root, rest, RESOLVE_BENEATH)``: the kernel refuses any escape (``..``, a symlink
out) in the same call. What that cannot decide (an absolute symlink, which may well stay
inside, or a kernel without ``openat2``) is decided on the descriptor: the path is opened
with ``O_PATH`` (which opens nothing and cannot block), the kernel's location of that
descriptor (``/proc/self/fd``) must lie inside a root and be a regular file, and only then
is it opened for reading through the descriptor itself. So links that stay inside the
roots work, and swapping a checked folder for a link to elsewhere between two reads (or
during one) reads nothing from elsewhere. Nothing about a path is cached across opens.
Every store opens non-blocking and refuses anything that is not a regular file (a FIFO
named like a chunk must not hang a reader thread). The rule lives in C
(``native.open_checked``, also used by the decode threads' direct reads), with the same
rule in Python where the extension is not built.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Sequence

from damacy_protocol.errors import InvalidArgument, StorageError
from damacy_protocol.limits import (
    DEFAULT_IO_WORKERS,
    DEFAULT_METADATA_CONCURRENCY,
    MAX_IO_THREADS,
    MAX_METADATA_CONCURRENCY,
    LatencyModel,
    positive_int,
)
from damacy_server import native
from damacy_server.store.base import MISSING, ByteRange, Store

_open_checked = native.open_checked  # the rule in C; None: built without a C compiler

_MISSING = (FileNotFoundError, NotADirectoryError)
_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
_O_PATH = getattr(os, "O_PATH", 0)
_PROC_FD = "/proc/self/fd"
#: how long a path :meth:`FileStore.check_allowed` found inside the roots is taken as inside
#: without resolving it again, and how many such paths are remembered
ALLOWED_TTL_S = 1.0
ALLOWED_REMEMBERED = 4096


def within(real: str, roots: Sequence[str]) -> bool:
    """Is the resolved path ``real`` one of ``roots`` or below one of them?"""
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


class FileStore(Store):
    """Reads files by absolute path.

    With ``roots`` set, only regular files whose real location (symlinks and ``..``
    resolved by the kernel at open time) lies inside those directories are read: a daemon
    reads files on behalf of its clients.
    """

    __slots__ = ("roots", "_allowed", "_root_fds", "_roots_blob", "_flags")

    def __init__(self, roots: list[str] | None = None) -> None:
        if not hasattr(self, "_flags"):
            self._flags = _FLAGS  # open flags (``native.NO_READAHEAD`` among them: readahead off)
        self.roots = None if roots is None else [os.path.realpath(r) for r in roots]
        self._allowed: dict[str, float] = {}  # paths check_allowed found inside, until when
        self._root_fds: list[int] = []
        # the roots as native code takes them: "FD:PATH" each, NUL-separated (FD -1: none)
        self._roots_blob = None
        if self.roots is not None:
            for r in self.roots:
                try:
                    self._root_fds.append(os.open(r, _O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if _O_PATH else -1)
                except OSError:
                    self._root_fds.append(-1)  # checked by the descriptor's location alone
            self._roots_blob = b"\0".join(b"%d:%s" % (fd, os.fsencode(r)) for fd, r in zip(self._root_fds, self.roots))

    def __del__(self) -> None:
        for fd in getattr(self, "_root_fds", ()):
            if fd >= 0:
                os.close(fd)
        self._root_fds = []

    def check_allowed(self, path: str) -> None:
        """Refuse ``path`` early, by name, unless it lies inside one of the roots (symlinks
        resolved now). A courtesy for a clear error at push time: the check that protects
        the roots is the one every open makes on its descriptor. A path found inside is
        not resolved again for :data:`ALLOWED_TTL_S` (a daemon is pushed every sample of
        every batch, mostly of a few arrays: resolving each was a fifth of its socket loop)."""
        if self.roots is None:
            return
        now = time.monotonic()
        if self._allowed.get(path, 0.0) > now:
            return
        _check_name(path)
        if not within(os.path.realpath(path), self.roots):
            raise self._outside(path)
        if len(self._allowed) >= ALLOWED_REMEMBERED:
            self._allowed.clear()
        self._allowed[path] = now + ALLOWED_TTL_S

    def _outside(self, path: str) -> InvalidArgument:
        if not self.roots:
            return InvalidArgument("this damacyd serves no paths (start it with --allow-root DIR)", path=path)
        return InvalidArgument(f"{path} is outside the daemon's allowed roots ({', '.join(self.roots)})", path=path)

    def open(self, key: str) -> tuple[int, int] | None:
        """(descriptor open for reading, size) of a regular file, ``None`` when there is no
        such file, :class:`InvalidArgument` outside the roots, :class:`StorageError` otherwise."""
        _check_name(key)
        if _open_checked is not None:
            fd, code, size = _open_checked(key, self._flags, self._roots_blob)
            if fd >= 0:
                return fd, size
            if code in (errno.ENOENT, errno.ENOTDIR):
                return None
            if code == -3:
                raise self._outside(key)
            if code == -1:
                raise StorageError(f"cannot read {_what(_stat_or_none(key))}", path=key)
            raise StorageError(f"cannot open: {os.strerror(code)}", path=key)
        fd = self._open_python(key)
        if fd is None:
            return None
        try:
            if self._flags & native.NO_READAHEAD:
                _advise_random(fd, key)
            return fd, os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise

    def _open_python(self, key: str) -> int | None:
        """:meth:`open`'s rule without the native extension (the /proc check always)."""
        if self.roots is None:
            fd = _open_fd(key, _FLAGS)
            if fd is not None:
                try:
                    _check_regular(fd, key)  # a folder, a FIFO: refused, its descriptor closed
                except BaseException:
                    os.close(fd)
                    raise
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
        return key, self._flags, self._roots_blob

    def read(self, key: str) -> bytes | None:
        opened = self.open(key)
        if opened is None:
            return None
        fd, size = opened
        try:
            return _pread_exact(fd, size, 0)
        except OSError as e:
            raise StorageError(f"read failed: {e.strerror or e}", path=key) from e
        finally:
            os.close(fd)

    def read_ranges(self, key: str, ranges: Sequence[ByteRange]) -> list[bytes] | None:
        opened = self.open(key)
        if opened is None:
            return None
        fd, size = opened
        try:
            return [_pread_within(fd, size, offset, length) for offset, length in ranges]
        except OSError as e:
            raise StorageError(f"read failed: {e.strerror or e}", path=key) from e
        finally:
            os.close(fd)

    def read_range_sized(self, key: str, offset: int, length: int) -> tuple[bytes, int] | None:
        opened = self.open(key)
        if opened is None:
            return None
        fd, size = opened
        try:
            return _pread_within(fd, size, offset, length), size
        except OSError as e:
            raise StorageError(f"read failed: {e.strerror or e}", path=key) from e
        finally:
            os.close(fd)

    def size(self, key: str) -> int | None:
        opened = self.open(key)
        if opened is None:
            return None
        os.close(opened[0])
        return opened[1]

    def exists(self, key: str) -> bool:
        try:
            return self.size(key) is not None
        except StorageError:
            return False  # something that is not a regular file (a folder, a FIFO)

    def version(self, key: str) -> tuple[int, ...] | str:
        """The file's inode, size, and modification and change times (in ns): a file
        rewritten in place, or replaced, changes them."""
        opened = self.open(key)
        if opened is None:
            return MISSING
        try:
            st = os.fstat(opened[0])
        finally:
            os.close(opened[0])
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def join(self, base: str, *parts: str) -> str:
        return os.path.join(base, *parts)


def _advise_random(fd: int, key: str) -> None:
    """Tell the kernel ``fd`` is read at random (no readahead); a refusal fails the read."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    try:
        advise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    except OSError as e:  # (the caller closes fd)
        raise StorageError(f"cannot advise random reads: {e.strerror or e}", path=key) from e


def _check_name(key: str) -> None:
    if "\0" in key:
        raise InvalidArgument(f"the path {key!r} contains a NUL byte", path=key)


def _check_regular(fd: int, key: str) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise StorageError(f"cannot read {_what(st)}", path=key)


def _what(st: os.stat_result | None) -> str:
    if st is not None and stat.S_ISDIR(st.st_mode):
        return "a folder"
    if st is not None and stat.S_ISFIFO(st.st_mode):
        return "a FIFO"
    return "something that is not a regular file"


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
    """The store used for ``zarr.json`` files and shard indexes (read while planning).

    ``concurrency``: how many of those reads are in flight at once while a batch is planned
    (the arrays' metadata and the outer shard indexes not cached yet; see
    :class:`~damacy_server.plan.resolve.Resolver`): local reads on that many threads,
    grouped requests to object stores that many in flight; 1 reads one after another, in
    the planning thread. ``latency``: a :class:`~damacy_protocol.limits.LatencyModel` of
    synthetic latency added to each read (benchmarks). It holds settings only: any number of
    planners and image loads may share it. ``roots`` (damacy's): read only below these
    folders (a daemon's ``--allow-root``)."""

    __slots__ = ("concurrency", "latency")

    def __init__(self, *, concurrency: int = DEFAULT_METADATA_CONCURRENCY, latency: LatencyModel | None = None, roots: list[str] | None = None) -> None:
        if latency is None:
            latency = LatencyModel()
        if not isinstance(latency, LatencyModel):
            raise TypeError("latency must be a LatencyModel")
        self.concurrency = positive_int(concurrency, "concurrency", MAX_METADATA_CONCURRENCY)
        self.latency = latency
        super().__init__(roots)


class FileReader(FileStore):
    """The store used for chunk data: ``workers`` threads issue positional reads (the GIL is
    released while they wait) with at most ``max_inflight_reads`` queued at once. Reads whose
    bytes the page cache holds are made by the decode threads themselves (see :meth:`direct`)
    and do not count.

    ``readahead=False`` tells the kernel each chunk or shard file this reader opens is read
    at random (``POSIX_FADV_RANDOM``): no readahead, which helps scattered crops on some
    storage and slows scans; the page cache is used as before. A kernel that refuses the
    advice fails the read (:class:`StorageError`). ``roots`` as for
    :class:`FileMetadataReader`."""

    __slots__ = ("workers", "max_inflight_reads", "readahead")

    def __init__(
        self,
        *,
        workers: int = DEFAULT_IO_WORKERS,
        max_inflight_reads: int = 4096,
        readahead: bool = True,
        roots: list[str] | None = None,
    ) -> None:
        if not isinstance(readahead, bool):
            raise TypeError("readahead must be a bool")
        self.workers = positive_int(workers, "workers", MAX_IO_THREADS)
        self.max_inflight_reads = positive_int(max_inflight_reads, "max_inflight_reads")
        self.readahead = readahead
        self._flags = _FLAGS if readahead else _FLAGS | native.NO_READAHEAD
        super().__init__(roots)
