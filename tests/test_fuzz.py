"""The fuzz targets (``fuzz/targets.py``) for a short while each: every generated input ends in
a result or a clear damacy error, and valid inputs read correctly. ``python -m fuzz TARGET
--minutes N [--sanitize]`` runs the same targets for long. DAMACY_FUZZ_EXAMPLES sets the
inputs per target here (default 150)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from fuzz.targets import STRATEGIES

EXAMPLES = int(os.environ.get("DAMACY_FUZZ_EXAMPLES", "150"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(autouse=True)
def _scratch(tmp_path, monkeypatch):
    monkeypatch.setenv("DAMACY_FUZZ_DIR", str(tmp_path))


@pytest.mark.parametrize("target", sorted(STRATEGIES))
def test_every_input_ends_in_a_result_or_a_damacy_error(target):
    strategy, check = STRATEGIES[target]
    seen = []

    @SETTINGS
    @given(strategy)
    def run(item):
        seen.append(1)
        check(item)

    run()
    assert len(seen) >= min(EXAMPLES, 50)  # the target ran, on many inputs


def test_the_targets_notice_what_they_guard(tmp_path, monkeypatch):
    """The checks can fail: a copy table that writes past its target is caught by the guards,
    and an unmodified shard that reads wrong is caught by the comparison."""
    from fuzz import targets

    monkeypatch.setenv("DAMACY_FUZZ_DIR", str(tmp_path))
    _, data, shard = targets.sharded_array()
    targets.check_shard_index(shard)  # the original reads as written
    monkeypatch.setitem(targets._SHARDED, "data", data + 1)
    with pytest.raises(AssertionError):
        targets.check_shard_index(shard)
    # a table whose target shape is larger than its memory: native code trusts the shape
    from damacy_server import native

    if not native.available():
        pytest.skip("the native extension was not built")
    real = native.targets

    def lying(views, ndim, norms=()):
        out = real(views, ndim, norms)
        out[:, 1 + ndim : 1 + 2 * ndim] *= 4  # shapes four times too large: copies run past the arena
        return out

    monkeypatch.setattr(native, "targets", lying)
    t = dict(ndim=1, unit_shape=[6], rows=[[0, 0, 0, 4, 6]], pool=[], out_shapes=[[4]], spans=[(0, 6)], dtypes=("uint8", "uint8"), norm=False, base=0)
    with pytest.raises(AssertionError, match="outside its target"):
        targets.check_copy_table(t)
    # the planner's native passes are held to numpy's forms: a numpy form that differs is caught
    from damacy_server.plan import rows as planner_rows

    passes = dict(shape=[10, 7], unit=[4, 3], boxes=[[0, 1, 2, 6, 7], [1, 0, 0, 10, 7]])
    targets.check_plan_passes(passes)
    monkeypatch.setattr(planner_rows, "box_rows_numpy", lambda boxes, shape, unit: np.zeros((1, 9), dtype=np.int64))
    with pytest.raises(AssertionError, match="box_rows differs"):
        targets.check_plan_passes(passes)
    table = dict(ndim=1, rows=[[0, 1, 0, 0, 2], [1, 0, 1, 2, 1]], inverse=[1, 0], hit=[False, True], dropped=None,
                 missing=[False, False], owners=[0, 0], offsets=[5, 3], nbytes=[4, 4], spoiled=None)
    targets.check_plan_table(table)
    real_table = planner_rows.plan_table_numpy
    monkeypatch.setattr(planner_rows, "plan_table_numpy", lambda *a: (real_table(*a)[0][::-1], *real_table(*a)[1:]))
    with pytest.raises(AssertionError, match="plan_table's order differs"):
        targets.check_plan_table(table)



def test_the_wire_protocol_fuzzed_against_a_real_damacyd(tmp_path):
    """Random, mutated and out-of-order messages on many connections: the daemon answers a
    ping after each conversation, then serves a correct batch, its sessions reclaimed and its
    memory near where it started."""
    from zarr.codecs import ZstdCodec

    import damacy
    from fuzz.wire import WireTarget, messages, rss_bytes

    from conftest import write_array
    from daemon_helpers import DaemonProcess, wait_for

    data = np.arange(6 * 9, dtype="uint16").reshape(6, 9)
    write_array(tmp_path / "a.zarr", data, chunks=(2, 3), compressors=[ZstdCodec()])
    proc = DaemonProcess(tmp_path, [tmp_path], extra=["--memory", "256M", "--max-message-size", "64K"])
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(2, 3), dtype="uint16", pop_timeout_s=60, drop_last=False)  # 9 samples
    samples = [damacy.Sample(str(tmp_path / "a.zarr"), np.s_[r : r + 2, c : c + 3]) for r in (0, 2, 4) for c in (0, 3, 6)]

    def serve_correctly() -> None:
        with damacy.Pipeline(cfg, endpoint=proc.endpoint) as pipe:
            pipe.push(samples)
            got = np.concatenate([b.copy() for b in pipe])
        assert all(np.array_equal(got[k], data[s.selection]) for k, s in enumerate(samples))

    def sessions() -> int:
        with damacy.Pipeline(damacy.Config(samples_per_batch=1, sample_shape=(1,)), endpoint=proc.endpoint) as p:
            return len([s for s in p.stats_dict()["sessions"] if not s["control"]]) - 1  # not this one

    target = WireTarget(proc.endpoint, proc.pid)
    try:
        serve_correctly()
        baseline = rss_bytes(proc.pid)

        @SETTINGS
        @given(messages(str(tmp_path)))
        def run(item):
            target.check(item)

        run()
        assert target.sent >= min(EXAMPLES, 50)
        wait_for(lambda: sessions() == 0, timeout=60, what="the fuzzed sessions to be reclaimed")
        serve_correctly()
        grown = rss_bytes(proc.pid) - baseline
        assert grown < 64 << 20, f"damacyd grew by {grown >> 20} MiB over the fuzzing"
    finally:
        target.close()
        assert proc.stop() == 0, proc.log_path.read_text()[-3000:]


def test_what_fuzzing_found_stays_fixed(tmp_path):
    """Regressions: a v2 .zarray whose filters are not a list, or whose blosc shuffle is not
    one of Blosc's, was a TypeError (not a MetadataError); a Blosc frame of 0-byte items
    divided by zero in the frame check; an op table's unit number at the bottom of int64
    overflowed when the native checks subtracted the base (UBSan; the wrapped value was refused
    too, so only ``python -m fuzz copy_table --sanitize`` tells the two apart: this checks the
    refusal)."""
    import json

    import damacy

    base = {"zarr_format": 2, "shape": [6, 8], "chunks": [4, 4], "dtype": "<u2", "fill_value": 7, "order": "C", "compressor": None}
    for k, (change, words) in enumerate([({"filters": True}, "filters must be a list"),
                                         ({"compressor": {"id": "blosc", "shuffle": [1]}}, "blosc shuffle"),
                                         ({"compressor": {"id": "blosc", "shuffle": 7}}, "blosc shuffle")]):
        folder = tmp_path / f"a{k}"
        folder.mkdir()
        (folder / ".zarray").write_text(json.dumps({**base, **change}))
        with pytest.raises(damacy.MetadataError, match=words):
            damacy.open_array(str(folder))

    # a Blosc frame whose header says items of 0 bytes: a ZeroDivisionError in the frame check
    from damacy_server.zarr.codecs.base import CorruptData
    from damacy_server.zarr.codecs.blosc import BloscCodec, parse_frame

    frame = bytearray(__import__("numcodecs").Blosc(cname="lz4", shuffle=1).encode(np.arange(300, dtype="u2")))
    frame[3] = 0  # typesize
    with pytest.raises(CorruptData, match="items of 0 bytes"):
        parse_frame(bytes(frame))
    with pytest.raises(CorruptData):
        BloscCodec("lz4", 5, "shuffle", 2).decode(bytes(frame), 600)

    from damacy_server import native

    if not native.available():
        return
    from damacy_server.native import _assemble

    out = np.zeros(4, dtype=np.uint8)
    ops = np.array([[-(2**63), 0, 0, 0, 4]], dtype=np.int64)
    with pytest.raises(ValueError, match="grouped by unit"):
        _assemble.run(bytes(4), 0, np.array([[0, 4]], dtype=np.int64), ops, 1, native.targets([out], 1), np.array([4], dtype=np.int64),
                      2, 2, 0, native.CODEC_RAW, 4, np.zeros(0, dtype=np.int64), b"")
