"""A pipeline's figures as the seed API's :class:`~damacy_protocol.stats.Stats`.

The stages are the executor's (a composed or Config pipeline's executor serves it alone,
so they are the pipeline's): ``io`` its reads, ``decode`` and ``assemble`` its decodes and
copies, ``input_transfer`` a GPU executor's copies to the device; ``plan`` is the
planner's; ``pop_wait`` the time callers waited in ``pop``. Stages damacy's engine has no
step for (``post_decode``, ``decode_gap``, ``bind_wait``: see docs/seed.md) stay at zero
observations. Counters: the planner's caches, its metadata reads (and their synthetic
latency), the engine's batches and chunks, the executor's reads, tasks and memory.
"""

from __future__ import annotations

import threading
from typing import Any

from damacy_protocol.enums import Stage
from damacy_protocol.stats import (
    NO_BEST_S,
    NO_OBSERVATION_MS,
    STAGE_METRICS,
    STAGE_SOURCES,
    Metric,
    Stats,
    stage_metric,
)

#: the seed API's stage name -> the executor's (StageStats) stage it reads


class Figures:
    """The :class:`Stats` of one pipeline: its ``planner`` (a Planner), ``executor`` and
    ``engine``."""

    def __init__(self, planner: Any, executor: Any, engine: Any) -> None:
        self.planner = planner
        self.executor = executor
        self.engine = engine
        self._lock = threading.Lock()
        self._pop = [0.0, NO_OBSERVATION_MS, 0]  # seconds, best, pops

    def waited(self, seconds: float) -> None:
        """A pop returned (or raised) after ``seconds``."""
        with self._lock:
            self._pop[0] += seconds
            self._pop[1] = min(self._pop[1], seconds * 1e3)
            self._pop[2] += 1

    def reset(self) -> None:
        """Zero the timings and stages' totals and the latency counters (the caches' hits and
        misses, the memory committed and the lifetime totals stay)."""
        with self._lock:
            self._pop = [0.0, NO_OBSERVATION_MS, 0]
        self.executor.stats.reset()
        reads = getattr(self.planner.metadata, "reads", None)
        if reads is not None:
            reads.reset_latency()

    def stats(self) -> Stats:
        stages = self.executor.stats.snapshot()
        metrics: dict[str, Metric] = {}
        for name in STAGE_METRICS:
            source = stages.get(STAGE_SOURCES.get(name, ""))
            if name == "pop_wait":
                with self._lock:
                    seconds, best, count = self._pop
                metrics[name] = Metric(name, seconds * 1e3, best, 0.0, 0.0, int(count))
            elif source is None:
                metrics[name] = Metric(name, 0.0, NO_OBSERVATION_MS, 0.0, 0.0, 0)
            else:
                metrics[name] = stage_metric(
                    name, source["seconds"], source.get("best", NO_BEST_S), source["bytes_in"], source["bytes_out"], source["count"]
                )
        cache = self.planner.metadata.cache
        arrays, shards = cache.arrays.stats(), cache.shard_indexes.stats()
        reads = getattr(self.planner.metadata, "reads", None)
        latency = reads.figures() if reads is not None else {}
        engine, executor = self.engine, self.executor
        layout = getattr(executor, "layout_cache", None)
        layout_stats = layout.stats() if layout is not None else {"hits": 0, "misses": 0}
        on_gpu = getattr(executor, "gpu", None) is not None
        return Stats(
            **metrics,
            array_meta_hits=arrays["hits"],
            array_meta_misses=arrays["misses"],
            shard_index_hits=shards["hits"],
            shard_index_misses=shards["misses"],
            chunk_layout_hits=layout_stats["hits"],
            chunk_layout_misses=layout_stats["misses"],
            metadata_latency_ops=latency.get("ops", 0),
            metadata_latency_stat_ops=latency.get("stat_ops", 0),
            metadata_latency_submit_ops=latency.get("submit_ops", 0),
            metadata_latency_active=latency.get("active", 0),
            metadata_latency_max_active=latency.get("max_active", 0),
            metadata_latency_total_sleep_ns=latency.get("total_sleep_ns", 0),
            metadata_latency_max_sleep_ns=latency.get("max_sleep_ns", 0),
            metadata_backend_read_jobs=latency.get("read_jobs", 0),
            metadata_backend_read_active=latency.get("read_active", 0),
            metadata_backend_read_max_active=latency.get("read_max_active", 0),
            batches_emitted=engine.batches_delivered,
            waves_emitted=engine.started_ids,
            chunks_planned=engine.units_planned,
            chunks_to_load=engine.units_to_load,
            chunks_dispatched=int(stages[Stage.DECODE]["count"]),
            reads_issued=int(stages[Stage.READ]["count"]),
            worker_steps=executor.worker_steps(),
            gpu_bytes_committed=executor.budget.used if on_gpu else 0,
            host_bytes_committed=0 if on_gpu else executor.budget.used,
        )
