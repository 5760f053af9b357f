"""``python -m bench thin``: thin samples (planes, slabs of a few planes) of the default data,
where every sample cuts chunks much deeper than itself.

Each epoch reads every plane of the 4 volumes once (``planes``: 1 x 512 x 512), or slabs
of 8 planes every 4 planes (``slabs``), shuffled, as f32; 2 epochs. Every reader gets the
same memory M for decoded data and reads the same samples in the same order:

- ``damacy``: the samples in a chunk-aware order (``Shuffled(window=M)``), with a chunk cache
  of M;
- ``once``: a decode-once peer written here: the same order, each chunk slab a sample needs
  read whole with tensorstore (every chunk decoded once per read) into an LRU store of M
  bytes, samples cut out of it with numpy, as loaders built around "decode each chunk once,
  cut many samples from it" do;
- ``tensorstore``: the same order, tensorstore's own chunk cache (``cache_pool``) of M;
- ``damacy-uniform``: damacy with a chunk cache of M on a uniform shuffle (what a sampler
  without a window gives), for what the window brings;
- ``damacy-warm`` (not run unless named): damacy with every chunk already in a cache that
  holds all the data (the samples read once before the clock starts), for what planning and
  copying cost alone.

Repeats are interleaved (every reader once, then again); the report gives the median
samples/s, CPU ms per sample, decoded bytes per delivered sample (damacy and the peer count
them) and the ratios to the peer. The first batches of every reader are checked against
zarr-python first.

Beside them, ``zstd alone``: what decoding alone allows on this machine. Every chunk of the
data, its compressed bytes already in memory, is decompressed with zstandard on as many
threads as the readers use, times the decodes per epoch the peer made (its decoded bytes over
the data's). No reader that decodes that much can pass this rate; its CPU per sample is the
least any of them spends.
"""

from __future__ import annotations

import resource
import statistics
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

import damacy
from bench import runners
from bench.data import ensure
from bench.scenarios import DEFAULT

READERS = ("damacy", "once", "tensorstore", "damacy-uniform", "damacy-warm")
KINDS = {"planes": (1, 1), "slabs": (8, 4)}  # (planes per sample, step between slab starts)
BATCH = 8
EPOCHS = 2


class Scn:
    """What the runners need of a scenario."""

    def __init__(self, depth: int) -> None:
        self.sample_shape = (depth, *DEFAULT.shape[1:])
        self.samples_per_batch = BATCH
        self.dtype = "f32"


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def epoch_samples(uris: list[str], kind: str) -> list[damacy.Sample]:
    depth, step = KINDS[kind]
    nz = DEFAULT.shape[0]
    return [damacy.Sample(u, np.s_[z : z + depth, :, :]) for u in uris for z in range(0, nz - depth + 1, step)]


def orders(uris: list[str], kind: str, memory: int, seed: int) -> tuple[list, list]:
    """The 2 epochs of samples: windowed (damacy's order, which the peers read too), uniform."""
    items = epoch_samples(uris, kind)
    windowed = damacy.Shuffled(items, seed=seed, window=memory)
    uniform = damacy.Shuffled(items, seed=seed)
    a, b = [], []
    for epoch in range(EPOCHS):
        windowed.set_epoch(epoch)
        uniform.set_epoch(epoch)
        a.extend(windowed)
        b.extend(uniform)
    return a, b


def _read(pipe: damacy.Pipeline, samples: list, consume=None, t0: float | None = None) -> dict:
    """Push ``samples`` and take every batch: seconds and the first batch (from ``t0``, default
    now), CPU, bytes decoded, the pipeline's stats."""
    before = pipe.stats_dict()["stages"].get("decode", {}).get("bytes_out", 0)
    c0, t0 = _cpu(), time.perf_counter() if t0 is None else t0
    pipe.push(samples)
    first = None
    for batch in pipe.batches():
        with batch:
            first = first or time.perf_counter() - t0
            if consume is not None:
                consume(batch.numpy())
    seconds, cpu = time.perf_counter() - t0, _cpu() - c0
    stats = pipe.stats_dict()
    decoded = stats["stages"].get("decode", {}).get("bytes_out", 0) - before
    return {"seconds": seconds, "cpu": cpu, "first_batch_s": first, "decoded_bytes": decoded, "stats": stats}


def run_damacy(scn: Scn, samples: list, memory: int, consume=None) -> dict:
    t0 = time.perf_counter()  # the pipeline's start counts, as the other readers' opening does
    with damacy.Pipeline(runners.damacy_config(scn, chunk_cache_bytes=memory)) as pipe:
        out = _read(pipe, samples, consume, t0)
    del out["cpu"]  # measured by the caller around the whole run, as for the other readers
    return out


def run_once(scn: Scn, samples: list, memory: int, consume=None) -> dict:
    """The decode-once peer: chunk slabs (one chunk deep, whole planes) read with tensorstore
    into an LRU store of ``memory`` bytes; a sample is cut from the slabs it cuts."""
    import tensorstore as ts

    t0 = time.perf_counter()
    ctx = ts.Context({"cache_pool": {"total_bytes_limit": 0}, "data_copy_concurrency": {"limit": runners.CPUS}})
    arrays: dict[str, object] = {}
    store: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
    held = decoded = 0
    depth = DEFAULT.chunks[0]
    out = np.empty((BATCH, *scn.sample_shape), dtype=np.float32)
    first = None
    for batch in runners.batches_of(samples, BATCH):
        needed = []
        for s in batch:
            z0, z1 = s.selection[0].start, s.selection[0].stop
            needed.extend((s.uri, k) for k in range(z0 // depth, (z1 - 1) // depth + 1))
        missing = [key for key in dict.fromkeys(needed) if key not in store]
        futures = []
        for uri, k in missing:
            arr = arrays.get(uri)
            if arr is None:
                arr = arrays[uri] = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": uri}}, context=ctx, read=True).result()
            futures.append(arr[k * depth : (k + 1) * depth].read())
        for key, f in zip(missing, futures):
            slab = f.result()
            store[key] = slab
            held += slab.nbytes
            decoded += slab.nbytes
        for key in needed:
            store.move_to_end(key)
        for i, s in enumerate(batch):
            z0, z1 = s.selection[0].start, s.selection[0].stop
            for k in range(z0 // depth, (z1 - 1) // depth + 1):
                lo, hi = max(z0, k * depth), min(z1, (k + 1) * depth)
                out[i, lo - z0 : hi - z0] = store[(s.uri, k)][lo - k * depth : hi - k * depth]
        while held > memory and len(store) > 1:
            _, gone = store.popitem(last=False)
            held -= gone.nbytes
        first = first or time.perf_counter() - t0
        if consume is not None:
            consume(out[: len(batch)])
    return {"seconds": time.perf_counter() - t0, "first_batch_s": first, "decoded_bytes": decoded}


def run_tensorstore(scn: Scn, samples: list, memory: int, consume=None) -> dict:
    """tensorstore with its chunk cache of ``memory`` bytes (see :func:`runners.run_tensorstore`)."""
    return runners.run_tensorstore(scn, samples, consume, cache_bytes=memory)


def run_damacy_warm(scn: Scn, samples: list, memory: int, consume=None) -> dict:
    """damacy reading ``samples`` with every chunk they touch already in its chunk cache (one
    that holds all the data; ``memory`` is not the bound here): planning and copies alone."""
    data_bytes = DEFAULT.volumes * int(np.prod(DEFAULT.shape)) * 2
    with damacy.Pipeline(runners.damacy_config(scn, chunk_cache_bytes=2 * data_bytes)) as pipe:
        _read(pipe, samples)  # fills the cache
        return _read(pipe, samples, consume)


RUN = {"damacy": run_damacy, "once": run_once, "tensorstore": run_tensorstore, "damacy-uniform": run_damacy, "damacy-warm": run_damacy_warm}


def zstd_frames(uris: list[str]) -> list[bytes]:
    """The compressed bytes of every chunk of the arrays at ``uris`` (each a zstd frame: the
    bench data's inner chunks are ``bytes`` then ``zstd``), located as damacy locates them."""
    from damacy_server.read import default_metadata, open_array

    frames = []
    for uri in uris:
        meta = open_array(uri)
        grid = tuple(-(-s // u) for s, u in zip(meta.shape, meta.read_unit))
        units = np.indices(grid).reshape(len(grid), -1).T.astype(np.int64)
        locs = default_metadata().locate(meta, units)
        for key, offset, nbytes, missing in zip(locs.keys, locs.offsets.tolist(), locs.nbytes.tolist(), locs.missing.tolist()):
            if not missing:
                frames.append(meta.store.read(key) if nbytes < 0 else meta.store.read_range(key, offset, nbytes))
    return frames


def zstd_alone(frames: list[bytes], threads: int) -> tuple[float, float]:
    """Decompress every frame once on ``threads`` threads: (wall seconds, CPU seconds)."""
    import zstandard

    cpu: list[float] = []

    def work(part: list[bytes]) -> None:
        d = zstandard.ZstdDecompressor()
        t = time.thread_time()
        for f in part:
            d.decompress(f)
        cpu.append(time.thread_time() - t)

    workers = [threading.Thread(target=work, args=(frames[i::threads],)) for i in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - t0, sum(cpu)


def verify(scn: Scn, samples: list, memory: int, readers: list[str]) -> None:
    """The first two batches of every reader equal zarr-python's reads, converted to f32."""
    import zarr

    head = samples[: 2 * BATCH]
    want = np.stack([zarr.open_array(s.uri, mode="r")[s.selection].astype(np.float32) for s in head])
    for r in readers:
        parts = []
        RUN[r](scn, head, memory, consume=lambda x, parts=parts: parts.append(x.copy()))
        if not np.array_equal(np.concatenate(parts), want):
            raise SystemExit(f"MISMATCH: {r} differs from zarr-python on the first {len(head)} samples")
    print(f"verified: {', '.join(readers)} equal zarr-python on the first {len(head)} samples")


def main(kinds: list[str], data: str, memories: list[int], repeats: int, readers: list[str]) -> dict:
    uris = ensure(DEFAULT, Path(data))
    data_bytes = DEFAULT.volumes * int(np.prod(DEFAULT.shape)) * 2
    results: dict = {"epochs": EPOCHS, "batch": BATCH, "data_decoded_bytes": data_bytes, "runs": {}}
    frames = zstd_frames(uris)
    for kind in kinds:
        scn = Scn(KINDS[kind][0])
        for memory in memories:
            windowed, uniform = orders(uris, kind, memory, seed=0)
            n = len(windowed)
            print(f"\n== {kind}, {memory >> 20} MiB for decoded data: {n} samples ({EPOCHS} epochs) of {scn.sample_shape} f32, batches of {BATCH}")
            verify(scn, windowed, memory, readers)
            runs: dict[str, dict[str, list[float]]] = {r: {"s": [], "cpu": [], "decoded": []} for r in readers}
            alone: dict[str, list[float]] = {"s": [], "cpu": []}  # one pass over the data's chunks
            for rep in range(repeats):
                wall, cpu = zstd_alone(frames, runners.CPUS)
                alone["s"].append(wall)
                alone["cpu"].append(cpu)
                for r in readers if rep % 2 == 0 else readers[::-1]:
                    c0 = _cpu()
                    out = RUN[r](scn, uniform if r == "damacy-uniform" else windowed, memory)
                    runs[r]["cpu"].append(out.get("cpu", _cpu() - c0))  # a warmed reader times its own
                    runs[r]["s"].append(out["seconds"])
                    if "decoded_bytes" in out:
                        runs[r]["decoded"].append(out["decoded_bytes"])
            rows = {}
            for r, v in runs.items():
                rows[r] = {
                    "samples_per_s": n / statistics.median(v["s"]),
                    "cpu_ms_per_sample": 1e3 * statistics.median(v["cpu"]) / n,
                    "decoded_MiB_per_sample": statistics.median(v["decoded"]) / n / 2**20 if v["decoded"] else None,
                    "decoded_per_epoch_x_data": statistics.median(v["decoded"]) / EPOCHS / data_bytes if v["decoded"] else None,
                    "runs_s": v["s"],
                }
            peer = rows.get("once", {}).get("samples_per_s")
            # the passes over the data an epoch needs: the peer's decodes (else once per epoch)
            passes = EPOCHS * (rows.get("once", {}).get("decoded_per_epoch_x_data") or 1.0)
            rows["zstd alone"] = {
                "samples_per_s": n / (passes * statistics.median(alone["s"])),
                "cpu_ms_per_sample": 1e3 * passes * statistics.median(alone["cpu"]) / n,
                "decoded_MiB_per_sample": None,
                "decoded_per_epoch_x_data": passes / EPOCHS,
                "runs_s": alone["s"],
            }
            print(f"{'reader':16} {'samples/s':>10} {'x once':>8} {'cpu ms/sample':>14} {'MiB decoded/sample':>19} {'decoded/epoch x data':>21}")
            for r, row in rows.items():
                vs = f"{row['samples_per_s'] / peer:.2f}x" if peer else "-"
                dec = f"{row['decoded_MiB_per_sample']:19.2f}" if row["decoded_MiB_per_sample"] is not None else f"{'-':>19}"
                per_epoch = f"{row['decoded_per_epoch_x_data']:21.2f}" if row["decoded_per_epoch_x_data"] is not None else f"{'-':>21}"
                print(f"{r:16} {row['samples_per_s']:10.1f} {vs:>8} {row['cpu_ms_per_sample']:14.2f} {dec} {per_epoch}")
            results["runs"][f"{kind}/{memory >> 20}MiB"] = rows
    return results
