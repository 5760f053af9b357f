"""damacyd with real processes: real daemons, real client processes, real sockets and shm."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from zarr.codecs import BytesCodec, ShardingCodec, ZstdCodec

import damacy
from damacy_protocol import messages as m
from damacy_runtime.probe import ping

from conftest import random_data, write_array
from daemon_helpers import DaemonProcess, damacyd_command, shm_segments, wait_for

LE = BytesCodec(endian="little")
SHAPE = (64, 48, 40)
BOX = (8, 12, 10)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("daemon-data")
    write_array(
        root / "vol.zarr",
        random_data(SHAPE, "uint16", 11),
        chunks=(32, 24, 20),
        serializer=ShardingCodec(chunk_shape=(8, 12, 10), codecs=[LE, ZstdCodec(level=1)]),
    )
    return root


@pytest.fixture(scope="module")
def cached_daemon(tmp_path_factory, data):
    proc = DaemonProcess(tmp_path_factory.mktemp("cached"), [data], ["--chunk-cache", "64M", "--memory", "256M"])
    yield proc
    assert proc.stop() == 0, proc.log_path.read_text()


def stats(endpoint) -> dict:
    out = subprocess.run(["damacy", "stats", "--json", "--endpoint", endpoint], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)



# -- client processes (spawned, as torchrun starts ranks) ------------------------------


def _client(endpoint, uri, starts, queue):
    import numpy as np
    import zarr

    import damacy

    try:
        oracle = zarr.open_array(uri, mode="r")
        cfg = damacy.Config(samples_per_batch=3, sample_shape=BOX, dtype="f32", pop_timeout_s=60, drop_last=False)
        checked = 0
        with damacy.Pipeline(cfg, endpoint=endpoint) as pipe:
            pipe.push(damacy.Sample(uri, tuple((a, a + n) for a, n in zip(s, BOX))) for s in starts)
            for batch in pipe.batches():
                with batch:
                    x = np.from_dlpack(batch)
                    for j, sample in enumerate(batch.info.samples):
                        want = oracle[tuple(slice(a, b) for a, b in sample.aabb)].astype("f4")
                        if not np.array_equal(x[j], want):
                            queue.put(("mismatch", str(sample)))
                            return
                        checked += 1
        queue.put(("ok", checked))
    except BaseException as e:  # report everything to the test
        queue.put(("error", f"{type(e).__name__}: {e}"))


@pytest.mark.parametrize("clients", [1, 2, 4])
def test_several_client_processes_share_the_daemon(cached_daemon, data, clients):
    uri = str(data / "vol.zarr")
    rng = np.random.default_rng(clients)
    shared = [tuple(int(v) for v in rng.integers(0, 20, size=3)) for _ in range(6)]  # every client reads these
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    before = stats(cached_daemon.endpoint)["chunk_cache"]["hits"]
    procs = []
    for _ in range(clients):
        own = [tuple(int(v) for v in rng.integers(0, 30, size=3)) for _ in range(7)]
        p = ctx.Process(target=_client, args=(cached_daemon.endpoint, uri, own + shared, queue))
        p.start()
        procs.append(p)
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert all(r[0] == "ok" for r in results), results
    assert sum(r[1] for r in results) == clients * 13
    after = stats(cached_daemon.endpoint)
    if clients > 1:
        assert after["chunk_cache"]["hits"] > before  # the overlap was decoded once
    assert wait_for(lambda: not [s for s in stats(cached_daemon.endpoint)["sessions"] if not s.get("control")], what="sessions to end")


# -- liveness ----------------------------------------------------------------------------

HOLDER = """
import sys, time, numpy as np, damacy
endpoint, uri = sys.argv[1], sys.argv[2]
cfg = damacy.Config(samples_per_batch=2, sample_shape=(8, 12, 10), dtype="f32")
pipe = damacy.Pipeline(cfg, endpoint=endpoint)
pipe.push(damacy.Sample(uri, np.s_[i % 50 : i % 50 + 8, 0:12, 0:10]) for i in range(10**9))
batch = pipe.pop()
x = np.from_dlpack(batch)
print("holding", flush=True)
time.sleep(600)
"""


def test_close_wakes_the_connection_thread(daemon, data, monkeypatch):
    # the I/O thread would sleep in its poll for a minute: close must wake it, not wait it out
    monkeypatch.setattr("damacy_client.transport.POLL_MS", 60_000)
    cfg = damacy.Config(samples_per_batch=2, sample_shape=BOX, pop_timeout_s=30)
    pipe = damacy.Pipeline(cfg, endpoint=daemon.endpoint)
    pipe.push([damacy.Sample(str(data / "vol.zarr"), tuple((0, n) for n in BOX))] * 2)
    with pipe.pop():
        pass
    thread = pipe._conn._thread
    pipe.close()
    thread.join(30)  # woken by close, it ends at once; left in its poll, it would outlast this wait
    assert not thread.is_alive()


def test_the_pop_after_the_last_batch_is_drained_whenever_the_final_push_goes_out(daemon, data, monkeypatch):
    """The pop asked for ahead says whether the input is final; a final push sent between
    that answer and the pop's send would be counted by the pop and the pop still say "not
    final": the daemon would wait for more input for ever. Where the send can be overtaken,
    this lets the feeder's final push overtake it."""
    from damacy_client.transport import Connection

    real, pipes, pops = Connection.request, [], []

    def request(self, make, on_progress=None):
        probe = make(0)
        if isinstance(probe, m.Pop):
            pops.append(probe.final)
            p = pipes[0]
            if len(pops) == 3 and not probe.final and not p._cond._is_owned():
                wait_for(lambda: p._final_sent, what="the feeder's final push")
        return real(self, make, on_progress)

    monkeypatch.setattr(Connection, "request", request)
    cfg = damacy.Config(samples_per_batch=2, sample_shape=BOX, dtype="u16", lookahead_samples=2, pop_timeout_s=60)
    uri = str(data / "vol.zarr")
    with damacy.Pipeline(cfg, endpoint=daemon.endpoint) as pipe:
        pipes.append(pipe)
        pipe.push([damacy.Sample(uri, tuple((z, z + n) for z, n in zip((8 * i, 0, 0), BOX))) for i in range(4)])
        assert [len(b) for b in pipe.batches()] == [2, 2]  # then drained, not a timeout
    assert len(pops) >= 3


def test_a_request_made_as_the_connection_dies_is_answered_with_its_death(daemon):
    """The I/O thread declares the daemon dead (abandoning every call) between a request's
    check and its send: the request must not wait for an answer that cannot come."""
    from damacy_client.transport import Connection

    conn = Connection(daemon.endpoint)
    try:
        real = conn._lock

        class DiesFirst:
            died = False

            def __enter__(self):
                if not DiesFirst.died:
                    DiesFirst.died = True
                    conn._lock = real
                    conn._die("damacyd stopped answering (as the request was made)")
                return real.__enter__()

            def __exit__(self, *exc):
                return real.__exit__(*exc)

        conn._lock = DiesFirst()
        call = conn.request(lambda i: m.Ping(id=i))
        with pytest.raises(damacy.DaemonUnavailable, match="as the request was made"):
            call.wait(30, "ping")
    finally:
        conn.close(bye=False)


def test_a_session_whose_start_waited_for_memory_is_not_reclaimed_as_silent(tmp_path, monkeypatch):
    """B's slots need memory that A's stalled read holds: B's start waits longer than the
    heartbeat timeout, and B is served once it starts, not reclaimed for the wait."""
    import threading

    import zarr

    from object_servers import RangeServer

    web = tmp_path / "web"
    # 16 chunks of 2 MiB (PlanLimits' largest by default), one sample in each of A's batch:
    # its 16 stalled reads hold over 28 MiB, more than B's slot leaves beside it in 128M
    big = zarr.create_array(str(web / "big.zarr"), shape=(32 << 20,), chunks=(2 << 20,), dtype="uint8", compressors=None, fill_value=0)
    big[:] = 7
    server = RangeServer(web)
    server.stall.update(f"/big.zarr/c/{k}" for k in range(16))
    import damacy_client.client as client

    def slow_pin(mapped):  # pinning a large slot (page-locking it for a GPU) takes a while
        time.sleep(1.0)

    monkeypatch.setattr(client.pinning, "pin", slow_pin)
    (tmp_path / "d").mkdir(mode=0o700)
    d = DaemonProcess(tmp_path / "d", [tmp_path], ["--memory", "128M", "--heartbeat-timeout", "2", "--allow-prefix", server.url + "/"])
    try:
        with damacy.Pipeline(damacy.Config(samples_per_batch=16, sample_shape=(16,), dtype="u8"), endpoint=d.endpoint) as first:
            first.push([damacy.Sample(server.url + "/big.zarr", np.s_[k << 21 : (k << 21) + 16]) for k in range(16)])
            assert server.stalled.wait(60)
            wait_for(lambda: sum(1 for _, _, status in server.requests if status == 0) == 16, timeout=60, what="16 stalled reads")
            threading.Timer(4.0, server.release.set).start()  # A's read ends after B's start has waited 4 s
            cfg = damacy.Config(samples_per_batch=1, sample_shape=(100 << 20,), dtype="u8", prepared_batches=1)
            with damacy.Pipeline(cfg, endpoint=d.endpoint) as second:
                started = time.monotonic()
                # a heartbeat answered after the daemon has looked for silent sessions since B's start
                assert wait_for(lambda: second._conn._last_recv > started + 1.0 or second._conn.dead, what="a heartbeat")
                assert second._conn.dead is None and second.stats_dict()["session"]
            with first.pop() as b:
                assert (b.numpy() == 7).all()
    finally:
        server.release.set()
        assert d.stop() == 0, d.log_path.read_text()
        server.stop()
    assert "reclaiming" not in d.log_path.read_text()


def test_an_error_naming_a_string_that_is_not_utf8_reaches_the_client(daemon, tmp_path):
    """An NGFF level path "\\udcff" (valid JSON, a lone surrogate in Python): the sample's
    error names it escaped; the reply is not lost and the session goes on."""
    import zarr

    img = tmp_path / "img.zarr"
    img.mkdir()
    axes = [{"name": n, "type": "space"} for n in "yx"]
    datasets = [{"path": p, "coordinateTransformations": [{"type": "scale", "scale": [k, k]}]} for k, p in ((1, "0"), (2, "\udcff"))]
    (img / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {"ome": {"version": "0.5", "multiscales": [{"axes": axes, "datasets": datasets}]}}}))
    zarr.create_array(str(img / "0"), shape=(8, 16), dtype="u2", chunks=(8, 16), fill_value=3)
    cfg = damacy.Config(samples_per_batch=1, sample_shape=(1, 16), dtype="u16", on_error="fill", pop_timeout_s=60)
    with damacy.Pipeline(cfg, endpoint=daemon.endpoint) as pipe:
        pipe.push([damacy.Sample(str(img), np.s_[0:1, 0:16], level=1), damacy.Sample(str(img), np.s_[0:1, 0:16], level=0)])
        with pipe.pop() as b:
            (_, err), = b.info.errors
            assert isinstance(err, damacy.NotFound) and "\\udcff" in str(err)
        with pipe.pop() as b:
            assert b.info.errors == () and (b.numpy() == 3).all()


def test_killed_clients_are_reclaimed(tmp_path, data):
    proc = DaemonProcess(tmp_path, [data], ["--memory", "256M"])
    try:
        uri = str(data / "vol.zarr")
        base = stats(proc.endpoint)["memory"]["in_use_bytes"]
        for _ in range(8):
            client = subprocess.Popen([sys.executable, "-c", HOLDER, proc.endpoint, uri], stdout=subprocess.PIPE, text=True)
            assert client.stdout.readline().strip() == "holding"  # a batch is held, more are in flight
            client.kill()  # kill -9, mid-stream
            client.wait()
        wait_for(
            lambda: not [x for x in stats(proc.endpoint)["sessions"] if not x.get("control")],
            timeout=60,
            what="dead sessions to be reclaimed",
        )
        # the slots are unmapped and their bytes returned once no task writes into them
        wait_for(
            lambda: stats(proc.endpoint)["memory"]["in_use_bytes"] == base,
            timeout=60,
            what="the dead sessions' memory to return to the budget",
        )
        assert stats(proc.endpoint)["memory"]["retiring_slot_bytes"] == 0
        assert shm_segments(proc.pid) == []
        # and it still serves
        cfg = damacy.Config(samples_per_batch=2, sample_shape=BOX, pop_timeout_s=30, drop_last=False)
        with damacy.Pipeline(cfg, endpoint=proc.endpoint) as pipe:
            pipe.push([damacy.Sample(uri, np.s_[0:8, 0:12, 0:10])])
            with pipe.pop() as b:
                assert b.info.shape == (1, *BOX)
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()
    assert shm_segments(proc.pid) == []


def test_a_killed_client_not_yet_reaped_is_reclaimed(tmp_path, data):
    # its parent has not waited for it (a zombie): it maps nothing any more, so its session
    # goes at once, by its pid, not after the heartbeat timeout (long here)
    proc = DaemonProcess(tmp_path, [data], ["--heartbeat-timeout", "600"])
    try:
        client = subprocess.Popen([sys.executable, "-c", HOLDER, proc.endpoint, str(data / "vol.zarr")], stdout=subprocess.PIPE, text=True)
        try:
            assert client.stdout.readline().strip() == "holding"
            client.kill()  # not waited for: a zombie until the finally
            wait_for(
                lambda: not [x for x in stats(proc.endpoint)["sessions"] if not x.get("control")],
                timeout=60,
                what="the unreaped client's session to be reclaimed",
            )
        finally:
            client.kill()
            client.wait()
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()


def test_sigterm_while_a_session_starts_leaves_no_segment(tmp_path, data):
    # the session's slots are being made (off the loop thread) when the daemon is told to
    # stop: it stops, and not one of their segments stays in /dev/shm
    proc = DaemonProcess(tmp_path, [data], ["--memory", "2G"])
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(proc.endpoint)
    try:
        cfg = damacy.Config(samples_per_batch=16, sample_shape=(64, 256, 256), dtype="u16", prepared_batches=8)  # 8 x 32 MiB
        sock.send(m.encode(m.Hello(id=1, version=m.PROTOCOL_VERSION, pid=os.getpid(), rank=None, config=cfg.to_dict())))
        wait_for(lambda: shm_segments(proc.pid), timeout=60, what="the session's first segment")
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(60) == 0
    finally:
        sock.close(0)
        left = shm_segments(proc.pid)
        for name in left:
            os.unlink(f"/dev/shm/{name}")
        proc.stop()
    assert left == []


def test_killed_daemon_is_reported_and_replaced(tmp_path, data):
    uri = str(data / "vol.zarr")
    proc = DaemonProcess(tmp_path, [data])
    cfg = damacy.Config(samples_per_batch=2, sample_shape=BOX, pop_timeout_s=60, drop_last=False)  # (the replacement's batch is short)
    pipe = damacy.Pipeline(cfg, endpoint=proc.endpoint)
    pipe.push(damacy.Sample(uri, np.s_[i % 50 : i % 50 + 8, 0:12, 0:10]) for i in range(10**9))
    pipe.pop().release()
    dead_pid = proc.pid
    proc.kill()
    # the loss is noticed by the heartbeats: a pop that waited out its timeout would raise TimeoutError
    with pytest.raises(damacy.DaemonUnavailable, match=f"damacyd at {re.escape(proc.endpoint)} stopped answering"):
        while True:  # batches already delivered may still come; then the loss shows
            pipe.pop().release()
    pipe.close()
    # a segment left by a dead daemon (as if it died before its client mapped it)
    stale = Path("/dev/shm") / f"damacy-{dead_pid}-deadbeef0000-0"
    stale.write_bytes(b"\0" * 64)
    replacement = DaemonProcess(tmp_path, [data], ["--log-format", "json", "--log-level", "info"])  # same endpoint; the old socket file is stale
    try:
        assert not stale.exists()
        # (a daemon another test starts at the same time may remove it first, and log it)
        said = [json.loads(line) for line in replacement.log_path.read_text().splitlines() if "stale shared-memory segment" in line]
        assert all(x["event"] == "stale_segments" for x in said), said
        with damacy.Pipeline(cfg, endpoint=replacement.endpoint) as pipe2:
            pipe2.push([damacy.Sample(uri, np.s_[8:16, 0:12, 0:10])])
            with pipe2.pop() as b:
                assert len(b) == 1
    finally:
        assert replacement.stop() == 0


def test_sigterm_drains_and_exits_cleanly(tmp_path, data):
    proc = DaemonProcess(tmp_path, [data])
    sock = Path(proc.endpoint[len("ipc://") :])
    assert (sock.stat().st_mode & 0o777) == 0o600  # owner-only by default
    cfg = damacy.Config(samples_per_batch=2, sample_shape=BOX, pop_timeout_s=30)
    pipe = damacy.Pipeline(cfg, endpoint=proc.endpoint)
    pipe.push(damacy.Sample(str(data / "vol.zarr"), np.s_[i % 50 : i % 50 + 8, 0:12, 0:10]) for i in range(10**9))
    held = pipe.pop()
    assert proc.stop() == 0
    assert not sock.exists() and shm_segments(proc.pid) == []
    assert np.from_dlpack(held).shape == (2, *BOX)  # the client's mapping outlives the daemon
    held.release()
    pipe.close()


# -- security and bad input --------------------------------------------------------------


def test_paths_outside_the_allowed_roots_are_refused(tmp_path, data):
    allowed, other = tmp_path / "allowed", tmp_path / "other"
    allowed.mkdir()
    other.mkdir()
    write_array(allowed / "in.zarr", random_data((16, 12, 10), "uint16", 1), chunks=(8, 12, 10))
    write_array(other / "out.zarr", random_data((16, 12, 10), "uint16", 2), chunks=(8, 12, 10))
    (allowed / "link.zarr").symlink_to(other / "out.zarr")
    proc = DaemonProcess(tmp_path, [allowed])
    try:
        cfg = damacy.Config(samples_per_batch=1, sample_shape=BOX, on_error="fill", pop_timeout_s=30)
        box = np.s_[0:8, 0:12, 0:10]
        uris = [str(other / "out.zarr"), str(allowed / "link.zarr"), f"{allowed}/../other/out.zarr", "/etc"]
        with damacy.Pipeline(cfg, endpoint=proc.endpoint) as pipe:
            pipe.push([damacy.Sample(u, box) for u in uris] + [damacy.Sample(str(allowed / "in.zarr"), box)])
            for _ in uris:
                with pipe.pop() as b:
                    (_, err), = b.info.errors
                    assert isinstance(err, damacy.InvalidArgument) and "outside the daemon's allowed roots" in str(err), err
                    assert (b.numpy() == 0).all()  # nothing from outside was read
            with pipe.pop() as b:
                assert b.info.errors == ()
    finally:
        assert proc.stop() == 0


def test_a_daemon_without_roots_says_so(tmp_path, data):
    proc = DaemonProcess(tmp_path, [])
    try:
        cfg = damacy.Config(samples_per_batch=1, sample_shape=BOX, pop_timeout_s=30)
        with damacy.Pipeline(cfg, endpoint=proc.endpoint) as pipe:
            pipe.push([damacy.Sample(str(data / "vol.zarr"), np.s_[0:8, 0:12, 0:10])])
            with pytest.raises(damacy.InvalidArgument, match="serves no paths.*--allow-root"):
                pipe.pop()
    finally:
        assert proc.stop() == 0


def test_malformed_messages_get_an_error_and_the_daemon_goes_on(daemon):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    try:
        for payload, kind, words in [
            (b"not msgpack at all \xc1", "ProtocolError", "malformed"),
            (m.encode(m.Hello(id=3, version=m.PROTOCOL_VERSION + 7, pid=1, rank=None, config={})), "ProtocolError", "protocol version"),
            (m.encode(m.Pop(id=4)), "UnknownSession", "before hello"),
        ]:
            sock.send(payload)
            assert sock.poll(60_000), "no reply"
            reply = m.decode_daemon(sock.recv())
            assert isinstance(reply, m.Failed) and reply.error.kind == kind and words in reply.error.reason, reply
        sock.send_multipart([m.encode(m.Ping(id=9)), b"frames"])  # not even our framing: told so
        assert sock.poll(60_000), "no reply to a request of two frames"
        reply = m.decode_daemon(sock.recv())
        assert isinstance(reply, m.Failed) and reply.reply_to == 9 and "one frame, this one came in 2" in reply.error.reason
    finally:
        sock.close(0)
    assert "protocol version" in daemon.log_path.read_text()
    cfg = damacy.Config(samples_per_batch=1, sample_shape=(2, 2))
    with damacy.Pipeline(cfg, endpoint=daemon.endpoint) as pipe:  # still serving
        assert pipe.stats_dict()["daemon"]["malformed_messages"] >= 3


def test_pushes_fit_the_daemons_largest_message_and_long_lists_are_refused_unread(tmp_path, monkeypatch):
    """With --max-message-size 64K: 64 index queries of 2,000 indices (about 190 KB in all)
    go as several pushes and are all delivered; a query whose list alone exceeds a message
    fails as a bad sample saying so, and one whose list is longer than any axis of the
    batch's samples is refused before it is read; the samples around them are delivered."""
    data = random_data((64, 6000), "uint16", seed=4)
    oracle = write_array(tmp_path / "w.zarr", data, chunks=(64, 512))
    uri = str(tmp_path / "w.zarr")
    proc = DaemonProcess(tmp_path, [tmp_path], ["--max-message-size", "64K"])
    try:
        idx = list(range(0, 4000, 2))
        # (the Config's cache floors: lookahead + 2 batches arrays, times 64 shard indexes)
        cfg = damacy.Config(
            samples_per_batch=4, sample_shape=(1, 2000), dtype="u16", lookahead_samples=256, on_error="fill",
            n_array_meta_cache=264, n_chunk_layout_cache=264, n_shard_index_cache=264 * 64,
        )
        with damacy.Pipeline(cfg, endpoint=proc.endpoint) as pipe:
            pipe.push([damacy.IndexQuery(uri, ([i], idx)) for i in range(64)])
            rows = []
            for b in pipe:
                with b:
                    assert b.info.errors == ()
                    rows.append(b.numpy()[:, 0].copy())
            np.testing.assert_array_equal(np.concatenate(rows), oracle[:, idx])
            huge = damacy.IndexQuery(uri, ([0], list(range(30000)) * 2))  # about 180 KB on the wire
            long = damacy.IndexQuery(uri, ([1], list(range(2001))))
            # push refuses both first (their shapes are not the batch's): a client that does
            # not check them meets the checks behind it, the wire's and the daemon's
            import damacy_client.client

            monkeypatch.setattr(damacy_client.client, "check_pushed", lambda item, *checks: item)
            pipe.push([damacy.IndexQuery(uri, ([2], idx)), huge, long, damacy.IndexQuery(uri, ([3], idx))])
            with pipe.pop() as b:
                (i, e1), (j, e2) = b.info.errors
                assert (i, j) == (1, 2) and isinstance(e1, damacy.InvalidArgument) and isinstance(e2, damacy.InvalidArgument)
                assert "more than a message to damacyd may hold" in str(e1) and "--max-message-size" in str(e1)
                assert "an index list of 2001 indices" in str(e2)
                np.testing.assert_array_equal(b.numpy()[[0, 3], 0], oracle[[2, 3]][:, idx])
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()


def test_session_config_is_checked(daemon):
    with pytest.raises(damacy.BudgetExceeded, match="max_memory_bytes"):  # (n_shard_index_cache: the Config's floor)
        damacy.Pipeline(damacy.Config(samples_per_batch=64, sample_shape=(512, 512, 512), n_shard_index_cache=1 << 20), endpoint=daemon.endpoint)
    with pytest.raises(damacy.DaemonUnavailable, match="no damacyd answers"):
        damacy.RemotePipeline(damacy.Config(samples_per_batch=1, sample_shape=(2,)), "ipc:///nonexistent/damacy.sock", connect_timeout_s=1.0)


def test_tcp_off_loopback_needs_curve(tmp_path):
    out = subprocess.run([*damacyd_command(), "--endpoint", "tcp://0.0.0.0:47111", "--allow-root", str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "CURVE" in out.stderr


def test_tcp_with_curve_keys(tmp_path, data, monkeypatch):
    import socket

    public, secret = zmq.curve_keypair()
    key = tmp_path / "server.key"
    key.write_bytes(secret)
    with socket.socket() as s:  # a port free now (the daemon binds it next)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [*damacyd_command(), "--endpoint", f"tcp://0.0.0.0:{port}", "--allow-root", str(data), "--curve-secret-key", str(key)]
    daemon_proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        monkeypatch.setenv("DAMACY_CURVE_SERVER_KEY", public.decode())
        cfg = damacy.Config(samples_per_batch=1, sample_shape=BOX, pop_timeout_s=30)
        pipe = wait_for(lambda: _try_connect(cfg, f"tcp://127.0.0.1:{port}"), timeout=60, what="the CURVE daemon")
        with pipe:
            pipe.push([damacy.Sample(str(data / "vol.zarr"), np.s_[0:8, 0:12, 0:10])])
            with pipe.pop() as b:
                assert len(b) == 1
    finally:
        daemon_proc.send_signal(signal.SIGTERM)
        daemon_proc.wait(60)


def _try_connect(cfg, endpoint):
    try:
        return damacy.RemotePipeline(cfg, endpoint, connect_timeout_s=10.0)
    except damacy.DaemonUnavailable:
        return None


# -- the damacy CLI ----------------------------------------------------------------------


def test_cli_ping_warm_stats(cached_daemon, data):
    env = {**os.environ, "DAMACY_ENDPOINT": cached_daemon.endpoint}
    out = subprocess.run(["damacy", "ping", "--timeout", "30"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and "answered" in out.stdout
    out = subprocess.run(["damacy", "warm", str(data / "vol.zarr"), "--shard-indexes", "--chunks"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "warmed 1 array(s)" in out.stdout and "128 chunk(s)" in out.stdout  # 8 x 4 x 4 inner chunks
    s = stats(cached_daemon.endpoint)
    assert s["chunk_cache"]["entries"] == 128
    out = subprocess.run(["damacy", "stats"], capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 0 and "cache chunks" in out.stdout and "decode" in out.stdout
    out = subprocess.run(["damacy", "warm", "/etc/passwd"], capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 1 and "outside" in out.stderr
    # a relative path is this process's: the daemon's working folder is another
    out = subprocess.run(["damacy", "warm", "vol.zarr"], capture_output=True, text=True, env=env, timeout=60, cwd=data)
    assert out.returncode == 0 and "warmed 1 array(s)" in out.stdout, out.stderr
    out = subprocess.run(["damacy", "ping", "--endpoint", "ipc:///nonexistent.sock", "--timeout", "30"], capture_output=True, text=True, timeout=60)
    # no socket file: said at once (not after the 30 s timeout), with how to start one
    assert out.returncode == 1 and "the socket file does not exist" in out.stderr and "damacyd --allow-root" in out.stderr


def test_a_daemon_client_loads_no_engine_and_no_codec(daemon, data):
    code = f"""
import sys, numpy as np, damacy
cfg = damacy.Config(samples_per_batch=1, sample_shape={BOX!r}, dtype="u16", pop_timeout_s=60)
with damacy.Pipeline(cfg, endpoint={daemon.endpoint!r}) as pipe:
    pipe.push([damacy.Sample({str(data / "vol.zarr")!r}, np.s_[0:8, 0:12, 0:10])])
    with pipe.pop() as b:
        assert b.info.errors == () and np.from_dlpack(b).shape == (1, *{BOX!r})
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("damacy_server", "numcodecs", "zstandard", "zarr"))
print(loaded)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.node_daemon
def test_pipeline_finds_the_node_daemon_whatever_the_environment(tmp_path, data, monkeypatch):
    import damacy_client.client
    import damacy_server.pipeline
    from damacy_runtime.endpoint import check_private_folder, node_endpoint

    endpoint = node_endpoint()
    if ping(endpoint, 0.5):
        pytest.skip(f"a damacyd of this user already serves {endpoint}")
    env = {k: v for k, v in os.environ.items() if k not in ("DAMACY_ENDPOINT", "XDG_RUNTIME_DIR")}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)  # the daemon's environment differs from the clients'
    proc = subprocess.Popen([*damacyd_command(), "--allow-root", str(data)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert wait_for(lambda: ping(endpoint, 0.2) or proc.poll() is not None, what="damacyd to answer") and proc.poll() is None
        check_private_folder(os.path.dirname(endpoint[len("ipc://") :]))
        cfg = damacy.Config(samples_per_batch=1, sample_shape=(4, 4, 4), pop_timeout_s=30)
        for xdg in (None, str(tmp_path / "elsewhere")):
            monkeypatch.delenv("DAMACY_ENDPOINT", raising=False)
            if xdg is None:
                monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
            else:
                monkeypatch.setenv("XDG_RUNTIME_DIR", xdg)
            with damacy.Pipeline(cfg) as p:
                assert isinstance(p, damacy_client.client.RemotePipeline) and p.endpoint == endpoint
                p.push([damacy.Sample(str(data / "vol.zarr"), ((0, 4), (0, 4), (0, 4)))])
                with p.pop() as b:
                    assert np.array_equal(b.numpy()[0], damacy.read(data / "vol.zarr", np.s_[0:4, 0:4, 0:4], dtype="f32"))
        with damacy.Pipeline(cfg, embedded=True) as p:
            assert isinstance(p, damacy_server.pipeline.Pipeline)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    cfg = damacy.Config(samples_per_batch=1, sample_shape=(4, 4, 4))
    with damacy.Pipeline(cfg) as p:  # none answers now: embedded
        assert isinstance(p, damacy_server.pipeline.Pipeline)
    with pytest.raises(damacy.DaemonUnavailable, match="no damacyd answers"):
        damacy.Pipeline(cfg, embedded=False)


def test_a_socket_folder_others_may_write_is_not_trusted(tmp_path):
    from damacy_runtime.endpoint import check_private_folder

    folder = tmp_path / "sock"
    folder.mkdir(mode=0o700)
    check_private_folder(str(folder))
    folder.chmod(0o777)
    with pytest.raises(damacy.InvalidArgument, match="not a private folder"):
        check_private_folder(str(folder))


def test_stats_watch_shows_rates_since_the_last_refresh(cached_daemon):
    import copy

    from damacy.cli import render

    before = stats(cached_daemon.endpoint)
    after = copy.deepcopy(before)
    name = next(iter(after["stages"]))
    after["stages"][name]["count"] += 10
    after["stages"][name]["seconds"] += 1.0
    after["stages"][name]["bytes_out"] += 4 << 20
    text = render(after, before, 2.0)
    row = next(line for line in text.splitlines() if line.startswith(name))
    assert "count/s" in text and "busy" in text
    assert " 5.0 " in row and "2.0 MiB/s" in row and row.endswith(" 0.50")  # 10 in 2 s, 4 MiB in 2 s, half a thread busy
    assert "count/s" not in render(after)  # a single snapshot: totals only
    with_disk = copy.deepcopy(after)
    with_disk["disk_cache"] = {"entries": 3, "bytes": 3 << 20, "hits": 3, "misses": 1, "writes": 4, "evictions": 1, "refused": 0}
    assert "cache disk: 3 entries (3.0 MiB), hit rate 75.0% (3 hits, 1 misses), 4 written, 1 evicted, 0 refused" in render(with_disk)
    slow = copy.deepcopy(before)
    slow["stages"][name]["bytes_out"] += 1000
    row = next(line for line in render(slow, before, 3.0).splitlines() if line.startswith(name))
    assert "333 B/s" in row and "333.3" not in row  # under a KiB a second: whole bytes, as the columns expect
    after["daemon"].update(batches=40, loop_cpu_s=0.1, messages=100, replies=60)
    assert "loop: 2.500 ms of the loop's CPU per batch delivered, 4.0 messages per batch (40 batches)" in render(after)


def test_warm_says_when_the_chunk_cache_kept_less_than_it_warmed(tmp_path_factory, data):
    small = DaemonProcess(tmp_path_factory.mktemp("small-cache"), [data], ["--chunk-cache", "64K"])
    try:
        env = {**os.environ, "DAMACY_ENDPOINT": small.endpoint}
        out = subprocess.run(["damacy", "warm", str(data / "vol.zarr"), "--chunks"], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        held = stats(small.endpoint)["chunk_cache"]["entries"]
        assert 0 < held < 128 and f"the chunk cache holds {held} chunk(s) now" in out.stderr
        assert f"{held} of the arrays' 128 written chunks were cached" in out.stderr and "larger --chunk-cache" in out.stderr
    finally:
        assert small.stop() == 0, small.log_path.read_text()


def test_warm_of_a_sparse_array_that_fits_says_nothing_of_room(cached_daemon, data):
    """Chunks never written read as the fill value: there is nothing of them to keep, and a
    cache that took every written chunk has not run out of room."""
    values = random_data((16, 24, 20), "uint16", 12)
    arr = write_array(data / "sparse.zarr", values, chunks=(8, 12, 10), compressors=[ZstdCodec(level=1)], write=False)
    arr[0:8, 0:12, 0:10] = values[0:8, 0:12, 0:10]  # one chunk of 8 written
    env = {**os.environ, "DAMACY_ENDPOINT": cached_daemon.endpoint}
    out = subprocess.run(["damacy", "warm", str(data / "sparse.zarr"), "--chunks"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "1 chunk(s)" in out.stdout and "did not fit" not in out.stderr


def test_warm_goes_on_past_a_corrupt_chunk_and_names_it(tmp_path_factory, data):
    values = random_data((16, 24, 20), "uint16", 13)
    write_array(data / "one-bad.zarr", values, chunks=(8, 12, 10), compressors=[ZstdCodec(level=1)])
    (data / "one-bad.zarr" / "c" / "0" / "0" / "0").write_bytes(b"\x28\xb5\x2f\xfd" + b"\x00" * 20)  # the first chunk
    d = DaemonProcess(tmp_path_factory.mktemp("warm-bad"), [data], ["--chunk-cache", "64M"])
    try:
        env = {**os.environ, "DAMACY_ENDPOINT": d.endpoint}
        out = subprocess.run(["damacy", "warm", str(data / "one-bad.zarr"), "--chunks"], capture_output=True, text=True, env=env, timeout=60)
        assert "7 chunk(s)" in out.stdout, (out.stdout, out.stderr)  # the other 7 of 8 are warmed
        assert "c/0/0/0" in out.stderr and stats(d.endpoint)["chunk_cache"]["entries"] == 7
    finally:
        assert d.stop() == 0, d.log_path.read_text()


def test_json_logs_name_events_and_say_a_refused_path_once(tmp_path_factory, data):
    d = DaemonProcess(tmp_path_factory.mktemp("json-logs"), [data], ["--log-format", "json", "--log-level", "info"])
    try:
        cfg = damacy.Config(samples_per_batch=2, sample_shape=BOX, dtype="u16", on_error="fill")
        with damacy.Pipeline(cfg, endpoint=d.endpoint) as pipe:
            pipe.push([damacy.Sample("/etc/passwd", tuple((0, n) for n in BOX)), damacy.Sample("/etc/group", tuple((0, n) for n in BOX))])
            with pipe.pop() as batch:
                assert len(batch.info.errors) == 2
    finally:
        assert d.stop() == 0, d.log_path.read_text()
    lines = [json.loads(line) for line in d.log_path.read_text().splitlines() if line.strip()]
    events = [x["event"] for x in lines]
    assert all({"time", "level", "event", "message", "pid"} <= set(x) for x in lines)
    before = events[: events.index("start")]  # shared memory a killed daemon of another test left is removed first
    assert set(before) <= {"stale_segments"} and "session_start" in events and "session_end" in events and events[-1] == "stop"
    refused = [x for x in lines if x["event"] == "refused_path"]
    assert len(refused) == 1 and refused[0]["uri"] == "/etc/passwd" and refused[0]["error"] == "InvalidArgument"
    start = next(x for x in lines if x["event"] == "session_start")
    assert start["client_pid"] == os.getpid() and start["session"]


def test_json_logs_name_slow_batches_and_reclaimed_clients(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("json-events")
    d = DaemonProcess(folder, [data], ["--log-format", "json", "--log-level", "info", "--slow-batch-s", "0.000001"])
    client = None
    try:
        cfg = damacy.Config(samples_per_batch=2, sample_shape=BOX, dtype="u16")
        box = tuple((0, n) for n in BOX)
        with damacy.Pipeline(cfg, endpoint=d.endpoint) as pipe:
            pipe.push([damacy.Sample(str(data / "vol.zarr"), box)] * 2)
            with pipe.pop():
                pass
        code = (
            "import damacy, sys, time\n"
            f"p = damacy.Pipeline(damacy.Config(samples_per_batch=1, sample_shape=(2, 2)), endpoint={d.endpoint!r})\n"
            "print('ready', flush=True)\n"
            "time.sleep(600)\n"
        )
        client = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert client.stdout.readline().strip() == "ready"
        client.kill()  # SIGKILL: no goodbye
        client.wait()

        def events():
            return [json.loads(line) for line in d.log_path.read_text().splitlines() if line.strip()]

        reclaimed = wait_for(lambda: [x for x in events() if x["event"] == "reclaimed"], what="the reclaimed event")
        assert reclaimed[0]["client_pid"] == client.pid and "gone" in reclaimed[0]["message"]
        slow = [x for x in events() if x["event"] == "slow_batch"]
        assert slow and slow[0]["batch"] == 0 and slow[0]["seconds"] >= 0 and slow[0]["client_pid"] == os.getpid()
    finally:
        if client is not None and client.poll() is None:
            client.kill()
        assert d.stop() == 0, d.log_path.read_text()


@pytest.mark.node_daemon
def test_a_busy_node_daemon_is_still_found_and_a_dead_socket_passed_over_at_once(monkeypatch):
    # the node's socket in a folder of this test's own (a short path: unix sockets take 107 bytes)
    import socket
    import tempfile
    import threading

    from damacy import pipeline
    from damacy_runtime import endpoint as endpoints
    from damacy_runtime import probe

    with tempfile.TemporaryDirectory(prefix="dmc") as folder:
        path = os.path.join(folder, "damacyd.sock")
        monkeypatch.setattr(endpoints, "node_endpoint", lambda: f"ipc://{path}")
        pings = []
        real_ping = probe.ping
        monkeypatch.setattr(probe, "ping", lambda *a, **k: pings.append(a) or real_ping(*a, **k))
        # a socket file whose daemon is gone: nobody listens, nothing is pinged
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
            dead.bind(path)
        assert os.path.exists(path) and pipeline._node_daemon() is None and pings == []
        os.unlink(path)
        # a daemon that answers only after a second (busy serving ranks): found
        router = zmq.Context.instance().socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(f"ipc://{path}")
        # set before the answer goes out: the client can take the pong before this thread runs on
        answering = threading.Event()

        def answer_late():
            if router.poll(30_000):
                peer, *_ = router.recv_multipart()
                time.sleep(1.0)  # the daemon's delay, not a wait for a condition
                answering.set()
                router.send_multipart([peer, b"pong"])

        t = threading.Thread(target=answer_late, daemon=True)
        t.start()
        try:
            assert pipeline._node_daemon() == f"ipc://{path}" and len(pings) == 1
            assert answering.is_set()  # found by the late answer, not by anything before it
        finally:
            t.join(30)
            router.close(0)


def test_flag_values_that_would_leave_the_daemon_open_or_useless_are_usage_errors(tmp_path):
    import socket

    base = [*damacyd_command(), "--endpoint", f"ipc://{tmp_path}/x.sock", "--allow-root", str(tmp_path)]
    for extra, words in [
        (["--socket-mode", "-1"], "from 000 to 777"),  # became 07777: anyone, setuid, sticky
        (["--socket-mode", "7777"], "from 000 to 777"),
        (["--heartbeat-timeout", "0"], "heartbeat-timeout"),  # every session reclaimed at once
        (["--heartbeat-timeout", "nan"], "not a finite number"),  # a silent session never reclaimed
        (["--max-message-size", "9000000T"], "at most 2**63 - 1"),  # a traceback (int64 overflow)
        (["--memory", "0"], "--memory"),  # said as CpuLimits.max_memory_bytes
        (["--chunk-cache-dir-bytes", "0"], "--chunk-cache-dir-bytes"),
        (["--max-message-size", "0"], "max-message-size"),  # every request dropped
    ]:
        run = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and words in run.stderr and "Traceback" not in run.stderr, (extra, run.stderr)
    with socket.socket() as taken:  # a port in use: said so, a usage error, no traceback
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(
            [*damacyd_command(), "--endpoint", f"tcp://127.0.0.1:{port}", "--allow-root", str(tmp_path)], capture_output=True, text=True, timeout=60
        )
    assert run.returncode == 2 and "cannot start on" in run.stderr and "Traceback" not in run.stderr, run.stderr
    # a port past 65535: zmq would wrap it (70000 listens on 4464)
    run = subprocess.run([*damacyd_command(), "--endpoint", "tcp://127.0.0.1:70000", "--allow-root", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "the port must be 0 to 65535" in run.stderr, run.stderr


def test_the_cli_refuses_timeouts_that_would_hang_and_names_what_refused_it(tmp_path):
    from test_demo import damacy_command

    run = subprocess.run([*damacy_command(), "ping", "--endpoint", "tcp://127.0.0.1:1", "--timeout", "-1"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--timeout" in run.stderr  # poll(-1000) waited for ever
    run = subprocess.run([*damacy_command(), "stats", "--watch", "--interval", "-1"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--interval" in run.stderr
    for args in (["ping", "--endpoint", "tcp://127.0.0.1:1", "--timeout", "nan"], ["stats", "--watch", "--interval", "nan"]):
        run = subprocess.run([*damacy_command(), *args], capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and "not a finite number" in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_a_warm_stops_at_its_next_step_once_its_session_ends(monkeypatch):
    # a client interrupted mid-warm (Ctrl-C) ends its session: the daemon's warm thread kept
    # filling the cache for it; it now stops, and answers nobody
    import threading
    from types import SimpleNamespace

    from damacy_server.daemon import warm as warming

    steps: list[int] = []
    replies: list = []
    session = SimpleNamespace(closed=False, sid="s1", reply=replies.append, opened=0.0)

    def long_warm(daemon, uris, shard_indexes, chunks, progress, since=None):
        for k in range(10_000):
            steps.append(k)
            progress(k, 10_000, "chunks")
            if k == 3:
                session.closed = True  # the client said bye
        return {"arrays": 1, "shard_indexes": 0, "chunks": 10_000, "errors": []}

    monkeypatch.setattr(warming, "warm", long_warm)
    warming.start_warm(None, session, m.Warm(id=1, uris=["/x"], chunks=True))
    wait_for(lambda: not any(t.name == "damacyd-warm-s1" for t in threading.enumerate()), what="the warm thread to end")
    assert steps == [0, 1, 2, 3, 4] and not any(isinstance(r, m.WarmDone) for r in replies)


def test_a_bad_storage_option_is_refused_at_start(tmp_path):
    # it was taken, and every request under its prefix failed later
    base = [*damacyd_command(), "--endpoint", f"ipc://{tmp_path}/x.sock", "--allow-root", str(tmp_path)]
    for option, words in [("no_such_option=1", "no_such_option"), ("max_retries=abc", "'abc'")]:
        run = subprocess.run([*base, "--storage-option", "s3://bkt", option], capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and words in run.stderr and "Traceback" not in run.stderr, run.stderr


# -- the limits: the value objects' fields, one flag each ----------------------------------

#: (arguments, the flag named, the field its value object's check names)
BAD_LIMITS = [
    (["--array-entries", "0"], "--array-entries", "array_entries"),
    (["--shard-index-entries", "-1"], "--shard-index-entries", "shard_index_entries"),
    (["--shard-index-bytes", "0"], "--shard-index-bytes", "shard_index_bytes"),
    (["--metadata-concurrency", "5000"], "--metadata-concurrency", "concurrency"),
    (["--max-chunks", "16385"], "--max-chunks", "max_chunks"),
    (["--max-chunk-bytes", "4G"], "--max-chunk-bytes", "max_chunk_bytes"),
    (["--max-shards-per-sample", "0"], "--max-shards-per-sample", "max_shards_per_sample"),
    (["--max-plan-bytes", "0"], "--max-plan-bytes", "max_plan_bytes"),
    (["--io-workers", "0"], "--io-workers", "workers"),
    (["--io-workers", "1025"], "--io-workers", "workers"),
    (["--max-inflight-reads", "0"], "--max-inflight-reads", "max_inflight_reads"),
    (["--memory", "0"], "--memory", "max_memory_bytes"),
    (["--decode-workers", "0"], "--decode-workers", "decode_workers"),
    (["--max-encoded-chunk-bytes", "0"], "--max-encoded-chunk-bytes", "max_encoded_chunk_bytes"),
    (["--max-decoded-chunk-bytes", "4G"], "--max-decoded-chunk-bytes", "max_decoded_chunk_bytes"),
    (["--chunks-per-input-buffer", "16385"], "--chunks-per-input-buffer", "chunks_per_input_buffer"),
    (["--chunks-per-input-buffer", "4", "--decode-workers", "8"], "--chunks-per-input-buffer", "decode_workers"),
    (["--max-inflight-requests", "0"], "--max-inflight-requests", "max_inflight_requests"),
    (["--chunk-cache-dir-bytes", "0"], "--chunk-cache-dir-bytes", "chunk_cache_dir_bytes"),
    (["--gpu-memory", "0"], "--gpu-memory", "max_gpu_memory_bytes"),
    (["--max-index-bytes", "64G"], "--max-index-bytes", "max_index_bytes"),
    (["--chunk-layout-entries", "0"], "--chunk-layout-entries", "chunk_layout_entries"),
    (["--gpu-max-chunk-bytes", "0"], "--gpu-max-chunk-bytes", "max_chunk_bytes"),
    (["--gpu-max-read-bytes", "0"], "--gpu-max-read-bytes", "max_read_bytes"),
    (["--host-buffer-waves", "1"], "--host-buffer-waves", "host_buffer_waves"),
    (["--host-buffer-waves", "9"], "--host-buffer-waves", "host_buffer_waves"),
    (["--max-chunks-per-wave", "65536"], "--max-chunks-per-wave", "max_chunks_per_wave"),
    (["--max-substreams-per-chunk", "0"], "--max-substreams-per-chunk", "max_substreams_per_chunk"),
]


@pytest.mark.parametrize("args,flag,field", BAD_LIMITS, ids=[" ".join(a) for a, _, _ in BAD_LIMITS])
def test_a_limit_its_value_object_refuses_is_a_usage_error_naming_the_flag(args, flag, field):
    from click.testing import CliRunner

    from damacy_server.daemon.cli import main

    result = CliRunner().invoke(main, ["--endpoint", "ipc:///nonexistent/damacyd.sock", *args])
    assert result.exit_code == 2, result.output
    assert f"'{flag}'" in result.output and field in result.output and "Traceback" not in result.output, result.output


def test_a_bad_limit_stops_the_real_damacyd_before_it_serves(tmp_path):
    base = [*damacyd_command(), "--endpoint", f"ipc://{tmp_path}/x.sock", "--allow-root", str(tmp_path)]
    for extra, words in [
        (["--max-chunks", "0"], "Invalid value for '--max-chunks': PlanLimits: max_chunks must be in [1, 16384]"),
        (["--array-entries", "0"], "Invalid value for '--array-entries': MetadataCache: array_entries must be in"),
        (["--host-buffer-waves", "1"], "'--host-buffer-waves': CudaLimits: host_buffer_waves must be at least 2"),
        (["--io-workers", "-3"], "'--io-workers': FileReader: workers must be in [1, 1024]"),
    ]:
        run = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and words in run.stderr and "Traceback" not in run.stderr, (extra, run.stderr)
    assert not (tmp_path / "x.sock").exists()


def test_every_limit_of_the_daemon_has_a_flag_named_after_its_field():
    import dataclasses

    from damacy_server.daemon.cli import main
    from damacy_server.daemon.options import FLAGS, PARTS

    flags = {opt for p in main.params for opt in p.opts}
    for part, tp in PARTS.items():
        names = [f.name for f in dataclasses.fields(tp)] if dataclasses.is_dataclass(tp) else list(tp.__slots__)
        for name in names:
            if (part, name) == ("metadata_reader", "latency"):
                continue  # synthetic latency for benchmarks: no limit
            flag = FLAGS[(part, name)]
            assert flag in flags, flag
            # named after the field, but where two objects share a name (the GPU's), a
            # switch turning a default off, and the flags that keep their documented names
            assert flag in ("--memory", "--chunk-cache", "--gpu-memory", "--io-workers", "--metadata-concurrency") or (
                flag.lstrip("-").removeprefix("no-").removeprefix("gpu-").replace("-", "_") == name
            ), (flag, name)


def test_the_daemons_defaults_are_the_value_objects_but_where_options_says():
    from damacy_protocol import limits as L
    from damacy_server.daemon.cli import build_options, main
    from damacy_server.daemon.options import DAEMON_MAX_MEMORY_BYTES, DAEMON_METADATA_CACHE

    o = build_options(main.make_context("damacyd", ["--endpoint", "ipc:///nonexistent/damacyd.sock"]).params)
    assert o.plan_limits == L.PlanLimits()
    decode, io = L.host_threads()  # the node's, not one pipeline's share
    cpus = os.cpu_count() or 1
    assert (decode, io) == (cpus + 1, max(L.DEFAULT_IO_WORKERS, cpus))
    assert o.cpu_limits == L.CpuLimits(
        max_memory_bytes=DAEMON_MAX_MEMORY_BYTES, decode_workers=decode, chunks_per_input_buffer=max(256, decode)
    )
    assert DAEMON_MAX_MEMORY_BYTES == 8 << 30
    assert o.cuda_limits == L.CudaLimits(L.DEFAULT_GPU_MEMORY_BYTES) and o.cuda_limits.max_gpu_memory_bytes == 1 << 30
    assert o.metadata_cache == DAEMON_METADATA_CACHE == L.MetadataCache(1024, 65536, 1 << 30)
    assert (o.reader.workers, o.reader.max_inflight_reads, o.reader.readahead) == (io, 4096, True)
    assert o.metadata_reader.concurrency == L.DEFAULT_METADATA_CONCURRENCY
    # the same as DaemonOptions made in Python; one flag raises a chunk's size everywhere
    from damacy_server.daemon.options import DaemonOptions

    assert DaemonOptions(endpoint="x").cpu_limits == o.cpu_limits
    big = build_options(main.make_context("damacyd", ["--endpoint", "ipc:///x.sock", "--max-chunk-bytes", "8M", "--decode-workers", "300"]).params)
    assert big.plan_limits.max_chunk_bytes == big.cpu_limits.max_decoded_chunk_bytes == big.cuda_limits.max_chunk_bytes == 8 << 20
    assert big.cpu_limits.chunks_per_input_buffer == 300  # at least one chunk per decode worker
    assert big.cpu_limits.max_encoded_chunk_bytes == 16 << 20  # stored chunks of that size read too
    assert o.cpu_limits.max_encoded_chunk_bytes == 4 << 20


def test_every_flag_reaches_the_daemons_planner_readers_and_executors(tmp_path, monkeypatch):
    from damacy_protocol import limits as L
    from damacy_runtime.devices import STANDIN_ENV, STANDIN_UUID
    from damacy_server.daemon.cli import build_options, main
    from damacy_server.daemon.service import Daemon

    monkeypatch.setenv(STANDIN_ENV, "1")  # the GPU executor on the host stand-in
    args = [
        "--endpoint", f"ipc://{tmp_path}/d.sock", "--allow-root", str(tmp_path),
        "--array-entries", "11", "--shard-index-entries", "12", "--shard-index-bytes", "13M", "--metadata-concurrency", "7",
        "--max-chunks", "100", "--max-chunk-bytes", "3M", "--max-shards-per-sample", "5", "--max-plan-bytes", "9M",
        "--max-gap-bytes", "1K", "--max-read-bytes", "2M", "--remote-max-gap-bytes", "3K", "--remote-max-read-bytes", "4M",
        "--io-workers", "3", "--max-inflight-reads", "99", "--no-readahead",
        "--memory", "300M", "--decode-workers", "5", "--max-encoded-chunk-bytes", "5M", "--max-decoded-chunk-bytes", "1M",
        "--chunks-per-input-buffer", "64", "--chunk-cache", "7M", "--no-native", "--max-inflight-requests", "33",
        "--chunk-cache-dir", str(tmp_path / "disk"), "--chunk-cache-dir-bytes", "1G",
        "--gpu-memory", "96M", "--max-index-bytes", "0", "--chunk-layout-entries", "17", "--gpu-max-chunk-bytes", "512K",
        "--gpu-max-read-bytes", "2M", "--host-buffer-waves", "3", "--max-chunks-per-wave", "100", "--max-substreams-per-chunk", "4",
    ]
    daemon = Daemon(build_options(main.make_context("damacyd", args).params))
    try:
        assert daemon.planner.limits == L.PlanLimits(100, 3 << 20, 5, 9 << 20, 1 << 10, 2 << 20, 3 << 10, 4 << 20)
        assert daemon.metadata.cache.limits == L.MetadataCache(11, 12, 13 << 20) and daemon.metadata.concurrency == 7
        assert daemon.metadata.reads.store.roots == [os.path.realpath(tmp_path)]  # read below the roots only
        cpu = daemon.executor
        assert cpu.limits == L.CpuLimits(
            300 << 20, 5, 5 << 20, 1 << 20, 64, 7 << 20, native=False, max_inflight_requests=33,
            chunk_cache_dir=str(tmp_path / "disk"), chunk_cache_dir_bytes=1 << 30,
        )
        assert cpu.budget.total == 300 << 20 and cpu.chunk_cache is not None and cpu.disk_tier is not None and cpu.native is None
        reader = cpu.reader
        assert (reader.workers, reader.max_inflight_reads, reader.readahead, reader.roots) == (3, 99, False, [os.path.realpath(tmp_path)])
        gpu = daemon.gpu_executor(STANDIN_UUID)
        assert gpu.limits == L.CudaLimits(96 << 20, 0, 17, 512 << 10, 2 << 20, 3, 100, 4)
        assert gpu.budget.total == 96 << 20 and gpu.device == 0
        assert (gpu.reader.workers, gpu.reader.readahead, gpu.reader.roots) == (3, False, [os.path.realpath(tmp_path)])
    finally:
        daemon.shutdown()


def test_the_limits_given_as_flags_hold_in_a_real_damacyd(tmp_path):
    """Each flag, seen from the client: its BudgetExceeded (or InvalidArgument) naming the
    value object's field, the caches' sizes in ``damacy stats --json``, the memory budget."""
    values = random_data((32, 4096), "uint16", seed=21)
    for k in range(4):  # more arrays than the array cache holds
        write_array(tmp_path / f"a{k}.zarr", values[:16, :64], chunks=(8, 16))
    write_array(tmp_path / "big.zarr", values[:, :1024], chunks=(32, 1024))  # 64 KiB decoded chunks
    write_array(tmp_path / "bigger.zarr", values, chunks=(32, 4096))  # 256 KiB
    # 8 shards of 4 rows, inner chunks (4, 8): more shard indexes than the cache holds
    write_array(tmp_path / "sharded.zarr", values[:, :32], chunks=(4, 8), shards=(4, 32))
    proc = DaemonProcess(tmp_path, [tmp_path], [
        "--memory", "300M", "--array-entries", "2", "--shard-index-entries", "3", "--max-chunk-bytes", "128K",
        "--max-decoded-chunk-bytes", "32K", "--max-chunks", "8", "--max-shards-per-sample", "2",
    ])
    try:
        s = stats(proc.endpoint)
        assert s["memory"]["budget_bytes"] == 300 << 20  # --memory
        cfg = damacy.Config(samples_per_batch=1, sample_shape=(8, 8), dtype="u16", on_error="fill", pop_timeout_s=60)
        samples = [damacy.Sample(str(tmp_path / f"a{k}.zarr"), [(0, 8), (0, 8)]) for k in range(4)]
        samples += [damacy.Sample(str(tmp_path / "sharded.zarr"), [(r, r + 8), (0, 8)]) for r in range(0, 32, 8)]
        samples += [
            damacy.Sample(str(tmp_path / "big.zarr"), [(0, 8), (0, 8)]),  # 64 KiB: over the executor's 32K
            damacy.Sample(str(tmp_path / "bigger.zarr"), [(0, 8), (0, 8)]),  # 256 KiB: over the planner's 128K
            damacy.Sample(str(tmp_path / "sharded.zarr"), [(2, 10), (0, 8)]),  # 3 shards
        ]
        with damacy.Pipeline(cfg, endpoint=proc.endpoint) as pipe:
            pipe.push(samples)
            errors = []
            for _ in samples:
                with pipe.pop() as b:
                    errors.append(b.info.errors[0][1] if b.info.errors else None)
        assert errors[:8] == [None] * 8
        big, bigger, shards = errors[8:]
        assert type(big) is damacy.BudgetExceeded and "CpuLimits.max_decoded_chunk_bytes" in str(big) and "32768" in str(big), big
        assert type(bigger) is damacy.BudgetExceeded and "PlanLimits.max_chunk_bytes=131072" in str(bigger), bigger
        assert type(shards) is damacy.InvalidArgument and "PlanLimits.max_shards_per_sample=2" in str(shards), shards
        s = stats(proc.endpoint)
        arrays, indexes = s["cache"]["arrays"], s["cache"]["shard_indexes"]
        assert arrays["entries"] == 2 and arrays["evictions"] >= 4, arrays  # --array-entries
        assert indexes["entries"] == 3 and indexes["evictions"] >= 5, indexes  # --shard-index-entries
        # --max-chunks: a batch of 8 samples of two chunks each uses 16
        cfg = damacy.Config(samples_per_batch=8, sample_shape=(8, 8), dtype="u16", pop_timeout_s=60)
        with damacy.Pipeline(cfg, endpoint=proc.endpoint) as pipe:
            pipe.push([damacy.Sample(str(tmp_path / "a0.zarr"), [(0, 8), (12, 20)])] * 8)
            with pytest.raises(damacy.BudgetExceeded, match=r"uses 16 chunks .*PlanLimits\.max_chunks=8") as info:
                pipe.pop()
            assert info.value.status is damacy.Status.BUDGET and info.value.what == "pop"
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()


@pytest.fixture(scope="module")
def odd_arrays(data):
    """Arrays whose samples fail, each in its own way (under the daemon fixture's roots)."""
    import zarr

    root = data / "odd"
    root.mkdir(exist_ok=True)
    write_array(root / "good.zarr", random_data((8, 8), "uint16", seed=5), chunks=(4, 4))
    zarr.create_array(str(root / "complex.zarr"), shape=(8, 8), chunks=(8, 8), dtype="complex64")[:] = 1
    write_array(root / "codec.zarr", random_data((8, 8), "uint16", seed=6), chunks=(8, 8), compressors=[ZstdCodec()])
    meta = json.loads((root / "codec.zarr" / "zarr.json").read_text())
    meta["codecs"][-1] = {"name": "lz4hc-unknown", "configuration": {}}
    (root / "codec.zarr" / "zarr.json").write_text(json.dumps(meta))
    write_array(root / "volume.zarr", random_data((2, 8, 8), "uint16", seed=7), chunks=(2, 8, 8))
    return root


def test_errors_cross_the_wire_as_their_own_classes(daemon, odd_arrays):
    root = odd_arrays
    box = [(0, 4), (0, 4)]
    cases = [
        (damacy.Sample(str(root / "missing.zarr"), box), damacy.NotFound, "no Zarr array"),
        (damacy.Sample(str(root / "complex.zarr"), box), damacy.DtypeMismatch, "complex64"),
        (damacy.Sample(str(root / "codec.zarr"), box), damacy.UnsupportedOperation, "lz4hc-unknown"),
        (damacy.Sample(str(root / "volume.zarr"), box), damacy.RankMismatch, ""),  # two axes of three
        (damacy.Sample(str(root / "good.zarr"), [(6, 10), (0, 4)]), damacy.OutOfBounds, "leaves the array"),
    ]
    cfg = damacy.Config(samples_per_batch=1, sample_shape=(4, 4), dtype="u16", on_error="raise", pop_timeout_s=60)
    with damacy.Pipeline(cfg, endpoint=daemon.endpoint) as pipe:
        assert type(pipe).__name__ == "RemotePipeline"
        pipe.push([sample for sample, _, _ in cases] + [damacy.Sample(str(root / "good.zarr"), box)])
        for sample, cls, words in cases:
            with pytest.raises(damacy.DamacyError) as info:
                pipe.pop()
            err = info.value
            assert type(err) is cls and err.status is cls.status and err.what == "pop" and words in str(err), (cls, err)
            assert err.uri == sample.uri
        with pipe.pop() as b:  # "raise": the next pop goes on
            assert b.info.errors == () and b.numpy().shape == (1, 4, 4)
        with pytest.raises(damacy.PipelineDrained) as drained:  # what the daemon answers a pop past the end
            pipe.pop()
        assert isinstance(drained.value, damacy.PoolStarved) and drained.value.status is damacy.Status.SHUTDOWN
    with pytest.raises(damacy.ShutdownError, match="closed"):
        pipe.pop()


def test_a_missing_array_stops_a_daemon_pipeline_with_not_found(daemon, odd_arrays):
    """The default on_error="stop": the pop that would hold the bad sample raises NotFound,
    every later pop raises it again, push raises ShutdownError; Stats come as damacy.Stats."""
    root = odd_arrays
    good, missing = str(root / "good.zarr"), str(root / "missing.zarr")
    cfg = damacy.Config(samples_per_batch=1, sample_shape=(4, 4), dtype="u16", pop_timeout_s=60)
    with damacy.Pipeline(cfg, endpoint=daemon.endpoint) as pipe:
        pipe.push([damacy.Sample(good, [(0, 4), (0, 4)]), damacy.Sample(missing, [(0, 4), (0, 4)]), damacy.Sample(good, [(4, 8), (4, 8)])])
        with pipe.pop() as b:
            assert b.info.errors == ()
        figures = pipe.stats()
        assert isinstance(figures, damacy.Stats) and isinstance(figures.decode, damacy.Metric)
        assert figures.batches_emitted == 1 and figures.array_meta_hits + figures.array_meta_misses >= 1
        assert figures.host_bytes_committed > 0  # the session's slots
        assert pipe.stats_dict()["session"]["batches"] == 1
        for _ in range(2):  # terminal: the same error at every pop
            with pytest.raises(damacy.NotFound, match="no Zarr array") as info:
                pipe.pop()
            assert info.value.status is damacy.Status.NOTFOUND and info.value.what == "pop" and info.value.uri == missing
        with pytest.raises(damacy.ShutdownError, match="stopped after an error at pop") as info:
            pipe.push([damacy.Sample(good, [(0, 4), (0, 4)])])
        assert info.value.status is damacy.Status.SHUTDOWN


def test_a_session_config_arrives_as_a_dict_and_is_checked_there(daemon):
    """The Hello carries Config.to_dict(); the daemon rebuilds it with Config.from_dict and
    refuses one it does not take, saying which field."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    try:
        good = damacy.Config(samples_per_batch=1, sample_shape=(4,)).to_dict()
        for config, words in [
            ({**good, "samples_per_batch": 0}, "samples_per_batch must be >= 1 (got 0)"),
            ({**good, "io_workers": 4}, "no field(s) ['io_workers']"),
            ({**good, "max_gpu_memory_bytes": 1 << 26}, "names its device"),  # a GPU Config without device=
        ]:
            sock.send(m.encode(m.Hello(id=1, version=m.PROTOCOL_VERSION, pid=os.getpid(), rank=None, config=config)))
            assert sock.poll(60_000), "no reply"
            reply = m.decode_daemon(sock.recv())
            assert isinstance(reply, m.Failed) and reply.error.kind == "InvalidArgument" and words in reply.error.reason, reply
    finally:
        sock.close(0)


def test_a_daemon_session_says_once_which_of_its_configs_limits_are_the_daemons(daemon, monkeypatch):
    """A session through damacyd uses the daemon's components: the Config fields that set them
    (given other than their defaults) are named in one warning at the caller's line; the
    batch, queue and policy fields are the session's own and say nothing; GPUDirect Storage
    is refused as an embedded GPU pipeline refuses it."""
    import warnings

    from damacy_runtime import warn

    monkeypatch.setattr(warn, "_said", set())
    cfg = damacy.Config(samples_per_batch=1, sample_shape=(4, 4), decode_workers=3, chunk_cache_bytes=1 << 20)
    assert cfg.daemon_owned() == ["decode_workers", "chunk_cache_bytes"]
    with pytest.warns(UserWarning, match="Config's decode_workers, chunk_cache_bytes are damacyd's to set") as got:
        damacy.Pipeline(cfg, endpoint=daemon.endpoint).close()
    assert [w.filename for w in got] == [__file__]
    own = damacy.Config(samples_per_batch=2, sample_shape=(4, 4), prepared_batches=3, on_error="skip", drop_last=False)
    assert own.daemon_owned() == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        damacy.Pipeline(cfg, endpoint=daemon.endpoint).close()  # said once
        damacy.Pipeline(own, endpoint=daemon.endpoint).close()
    with pytest.raises(damacy.InvalidArgument, match="GPUDirect Storage"):
        damacy.Pipeline(damacy.Config(samples_per_batch=1, sample_shape=(4, 4), device=0, enable_gds=True), endpoint=daemon.endpoint)
