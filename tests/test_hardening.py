"""Attacks and accidents, each reproduced against the real thing: ``damacy.read`` and a real
damacyd (its command, its socket, its shared memory). Every test here failed before the
fix it guards.

Clients that must run as another user, or be killed with SIGKILL, are forked from a fork
server that has damacy loaded already (so a client switched to ``nobody`` needs no file of
this checkout, and a killed client costs a fork rather than an interpreter start).
"""

from __future__ import annotations

import grp
import json
import multiprocessing as mp
import os
import resource
import shutil
import struct
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
from zarr.codecs import BytesCodec, ShardingCodec

import damacy
from damacy_client.transport import Connection
from damacy_protocol import messages as m

from conftest import random_data, write_array
from daemon_helpers import DaemonProcess, shm_segments, wait_for

SHAPE = (32, 48, 40)
BOX = (8, 12, 10)
CHUNKS = (8, 12, 10)
FIRST = np.s_[0:8, 0:12, 0:10]  # exactly chunk c/0/0/0



def control(endpoint: str) -> Connection:
    """A session without a pipeline, as the `damacy` command opens."""
    conn = Connection(endpoint, connect_timeout_s=60.0)
    conn.call(lambda i: m.Attached(id=i), 30.0, "attach")
    return conn


def daemon_stats(endpoint: str) -> dict:
    from damacy_client.transport import daemon_stats as ask

    return ask(endpoint, 30.0)


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (kB) and the open descriptors of a process."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return {
        "rss": int(fields["VmRSS"].split()[0]) << 10,
        "hwm": int(fields["VmHWM"].split()[0]) << 10,
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A served root with an array, and outside it an array of the same layout and other values."""
    base = tmp_path_factory.mktemp("hardening")
    root, outside = base / "root", base / "outside"
    inside = random_data(SHAPE, "uint16", 1)
    other = inside ^ np.uint16(0x5A5A)
    write_array(root / "vol.zarr", inside, chunks=CHUNKS)
    write_array(outside / "vol.zarr", other, chunks=CHUNKS)
    return {"root": root, "outside": outside, "inside": inside, "other": other}


@pytest.fixture
def fresh(tmp_path):
    """A served root of this test's own (its arrays may be damaged) with an array in it."""
    root = tmp_path / "root"
    data = random_data(SHAPE, "uint16", 3)
    write_array(root / "vol.zarr", data, chunks=CHUNKS)
    return root, data


@pytest.fixture
def served(tmp_path, fresh):
    proc = DaemonProcess(tmp_path, [fresh[0]], ["--memory", "256M"])
    yield proc
    assert proc.stop() == 0, proc.log_path.read_text()


@pytest.fixture(params=["native", "python"])
def open_rule(request, monkeypatch):
    """Files opened by the C rule (openat2, else the descriptor's location), or by the
    Python rule used where the extension is not built."""
    from damacy_server.store import file

    if request.param == "python":
        monkeypatch.setattr(file, "_open_checked", None)
    elif file._open_checked is None:
        pytest.skip("the native extension is not built")
    return request.param


def rooted_metadata(root: Path):
    """What a daemon reads through (its Resolver, with caches): a metadata reader confined to ``root``."""
    from damacy_server.plan.resolve import Caches, Resolver

    return Resolver(damacy.FileMetadataReader(roots=[str(root)]), Caches(damacy.MetadataCache()))


def swap_for_outside_link(store: Path, outside_store: Path) -> None:
    """Replace the folder c/0 of ``store`` with a link to the same folder of another array."""
    shutil.rmtree(store / "c" / "0")
    os.symlink(outside_store / "c" / "0", store / "c" / "0")


def fill_cfg(**kw) -> damacy.Config:
    return damacy.Config(samples_per_batch=kw.pop("n", 3), sample_shape=BOX, dtype="u16", on_error="fill", pop_timeout_s=60, **kw)


# -- 1. the allow-root escape ---------------------------------------------------------------


def test_a_folder_swapped_for_a_link_out_of_the_root_is_refused_after_a_read(tmp_path, world, open_rule):
    root = tmp_path / "root"
    shutil.copytree(world["root"], root)
    md = rooted_metadata(root)
    store = root / "vol.zarr"
    assert np.array_equal(damacy.read(store, FIRST, metadata=md), world["inside"][FIRST])
    swap_for_outside_link(store, world["outside"] / "vol.zarr")
    with pytest.raises(damacy.InvalidArgument, match="outside the daemon's allowed roots"):
        damacy.read(store, FIRST, metadata=md)


def test_the_early_check_remembers_a_path_briefly_and_the_open_still_refuses(tmp_path, world, open_rule, monkeypatch):
    # the push-time check (a courtesy) does not resolve a path it found inside again for a
    # second; a link swapped to the outside meanwhile is still refused where it matters, at open
    from damacy_server.store import file

    root = tmp_path / "root"
    shutil.copytree(world["root"], root)
    md = rooted_metadata(root)
    store = root / "vol.zarr"
    md.check_allowed(str(store))
    assert np.array_equal(damacy.read(store, FIRST, metadata=md), world["inside"][FIRST])
    shutil.rmtree(store)
    os.symlink(world["outside"] / "vol.zarr", store)
    md.check_allowed(str(store))  # remembered: not resolved again within ALLOWED_TTL_S
    with pytest.raises(damacy.InvalidArgument, match="outside the daemon's allowed roots"):
        damacy.read(store, FIRST, metadata=md)
    later = time.monotonic() + file.ALLOWED_TTL_S + 1
    monkeypatch.setattr(file.time, "monotonic", lambda: later)
    with pytest.raises(damacy.InvalidArgument, match="outside the daemon's allowed roots"):
        md.check_allowed(str(store))


def test_links_that_stay_inside_the_root_are_followed(tmp_path, world, open_rule):
    root = tmp_path / "root"
    shutil.copytree(world["root"], root)
    (root / "moved").mkdir()
    shutil.move(root / "vol.zarr" / "c" / "1", root / "moved" / "1")
    os.symlink("../../moved/1", root / "vol.zarr" / "c" / "1")  # relative, up and back in
    os.symlink(root / "vol.zarr", root / "alias.zarr")  # absolute, inside
    md = rooted_metadata(root)
    for name in ("vol.zarr", "alias.zarr"):
        assert np.array_equal(damacy.read(root / name, metadata=md), world["inside"])


def test_the_daemon_never_serves_bytes_from_outside_its_root(tmp_path, world):
    root = tmp_path / "root"
    shutil.copytree(world["root"], root)
    store = root / "vol.zarr"
    proc = DaemonProcess(tmp_path, [root])
    try:
        with damacy.Pipeline(fill_cfg(n=1), endpoint=proc.endpoint) as pipe:
            pipe.push([damacy.Sample(str(store), FIRST)])
            with pipe.pop() as b:  # now the folder is known to the daemon (and in the page cache)
                assert b.info.errors == () and np.array_equal(np.from_dlpack(b)[0], world["inside"][FIRST])
            swap_for_outside_link(store, world["outside"] / "vol.zarr")
            pipe.push([damacy.Sample(str(store), FIRST)] * 2)
            for _ in range(2):  # the I/O threads' path and the decode threads' direct path alike
                with pipe.pop() as b:
                    x = np.from_dlpack(b)[0]
                    (_, err), = b.info.errors
                    assert isinstance(err, damacy.InvalidArgument) and "outside" in str(err), err
                    assert not np.array_equal(x, world["other"][FIRST]) and not x.any()
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()


# -- 2. FIFOs and other files that are not regular ------------------------------------------


@pytest.mark.timeout(60)
def test_a_fifo_is_a_storage_error_not_a_hang(fresh, open_rule):
    root, _ = fresh
    chunk = root / "vol.zarr" / "c" / "0" / "0" / "0"
    chunk.unlink()
    os.mkfifo(chunk)
    with pytest.raises(damacy.StorageError, match="FIFO"):
        damacy.read(root / "vol.zarr", FIRST)
    meta = root / "vol.zarr" / "zarr.json"
    meta.unlink()
    os.mkfifo(meta)
    with pytest.raises(damacy.StorageError, match="FIFO"):
        damacy.read(root / "vol.zarr", FIRST, metadata=rooted_metadata(root))


@pytest.mark.timeout(120)
def test_fifo_samples_do_not_block_the_daemons_readers(tmp_path, fresh):
    root, data = fresh
    fifos = []
    for k in range(6):  # more than the daemon has I/O threads
        store = root / f"fifo{k}.zarr"
        shutil.copytree(root / "vol.zarr", store)
        chunk = store / "c" / "0" / "0" / "0"
        chunk.unlink()
        os.mkfifo(chunk)
        fifos.append(store)
    (root / "nometa.zarr").mkdir()
    os.mkfifo(root / "nometa.zarr" / "zarr.json")
    proc = DaemonProcess(tmp_path, [root], ["--io-workers", "4"])
    try:
        with damacy.Pipeline(fill_cfg(n=7), endpoint=proc.endpoint) as pipe:
            pipe.push([damacy.Sample(str(s), FIRST) for s in fifos] + [damacy.Sample(str(root / "nometa.zarr"), FIRST)])
            with pipe.pop() as b:
                errors = dict(b.info.errors)
                assert sorted(errors) == list(range(7))
                assert all(isinstance(e, damacy.StorageError) for e in errors.values()), errors
        with damacy.Pipeline(fill_cfg(n=1), endpoint=proc.endpoint) as pipe:  # another session reads on
            pipe.push([damacy.Sample(str(root / "vol.zarr"), FIRST)])
            with pipe.pop() as b:
                assert b.info.errors == () and np.array_equal(np.from_dlpack(b)[0], data[FIRST])
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()


# -- 3. a NUL byte in a uri -------------------------------------------------------------------


def test_a_nul_byte_in_a_uri_is_that_samples_invalid_argument(served, fresh):
    root, data = fresh
    bad = str(root / "vol\0.zarr")
    with pytest.raises(damacy.InvalidArgument, match="NUL") as raised:
        damacy.read(bad, FIRST)
    # the error keeps the real uri; only its message escapes the NUL
    assert raised.value.uri == bad and "\0" not in str(raised.value) and "vol\\0.zarr" in str(raised.value)
    good = damacy.Sample(str(root / "vol.zarr"), FIRST)
    with damacy.Pipeline(fill_cfg(n=3), endpoint=served.endpoint) as pipe:
        pipe.push([good, damacy.Sample(str(root / "v\0l.zarr"), FIRST), good])
        with pipe.pop() as b:
            (i, err), = b.info.errors
            assert i == 1 and isinstance(err, damacy.InvalidArgument) and "NUL" in str(err)
            assert err.uri == str(root / "v\0l.zarr") and "\0" not in str(err)
            x = np.from_dlpack(b)
            assert np.array_equal(x[0], data[FIRST]) and np.array_equal(x[2], data[FIRST])
    conn = control(served.endpoint)
    try:
        call = conn.request(lambda i: m.Warm(id=i, uris=[str(root / "a\0b"), str(root / "vol.zarr")]))
        done = call.wait(30.0, "warm")
        assert isinstance(done, m.WarmDone) and done.arrays == 1
        (err,) = done.errors
        assert err.kind == "InvalidArgument" and "NUL" in err.reason
    finally:
        conn.close()


# -- 4. errors of the wrong type ------------------------------------------------------------


def test_malformed_metadata_is_a_metadata_error_naming_the_array(served, fresh):
    root, _ = fresh
    doc = json.loads((root / "vol.zarr" / "zarr.json").read_text())
    cases = {
        "deep.zarr": '{"a":' * 100_000 + "1" + "}" * 100_000,
        "transformers.zarr": json.dumps({**doc, "storage_transformers": 5}),
        "huge.zarr": json.dumps({**doc, "shape": [2**70, 48, 40]}),
    }
    for name, text in cases.items():
        shutil.copytree(root / "vol.zarr", root / name)
        (root / name / "zarr.json").write_text(text)
        with pytest.raises(damacy.MetadataError) as info:
            damacy.read(root / name)
        assert info.value.uri == str(root / name)
    names = list(cases)
    with damacy.Pipeline(fill_cfg(n=len(names)), endpoint=served.endpoint) as pipe:
        pipe.push([damacy.Sample(str(root / n), FIRST) for n in names])
        with pipe.pop() as b:
            errors = dict(b.info.errors)
            assert sorted(errors) == list(range(len(names)))
            for i, name in enumerate(names):
                assert isinstance(errors[i], damacy.MetadataError) and errors[i].uri == str(root / name), errors[i]


def test_a_shard_index_entry_past_the_end_of_its_shard_is_a_decode_error(tmp_path):
    data = random_data((8, 8), "uint16", 4)
    sharding = ShardingCodec(chunk_shape=(4, 4), codecs=[BytesCodec()], index_codecs=[BytesCodec()])
    write_array(tmp_path / "s.zarr", data, chunks=(8, 8), serializer=sharding)
    shard = tmp_path / "s.zarr" / "c" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    index = len(raw) - 4 * 16  # four (offset, nbytes) entries at the end
    offset, _ = struct.unpack_from("<QQ", raw, index)
    struct.pack_into("<QQ", raw, index, offset, 2**61)  # inner chunk (0, 0): 2 EiB
    shard.write_bytes(bytes(raw))
    uri = str(tmp_path / "s.zarr")
    with pytest.raises(damacy.DecodeError, match="past the shard") as info:
        damacy.read(uri, np.s_[0:4, 0:4])
    assert info.value.chunk == (0, 0)
    assert np.array_equal(damacy.read(uri, np.s_[4:8, 4:8]), data[4:8, 4:8])  # the rest reads
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(4, 4), dtype="u16", on_error="fill")
    with damacy.Pipeline(cfg) as pipe:
        pipe.push([damacy.Sample(uri, np.s_[0:4, 0:4]), damacy.Sample(uri, np.s_[4:8, 4:8])])
        with pipe.pop() as b:
            (i, err), = b.info.errors
            assert i == 0 and isinstance(err, damacy.DecodeError) and "past the shard" in str(err)
            assert np.array_equal(np.from_dlpack(b)[1], data[4:8, 4:8])


class Raw:
    """A client speaking the wire protocol by hand (to send what the real client never would)."""

    def __init__(self, endpoint: str, unlimited_queue: bool = False) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if unlimited_queue:
            self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.connect(endpoint)
        self.ids = iter(range(1, 1 << 62))

    def send(self, data: bytes) -> None:
        self.sock.send(data)

    def recv(self, timeout_s: float = 30.0):
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return m.decode_daemon(self.sock.recv())

    def call(self, make, timeout_s: float = 30.0):
        rid = next(self.ids)
        self.send(m.encode(make(rid)))
        while True:
            reply = self.recv(timeout_s)
            assert reply is not None, "no reply"
            if reply.reply_to == rid and not isinstance(reply, (m.WarmProgress, m.Consumed)):
                return reply

    def hello(self, config: damacy.Config | None = None):
        described = None if config is None else config.to_dict()  # (the wire form, as the client sends it)
        welcome = self.call(lambda i: m.Hello(id=i, version=m.PROTOCOL_VERSION, pid=os.getpid(), rank=None, config=described))
        assert isinstance(welcome, m.Welcome), welcome
        assert isinstance(self.call(lambda i: m.Attached(id=i)), m.Ack)
        return welcome

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def test_malformed_requests_get_a_protocol_error_reply_that_keeps_the_schema(served):
    raw = Raw(served.endpoint)
    try:
        deep = msgspec.msgpack.encode({"type": "stats", "id": 7, "x": 0})[:-1] + b"\x91" * 100_000 + b"\x01"
        raw.send(deep)
        reply = raw.recv()
        assert isinstance(reply, m.Failed) and reply.error.kind == "ProtocolError" and "nested" in reply.error.reason
        raw.send(msgspec.msgpack.encode({"type": "stats", "id": True}))  # a boolean is no request id
        reply = raw.recv()  # decodes under the schema, which a reply_to of True would not
        assert isinstance(reply, m.Failed) and reply.error.kind == "ProtocolError" and reply.reply_to == 0
        assert isinstance(raw.call(lambda i: m.Ping(id=i)), m.Pong)  # and the daemon goes on
    finally:
        raw.close()


# -- 5. memory and descriptors of finished sessions -----------------------------------------


def test_sessions_over_the_slot_cap_or_the_descriptor_limit_are_refused_with_a_reason(tmp_path, fresh):
    root, data = fresh
    limit = 256

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    proc = DaemonProcess(tmp_path, [root], ["--max-slots-per-session", "64"], preexec_fn=low_limit)
    try:
        cfg = damacy.Config(samples_per_batch=1, sample_shape=BOX, dtype="u16", prepared_batches=64, lookahead_samples=1)
        with pytest.raises(damacy.InvalidArgument, match="at most 64 slots"):
            damacy.Pipeline(damacy.Config(samples_per_batch=1, sample_shape=BOX, prepared_batches=65), endpoint=proc.endpoint)
        first = damacy.Pipeline(cfg, endpoint=proc.endpoint)
        second = damacy.Pipeline(cfg, endpoint=proc.endpoint)
        with pytest.raises(damacy.BudgetExceeded, match="file descriptors"):
            damacy.Pipeline(cfg, endpoint=proc.endpoint)
        first.close()
        second.close()
        # (a close whose goodbye came late leaves its session to the daemon's liveness check)
        wait_for(lambda: not [x for x in daemon_stats(proc.endpoint)["sessions"] if not x.get("control")], timeout=60, what="the closed sessions to end")
        # the descriptors come back, and a session of the same size is served again
        with damacy.Pipeline(cfg, endpoint=proc.endpoint) as third:
            third.push([damacy.Sample(str(root / "vol.zarr"), FIRST)])
            with third.pop() as b:
                assert np.array_equal(np.from_dlpack(b)[0], data[FIRST])
        assert proc_status(proc.pid)["fds"] < limit
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()


def test_sessions_starting_together_are_held_to_the_descriptor_limit_together(tmp_path, fresh):
    """Each start counts the descriptors the others are opening: at most as many sessions as
    fit are served, the others refused with the reason (never a failure to open a file)."""
    root, _ = fresh
    limit = 256

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    proc = DaemonProcess(tmp_path, [root], ["--max-slots-per-session", "64"], preexec_fn=low_limit)
    outcomes, pipes = [], []
    try:
        cfg = damacy.Config(samples_per_batch=1, sample_shape=BOX, dtype="u16", prepared_batches=64, lookahead_samples=1)

        def start():
            try:
                pipes.append(damacy.Pipeline(cfg, endpoint=proc.endpoint))
                outcomes.append("served")
            except BaseException as e:  # noqa: BLE001 - the outcome is what it raised
                outcomes.append(e)

        threads = [threading.Thread(target=start) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        refused = [e for e in outcomes if e != "served"]
        assert len(outcomes) == 4 and 1 <= outcomes.count("served") <= 2, outcomes
        assert all(isinstance(e, damacy.BudgetExceeded) and "file descriptors" in str(e) for e in refused), refused
        assert proc_status(proc.pid)["fds"] < limit
    finally:
        for p in pipes:
            p.close()
        assert proc.stop() == 0, proc.log_path.read_text()


_SERVER = None


def forkserver():
    """Clients forked from one process that has damacy loaded (started once)."""
    global _SERVER
    if _SERVER is None:
        _SERVER = mp.get_context("forkserver")
        _SERVER.set_forkserver_preload(["damacy", "damacy_client.client", "numpy", "zmq", "test_hardening"])
    return _SERVER


def _holder(endpoint: str, uri: str, box, shape, user, queue) -> None:
    """A client (optionally as another user: (uid, gid, groups)) that pops a batch, says so,
    and holds it until killed."""
    try:
        if user is not None:
            uid, gid, groups = user
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
        cfg = damacy.Config(samples_per_batch=2, sample_shape=shape, dtype="f32", pop_timeout_s=60)
        pipe = damacy.Pipeline(cfg, endpoint=endpoint)
        pipe.push(damacy.Sample(uri, box) for _ in range(10**9))
        batch = pipe.pop()
        queue.put(("holding", np.from_dlpack(batch)[0].copy()))
        time.sleep(600)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        queue.put(("error", f"{type(e).__name__}: {e}"))


@pytest.mark.timeout(600)
def test_120_sessions_one_after_another_leave_the_daemon_as_they_found_it(tmp_path):
    root = tmp_path / "root"
    shape = (32, 48, 40)  # a slot of 4 samples: 1 MiB; 120 sessions leaking their 3 slots would be 360 MiB
    write_array(root / "big.zarr", random_data((64, 96, 80), "uint16", 9), chunks=(32, 48, 40))
    uri = str(root / "big.zarr")
    proc = DaemonProcess(tmp_path, [root], ["--memory", "256M"])
    ctx = forkserver()
    try:
        idle = proc_status(proc.pid)

        def settled():
            s = daemon_stats(proc.endpoint)
            live = [x for x in s["sessions"] if not x.get("control")]
            return not live and s["memory"]["in_use_bytes"] == 0 and s["memory"].get("retiring_slot_bytes", 0) == 0

        after_first = None
        for k in range(120):
            if k % 5 == 4:  # killed mid-stream, holding a batch, with more in flight
                queue = ctx.Queue()
                p = ctx.Process(target=_holder, args=(proc.endpoint, uri, np.s_[0:32, 0:48, 0:40], shape, None, queue))
                p.start()
                said = queue.get(timeout=60)
                assert said[0] == "holding", said
                p.kill()
                p.join()
            else:
                cfg = damacy.Config(samples_per_batch=4, sample_shape=shape, dtype="f32", pop_timeout_s=60)
                with damacy.Pipeline(cfg, endpoint=proc.endpoint) as pipe:
                    pipe.push(damacy.Sample(uri, np.s_[z : z + 32, 0:48, 0:40]) for z in range(12))
                    for batch in pipe.batches(3):
                        with batch:
                            assert batch.info.errors == ()
            if k == 0:
                wait_for(settled, what="the first session to be reclaimed")
                wait_for(lambda: proc_status(proc.pid)["fds"] <= idle["fds"] + 2, what="descriptors to settle")
                after_first = proc_status(proc.pid)
        wait_for(settled, timeout=60, what="every session to be reclaimed")
        wait_for(lambda: proc_status(proc.pid)["fds"] <= after_first["fds"], what="descriptors to return")
        last = proc_status(proc.pid)
        print(f"daemon RSS idle {idle['rss'] >> 20} MiB, after the first session {after_first['rss'] >> 20} MiB, "
              f"after 120 {last['rss'] >> 20} MiB, peak {last['hwm'] >> 20} MiB; descriptors {after_first['fds']} -> {last['fds']}")
        assert shm_segments(proc.pid) == []
        assert last["rss"] - after_first["rss"] < 64 << 20, (idle, after_first, last)
        assert last["hwm"] < (256 << 20) + idle["rss"] + (64 << 20), (idle, after_first, last)
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()


# -- 6. credits and fairness ------------------------------------------------------------------


def test_pushes_beyond_the_credits_granted_are_refused(served, fresh):
    root, _ = fresh
    raw = Raw(served.endpoint)
    try:
        cfg = damacy.Config(samples_per_batch=2, sample_shape=BOX, lookahead_samples=4)
        welcome = raw.hello(cfg)
        assert welcome.credits == 4
        wire = [m.WireSample(seq=i, uri=str(root / "vol.zarr"), box=True, axes=[m.WireRange(0, 8), m.WireRange(0, 12), m.WireRange(0, 10)]) for i in range(5)]
        reply = raw.call(lambda i: m.Push(id=i, samples=wire))
        assert isinstance(reply, m.Failed) and reply.error.kind == "ProtocolError" and "credits" in reply.error.reason
        raw.send(m.encode(m.Push(id=next(raw.ids), samples=wire[:4])))  # taken: a push is answered only if refused
        raw.send(m.encode(m.Ping(id=(ping := next(raw.ids)))))
        reply = raw.recv()  # the first answer since is the ping's: nothing refused the push
        assert isinstance(reply, m.Pong) and reply.reply_to == ping, reply
        reply = raw.call(lambda i: m.Push(id=i, samples=wire[4:]))  # none left until a batch is popped
        assert isinstance(reply, m.Failed) and "credits" in reply.error.reason
        s = daemon_stats(served.endpoint)
        (mine,) = [x for x in s["sessions"] if not x.get("control")]
        assert mine["samples_pulled"] <= 4
    finally:
        raw.close()


def test_a_flooding_client_does_not_hold_up_another_clients_answers(served):
    flood_size = 200_000
    other = Raw(served.endpoint)
    flood = Raw(served.endpoint, unlimited_queue=True)
    try:
        other.hello()  # a control session, for stats
        ping = m.encode(m.Ping(id=1))
        for _ in range(flood_size):
            flood.send(ping)
        first = other.call(lambda i: m.Stats(id=i), timeout_s=120)
        second = other.call(lambda i: m.Stats(id=i), timeout_s=120)
        assert isinstance(second, m.StatsReply), second
        # answered between the flood's messages, not after all of them
        assert second.stats.daemon.messages < flood_size, (first.stats.daemon, second.stats.daemon)
    finally:
        flood.close()
        other.close()


# -- 7. a fast restart --------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_restarted_daemon_fails_the_old_sessions_calls_with_daemon_unavailable(tmp_path, fresh, monkeypatch):
    root, _ = fresh
    # silence never ends the session here, however long the replacement takes to start: only
    # the restart can
    monkeypatch.setattr("damacy_client.transport.DEAD_AFTER_S", 600.0)
    proc = DaemonProcess(tmp_path, [root])
    replacement = None
    release = __import__("threading").Event()

    def slow():  # the pop waits in the daemon for samples that come only later
        release.wait(60)
        yield damacy.Sample(str(root / "vol.zarr"), FIRST)

    try:
        pipe = damacy.Pipeline(fill_cfg(n=1, lookahead_samples=1), endpoint=proc.endpoint)
        pipe.push(slow())
        import threading

        outcome = {}

        def pop():
            try:
                pipe.pop()
                outcome["error"] = None
            except BaseException as e:  # noqa: BLE001
                outcome["error"] = e

        t = threading.Thread(target=pop)
        t.start()
        proc.kill()
        replacement = DaemonProcess(tmp_path, [root])  # the same endpoint, at once
        t.join(90)
        assert isinstance(outcome.get("error"), damacy.DaemonUnavailable), outcome
        with pytest.raises(damacy.DaemonUnavailable, match="restarted"):
            pipe.pop()
        release.set()
        pipe.close()
    finally:
        release.set()
        if replacement is not None:
            assert replacement.stop() == 0, replacement.log_path.read_text()


# -- 8, 9. who may connect, and with what --------------------------------------------------------


def _other_group() -> int:
    for name in ("audio", "video", "games", "users", "daemon"):
        try:
            gid = grp.getgrnam(name).gr_gid
        except KeyError:
            continue
        if gid != os.getgid():
            return gid
    pytest.skip("no group to lend a client")


NOBODY = 65534


def _run_as(endpoint: str, uri: str, user) -> tuple:
    ctx = forkserver()
    queue = ctx.Queue()
    p = ctx.Process(target=_holder, args=(endpoint, uri, FIRST, BOX, user, queue))
    p.start()
    try:
        return queue.get(timeout=60)
    finally:
        p.kill()
        p.join()


def _shared_folder() -> Path:
    """A folder other users may enter (pytest's are the owner's only)."""
    folder = Path(tempfile.mkdtemp(prefix="damacy-shared-"))
    folder.chmod(0o755)
    return folder


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching a client to another user needs root")


@needs_root
def test_a_socket_group_member_maps_the_slots(tmp_path, fresh):
    root, data = fresh
    gid = _other_group()
    folder = _shared_folder()
    proc = DaemonProcess(folder, [root], ["--socket-group", grp.getgrgid(gid).gr_name, "--socket-mode", "660"])
    try:
        said = _run_as(proc.endpoint, str(root / "vol.zarr"), (NOBODY, NOBODY, [gid]))
        assert said[0] == "holding", said
        assert np.array_equal(said[1], data[FIRST].astype("f4"))
        assert f"uid {NOBODY}" in proc.log_path.read_text()  # who connected is logged
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()
        shutil.rmtree(folder)


@needs_root
def test_allow_uid_and_allow_gid_choose_who_may_open_a_session(tmp_path, fresh):
    root, _ = fresh
    gid = _other_group()
    folder = _shared_folder()
    proc = DaemonProcess(folder, [root], ["--socket-mode", "666", "--allow-uid", "4242", "--allow-gid", str(gid)])
    try:
        uri = str(root / "vol.zarr")
        said = _run_as(proc.endpoint, uri, (NOBODY, NOBODY, []))
        assert said[0] == "error" and "permission denied" in said[1] and f"uid {NOBODY}" in said[1], said
        said = _run_as(proc.endpoint, uri, (NOBODY, NOBODY, [gid]))  # a member of an allowed group
        assert said[0] == "holding", said
        with damacy.Pipeline(fill_cfg(n=1), endpoint=proc.endpoint):  # the daemon's own user
            pass
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()
        shutil.rmtree(folder)


def test_allow_uid_needs_an_ipc_endpoint(tmp_path):
    import subprocess

    from daemon_helpers import damacyd_command

    out = subprocess.run(
        [*damacyd_command(), "--endpoint", "tcp://127.0.0.1:0", "--allow-uid", "0", "--allow-root", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode != 0 and "ipc://" in out.stderr


def test_a_message_over_the_size_limit_is_dropped_with_its_connection(tmp_path, fresh):
    root, _ = fresh
    proc = DaemonProcess(tmp_path, [root], ["--max-message-size", "1M"])
    raw = Raw(proc.endpoint)
    try:
        big = msgspec.msgpack.encode({"type": "stats", "id": 1, "padding": b"x" * (2 << 20)})
        raw.send(big)  # before hello: answered with a protocol error, if it were read at all
        answered = []
        for k in range(2, 200):  # the socket reconnects; pings go on until one is answered
            raw.send(m.encode(m.Ping(id=k)))
            reply = raw.recv(0.5)
            while reply is not None:
                answered.append(reply.reply_to)
                reply = raw.recv(0)
            if any(r != 1 for r in answered):
                break
        assert answered and 1 not in answered, answered
    finally:
        raw.close()
        assert proc.stop() == 0, proc.log_path.read_text()


def test_over_tcp_a_session_is_watched_by_its_heartbeats_not_a_pid_it_names():
    # a pid a client names over TCP may be another machine's: it must not tie the session to
    # whatever local process has that number (reclaimed when that one exits)
    from types import SimpleNamespace

    from damacy_protocol import messages as m
    from damacy_protocol.connection import ServerConnection
    from damacy_server.daemon.session import Session

    hello = m.Hello(id=1, version=m.PROTOCOL_VERSION, pid=os.getpid(), rank=None, config=None)  # a live local pid
    remote = Session(SimpleNamespace(endpoint="tcp://127.0.0.1:47000", sharing=None), b"r", ServerConnection(), hello)
    assert remote.watch_pid == 0 and not remote.pid_visible
    local = Session(SimpleNamespace(endpoint="ipc:///tmp/d.sock", sharing=None), b"l", ServerConnection(), hello)
    assert local.watch_pid == os.getpid() and local.pid_visible
