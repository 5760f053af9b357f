"""The disk tier of fetched object-store bytes: bounded, shared by folder, read again instead
of the store, and never serving an entry a crash cut short."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import zarr
from zarr.codecs import ZstdCodec

import damacy
from damacy_server.store.disk import TMP_SUFFIX, DiskTier

from conftest import random_data, write_array
from daemon_helpers import wait_for
from object_servers import RangeServer


def _payload(key: str, n: int) -> bytes:
    return (key.encode() * (n // len(key) + 1))[:n]


def test_entries_come_back_and_the_tier_keeps_its_bound(tmp_path):
    tier = DiskTier(tmp_path / "t", max_bytes=3 * 1100)
    for k in range(5):
        assert tier.put(f"s3://b/c/{k}#0+1000", _payload(f"k{k}", 1000))
    assert tier.nbytes <= 3 * 1100 and tier.stats()["evictions"] == 2
    assert tier.get("s3://b/c/0#0+1000") is None and tier.get("s3://b/c/1#0+1000") is None  # the oldest went
    assert tier.get("s3://b/c/4#0+1000") == _payload("k4", 1000)
    assert not tier.put("big", b"x" * 4000)  # larger than the whole tier: not kept
    # a second tier on the folder (another process, or a restart) finds the entries
    again = DiskTier(tmp_path / "t", max_bytes=3 * 1100)
    assert again.get("s3://b/c/3#0+1000") == _payload("k3", 1000) and again.stats()["entries"] == 3


def test_an_entry_cut_short_or_another_keys_is_refused_and_removed(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=1 << 20)
    tier.put("a", _payload("a", 5000))
    tier.put("b", _payload("b", 5000))
    path_a = tmp_path / tier._name("a")
    path_a.write_bytes(path_a.read_bytes()[:3000])  # a file cut short (the machine crashed)
    assert tier.get("a") is None and not path_a.exists() and tier.stats()["refused"] == 1
    path_b = tmp_path / tier._name("b")
    data = bytearray(path_b.read_bytes())
    data[-1] ^= 0xFF  # one byte changed on disk: the CRC tells
    path_b.write_bytes(bytes(data))
    assert tier.get("b") is None and tier.stats()["refused"] == 2
    tier.put("c", _payload("c", 100))
    (tmp_path / tier._name("d")).parent.mkdir(exist_ok=True)
    os.replace(tmp_path / tier._name("c"), tmp_path / tier._name("d"))  # under another key's name
    assert tier.get("d") is None


WRITER = textwrap.dedent(
    """
    import builtins, os, sys
    from damacy_server.store.disk import DiskTier

    folder = sys.argv[1]
    tier = DiskTier(folder, max_bytes=1 << 30)
    for k in range(3):
        key = f"s3://bucket/c/{k}#0+4000000"
        tier.put(key, (key.encode() * 200000)[:4000000])
    real_open = builtins.open

    class Stuck:  # writes half of what it is given, says so, and never returns
        def __init__(self, f):
            self.f = f
        def write(self, data):
            if len(data) > 1000:
                self.f.write(bytes(data[: len(data) // 2]))
                self.f.flush()
                print("half", flush=True)
                while True:
                    os.pause()
            return self.f.write(data)
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    def stuck_open(path, mode="r", *a, **kw):
        f = real_open(path, mode, *a, **kw)
        return Stuck(f) if "w" in mode and str(path).endswith("{suffix}") else f

    import damacy_server.store.disk as disk
    disk.open = stuck_open
    key = "s3://bucket/c/3#0+4000000"
    tier.put(key, (key.encode() * 200000)[:4000000])
    """
).replace("{suffix}", TMP_SUFFIX)


def test_a_writer_killed_mid_write_leaves_no_torn_entry(tmp_path):
    folder = tmp_path / "tier"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "half", "the writer did not reach the middle of its write"
        parts = list(folder.rglob(f"*{TMP_SUFFIX}"))
        assert len(parts) == 1 and 0 < parts[0].stat().st_size < 4_000_000
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    tier = DiskTier(folder, max_bytes=1 << 30)
    assert not list(folder.rglob(f"*{TMP_SUFFIX}"))  # the half-written entry is gone
    for k in range(3):
        key = f"s3://bucket/c/{k}#0+4000000"
        assert tier.get(key) == (key.encode() * 200000)[:4000000]
    assert tier.get("s3://bucket/c/3#0+4000000") is None and tier.stats()["entries"] == 3


@pytest.fixture
def served(tmp_path):
    data = random_data((64, 48), "uint16", seed=5)
    write_array(tmp_path / "a.zarr", data, chunks=(8, 8), shards=(32, 24), compressors=[ZstdCodec()])
    server = RangeServer(tmp_path)
    yield server, zarr.open_array(str(tmp_path / "a.zarr"), mode="r")[...]
    server.stop()


def _data_reads(server) -> int:
    """GETs of chunk bytes in shards (shard indexes are suffix ranges; zarr.json no range)."""
    with server.lock:
        return sum(1 for path, rng in server.ranges if "/c/" in path and rng and not rng.startswith("bytes=-"))


@pytest.mark.parametrize("mode", ["embedded", "daemon"])
def test_a_second_epoch_reads_the_disk_tier_not_the_store(served, tmp_path_factory, mode):
    from daemon_helpers import DaemonProcess

    server, expected = served
    folder = tmp_path_factory.mktemp("tier")
    uri = f"{server.url}/a.zarr"
    boxes = [np.s_[z : z + 8, x : x + 12] for z in range(0, 56, 7) for x in (0, 30)]
    cfg = damacy.Config(samples_per_batch=4, sample_shape=(8, 12), dtype="u16", chunk_cache_dir=str(folder), chunk_cache_dir_bytes=64 << 20)
    daemon = None
    if mode == "daemon":
        daemon = DaemonProcess(tmp_path_factory.mktemp("d"), [], ["--allow-prefix", server.url, "--chunk-cache-dir", str(folder)])
        cfg = damacy.Config(samples_per_batch=4, sample_shape=(8, 12), dtype="u16")

    def epoch(pipe):
        got = []
        pipe.push(damacy.Sample(uri, b) for b in boxes)
        for batch in pipe.batches(len(boxes) // 4):
            with batch:
                got.append(np.array(np.from_dlpack(batch)))
        np.testing.assert_array_equal(np.concatenate(got), np.stack([expected[b] for b in boxes]))
        return pipe.stats()

    try:
        with damacy.Pipeline(cfg, endpoint=daemon.endpoint if daemon else None) as pipe:
            first = epoch(pipe)
            fetched = _data_reads(server)
            assert fetched > 0 and first["stages"].get("disk", {}).get("count", 0) == 0
            # the tier is written off the fetching thread: wait for it
            wait_for(lambda: pipe.stats()["disk_cache"]["writes"] == fetched, what="every fetched range on disk")
            second = epoch(pipe)
        assert _data_reads(server) == fetched  # nothing fetched again: read from the disk tier
        assert second["stages"]["disk"]["count"] == fetched and second["disk_cache"]["hits"] == fetched
        assert len(list(folder.rglob("*/*"))) == fetched
    finally:
        if daemon is not None:
            assert daemon.stop() == 0, daemon.log_path.read_text()
