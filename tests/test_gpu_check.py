"""scripts/gpu-check, the hardware check of the CUDA path, runs end to end on the host
stand-in device (so a GPU session starts from a script known to work), and says what it
does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from damacy_server.cuda import twin

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu-check"


def test_help_says_what_it_checks():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True).stdout
    for word in ("zstd", "lz4", "convert", "unshuffle", "pipeline", "quickstart", "ipc", "--host", "--wheelhouse", "--prepare"):
        assert word in out


@pytest.mark.skipif(not twin.available(), reason="the kernels' host twin was not built (no C compiler)")
def test_every_check_passes_on_the_host_stand_in(tmp_path):
    work = tmp_path / ("tmp-" + "x" * 64)  # a long TMPDIR: the daemon's socket must not go there (107 bytes at most)
    work.mkdir()
    env = {**os.environ, "TMPDIR": str(work)}
    run = subprocess.run([sys.executable, str(SCRIPT), "--host", "--quick", "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert set(report) == {"versions", "zstd", "lz4", "convert", "unshuffle", "pipeline", "quickstart", "ipc"}
    assert all(r["ok"] for r in report.values())
    assert report["zstd"]["frames"] == 12 and report["pipeline"]["batches"] == 2
