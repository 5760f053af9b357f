"""A storage library's failure (obstore's, icechunk's) as damacy's error: the object, the
HTTP status when the server answered, whether it could be reached at all, and the cause in
one line."""

from __future__ import annotations

import re

from damacy_protocol.errors import StorageError

_STATUS = re.compile(r"status(?: code)?:? (\d{3})")
_RETRIES = re.compile(r"\bretries: (\d+)")
#: a connection's failure in obstore's debug text: its kind, the address when one was tried,
#: and the system's words for it
_CONNECT = re.compile(r'ConnectError\(\s*"([^"]+)",\s*(?:([\w.:\[\]-]+:\d+),)?')
_CAUSE = re.compile(r'(?:message|error): "([^"]+)"')


def first_line(e: BaseException) -> str:
    """The first line of an error's text that says something (icechunk's frame their
    messages with ``x`` and ``|``), at most 300 characters."""
    lines = str(e).strip().splitlines()
    return next((line.strip(" x|") for line in lines if line.strip(" x|")), type(e).__name__)[:300]


def http_status(e: BaseException) -> int | None:
    """The HTTP status a storage library's failure reports (None: no server answered)."""
    found = _STATUS.search(str(e))
    return int(found.group(1)) if found else None


def _no_connection(text: str) -> bool:
    return "kind: Connect" in text


def _timed_out(text: str) -> bool:
    return "kind: Timeout" in text or "TimedOut" in text or "timed out" in text.lower()


def unanswered(e: BaseException) -> bool:
    """Did no server answer (a connection that failed, a request that timed out)?"""
    text = str(e)
    return _no_connection(text) or _timed_out(text)


def storage_error(e: BaseException, key: str) -> StorageError:
    """An obstore failure as a :class:`StorageError` naming the object, the HTTP status
    (when the server answered) or why no server answered, and the cause."""
    text = str(e)
    status = http_status(e)
    if status is not None:
        reason = f"HTTP {status}"
    elif _no_connection(text):  # no answer at all: a wrong endpoint, a server down, a name unknown
        found = _CONNECT.search(text)
        what, where = (found.group(1), found.group(2)) if found else ("connect error", None)
        cause = _CAUSE.search(text[found.end() :] if found else text)
        reason = f"could not reach the server ({what}{' to ' + where if where else ''}{': ' + cause.group(1) if cause else ''})"
    elif _timed_out(text):
        reason = "the request timed out"
    else:
        reason = "the request failed"
    retries = _RETRIES.search(text)
    if retries and int(retries.group(1)):
        reason += f" after {retries.group(1)} retries"
    return StorageError(f"{reason} ({first_line(e)})", path=key)
