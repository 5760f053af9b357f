"""Two "nodes" on this machine: two torchrun agents with a c10d rendezvous on 127.0.0.1 and
the gloo backend, two ranks each, one damacyd per node; the job is stopped in its last epoch
with a checkpoint and resumed by a second job of one rank per node (an elastic resume:
four ranks' state read by two). Every sample of every epoch is read once, in lockstep
batch counts. (Resuming on the same ranks is tests/test_resume.py's, in new processes.)"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from zarr.codecs import ZstdCodec

import damacy

from conftest import random_data, write_array
from daemon_helpers import DaemonProcess

pytest.importorskip("torch")
EXAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "torchrun_example.py"
SAMPLES = 36


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(tmp_path, uris, daemons, procs_per_node, name, extra):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    assert torchrun, "torchrun is not installed"
    port = _port()
    agents = []
    for node, d in enumerate(daemons):
        env = {**os.environ, "DAMACY_ENDPOINT": d.endpoint, "OMP_NUM_THREADS": "1"}
        cmd = [
            torchrun, "--nnodes", str(len(daemons)), "--nproc-per-node", str(procs_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", name,
            "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}", "--max-restarts", "0",
            str(EXAMPLE), "--samples-per-epoch", str(SAMPLES), "--epochs", "2", "--batch", "3",
            "--checkpoint", str(tmp_path / "ckpt"), "--read-log", str(tmp_path / name), *extra, *uris,
        ]
        agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [a.communicate(timeout=400)[0] for a in agents]
    for a, out in zip(agents, outs):
        assert a.returncode == 0, out[-4000:]
    world = procs_per_node * len(daemons)
    return [json.loads(Path(f"{tmp_path / name}.{r}").read_text()) for r in range(world)]


def _key(entry):
    return (entry[1], tuple(tuple(b) for b in entry[2]))


def _global(uris, epoch):
    s = damacy.RandomBoxes({u: (32, 64, 64) for u in uris}, (16, 32, 32), seed=0, samples_per_epoch=SAMPLES, rank=0, world_size=1)
    s.set_epoch(epoch)
    return [(x.uri, tuple((sl.start, sl.stop) for sl in x.selection)) for x in s.epoch_samples()]


@pytest.fixture(scope="module")
def first_job(tmp_path_factory):
    """Two nodes' daemons, and the first job: epoch 0 whole, then one step of epoch 1 and a
    checkpoint (both resumptions go on from it)."""
    root = tmp_path_factory.mktemp("torchrun")
    uris = []
    for k in range(2):
        write_array(root / f"v{k}.zarr", random_data((32, 64, 64), "uint16", seed=k), chunks=(16, 32, 32), compressors=[ZstdCodec()])
        uris.append(str(root / f"v{k}.zarr"))
    daemons = [DaemonProcess(tmp_path_factory.mktemp(f"node{n}"), [root]) for n in range(2)]
    try:
        first = _job(root, uris, daemons, 2, "first", ["--stop-after", "1"])
        yield root, uris, daemons, first
    finally:
        for d in daemons:
            assert d.stop() == 0, d.log_path.read_text()


def test_two_nodes_read_every_sample_once_and_resume_on_fewer_ranks(tmp_path, first_job):
    resume_procs = 1
    root, uris, daemons, first = first_job
    shutil.copytree(root / "ckpt", tmp_path / "ckpt")  # the resumption reads (and writes) a copy of the checkpoint
    second = _job(tmp_path, uris, daemons, resume_procs, "second", [])
    # epoch 0, read whole by the first job: every rank the same number of samples, all once
    per_rank = [[_key(e) for e in log if e[0] == 0] for log in first]
    assert len({len(p) for p in per_rank}) == 1
    assert sorted(k for p in per_rank for k in p) == sorted(_global(uris, 0))
    # epoch 1: one step of each rank in the first job, the rest in the second
    read = [_key(e) for log in first + second for e in log if e[0] == 1]
    glob = _global(uris, 1)
    counts = Counter(read)
    assert all(n == 1 for n in counts.values()), [k for k, n in counts.items() if n > 1]
    assert set(read) <= set(glob) and len(glob) - len(read) < 4 + 2 * resume_procs  # only each share's remainder is dropped
    assert len({len([e for e in log if e[0] == 1]) for log in second}) == 1  # lockstep
