"""Many sessions on one damacyd: at equal demand every session gets its share of the batches
(no starvation), and the socket loop's cost per batch is measured (messages and busy time)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from zarr.codecs import ZstdCodec

from damacy_client.transport import daemon_stats

from conftest import random_data, write_array
from daemon_helpers import DaemonProcess, wait_for

CLIENT = textwrap.dedent(
    """
    import sys, os, damacy
    endpoint, uri, stop = sys.argv[1], sys.argv[2], sys.argv[3]
    cfg = damacy.Config(samples_per_batch=4, sample_shape=(32, 32, 32), dtype="u16", prepared_batches=2)
    sampler = damacy.RandomBoxes({uri: (128, 128, 128)}, (32, 32, 32), seed=int(sys.argv[4]), samples_per_epoch=10**6, rank=0, world_size=1)
    with damacy.Pipeline(cfg, endpoint=endpoint) as pipe:
        pipe.push(sampler)
        n = 0
        while not os.path.exists(stop):  # as fast as it can: every session asks alike
            pipe.pop().release()
            n += 1
    print(n)
    """
)


def test_sessions_at_equal_demand_get_equal_shares(tmp_path):
    sessions = 8
    write_array(tmp_path / "v.zarr", random_data((128, 128, 128), "uint16", seed=3), chunks=(32, 32, 32), compressors=[ZstdCodec()])
    uri = str(tmp_path / "v.zarr")
    daemon = DaemonProcess(tmp_path, [tmp_path], ["--decode-workers", "2", "--io-workers", "2"])
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    stop = tmp_path / "stop"
    clients = [
        subprocess.Popen([sys.executable, str(script), daemon.endpoint, uri, str(stop), str(k)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for k in range(sessions)
    ]
    try:
        # every session streaming, then a window of 8 x 80 batches measured from there
        def snapshot():
            stats = daemon_stats(daemon.endpoint, 60.0)  # the loop answers eight busy sessions too
            return {s["pid"]: s["samples"] for s in stats["sessions"] if not s["control"]}, stats["daemon"]

        start, before = wait_for(lambda: (d := snapshot()) and len(d[0]) == sessions and all(d[0].values()) and d, 120, "every session streaming")
        end, after = wait_for(lambda: (d := snapshot()) and sum(d[0].values()) - sum(start.values()) >= sessions * 80 * 4 and d, 300, "the window's batches")
    finally:
        stop.touch()
        outs = [c.communicate(timeout=60) for c in clients]
        assert daemon.stop() == 0, daemon.log_path.read_text()
    assert all(c.returncode == 0 for c in clients), [o[1][-2000:] for o in outs]
    shares = [end[pid] - start[pid] for pid in start]
    mean = sum(shares) / len(shares)
    # eight clients share the machine's cores with the daemon (and, in the suite, another test
    # worker), so their demand is equal only on average: a client the OS holds off fills its
    # slots and asks for nothing until it runs. Unloaded the shares fall within 4% of the mean;
    # a scheduler that starves sessions puts some far below it.
    assert all(abs(s - mean) <= 0.2 * mean for s in shares), f"per-session samples over the window: {shares}"
    # the loop's cost per batch, as damacy stats prints it: per batch one Pop, one Release and
    # one Push of its samples (the client pushes as the sampler is pulled), whatever the sessions
    batches = after["batches"] - before["batches"]
    kinds = {k: after["requests"].get(k, 0) - before["requests"].get(k, 0) for k in ("Pop", "Push", "Release")}
    assert batches >= sessions * 80 and all(0.9 <= n / batches <= 1.1 for n in kinds.values()), (kinds, batches)
    assert after["loop_cpu_s"] > before["loop_cpu_s"] and after["replies"] > before["replies"]
    print(json.dumps({"shares": shares, "requests_per_batch": {k: n / batches for k, n in kinds.items()},
                      "loop_ms_per_batch": 1e3 * (after["loop_cpu_s"] - before["loop_cpu_s"]) / batches}))


def test_a_session_holds_at_most_the_daemons_lookahead(tmp_path):
    # queued samples are the daemon's memory, outside --memory: a client asking for a huge
    # lookahead gets the daemon's most, and its samples still all arrive, in order
    import numpy as np

    import damacy

    data = random_data((64, 8, 8), "uint16", seed=4)
    write_array(tmp_path / "v.zarr", data, chunks=(16, 8, 8))
    daemon = DaemonProcess(tmp_path, [tmp_path], ["--max-lookahead-samples", "8"])
    try:
        floor = 100_000 + 2 * 2  # the Config's cache floors: its lookahead plus two batches
        cfg = damacy.Config(
            samples_per_batch=2, sample_shape=(1, 8, 8), dtype="u16", lookahead_samples=100_000,
            n_array_meta_cache=floor, n_chunk_layout_cache=floor, n_shard_index_cache=64 * floor,
        )
        with damacy.Pipeline(cfg, endpoint=daemon.endpoint) as pipe:
            assert pipe._conn.welcome.credits == 8
            pipe.push(damacy.Sample(str(tmp_path / "v.zarr"), np.s_[z : z + 1, 0:8, 0:8]) for z in range(64))
            got = np.concatenate([b.copy() for b in pipe])
        np.testing.assert_array_equal(got.reshape(64, 8, 8), data)
        with pytest.raises(damacy.InvalidArgument, match="at most 8 samples ahead for a session"):
            damacy.Pipeline(damacy.Config(samples_per_batch=16, sample_shape=(1, 8, 8)), endpoint=daemon.endpoint)
    finally:
        assert daemon.stop() == 0, daemon.log_path.read_text()
