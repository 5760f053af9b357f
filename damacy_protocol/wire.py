"""Conversions between the messages and the values on either side: samples and errors.

One place for the wire form of a sample (``WireSample``: a box or per-axis index
selections, numbered by the client) and of an error (``WireError``: its type's name, the
reason and the sample's context), used by the client and the daemon alike.
"""

from __future__ import annotations

import os
from typing import Any, overload

import msgspec

from damacy_protocol import messages as m
from damacy_protocol.errors import DamacyError, from_wire, kind_of, redact_uri, to_wire
from damacy_protocol.samples import IndexQuery, Sample, describe_item
from damacy_protocol.selection import describe, describe_indices


def absolute_uri(uri: str) -> str:
    """A local path made absolute in this process's working directory (the daemon's is
    another); a URL (``scheme://...``, or ``file:/path``) as given."""
    if "://" in uri:
        return uri
    if uri[:5].lower() == "file:":  # file:/abs/path, or a relative file:path made absolute
        return uri if uri[5:].startswith("/") else "file:" + os.path.abspath(uri[5:])
    return os.path.abspath(uri)


def sample_to_wire(seq: int, sample: Any) -> m.WireSample:
    """Sample ``seq`` of a client as sent (a relative path made absolute here); anything but
    a Sample or an IndexQuery goes as a refused stand-in (a bad sample saying why)."""
    if not isinstance(sample, (Sample, IndexQuery)):
        return m.WireSample(seq=seq, uri="", box=True, axes=[], refused=f"expected a Sample or an IndexQuery, got {describe_item(sample)}")
    axes = [_entry_to_wire(e) for e in sample.selection]
    return m.WireSample(
        seq=seq, uri=absolute_uri(sample.uri), box=isinstance(sample, Sample), axes=axes, level=sample.level,
        flip=list(sample.flip), transpose=None if sample.transpose is None else list(sample.transpose),
        normalize=sample.normalize,
    )


#: room a push message takes beside its samples (its type, id, flag and framing), with margin
PUSH_ROOM = 4096

_encoder = msgspec.msgpack.Encoder()


def fit_pushes(samples: list[m.WireSample], max_message_bytes: int) -> list[list[m.WireSample]]:
    """``samples`` cut into pushes that each fit a message of ``max_message_bytes`` (0: one
    push). A sample that alone does not fit goes as a refused stand-in (its seq, the start
    of its uri), which the daemon fails as a bad sample saying why. At least one push (an
    empty one says the input ended)."""
    room = max(max_message_bytes - PUSH_ROOM, 1)
    if not max_message_bytes or len(_encoder.encode(samples)) <= room:  # (one call: most pushes fit whole)
        return [samples]
    out: list[list[m.WireSample]] = [[]]
    used = 0
    for w in samples:
        size = len(_encoder.encode(w))
        if size > room:
            w = m.WireSample(
                seq=w.seq, uri=w.uri[:1024], box=w.box, axes=[],
                refused=f"the sample takes {size} bytes on the wire, more than a message to damacyd may hold "
                f"({max_message_bytes} bytes: damacyd --max-message-size)",
            )
            size = len(_encoder.encode(w))
        if out[-1] and used + size > room:
            out.append([])
            used = 0
        out[-1].append(w)
        used += size
    return out


def _entry_to_wire(e: Any) -> m.WireEntry:
    if isinstance(e, slice):
        return m.WireRange(e.start, e.stop, e.step)
    if isinstance(e, int):
        return m.WireAt(e)
    if e is Ellipsis:
        return m.WireRest()
    return m.WireList(list(e))


def _entry_from_wire(w: m.WireEntry) -> Any:
    if isinstance(w, m.WireRange):
        return slice(w.start, w.stop, w.step)
    if isinstance(w, m.WireAt):
        return w.index
    if isinstance(w, m.WireRest):
        return Ellipsis
    return w.indices


def sample_from_wire(w: m.WireSample) -> Sample | IndexQuery:
    """The Sample or IndexQuery a wire sample names (its checks raise as the constructors do)."""
    entries = tuple(_entry_from_wire(a) for a in w.axes)
    kind = Sample if w.box else IndexQuery
    return kind(w.uri, entries, level=w.level, flip=w.flip, transpose=w.transpose, normalize=w.normalize)


class _Listed:
    """An index list of a wire sample as an error message shows it (a few of its indices)."""

    __slots__ = ("indices",)

    def __init__(self, indices: list[int]) -> None:
        self.indices = indices

    def __repr__(self) -> str:
        return describe_indices(self.indices)


def longest_list(w: m.WireSample) -> int:
    """The most indices an index list of ``w`` holds (0: none)."""
    return max((len(a.indices) for a in w.axes if isinstance(a, m.WireList)), default=0)


def describe_wire(w: m.WireSample) -> str:
    """How a wire sample reads in an error message (it may not make a valid Sample)."""
    entries = tuple(_Listed(a.indices) if isinstance(a, m.WireList) else _entry_from_wire(a) for a in w.axes)
    level = "" if w.level is None else f", level={w.level}"
    transform = (
        (f", flip={tuple(w.flip)}" if w.flip else "") + (f", transpose={tuple(w.transpose)}" if w.transpose else "")
        + (f", normalize={tuple(w.normalize)}" if w.normalize is not None else "")
    )
    return f"{'Sample' if w.box else 'IndexQuery'}({redact_uri(w.uri)!r}, {describe(entries)}{level}{transform})"


@overload
def text(s: str) -> str: ...
@overload
def text(s: None) -> None: ...
def text(s: str | None) -> str | None:
    """``s`` as a message may carry it: UTF-8. A lone surrogate (a file name that is not
    UTF-8, a ``\\udcff`` escape in a zarr.json) is written out as its escape."""
    if s is None or s.isascii():
        return s
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "backslashreplace").decode("utf-8")


def error_to_wire(err: BaseException, seq: int | None = None) -> m.WireError:
    """An error as a message carries it: its kind (its class), status, stage and context."""
    data = to_wire(err)
    chunk = data.get("chunk")
    return m.WireError(
        kind=kind_of(err),
        reason=text(data["reason"]),
        uri=text(data.get("uri")),
        sample=text(data.get("sample")),
        path=text(data.get("path")),
        chunk=None if chunk is None else list(chunk),
        seq=seq,
        status=data.get("status"),
        what=data.get("what") or "",
    )


def error_from_wire(w: m.WireError) -> DamacyError:
    """The error :func:`error_to_wire` described, of the same class."""
    return from_wire(
        {
            "kind": w.kind, "reason": w.reason, "uri": w.uri, "sample": w.sample, "path": w.path, "chunk": w.chunk,
            "status": w.status, "what": w.what,
        }
    )

