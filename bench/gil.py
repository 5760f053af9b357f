"""``python -m bench gil``: how much of damacy's work holds the interpreter lock, and what that
caps on a big node.

Each workload runs in its own process (embedded: the training process; daemon: damacyd, with
client processes beside it). It warms up, then py-spy attaches and samples it with ``--gil``
(a sample is taken only when some thread holds the GIL) while the measured phase runs; the
process is idle (blocked, not holding the lock) before and after that phase. So

- GIL share of wall = GIL-held samples / (rate x the phase's seconds): the fraction of the
  time some thread of the process held the lock;
- GIL share of CPU = GIL-held seconds / the process's CPU seconds in the phase: the serial
  fraction ``s`` of the work, the part no number of cores runs in parallel;
- the Amdahl ceiling on N cores = 1 / (s + (1 - s) / N) cores' worth of work, and 1 / s on any
  number of cores.

Repeats are interleaved (every workload once, then again); the figures are medians. The
GIL-held frames most often on top of the stacks are printed for the last repeat, the places
to take off the interpreter next. py-spy must be installed (``pip install py-spy``) and
allowed to read the processes (ptrace).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench import daemon as daemon_bench
from bench import runners
from bench.data import ensure
from bench.scenarios import DEFAULT, SCENARIOS

ROOT = str(Path(__file__).resolve().parents[1])
CORES = (16, 64, 128)

# An embedded workload: warm up, say "ready", wait for "go", run the measured phase, report,
# then wait (blocked on stdin, the GIL released) until told to exit.
EMBEDDED = r"""
import json, resource, sys, time
sys.path.insert(0, {root!r})
import numpy as np
import damacy
from bench import runners, thin
from bench.scenarios import SCENARIOS, DEFAULT
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
kind, uris, batches, seed = {kind!r}, {uris!r}, {batches}, {seed}
if kind == "planes-cached":
    scn = thin.Scn(1)
    epoch = thin.epoch_samples(uris, "planes")
    data_bytes = len(uris) * int(np.prod(DEFAULT.shape)) * 2
    cfg = runners.damacy_config(scn, chunk_cache_bytes=2 * data_bytes)
    warm = epoch
    rng = np.random.default_rng(seed)
    # at least 4 epochs: one of cached planes passes in under a second, too short a phase to sample
    measured = [epoch[i] for i in rng.permutation(len(epoch))] * max(4, -(-batches * scn.samples_per_batch // len(epoch)))
else:
    scn = SCENARIOS[kind]
    cfg = runners.damacy_config(scn)
    warm = scn.samples(uris, 2, seed=10_000 + seed)
    measured = scn.samples(uris, batches, seed=seed)
with damacy.Pipeline(cfg) as pipe:
    pipe.push(warm)
    for b in pipe.batches():
        b.release()
    print("ready", flush=True)
    sys.stdin.readline()
    t0, c0 = time.perf_counter(), cpu()
    pipe.push(measured)
    for b in pipe.batches():
        b.release()
    out = {{"seconds": time.perf_counter() - t0, "cpu": cpu() - c0, "samples": len(measured)}}
print(json.dumps(out), flush=True)
sys.stdin.read()
"""

WORKLOADS = {
    "boxes": "random boxes 64x128x128 f32 of the default data, batches of 8, embedded",
    "small-chunks": "the same boxes of data in 16x32x32 chunks, embedded",
    "planes-cached": "planes 1x512x512 f32 of the default data, every chunk in the chunk cache, embedded",
    "daemon": "the random boxes through damacyd, 2 client processes (the daemon's GIL)",
}
DATA = {"boxes": DEFAULT, "planes-cached": DEFAULT, "daemon": DEFAULT, "small-chunks": SCENARIOS["small-chunks"].dataset}
SCENARIO = {"boxes": "default", "small-chunks": "small-chunks", "daemon": "default"}


class Profiler:
    """py-spy recording one process's GIL-held samples until stopped."""

    def __init__(self, pid: int, rate: int, out: Path) -> None:
        exe = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
        if exe is None:
            raise SystemExit("python -m bench gil needs py-spy: pip install py-spy")
        self.out = out
        self.log = out.with_suffix(".log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [exe, "record", "--pid", str(pid), "--gil", "--nonblocking", "-r", str(rate), "-f", "raw", "-o", str(out)],
                stdout=log,  # its banner and summary are written here
                stderr=subprocess.STDOUT,
            )
        # its banner says it is sampling; until then a "go" would start the phase unwatched
        deadline = time.monotonic() + 30
        while "Sampling process" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"py-spy could not sample pid {pid} (ptrace not allowed?): {self.log.read_text().strip()}")
            time.sleep(0.01)

    def stop(self) -> Counter:
        """Stop sampling; the GIL-held stacks and their sample counts."""
        self.proc.send_signal(signal.SIGINT)
        self.proc.communicate(timeout=60)
        stacks: Counter = Counter()
        if self.out.exists():
            for line in self.out.read_text().splitlines():
                stack, _, n = line.rpartition(" ")
                if stack:
                    stacks[stack] += int(n)
        return stacks


def _embedded(kind: str, uris: list[str], batches: int, seed: int, rate: int, tmp: Path) -> tuple[dict, Counter]:
    code = EMBEDDED.format(root=ROOT, kind=SCENARIO.get(kind, kind), uris=uris, batches=batches, seed=seed)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"the {kind} workload failed while warming up: exit {proc.wait()}")
        spy = Profiler(proc.pid, rate, tmp / f"{kind}.raw")
        proc.stdin.write("go\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        stacks = spy.stop()
        if not line:
            raise SystemExit(f"the {kind} workload failed: exit {proc.wait()}")
        return json.loads(line), stacks
    finally:
        proc.stdin.close()
        proc.wait(60)


def _daemon(uris: list[str], data: Path, batches: int, seed: int, rate: int, tmp: Path, clients: int = 2) -> tuple[dict, Counter]:
    proc, endpoint = daemon_bench.start_daemon(data, tmp)

    def run_clients(base_seed: int) -> list[dict]:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", daemon_bench.CLIENT.format(root=ROOT, scenario="default", uris=uris, batches=batches, seed=base_seed + c, endpoint=endpoint)],
                stdout=subprocess.PIPE,
                text=True,
            )
            for c in range(clients)
        ]
        return [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]

    try:
        run_clients(10_000 + 100 * seed)  # metadata and shard indexes cached, sessions' first costs paid
        spy = Profiler(proc.pid, rate, tmp / "daemon.raw")
        d0 = runners.proc_cpu(proc.pid)
        results = run_clients(100 * seed)
        cpu = runners.proc_cpu(proc.pid) - d0
        stacks = spy.stop()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    seconds = max(r["end"] for r in results) - min(r["start"] for r in results)
    return {"seconds": seconds, "cpu": cpu, "samples": sum(r["samples"] for r in results)}, stacks


def figures(run: dict, stacks: Counter, rate: int) -> dict:
    """A run's throughput, CPU per sample, GIL shares and the Amdahl ceilings they imply."""
    gil_s = sum(stacks.values()) / rate
    s = min(1.0, gil_s / run["cpu"]) if run["cpu"] > 0 else 1.0
    out = {
        "samples_per_s": run["samples"] / run["seconds"],
        "cpu_ms_per_sample": 1e3 * run["cpu"] / run["samples"],
        "gil_share_of_wall": gil_s / run["seconds"],
        "gil_share_of_cpu": s,
        "gil_samples": sum(stacks.values()),
    }
    for n in CORES:
        out[f"ceiling_{n}_cores"] = 1.0 / (s + (1.0 - s) / n)
    out["ceiling_any_cores"] = 1.0 / s if s > 0 else float("inf")
    return out


def top_frames(stacks: Counter, n: int = 12) -> list[tuple[str, float]]:
    """The frames most often on top of a GIL-held stack, with their share of those samples
    (damacy's frames, or the library frame a damacy frame called into)."""
    total = sum(stacks.values()) or 1
    leaf: Counter = Counter()
    for stack, count in stacks.items():
        frames = stack.split(";")
        leaf[frames[-1].strip() or "(native, no Python frame)"] += count
    return [(f, c / total) for f, c in leaf.most_common(n)]


def inclusive_frames(stacks: Counter, n: int = 12) -> list[tuple[str, float]]:
    """damacy's functions by the share of GIL-held samples they are on the stack for (a
    function and what it calls): where the serial time is spent, by caller."""
    total = sum(stacks.values()) or 1
    incl: Counter = Counter()
    for stack, count in stacks.items():
        names = {f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0] + ")" for f in stack.split(";") if "damacy" in f and " (" in f}
        for name in names:
            incl[name] += count
    return [(f, c / total) for f, c in incl.most_common(n)]


def main(kinds: list[str], data_dir: str, batches: int, repeats: int, rate: int, keep: str | None = None) -> dict:
    data = Path(data_dir).resolve()
    uris = {k: ensure(DATA[k], data) for k in kinds}
    tmp = Path(tempfile.mkdtemp(prefix="damacy-gil-"))
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    last: dict[str, Counter] = {}
    try:
        for rep in range(repeats):
            for kind in kinds:
                if kind == "daemon":
                    run, stacks = _daemon(uris[kind], data, batches, rep, rate, tmp)
                else:
                    run, stacks = _embedded(kind, uris[kind], batches, rep, rate, tmp)
                runs[kind].append(figures(run, stacks, rate))
                if keep is not None:
                    Path(keep).mkdir(parents=True, exist_ok=True)
                    (Path(keep) / f"{kind}-{rep + 1}.raw").write_text("".join(f"{s} {c}\n" for s, c in stacks.items()))
                last[kind] = stacks
                f = runs[kind][-1]
                print(f"  repeat {rep + 1} {kind:14} {f['samples_per_s']:8.1f}/s {f['cpu_ms_per_sample']:7.3f} ms CPU  GIL {100 * f['gil_share_of_cpu']:5.1f}% of CPU", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res: dict = {"batches": batches, "repeats": repeats, "rate_hz": rate, "cpus": runners.CPUS, "method": "py-spy record --gil --nonblocking", "workloads": {}}
    head = f"{'workload':14} {'samples/s':>10} {'CPU ms':>8} {'GIL/wall':>9} {'GIL/CPU':>8} " + " ".join(f"{'<=' + str(n) + ' cores':>10}" for n in CORES) + f" {'any':>7}"
    print("\n" + head)
    for kind in kinds:
        med = {key: statistics.median(r[key] for r in runs[kind]) for key in runs[kind][0]}
        res["workloads"][kind] = {"description": WORKLOADS[kind], "median": med, "repeats": runs[kind], "top_gil_frames": top_frames(last[kind]), "inclusive_gil_frames": inclusive_frames(last[kind])}
        print(
            f"{kind:14} {med['samples_per_s']:10.1f} {med['cpu_ms_per_sample']:8.3f} {100 * med['gil_share_of_wall']:8.1f}% {100 * med['gil_share_of_cpu']:7.1f}% "
            + " ".join(f"{med[f'ceiling_{n}_cores']:10.1f}" for n in CORES)
            + f" {med['ceiling_any_cores']:7.1f}"
        )
    print("\n(ceilings: cores' worth of work on that many cores, Amdahl's law with the GIL share of CPU as the serial part)")
    for kind in kinds:
        print(f"\n{kind}: frames on top of GIL-held stacks (last repeat)")
        for frame, share in res["workloads"][kind]["top_gil_frames"]:
            print(f"  {100 * share:5.1f}%  {frame}")
        print(f"{kind}: damacy's functions on GIL-held stacks, with what they call (last repeat)")
        for frame, share in res["workloads"][kind]["inclusive_gil_frames"]:
            print(f"  {100 * share:5.1f}%  {frame}")
    return res
