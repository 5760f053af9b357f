"""Long fuzzing runs: ``python -m fuzz TARGET [--minutes N] [--inputs K] [--sanitize]``.

TARGET is one of the targets of ``fuzz/targets.py`` (zarr_json_v3, zarr_json_v2,
shard_index, blosc_frame, copy_table, plan_passes, plan_table, file_job, cache_index), ``wire`` (a real damacyd, started here), or ``all``.
Each runs until K inputs (default 100,000) or N minutes, whichever comes first, and prints
the inputs run. ``--sanitize`` first builds damacy's native extension with AddressSanitizer
and UndefinedBehaviorSanitizer and runs the targets in a child process that loads it (any
report aborts the run with its trace). Exit status 0: every input ended in a result or a
damacy error.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NATIVE_ENV = "DAMACY_FUZZ_NATIVE"  # a sanitized build of damacy_server.native._assemble to load


def _sanitized_build(folder: Path) -> Path:
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    out = folder / f"_assemble{suffix}"
    cmd = [
        os.environ.get("CC", "gcc"), "-shared", "-fPIC", "-O1", "-g", "-std=c11", "-fno-omit-frame-pointer",
        "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
        f"-I{sysconfig.get_paths()['include']}", *sorted(str(p) for p in (ROOT / "damacy_server/native").glob("*.c")),
        "-ldl", "-o", str(out),
    ]
    subprocess.run(cmd, check=True)
    return out


def _load_native(path: str) -> None:
    """Load the sanitized extension as damacy_server.native._assemble (before the package)."""
    name = "damacy_server.native._assemble"
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[name] = module


def _run_target(name: str, inputs: int, seconds: float) -> dict:
    import random

    from hypothesis import HealthCheck, given, seed, settings

    from fuzz.targets import STRATEGIES

    daemon = None
    if name == "wire":
        daemon, target, strategy = _wire()
        check = target.check
    else:
        strategy, check = STRATEGIES[name]
    count = [0]
    deadline = time.monotonic() + seconds

    class Done(BaseException):  # not an Exception: hypothesis lets it out as it is (no replay, no shrinking)
        pass

    drawn = random.SystemRandom().getrandbits(64)  # printed with the result: the run can be replayed

    @seed(drawn)
    @settings(max_examples=inputs, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(strategy)
    def run(item):
        if time.monotonic() > deadline:
            raise Done
        count[0] += 1
        check(item)

    t0 = time.monotonic()
    try:
        run()
    except Done:
        pass
    except Exception:  # hypothesis re-raises the smallest failing input's error
        _stop(daemon)
        raise
    result = {"target": name, "inputs": count[0], "seconds": round(time.monotonic() - t0, 1), "seed": drawn}
    if daemon is not None:
        result.update(_after_wire(daemon, target))
    return result


def _wire():
    import numpy as np
    import zarr

    from fuzz.wire import WireTarget, messages

    folder = Path(tempfile.mkdtemp(prefix="damacy-fuzz-wire-"))
    data = np.arange(6 * 9, dtype="uint16").reshape(6, 9)
    zarr.create_array(str(folder / "a.zarr"), shape=data.shape, chunks=(2, 3), dtype=data.dtype)[...] = data
    endpoint = f"ipc://{folder}/d.sock"
    log = open(folder / "damacyd.log", "ab")
    proc = subprocess.Popen(["damacyd", "--endpoint", endpoint, "--allow-root", str(folder), "--memory", "256M",
                             "--max-message-size", "64K", "--heartbeat-timeout", "3"], stdout=log, stderr=subprocess.STDOUT)
    from damacy_runtime.probe import ping

    t0 = time.monotonic()
    while not ping(endpoint, timeout_s=0.2):
        if proc.poll() is not None or time.monotonic() - t0 > 30:
            raise SystemExit(f"damacyd did not start: {(folder / 'damacyd.log').read_text()}")
    target = WireTarget(endpoint, proc.pid)
    _serve(endpoint, folder, data)
    daemon = {"proc": proc, "folder": folder, "data": data, "endpoint": endpoint}
    from fuzz.wire import rss_bytes

    daemon["baseline"] = rss_bytes(proc.pid)
    return daemon, target, messages(str(folder))


def _serve(endpoint: str, folder: Path, data) -> None:
    import numpy as np

    import damacy

    # 9 samples in batches of 2: the last one short (drop_last=False), every sample checked
    cfg = damacy.Config(samples_per_batch=2, sample_shape=(2, 3), dtype="uint16", pop_timeout_s=60, drop_last=False)
    samples = [damacy.Sample(str(folder / "a.zarr"), np.s_[r : r + 2, c : c + 3]) for r in (0, 2, 4) for c in (0, 3, 6)]
    with damacy.Pipeline(cfg, endpoint=endpoint) as pipe:
        pipe.push(samples)
        got = np.concatenate([b.copy() for b in pipe])
    if not all(np.array_equal(got[k], data[s.selection]) for k, s in enumerate(samples)):
        raise AssertionError("damacyd served a wrong batch")


def _after_wire(daemon: dict, target) -> dict:
    import damacy
    from fuzz.wire import rss_bytes

    proc = daemon["proc"]
    deadline = time.monotonic() + 60
    while True:  # the fuzzed sessions are reclaimed (heartbeat timeout 3 s)
        with damacy.Pipeline(damacy.Config(samples_per_batch=1, sample_shape=(1,)), endpoint=daemon["endpoint"]) as p:
            left = len([s for s in p.stats_dict()["sessions"] if not s["control"]]) - 1
        if left == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    _serve(daemon["endpoint"], daemon["folder"], daemon["data"])
    grown = rss_bytes(proc.pid) - daemon["baseline"]
    target.close()
    _stop(daemon)
    return {"messages": target.sent, "sessions_left": left, "rss_growth_mib": round(grown / 2**20, 1), "served_after": True}


def _stop(daemon: dict | None) -> None:
    if daemon is not None and daemon["proc"].poll() is None:
        daemon["proc"].terminate()
        daemon["proc"].wait(30)


def main() -> int:
    if NATIVE_ENV in os.environ:  # before anything imports damacy (which loads its native module)
        _load_native(os.environ[NATIVE_ENV])
    from fuzz.targets import STRATEGIES

    names = sorted(STRATEGIES) + ["wire"]
    parser = argparse.ArgumentParser(prog="python -m fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", choices=names + ["all"])
    parser.add_argument("--minutes", type=float, default=60.0, help="per target")
    parser.add_argument("--inputs", type=int, default=100_000, help="per target")
    parser.add_argument("--sanitize", action="store_true", help="build the native extension with ASan and UBSan and run under it")
    parser.add_argument("--json", action="store_true", help="print one JSON object per target")
    args = parser.parse_args()

    if args.sanitize and NATIVE_ENV not in os.environ:
        folder = Path(tempfile.mkdtemp(prefix="damacy-asan-"))
        path = _sanitized_build(folder)
        libasan = subprocess.run([os.environ.get("CC", "gcc"), "-print-file-name=libasan.so"], capture_output=True, text=True, check=True).stdout.strip()
        env = dict(os.environ, **{NATIVE_ENV: str(path), "LD_PRELOAD": libasan,
                                  "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:halt_on_error=1",
                                  "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"})
        argv = [sys.executable, "-m", "fuzz", *sys.argv[1:]]
        return subprocess.run(argv, env=env, cwd=ROOT).returncode
    if NATIVE_ENV in os.environ:
        from damacy_server.native import _assemble

        assert _assemble.__file__ == os.environ[NATIVE_ENV], "the sanitized build was not the one loaded"

    for name in names if args.target == "all" else [args.target]:
        result = _run_target(name, args.inputs, args.minutes * 60)
        result["sanitized"] = NATIVE_ENV in os.environ
        print(json.dumps(result) if args.json else "  ".join(f"{k}={v}" for k, v in result.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
