"""Conversions between the messages and the values on either side: samples and errors.

One place for the wire form of a sample (``WireSample``: a box or per-axis index
selections, numbered by the client) and of an error (``WireError``: its type's name, the
reason and the sample's context), used by the client and the daemon alike.
"""

from __future__ import annotations

import os
from typing import Any

from damacy_protocol import messages as m
from damacy_protocol.errors import (
    BatchFailed,
    BudgetExceeded,
    DaemonUnavailable,
    DamacyError,
    InvalidArgument,
    PipelineDrained,
    ProtocolError,
    SampleError,
    UnknownSession,
    from_wire,
)
from damacy_protocol.samples import IndexQuery, Sample


def absolute_uri(uri: str) -> str:
    """A local path made absolute in this process's working directory (the daemon's is
    another); a URL (``scheme://...``) as given."""
    return uri if "://" in uri else os.path.abspath(uri)


def sample_to_wire(seq: int, sample: Any) -> m.WireSample:
    """Sample ``seq`` of a client as sent (a relative path made absolute here); InvalidArgument
    for anything but a Sample or an IndexQuery."""
    if isinstance(sample, Sample):
        return m.WireSample(seq=seq, uri=absolute_uri(sample.uri), box=[tuple(e) for e in sample.aabb])
    if isinstance(sample, IndexQuery):
        axes = [
            m.WireAxis(start=s.start, stop=s.stop, step=s.step) if isinstance(s, slice) else m.WireAxis(indices=list(s))
            for s in sample.selection
        ]
        return m.WireSample(seq=seq, uri=absolute_uri(sample.uri), index=axes)
    raise InvalidArgument(f"expected a Sample or an IndexQuery, got {type(sample).__name__}")


def sample_from_wire(w: m.WireSample) -> Sample | IndexQuery:
    """The Sample or IndexQuery a wire sample names (its checks raise as the constructors do)."""
    if w.box is not None:
        return Sample(w.uri, [tuple(e) for e in w.box])
    if w.index is not None:
        return IndexQuery(w.uri, tuple(slice(a.start, a.stop, a.step) if a.indices is None else a.indices for a in w.index))
    raise InvalidArgument("a sample needs a box or an index selection", uri=w.uri)


def describe_wire(w: m.WireSample) -> str:
    """How a wire sample reads in an error message (it may not make a valid Sample)."""
    if w.box is None:
        return f"IndexQuery({w.uri!r}, ...)"
    box = ", ".join(f"{'' if a is None else a}:{'' if b is None else b}" for a, b in w.box)
    return f"Sample({w.uri!r}, [{box}])"


_NON_SAMPLE: dict[str, type[BaseException]] = {
    "PipelineDrained": PipelineDrained,
    "BatchFailed": BatchFailed,
    "BudgetExceeded": BudgetExceeded,
    "DaemonUnavailable": DaemonUnavailable,
    "ProtocolError": ProtocolError,
    "UnknownSession": UnknownSession,
    "DamacyError": DamacyError,
    "TimeoutError": TimeoutError,
}


def error_to_wire(err: BaseException, seq: int | None = None) -> m.WireError:
    if isinstance(err, SampleError):
        return m.WireError(
            kind=type(err).__name__,
            reason=err.reason,
            uri=err.uri,
            sample=err.sample,
            path=err.path,
            chunk=None if err.chunk is None else list(err.chunk),
            seq=seq,
        )
    kind = type(err).__name__ if type(err).__name__ in _NON_SAMPLE else "DamacyError"
    return m.WireError(kind=kind, reason=str(err) or type(err).__name__, seq=seq)


def error_from_wire(w: m.WireError) -> BaseException:
    cls = _NON_SAMPLE.get(w.kind)
    if cls is not None:
        return cls(w.reason)
    return from_wire(
        {"kind": w.kind, "reason": w.reason, "uri": w.uri, "sample": w.sample, "path": w.path, "chunk": w.chunk}
    )
