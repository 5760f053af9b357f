"""damacyd --metrics: a real daemon's /metrics, scraped over HTTP after a stream whose figures
the test knows (what the client received, a warm that filled the chunk cache, a refused path)."""

from __future__ import annotations

import re
import subprocess
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from zarr.codecs import ZstdCodec

import damacy

from conftest import random_data, write_array
from daemon_helpers import DaemonProcess, damacyd_command, wait_for


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of the exposition: (name, sorted labels) -> value."""
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metrics_url(proc: DaemonProcess) -> str:
    line = wait_for(lambda: re.search(r"metrics at (http://\S+/metrics)", proc.log_path.read_text()), what="the metrics line in the log")
    return line.group(1)


def test_metrics_carry_the_figures_of_the_stream_that_ran(tmp_path):
    data = random_data((32, 48), "uint16", seed=4)
    write_array(tmp_path / "a.zarr", data, chunks=(8, 16), compressors=[ZstdCodec()])
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    write_array(outside / "b.zarr", data, chunks=(8, 16))
    proc = DaemonProcess(tmp_path, [tmp_path], extra=["--metrics", "127.0.0.1:0", "--chunk-cache", "16M", "--memory", "512M"])
    try:
        url = metrics_url(proc)
        assert url.startswith("http://127.0.0.1:")
        before = scrape(url)
        assert before[("damacy_batches_delivered_total", ())] == 0 and before[("damacy_sessions", ())] == 0
        assert before[("damacy_memory_budget_bytes", ())] == 512 << 20

        warm = subprocess.run(["damacy", "warm", "--endpoint", proc.endpoint, "--chunks", str(tmp_path / "a.zarr")], capture_output=True, text=True, timeout=60)
        assert warm.returncode == 0, warm.stderr
        uri = str(tmp_path / "a.zarr")
        samples = [damacy.Sample(uri, np.s_[r : r + 8, c : c + 16]) for r in range(0, 32, 8) for c in range(0, 48, 16)]
        samples.insert(5, damacy.Sample(str(outside / "b.zarr"), np.s_[0:8, 0:16]))  # refused: outside the root
        cfg = damacy.Config(samples_per_batch=3, sample_shape=(8, 16), dtype="uint16", on_error="fill", pop_timeout_s=60, drop_last=False)
        got_batches = got_samples = 0
        with damacy.Pipeline(cfg, endpoint=proc.endpoint) as pipe:
            pipe.push(samples)
            for batch in pipe:
                with batch:
                    got_batches += 1
                    got_samples += len(batch.info.samples)
            me = pipe.stats_dict()["session"]["session"]
            during = scrape(url)
        assert (got_batches, got_samples) == (5, 13)
        key = (("pid", str(__import__("os").getpid())), ("rank", ""), ("session", me))
        assert during[("damacy_session_batches_total", key)] == got_batches
        assert during[("damacy_session_samples_total", key)] == got_samples
        assert during[("damacy_session_samples_pushed_total", key)] == len(samples)
        assert during[("damacy_session_sample_errors_total", key)] == 1
        assert during[("damacy_sessions", ())] >= 1

        def ended():  # at once after its goodbye; a goodbye that came late leaves it to the liveness check
            figures = scrape(url)
            return not any(name.startswith("damacy_session_") for name, labels in figures if ("session", me) in labels) and figures

        after = wait_for(ended, timeout=60, what="the session's figures to go")
        assert after[("damacy_batches_delivered_total", ())] == got_batches
        assert after[("damacy_samples_delivered_total", ())] == got_samples
        assert after[("damacy_sample_errors_total", (("type", "InvalidArgument"),))] == 1  # the refused path, once
        assert after[("damacy_stage_bytes_out_total", (("stage", "read"),))] > 0  # the warm's reads
        assert after[("damacy_stage_seconds_total", (("stage", "decode"),))] > 0
        assert after[("damacy_stage_units_total", (("stage", "warm"),))] == 12
        assert after[("damacy_cache_hits_total", (("cache", "chunk"),))] >= 12  # every chunk was warmed
        assert after[("damacy_cache_entries", (("cache", "chunk"),))] == 12
        assert after[("damacy_cache_hits_total", (("cache", "metadata"),))] > 0
        assert after[("damacy_memory_peak_bytes", ())] > 0
        assert ("damacy_queue_tasks", (("pool", "decode"),)) in after
        assert after[("damacy_sessions_started_total", ())] == 1
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()


def test_metrics_are_off_by_default_and_a_bad_address_is_refused(tmp_path):
    proc = DaemonProcess(tmp_path, [tmp_path])
    try:
        assert "metrics at" not in proc.log_path.read_text()
    finally:
        assert proc.stop() == 0
    for bad in ("nonsense", "127.0.0.1:99999"):
        out = subprocess.run([*damacyd_command(), "--endpoint", f"ipc://{tmp_path}/x.sock", "--metrics", bad], capture_output=True, text=True, timeout=30)
        assert out.returncode == 2 and "--metrics" in out.stderr and "HOST:PORT" in out.stderr, out.stderr


def test_the_disk_tier_has_its_cache_series(tmp_path):
    proc = DaemonProcess(tmp_path, [tmp_path], extra=["--metrics", "127.0.0.1:0", "--chunk-cache-dir", str(tmp_path / "tier")])
    try:
        got = scrape(metrics_url(proc))
        for name in ("damacy_cache_entries", "damacy_cache_bytes", "damacy_cache_hits_total", "damacy_cache_misses_total", "damacy_cache_evictions_total"):
            assert got[(name, (("cache", "disk"),))] == 0, name  # an empty tier: its series, at 0
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()


@pytest.mark.parametrize("text,want", [("9400", ("127.0.0.1", 9400)), (":9400", ("127.0.0.1", 9400)), ("0.0.0.0:1", ("0.0.0.0", 1)), ("[::1]:80", ("::1", 80))])
def test_metrics_addresses_default_to_loopback(text, want):
    from damacy_server.daemon.metrics import parse_address

    assert parse_address(text) == want


def test_a_client_holding_every_slot_shows_as_slot_waits(tmp_path):
    data = random_data((16, 16), "uint16", seed=5)
    write_array(tmp_path / "a.zarr", data, chunks=(8, 8))
    proc = DaemonProcess(tmp_path, [tmp_path], extra=["--metrics", "0"])
    try:
        url = metrics_url(proc)
        cfg = damacy.Config(samples_per_batch=2, sample_shape=(8, 8), dtype="uint16", prepared_batches=1, pop_timeout_s=60)
        with damacy.Pipeline(cfg, endpoint=proc.endpoint) as pipe:
            pipe.push([damacy.Sample(str(tmp_path / "a.zarr"), np.s_[r : r + 8, 0:8]) for r in (0, 8)] * 4)
            me = pipe.stats_dict()["session"]["session"]
            key = (("pid", str(__import__("os").getpid())), ("rank", ""), ("session", me))
            wait_for(lambda: scrape(url).get(("damacy_session_queued_samples", key), 0) > 0, what="samples queued behind the first batch")
            assert scrape(url)[("damacy_session_slot_waits_total", key)] == 0  # the slot is busy, not the client's
            with pipe.pop():  # held: the one slot is the client's, the next batch waits for it
                wait_for(lambda: scrape(url).get(("damacy_session_slot_waits_total", key), 0) >= 1, what="a slot wait")
                assert scrape(url)[("damacy_session_held_batches", key)] == 1
                assert scrape(url)[("damacy_session_queued_samples", key)] > 0
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()
