"""The daemon's figures as typed values: what ``StatsReply`` carries.

The daemon builds these; clients decode them against the same types and hand them to
callers as plain dicts (``msgspec.to_builtins``), so ``damacy stats --json`` and
``Pipeline.stats()`` keep their shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from damacy_protocol.enums import Stage


class _Figures(msgspec.Struct, forbid_unknown_fields=False):
    pass


class StageFigures(_Figures):
    """One stage's totals over all threads: seconds, units (or reads) and bytes in and out."""

    seconds: float = 0.0
    count: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    best: float = 0.0  # the shortest single observation, seconds (NO_BEST_S before any)


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


# -- the seed API's snapshot of one pipeline -------------------------------------------------

#: ``Metric.best_ms`` before any observation
NO_OBSERVATION_MS = 1e30
#: a stage's best observation before any, in the engine's stage figures (seconds)
NO_BEST_S = 1e27
#: the seed API's stage -> the engine's stage figures it reads
STAGE_SOURCES = {"plan": Stage.PLAN, "io": Stage.READ, "input_transfer": Stage.UPLOAD, "decode": Stage.DECODE, "assemble": Stage.ASSEMBLE}

STAGE_METRICS = (
    "plan", "io", "input_transfer", "decode", "post_decode", "decode_gap", "assemble", "bind_wait", "pop_wait",
)
COUNTERS = (
    "array_meta_hits", "array_meta_misses", "shard_index_hits", "shard_index_misses", "chunk_layout_hits",
    "chunk_layout_misses", "metadata_latency_ops", "metadata_latency_stat_ops", "metadata_latency_submit_ops",
    "metadata_latency_active", "metadata_latency_max_active", "metadata_latency_total_sleep_ns",
    "metadata_latency_max_sleep_ns", "metadata_backend_read_jobs", "metadata_backend_read_active",
    "metadata_backend_read_max_active", "batches_emitted", "waves_emitted", "chunks_planned", "chunks_to_load",
    "chunks_dispatched", "reads_issued", "worker_steps", "gpu_bytes_committed", "host_bytes_committed",
)


@dataclass(frozen=True, slots=True)
class Metric:
    """One stage of a pipeline: ``ms`` summed over every observation (and thread),
    ``best_ms`` the shortest single one (a large sentinel before any), the bytes it took in
    and gave out, and ``count`` observations."""

    name: str
    ms: float
    best_ms: float
    input_bytes: float
    output_bytes: float
    count: int


@dataclass(frozen=True, slots=True)
class Stats:
    """A pipeline's figures when asked (``Pipeline.stats()``; they keep accumulating).

    Stages (each a :class:`Metric`): ``plan`` (batches planned), ``io`` (reads),
    ``input_transfer`` (host to device copies of a GPU pipeline), ``decode`` (chunks),
    ``post_decode`` (device work after decoding: unshuffles), ``decode_gap`` (time decode
    threads waited for reads), ``assemble`` (copies into batches), ``bind_wait`` (batches
    waiting for a free slot), ``pop_wait`` (callers waiting in ``pop``). Then the caches'
    hits and misses (``chunk_layout``: parsed Blosc headers of a GPU pipeline), the
    synthetic metadata latency (:class:`LatencyModel`) and the metadata reads, batches,
    chunks planned (uses, before deduplication), to load (distinct, not cached) and
    dispatched (decoded), reads issued, worker tasks run, and the device and host memory
    committed now (``waves_emitted``: batches handed to an executor). See docs/seed.md.
    """

    plan: Metric
    io: Metric
    input_transfer: Metric
    decode: Metric
    post_decode: Metric
    decode_gap: Metric
    assemble: Metric
    bind_wait: Metric
    pop_wait: Metric
    array_meta_hits: int
    array_meta_misses: int
    shard_index_hits: int
    shard_index_misses: int
    chunk_layout_hits: int
    chunk_layout_misses: int
    metadata_latency_ops: int
    metadata_latency_stat_ops: int
    metadata_latency_submit_ops: int
    metadata_latency_active: int
    metadata_latency_max_active: int
    metadata_latency_total_sleep_ns: int
    metadata_latency_max_sleep_ns: int
    metadata_backend_read_jobs: int
    metadata_backend_read_active: int
    metadata_backend_read_max_active: int
    batches_emitted: int
    waves_emitted: int
    chunks_planned: int
    chunks_to_load: int
    chunks_dispatched: int
    reads_issued: int
    worker_steps: int
    gpu_bytes_committed: int
    host_bytes_committed: int = 0


def stage_metric(name: str, seconds: float, best_s: float, bytes_in: float, bytes_out: float, count: int) -> Metric:
    """A seed API stage from the engine's figures for it (``best_s`` at ``NO_BEST_S``: none)."""
    best = best_s * 1e3 if count and best_s < NO_BEST_S else NO_OBSERVATION_MS
    return Metric(name, seconds * 1e3, best, float(bytes_in), float(bytes_out), int(count))


def session_stats(daemon: DaemonStats, pop_seconds: float, pops: int, pop_best_s: float = math.inf) -> Stats:
    """A daemon client's :class:`Stats`: the daemon's stages, caches and memory (which all
    its sessions share), this session's batches, and the client's own waits in ``pop``
    (``pop_best_s``: the shortest)."""
    metrics: dict = {}
    for name in STAGE_METRICS:
        if name == "pop_wait":
            best = NO_OBSERVATION_MS if not pops else pop_best_s * 1e3
            metrics[name] = Metric(name, pop_seconds * 1e3, best, 0.0, 0.0, pops)
            continue
        fig = daemon.stages.get(STAGE_SOURCES.get(name, ""))
        if fig is None:
            metrics[name] = Metric(name, 0.0, NO_OBSERVATION_MS, 0.0, 0.0, 0)
        else:
            metrics[name] = stage_metric(name, fig.seconds, fig.best, fig.bytes_in, fig.bytes_out, fig.count)
    session = daemon.session
    read = daemon.stages.get(Stage.READ)
    decode = daemon.stages.get(Stage.DECODE)
    return Stats(
        **metrics,
        array_meta_hits=daemon.cache.arrays.hits,
        array_meta_misses=daemon.cache.arrays.misses,
        shard_index_hits=daemon.cache.shard_indexes.hits,
        shard_index_misses=daemon.cache.shard_indexes.misses,
        chunk_layout_hits=0,
        chunk_layout_misses=0,
        metadata_latency_ops=0,
        metadata_latency_stat_ops=0,
        metadata_latency_submit_ops=0,
        metadata_latency_active=0,
        metadata_latency_max_active=0,
        metadata_latency_total_sleep_ns=0,
        metadata_latency_max_sleep_ns=0,
        metadata_backend_read_jobs=0,
        metadata_backend_read_active=0,
        metadata_backend_read_max_active=0,
        batches_emitted=session.batches if session is not None else 0,
        waves_emitted=session.batches if session is not None else 0,
        chunks_planned=0,
        chunks_to_load=0,
        chunks_dispatched=decode.count if decode is not None else 0,
        reads_issued=read.count if read is not None else 0,
        worker_steps=0,
        gpu_bytes_committed=0,
        host_bytes_committed=daemon.memory.in_use_bytes,
    )


def since(now: Stats, then: Stats) -> Stats:
    """``now`` with the timings and stages' totals counted from ``then`` (a ``stats_reset``)."""
    values: dict = {}
    for name in STAGE_METRICS:
        a, b = getattr(now, name), getattr(then, name)
        count = a.count - b.count
        values[name] = Metric(
            name, a.ms - b.ms, a.best_ms if count else NO_OBSERVATION_MS, a.input_bytes - b.input_bytes,
            a.output_bytes - b.output_bytes, count,
        )
    for name in COUNTERS:
        values[name] = getattr(now, name)
    return Stats(**values)
