"""Ray Data for work past one node: a :class:`Datasource` whose read tasks read groups of
damacy samples with damacy's engine on each Ray worker.

::

    import ray, damacy, damacy.ray

    windows = damacy.GridBoxes(["s3://bucket/volume.zarr"], (64, 256, 256))
    cfg = damacy.Config(samples_per_batch=16, sample_shape=(64, 256, 256), dtype="f32", drop_last=False)
    ds = damacy.ray.read(windows, cfg)               # = ray.data.read_datasource(Datasource(windows, cfg))
    for batch in ds.iter_torch_batches(batch_size=32):
        x, where = batch["data"], batch["index"]     # (32, 64, 256, 256) float32; positions in windows

The samples are a sampler (``RandomBoxes``, ``Shuffled``, ``GridBoxes``: read tasks carry
the sampler and a range of its positions and compute their samples on the worker, so an
epoch is never listed on the driver), a sequence of samples (sliced), or any other finite
iterable of them (listed once, on the driver). A sampler is copied as it is when the dataset
is made (its epoch and rank: ``set_epoch`` first; datasets of several epochs may be made
before any is read); with ``world_size=1`` the dataset holds the whole epoch, every
position once.

Each block is one damacy batch (``config.samples_per_batch`` rows; a task's last may be
shorter, so the Config must say ``drop_last=False``: its default, ``True``, would leave the
last rows of every task out, and is refused) with the columns

- ``data``: the samples, a tensor column of ``config.sample_shape`` and ``config.dtype``
  (per name, ``{name: Config}`` and :class:`~damacy.multi.MultiSample` s: a column per name);
- ``index`` (int64): the sample's position in the samples given (a sampler: in its epoch's
  share), so every row can be traced to its sample;
- ``array`` (int32): the sample's array, an index into :attr:`Datasource.uris`;
- ``origin`` (int64, one per named axis): the box's start in the array, when every sample is
  a box with every axis named (always so for the samplers' samples);
- ``filled`` (bool): the sample could not be read and holds the fill value instead
  (``on_error="fill"``; the error is logged by the task, naming the sample).

All of them are numbers, so ``iter_torch_batches`` converts every column. Samples that only
even out ranks (:class:`~damacy.Padding`) are dropped. ``on_error="skip"`` drops a failing
sample's row; ``"stop"`` (the Config's default) and ``"raise"`` fail the read task, which
Ray retries and then reports with the sample and its cause.

Each task runs ``damacy.Pipeline(config)``: the node's damacyd when one answers there (its
caches shared by every task of the node), else the engine in the task's process;
``embedded=True`` or ``endpoint=`` choose, as for a pipeline. A task's engine uses
``config.n_io_threads``/``decode_workers`` threads: set them
to the CPUs a task is given (``read(..., num_cpus=k)``) when many tasks share a node.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import ray.data
from ray.data.block import BlockAccessor, BlockMetadata
from ray.data.datasource import ReadTask

from damacy.multi import MultiPipeline, MultiSample
from damacy.pipeline import Pipeline
from damacy_protocol.config import Config
from damacy_protocol.dtypes import dtype_name, itemsize
from damacy_protocol.errors import InvalidArgument
from damacy_protocol.samples import IndexQuery, Padding, Sample

log = logging.getLogger("damacy")


def _itemsize(dtype: Any) -> int:
    """Bytes per element of a batch dtype (``native``: not known before the arrays are read;
    4 for the estimate Ray makes of a dataset's size)."""
    return itemsize(dtype) or 4


class _Positions:
    """The samples as positions [0, n): a sampler's (computed on the worker from the
    position on) or a list's."""

    def __init__(self, samples: Any) -> None:
        if callable(getattr(samples, "iter_from", None)) and hasattr(samples, "__len__"):
            # a copy as it is now: a dataset is read when consumed, after the caller may have
            # moved the sampler on to its next epoch
            self.sampler: Any = copy.deepcopy(samples)
            self.items: list | None = None
            self.n = len(samples)
        else:
            if isinstance(samples, (str, bytes, Sample, IndexQuery, MultiSample, Mapping)):
                raise InvalidArgument(f"a Datasource takes an iterable of samples, got one {type(samples).__name__}")
            self.sampler = None
            self.items = list(samples)  # finite: listed once (and a list changed later is not what is read)
            self.n = len(self.items)
            for i, s in enumerate(self.items):
                if not isinstance(s, (Sample, IndexQuery, MultiSample)):
                    raise InvalidArgument(
                        f"sample {i} is a {type(s).__name__}, not a Sample, IndexQuery or MultiSample"
                    )

    def part(self, lo: int, hi: int) -> Any:
        """What a task carries for positions [lo, hi)."""
        if self.sampler is not None:
            return ("sampler", self.sampler, lo, hi)
        return ("list", list(self.items[lo:hi]), lo, hi)  # type: ignore[index]


def _iterate(part: Any) -> Iterator[Any]:
    kind, what, lo, hi = part
    if kind == "sampler":
        return itertools.islice(what.iter_from(lo), hi - lo)
    return iter(what)


def _key(sample: Any, first: str | None) -> Any:
    return sample.parts[first] if first is not None else sample


def _origin(sample: Any) -> list[int] | None:
    """A box's start per axis, None unless it is a box with every axis named and closed."""
    if not isinstance(sample, Sample):
        return None
    out = []
    for e in sample.selection:
        if isinstance(e, int):
            out.append(e)
        elif isinstance(e, slice) and e.start is not None and e.stop is not None:
            out.append(int(e.start))
        else:
            return None
    return out


class Datasource(ray.data.Datasource):
    """Samples read by damacy as a Ray dataset (see the module's text).

    ``samples``: a sampler, a sequence or a finite iterable of :class:`Sample`,
    :class:`IndexQuery` or :class:`~damacy.multi.MultiSample`; ``config``: what a batch is
    (a :class:`Config`, or ``{name: Config}`` for multi-samples); ``rows_per_task``: the
    least number of samples a read task reads (default: 4 batches; a task starts one
    pipeline); ``embedded``/``endpoint``: as for :func:`damacy.Pipeline`."""

    def __init__(
        self,
        samples: Iterable[Any],
        config: Config | Mapping[str, Config],
        *,
        rows_per_task: int | None = None,
        embedded: bool | None = None,
        endpoint: str | None = None,
    ) -> None:
        if isinstance(config, Config):
            self.configs: dict[str, Config] | None = None
            configs = {"data": config}
        elif isinstance(config, Mapping) and config and all(isinstance(c, Config) for c in config.values()):
            self.configs = dict(config)
            configs = self.configs
            if "index" in configs or "array" in configs or "origin" in configs or "filled" in configs:
                raise InvalidArgument(
                    f"names {sorted(configs)} clash with the metadata columns index, array, origin, filled"
                )
        else:
            raise InvalidArgument(f"config must be a damacy.Config or {{name: Config}}, got {type(config).__name__}")
        for name, c in configs.items():
            if dtype_name(c.dtype) == "bf16":
                raise InvalidArgument(f"{name}: bf16 has no Arrow tensor type; read f32 or f16 and cast in the model")
            if c.drop_last:
                raise InvalidArgument(
                    f"{name}: drop_last (the Config's default) would drop the last rows of every read task; a dataset "
                    "reads every sample: give the Config drop_last=False (and drop short batches where they are "
                    "consumed: iter_batches(drop_last=True))"
                )
            if c.device is not None:
                raise InvalidArgument(
                    f"{name}: Ray Data blocks live in host memory: config.device must be None, got {c.device}"
                )
        self.config = config
        self.rows_per_batch = next(iter(configs.values())).samples_per_batch
        if rows_per_task is not None and (not isinstance(rows_per_task, int) or rows_per_task < 1):
            raise InvalidArgument(f"rows_per_task must be a positive integer, got {rows_per_task!r}")
        self.rows_per_task = rows_per_task or 4 * self.rows_per_batch
        self.embedded = embedded
        self.endpoint = endpoint
        self._positions = _Positions(samples)
        self._first = next(iter(self.configs)) if self.configs is not None else None
        self.uris, self._boxes = self._describe(samples)
        self._row_bytes = sum(
            math.prod(c.sample_shape) * _itemsize(c.dtype) for c in configs.values()
        )  # native: a guess

    def _describe(self, samples: Any) -> tuple[tuple[str, ...], int | None]:
        """The arrays (the ``array`` column's table) and the boxes' number of axes (None:
        no ``origin`` column)."""
        sampler = self._positions.sampler
        arrays = getattr(sampler, "arrays", None)
        if sampler is not None and arrays is not None:  # RandomBoxes, GridBoxes: boxes of these arrays
            uris = []
            for a in range(len(arrays)):
                where = arrays.where(a)
                if isinstance(where, Mapping):  # a group: the sample is named by its first part
                    where = where.get(self._first, next(iter(where.values())))
                uris.append(str(where))
            return tuple(dict.fromkeys(uris)), len(sampler.sample_shape)
        items = sampler.samples if sampler is not None else self._positions.items  # Shuffled: its list
        uris = []
        ndims = set()
        for s in items:
            if isinstance(s, MultiSample) != (self._first is not None):
                raise InvalidArgument(
                    "a {name: Config} reads MultiSamples, a Config reads Samples and IndexQueries; "
                    f"got {type(s).__name__} for {'a mapping' if self._first is not None else 'a Config'}"
                )
            if isinstance(s, MultiSample) and list(s.parts) != list(self.configs):  # type: ignore[arg-type]
                raise InvalidArgument(f"a MultiSample names {list(s.parts)}, the configs {list(self.configs)}")  # type: ignore[arg-type]
            uris.append(_key(s, self._first).uri)
            o = _origin(_key(s, self._first))
            ndims.add(None if o is None else len(o))
        ndim = ndims.pop() if len(ndims) == 1 else None
        return tuple(dict.fromkeys(uris)), ndim

    # -- what Ray asks ------------------------------------------------------------
    def get_name(self) -> str:
        return "damacy"

    def estimate_inmemory_data_size(self) -> int | None:
        return self._positions.n * self._row_bytes

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
    ) -> list[ReadTask]:
        n = self._positions.n
        if n == 0:
            return []
        # tasks of whole batches, at least rows_per_task each, at most `parallelism` of them
        batches = math.ceil(n / self.rows_per_batch)
        tasks = max(1, min(max(1, int(parallelism)), math.ceil(n / self.rows_per_task), batches))
        per_task = math.ceil(batches / tasks) * self.rows_per_batch
        out = []
        for lo in range(0, n, per_task):
            hi = min(n, lo + per_task)
            meta = BlockMetadata(
                num_rows=hi - lo, size_bytes=(hi - lo) * self._row_bytes, exec_stats=None, input_files=None
            )
            read = _Reader(self, self._positions.part(lo, hi))
            if per_task_row_limit is None:
                out.append(ReadTask(read, meta))
            else:
                out.append(ReadTask(read, meta, per_task_row_limit=per_task_row_limit))
        return out


class _Reader:
    """One read task: its samples through one pipeline, a block per batch."""

    def __init__(self, source: Datasource, part: Any) -> None:
        self.config = source.config
        self.first = source._first
        self.names = list(source.configs) if source.configs is not None else None  # the data columns
        self.uris = {u: i for i, u in enumerate(source.uris)}
        self.boxes = source._boxes
        self.embedded = source.embedded
        self.endpoint = source.endpoint
        self.part = part

    def __call__(self) -> Iterator[Any]:
        pending: dict[Any, deque[int]] = {}  # sample -> its positions pushed and not delivered
        lock = threading.Lock()
        lo = self.part[2]

        def tagged() -> Iterator[Any]:
            for i, s in enumerate(_iterate(self.part), lo):
                if not isinstance(s, Padding):
                    with lock:
                        pending.setdefault(_key(s, self.first), deque()).append(i)
                yield s

        kw: dict[str, Any] = {}
        if self.endpoint is not None:
            kw["endpoint"] = self.endpoint
        if self.embedded is not None:
            kw["embedded"] = self.embedded
        pipe = MultiPipeline(self.config, **kw) if isinstance(self.config, Mapping) else Pipeline(self.config, **kw)
        with pipe:
            pipe.push(tagged())
            for batch in pipe.batches():
                with batch:
                    yield self._block(batch, pending, lock)

    def _block(self, batch: Any, pending: dict[Any, deque[int]], lock: threading.Lock) -> Any:
        names = self.names
        head = batch[names[0]] if names is not None else batch
        info = head.info
        keep = [k for k, s in enumerate(info.samples) if not isinstance(s, Padding)]
        filled = np.zeros(len(info.samples), dtype=bool)
        for part in [batch[n] for n in names] if names is not None else [head]:  # a group: any part's fill
            for k, err in part.info.errors:
                filled[k] = True
                log.warning("damacy.ray: filled %r: %s", part.info.samples[k], err)
        for s, err in info.skipped:
            log.warning("damacy.ray: skipped %r: %s", s, err)
        index = np.empty(len(keep), dtype=np.int64)
        array = np.empty(len(keep), dtype=np.int32)
        origin = np.empty((len(keep), self.boxes or 0), dtype=np.int64)
        with lock:
            for r, k in enumerate(keep):
                s = info.samples[k]
                index[r] = pending[s].popleft()
                array[r] = self.uris[s.uri]
                if self.boxes is not None:
                    o = _origin(s)
                    origin[r] = o if o is not None and len(o) == self.boxes else -1
        cols: dict[str, np.ndarray] = {}
        rows = np.asarray(keep, dtype=np.intp)
        for name, b in [(n, batch[n]) for n in names] if names is not None else [("data", batch)]:
            x = b.numpy()
            cols[name] = x[rows] if len(keep) != len(x) else x.copy()  # out of the slot before it is let go
        cols["index"] = index
        cols["array"] = array
        if self.boxes is not None:
            cols["origin"] = origin
        cols["filled"] = filled[rows]
        return BlockAccessor.batch_to_block(cols)


def read(
    samples: Iterable[Any],
    config: Config | Mapping[str, Config],
    *,
    rows_per_task: int | None = None,
    embedded: bool | None = None,
    endpoint: str | None = None,
    **ray_args: Any,
) -> ray.data.Dataset:
    """``ray.data.read_datasource(Datasource(samples, config, ...), **ray_args)``: the
    samples as a Ray dataset (``ray_args``: ``num_cpus=``, ``concurrency=``,
    ``override_num_blocks=``, ...)."""
    source = Datasource(samples, config, rows_per_task=rows_per_task, embedded=embedded, endpoint=endpoint)
    return ray.data.read_datasource(source, **ray_args)
