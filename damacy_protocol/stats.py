"""The daemon's figures as typed values: what ``StatsReply`` carries.

The daemon builds these; clients decode them against the same types and hand them to
callers as plain dicts (``msgspec.to_builtins``), so ``damacy stats --json`` and
``Pipeline.stats()`` keep their shape.
"""

from __future__ import annotations

import msgspec


class _Figures(msgspec.Struct, forbid_unknown_fields=False):
    pass


class StageFigures(_Figures):
    """One stage's totals over all threads: seconds, units (or reads) and bytes in and out."""

    seconds: float = 0.0
    count: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


class CacheFigures(_Figures):
    entries: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    rejections: int = 0  # values a full cache with frequency admission turned away
    admission: str = "lru"  # the chunk cache's rule in force: "frequency" or "recency" (see damacy_server.cache)
    switches: int = 0  # how often it changed rules


class MetadataCacheFigures(_Figures):
    arrays: CacheFigures
    shard_indexes: CacheFigures


class DaemonFigures(_Figures):
    pid: int
    endpoint: str
    uptime_s: float
    allow_roots: list[str]
    messages: int
    malformed_messages: int
    allow_prefixes: list[str] = []
    replies: int = 0
    loop_cpu_s: float = 0.0  # the socket loop thread's CPU time: receiving, pumping sessions, replying
    batches: int = 0  # delivered to every session since start (ended ones included)
    requests: dict[str, int] = {}  # requests handled, by kind (Pop, Release, Push, Ping...)

    @property
    def loop_ms_per_batch(self) -> float:
        """The socket loop thread's CPU time per batch delivered: one thread serves every
        session, so this bounds a daemon's batches/s (1000 / it)."""
        return 1e3 * self.loop_cpu_s / self.batches if self.batches else 0.0

    @property
    def messages_per_batch(self) -> float:
        """Requests and replies per batch delivered (a pop, its reply, a release...)."""
        return (self.messages + self.replies) / self.batches if self.batches else 0.0


class MemoryFigures(_Figures):
    budget_bytes: int
    slot_bytes: int
    in_use_bytes: int
    peak_bytes: int
    chunk_cache_bytes: int
    retiring_slot_bytes: int


class SessionFigures(_Figures):
    """One client session; a control session (the CLI: stats, warm) has no pipeline."""

    session: str
    pid: int
    rank: int | None
    control: bool = False
    batches: int = 0
    samples: int = 0
    sample_errors: int = 0
    samples_pulled: int = 0
    held_batches: int = 0
    slot_waits: int = 0  # times a full batch of samples waited for a free slot (the client held them all)
    queued_samples: int = 0  # pushed, waiting for a slot
    slot_bytes: int = 0
    samples_per_batch: int = 0
    sample_shape: list[int] = []
    dtype: str = ""


class DiskTierFigures(_Figures):
    """The disk tier of fetched object-store bytes (``--chunk-cache-dir``)."""

    entries: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    writes: int = 0
    evictions: int = 0
    refused: int = 0  # entries that failed their checks (cut short, another key): deleted, not served


class DaemonStats(_Figures):
    daemon: DaemonFigures
    stages: dict[str, StageFigures]
    cache: MetadataCacheFigures
    chunk_cache: CacheFigures | None
    memory: MemoryFigures
    sessions: list[SessionFigures]
    session: SessionFigures | None = None  # the asking session's own
    disk_cache: DiskTierFigures | None = None


def as_dict(stats: DaemonStats) -> dict:
    """The figures as plain dicts and lists (what callers and ``--json`` get)."""
    return msgspec.to_builtins(stats)
