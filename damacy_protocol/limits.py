"""The one home of damacy's limits: the value objects a pipeline is built from.

Each limit is defined here once, with its default and its check: :class:`BatchSpec` (what a
batch is), :class:`QueueLimits` (how far ahead), :class:`MetadataCache` (what planning
keeps), :class:`PlanLimits` (what one batch may ask for), :class:`CpuLimits` and
:class:`CudaLimits` (what an executor may hold), :class:`LatencyModel` (synthetic metadata
latency, for benchmarks) and :class:`NgffLimits` (what loading an image may read).
:class:`damacy.Config`, the daemon's options and its flags compose these.

They are frozen dataclasses, checked when made: a value of the wrong type raises
``TypeError``, one out of range ``ValueError`` naming the field and its range (``"samples
must be in [1, 65535]"``). Sizes are bytes; an explicit limit is positive (0 is refused),
except ``CudaLimits.max_index_bytes``, where 0 turns index queries off.

Beside the seed API's fields each object has damacy's own, after them and with defaults
that change nothing (a chunk cache of 0 bytes is none): see docs/seed.md.

(Over 400 lines: one job, the limits; each value object with its defaults, checks and the
defaults that follow from others, so that no limit is defined twice.)
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from damacy_protocol.dtypes import output_dtype
from damacy_protocol.enums import Dtype

#: the most axes an array, a batch's sample and a selection may have
MAX_RANK = 31
#: the most threads one reader or decoder pool may have
MAX_IO_THREADS = 1024
#: the most samples a batch may have
MAX_SAMPLES = 65535
#: the largest chunk any cap may admit (a chunk's size is a 32-bit number in the plan)
MAX_CHUNK_BYTES = (1 << 32) - 1
#: the most metadata reads in flight
MAX_METADATA_CONCURRENCY = 4096
UINT32_MAX = (1 << 32) - 1
UINT64_MAX = (1 << 64) - 1
INT63_MAX = (1 << 63) - 1

# defaults shared by the value objects and the Config that composes them
DEFAULT_CHUNK_BYTES = 2 << 20  # decoded bytes of one chunk
DEFAULT_ENCODED_CHUNK_BYTES = 4 << 20  # stored bytes of one chunk (a CPU executor's cap)
DEFAULT_CHUNKS_PER_INPUT_BUFFER = 256
DEFAULT_READ_BYTES = 4 << 20  # one read of a GPU executor
DEFAULT_MAX_INDEX_BYTES = 64 << 20
DEFAULT_HOST_BUFFER_WAVES = 2
N_WAVES = 2
MAX_HOST_BUFFER_WAVES = 8
DEFAULT_MAX_CHUNKS_PER_WAVE = 512
HARD_MAX_CHUNKS_PER_WAVE = 65535
DEFAULT_MAX_SUBSTREAMS_PER_CHUNK = 32
HARD_MAX_SUBSTREAMS_PER_CHUNK = 65535
DEFAULT_IO_WORKERS = 8  # a FileReader's
#: a Config's reader threads: the seed API's legacy adapter documents its own default
CONFIG_IO_THREADS = 64
DEFAULT_DECODE_WORKERS = 8
DEFAULT_METADATA_CONCURRENCY = 64
DEFAULT_ARRAY_ENTRIES = 256
DEFAULT_SHARD_INDEX_ENTRIES = 8192
DEFAULT_CHUNK_LAYOUT_ENTRIES = 256
DEFAULT_MAX_SHARDS_PER_SAMPLE = 64
DEFAULT_MAX_CHUNKS = 16384
DEFAULT_POP_TIMEOUT_S = 30.0
#: a GPU pipeline's device memory when its Config names a device and no budget
DEFAULT_GPU_MEMORY_BYTES = 1 << 30


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity (a container's or ``taskset``'s
    share), else the host's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # (no affinity on this platform)
        return os.cpu_count() or 1


def host_threads() -> tuple[int, int]:
    """Decode and I/O threads sized to this host (the CPUs it may use), for a process that is the host's reader
    (damacyd; a benchmark): the CPUs plus one decode threads (a decode thread holds the
    interpreter lock for the Python around each native call, and one more keeps every core
    decoding meanwhile: measured +4% to +10% with a chunk cache on 2 cores, no change
    without) and the CPUs, at least ``DEFAULT_IO_WORKERS``, I/O threads (they wait on
    storage). The value objects' defaults (8, and a Config's 64 I/O threads) are the seed
    API's."""
    cpus = usable_cpus()
    return cpus + 1, max(DEFAULT_IO_WORKERS, cpus)


def encoded_chunk_bytes_for(decoded: int) -> int:
    """The stored-size cap that goes with a decoded-size cap where only that one is given (a
    Config's ``max_chunk_uncompressed_bytes``, damacyd's ``--max-chunk-bytes``): twice it,
    at least the default (a chunk stored uncompressed, or barely compressed, with its
    codec's framing)."""
    return min(UINT32_MAX, max(DEFAULT_ENCODED_CHUNK_BYTES, 2 * decoded))


def chunks_per_input_buffer_for(decode_workers: int) -> int:
    """``chunks_per_input_buffer`` where only ``decode_workers`` is given: the default, at
    least one chunk per decode worker (the check :class:`CpuLimits` makes)."""
    return max(DEFAULT_CHUNKS_PER_INPUT_BUFFER, decode_workers)


def positive_int(value: Any, name: str, maximum: int = UINT32_MAX) -> int:
    """``value`` as an int in ``[1, maximum]``: ``TypeError`` for a non-integer (a bool is
    0 or 1), ``ValueError("{name} must be in [1, {maximum}]")`` out of range."""
    value = operator.index(value)
    if not 1 <= value <= maximum:
        raise ValueError(f"{name} must be in [1, {maximum}]")
    return value


def size_int(value: Any, name: str, maximum: int = UINT64_MAX) -> int:
    """``value`` as an int in ``[0, maximum]`` (0: off), checked as :func:`positive_int`."""
    value = operator.index(value)
    if not 0 <= value <= maximum:
        raise ValueError(f"{name} must be in [0, {maximum}]")
    return value


def index_bytes(value: Any) -> int:
    """``max_index_bytes``: 0 (index queries off) or up to eight bytes per index of 2**32-1."""
    value = operator.index(value)
    if not 0 <= value <= 8 * UINT32_MAX:
        raise ValueError("max_index_bytes must be between 0 and 8 * (2**32 - 1)")
    return value


def _set(obj: Any, **values: Any) -> None:
    for name, value in values.items():
        object.__setattr__(obj, name, value)


@dataclass(frozen=True, slots=True, init=False)
class BatchSpec:
    """What a batch is: ``samples`` samples of ``shape`` each, cast to ``dtype``.

    ``dtype`` is a :class:`~damacy_protocol.enums.Dtype` (or its name); damacy also writes
    ``"f16"``, ``"f64"``, ``"bool"`` and ``"native"`` (the array's own dtype) batches.

    >>> BatchSpec(samples=2, shape=[64, 256, 256], dtype="u16")
    BatchSpec(samples=2, shape=(64, 256, 256), dtype=<Dtype.U16: 3>)
    >>> BatchSpec(samples=0, shape=(1,))
    Traceback (most recent call last):
        ...
    ValueError: samples must be in [1, 65535]
    """

    samples: int
    shape: tuple[int, ...]
    dtype: Dtype | str

    def __init__(self, samples: int, shape: Sequence[int], dtype: Dtype | str | int = Dtype.F32) -> None:
        samples = positive_int(samples, "samples", MAX_SAMPLES)
        extents = tuple(positive_int(x, "shape extent", INT63_MAX) for x in shape)
        if not 1 <= len(extents) <= MAX_RANK:
            raise ValueError(f"shape must have between 1 and {MAX_RANK} dimensions")
        _set(self, samples=samples, shape=extents, dtype=output_dtype(dtype))

    @property
    def nbytes(self) -> int:
        """Bytes of one batch (0 for ``"native"``, whose width the array decides)."""
        from damacy_protocol.dtypes import itemsize

        return self.samples * math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class QueueLimits:
    """How far ahead a pipeline works: ``lookahead_samples`` pulled from the input and not
    yet delivered (at least one batch), and
    ``prepared_batches`` batches planned and assembled ahead of ``pop`` (each in a batch
    slot of its own: see docs/seed.md)."""

    lookahead_samples: int
    prepared_batches: int = 2

    def __post_init__(self) -> None:
        _set(self, lookahead_samples=positive_int(self.lookahead_samples, "lookahead_samples", UINT32_MAX - 4))
        _set(self, prepared_batches=positive_int(self.prepared_batches, "prepared_batches", 1024))


@dataclass(frozen=True, slots=True)
class MetadataCache:
    """How much parsed metadata planning keeps: ``array_entries`` arrays' zarr.json,
    ``shard_index_entries`` shard indexes, and (damacy's) at most ``shard_index_bytes`` of
    them (a shard's index grows with its chunks, 16 bytes each)."""

    array_entries: int = DEFAULT_ARRAY_ENTRIES
    shard_index_entries: int = DEFAULT_SHARD_INDEX_ENTRIES
    shard_index_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        _set(
            self,
            array_entries=positive_int(self.array_entries, "array_entries"),
            shard_index_entries=positive_int(self.shard_index_entries, "shard_index_entries"),
            shard_index_bytes=positive_int(self.shard_index_bytes, "shard_index_bytes", UINT64_MAX),
        )


@dataclass(frozen=True, slots=True)
class PlanLimits:
    """What one batch may ask for: ``max_chunks`` chunk uses (a chunk counts once per sample
    that uses it), chunks of at most ``max_chunk_bytes`` decoded bytes, at most
    ``max_shards_per_sample`` shards per sample, and at most ``max_plan_bytes`` of plan (its
    copy tables and index lists; also the index lists one query may carry). A batch beyond
    them fails with :class:`BudgetExceeded` (a sample over ``max_shards_per_sample``:
    :class:`InvalidArgument`).

    damacy's: byte ranges of one object closer than ``max_gap_bytes`` are read as one, up to
    ``max_read_bytes`` per read (objects in object stores: the ``remote_`` pair, since a
    request there costs a round trip in which the link carries far more than a disk's gap)."""

    max_chunks: int = DEFAULT_MAX_CHUNKS
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_shards_per_sample: int = DEFAULT_MAX_SHARDS_PER_SAMPLE
    max_plan_bytes: int = 64 << 20
    max_gap_bytes: int = 64 << 10
    max_read_bytes: int = 64 << 20
    remote_max_gap_bytes: int = 1 << 20
    remote_max_read_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        _set(
            self,
            max_chunks=positive_int(self.max_chunks, "max_chunks", DEFAULT_MAX_CHUNKS),
            max_chunk_bytes=positive_int(self.max_chunk_bytes, "max_chunk_bytes"),
            max_shards_per_sample=positive_int(self.max_shards_per_sample, "max_shards_per_sample"),
            max_plan_bytes=positive_int(self.max_plan_bytes, "max_plan_bytes", UINT64_MAX),
            max_gap_bytes=size_int(self.max_gap_bytes, "max_gap_bytes"),
            max_read_bytes=size_int(self.max_read_bytes, "max_read_bytes"),
            remote_max_gap_bytes=size_int(self.remote_max_gap_bytes, "remote_max_gap_bytes"),
            remote_max_read_bytes=size_int(self.remote_max_read_bytes, "remote_max_read_bytes"),
        )


@dataclass(frozen=True, slots=True)
class CpuLimits:
    """What the CPU executor may hold: ``max_memory_bytes`` for batch slots plus chunk data
    in flight (never exceeded; not a process RSS limit), ``decode_workers`` decode and
    assembly threads, chunks of at most ``max_encoded_chunk_bytes`` stored and
    ``max_decoded_chunk_bytes`` decoded bytes (a larger one fails its sample with
    :class:`BudgetExceeded`), and reads of at most ``chunks_per_input_buffer`` chunks in
    flight per read buffer, two buffers (see docs/seed.md for how damacy's engine spends
    these).

    damacy's: ``chunk_cache_bytes`` of decoded chunks kept across batches (0: none; beside
    ``max_memory_bytes``); ``native``: decode and copy in C without the GIL where that
    applies; ``max_inflight_requests`` object-store requests at once;
    ``chunk_cache_dir``/``chunk_cache_dir_bytes``: a disk tier for bytes fetched from
    object stores (None: none)."""

    max_memory_bytes: int
    decode_workers: int = DEFAULT_DECODE_WORKERS
    max_encoded_chunk_bytes: int = DEFAULT_ENCODED_CHUNK_BYTES
    max_decoded_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    chunks_per_input_buffer: int = DEFAULT_CHUNKS_PER_INPUT_BUFFER
    chunk_cache_bytes: int = 0
    native: bool = True
    max_inflight_requests: int = 1024
    chunk_cache_dir: str | None = None
    chunk_cache_dir_bytes: int = 64 << 30

    def __post_init__(self) -> None:
        _set(
            self,
            max_memory_bytes=positive_int(self.max_memory_bytes, "max_memory_bytes", UINT64_MAX),
            decode_workers=positive_int(self.decode_workers, "decode_workers", MAX_IO_THREADS),
            max_encoded_chunk_bytes=positive_int(self.max_encoded_chunk_bytes, "max_encoded_chunk_bytes"),
            max_decoded_chunk_bytes=positive_int(self.max_decoded_chunk_bytes, "max_decoded_chunk_bytes"),
            chunks_per_input_buffer=positive_int(self.chunks_per_input_buffer, "chunks_per_input_buffer", DEFAULT_MAX_CHUNKS),
            chunk_cache_bytes=size_int(self.chunk_cache_bytes, "chunk_cache_bytes"),
            max_inflight_requests=positive_int(self.max_inflight_requests, "max_inflight_requests"),
            chunk_cache_dir_bytes=positive_int(self.chunk_cache_dir_bytes, "chunk_cache_dir_bytes", UINT64_MAX),
        )
        if self.chunks_per_input_buffer < self.decode_workers:
            raise ValueError(
                f"chunks_per_input_buffer ({self.chunks_per_input_buffer}) must be at least decode_workers ({self.decode_workers})"
            )
        if not isinstance(self.native, bool):
            raise TypeError("native must be a bool")
        if self.chunk_cache_dir is not None and not isinstance(self.chunk_cache_dir, str):
            raise TypeError("chunk_cache_dir must be a path (str) or None")

    @property
    def input_buffer_bytes(self) -> int:
        """Encoded bytes the two read buffers may hold in flight at once."""
        return 2 * self.chunks_per_input_buffer * self.max_encoded_chunk_bytes

    @property
    def min_inflight_bytes(self) -> int:
        """The room for chunk data in flight the budget must leave beside the batch slots:
        one read of the largest chunk the caps admit, stored and decoded."""
        return self.max_encoded_chunk_bytes + self.max_decoded_chunk_bytes


@dataclass(frozen=True, slots=True)
class CudaLimits:
    """What a GPU executor may hold: ``max_gpu_memory_bytes`` of device memory (batch slots,
    the arenas chunks are read into and decoded in, index tables), index storage of
    ``max_index_bytes`` per batch (0: index queries are refused at push; else at least
    ``8 * samples * sum(shape)``), ``chunk_layout_entries`` parsed Blosc headers kept,
    chunks of at most ``max_chunk_bytes`` decoded bytes, reads of at most ``max_read_bytes``,
    ``host_buffer_waves`` batches read on the host ahead of the device, and decode calls of
    at most ``max_chunks_per_wave`` chunks, each of at most ``max_substreams_per_chunk``
    compressed streams (see docs/seed.md).

    >>> CudaLimits(1 << 30, host_buffer_waves=1)
    Traceback (most recent call last):
        ...
    ValueError: host_buffer_waves must be at least 2
    """

    max_gpu_memory_bytes: int
    max_index_bytes: int = DEFAULT_MAX_INDEX_BYTES
    chunk_layout_entries: int = DEFAULT_CHUNK_LAYOUT_ENTRIES
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_read_bytes: int = DEFAULT_READ_BYTES
    host_buffer_waves: int = DEFAULT_HOST_BUFFER_WAVES
    max_chunks_per_wave: int = DEFAULT_MAX_CHUNKS_PER_WAVE
    max_substreams_per_chunk: int = DEFAULT_MAX_SUBSTREAMS_PER_CHUNK

    def __post_init__(self) -> None:
        _set(
            self,
            max_index_bytes=index_bytes(self.max_index_bytes),
            chunk_layout_entries=positive_int(self.chunk_layout_entries, "chunk_layout_entries"),
            max_gpu_memory_bytes=positive_int(self.max_gpu_memory_bytes, "max_gpu_memory_bytes", UINT64_MAX),
            max_chunk_bytes=positive_int(self.max_chunk_bytes, "max_chunk_bytes"),
            max_read_bytes=positive_int(self.max_read_bytes, "max_read_bytes"),
            host_buffer_waves=positive_int(self.host_buffer_waves, "host_buffer_waves", MAX_HOST_BUFFER_WAVES),
        )
        if self.host_buffer_waves < N_WAVES:
            raise ValueError(f"host_buffer_waves must be at least {N_WAVES}")
        _set(
            self,
            max_chunks_per_wave=positive_int(self.max_chunks_per_wave, "max_chunks_per_wave", HARD_MAX_CHUNKS_PER_WAVE),
            max_substreams_per_chunk=positive_int(
                self.max_substreams_per_chunk, "max_substreams_per_chunk", HARD_MAX_SUBSTREAMS_PER_CHUNK
            ),
        )

    def takes_index_queries(self, samples: int, shape: Sequence[int], name: str = "CudaLimits.max_index_bytes") -> bool:
        """Does a GPU pipeline of batches of ``samples`` x ``shape`` take index queries? Not
        with ``max_index_bytes=0``; a nonzero one below a batch's indices (``8 * samples *
        sum(shape)`` bytes) is refused (BudgetExceeded, naming the field as ``name``)."""
        if self.max_index_bytes == 0:
            return False
        need = 8 * samples * sum(shape)
        if self.max_index_bytes < need:
            from damacy_protocol.errors import BudgetExceeded

            raise BudgetExceeded(
                f"{name}={self.max_index_bytes} cannot hold a batch's indices: "
                f"8 * samples * sum(shape) = {need} bytes (or 0: no index queries)"
            )
        return True

    def index_reservation(self, samples: int, shape: Sequence[int]) -> int:
        """Device bytes index storage takes for two batch slots of ``samples`` x ``shape``:
        eight bytes per index of a batch plus 16 bytes per axis for each of up to
        ``max_chunks`` chunks, per slot (0 with ``max_index_bytes=0``)."""
        if not self.max_index_bytes:
            return 0
        return 2 * (8 * samples * sum(shape) + 16 * len(shape) * DEFAULT_MAX_CHUNKS)


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """Synthetic latency added to every metadata read (for benchmarks of planning ahead): a
    ``baseline_ns`` plus a log-normal tail (``lognormal_mu_ln_ns``, ``lognormal_sigma_ln_ns``:
    the mean and spread of its natural log, in nanoseconds), at most ``cap_ns`` in all (0: no
    cap), drawn from a generator seeded with ``seed``. All zero: none."""

    baseline_ns: int = 0
    lognormal_mu_ln_ns: float = 0.0
    lognormal_sigma_ln_ns: float = 0.0
    cap_ns: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("baseline_ns", "cap_ns", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                value = operator.index(value)
            if value < 0:
                raise ValueError(f"{name} must be >= 0")
            object.__setattr__(self, name, value)
        for name in ("lognormal_mu_ln_ns", "lognormal_sigma_ln_ns"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)):
                raise TypeError(f"{name} must be a number")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite")
            object.__setattr__(self, name, float(value))
        if self.lognormal_sigma_ln_ns < 0:
            raise ValueError("lognormal_sigma_ln_ns must be >= 0")

    @property
    def active(self) -> bool:
        """Does it add any latency?"""
        return bool(self.baseline_ns or self.lognormal_mu_ln_ns or self.lognormal_sigma_ln_ns)


@dataclass(frozen=True, slots=True)
class NgffLimits:
    """What loading an OME-Zarr image may read: at most ``max_levels`` levels and
    ``max_metadata_bytes`` of JSON in all (checked before each file is read)."""

    max_levels: int = 32
    max_metadata_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        _set(
            self,
            max_levels=positive_int(self.max_levels, "max_levels", (1 << 31) - 1),
            max_metadata_bytes=positive_int(self.max_metadata_bytes, "max_metadata_bytes", UINT64_MAX),
        )
