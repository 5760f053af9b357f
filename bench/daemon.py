"""Daemon mode: damacyd serving 1 and 2 client processes, against the embedded engine.

Reports, over interleaved repeats, the aggregate throughput of the clients and the CPU
they and the daemon use per sample, and the cost of a pop when its batch is already
prepared (the daemon's per-batch overhead: a round trip and a shared-memory view).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import runners
from bench.data import ensure
from damacy_runtime.probe import ping

CLIENT = r"""
import json, resource, sys, time
sys.path.insert(0, {root!r})
from bench.scenarios import SCENARIOS
from bench import runners
import damacy
import damacy_client.client  # loaded before the clock starts, as in a training process that has imported its reader
scn = SCENARIOS[{scenario!r}]
samples = scn.samples({uris!r}, {batches}, seed={seed})
cfg = runners.damacy_config(scn)
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
t0, c0 = time.time(), cpu()
with damacy.Pipeline(cfg, endpoint={endpoint!r}) as pipe:
    pipe.push(samples)
    for batch in pipe.batches():
        batch.release()
print(json.dumps({{"start": t0, "end": time.time(), "cpu": cpu() - c0, "samples": len(samples)}}))
"""


def start_daemon(data: Path, folder: Path, extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    endpoint = f"ipc://{folder}/bench.sock"
    exe = shutil.which("damacyd", path=os.path.dirname(sys.executable)) or "damacyd"
    proc = subprocess.Popen(
        [exe, "--endpoint", endpoint, "--allow-root", str(data), "--memory", "4G", "--log-level", "warning", *extra],
    )
    t0 = time.monotonic()
    while not ping(endpoint, 0.2):
        if proc.poll() is not None or time.monotonic() - t0 > 30:
            raise SystemExit("damacyd did not start")
    return proc, endpoint


def measure_pop(cfg, uri: str, endpoint: str | None, rounds: int = 10, step_s: float = 0.005) -> float:
    """Median seconds of pop + release when every batch is already prepared: all samples
    are pushed (the input is finite and within the lookahead) and assembled first, and the
    loop spends ``step_s`` between pops, as a training step would."""
    import damacy

    times = []
    n = cfg.prepared_batches * cfg.samples_per_batch
    for _ in range(rounds):
        pipe = damacy.Pipeline(cfg, endpoint=endpoint) if endpoint else damacy.EmbeddedPipeline(cfg)
        with pipe:
            pipe.push([damacy.Sample(uri, np.s_[0:8, 0:8, 0:8]) for _ in range(n)])
            time.sleep(0.5)  # every slot is filled by now
            for _ in range(cfg.prepared_batches):
                t0 = time.perf_counter()
                batch = pipe.pop()
                batch.release()
                times.append(time.perf_counter() - t0)
                time.sleep(step_s)
    return statistics.median(times)


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(scenario_name: str, data_dir: str, batches: int, repeats: int, clients: list[int]) -> dict:
    """Interleaved repeats (embedded, daemon with 1 client, with 2, ...; again): median
    samples/s and CPU ms per sample (daemon and clients together) of each."""
    import damacy
    from bench.scenarios import SCENARIOS

    scn = SCENARIOS[scenario_name]
    data = Path(data_dir).resolve()
    uris = ensure(scn.dataset, data)
    folder = Path(tempfile.mkdtemp(prefix="damacy-bench-"))
    proc, endpoint = start_daemon(data, folder)
    out: dict = {"scenario": scenario_name, "batches_per_client": batches, "repeats": repeats}
    modes = ["embedded"] + [f"daemon_{k}" for k in clients]
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    cpu_ms: dict[str, list[float]] = {mode: [] for mode in modes}
    try:
        cfg = damacy.Config(samples_per_batch=8, sample_shape=(8, 8, 8), dtype="f32", prepared_batches=8, lookahead_samples=64, pop_timeout_s=60)
        out["pop_ready_ms"] = {
            "embedded": 1e3 * measure_pop(cfg, uris[0], None),
            "daemon": 1e3 * measure_pop(cfg, uris[0], endpoint),
        }
        out["pop_ready_ms"]["overhead"] = out["pop_ready_ms"]["daemon"] - out["pop_ready_ms"]["embedded"]
        n = batches * scn.samples_per_batch
        root = str(Path(__file__).resolve().parents[1])
        for rep in range(repeats):
            c0 = _self_cpu()
            rates["embedded"].append(n / runners.run_damacy(scn, scn.samples(uris, batches, seed=rep))["seconds"])
            cpu_ms["embedded"].append(1e3 * (_self_cpu() - c0) / n)
            for k in clients:
                d0 = runners.proc_cpu(proc.pid)
                procs = [
                    subprocess.Popen(
                        [sys.executable, "-c", CLIENT.format(root=root, scenario=scenario_name, uris=uris, batches=batches, seed=100 * rep + c, endpoint=endpoint)],
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                    for c in range(k)
                ]
                results = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
                daemon_cpu = runners.proc_cpu(proc.pid) - d0
                wall = max(r["end"] for r in results) - min(r["start"] for r in results)
                total = sum(r["samples"] for r in results)
                rates[f"daemon_{k}"].append(total / wall)
                cpu_ms[f"daemon_{k}"].append(1e3 * (daemon_cpu + sum(r["cpu"] for r in results)) / total)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        shutil.rmtree(folder, ignore_errors=True)
    for mode in modes:
        out[f"{mode}_samples_per_s"] = statistics.median(rates[mode])
        out[f"{mode}_cpu_ms_per_sample"] = statistics.median(cpu_ms[mode])
        out[f"{mode}_runs"] = {"samples_per_s": rates[mode], "cpu_ms_per_sample": cpu_ms[mode]}
    print(f"\n== daemon mode, {scenario_name}: {batches} batches of {scn.samples_per_batch} per client, {repeats} interleaved repeats")
    p = out["pop_ready_ms"]
    print(
        f"pop + release of a prepared batch (5 ms step between pops): embedded {p['embedded']:.3f} ms, "
        f"daemon {p['daemon']:.3f} ms (overhead {p['overhead']:.3f} ms per batch)"
    )
    base, base_cpu = out["embedded_samples_per_s"], out["embedded_cpu_ms_per_sample"]
    print(f"embedded              {base:8.1f} samples/s   {base_cpu:6.2f} ms CPU/sample")
    for k in clients:
        rate, cpu = out[f"daemon_{k}_samples_per_s"], out[f"daemon_{k}_cpu_ms_per_sample"]
        print(
            f"daemon, {k} client(s)   {rate:8.1f} samples/s   {cpu:6.2f} ms CPU/sample (daemon and clients)"
            f"   {rate / base:.2f}x embedded, CPU {cpu / base_cpu:.2f}x"
        )
    return out
