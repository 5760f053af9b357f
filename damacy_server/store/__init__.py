"""Storage backends behind one small interface (:class:`Store`), and uri resolution: local
paths and ``file://`` through :class:`FileStore`, object-store uris (``s3://``, ``gs://``,
``az://``, ``http(s)://``) through :class:`ObjectStore` (obstore), icechunk repositories
(``icechunk+file://...``, ``icechunk+s3://...``) through :class:`IcechunkStore`."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse

from damacy_protocol.errors import InvalidArgument, UnsupportedOperation
from damacy_server.store.base import MISSING, ByteRange, Store
from damacy_server.store.file import FileStore
from damacy_server.store.remote import SCHEMES, ObjectStore, RemoteStores, is_remote

__all__ = ["MISSING", "ByteRange", "FileStore", "ObjectStore", "RemoteStores", "Store", "is_remote", "resolve_uri"]

_FILE_STORE = FileStore()
_REMOTE = RemoteStores()
#: local uris whose root key does not depend on the working directory (absolute paths and
#: file uris of them), with it: the planner and damacyd's socket loop resolve a uri per
#: sample, mostly of a few arrays, and parsing each cost more than the rest of its handling
_ROOTS: dict[str, str] = {}
_ROOTS_REMEMBERED = 4096


def resolve_uri(uri: str, remote: RemoteStores | None = None) -> tuple[Store, str]:
    """The store that holds ``uri`` and the key of its root (for files: an absolute path; for
    objects: the normalised uri).

    Accepted: a local path (absolute or relative to the working directory), ``file://``, an
    object-store uri or an icechunk uri, read through ``remote`` (default: the process's,
    options from the environment).
    """
    if type(uri) is str:
        root = _ROOTS.get(uri)
        if root is not None:
            return _FILE_STORE, root
    if not isinstance(uri, (str, os.PathLike)):
        raise InvalidArgument(f"a uri must be a string or path, not {type(uri).__name__}")
    text = os.fspath(uri)
    if not text:
        raise InvalidArgument("the uri is empty")
    if "\0" in text:
        raise InvalidArgument("the uri contains a NUL byte", uri=text)
    if text.startswith("icechunk+"):
        store, root = (remote if remote is not None else _REMOTE).icechunk.resolve(text)
        store.check_allowed(root)
        return store, root
    parsed = urlparse(text)
    # a uri says scheme://, or file: (file:/path); anything else is a path, a colon in its
    # first part too (run-10:00.zarr), as the daemon's clients read it
    scheme = parsed.scheme.lower() if "://" in text or parsed.scheme.lower() == "file" else ""
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise InvalidArgument(f"file uri with a remote host {parsed.netloc!r}", uri=text)
        if parsed.query or parsed.fragment or text.endswith(("?", "#")):
            raise InvalidArgument("a file uri takes no query or fragment (a path's '?' is %3F in a uri, '#' is %23)", uri=text)
        path = unquote(parsed.path)
    elif scheme in SCHEMES:
        return (remote if remote is not None else _REMOTE).resolve(text)
    elif scheme and len(scheme) > 1:  # one letter: a Windows drive, not a scheme
        raise UnsupportedOperation(
            f"storage scheme {scheme!r}:// is not supported (local paths, file://, {', '.join(s + '://' for s in SCHEMES)}, "
            "icechunk+file:// and icechunk+s3:// are)",
            uri=text,
        )
    else:
        path = text
    root = os.path.abspath(path).rstrip(os.sep) or os.sep
    if type(uri) is str and os.path.isabs(path):  # (a relative path follows the working directory)
        if len(_ROOTS) >= _ROOTS_REMEMBERED:
            _ROOTS.clear()
        _ROOTS[uri] = root
    return _FILE_STORE, root
