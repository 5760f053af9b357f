"""GPU sessions of damacyd: slots shared over CUDA IPC, across real processes.

The device is the stand-in (``DAMACY_DEVICE_STANDIN``, set for the daemon and the client):
slot memory is shared memory, kernels are the host twin, and the interprocess events are
names whose records and waits both processes append to one log. The tests read that log
to check the protocol's order: the client's consumer streams wait for a slot's ``ready``
event, the client records the slot's ``free`` event (after its consumers' fences) before
the daemon hears of the release, and the daemon waits for ``free`` before it writes the slot
again; and what happens to the slots when either side dies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from test_device_batches import Consumer

import damacy
from damacy_runtime.devices import STANDIN_ENV

from daemon_helpers import DaemonProcess, wait_for

zarr = pytest.importorskip("zarr")


@pytest.fixture
def volume(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    path = str(root / "v.zarr")
    arr = zarr.create_array(path, shape=(32, 32), chunks=(8, 8), dtype="uint16", compressors=zarr.codecs.ZstdCodec())
    data = np.arange(32 * 32, dtype=np.uint16).reshape(32, 32)
    arr[:] = data
    return root, path, data


@pytest.fixture
def standin(tmp_path, monkeypatch):
    log = tmp_path / "standin.log"
    monkeypatch.setenv(STANDIN_ENV, str(log))  # this process (the client) and the daemon it starts
    return log


@pytest.fixture
def daemon(tmp_path, volume, standin):
    proc = DaemonProcess(tmp_path, [volume[0]], ["--gpu-memory", "256M"])
    yield proc
    assert proc.stop() == 0, proc.log_path.read_text()


def entries(log) -> list[tuple[str, str, str, str]]:
    return [tuple(line.split()) for line in log.read_text().splitlines()] if log.exists() else []


def boxes(path, starts):
    return [damacy.Sample(path, ((y, y + 4), (x, x + 4))) for y, x in starts]


def cfg(**kw):
    return damacy.Config(samples_per_batch=2, sample_shape=(4, 4), dtype="float32", device=0, pop_timeout_s=60, **kw)


def test_a_gpu_session_orders_every_use_of_a_shared_slot(daemon, volume, standin):
    _, path, data = volume
    starts = [(4 * k, 4 * k) for k in range(6)]
    with damacy.Pipeline(cfg(prepared_batches=1), endpoint=daemon.endpoint) as pipe:
        pipe.push(boxes(path, starts))
        got = []
        for k in range(3):
            batch = pipe.pop()
            assert batch.info.device == "cuda:0" and batch.on_device and batch.__dlpack_device__() == (2, 0)
            got.append(batch.copy())
            consumer = Consumer(batch, stream=40 + k)  # torch on stream 40 + k
            batch.release()  # the tensor keeps the slot
            consumer.drop()  # the consumer's fence, the slot's free event, then the Release
            wait_for(  # the Release goes from the I/O thread; closing the pipeline skips it
                lambda k=k: sum(e[:2] == ("client", "record") and e[2].endswith(".free") for e in entries(standin)) == k + 1,
                what=f"the release of batch {k}",
            )
        want = [np.stack([data[y : y + 4, x : x + 4] for y, x in starts[2 * k : 2 * k + 2]]).astype(np.float32) for k in range(3)]
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    log = entries(standin)
    slot = next(e[2] for e in log if e[:2] == ("daemon", "record"))[: -len(".ready")]
    ready, free = f"{slot}.ready", f"{slot}.free"
    # per batch, in this order: the daemon waits for the slot's free event, writes, records
    # ready; the client's consumer stream waits for ready; its fence is recorded on that
    # stream; the release stream waits for the fence and records free
    steps = [e for e in log if e[0] == "daemon" or e[2] in (ready, free) or e[2].startswith("local-")]
    for k in range(3):
        i = steps.index(("daemon", "wait", free, "-"))
        steps = steps[i:]
        write = next(j for j, e in enumerate(steps) if e[:2] == ("daemon", "write"))
        done = steps.index(("daemon", "record", ready, "-"))
        assert 0 < write < done
        rest = steps[done:]
        waited = rest.index(("client", "wait", ready, str(40 + k)))
        fence = next(e for e in rest if e[:2] == ("client", "record") and e[2].startswith("local-"))
        assert fence[3] == str(40 + k)
        released = rest.index(("client", "record", free, "-"))
        assert waited < rest.index(fence) < rest.index(("client", "wait", fence[2], "-")) < released
        steps = rest[released:]


def test_a_gpu_session_without_index_storage_refuses_index_queries_at_push(daemon, volume, standin):
    """A GPU Config with ``max_index_bytes=0`` takes no index queries, through damacyd as
    embedded: refused at push (BudgetExceeded, naming the setting), the session goes on."""
    _, path, data = volume
    with damacy.Pipeline(cfg(max_index_bytes=0), endpoint=daemon.endpoint) as pipe:
        with pytest.raises(damacy.BudgetExceeded, match="Config.max_index_bytes=0"):
            pipe.push([damacy.IndexQuery(path, ([0, 2, 4, 6], slice(0, 4)))])
        pipe.push(boxes(path, [(0, 0), (4, 4)]))
        with pipe.pop() as batch:
            got = batch.copy()
    np.testing.assert_array_equal(got, np.stack([data[0:4, 0:4], data[4:8, 4:8]]).astype(np.float32))


def test_slots_are_freed_only_once_the_client_no_longer_maps_them(daemon, volume, standin):
    """Freeing device memory another process maps is undefined in CUDA: a client that closes
    with nothing held unmaps first and says so; one whose tensors still read a slot keeps
    its mappings, and the daemon keeps the slots (until the process is gone)."""
    _, path, _ = volume

    def frees():
        return [e[2] for e in entries(standin) if e[:2] == ("daemon", "free")]

    with damacy.Pipeline(cfg(prepared_batches=1), endpoint=daemon.endpoint) as pipe:
        pipe.push(boxes(path, [(0, 0), (4, 4)]))
        pipe.pop().release()
        wait_for(lambda: any(e[:2] == ("client", "record") and e[2].endswith(".free") for e in entries(standin)), what="the release")
    wait_for(frees, what="the closed session's slots to be freed")
    log = entries(standin)
    (name,) = frees()
    assert log.index(("client", "unmap", name, "-")) < log.index(("daemon", "free", name, "-"))

    with damacy.Pipeline(cfg(prepared_batches=1), endpoint=daemon.endpoint) as watcher:  # a second session
        held = damacy.Pipeline(cfg(prepared_batches=1), endpoint=daemon.endpoint)
        held.push(boxes(path, [(0, 0), (4, 4)]))
        batch = held.pop()
        consumer = Consumer(batch, stream=5)  # a tensor still reads the slot
        batch.release()
        held.close()
        wait_for(lambda: len(watcher.stats_dict()["sessions"]) == 1, what="the closed session to end")
        assert len(frees()) == 1  # not freed: this process still maps it
        consumer.drop()


def test_a_gpu_session_on_a_gpu_the_daemon_does_not_see_is_refused(daemon, monkeypatch):
    from damacy_client import client

    monkeypatch.setattr(client, "device_uuid", lambda device: "GPU-12345678-0000-0000-0000-000000000000")
    with pytest.raises(damacy.InvalidArgument, match="no CUDA device GPU-12345678"):
        damacy.Pipeline(cfg(), endpoint=daemon.endpoint)


CLIENT = r"""
import sys, time
import damacy
cfg = damacy.Config(samples_per_batch=2, sample_shape=(4, 4), dtype="float32", device=0, prepared_batches=2, pop_timeout_s=60)
pipe = damacy.Pipeline(cfg, endpoint=sys.argv[1])
pipe.push([damacy.Sample(sys.argv[2], ((0, 4), (0, 4)))] * 8)
held = [pipe.pop(), pipe.pop()]
print("holding", flush=True)
time.sleep(600)
"""


def daemon_log(daemon):
    return daemon.folder / "standin.log"


def test_a_dead_clients_gpu_slots_are_reclaimed_and_others_carry_on(daemon, volume):
    _, path, data = volume
    child = subprocess.Popen([sys.executable, "-c", CLIENT, daemon.endpoint, path], stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert child.stdout.readline().strip() == "holding"
        with damacy.Pipeline(cfg(prepared_batches=1), endpoint=daemon.endpoint) as pipe:
            assert len(pipe.stats_dict()["sessions"]) == 2
            child.send_signal(signal.SIGKILL)
            child.wait(30)
            wait_for(lambda: len(pipe.stats_dict()["sessions"]) == 1, what="the dead client's session to end")
            pipe.push(boxes(path, [(8, 8), (12, 12)]))
            with pipe.pop() as batch:
                np.testing.assert_array_equal(batch.copy(), np.stack([data[8:12, 8:12], data[12:16, 12:16]]).astype(np.float32))
        text = daemon.log_path.read_text()
        assert "ended: " in text
        # the dead client's two slots were freed (its process is gone, so nothing maps them);
        # ours (closed by now) after we unmapped them
        def theirs() -> set:
            log = entries(daemon_log(daemon))
            ours = {e[2] for e in log if e[:2] == ("client", "unmap")}
            assert len(ours) == 1
            return {e[2] for e in log if e[:2] == ("daemon", "free")} - ours

        assert len(wait_for(lambda: len(theirs()) == 2 and theirs(), what="the dead client's slots to be freed")) == 2
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_the_daemon_dying_makes_a_gpu_client_raise_daemon_unavailable(tmp_path, volume, standin):
    root, path, _ = volume
    daemon = DaemonProcess(tmp_path, [root], ["--gpu-memory", "256M"], name="dies.sock")
    pipe = damacy.Pipeline(cfg(prepared_batches=1), endpoint=daemon.endpoint)
    try:
        pipe.push(boxes(path, [(0, 0), (4, 4)] * 4))
        batch = pipe.pop()
        daemon.kill()
        batch.release()
        with pytest.raises(damacy.DaemonUnavailable):
            pipe.pop(timeout=30)
    finally:
        pipe.close()


def test_the_gpu_flags_reach_each_gpus_executor(tmp_path, volume, standin):
    """--gpu-memory bounds a GPU's sessions (their slots beside one read of the largest
    chunk), --gpu-max-chunk-bytes the chunks they decode there; host sessions keep the host's."""
    root, path, data = volume
    d = DaemonProcess(tmp_path, [root], ["--gpu-memory", "1M", "--gpu-max-chunk-bytes", "64"], name="limits.sock")
    try:
        wide = damacy.Config(samples_per_batch=2, sample_shape=(256, 256), dtype="float32", device=0, prepared_batches=2)
        with pytest.raises(damacy.BudgetExceeded, match="1048576"):  # two slots of 512 KiB leave no room to read
            damacy.Pipeline(wide, endpoint=d.endpoint)
        with damacy.Pipeline(cfg(), endpoint=d.endpoint) as pipe:  # its chunks decode to 128 bytes
            pipe.push(boxes(path, [(0, 0), (4, 4)]))
            with pytest.raises(damacy.BudgetExceeded, match=r"decode to 128 bytes, more than the executor admits \(64: .*CudaLimits\.max_chunk_bytes"):
                pipe.pop()
        host = damacy.Config(samples_per_batch=2, sample_shape=(4, 4), dtype="float32", pop_timeout_s=60)
        with damacy.Pipeline(host, endpoint=d.endpoint) as pipe:
            pipe.push(boxes(path, [(0, 0), (4, 4)]))
            with pipe.pop() as b:
                np.testing.assert_array_equal(b.copy(), np.stack([data[0:4, 0:4], data[4:8, 4:8]]).astype(np.float32))
    finally:
        assert d.stop() == 0, d.log_path.read_text()


def test_a_gpu_holds_the_value_objects_gigabyte_unless_told_and_a_gpu_config_names_its_device(tmp_path, volume, standin):
    root, _, _ = volume
    d = DaemonProcess(tmp_path, [root], [], name="default.sock")
    try:
        # two slots of 520 MiB: more than CudaLimits' default budget (DEFAULT_GPU_MEMORY_BYTES)
        big = damacy.Config(samples_per_batch=1, sample_shape=(130, 1024, 1024), dtype="float32", device=0, prepared_batches=2)
        with pytest.raises(damacy.BudgetExceeded, match=str(1 << 30)):
            damacy.Pipeline(big, endpoint=d.endpoint)
        # the daemon has no CUDA context of the client's: a GPU Config names its device
        with pytest.raises(damacy.InvalidArgument, match=r"names its device \(Config\(device=k\)\)"):
            damacy.Pipeline(damacy.Config(samples_per_batch=2, sample_shape=(4, 4), max_gpu_memory_bytes=1 << 26), endpoint=d.endpoint)
    finally:
        assert d.stop() == 0, d.log_path.read_text()
