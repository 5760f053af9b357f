"""Samples of several arrays at once (an image, its labels, its mask at one box): one
pipeline per name, fed from one stream, popped together.

A :class:`MultiSample` names a sample per array; :class:`MultiPipeline` takes a
:class:`~damacy_protocol.config.Config` per name (each its own dtype and sample shape) and
hands out :class:`MultiBatch` es, one batch per name, each usable through DLPack. Batch ``k``
of every name holds the parts of the same samples: a pop that fails for one name (``on_error=
"raise"``) lets the other names' batch ``k`` go and raises. ``on_error="skip"`` would drop a
sample from one name's batch only, so it is refused.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from damacy.pipeline import Pipeline
from damacy_protocol.config import Config
from damacy_protocol.errors import InvalidArgument, PipelineDrained, PoolStarved
from damacy_protocol.samples import IndexQuery, Sample
from damacy_runtime.batch import Batch


class MultiSample:
    """A sample of several arrays: ``{name: Sample or IndexQuery}``, in the names' order."""

    __slots__ = ("parts",)

    def __init__(self, parts: Mapping[str, Sample | IndexQuery]) -> None:
        if not isinstance(parts, Mapping) or not parts:
            raise InvalidArgument("a MultiSample takes a non-empty {name: Sample or IndexQuery}")
        for name, part in parts.items():
            if not isinstance(name, str) or not isinstance(part, (Sample, IndexQuery)):
                raise InvalidArgument(f"a MultiSample's parts are named samples, got {name!r}: {type(part).__name__}")
        object.__setattr__(self, "parts", dict(parts))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("MultiSample is immutable")

    def __getitem__(self, name: str) -> Sample | IndexQuery:
        return self.parts[name]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MultiSample) and self.parts == other.parts

    def __hash__(self) -> int:
        return hash(tuple(self.parts.items()))

    def __reduce__(self):
        return (MultiSample, (self.parts,))

    def __repr__(self) -> str:
        return f"MultiSample({self.parts!r})"

    @classmethod
    def at(
        cls, uris: Mapping[str, str], box: Any, *, scales: Mapping[str, float] | None = None, levels: Mapping[str, int] | None = None,
        normalize: Mapping[str, tuple[float, float]] | None = None, **transform: Any,
    ) -> MultiSample:
        """The same box of every array in ``uris``: per name a :class:`Sample` of ``box``,
        its coordinates multiplied by ``scales[name]`` (e.g. 0.5 for labels stored at half
        the resolution: they must land on whole numbers), read at ``levels[name]`` and
        normalised by ``normalize[name]`` = (offset, scale); ``flip``/``transpose`` apply to
        every part."""
        for what, given in (("normalize", normalize), ("scales", scales), ("levels", levels)):
            unknown = set(given or ()) - set(uris)
            if unknown:  # a misspelt name would read that array unscaled, at level 0
                raise InvalidArgument(f"{what} names {sorted(unknown)}, the sample's arrays are {sorted(uris)}")
        parts = {}
        for name, uri in uris.items():
            s = Sample(uri, box, level=(levels or {}).get(name), normalize=(normalize or {}).get(name), **transform)
            factor = (scales or {}).get(name)
            if factor is not None:
                scaled = []
                for e in s.selection:
                    if not isinstance(e, slice) or e.start is None or e.stop is None:
                        raise InvalidArgument(f"{name}: only a box of closed ranges can be scaled, got {s!r}", uri=uri)
                    a, b = e.start * factor, e.stop * factor
                    if abs(a - round(a)) > 1e-9 * max(1.0, abs(a)) or abs(b - round(b)) > 1e-9 * max(1.0, abs(b)):
                        raise InvalidArgument(f"{name}: the box scaled by {factor} is not on whole numbers ({a}, {b})", uri=uri)
                    scaled.append((round(a), round(b)))  # 49 * (1/49) is 0.999...: whole within rounding
                s = Sample(uri, tuple(scaled), level=s.level, flip=s.flip, transpose=s.transpose, normalize=s.normalize)
            parts[name] = s
        return cls(parts)


class MultiBatch:
    """Batch ``batch_id`` of every name: ``multi["image"]`` is a :class:`Batch` (DLPack,
    ``numpy()``, ``info``). Release it (or use it as a context manager) to let every slot go."""

    def __init__(self, batches: dict[str, Batch]) -> None:
        self.batches = batches

    def __getitem__(self, name: str) -> Batch:
        return self.batches[name]

    def keys(self):
        return self.batches.keys()

    def items(self):
        return self.batches.items()

    @property
    def batch_id(self) -> int:
        return next(iter(self.batches.values())).info.batch_id

    def release(self) -> None:
        for b in self.batches.values():
            b.release()

    def __enter__(self) -> MultiBatch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class MultiPipeline:
    """One pipeline per name (``configs``: ``{name: Config}``, the same ``samples_per_batch``
    and ``on_error`` in each), fed by :meth:`push` from one stream of :class:`MultiSample`;
    ``pipeline_kw`` goes to each :func:`damacy.Pipeline` (``endpoint=`` for a damacyd)."""

    def __init__(self, configs: Mapping[str, Config], **pipeline_kw: Any) -> None:
        if not configs:
            raise InvalidArgument("MultiPipeline needs a Config per name")
        sizes = {c.samples_per_batch for c in configs.values()}
        policies = {c.on_error for c in configs.values()}
        ends = {c.drop_last for c in configs.values()}
        if len(sizes) != 1 or len(policies) != 1 or len(ends) != 1:
            raise InvalidArgument("every name's Config must have the same samples_per_batch, on_error and drop_last")
        if "skip" in policies:
            raise InvalidArgument('on_error="skip" would drop a sample from one name\'s batch only; use "fill" or "raise"')
        self.names = list(configs)
        # batch k's outcome per name (its Batch, or the DamacyError its pop raised) while
        # another name's pop has not answered (a timeout): the next pop completes it
        self._pending: dict[str, Any] = {}
        self.pipes: dict[str, Any] = {}
        try:
            for name, cfg in configs.items():
                self.pipes[name] = Pipeline(cfg, **pipeline_kw)
        except BaseException:
            self.close()
            raise

    def push(self, samples: Iterable[MultiSample]) -> None:
        """Queue multi-samples (pulled lazily, as each name's pipeline has room)."""
        state_of = getattr(samples, "state_dict", None)
        split = _Split(_checked(samples, self.names), self.names, state_of() if callable(state_of) else None)
        for name in self.names:
            self.pipes[name].push(split.branch(name))

    def pop(self, timeout: float | None = None) -> MultiBatch:
        """Batch k of every name. A name whose pop times out (or is interrupted) keeps the
        others' batch k for the next pop, so names never get out of step; a name whose
        batch k failed fails batch k of all (raised once every name has answered)."""
        for name in self.names:
            if name in self._pending:
                continue
            try:
                self._pending[name] = self.pipes[name].pop(timeout)
            except PipelineDrained:
                self._let_go()
                raise
            except PoolStarved:  # timed out, nothing delivered (SlotsHeld too): the next pop asks again
                raise
            except Exception as e:  # batch k of this name is spent (a sample's error, a failed
                self._pending[name] = e  # batch, the iterable's): every name's k goes with it
        got, self._pending = self._pending, {}
        errors = [v for v in got.values() if isinstance(v, Exception)]
        if errors:
            for v in got.values():
                if isinstance(v, Batch):
                    v.release()
            raise errors[0]
        return MultiBatch({name: got[name] for name in self.names})

    def _let_go(self) -> None:
        for v in self._pending.values():
            if isinstance(v, Batch):
                v.release()
        self._pending = {}

    def batches(self, n: int | None = None) -> Iterator[MultiBatch]:
        for _ in itertools.count() if n is None else range(n):
            try:
                yield self.pop()
            except PipelineDrained:
                return

    def __iter__(self) -> Iterator[MultiBatch]:
        return self.batches()

    def state_dict(self) -> dict[str, Any]:
        """Each name's pipeline state (see ``Pipeline.state_dict``), all at the same place:
        the least any name has seen (a name may be a batch ahead: its batch k released, or
        its error counted, while another's is held or still coming), so a resume reads every
        name from one position and keeps them in step."""
        states = {name: pipe.state_dict() for name, pipe in self.pipes.items()}
        least = min(states.values(), key=lambda st: (st["push"], st["offset"]))
        return {name: dict(least) for name in states}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name, pipe in self.pipes.items():
            pipe.load_state_dict(state[name])

    def stats(self) -> dict[str, Any]:
        """Each name's :class:`~damacy.Stats`."""
        return {name: pipe.stats() for name, pipe in self.pipes.items()}

    def stats_dict(self) -> dict[str, Any]:
        """Each name's figures as plain data (see ``Pipeline.stats_dict``)."""
        return {name: pipe.stats_dict() for name, pipe in self.pipes.items()}

    def close(self) -> None:
        if getattr(self, "_pending", None):
            self._let_go()
        for pipe in getattr(self, "pipes", {}).values():
            pipe.close()

    def __enter__(self) -> MultiPipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Split:
    """One stream of multi-samples as one stream of parts per name, each pulled from its own
    pipeline's thread (``itertools.tee`` is not safe across threads): a part waits in its
    name's queue until that pipeline pulls it."""

    def __init__(self, source: Iterator[MultiSample], names: list[str], state: Any = None) -> None:
        self._source = source
        self.state = state  # the pushed iterable's state_dict() (a sampler's), for each branch
        self._queues: dict[str, deque] = {name: deque() for name in names}
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._done = False

    def branch(self, name: str) -> _Branch:
        return _Branch(self._parts(name), self.state)

    def _parts(self, name: str) -> Iterator[Any]:
        queue = self._queues[name]
        while True:
            with self._lock:
                if not queue:
                    if self._error is not None:
                        raise self._error
                    if self._done:
                        return
                    try:
                        item = next(self._source)
                    except StopIteration:
                        self._done = True
                        return
                    except BaseException as e:  # every name's pop reports it
                        self._error = e
                        raise
                    for q in self._queues.values():
                        q.append(item)
                item = queue.popleft()
            yield item[name]


class _Branch:
    """One name's parts, with the pushed iterable's state (what a pipeline's state_dict
    records of the iterable it was pushed)."""

    def __init__(self, parts: Iterator[Any], state: Any) -> None:
        self._parts = parts
        self._state = state

    def __iter__(self) -> Iterator[Any]:
        return self._parts

    def state_dict(self) -> Any:
        return self._state


def _checked(samples: Iterable[Any], names: list[str]) -> Iterator[MultiSample]:
    for s in samples:
        if not isinstance(s, MultiSample) or list(s.parts) != names:
            raise InvalidArgument(f"MultiPipeline takes MultiSamples of {names}, got {s!r}")
        yield s
