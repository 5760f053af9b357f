"""Object-store reads: the scenario's data served over HTTP with Range, each request answered
after an injected latency (the round trip of a cloud region), read by damacy (``http://``
uris), tensorstore (its ``http`` kvstore driver) and zarr-python (obstore's HTTPStore) on
the same samples, values checked equal first; medians of interleaved repeats, with the
readers' CPU ms per sample (this process; the server's own CPU is reported apart).

The server (``bench/http_server.py``) answers from its own process with ``sendfile``; where
the kernel allows it, ``tc qdisc add dev lo root netem delay`` would put the latency on the
link instead, which this machine's kernel does not offer.
"""

from __future__ import annotations

import resource
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

import damacy
from bench import runners
from bench.data import ensure
from bench.scenarios import SCENARIOS


def _cpu(who=resource.RUSAGE_SELF) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def start_server(root: Path, latency_ms: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.http_server", str(root), "--latency-ms", str(latency_ms)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    port = proc.stdout.readline().strip()
    if not port.isdigit():
        proc.kill()
        raise SystemExit("the HTTP server did not start")
    return proc, f"http://127.0.0.1:{port}"


def _over_http(samples: list, root: Path, url: str) -> list:
    out = []
    for s in samples:
        uri = f"{url}/{Path(s.uri).relative_to(root).as_posix()}"
        out.append(damacy.Sample(uri, s.aabb) if isinstance(s, damacy.Sample) else damacy.IndexQuery(uri, s.selection))
    return out


def main(scenario: str, data: str, latency_ms: float, batches: int, repeats: int, readers: list[str]) -> dict:
    scn = SCENARIOS[scenario]
    root = Path(data).resolve()
    uris = ensure(scn.dataset, root)
    server, url = start_server(root, latency_ms)
    try:
        n = batches * scn.samples_per_batch
        print(f"== remote {scenario}: {scn.description}; served over HTTP at {url} with {latency_ms:g} ms per request;"
              f" {batches} batches of {scn.samples_per_batch}, {repeats} repeats")
        check = _over_http(scn.samples(uris, 1, seed=99), root, url)
        got = {}
        for r in readers:
            parts: list[np.ndarray] = []
            runners.READERS[r](scn, check, consume=lambda x, parts=parts: parts.append(x.copy()))
            got[r] = np.concatenate(parts)
        ref = readers[0]
        for r, value in got.items():
            if not np.array_equal(value, got[ref]):
                raise SystemExit(f"MISMATCH: {r} and {ref} disagree over HTTP")
        local = []
        runners.READERS[ref](scn, scn.samples(uris, 1, seed=99), consume=lambda x: local.append(x.copy()))
        if not np.array_equal(np.concatenate(local), got[ref]):
            raise SystemExit("MISMATCH: reads over HTTP differ from the local files")
        print(f"verified: {', '.join(readers)} agree over HTTP, and with the local files")
        seconds: dict[str, list[float]] = {r: [] for r in readers}
        cpu: dict[str, list[float]] = {r: [] for r in readers}
        server_cpu: dict[str, list[float]] = {r: [] for r in readers}
        for rep in range(repeats):
            samples = _over_http(scn.samples(uris, batches, seed=rep), root, url)
            order = readers if rep % 2 == 0 else readers[::-1]  # interleaved, alternating first place
            for r in order:
                c0, s0 = _cpu(), runners.proc_cpu(server.pid)
                out = runners.READERS[r](scn, samples)
                cpu[r].append(_cpu() - c0)
                server_cpu[r].append(runners.proc_cpu(server.pid) - s0)
                seconds[r].append(out["seconds"])
                print(f"  repeat {rep}: {r:12} {n / out['seconds']:8.1f} samples/s", flush=True)
        rows = {}
        base = {name: n / statistics.median(seconds[name]) for name in readers}
        for r in readers:
            rate = n / statistics.median(seconds[r])
            rows[r] = {
                "samples_per_s": rate,
                "median_s": statistics.median(seconds[r]),
                "runs_s": seconds[r],
                "cpu_ms_per_sample": 1e3 * statistics.median(cpu[r]) / n,
                "server_cpu_ms_per_sample": 1e3 * statistics.median(server_cpu[r]) / n,
                **{f"vs_{other}": rate / base[other] for other in readers if other != r},
            }
        print(f"{'reader':12} {'samples/s':>10} {'cpu ms/sample':>14} {'server cpu ms':>14}  ratios")
        for r, row in rows.items():
            ratios = "  ".join(f"{k[3:]} {v:.2f}x" for k, v in row.items() if k.startswith("vs_"))
            print(f"{r:12} {row['samples_per_s']:10.1f} {row['cpu_ms_per_sample']:14.2f} {row['server_cpu_ms_per_sample']:14.2f}  {ratios}")
        return {
            "scenario": scenario, "latency_ms": latency_ms, "batches": batches, "samples": n, "repeats": repeats,
            "readers": rows,
        }
    finally:
        server.kill()
        server.wait()
