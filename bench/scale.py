"""``python -m bench scale``: how damacy's costs grow with the work, as curves.

- ``samples``: a ``RandomBoxes`` epoch of 10^4 .. 10^8 samples, rank 63 of 64: time to its
  first sample, to a ``state_dict``, to the first sample of a restore half way through its
  share, and the growth of the process's resident memory over an interpreter that only imported
  damacy (each size in a fresh process);
- ``arrays``: NGFF plates of 10 .. 10^5 images (written by zarr-python once: one image per
  distinct data, the others' files linked): ``open_plate`` time, a sampler over every image
  and its first batch through an embedded pipeline, images opened, resident memory growth;
- ``sessions``: damacyd with 1 .. 32 client processes streaming at equal demand: the socket
  loop thread's CPU ms per delivered batch, requests per batch, each session's share of a
  window of batches (min and max over the mean) and the daemon's batches/s;
- ``threads``: the default scenario's boxes through an embedded pipeline with 1 .. cores
  decode threads: samples/s and CPU ms per sample.

Prints a table per curve and writes the figures as JSON and, with matplotlib installed
(``pip install 'damacy[bench]'``), a PNG of the four curves beside the JSON.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import string
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

CURVES = ("samples", "arrays", "sessions", "threads")

_SAMPLES_PROBE = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    import damacy
    n = int(sys.argv[1])
    def rss():  # resident now, KiB
        return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1])
    base = rss()
    t0 = time.perf_counter()
    s = damacy.RandomBoxes({"/data/v.zarr": (4096, 4096, 4096)}, (64, 64, 64), seed=0, samples_per_epoch=n, rank=63, world_size=64)
    s.set_epoch(3)
    it = iter(s)
    next(it)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    state = s.state_dict()
    state_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    next(iter(s.iter_from(len(s) // 2)))
    restore = time.perf_counter() - t0
    print(json.dumps({"first_sample_s": first, "state_s": state_s, "restore_s": restore, "rss_growth_MiB": (rss() - base) / 1024, "state_bytes": len(json.dumps(state))}))
    """
)

_ARRAYS_PROBE = textwrap.dedent(
    """
    import json, sys, time
    import damacy
    from damacy_server.read import default_metadata
    uri = sys.argv[1]
    import damacy_server.read, damacy_server.pipeline  # imported before the baseline
    def rss():  # resident now, KiB
        return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1])
    base = rss()
    t0 = time.perf_counter()
    plate = damacy.open_plate(uri)
    images = plate.images
    open_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    sampler = damacy.RandomBoxes(images, (4, 8, 8), seed=0, samples_per_epoch=10**6, level=0)
    cfg = damacy.Config(samples_per_batch=8, sample_shape=(4, 8, 8), dtype="u16")
    with damacy.Pipeline(cfg) as pipe:
        pipe.push(sampler)
        pipe.pop().release()
        cache = pipe.stats_dict()["cache"]["arrays"]
    first_batch = time.perf_counter() - t0
    print(json.dumps({"images": len(images), "open_plate_s": open_s, "first_batch_s": first_batch,
                      "images_opened": default_metadata().cache.arrays.misses, "pipeline_metadata_entries": cache["entries"],
                      "rss_growth_MiB": (rss() - base) / 1024}))
    """
)

_CLIENT = textwrap.dedent(
    """
    import os, sys, damacy
    endpoint, uri, stop, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    cfg = damacy.Config(samples_per_batch=4, sample_shape=(32, 32, 32), dtype="u16", prepared_batches=2)
    sampler = damacy.RandomBoxes({uri: (128, 128, 128)}, (32, 32, 32), seed=seed, samples_per_epoch=10**7, rank=0, world_size=1)
    with damacy.Pipeline(cfg, endpoint=endpoint) as pipe:
        pipe.push(sampler)
        while not os.path.exists(stop):
            pipe.pop().release()
    """
)


def _probe(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"probe failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def samples_curve(sizes: list[int]) -> list[dict]:
    rows = []
    print(f"\n== samples per epoch (RandomBoxes, rank 63 of 64)\n{'samples':>12} {'first s':>9} {'state s':>9} {'restore s':>10} {'RSS +MiB':>9} {'state B':>8}")
    for n in sizes:
        r = {"samples_per_epoch": n, **_probe(_SAMPLES_PROBE, str(n))}
        rows.append(r)
        print(f"{n:12d} {r['first_sample_s']:9.4f} {r['state_s']:9.5f} {r['restore_s']:10.4f} {r['rss_growth_MiB']:9.1f} {r['state_bytes']:8d}")
    return rows


def write_plate(root: Path, images: int) -> Path:
    """A plate of ``images`` fields (wells of up to 100 fields) written by zarr-python: 4
    distinct images, every other field's files hard-linked to one of them. Reused if there."""
    import zarr

    done = root / ".complete"
    if done.exists():
        return root
    if root.exists():
        shutil.rmtree(root)
    fields = min(images, 100)
    wells_n = -(-images // fields)
    cols = min(wells_n, 48)
    rows_n = -(-wells_n // cols)
    row_names = [a + b for a in ("", *string.ascii_uppercase) for b in string.ascii_uppercase][:rows_n]
    g = zarr.open_group(root, mode="w", zarr_format=3)
    wells = [{"path": f"{row_names[w // cols]}/{w % cols + 1}", "rowIndex": w // cols, "columnIndex": w % cols} for w in range(wells_n)]
    g.attrs["ome"] = {"version": "0.5", "plate": {"rows": [{"name": r} for r in row_names], "columns": [{"name": str(c + 1)} for c in range(cols)], "wells": wells}}
    templates = []
    for k in range(4):
        img = g.create_group(f"_t{k}")
        img.attrs["ome"] = {"version": "0.5", "multiscales": [{"axes": [{"name": n, "type": "space"} for n in "zyx"], "datasets": [{"path": "0", "coordinateTransformations": [{"type": "scale", "scale": [1, 1, 1]}]}]}]}
        arr = img.create_array("0", shape=(4, 16, 16), chunks=(4, 16, 16), dtype="uint16")
        arr[:] = np.random.default_rng(k).integers(0, 60000, (4, 16, 16), dtype=np.uint16)
        templates.append(root / f"_t{k}")
    left = images
    for i, w in enumerate(wells):
        n = min(fields, left)
        left -= n
        well = g.create_group(w["path"])
        well.attrs["ome"] = {"version": "0.5", "well": {"images": [{"path": str(f)} for f in range(n)]}}
        for f in range(n):
            shutil.copytree(templates[(i + f) % 4], root / w["path"] / str(f), copy_function=os.link)
    for t in templates:
        shutil.rmtree(t)
    done.touch()
    return root


def arrays_curve(counts: list[int], data: Path) -> list[dict]:
    rows = []
    print(f"\n== arrays (NGFF plates)\n{'images':>8} {'open s':>8} {'1st batch s':>12} {'opened':>7} {'RSS +MiB':>9}")
    for n in counts:
        t0 = time.perf_counter()
        root = write_plate(data / f"plate-{n}.zarr", n)
        made = time.perf_counter() - t0
        r = {"images": n, "written_s": made, **_probe(_ARRAYS_PROBE, str(root))}
        rows.append(r)
        print(f"{n:8d} {r['open_plate_s']:8.3f} {r['first_batch_s']:12.3f} {r['images_opened']:7d} {r['rss_growth_MiB']:9.1f}")
    return rows


def sessions_curve(counts: list[int], data: Path, per_session: int) -> list[dict]:
    import zarr
    from zarr.codecs import ZstdCodec

    vol = data / "sessions.zarr"
    if not (vol / "zarr.json").exists():
        a = zarr.create_array(vol, shape=(128, 128, 128), chunks=(32, 32, 32), dtype="uint16", compressors=[ZstdCodec()])
        a[:] = np.random.default_rng(0).integers(0, 60000, (128, 128, 128), dtype=np.uint16)
    rows = []
    print(f"\n== sessions on one damacyd\n{'sessions':>8} {'loop ms/batch':>14} {'requests/batch':>15} {'share min':>10} {'share max':>10} {'batches/s':>10}")
    for n in counts:
        r = _sessions_run(n, vol, data, per_session)
        rows.append(r)
        print(f"{n:8d} {r['loop_ms_per_batch']:14.3f} {r['requests_per_batch']:15.2f} {r['share_min']:10.3f} {r['share_max']:10.3f} {r['batches_per_s']:10.1f}")
    return rows


def _sessions_run(n: int, vol: Path, data: Path, per_session: int) -> dict:
    """One damacyd, ``n`` clients streaming; the figures of a window of batches."""
    from damacy_client.transport import daemon_stats

    daemon_exe = shutil.which("damacyd", path=os.path.dirname(sys.executable)) or "damacyd"
    with tempfile.TemporaryDirectory() as tmp:
        endpoint = f"ipc://{tmp}/d.sock"
        log = open(Path(tmp) / "d.log", "wb")
        proc = subprocess.Popen([daemon_exe, "--endpoint", endpoint, "--allow-root", str(data)], stdout=log, stderr=subprocess.STDOUT)
        stop = Path(tmp) / "stop"
        clients = []

        def snapshot():
            s = daemon_stats(endpoint)
            return {x["pid"]: x["samples"] for x in s["sessions"] if not x["control"]}, s["daemon"]

        try:
            _wait(lambda: _answers(endpoint), 60)
            clients = [subprocess.Popen([sys.executable, "-c", _CLIENT, endpoint, str(vol), str(stop), str(k)]) for k in range(n)]
            start, before = _wait(lambda: (d := snapshot()) and len(d[0]) == n and all(d[0].values()) and d, 300)
            t0 = time.perf_counter()
            want = max(n * per_session, 200) * 4
            end, after = _wait(lambda: (d := snapshot()) and sum(d[0].values()) - sum(start.values()) >= want and d, 1200, interval=0.5)
            seconds = time.perf_counter() - t0
        finally:
            stop.touch()
            for c in clients:
                c.wait(60)
            proc.terminate()
            proc.wait(30)
            log.close()
    batches = after["batches"] - before["batches"]
    shares = np.array([end[p] - start[p] for p in start], dtype=np.float64)
    requests = sum(after["requests"].get(k, 0) - before["requests"].get(k, 0) for k in ("Pop", "Push", "Release"))
    return {
        "sessions": n,
        "loop_ms_per_batch": 1e3 * (after["loop_cpu_s"] - before["loop_cpu_s"]) / batches,
        "requests_per_batch": requests / batches,
        "share_min": float(shares.min() / shares.mean()),
        "share_max": float(shares.max() / shares.mean()),
        "batches_per_s": batches / seconds,
    }


def _answers(endpoint: str) -> bool:
    from damacy_runtime.probe import ping

    return ping(endpoint, timeout_s=0.2)


def _wait(predicate, timeout: float, interval: float = 0.2):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise SystemExit("bench scale: timed out waiting")


def threads_curve(threads: list[int], data: Path, batches: int) -> list[dict]:
    import damacy
    from bench import runners
    from bench.data import ensure
    from bench.scenarios import SCENARIOS

    scn = SCENARIOS["default"]
    uris = ensure(scn.dataset, data)
    samples = scn.samples(uris, batches, seed=1)
    rows = []
    print(f"\n== decode threads (default scenario, {len(samples)} samples, embedded)\n{'threads':>8} {'samples/s':>10} {'cpu ms/sample':>14}")
    for k in threads:
        cfg = runners.damacy_config(scn, decode_workers=k)
        c0, t0 = _cpu(), time.perf_counter()
        with damacy.Pipeline(cfg) as pipe:
            pipe.push(samples)
            for b in pipe.batches():
                b.release()
        seconds, cpu = time.perf_counter() - t0, _cpu() - c0
        r = {"threads": k, "samples_per_s": len(samples) / seconds, "cpu_ms_per_sample": 1e3 * cpu / len(samples)}
        rows.append(r)
        print(f"{k:8d} {r['samples_per_s']:10.1f} {r['cpu_ms_per_sample']:14.2f}")
    return rows


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def plot(results: dict, path: Path) -> Path | None:
    """The four curves in one PNG (None: matplotlib is not installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: pip install 'damacy[bench]' for matplotlib)")
        return None
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    if "samples" in results:
        rows = results["samples"]
        ax = axes[0][0]
        x = [r["samples_per_epoch"] for r in rows]
        ax.loglog(x, [r["first_sample_s"] for r in rows], "o-", label="first sample (s)")
        ax.loglog(x, [max(r["restore_s"], 1e-6) for r in rows], "s-", label="restore mid-epoch (s)")
        ax.set_xlabel("samples per epoch")
        ax.set_title("sampler: rank 63 of 64")
        ax2 = ax.twinx()
        rss = [r["rss_growth_MiB"] for r in rows]
        ax2.semilogx(x, rss, "^--", color="gray", label="RSS growth (MiB)")
        ax2.set_ylim(0, max(16.0, 1.5 * max(rss)))  # flat means flat, not a zoomed-in jump
        ax2.set_ylabel("resident memory growth, MiB (gray)")
        ax.legend(loc="upper left")
    if "arrays" in results:
        rows = results["arrays"]
        ax = axes[0][1]
        x = [r["images"] for r in rows]
        ax.loglog(x, [r["open_plate_s"] for r in rows], "o-", label="open_plate (s)")
        ax.loglog(x, [r["first_batch_s"] for r in rows], "s-", label="sampler + first batch (s)")
        ax.set_xlabel("images in the plate")
        ax.set_title("metadata: NGFF plates")
        ax.legend()
    if "sessions" in results:
        rows = results["sessions"]
        ax = axes[1][0]
        x = [r["sessions"] for r in rows]
        ax.plot(x, [r["loop_ms_per_batch"] for r in rows], "o-", label="loop CPU ms / batch")
        ax.plot(x, [r["requests_per_batch"] for r in rows], "s-", label="requests / batch")
        ax.plot(x, [r["share_min"] for r in rows], "v--", label="min share / mean")
        ax.plot(x, [r["share_max"] for r in rows], "^--", label="max share / mean")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("client sessions")
        ax.set_title("damacyd sessions")
        ax.legend()
    if "threads" in results:
        rows = results["threads"]
        ax = axes[1][1]
        x = [r["threads"] for r in rows]
        ax.plot(x, [r["samples_per_s"] for r in rows], "o-", label="samples/s")
        ax.set_xlabel("decode threads")
        ax.set_title("throughput vs decode threads")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(curves: list[str], data: str, samples: list[int], arrays: list[int], sessions: list[int], threads: list[int], per_session: int, batches: int) -> dict:
    base = Path(data)
    base.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    if "samples" in curves:
        results["samples"] = samples_curve(samples)
    if "arrays" in curves:
        results["arrays"] = arrays_curve(arrays, base / "plates")
    if "sessions" in curves:
        results["sessions"] = sessions_curve(sessions, base, per_session)
    if "threads" in curves:
        results["threads"] = threads_curve(threads, base, batches)
    return results
