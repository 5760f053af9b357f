"""The disk tier of fetched object-store bytes: bounded, shared by folder, read again instead
of the store, and never serving an entry a crash cut short."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import zarr
from zarr.codecs import ZstdCodec

import damacy
from damacy_server.store.disk import MARKER, TMP_SUFFIX, DiskTier

from conftest import random_data, write_array
from daemon_helpers import wait_for
from object_servers import RangeServer


def _payload(key: str, n: int) -> bytes:
    return (key.encode() * (n // len(key) + 1))[:n]


def test_entries_come_back_and_the_tier_keeps_its_bound(tmp_path):
    probe = DiskTier(tmp_path / "probe", max_bytes=1 << 20)
    block = probe._block
    n = 3 * block - 200  # with its header, an entry takes 3 blocks of disk
    tier = DiskTier(tmp_path / "t", max_bytes=9 * block + 100)
    for k in range(5):
        assert tier.put(f"s3://b/c/{k}#0+{n}", _payload(f"k{k}", n))
    assert tier.nbytes == 9 * block and tier.stats()["evictions"] == 2
    assert tier.get(f"s3://b/c/0#0+{n}") is None and tier.get(f"s3://b/c/1#0+{n}") is None  # the oldest went
    assert tier.get(f"s3://b/c/4#0+{n}") == _payload("k4", n)
    assert not tier.put("big", b"x" * 10 * block)  # larger than the whole tier: not kept
    # a second tier on the folder (another process, or a restart) finds the entries
    again = DiskTier(tmp_path / "t", max_bytes=9 * block + 100)
    assert again.get(f"s3://b/c/3#0+{n}") == _payload("k3", n) and again.stats()["entries"] == 3
    assert _on_disk(tmp_path / "t") <= tier.max_bytes


def _on_disk(folder) -> int:
    """The disk space the tier's entries take."""
    return sum(p.stat().st_blocks * 512 for p in folder.glob("??/*") if p.is_file())


def test_a_disk_that_refuses_writes_and_removals_turns_entries_away_quietly(tmp_path, monkeypatch):
    """A read-only filesystem refuses the write and even the removal of what was not
    written (EROFS): put says False, as for any refusal, and raises nothing."""
    import errno
    from pathlib import Path

    from damacy_server.store import disk

    tier = DiskTier(str(tmp_path / "tier"), 1 << 20)
    assert tier.put("a", b"kept")

    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(disk, "open", refuse, raising=False)
    monkeypatch.setattr(Path, "unlink", refuse)
    assert tier.put("b", b"x" * 100) is False
    monkeypatch.undo()
    assert tier.get("a") == b"kept" and tier.get("b") is None


def test_a_full_disk_makes_room_from_the_least_recently_used_entries(tmp_path, monkeypatch):
    """The disk fills before the bound does (the bound is larger than the free space): a
    write that finds no space evicts old entries and is tried once more."""
    import builtins
    import errno

    from damacy_server.store import disk

    tier = DiskTier(str(tmp_path / "tier"), 64 << 20)
    for k in "abcd":
        assert tier.put(k, k.encode() * 1000)
    tier.get("a")  # b is now the least recently used
    real, full = builtins.open, [True]

    def no_space_once(path, mode="r", *args, **kwargs):
        if "w" in mode and full[0] and str(path).endswith(TMP_SUFFIX):
            full[0] = False
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(disk, "open", no_space_once, raising=False)
    assert tier.put("e", b"e" * 1000)  # room made, then written
    monkeypatch.undo()
    assert tier.get("e") == b"e" * 1000 and tier.get("b") is None and tier.get("a") == b"a" * 1000
    assert tier.stats()["evictions"] >= 1


def test_processes_making_a_new_folder_a_tier_together_all_open_it(tmp_path):
    # processes at once, each opening the same 100 fresh folders as fast as it can
    code = textwrap.dedent("""
        import os, sys, time
        from damacy_server.store.disk import DiskTier
        open(f"{sys.argv[1]}/ready-{os.getpid()}", "w").close()
        while not os.path.exists(f"{sys.argv[1]}/go"):  # all start together
            time.sleep(0.001)
        bad = 0
        for k in range(100):
            try:
                DiskTier(f"{sys.argv[1]}/{k}", 1 << 20)
            except Exception as e:
                bad += 1
                print(repr(e))
        print("refused", bad)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    assert wait_for(lambda: len(list(tmp_path.glob("ready-*"))) == 4, timeout=120, what="the processes to be ready")
    (tmp_path / "go").touch()
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(out.strip().endswith("refused 0") for out in outs), outs
    assert all((tmp_path / str(k) / MARKER).is_file() for k in range(100))


def test_a_temporary_file_of_an_earlier_process_with_this_pid_is_removed(tmp_path):
    """A restarted container's process often gets its predecessor's pid: a write that
    predecessor left half done is its, not this process's."""
    tier_dir = tmp_path / "tier"
    DiskTier(str(tier_dir), 1 << 20)
    (tier_dir / "cd").mkdir()
    left = tier_dir / "cd" / f"{'2' * 38}.{os.getpid()}.1{TMP_SUFFIX}"
    left.write_bytes(b"half")
    os.utime(left, (1_000_000_000, 1_000_000_000))  # written long before this process started
    mine = tier_dir / "cd" / f"{'3' * 38}.{os.getpid()}.2{TMP_SUFFIX}"  # one this process writes now
    mine.write_bytes(b"half")
    DiskTier(str(tier_dir), 1 << 20)
    assert not left.exists() and mine.exists()


def test_the_folder_is_the_tiers_own(tmp_path):
    # a folder holding anything else is refused, and nothing in it is touched
    other = tmp_path / "scratch"
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints" / "model.pt").write_bytes(b"weights")
    with pytest.raises(damacy.InvalidArgument, match="not a damacy disk tier.*checkpoints"):
        DiskTier(other, max_bytes=1 << 20)
    assert (other / "checkpoints" / "model.pt").read_bytes() == b"weights"
    mount = tmp_path / "nvme"
    (mount / "lost+found").mkdir(parents=True)  # the root of a filesystem: a tier may live there
    DiskTier(mount, max_bytes=1 << 20).put("k", b"v")
    assert (mount / "lost+found").is_dir() and (mount / MARKER).is_file()
    # in a tier, only names of its own forms are read or removed; links are not followed
    tier_dir = tmp_path / "tier"
    tier = DiskTier(tier_dir, max_bytes=1 << 20)
    tier.put("a", _payload("a", 5000))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / ("0" * 38)).write_bytes(b"precious")
    (tier_dir / "ab").symlink_to(outside)
    (tier_dir / tier._name("a")).parent.joinpath("notes.txt").write_text("mine")
    (tier_dir / "cd").mkdir()
    (tier_dir / "cd" / ("1" * 38)).mkdir()  # a folder where an entry would be
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    stale = tier_dir / "cd" / f"{'2' * 38}.{dead}.1{TMP_SUFFIX}"  # its writer is gone
    live = tier_dir / "cd" / f"{'3' * 38}.{os.getppid()}.1{TMP_SUFFIX}"  # its writer still writes
    stale.write_bytes(b"half")
    live.write_bytes(b"half")
    again = DiskTier(tier_dir, max_bytes=1)  # a bound below every entry: evicts all it indexed
    assert again.stats()["evictions"] == 1 and again.stats()["entries"] == 0
    assert (outside / ("0" * 38)).read_bytes() == b"precious"
    assert (tier_dir / tier._name("a")).parent.joinpath("notes.txt").read_text() == "mine"
    assert not stale.exists() and live.exists()


def test_processes_sharing_a_folder_keep_its_bound_together(tmp_path):
    # two tiers on one folder (two processes' own indexes): each rescans the folder after
    # writing a sixteenth of the bound, so together they stay within it (plus that margin each)
    bound = 64 * 8192
    a, b = DiskTier(tmp_path, max_bytes=bound), DiskTier(tmp_path, max_bytes=bound)
    for k in range(200):
        (a if k % 2 else b).put(f"s3://b/c/{k}#0+8000", _payload(f"k{k}", 8000))
    assert _on_disk(tmp_path) <= bound + 2 * (bound // 16 + 16384)
    assert a.nbytes <= bound and b.nbytes <= bound
    # the last entries written by either are still there
    assert a.get("s3://b/c/198#0+8000") == _payload("k198", 8000) and b.get("s3://b/c/199#0+8000") == _payload("k199", 8000)


def test_a_hit_keeps_its_entry_in_use_across_a_restart(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=2 * 8192 + 100)
    for key in ("hot", "cold"):
        tier.put(key, _payload(key, 7000))
    os.utime(tmp_path / tier._name("hot"), (1000, 1000))  # written long ago, hot first
    os.utime(tmp_path / tier._name("cold"), (2000, 2000))
    assert tier.get("hot") is not None  # used now
    again = DiskTier(tmp_path, max_bytes=2 * 8192 + 100)  # a restart: the order from the files
    again.put("new", _payload("new", 7000))  # one has to go: the least recently used
    assert again.get("hot") == _payload("hot", 7000) and again.get("cold") is None


def test_a_miss_racing_a_put_of_its_key_leaves_the_entry_indexed(tmp_path, monkeypatch):
    # a get finds no file; before it settles its miss, a put of the same key (another batch
    # fetched it) lands: the entry must stay indexed, else its file is never evicted
    import damacy_server.store.disk as disk

    tier = DiskTier(tmp_path, max_bytes=6 * 8192)
    key = "s3://b/c/x#0+7000"
    missed, written = threading.Event(), threading.Event()
    real_open = open

    def racing_open(path, mode="r", *a, **kw):
        if mode == "rb" and threading.current_thread().name == "reader":
            try:
                return real_open(path, mode, *a, **kw)
            except FileNotFoundError:
                missed.set()
                assert written.wait(30)
                raise
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr(disk, "open", racing_open, raising=False)
    reader = threading.Thread(target=tier.get, args=(key,), name="reader")
    reader.start()
    assert missed.wait(30)
    assert tier.put(key, _payload(key, 7000))
    written.set()
    reader.join()
    for k in range(12):  # more entries than the bound holds: the old ones go, x among them
        tier.put(f"s3://b/c/{k}#0+7000", _payload(str(k), 7000))
    files = {f"{p.parent.name}/{p.name}" for p in tmp_path.glob("??/*")}
    assert files == set(tier._index) and tier._name(key) not in files


def test_threads_keep_the_index_and_the_files_in_step(tmp_path):
    # gets, puts and evictions of a few keys from many threads at once: every file on disk is
    # indexed and counted, every indexed entry is on disk
    tier = DiskTier(tmp_path, max_bytes=6 * 8192)
    keys = [f"s3://b/c/{k}#0+7000" for k in range(10)]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        def work(seed: int) -> None:
            rng = np.random.default_rng(seed)
            for _ in range(400):
                key = keys[int(rng.integers(len(keys)))]
                if rng.random() < 0.5:
                    got = tier.get(key)
                    assert got is None or got == _payload(key, 7000)
                else:
                    tier.put(key, _payload(key, 7000))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    files = {f"{p.parent.name}/{p.name}" for p in tmp_path.glob("??/*") if not p.name.endswith(TMP_SUFFIX)}
    assert files == set(tier._index) and tier.nbytes == sum(tier._index.values()) <= tier.max_bytes
    assert not list(tmp_path.rglob(f"*{TMP_SUFFIX}"))


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
        return pipe.stats_dict()

    try:
        with damacy.Pipeline(cfg, endpoint=daemon.endpoint if daemon else None) as pipe:
            first = epoch(pipe)
            fetched = _data_reads(server)
            assert fetched > 0 and first["stages"].get("disk", {}).get("count", 0) == 0
            # the tier is written off the fetching thread: wait for it
            wait_for(lambda: pipe.stats_dict()["disk_cache"]["writes"] == fetched, what="every fetched range on disk")
            second = epoch(pipe)
        assert _data_reads(server) == fetched  # nothing fetched again: read from the disk tier
        assert second["stages"]["disk"]["count"] == fetched and second["disk_cache"]["hits"] == fetched
        assert len(list(folder.glob("??/*"))) == fetched
    finally:
        if daemon is not None:
            assert daemon.stop() == 0, daemon.log_path.read_text()
