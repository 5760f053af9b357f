"""damacyd's figures for Prometheus: ``damacyd --metrics HOST:PORT`` serves ``/metrics``.

Nothing on the hot path: a scrape asks the daemon for the same snapshot ``damacy stats``
shows (:meth:`damacy_server.daemon.service.Daemon.stats`) and turns it into metric families, so the
figures a monitoring system sees are the ones an operator reads on the node. Counters are
totals since the daemon started (per session: since the session started; a session's
series end with it, the daemon-wide totals keep its batches).
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger("damacyd")

PREFIX = "damacy"


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` or ``PORT`` (loopback by default) as (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT (a port 0 to 65535; 0 picks a free one)")
    return host, int(port)


class DaemonCollector:
    """The daemon's snapshot as metric families, built at each scrape."""

    def __init__(self, daemon: Any) -> None:
        self.daemon = daemon

    def describe(self):  # no fixed set: families come with the snapshot
        return []

    def collect(self):
        stats = self.daemon.stats()
        counts = self.daemon.totals.snapshot()
        d = stats.daemon

        yield _gauge("uptime_seconds", "Seconds since damacyd started.", d.uptime_s)
        yield _counter("messages", "Requests received.", d.messages)
        yield _counter("malformed_messages", "Requests that could not be decoded (their connection was dropped).", d.malformed_messages)
        yield _counter("replies", "Replies sent.", d.replies)
        yield _counter("loop_cpu_seconds", "The socket loop thread's CPU time (receiving, pumping sessions, replying).", d.loop_cpu_s)

        sessions = [s for s in stats.sessions if not s.control]
        yield _gauge("sessions", "Pipeline sessions open now.", len(sessions))
        yield _counter("sessions_started", "Pipeline sessions started.", counts["sessions_started"])
        yield _counter("batches_delivered", "Batches handed to clients, all sessions (ended ones included).", counts["batches"])
        yield _counter("samples_delivered", "Samples in the batches handed to clients, all sessions.", counts["samples"])
        errors = CounterMetricFamily(f"{PREFIX}_sample_errors", "Samples that failed, by error type (refused paths included).", labels=["type"])
        for kind, n in sorted(counts["errors"].items()):
            errors.add_metric([kind], n)
        yield errors

        labels = ["session", "pid", "rank"]
        per = {
            "batches": CounterMetricFamily(f"{PREFIX}_session_batches", "Batches delivered to the session.", labels=labels),
            "samples": CounterMetricFamily(f"{PREFIX}_session_samples", "Samples delivered to the session.", labels=labels),
            "sample_errors": CounterMetricFamily(f"{PREFIX}_session_sample_errors", "Samples of the session that failed.", labels=labels),
            "samples_pulled": CounterMetricFamily(f"{PREFIX}_session_samples_pushed", "Samples the session pushed.", labels=labels),
            "slot_waits": CounterMetricFamily(
                f"{PREFIX}_session_slot_waits", "Times a full batch of samples waited for a free slot (the client held them all).", labels=labels
            ),
            "held_batches": GaugeMetricFamily(f"{PREFIX}_session_held_batches", "Batches the client holds now.", labels=labels),
            "queued_samples": GaugeMetricFamily(f"{PREFIX}_session_queued_samples", "Samples pushed and waiting for a slot.", labels=labels),
            "slot_bytes": GaugeMetricFamily(f"{PREFIX}_session_slot_bytes", "Bytes of the session's batch slots.", labels=labels),
        }
        for s in sessions:
            key = [s.session, str(s.pid), "" if s.rank is None else str(s.rank)]
            for name, family in per.items():
                family.add_metric(key, getattr(s, name))
        yield from per.values()

        stage_labels = ["stage"]
        seconds = CounterMetricFamily(f"{PREFIX}_stage_seconds", "Seconds spent per stage, summed over threads.", labels=stage_labels)
        units = CounterMetricFamily(f"{PREFIX}_stage_units", "Units (reads, chunks, batches) per stage.", labels=stage_labels)
        bytes_in = CounterMetricFamily(f"{PREFIX}_stage_bytes_in", "Bytes into each stage.", labels=stage_labels)
        bytes_out = CounterMetricFamily(f"{PREFIX}_stage_bytes_out", "Bytes out of each stage.", labels=stage_labels)
        for name, f in sorted(stats.stages.items()):
            seconds.add_metric([name], f.seconds)
            units.add_metric([name], f.count)
            bytes_in.add_metric([name], f.bytes_in)
            bytes_out.add_metric([name], f.bytes_out)
        yield from (seconds, units, bytes_in, bytes_out)

        caches = {"metadata": stats.cache.arrays, "shard_index": stats.cache.shard_indexes}
        if stats.chunk_cache is not None:
            caches["chunk"] = stats.chunk_cache
        if stats.disk_cache is not None:  # (--chunk-cache-dir: fetched object-store bytes on local disk)
            caches["disk"] = stats.disk_cache
        cache_labels = ["cache"]
        families = {
            "hits": CounterMetricFamily(f"{PREFIX}_cache_hits", "Lookups found in the cache.", labels=cache_labels),
            "misses": CounterMetricFamily(f"{PREFIX}_cache_misses", "Lookups not found.", labels=cache_labels),
            "evictions": CounterMetricFamily(f"{PREFIX}_cache_evictions", "Entries evicted.", labels=cache_labels),
            "entries": GaugeMetricFamily(f"{PREFIX}_cache_entries", "Entries held now.", labels=cache_labels),
            "bytes": GaugeMetricFamily(f"{PREFIX}_cache_bytes", "Bytes held now.", labels=cache_labels),
        }
        for name, c in caches.items():
            for field, family in families.items():
                family.add_metric([name], getattr(c, field))
        yield from families.values()

        mem = stats.memory
        yield _gauge("memory_budget_bytes", "Host memory damacyd may use for slots and data in flight (--memory).", mem.budget_bytes)
        yield _gauge("memory_in_use_bytes", "Of the budget, in use now (slots and data in flight).", mem.in_use_bytes)
        yield _gauge("memory_peak_bytes", "Of the budget, the most in use at once.", mem.peak_bytes)
        yield _gauge("memory_slot_bytes", "Of the budget, held by batch slots.", mem.slot_bytes)
        yield _gauge("memory_retiring_slot_bytes", "Slots of ended sessions still mapped by a client.", mem.retiring_slot_bytes)

        queues = GaugeMetricFamily(f"{PREFIX}_queue_tasks", "Tasks waiting for a worker thread, per pool.", labels=["pool"])
        for pool, n in sorted(self.daemon.queue_depths().items()):
            queues.add_metric([pool], n)
        yield queues


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def serve(daemon: Any, address: str) -> tuple[Any, tuple[str, int]]:
    """Serve ``/metrics`` for ``daemon`` at ``address`` from a thread of its own; returns
    (the server, the (host, port) it listens on)."""
    host, port = parse_address(address)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(daemon))
    server, thread = start_http_server(port, addr=host, registry=registry)
    bound = server.server_address[:2]
    log.info("metrics at http://%s:%d/metrics", bound[0], bound[1], extra={"event": "metrics"})
    return (server, thread), (str(bound[0]), int(bound[1]))
