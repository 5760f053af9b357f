"""Storage backends behind one small interface (:class:`Store`), and uri resolution."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse

from damacy_protocol.errors import InvalidArgument, UnsupportedError
from damacy_server.store.base import ByteRange, Store
from damacy_server.store.file import FileStore

__all__ = ["ByteRange", "FileStore", "Store", "resolve_uri"]

_FILE_STORE = FileStore()


def resolve_uri(uri: str) -> tuple[Store, str]:
    """The store that holds ``uri`` and the key of its root (for files: an absolute path).

    Accepted: a local path (absolute or relative to the working directory) or ``file://``.
    """
    if not isinstance(uri, (str, os.PathLike)):
        raise InvalidArgument(f"a uri must be a string or path, not {type(uri).__name__}")
    text = os.fspath(uri)
    if not text:
        raise InvalidArgument("the uri is empty")
    if "\0" in text:
        raise InvalidArgument("the uri contains a NUL byte", uri=text.replace("\0", "\\0"))
    parsed = urlparse(text)
    scheme = parsed.scheme.lower()
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise InvalidArgument(f"file uri with a remote host {parsed.netloc!r}", uri=text)
        path = unquote(parsed.path)
    elif scheme and len(scheme) > 1:  # one letter: a Windows drive, not a scheme
        raise UnsupportedError(
            f"storage scheme {scheme!r}:// is not supported (local paths and file:// are)", uri=text
        )
    else:
        path = text
    return _FILE_STORE, os.path.abspath(path).rstrip(os.sep) or os.sep
