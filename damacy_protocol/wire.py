"""Conversions between the messages and the values on either side: samples and errors.

One place for the wire form of a sample (``WireSample``: a box or per-axis index
selections, numbered by the client) and of an error (``WireError``: its type's name, the
reason and the sample's context), used by the client and the daemon alike.
"""

from __future__ import annotations

import os
from typing import Any

from damacy_protocol import messages as m
from damacy_protocol.errors import ERRORS, InvalidArgument, SampleError, from_wire, kind_of
from damacy_protocol.samples import IndexQuery, Sample
from damacy_protocol.selection import describe


def absolute_uri(uri: str) -> str:
    """A local path made absolute in this process's working directory (the daemon's is
    another); a URL (``scheme://...``) as given."""
    return uri if "://" in uri else os.path.abspath(uri)


def sample_to_wire(seq: int, sample: Any) -> m.WireSample:
    """Sample ``seq`` of a client as sent (a relative path made absolute here); InvalidArgument
    for anything but a Sample or an IndexQuery."""
    if not isinstance(sample, (Sample, IndexQuery)):
        raise InvalidArgument(f"expected a Sample or an IndexQuery, got {type(sample).__name__}")
    axes = [_entry_to_wire(e) for e in sample.selection]
    return m.WireSample(
        seq=seq, uri=absolute_uri(sample.uri), box=isinstance(sample, Sample), axes=axes, level=sample.level,
        flip=list(sample.flip), transpose=None if sample.transpose is None else list(sample.transpose),
        normalize=sample.normalize,
    )


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


def describe_wire(w: m.WireSample) -> str:
    """How a wire sample reads in an error message (it may not make a valid Sample)."""
    entries = tuple(_entry_from_wire(a) for a in w.axes)
    level = "" if w.level is None else f", level={w.level}"
    transform = (
        (f", flip={tuple(w.flip)}" if w.flip else "") + (f", transpose={tuple(w.transpose)}" if w.transpose else "")
        + (f", normalize={tuple(w.normalize)}" if w.normalize is not None else "")
    )
    return f"{'Sample' if w.box else 'IndexQuery'}({w.uri!r}, {describe(entries)}{level}{transform})"


def error_to_wire(err: BaseException, seq: int | None = None) -> m.WireError:
    kind = kind_of(err)
    if isinstance(err, SampleError):
        return m.WireError(
            kind=kind,
            reason=err.reason,
            uri=err.uri,
            sample=err.sample,
            path=err.path,
            chunk=None if err.chunk is None else list(err.chunk),
            seq=seq,
        )
    return m.WireError(kind=kind, reason=str(err) or type(err).__name__, seq=seq)


def error_from_wire(w: m.WireError) -> BaseException:
    cls = ERRORS.get(w.kind, SampleError)
    if not issubclass(cls, SampleError):
        return cls(w.reason)
    return from_wire(
        {"kind": w.kind, "reason": w.reason, "uri": w.uri, "sample": w.sample, "path": w.path, "chunk": w.chunk}
    )
