"""The configuration of a pipeline: one frozen value, checked when it is made.

The same :class:`Config` configures an embedded pipeline and a daemon session, so it holds
plain values only.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from damacy_protocol.dtypes import canonical_dtype
from damacy_protocol.errors import InvalidArgument

ON_ERROR = ("raise", "fill", "skip")
OUT_OF_BOUNDS = ("pad", "error")


def _check_int(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidArgument(f"Config.{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class Config:
    """Everything a pipeline needs; invalid values raise :class:`InvalidArgument` naming the field.

    - ``samples_per_batch``, ``sample_shape``, ``dtype``: what a batch is (``dtype``: f32, bf16,
      f16, f64, u8, u16, u32, u64, i8, i16, i32, i64, bool or native).
    - ``device``: ``None`` for host memory (a GPU index for GPU memory, where supported).
    - ``max_memory_bytes``: host memory for batch slots plus chunk data in flight; never exceeded.
    - ``lookahead_samples``: samples pulled and in flight before their batch is popped
      (default: two batches); at least ``samples_per_batch``.
    - ``prepared_batches``: batch slots (ready or being filled).
    - ``io_workers``, ``decode_workers``: threads reading and decoding (default: the CPUs).
    - ``array_cache_entries``, ``shard_index_cache_entries``: metadata cache bounds.
    - ``chunk_cache_bytes``: decoded chunks kept for reuse across batches (LRU, 0: off;
      beside ``max_memory_bytes``). A daemon has one cache for all its clients instead.
    - ``on_error``: ``"raise"`` a bad sample's error at the pop that would have held it,
      ``"fill"`` it with the fill value and list it in ``batch.info.errors``, or ``"skip"`` it.
    - ``out_of_bounds``: ``"pad"`` boxes that leave the array with its fill value, or ``"error"``.
    - ``drop_last``: drop the last batch when it is not full.
    - ``pop_timeout_s``: how long ``pop`` waits for a batch (``None``: no limit).
    - ``switch_interval_s``: while an embedded pipeline is open, the interpreter's thread
      switch interval is lowered to this (Python's default is 5 ms), so a decode thread
      coming back from C code waits at most that long for the GIL; ``None`` leaves it alone.
    """

    samples_per_batch: int
    sample_shape: tuple[int, ...]
    dtype: str = "f32"
    device: int | None = None
    max_memory_bytes: int = 2 << 30
    max_gpu_memory_bytes: int | None = None
    lookahead_samples: int | None = None
    prepared_batches: int = 2
    io_workers: int | None = None
    decode_workers: int | None = None
    array_cache_entries: int = 256
    shard_index_cache_entries: int = 8192
    chunk_cache_bytes: int = 0
    on_error: str = "raise"
    out_of_bounds: str = "pad"
    drop_last: bool = False
    pop_timeout_s: float | None = 600.0
    switch_interval_s: float | None = 0.0005

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        _check_int("samples_per_batch", self.samples_per_batch, 1)
        shape = self.sample_shape
        if isinstance(shape, int) and not isinstance(shape, bool):
            shape = (shape,)
        if not isinstance(shape, (tuple, list)) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
        ):
            raise InvalidArgument(f"Config.sample_shape must be a tuple of integers >= 0, got {self.sample_shape!r}")
        set_(self, "sample_shape", tuple(shape))
        set_(self, "dtype", canonical_dtype(self.dtype, "Config.dtype"))
        _check_int("device", self.device, 0, optional=True)
        _check_int("max_memory_bytes", self.max_memory_bytes, 1)
        _check_int("max_gpu_memory_bytes", self.max_gpu_memory_bytes, 1, optional=True)
        if self.lookahead_samples is None:
            set_(self, "lookahead_samples", 2 * self.samples_per_batch)
        _check_int("lookahead_samples", self.lookahead_samples, 1)
        if self.lookahead_samples < self.samples_per_batch:
            raise InvalidArgument(
                f"Config.lookahead_samples ({self.lookahead_samples}) must be at least samples_per_batch "
                f"({self.samples_per_batch}): a batch is planned as a whole"
            )
        _check_int("prepared_batches", self.prepared_batches, 1)
        cpus = os.cpu_count() or 1
        if self.io_workers is None:
            set_(self, "io_workers", max(4, cpus))
        if self.decode_workers is None:
            set_(self, "decode_workers", cpus)
        _check_int("io_workers", self.io_workers, 1)
        _check_int("decode_workers", self.decode_workers, 1)
        _check_int("array_cache_entries", self.array_cache_entries, 0)
        _check_int("shard_index_cache_entries", self.shard_index_cache_entries, 0)
        _check_int("chunk_cache_bytes", self.chunk_cache_bytes, 0)
        if self.on_error not in ON_ERROR:
            raise InvalidArgument(f"Config.on_error must be one of {ON_ERROR}, got {self.on_error!r}")
        if self.out_of_bounds not in OUT_OF_BOUNDS:
            raise InvalidArgument(f"Config.out_of_bounds must be one of {OUT_OF_BOUNDS}, got {self.out_of_bounds!r}")
        if not isinstance(self.drop_last, bool):
            raise InvalidArgument(f"Config.drop_last must be True or False, got {self.drop_last!r}")
        for name in ("pop_timeout_s", "switch_interval_s"):
            t = getattr(self, name)
            if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
                raise InvalidArgument(f"Config.{name} must be a positive number or None, got {t!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise InvalidArgument(f"Config has no field(s) {sorted(unknown)}")
        return cls(**data)
