"""The configuration of a pipeline: one frozen value, checked when it is made.

The same :class:`Config` configures an embedded pipeline and a daemon session, and travels
in the daemon's ``Hello`` as itself (a msgspec Struct): the field types carry the
constraints (:mod:`damacy_protocol.checks`), checked alike when a caller builds a Config
and when the daemon decodes one.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import msgspec

from damacy_protocol.checks import Count, Seconds, Size, checked, default_decode_workers
from damacy_protocol.dtypes import canonical_dtype
from damacy_protocol.errors import InvalidArgument

OnError = Literal["raise", "fill", "skip"]
OutOfBounds = Literal["pad", "error"]


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Everything a pipeline needs; invalid values raise :class:`InvalidArgument` naming the field.

    - ``samples_per_batch``, ``sample_shape``, ``dtype``: what a batch is (``dtype``: f32, bf16,
      f16, f64, u8, u16, u32, u64, i8, i16, i32, i64, bool or native).
    - ``device``: ``None`` for host memory, or the index of a CUDA device (a pipeline made with
      a Config naming one that this machine does not have is refused when it is made).
    - ``max_memory_bytes``: host memory for batch slots plus chunk data in flight; never exceeded.
    - ``lookahead_samples``: samples pulled and in flight before their batch is popped
      (default: two batches); at least ``samples_per_batch``.
    - ``prepared_batches``: batch slots (ready or being filled).
    - ``io_workers``, ``decode_workers``: threads reading and decoding (default: the CPUs, at
      least 4 readers; the CPUs plus one decoders).
    - ``array_cache_entries``, ``shard_index_cache_entries``, ``shard_index_cache_bytes``:
      metadata cache bounds (parsed arrays by entries, shard indexes by entries and bytes).
    - ``chunk_cache_bytes``: decoded chunks kept for reuse across batches (0: off; beside
      ``max_memory_bytes``). A daemon has one cache for all its clients instead.
    - ``chunk_cache_dir``, ``chunk_cache_dir_bytes``: a folder on local disk (NVMe) where bytes
      fetched from object stores are kept, at most that many bytes, and read again from there
      (None: off). Embedded pipelines; damacyd has ``--chunk-cache-dir`` for all its clients.
    - ``on_error``: ``"raise"`` a bad sample's error at the pop that would have held it,
      ``"fill"`` it with the fill value and list it in ``batch.info.errors``, or ``"skip"`` it.
    - ``out_of_bounds``: ``"pad"`` the positions a sample selects outside the array with its
      fill value (boxes and index lists alike), or ``"error"``.
    - ``drop_last``: drop the last batch when it is not full.
    - ``pop_timeout_s``: how long ``pop`` waits for a batch (``None``: no limit).
    - ``storage_options``: options for object stores by uri prefix, e.g.
      ``{"s3://bucket/data": {"endpoint": "http://10.0.0.2:9000", "region": "eu-west-1"}}``:
      obstore's store options, its client options (``timeout``, ``connect_timeout``,
      ``allow_http``, ...) and ``max_retries``/``retry_timeout``; the longest matching prefix
      applies, over what the environment sets. Embedded pipelines only: damacyd reads with
      its own options (``--storage-option``).
    - ``switch_interval_s``: while an embedded pipeline is open, the interpreter's thread
      switch interval is lowered to this (Python's default is 5 ms), so a decode thread
      coming back from C code waits at most that long for the GIL; ``None`` leaves it alone.
    """

    samples_per_batch: Count
    sample_shape: tuple[Size, ...]
    dtype: str = "f32"
    device: Size | None = None
    max_memory_bytes: Count = 2 << 30
    max_gpu_memory_bytes: Count | None = None
    lookahead_samples: Count | None = None
    prepared_batches: Count = 2
    io_workers: Count | None = None
    decode_workers: Count | None = None
    array_cache_entries: Size = 256
    shard_index_cache_entries: Size = 8192
    shard_index_cache_bytes: Size = 256 << 20
    chunk_cache_bytes: Size = 0
    chunk_cache_dir: str | None = None
    chunk_cache_dir_bytes: Count = 64 << 30
    on_error: OnError = "raise"
    out_of_bounds: OutOfBounds = "pad"
    drop_last: bool = False
    pop_timeout_s: Seconds | None = 600.0
    switch_interval_s: Seconds | None = 0.0005
    storage_options: dict[str, dict[str, str]] = {}

    def __post_init__(self) -> None:
        # msgspec checks types only when it decodes; a caller's Config is checked here, by
        # the same annotated types
        set_ = msgspec.structs.force_setattr
        shape = self.sample_shape
        if isinstance(shape, int) and not isinstance(shape, bool):
            set_(self, "sample_shape", (shape,))
        for f in msgspec.structs.fields(self):
            if f.name != "dtype":
                set_(self, f.name, checked("Config", f.name, getattr(self, f.name), f.type))
        set_(self, "dtype", canonical_dtype(self.dtype, "Config.dtype"))
        if 0 in self.sample_shape:
            raise InvalidArgument(f"Config.sample_shape {self.sample_shape} holds no element: every extent must be at least 1")
        lookahead = 2 * self.samples_per_batch if self.lookahead_samples is None else self.lookahead_samples
        set_(self, "lookahead_samples", lookahead)
        if lookahead < self.samples_per_batch:
            raise InvalidArgument(
                f"Config.lookahead_samples ({lookahead}) must be at least samples_per_batch "
                f"({self.samples_per_batch}): a batch is planned as a whole"
            )
        cpus = os.cpu_count() or 1
        if self.io_workers is None:
            set_(self, "io_workers", max(4, cpus))
        if self.decode_workers is None:
            set_(self, "decode_workers", default_decode_workers())

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__struct_fields__}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        unknown = set(data) - set(cls.__struct_fields__)
        if unknown:
            raise InvalidArgument(f"Config has no field(s) {sorted(unknown)}")
        return cls(**data)
