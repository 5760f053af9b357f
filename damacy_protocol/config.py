"""The configuration of a pipeline: one frozen value, checked when it is made.

:class:`Config` is the seed API's adapter: one flat value whose fields compose the value
objects of :mod:`damacy_protocol.limits` (each field's default and range come from there).
The same Config configures an embedded pipeline and a daemon session; it travels in the
daemon's ``Hello`` as :meth:`Config.to_dict` and is checked again where it arrives.

(Over 400 lines: one job, the Config; its fields' checks keep the seed API's messages one by
one, and it composes each value object from them.)
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from damacy_protocol import limits as L
from damacy_protocol.dtypes import dtype_name, output_dtype
from damacy_protocol.enums import BoundsPolicy, Dtype, ErrorPolicy, NumaStrategy
from damacy_protocol.limits import (
    BatchSpec,
    CpuLimits,
    CudaLimits,
    LatencyModel,
    MetadataCache,
    PlanLimits,
    QueueLimits,
)

#: host memory of a Config pipeline that names no budget (CpuLimits has no default)
DEFAULT_MAX_MEMORY_BYTES = 2 << 30


def _in_range(value: Any, name: str, lo: int, hi: int) -> int:
    """The seed Config's check: ``"{name} must be in [lo, hi] (got v)"``."""
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}] (got {value})")
    return operator.index(value)


def _at_least_one(value: Any, name: str) -> int:
    if value < 1:
        raise ValueError(f"{name} must be >= 1 (got {value})")
    return operator.index(value)


#: the Config fields that describe the engine's components, which damacyd owns: a session
#: through damacyd uses the daemon's (its flags), not its Config's (see Config.daemon_owned)
DAEMON_OWNED = (
    "max_chunk_uncompressed_bytes", "max_read_op_bytes", "max_gpu_memory_bytes", "host_buffer_waves",
    "max_chunks_per_wave", "max_substreams_per_chunk", "n_io_threads", "metadata_io_concurrency",
    "n_array_meta_cache", "n_shard_index_cache", "n_chunk_layout_cache", "max_shards_per_sample", "numa_strategy",
    "numa_node", "metadata_latency", "max_memory_bytes", "decode_workers", "shard_index_cache_bytes",
    "chunk_cache_bytes", "chunk_cache_dir", "chunk_cache_dir_bytes", "switch_interval_s",
)


class _Chosen(int):
    """A cache size Config chose, not one it was given: its default, raised to the floor of
    the samples in flight. A variant built with :func:`dataclasses.replace` chooses it again
    for its own batches (a number it was given it keeps, and checks)."""

    __slots__ = ()


@dataclass(frozen=True, slots=True, init=False)
class Config:
    """Everything a pipeline needs, in one frozen value; build variants with
    :func:`dataclasses.replace`.

    >>> import dataclasses
    >>> cfg = Config(samples_per_batch=8, sample_shape=(8, 16))
    >>> cfg.dtype is Dtype.F32, cfg.lookahead_samples
    (True, 16)
    >>> dataclasses.replace(cfg, samples_per_batch=64, lookahead_samples=128).samples_per_batch
    64
    >>> Config(samples_per_batch=0, sample_shape=(8, 16))
    Traceback (most recent call last):
        ...
    ValueError: samples_per_batch must be >= 1 (got 0)

    What a batch is: ``samples_per_batch`` samples of ``sample_shape``, cast to ``dtype``
    (a :class:`Dtype` or its name; damacy also writes ``"f16"``, ``"f64"``, ``"bool"`` and
    ``"native"``, the array's own).

    Where: with ``max_gpu_memory_bytes`` the pipeline runs on a GPU, as the seed API's
    Config does: ``device=k`` on GPU k, ``device=None`` on the GPU whose CUDA context is
    current in the calling thread (none current: :class:`InvalidArgument`). Without it,
    ``device=None`` streams into host memory (damacy's own) and ``device=k`` uses GPU k with
    a budget of 1 GiB.

    The seed API's fields, each composing a value object's limit (see
    :mod:`damacy_protocol.limits` and docs/seed.md for what each means in damacy's
    engine): ``lookahead_samples`` (default two batches), ``max_chunk_uncompressed_bytes``,
    ``max_read_op_bytes``, ``max_index_bytes``, ``host_buffer_waves``,
    ``max_chunks_per_wave``, ``max_substreams_per_chunk``, ``n_io_threads`` (reader
    threads), ``metadata_io_concurrency``, ``n_array_meta_cache``, ``n_shard_index_cache``,
    ``n_chunk_layout_cache``, ``max_shards_per_sample``, ``pop_timeout_s`` (default 30 s;
    ``None``: no limit), ``enable_gds`` (GPUDirect Storage: damacy has none, so ``True``,
    or ``None`` with ``DAMACY_GDS_ENABLE=1``, is refused), ``numa_strategy``/``numa_node``,
    ``metadata_latency``.

    damacy's own: ``max_memory_bytes`` (host memory for batch slots plus chunk data in
    flight, default 2 GiB), ``prepared_batches`` (batch slots), ``decode_workers``,
    ``shard_index_cache_bytes``, ``chunk_cache_bytes`` (decoded chunks kept across batches;
    0: none; a daemon has one cache for all its clients instead), ``chunk_cache_dir`` and
    ``chunk_cache_dir_bytes`` (a disk tier for bytes fetched from object stores),
    ``on_error`` (``"stop"``: a bad sample's error is raised at the pop that would have held
    it and the pipeline stops, as the seed API's does; ``"raise"``: raised there and the
    next pop goes on; ``"fill"``: filled with the fill value and listed in
    ``batch.info.errors``; ``"skip"``: replaced by the next sample), ``out_of_bounds``
    (``"error"``, or ``"pad"`` with the fill value), ``drop_last`` (``True``, as the seed
    API: only whole batches; ``False``: the last one short), ``switch_interval_s`` (the
    interpreter's thread switch interval while an embedded pipeline is open; ``None``: left
    alone) and ``storage_options`` (object-store options by uri prefix, embedded pipelines).
    """

    samples_per_batch: int
    dtype: Dtype | str
    lookahead_samples: int
    max_chunk_uncompressed_bytes: int
    max_read_op_bytes: int
    max_gpu_memory_bytes: int | None
    max_index_bytes: int
    host_buffer_waves: int
    max_chunks_per_wave: int
    max_substreams_per_chunk: int
    n_io_threads: int
    metadata_io_concurrency: int
    n_array_meta_cache: int
    n_shard_index_cache: int
    n_chunk_layout_cache: int
    max_shards_per_sample: int
    sample_shape: tuple[int, ...]
    device: int | None
    pop_timeout_s: float | None
    enable_gds: bool | None
    numa_strategy: NumaStrategy
    numa_node: int
    metadata_latency: LatencyModel
    # damacy's own
    max_memory_bytes: int
    prepared_batches: int
    decode_workers: int
    shard_index_cache_bytes: int
    chunk_cache_bytes: int
    chunk_cache_dir: str | None
    chunk_cache_dir_bytes: int
    on_error: ErrorPolicy
    out_of_bounds: BoundsPolicy
    drop_last: bool
    switch_interval_s: float | None
    storage_options: dict[str, dict[str, str]] = field(hash=False)

    def __init__(
        self,
        *,
        samples_per_batch: int,
        sample_shape: Sequence[int] | int,
        max_gpu_memory_bytes: int | None = None,
        dtype: Dtype | str | int = Dtype.F32,
        lookahead_samples: int | None = None,
        max_chunk_uncompressed_bytes: int = L.DEFAULT_CHUNK_BYTES,
        max_read_op_bytes: int = L.DEFAULT_READ_BYTES,
        max_index_bytes: int = L.DEFAULT_MAX_INDEX_BYTES,
        host_buffer_waves: int = L.DEFAULT_HOST_BUFFER_WAVES,
        max_chunks_per_wave: int = L.DEFAULT_MAX_CHUNKS_PER_WAVE,
        max_substreams_per_chunk: int = L.DEFAULT_MAX_SUBSTREAMS_PER_CHUNK,
        n_io_threads: int = L.CONFIG_IO_THREADS,
        metadata_io_concurrency: int = L.DEFAULT_METADATA_CONCURRENCY,
        n_array_meta_cache: int | None = None,
        n_shard_index_cache: int | None = None,
        n_chunk_layout_cache: int | None = None,
        max_shards_per_sample: int = L.DEFAULT_MAX_SHARDS_PER_SAMPLE,
        device: int | None = None,
        pop_timeout_s: float | None = L.DEFAULT_POP_TIMEOUT_S,
        enable_gds: bool | None = None,
        numa_strategy: NumaStrategy | str | int = NumaStrategy.AUTO,
        numa_node: int = -1,
        metadata_latency: LatencyModel | None = None,
        max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
        prepared_batches: int = 2,
        decode_workers: int = L.DEFAULT_DECODE_WORKERS,
        shard_index_cache_bytes: int = 256 << 20,
        chunk_cache_bytes: int = 0,
        chunk_cache_dir: str | None = None,
        chunk_cache_dir_bytes: int = 64 << 30,
        on_error: ErrorPolicy | str = ErrorPolicy.STOP,
        out_of_bounds: BoundsPolicy | str = BoundsPolicy.ERROR,
        drop_last: bool = True,
        switch_interval_s: float | None = 0.0005,
        storage_options: dict[str, dict[str, str]] | None = None,
    ) -> None:
        set_ = object.__setattr__
        spb = _at_least_one(samples_per_batch, "samples_per_batch")
        if lookahead_samples is None:
            lookahead_samples = 2 * spb
        if lookahead_samples < spb:
            raise ValueError(
                f"lookahead_samples must cover at least one full batch (got {lookahead_samples}, samples_per_batch={spb})"
            )
        set_(self, "samples_per_batch", spb)
        set_(self, "lookahead_samples", operator.index(lookahead_samples))
        set_(self, "n_io_threads", _in_range(n_io_threads, "n_io_threads", 1, L.MAX_IO_THREADS))
        if metadata_io_concurrency > L.MAX_METADATA_CONCURRENCY:
            _in_range(metadata_io_concurrency, "metadata_io_concurrency", 1, L.MAX_METADATA_CONCURRENCY)
        set_(self, "metadata_io_concurrency", _at_least_one(metadata_io_concurrency, "metadata_io_concurrency"))
        set_(
            self,
            "max_chunk_uncompressed_bytes",
            _in_range(max_chunk_uncompressed_bytes, "max_chunk_uncompressed_bytes", 1, L.MAX_CHUNK_BYTES),
        )
        set_(self, "max_read_op_bytes", _in_range(max_read_op_bytes, "max_read_op_bytes", 1, L.UINT32_MAX))
        set_(self, "max_index_bytes", L.index_bytes(max_index_bytes))
        if max_gpu_memory_bytes is not None:
            max_gpu_memory_bytes = _at_least_one(max_gpu_memory_bytes, "max_gpu_memory_bytes")
        set_(self, "max_gpu_memory_bytes", max_gpu_memory_bytes)
        set_(
            self,
            "host_buffer_waves",
            _in_range(host_buffer_waves, "host_buffer_waves", L.N_WAVES, L.MAX_HOST_BUFFER_WAVES),
        )
        set_(
            self,
            "max_chunks_per_wave",
            _in_range(max_chunks_per_wave, "max_chunks_per_wave", 1, L.HARD_MAX_CHUNKS_PER_WAVE),
        )
        set_(
            self,
            "max_substreams_per_chunk",
            _in_range(max_substreams_per_chunk, "max_substreams_per_chunk", 1, L.HARD_MAX_SUBSTREAMS_PER_CHUNK),
        )
        # the caches' floors (lookahead and the batches in flight) are checked where the
        # pipeline is made (InvalidArgument); a cache not given is its default, raised to its
        # floor (large batches: the defaults are sized for the quick start's)
        # (max_shards_per_sample > 0 is checked there too, as the seed's native code does)
        set_(self, "max_shards_per_sample", operator.index(max_shards_per_sample))
        floor = self.lookahead_samples + 2 * spb
        chosen = {
            "n_array_meta_cache": (n_array_meta_cache, L.DEFAULT_ARRAY_ENTRIES),
            "n_chunk_layout_cache": (n_chunk_layout_cache, L.DEFAULT_CHUNK_LAYOUT_ENTRIES),
            "n_shard_index_cache": (n_shard_index_cache, max(L.DEFAULT_SHARD_INDEX_ENTRIES, floor * max(self.max_shards_per_sample, 1))),
        }
        for name, (value, default) in chosen.items():
            # one Config chose (a variant from dataclasses.replace chooses again, for its batches)
            if value is None or isinstance(value, _Chosen):
                set_(self, name, _Chosen(max(default, floor)))
            else:
                set_(self, name, operator.index(value))
        if pop_timeout_s is not None and pop_timeout_s <= 0:
            raise ValueError(f"pop_timeout_s must be > 0 or None (got {pop_timeout_s})")
        set_(self, "pop_timeout_s", None if pop_timeout_s is None else float(pop_timeout_s))
        strategy = NumaStrategy.coerce(numa_strategy)
        if strategy is NumaStrategy.PIN_TO:
            if numa_node < 0:
                raise ValueError(f"numa_node must be >= 0 when numa_strategy=PIN_TO (got {numa_node})")
        elif numa_node != -1:
            raise ValueError(f"numa_node must be -1 when numa_strategy={strategy.name} (got {numa_node})")
        set_(self, "numa_strategy", strategy)
        set_(self, "numa_node", int(numa_node))
        if metadata_latency is not None and not isinstance(metadata_latency, LatencyModel):
            raise TypeError("metadata_latency must be a LatencyModel or None")
        set_(self, "metadata_latency", metadata_latency or LatencyModel())
        if isinstance(sample_shape, int) and not isinstance(sample_shape, bool):
            sample_shape = (sample_shape,)
        shape = tuple(int(x) for x in sample_shape)  # type: ignore[union-attr]
        if not shape:
            raise ValueError("sample_shape must be non-empty")
        if any(d <= 0 for d in shape):
            raise ValueError(f"sample_shape entries must be > 0 (got {shape})")
        set_(self, "sample_shape", shape)
        set_(self, "dtype", output_dtype(dtype))
        if device is not None:
            if isinstance(device, bool) or operator.index(device) < 0:
                raise ValueError(f"device must be a CUDA device index >= 0 or None (got {device!r})")
            device = operator.index(device)
        set_(self, "device", device)
        set_(self, "enable_gds", None if enable_gds is None else bool(enable_gds))
        # damacy's own
        set_(self, "max_memory_bytes", L.positive_int(max_memory_bytes, "max_memory_bytes", L.UINT64_MAX))
        set_(self, "prepared_batches", L.positive_int(prepared_batches, "prepared_batches", 1024))
        set_(self, "decode_workers", L.positive_int(decode_workers, "decode_workers", L.MAX_IO_THREADS))
        set_(self, "shard_index_cache_bytes", L.positive_int(shard_index_cache_bytes, "shard_index_cache_bytes", L.UINT64_MAX))
        set_(self, "chunk_cache_bytes", L.size_int(chunk_cache_bytes, "chunk_cache_bytes"))
        if chunk_cache_dir is not None and not isinstance(chunk_cache_dir, str):
            raise TypeError(f"chunk_cache_dir must be a path (str) or None, got {type(chunk_cache_dir).__name__}")
        set_(self, "chunk_cache_dir", chunk_cache_dir)
        set_(self, "chunk_cache_dir_bytes", L.positive_int(chunk_cache_dir_bytes, "chunk_cache_dir_bytes", L.UINT64_MAX))
        set_(self, "on_error", ErrorPolicy.coerce(on_error))
        set_(self, "out_of_bounds", BoundsPolicy.coerce(out_of_bounds))
        if not isinstance(drop_last, bool):
            raise TypeError(f"drop_last must be True or False, got {drop_last!r}")
        set_(self, "drop_last", drop_last)
        if switch_interval_s is not None:
            if isinstance(switch_interval_s, bool) or not isinstance(switch_interval_s, (int, float)):
                raise TypeError(f"switch_interval_s must be a number of seconds or None, got {switch_interval_s!r}")
            if not (switch_interval_s > 0 and math.isfinite(switch_interval_s)):
                raise ValueError(f"switch_interval_s must be > 0 and finite, or None (got {switch_interval_s})")
            switch_interval_s = float(switch_interval_s)
        set_(self, "switch_interval_s", switch_interval_s)
        set_(self, "storage_options", _storage_options(storage_options))

    @classmethod
    def default(
        cls,
        *,
        samples_per_batch: int,
        sample_shape: Sequence[int],
        max_gpu_memory_bytes: int | None = None,
        dtype: Dtype | str | int = Dtype.F32,
        **overrides: Any,
    ) -> Config:
        """The recommended Config for a workload's geometry: the constructor's defaults are
        the tuned values; any field may be overridden by keyword."""
        return cls(
            samples_per_batch=samples_per_batch,
            sample_shape=sample_shape,
            max_gpu_memory_bytes=max_gpu_memory_bytes,
            dtype=dtype,
            **overrides,
        )

    # -- the value objects it composes ------------------------------------------------------
    @property
    def on_gpu(self) -> bool:
        """Does this Config build a GPU pipeline (a budget or a device given)?"""
        return self.max_gpu_memory_bytes is not None or self.device is not None

    @property
    def output(self) -> BatchSpec:
        """What a batch is (BatchSpec's limits apply: at most 65535 samples, 31 axes)."""
        return BatchSpec(self.samples_per_batch, self.sample_shape, self.dtype)

    @property
    def queues(self) -> QueueLimits:
        return QueueLimits(self.lookahead_samples, self.prepared_batches)

    @property
    def metadata_cache(self) -> MetadataCache:
        return MetadataCache(self.n_array_meta_cache, self.n_shard_index_cache, self.shard_index_cache_bytes)

    @property
    def plan_limits(self) -> PlanLimits:
        return PlanLimits(
            max_chunk_bytes=self.max_chunk_uncompressed_bytes, max_shards_per_sample=self.max_shards_per_sample
        )

    @property
    def cpu_limits(self) -> CpuLimits:
        return CpuLimits(
            max_memory_bytes=self.max_memory_bytes,
            decode_workers=self.decode_workers,
            max_encoded_chunk_bytes=L.encoded_chunk_bytes_for(self.max_chunk_uncompressed_bytes),
            max_decoded_chunk_bytes=self.max_chunk_uncompressed_bytes,
            chunks_per_input_buffer=L.chunks_per_input_buffer_for(self.decode_workers),
            chunk_cache_bytes=self.chunk_cache_bytes,
            chunk_cache_dir=self.chunk_cache_dir,
            chunk_cache_dir_bytes=self.chunk_cache_dir_bytes,
        )

    @property
    def cuda_limits(self) -> CudaLimits:
        return CudaLimits(
            max_gpu_memory_bytes=self.max_gpu_memory_bytes or L.DEFAULT_GPU_MEMORY_BYTES,
            max_index_bytes=self.max_index_bytes,
            chunk_layout_entries=self.n_chunk_layout_cache,
            max_chunk_bytes=self.max_chunk_uncompressed_bytes,
            max_read_bytes=self.max_read_op_bytes,
            host_buffer_waves=self.host_buffer_waves,
            max_chunks_per_wave=self.max_chunks_per_wave,
            max_substreams_per_chunk=self.max_substreams_per_chunk,
        )

    def daemon_owned(self) -> list[str]:
        """The fields given other than their defaults that a daemon session does not take
        from its Config: damacyd's components (readers, caches, executors) serve every
        session with the limits damacyd was started with (its flags)."""
        default = Config(
            samples_per_batch=self.samples_per_batch,
            sample_shape=self.sample_shape,
            dtype=self.dtype,
            lookahead_samples=self.lookahead_samples,  # (the caches' defaults follow it)
        )
        return [
            name for name in DAEMON_OWNED
            if not isinstance(value := getattr(self, name), _Chosen) and value != getattr(default, name)
        ]

    def check_cache_floors(self) -> None:
        """The seed Config's cache floors: every cache holds at least the samples in flight
        (the lookahead plus two batches), the shard-index cache that many times the shards a
        sample may touch (InvalidArgument)."""
        from damacy_protocol.errors import InvalidArgument

        if self.max_shards_per_sample < 1:
            raise InvalidArgument(f"Config.max_shards_per_sample must be > 0 (got {self.max_shards_per_sample})")
        floor = self.lookahead_samples + 2 * self.samples_per_batch
        for name in ("n_array_meta_cache", "n_chunk_layout_cache"):
            if getattr(self, name) < floor:
                raise InvalidArgument(
                    f"Config.{name}={getattr(self, name)} is below its floor lookahead_samples + 2 * samples_per_batch = {floor}"
                )
        need = floor * self.max_shards_per_sample
        if self.n_shard_index_cache < need:
            raise InvalidArgument(
                f"Config.n_shard_index_cache={self.n_shard_index_cache} is below its floor "
                f"(lookahead_samples + 2 * samples_per_batch) * max_shards_per_sample = {need}"
            )

    # -- as data ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data (msgpack- and JSON-able); :meth:`from_dict` rebuilds it."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "dtype":
                value = dtype_name(value)
            elif f.name == "numa_strategy":
                value = value.name.lower()
            elif f.name == "metadata_latency":
                value = {k.name: getattr(value, k.name) for k in fields(value)}
            elif f.name == "sample_shape":
                value = list(value)
            elif isinstance(value, _Chosen):
                value = None  # (chosen again where it arrives, alike)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """The Config :meth:`to_dict` described (checked again); unknown fields are refused."""
        if not isinstance(data, dict):
            raise TypeError(f"a Config is described by a dict, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"Config has no field(s) {sorted(unknown)}")
        values = dict(data)
        latency = values.get("metadata_latency")
        if isinstance(latency, dict):
            values["metadata_latency"] = LatencyModel(**latency)
        return cls(**values)


def _storage_options(value: Any) -> dict[str, dict[str, str]]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, dict) and all(isinstance(a, str) and isinstance(b, str) for a, b in v.items())
        for k, v in value.items()
    ):
        raise TypeError("storage_options must map uri prefixes to {option: value} dicts of strings")
    return {k: dict(v) for k, v in value.items()}
