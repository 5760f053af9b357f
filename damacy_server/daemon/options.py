"""damacyd's settings (what ``damacyd``'s options set)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass
class DaemonOptions:
    endpoint: str
    allow_roots: list[str] = field(default_factory=list)
    allow_prefixes: list[str] = field(default_factory=list)
    storage_options: dict[str, dict[str, str]] = field(default_factory=dict)
    memory_bytes: int = 8 << 30
    chunk_cache_bytes: int = 0
    chunk_cache_dir: str | None = None  # a disk tier for fetched object-store bytes (None: off)
    chunk_cache_dir_bytes: int = 64 << 30
    io_workers: int = max(4, os.cpu_count() or 1)
    decode_workers: int = os.cpu_count() or 1
    array_cache_entries: int = 1024
    shard_index_cache_entries: int = 65536
    shard_index_cache_bytes: int = 1 << 30
    socket_mode: int = 0o600
    socket_group: str | None = None
    curve_secret_key: bytes | None = None
    heartbeat_timeout_s: float = 5.0
    max_slots_per_session: int = 64
    max_lookahead_samples: int = 65536  # per session: samples queued in the daemon's memory
    max_message_bytes: int = 64 << 20
    allow_uids: list[int] = field(default_factory=list)
    allow_gids: list[int] = field(default_factory=list)
    gpu_memory_bytes: int = 4 << 30  # per GPU: device slots plus each batch's decode arena
    slow_batch_s: float = 10.0  # a batch longer than this from its start to ready is logged (0: never)
