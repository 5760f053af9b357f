"""``python -m bench ranks``: K training ranks on one node, each re-reading its own samples.

Each rank draws its own random samples (its own seed) and reads them for E epochs, in a new
order each epoch; the ranks start together once each has imported its reader. Every reader
gets the same cache memory C on the node:

- ``damacyd``: one daemon with ``--chunk-cache C`` serving the K ranks;
- ``embedded``: K damacy pipelines with ``chunk_cache_bytes = C / K`` each;
- ``tensorstore-cache``: K tensorstore processes with a ``cache_pool`` of C / K each;
- ``tensorstore``: K tensorstore processes without a cache.

And, for what ordering for locality does (not in the default readers): ``damacyd-sampler``,
the K ranks sharing one ``damacy.RandomBoxes`` per epoch (the same number of samples per
epoch, each rank every K-th), and ``damacyd-locality``, the same boxes with ``locality=True``
(the ranks of the node read neighbouring boxes at each step).

The samples are drawn until the decoded chunks they touch, over all ranks, add up to the
data size D (by default twice C). Repeats are interleaved (every reader once, then again);
the report gives the median aggregate samples/s, CPU ms per sample (ranks and daemon
together) and chunk-cache hit rates where the reader reports them, and the ratios.
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
from pathlib import Path

import numpy as np

from bench.daemon import start_daemon
from bench.data import ensure
from bench.runners import proc_cpu

READERS = ("damacyd", "embedded", "tensorstore-cache", "tensorstore", "damacyd-sampler", "damacyd-locality")

RANK = r"""
import json, random, resource, sys, time
sys.path.insert(0, {root!r})
import numpy as np
from bench.scenarios import SCENARIOS
from bench import runners
import damacy
import damacy_client.client  # loaded before the clock starts (a training process has its reader imported)

job = json.loads({job!r})
if job["reader"].startswith("tensorstore"):
    import tensorstore as ts
scn = SCENARIOS[job["scenario"]]
samples = [damacy.Sample(uri, tuple(map(tuple, box))) for uri, box in job["samples"]]
rng = random.Random(job["seed"])
order = []
for epoch in range(job["epochs"]):
    epoch_samples = list(samples)
    rng.shuffle(epoch_samples)
    order.extend(epoch_samples)
if job.get("sampler") is not None:  # the ranks share one RandomBoxes per epoch
    kw = job["sampler"]
    sampler = damacy.RandomBoxes({{u: tuple(s) for u, s in kw["shapes"].items()}}, tuple(kw["sample_shape"]), seed=kw["seed"],
                                 samples_per_epoch=kw["samples_per_epoch"], rank=kw["rank"], world_size=kw["world_size"],
                                 local_world_size=kw["world_size"], locality=kw["locality"])
    order = []
    for epoch in range(job["epochs"]):
        sampler.set_epoch(epoch)
        order.extend(sampler)

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

reader, cache = job["reader"], job["cache_bytes"]
hits = misses = None
# the ranks start together, as training ranks do once their process group is up
print("ready", flush=True)
sys.stdin.readline()
t0, c0 = time.time(), cpu()
if reader.startswith("damacyd") or reader == "embedded":
    kw = {{"chunk_cache_bytes": cache}} if reader == "embedded" else {{}}
    cfg = runners.damacy_config(scn, **kw)
    pipe = damacy.Pipeline(cfg, endpoint=job["endpoint"]) if reader.startswith("damacyd") else damacy.EmbeddedPipeline(cfg)
    with pipe:
        pipe.push(order)
        for batch in pipe.batches():
            batch.release()
        if reader == "embedded":
            cc = pipe.executor.chunk_cache.stats()
            hits, misses = cc["hits"], cc["misses"]
else:
    ctx = ts.Context({{
        "cache_pool": {{"total_bytes_limit": cache if reader == "tensorstore-cache" else 0}},
        "data_copy_concurrency": {{"limit": runners.CPUS}},
        "file_io_concurrency": {{"limit": max(4, runners.CPUS)}},
    }})
    arrays = {{}}
    out = np.empty((scn.samples_per_batch, *scn.sample_shape), dtype=np.float32)
    for batch in runners.batches_of(order, scn.samples_per_batch):
        futures = []
        with ts.Batch() as tsbatch:
            for s in batch:
                arr = arrays.get(s.uri)
                if arr is None:
                    spec = {{"driver": "zarr3", "kvstore": {{"driver": "file", "path": s.uri}}, "recheck_cached_data": False}}
                    arr = arrays[s.uri] = ts.cast(ts.open(spec, context=ctx, read=True).result(), ts.float32)
                futures.append(arr[tuple(slice(a, b) for a, b in s.aabb)].read(batch=tsbatch))
        for i, f in enumerate(futures):
            out[i] = f.result()
print(json.dumps({{"start": t0, "end": time.time(), "cpu": cpu() - c0, "samples": len(order), "hits": hits, "misses": misses}}))
"""


def draw(scn, uris: list[str], ranks: int, data_bytes: int, seed: int = 0) -> list[list]:
    """Per rank, whole batches of random boxes, drawn in turns until the chunks they touch
    (over all ranks, each counted once) decode to ``data_bytes``."""
    import damacy

    meta = damacy.open_array(uris[0])
    chunk = meta.layout.unit_shape  # the read unit: an inner chunk of a shard
    chunk_bytes = int(np.prod(chunk)) * meta.dtype.itemsize
    rngs = [np.random.default_rng(1000 * seed + r) for r in range(ranks)]
    shape = scn.dataset.shape
    per_rank: list[list] = [[] for _ in range(ranks)]
    seen: set = set()
    while len(seen) * chunk_bytes < data_bytes:
        for r in range(ranks):
            for _ in range(scn.samples_per_batch):
                rng = rngs[r]
                uri = uris[int(rng.integers(len(uris)))]
                start = [int(rng.integers(0, n - s + 1)) for n, s in zip(shape, scn.sample_shape)]
                box = [(a, a + s) for a, s in zip(start, scn.sample_shape)]
                per_rank[r].append((uri, box))
                ranges = [range(a // c, (b - 1) // c + 1) for (a, b), c in zip(box, chunk)]
                seen.update((uri, i, j, k) for i in ranges[0] for j in ranges[1] for k in ranges[2])
    return per_rank


def main(scenario_name: str, data_dir: str, ranks: int, epochs: int, cache_bytes: int, data_bytes: int, repeats: int, readers: list[str]) -> dict:
    from bench.scenarios import SCENARIOS

    scn = SCENARIOS[scenario_name]
    if scn.kind != "box":
        raise SystemExit("bench ranks draws boxes: choose a box scenario")
    data = Path(data_dir).resolve()
    uris = ensure(scn.dataset, data)
    samples = draw(scn, uris, ranks, data_bytes)
    n_total = sum(len(s) for s in samples) * epochs
    folder = Path(tempfile.mkdtemp(prefix="damacy-ranks-"))
    proc = None
    rates: dict[str, list[float]] = {r: [] for r in readers}
    cpu_ms: dict[str, list[float]] = {r: [] for r in readers}
    hit_rates: dict[str, list[float]] = {r: [] for r in readers}
    root = str(Path(__file__).resolve().parents[1])
    try:
        for rep in range(repeats):
            for reader in readers:
                endpoint = None
                daemon = reader.startswith("damacyd")
                if daemon:  # a fresh daemon each repeat: every reader starts cold
                    extra = os.environ.get("DAMACY_BENCH_DAEMON_ARGS", "").split()  # e.g. "--decode-workers 4"
                    proc, endpoint = start_daemon(data, folder, ["--chunk-cache", str(cache_bytes), *extra])
                d0 = proc_cpu(proc.pid) if daemon else 0.0
                share = cache_bytes if daemon else cache_bytes // ranks
                sampler = None
                if reader in ("damacyd-sampler", "damacyd-locality"):
                    meta_shape = list(scn.dataset.shape)
                    sampler = {
                        "shapes": {u: meta_shape for u in uris}, "sample_shape": list(scn.sample_shape), "seed": rep,
                        "samples_per_epoch": sum(len(x) for x in samples), "world_size": ranks,
                        "locality": reader == "damacyd-locality",
                    }
                jobs = [
                    json.dumps(
                        {
                            "scenario": scenario_name,
                            "samples": samples[r],
                            "epochs": epochs,
                            "seed": 7919 * rep + r,
                            "reader": reader,
                            "cache_bytes": share,
                            "endpoint": endpoint,
                            "sampler": None if sampler is None else {**sampler, "rank": r},
                        }
                    )
                    for r in range(ranks)
                ]
                procs = [
                    subprocess.Popen(
                        [sys.executable, "-c", RANK.format(root=root, job=job)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
                    )
                    for job in jobs
                ]
                for p in procs:  # every rank has imported its reader
                    if p.stdout.readline().strip() != "ready":
                        raise SystemExit(f"a {reader} rank failed to start")
                for p in procs:
                    p.stdin.write("go\n")
                    p.stdin.flush()
                results = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
                daemon_cpu = 0.0
                if daemon:
                    daemon_cpu = proc_cpu(proc.pid) - d0
                    hits, misses = _daemon_cache(endpoint)
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(30)
                    proc = None
                else:
                    hits = sum(r["hits"] or 0 for r in results)
                    misses = sum(r["misses"] or 0 for r in results)
                wall = max(r["end"] for r in results) - min(r["start"] for r in results)
                total = sum(r["samples"] for r in results)
                rates[reader].append(total / wall)
                cpu_ms[reader].append(1e3 * (daemon_cpu + sum(r["cpu"] for r in results)) / total)
                if hits + misses:
                    hit_rates[reader].append(hits / (hits + misses))
                print(f"  repeat {rep}: {reader:18s} {total / wall:8.1f} samples/s  {cpu_ms[reader][-1]:6.2f} ms CPU/sample", flush=True)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)
    out = {
        "scenario": scenario_name,
        "ranks": ranks,
        "epochs": epochs,
        "cache_bytes": cache_bytes,
        "data_bytes": data_bytes,
        "samples_per_rank": [len(s) for s in samples],
        "samples": n_total,
        "repeats": repeats,
        "readers": {
            r: {
                "samples_per_s": statistics.median(rates[r]),
                "cpu_ms_per_sample": statistics.median(cpu_ms[r]),
                "chunk_cache_hit_rate": statistics.median(hit_rates[r]) if hit_rates[r] else None,
                "runs": {"samples_per_s": rates[r], "cpu_ms_per_sample": cpu_ms[r]},
            }
            for r in readers
        },
    }
    print(
        f"\n== ranks, {scenario_name}: {ranks} ranks x {len(samples[0])} samples x {epochs} epochs; "
        f"{cache_bytes >> 20} MiB of cache on the node for {data_bytes >> 20} MiB of decoded data; {repeats} interleaved repeats"
    )
    for r in readers:
        row = out["readers"][r]
        hit = "" if row["chunk_cache_hit_rate"] is None else f"   cache hits {100 * row['chunk_cache_hit_rate']:.0f}%"
        ratios = "   ".join(
            f"{row['samples_per_s'] / out['readers'][o]['samples_per_s']:.2f}x {o}" for o in readers if o != r and o.startswith("tensorstore")
        )
        print(f"{r:18s} {row['samples_per_s']:8.1f} samples/s  {row['cpu_ms_per_sample']:6.2f} ms CPU/sample{hit}   {ratios}")
    return out


def _daemon_cache(endpoint: str) -> tuple[int, int]:
    from damacy_client.transport import Connection
    from damacy_protocol import messages as m

    conn = Connection(endpoint)
    try:
        conn.call(lambda i: m.Attached(id=i), 30.0, "attach")
        cc = conn.call(lambda i: m.Stats(id=i), 30.0, "stats").stats.chunk_cache
    finally:
        conn.close()
    return (cc.hits, cc.misses) if cc is not None else (0, 0)
