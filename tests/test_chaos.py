"""The chaos suite (marker ``chaos``): clients killed with SIGKILL at random moments while
another streams, the daemon killed mid-stream and restarted, eight clients against a small
``--memory``, files truncated and deleted under a running stream. Real damacyd processes,
real client processes, real shared memory.

``.ci/run`` runs the short form (DAMACY_CHAOS_KILLS clients killed, 20 by default); the long
form is ``DAMACY_CHAOS_KILLS=100 pytest -m chaos``. A kill's moment is drawn from a seeded
generator: a phase of the victim (connected, pushed, holding batches it popped as zero-copy
arrays) and a delay after the victim says it reached it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from zarr.codecs import ZstdCodec

import damacy

from conftest import padded_selection, random_data, write_array
from daemon_helpers import DaemonProcess, shm_segments, wait_for

pytestmark = pytest.mark.chaos

KILLS = int(os.environ.get("DAMACY_CHAOS_KILLS", "20"))
SHAPE, BOX = (48, 96, 96), (8, 32, 32)

VICTIM = r"""
import sys, time
import numpy as np
import damacy

endpoint, uri, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = np.random.default_rng(seed)
shape, box = (48, 96, 96), (8, 32, 32)
cfg = damacy.Config(samples_per_batch=4, sample_shape=box, dtype="float32", prepared_batches=3, pop_timeout_s=120)
pipe = damacy.Pipeline(cfg, endpoint=endpoint)
print("connected", flush=True)
samples = [damacy.Sample(uri, tuple((int(o), int(o) + b) for o, b in zip((rng.integers(0, n - b + 1) for n, b in zip(shape, box)), box))) for _ in range(400)]
pipe.push(samples)
print("pushed", flush=True)
held = []
for batch in pipe:
    held.append((batch, np.from_dlpack(batch)))  # exported, zero-copy: the slot stays the client's
    if len(held) > 2:
        held.pop(0)[0].release()
    print("holding", flush=True)
"""


def rss(pid: int, field: str = "VmRSS") -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) * 1024


def daemon_sessions(endpoint: str) -> int:
    with damacy.Pipeline(damacy.Config(samples_per_batch=1, sample_shape=(1,)), endpoint=endpoint) as p:
        return len([s for s in p.stats_dict()["sessions"] if not s["control"]]) - 1  # not this one


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chaos")
    data = random_data(SHAPE, "uint16", seed=31)
    write_array(folder / "v.zarr", data, chunks=(8, 32, 32), compressors=[ZstdCodec()])
    return folder, str(folder / "v.zarr"), data


class Streamer(threading.Thread):
    """The client that must not notice: streams known boxes epoch after epoch and checks
    every batch against zarr-python's values, until told to stop."""

    def __init__(self, endpoint: str, uri: str, data: np.ndarray) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.uri, self.data = endpoint, uri, data
        self.stop = threading.Event()
        self.batches = 0
        self.wrong: list[str] = []
        self.error: BaseException | None = None
        rng = np.random.default_rng(1)
        self.samples = [
            damacy.Sample(uri, tuple((int(o), int(o) + b) for o, b in zip((rng.integers(0, n - b + 1) for n, b in zip(SHAPE, BOX)), BOX)))
            for _ in range(24)
        ]

    def run(self) -> None:
        cfg = damacy.Config(samples_per_batch=4, sample_shape=BOX, dtype="float32", prepared_batches=2, pop_timeout_s=120)
        try:
            with damacy.Pipeline(cfg, endpoint=self.endpoint) as pipe:
                while not self.stop.is_set():
                    pipe.push(self.samples)
                    for batch in pipe:
                        with batch:
                            got = np.from_dlpack(batch)
                            for k, s in enumerate(batch.info.samples):
                                if not np.array_equal(got[k], padded_selection(self.data, s.selection).astype("f4")):
                                    self.wrong.append(repr(s))
                            assert batch.info.errors == ()
                            del got  # a zero-copy array kept past its batch would hold the slot
                        self.batches += 1
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def finish(self) -> None:
        self.stop.set()
        self.join(180)
        assert not self.is_alive(), "the streaming client hung"
        assert self.error is None, repr(self.error)
        assert not self.wrong, self.wrong[:3]
        assert self.batches > 0


def _victim(endpoint: str, uri: str, seed: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", VICTIM, endpoint, uri, str(seed)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def test_clients_killed_at_random_moments_hurt_nobody(volume, tmp_path):
    folder, uri, data = volume
    proc = DaemonProcess(tmp_path, [folder], extra=["--memory", "512M", "--heartbeat-timeout", "3"])
    rng = np.random.default_rng(2026)
    try:
        warm = _victim(proc.endpoint, uri, 0)  # a session like the victims', left to end on its own
        assert warm.stdout.readline().strip() == "connected"
        warm.stdout.readline()
        warm.stdout.readline()
        warm.terminate()
        warm.wait()
        wait_for(lambda: daemon_sessions(proc.endpoint) == 0, timeout=60, what="the first session to end")
        baseline = rss(proc.pid)

        streamer = Streamer(proc.endpoint, uri, data)
        streamer.start()
        phases = ["connected", "pushed", "holding"]
        killed = []
        for k in range(KILLS):
            victim = _victim(proc.endpoint, uri, 100 + k)
            phase = phases[int(rng.integers(0, 3))]
            while True:  # the victim says where it is; kill it there
                line = victim.stdout.readline().strip()
                assert line, f"victim {k} ended before {phase}"
                if line == phase:
                    break
            if phase == "holding":  # some batches later
                for _ in range(int(rng.integers(0, 4))):
                    victim.stdout.readline()
            try:
                victim.wait(float(rng.uniform(0, 0.05)))  # a moment later, whatever it does then
            except subprocess.TimeoutExpired:
                pass
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            victim.stdout.close()
            killed.append(phase)
        assert len(killed) == KILLS and set(killed) == set(phases)
        wait_for(lambda: daemon_sessions(proc.endpoint) == 1, timeout=60, what="the killed clients' sessions to be reclaimed")
        streamer.finish()
        wait_for(lambda: not shm_segments(proc.pid), timeout=60, what="every slot segment to be unlinked")
        wait_for(lambda: rss(proc.pid) < baseline + (64 << 20), timeout=60, what="damacyd's memory to come back near its baseline")
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()[-3000:]
    assert not shm_segments(proc.pid)


def test_a_killed_daemon_fails_every_client_and_a_restarted_one_serves(volume, tmp_path):
    folder, uri, data = volume
    proc = DaemonProcess(tmp_path, [folder])
    replacement = None
    try:
        pipes = [damacy.Pipeline(damacy.Config(samples_per_batch=4, sample_shape=BOX, dtype="float32", pop_timeout_s=120), endpoint=proc.endpoint) for _ in range(3)]
        samples = Streamer(proc.endpoint, uri, data).samples
        for p in pipes:
            p.push(samples * 50)
            with p.pop():
                pass
        dead_pid = proc.pid
        proc.kill()  # SIGKILL mid-stream
        # the names of its slots were unlinked once the clients mapped them; one it had made for a
        # session still connecting would stay: stand one in, the next daemon must remove it
        stale = Path("/dev/shm") / f"damacy-{dead_pid}-{os.urandom(4).hex()}-0"
        stale.write_bytes(b"\0" * 4096)
        for p in pipes:  # every client raises DaemonUnavailable (after the heartbeat timeout), none hangs
            with pytest.raises(damacy.DaemonUnavailable):
                for _ in range(1000):
                    with p.pop():
                        pass
            p.close()
        replacement = DaemonProcess(tmp_path, [folder])
        assert not stale.exists() and not shm_segments(dead_pid)  # the new daemon removed what the dead one left
        streamer = Streamer(replacement.endpoint, uri, data)
        streamer.start()
        wait_for(lambda: streamer.batches >= 6 or streamer.error, timeout=120, what="batches from the restarted daemon")
        streamer.finish()
    finally:
        if proc.proc.poll() is None:  # the test failed before the kill: leave no daemon behind
            proc.kill()
        if replacement is not None:
            assert replacement.stop() == 0, replacement.log_path.read_text()[-3000:]


CLIENT = r"""
import sys
import numpy as np
import damacy
endpoint, uri, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = np.random.default_rng(seed)
shape, box = (48, 96, 96), (16, 64, 64)
cfg = damacy.Config(samples_per_batch=4, sample_shape=box, dtype="float32", prepared_batches=2, pop_timeout_s=300)
samples = [damacy.Sample(uri, tuple((int(o), int(o) + b) for o, b in zip((rng.integers(0, n - b + 1) for n, b in zip(shape, box)), box))) for _ in range(48)]
n = 0
with damacy.Pipeline(cfg, endpoint=endpoint) as pipe:
    pipe.push(samples)
    for batch in pipe:
        with batch:
            n += len(batch.info.samples)
print(n, flush=True)
"""


def test_eight_clients_against_a_small_memory_budget_stay_within_it(volume, tmp_path):
    folder, uri, _ = volume
    budget = 40 << 20  # 8 sessions x 2 slots x 1 MiB, 24 MiB for the chunks in flight of all of them (16 MiB is the least damacyd takes)
    proc = DaemonProcess(tmp_path, [folder], extra=["--memory", str(budget), "--decode-workers", "2"])
    try:
        idle = rss(proc.pid)
        clients = [subprocess.Popen([sys.executable, "-c", CLIENT, proc.endpoint, uri, str(k)], stdout=subprocess.PIPE, text=True) for k in range(8)]
        outs = [c.communicate(timeout=280)[0].strip() for c in clients]
        assert [c.returncode for c in clients] == [0] * 8 and outs == ["48"] * 8  # every sample of every client: no deadlock
        with damacy.Pipeline(damacy.Config(samples_per_batch=1, sample_shape=(1,)), endpoint=proc.endpoint) as p:
            memory = p.stats_dict()["memory"]
        assert 0 < memory["peak_bytes"] <= budget  # what the budget lent at its most
        peak = rss(proc.pid, "VmHWM")
        overhead = 64 << 20  # stated in the README: threads' stacks and arenas, decoders' buffers, Python's objects
        assert peak <= idle + budget + overhead, f"peak RSS {peak >> 20} MiB, idle {idle >> 20} MiB, budget {budget >> 20} MiB"
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()[-3000:]


def test_files_truncated_or_deleted_under_a_running_stream(tmp_path):
    data = random_data((32, 64), "uint16", seed=8)
    write_array(tmp_path / "a.zarr", data, chunks=(8, 16), compressors=[ZstdCodec()], fill_value=3)
    uri = str(tmp_path / "a.zarr")
    proc = DaemonProcess(tmp_path, [tmp_path])
    try:
        boxes = [(r, c) for r in range(0, 32, 8) for c in range(0, 64, 16)]  # one chunk each
        cfg = damacy.Config(samples_per_batch=4, sample_shape=(8, 16), dtype="uint16", on_error="fill", prepared_batches=1, lookahead_samples=4, pop_timeout_s=60)
        with damacy.Pipeline(cfg, endpoint=proc.endpoint) as pipe:
            pipe.push([damacy.Sample(uri, np.s_[r : r + 8, c : c + 16]) for r, c in boxes])
            with pipe.pop() as first:
                assert first.info.errors == () and len(first.info.samples) == 4
                chunk = tmp_path / "a.zarr" / "c"
                truncated, deleted = chunk / "2" / "1", chunk / "3" / "2"  # boxes 9 and 14, not read yet
                truncated.write_bytes(truncated.read_bytes()[:5])
                deleted.unlink()
            seen = {}
            for batch in pipe:
                with batch:
                    got = batch.copy()  # (a zero-copy array kept past the batch would hold the one slot)
                    errors = dict(batch.info.errors)
                    for k, s in enumerate(batch.info.samples):
                        seen[(s.selection[0].start, s.selection[1].start)] = (got[k], errors.get(k))
        assert len(seen) == 12  # every later sample delivered
        for (r, c), (values, err) in seen.items():
            if (r, c) == (16, 16):
                assert isinstance(err, damacy.DecodeError) and "chunk [2, 1]" in str(err), err
            elif (r, c) == (24, 32):  # a missing chunk reads as the fill value (Zarr's rule)
                assert err is None and np.all(values == 3)
            else:
                assert err is None and np.array_equal(values, data[r : r + 8, c : c + 16])
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()[-3000:]
