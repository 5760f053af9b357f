"""damacyd's settings (what ``damacyd``'s options set).

The daemon's limits are the value objects of :mod:`damacy_protocol.limits` and the reader
components (:class:`~damacy_server.store.file.FileReader`,
:class:`~damacy_server.store.file.FileMetadataReader`), as an embedded pipeline's are: each
limit's default and check live there, once. :class:`DaemonOptions` composes them beside the
daemon's own settings (endpoint, roots, sockets, sessions), and :data:`FLAGS` names the
``damacyd`` flag of every field of them.

Where the daemon's default differs from the value object's, it is said here, once, and for
one reason: one damacyd serves every rank of a node, so it holds more than one pipeline:

- host memory (``CpuLimits.max_memory_bytes``, which has no default): 8 GiB, for all
  sessions together (:data:`DAEMON_MAX_MEMORY_BYTES`);
- the metadata caches (:data:`DAEMON_METADATA_CACHE`): 1024 arrays, 65536 shard indexes of
  at most 1 GiB, four times to eight times an embedded pipeline's, shared by all ranks;
- the GPU budget per GPU: ``DEFAULT_GPU_MEMORY_BYTES`` (1 GiB), the value objects' own;
- the threads: ``CpuLimits.decode_workers`` is the node's CPUs plus one and
  ``FileReader.workers`` the CPUs, at least 8 (:func:`~damacy_protocol.limits.host_threads`),
  where the value objects' 8 and 8 are one pipeline's share: the daemon is the node's one
  reader.

Some defaults follow other settings, as :class:`damacy.Config` composes them:
``CpuLimits.max_decoded_chunk_bytes`` and ``CudaLimits.max_chunk_bytes`` are
``PlanLimits.max_chunk_bytes`` unless given (one flag, ``--max-chunk-bytes``, raises the
decoded chunk size everywhere) and ``CpuLimits.max_encoded_chunk_bytes`` twice that, at
least 4 MiB (:func:`~damacy_protocol.limits.encoded_chunk_bytes_for`), and
``CpuLimits.chunks_per_input_buffer`` is at least ``decode_workers`` unless given (see
:func:`compose`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from damacy_protocol.limits import (
    DEFAULT_GPU_MEMORY_BYTES,
    CpuLimits,
    CudaLimits,
    MetadataCache,
    PlanLimits,
    chunks_per_input_buffer_for,
    encoded_chunk_bytes_for,
    host_threads,
)
from damacy_server.store.file import FileMetadataReader, FileReader

#: host memory for batch slots plus chunk data in flight, all sessions together
DAEMON_MAX_MEMORY_BYTES = 8 << 30
#: the metadata caches all sessions share
DAEMON_METADATA_CACHE = MetadataCache(array_entries=1024, shard_index_entries=65536, shard_index_bytes=1 << 30)

#: the parts of :class:`DaemonOptions` that are value objects (or reader settings), their types
PARTS: dict[str, type] = {
    "metadata_cache": MetadataCache,
    "plan_limits": PlanLimits,
    "cpu_limits": CpuLimits,
    "cuda_limits": CudaLimits,
    "reader": FileReader,
    "metadata_reader": FileMetadataReader,
}

#: (part, field) -> the damacyd flag that sets it. Every limit the daemon has is one.
FLAGS: dict[tuple[str, str], str] = {
    ("metadata_cache", "array_entries"): "--array-entries",
    ("metadata_cache", "shard_index_entries"): "--shard-index-entries",
    ("metadata_cache", "shard_index_bytes"): "--shard-index-bytes",
    ("metadata_reader", "concurrency"): "--metadata-concurrency",
    ("plan_limits", "max_chunks"): "--max-chunks",
    ("plan_limits", "max_chunk_bytes"): "--max-chunk-bytes",
    ("plan_limits", "max_shards_per_sample"): "--max-shards-per-sample",
    ("plan_limits", "max_plan_bytes"): "--max-plan-bytes",
    ("plan_limits", "max_gap_bytes"): "--max-gap-bytes",
    ("plan_limits", "max_read_bytes"): "--max-read-bytes",
    ("plan_limits", "remote_max_gap_bytes"): "--remote-max-gap-bytes",
    ("plan_limits", "remote_max_read_bytes"): "--remote-max-read-bytes",
    ("reader", "workers"): "--io-workers",
    ("reader", "max_inflight_reads"): "--max-inflight-reads",
    ("reader", "readahead"): "--no-readahead",
    ("cpu_limits", "max_memory_bytes"): "--memory",
    ("cpu_limits", "decode_workers"): "--decode-workers",
    ("cpu_limits", "max_encoded_chunk_bytes"): "--max-encoded-chunk-bytes",
    ("cpu_limits", "max_decoded_chunk_bytes"): "--max-decoded-chunk-bytes",
    ("cpu_limits", "chunks_per_input_buffer"): "--chunks-per-input-buffer",
    ("cpu_limits", "chunk_cache_bytes"): "--chunk-cache",
    ("cpu_limits", "native"): "--no-native",
    ("cpu_limits", "max_inflight_requests"): "--max-inflight-requests",
    ("cpu_limits", "chunk_cache_dir"): "--chunk-cache-dir",
    ("cpu_limits", "chunk_cache_dir_bytes"): "--chunk-cache-dir-bytes",
    ("cuda_limits", "max_gpu_memory_bytes"): "--gpu-memory",
    ("cuda_limits", "max_index_bytes"): "--max-index-bytes",
    ("cuda_limits", "chunk_layout_entries"): "--chunk-layout-entries",
    ("cuda_limits", "max_chunk_bytes"): "--gpu-max-chunk-bytes",
    ("cuda_limits", "max_read_bytes"): "--gpu-max-read-bytes",
    ("cuda_limits", "host_buffer_waves"): "--host-buffer-waves",
    ("cuda_limits", "max_chunks_per_wave"): "--max-chunks-per-wave",
    ("cuda_limits", "max_substreams_per_chunk"): "--max-substreams-per-chunk",
}


class LimitError(ValueError):
    """A limit refused by its value object's check: ``flags`` are the damacyd flags of the
    fields it names (the first is the field refused), ``error`` the check's own error."""

    def __init__(self, error: Exception, flags: list[str], owner: str = "") -> None:
        super().__init__(f"{owner}: {error}" if owner else str(error))
        self.error = error
        self.flags = flags


def _fields_named(part: str, message: str) -> list[str]:
    """The flags of ``part``'s fields named in ``message``, in the order they appear."""
    found = []
    for (p, name), flag in FLAGS.items():
        if p == part and (where := re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", message)):
            found.append((where.start(), flag))
    return [flag for _, flag in sorted(found)]


def _make(part: str, values: dict[str, Any]) -> Any:
    try:
        return PARTS[part](**values)
    except (ValueError, TypeError) as e:
        flags = _fields_named(part, str(e)) or [FLAGS[(part, name)] for name in values if (part, name) in FLAGS]
        raise LimitError(e, flags, PARTS[part].__name__) from e


def compose(given: dict[tuple[str, str], Any] | None = None) -> dict[str, Any]:
    """The value objects of :class:`DaemonOptions` (keyword arguments for it) from the fields
    ``given`` by ``(part, field)``; a field not given takes the daemon's default (see the
    module) or else the value object's. A value its object refuses raises
    :class:`LimitError` naming the flags concerned."""
    given = dict(given or {})
    unknown = set(given) - set(FLAGS)
    if unknown:
        raise KeyError(f"no daemon limit {sorted(unknown)}")
    by_part: dict[str, dict[str, Any]] = {part: {} for part in PARTS}
    for (part, name), value in given.items():
        by_part[part][name] = value
    metadata = dict(dataclasses.asdict(DAEMON_METADATA_CACHE), **by_part["metadata_cache"])
    plan = _make("plan_limits", by_part["plan_limits"])
    decode, io = host_threads()
    cpu = {"max_memory_bytes": DAEMON_MAX_MEMORY_BYTES, "decode_workers": decode, **by_part["cpu_limits"]}
    by_part["reader"].setdefault("workers", io)
    cpu.setdefault("max_decoded_chunk_bytes", plan.max_chunk_bytes)
    if isinstance(plan.max_chunk_bytes, int):
        cpu.setdefault("max_encoded_chunk_bytes", encoded_chunk_bytes_for(plan.max_chunk_bytes))
    if "chunks_per_input_buffer" not in cpu and isinstance(cpu["decode_workers"], int):
        cpu["chunks_per_input_buffer"] = chunks_per_input_buffer_for(cpu["decode_workers"])
    cuda = {"max_gpu_memory_bytes": DEFAULT_GPU_MEMORY_BYTES, **by_part["cuda_limits"]}
    cuda.setdefault("max_chunk_bytes", plan.max_chunk_bytes)
    return {
        "metadata_cache": _make("metadata_cache", metadata),
        "plan_limits": plan,
        "cpu_limits": _make("cpu_limits", cpu),
        "cuda_limits": _make("cuda_limits", cuda),
        "reader": _make("reader", by_part["reader"]),
        "metadata_reader": _make("metadata_reader", by_part["metadata_reader"]),
    }


def _default(part: str) -> Any:
    return lambda: compose()[part]


@dataclass
class DaemonOptions:
    """Everything damacyd is started with.

    The limits (each a value object's, checked by it): ``metadata_cache`` (the metadata
    caches all sessions share), ``plan_limits`` (what one batch of a session may ask for),
    ``cpu_limits`` (the CPU executor all host sessions share: its ``max_memory_bytes`` is
    the host memory of all sessions together), ``cuda_limits`` (per GPU, each GPU's executor
    shared by its sessions), ``reader`` (the chunk reader's settings: workers,
    max_inflight_reads, readahead) and ``metadata_reader`` (the metadata reads' concurrency);
    both readers are made below the daemon's roots (:meth:`file_reader`,
    :meth:`file_metadata_reader`). Defaults: :func:`compose`.

    The daemon's own: ``endpoint``, ``allow_roots``/``allow_prefixes`` (what it serves),
    ``storage_options`` (per object-store prefix), the ipc socket's ``socket_mode`` and
    ``socket_group``, ``curve_secret_key``, ``heartbeat_timeout_s``, per session
    ``max_slots_per_session`` and ``max_lookahead_samples`` (what a session's
    ``QueueLimits`` are held to), ``max_message_bytes``, ``allow_uids``/``allow_gids``, and
    ``slow_batch_s`` (a batch slower than this from its start to ready is logged; 0: never).
    """

    endpoint: str
    allow_roots: list[str] = field(default_factory=list)
    allow_prefixes: list[str] = field(default_factory=list)
    storage_options: dict[str, dict[str, str]] = field(default_factory=dict)
    metadata_cache: MetadataCache = field(default_factory=_default("metadata_cache"))
    plan_limits: PlanLimits = field(default_factory=_default("plan_limits"))
    cpu_limits: CpuLimits = field(default_factory=_default("cpu_limits"))
    cuda_limits: CudaLimits = field(default_factory=_default("cuda_limits"))
    reader: FileReader = field(default_factory=_default("reader"))
    metadata_reader: FileMetadataReader = field(default_factory=_default("metadata_reader"))
    socket_mode: int = 0o600
    socket_group: str | None = None
    curve_secret_key: bytes | None = None
    heartbeat_timeout_s: float = 5.0
    max_slots_per_session: int = 64
    max_lookahead_samples: int = 65536  # per session: samples queued in the daemon's memory
    max_message_bytes: int = 64 << 20
    allow_uids: list[int] = field(default_factory=list)
    allow_gids: list[int] = field(default_factory=list)
    slow_batch_s: float = 10.0

    def __post_init__(self) -> None:
        for part, tp in PARTS.items():
            if not isinstance(getattr(self, part), tp):
                raise TypeError(f"DaemonOptions.{part} must be a {tp.__name__}, got {type(getattr(self, part)).__name__}")

    @classmethod
    def with_limits(cls, endpoint: str, limits: dict[tuple[str, str], Any] | None = None, **own: Any) -> DaemonOptions:
        """Options whose limits are :func:`compose`'s of ``limits`` (by ``(part, field)``)."""
        return cls(endpoint=endpoint, **compose(limits), **own)

    def file_reader(self, roots: list[str] | None) -> FileReader:
        """A chunk reader with :attr:`reader`'s settings, reading below ``roots`` only."""
        r = self.reader
        return FileReader(workers=r.workers, max_inflight_reads=r.max_inflight_reads, readahead=r.readahead, roots=roots)

    def file_metadata_reader(self, roots: list[str] | None) -> FileMetadataReader:
        """A metadata reader with :attr:`metadata_reader`'s settings, below ``roots`` only."""
        r = self.metadata_reader
        return FileMetadataReader(concurrency=r.concurrency, latency=r.latency, roots=roots)

    # what the log and the figures name
    @property
    def memory_bytes(self) -> int:
        """The host memory of all sessions (``cpu_limits.max_memory_bytes``)."""
        return self.cpu_limits.max_memory_bytes

    @property
    def gpu_memory_bytes(self) -> int:
        """Each GPU's memory for its sessions (``cuda_limits.max_gpu_memory_bytes``)."""
        return self.cuda_limits.max_gpu_memory_bytes
