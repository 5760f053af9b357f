"""``damacy demo``: the volume it writes is a Zarr v3 array zarr-python reads alike, and the
command streams it (embedded and through a damacyd) from a fresh cache folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import zarr
from zarr.codecs import ZstdCodec

import damacy
from damacy import demo

from conftest import random_data, write_array


def damacy_command() -> list[str]:
    exe = shutil.which("damacy", path=os.path.dirname(sys.executable)) or shutil.which("damacy")
    assert exe, "the damacy command is not installed (pip install -e .)"
    return [exe]


def test_the_demo_writer_writes_what_zarr_python_reads(tmp_path):
    data = random_data((40, 70, 33), "uint16", 9)  # edges: shards and chunks past the end
    demo.write_volume(tmp_path / "w.zarr", data, shards=(32, 64, 32), chunks=(16, 32, 16))
    assert np.array_equal(zarr.open_array(tmp_path / "w.zarr", mode="r")[...], data)
    assert np.array_equal(damacy.read(tmp_path / "w.zarr"), data)
    assert not list(tmp_path.glob("w.zarr.part*"))


def test_a_demo_volume_cut_short_leaves_nothing_and_is_readable_by_others(tmp_path, monkeypatch):
    import stat

    data = random_data((16, 16, 16), "uint16", 4)
    calls = []

    def interrupted(self, *args, **kwargs):
        calls.append(self)
        if len(calls) == 2:  # Ctrl-C while the shards are written
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    real = demo.Path.write_bytes
    monkeypatch.setattr(demo.Path, "write_bytes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        demo.write_volume(tmp_path / "v.zarr", data, shards=(8, 16, 16), chunks=(8, 8, 8))
    monkeypatch.undo()
    assert not list(tmp_path.glob("v.zarr*"))  # no half-written folder left behind
    demo.write_volume(tmp_path / "v.zarr", data, shards=(8, 16, 16), chunks=(8, 8, 8))
    mode = stat.S_IMODE((tmp_path / "v.zarr").stat().st_mode)
    assert mode == 0o777 & ~demo._umask(), oct(mode)  # as a folder made here is, not mkdtemp's 700


def test_two_demos_writing_at_once_leave_one_whole_volume(tmp_path):
    # each writes a folder of its own; the first to finish is kept, the other's dropped (they
    # shared one folder, and one's cleanup deleted the other's shards: zeros, for ever)
    import threading

    data = random_data((64, 64, 64), "uint16", 3)
    errors = []

    def write() -> None:
        try:
            demo.write_volume(tmp_path / "v.zarr", data, shards=(16, 16, 16), chunks=(8, 8, 8))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    writers = [threading.Thread(target=write) for _ in range(3)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    assert not errors
    assert np.array_equal(zarr.open_array(tmp_path / "v.zarr", mode="r")[...], data)
    assert not list(tmp_path.glob("v.zarr.part*"))


def test_demo_writes_its_volume_once_and_streams_it(tmp_path):
    run = lambda *args: subprocess.run([*damacy_command(), "demo", *args], capture_output=True, text=True, timeout=300)  # noqa: E731
    first = run("--size", "small", "--batches", "3", "--data-dir", str(tmp_path))
    assert first.returncode == 0, first.stderr
    assert "writing the demo volume" in first.stderr and "done: 24 samples" in first.stdout
    live = first.stdout.split("\r")[-1]  # the live line, as last drawn
    assert "3/3 batches" in live and "samples/s" in live and "GB/s" in live and "decode" in live
    volume = tmp_path / "demo-small.zarr"
    shape, _, _ = demo.SIZES["small"]
    assert damacy.open_array(volume).shape == shape
    again = run("--size", "small", "--batches", "2", "--batch-size", "3", "--data-dir", str(tmp_path))
    assert again.returncode == 0 and "writing" not in again.stderr and "done: 6 samples" in again.stdout


def test_demo_streams_a_given_array_through_a_damacyd(tmp_path, daemon):
    write_array(tmp_path / "a.zarr", random_data((20, 30), "float32", 2), chunks=(10, 10), compressors=[ZstdCodec()])
    out = subprocess.run(
        [*damacy_command(), "demo", str(tmp_path / "a.zarr"), "--batches", "2", "--endpoint", daemon.endpoint],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"damacyd at {daemon.endpoint}" in out.stdout and "(20, 30) float32" in out.stdout and "done: 16 samples" in out.stdout


def test_demo_names_a_bad_uri(tmp_path):
    out = subprocess.run([*damacy_command(), "demo", str(tmp_path / "nothing.zarr")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "nothing.zarr" in out.stderr and "Traceback" not in out.stderr
    (tmp_path / "a-file").write_text("")
    out = subprocess.run([*damacy_command(), "demo", "--size", "small", "--data-dir", str(tmp_path / "a-file" / "x")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "cannot write the demo volume" in out.stderr and "Traceback" not in out.stderr


def test_demo_without_an_endpoint_is_embedded_even_where_a_damacyd_answers(daemon):
    # the node's daemon may not serve the user's cache folder: the demo says embedded and is
    import tempfile

    env = {**os.environ, "DAMACY_ENDPOINT": daemon.endpoint}
    outside = tempfile.mkdtemp(prefix="damacy-demo-")  # not under the daemon's roots
    try:
        out = subprocess.run(
            [*damacy_command(), "demo", "--size", "small", "--batches", "2", "--data-dir", outside],
            capture_output=True, text=True, timeout=300, env=env,
        )
    finally:
        shutil.rmtree(outside, ignore_errors=True)
    assert out.returncode == 0, out.stderr
    assert "(embedded)" in out.stdout and "done: 16 samples" in out.stdout


def test_both_commands_say_their_version():
    from importlib.metadata import version

    for exe in (damacy_command()[0], shutil.which("damacyd", path=os.path.dirname(sys.executable))):
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and version("damacy") in out.stdout and os.path.basename(exe) in out.stdout
