"""``python -m bench ray``: damacy.ray beside ray.data.read_zarr, on a local Ray cluster.

The data: a Zarr v2 group of 4 uint16 volumes (256 x 512 x 512, chunks 32 x 256 x 256,
numcodecs' zstd), written by zarr-python (3 or 2) when absent. ``ray.data.read_zarr`` reads
Zarr v2 with zarr-python 2 (``zarr<3``), so its runs need an environment with that; without
it the bench says so and runs damacy alone.

Both readers hand out every chunk-sized tile of every volume once, as uint16 tensor rows,
through the same number of read tasks (``--tasks``; one CPU each) on a cluster of the
machine's CPUs, consumed with ``iter_batches``. Repeats are interleaved; the report gives the
median tiles/s, GB/s, CPU ms per tile (every process of the cluster: the driver, the raylet
and the workers, from /proc) and the ratio damacy / read_zarr. The first rows of both are
checked against zarr-python first.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import numpy as np

from bench.runners import proc_stat

VOLUMES = 4
SHAPE = (256, 512, 512)
CHUNKS = (32, 256, 256)


def _write(root: Path) -> list[str]:
    """The group (written once) and its arrays' uris."""
    import zarr

    from bench.data import field

    names = [f"vol{i}" for i in range(VOLUMES)]
    done = root / ".complete"
    if not done.exists():
        import numcodecs

        v3 = int(zarr.__version__.split(".")[0]) >= 3
        group = zarr.open_group(str(root), mode="w", zarr_format=2) if v3 else zarr.open_group(str(root), mode="w")

        def make(name: str):
            if v3:
                return group.create_array(name, shape=SHAPE, chunks=CHUNKS, dtype="uint16", compressors=numcodecs.Zstd(level=3))
            return group.create_dataset(name, shape=SHAPE, chunks=CHUNKS, dtype="uint16", compressor=numcodecs.Zstd(level=3))

        for i, name in enumerate(names):
            make(name)[...] = field(SHAPE, seed=100 + i)
        zarr.consolidate_metadata(str(root))
        done.write_text("ok")
    return [str(root / n) for n in names]


def _tree_cpu() -> float:
    """CPU seconds of this process and every process under it (the cluster: raylet, workers)."""
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent, cpu[int(entry)] = proc_stat(int(entry))
            except OSError:  # gone meanwhile
                continue
            children.setdefault(parent, []).append(int(entry))
    total, todo = 0.0, [os.getpid()]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo.extend(children.get(pid, ()))
    return total


def _zarr2() -> str | None:
    """Why ray.data.read_zarr cannot run here, or None."""
    try:
        import zarr.hierarchy  # noqa: F401  (zarr-python 2 only)
    except ImportError:
        import zarr

        return f"ray.data.read_zarr needs zarr-python 2 (zarr<3); this environment has {zarr.__version__}"
    return None


def run_damacy(uris: list[str], tasks: int):
    import damacy
    import damacy.ray

    tiles = damacy.GridBoxes(uris, CHUNKS)
    cfg = damacy.Config(samples_per_batch=4, sample_shape=CHUNKS, dtype="u16", n_io_threads=1, decode_workers=1, drop_last=False)
    return damacy.ray.read(
        tiles, cfg, embedded=True, rows_per_task=len(tiles) // tasks, override_num_blocks=tasks
    ), "data"


def run_read_zarr(root: Path, tasks: int):
    import ray.data

    return ray.data.read_zarr(
        str(root), array_paths=[f"vol{i}" for i in range(VOLUMES)], override_num_blocks=tasks
    ), "chunk"


def _consume(ds, column: str, check=None) -> tuple[float, int]:
    t0 = time.perf_counter()
    rows = 0
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        x = batch[column]
        if check is not None:
            check(batch)
            check = None
        rows += len(x)
    return time.perf_counter() - t0, rows


def main(data: str, repeats: int, tasks: int) -> dict:
    import ray
    import zarr

    root = Path(data) / "ray-v2" / "group.zarr"
    uris = _write(root)
    cpus = os.cpu_count() or 1
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    why = _zarr2()
    readers = ["damacy"] + ([] if why else ["read_zarr"])
    if why:
        print(f"read_zarr not run: {why}")
    n = VOLUMES * int(np.prod([s // c for s, c in zip(SHAPE, CHUNKS)]))
    tile_bytes = int(np.prod(CHUNKS)) * 2
    arrays = [zarr.open_array(u, mode="r") for u in uris]

    def check_damacy(b):
        import damacy

        tiles = damacy.GridBoxes(uris, CHUNKS)
        want = list(tiles)
        for i, x in zip(b["index"][:3], b["data"][:3]):
            s = want[i]
            if not np.array_equal(x, arrays[uris.index(s.uri)][s.selection]):
                raise SystemExit(f"MISMATCH: damacy tile {i}")

    def check_read_zarr(b):
        for name, sl, x in zip(b["array"][:3], b["chunk_slices"][:3], b["chunk"][:3]):
            sel = tuple(slice(int(a), int(z)) for a, z in sl)
            if not np.array_equal(x, arrays[int(str(name)[-1])][sel]):
                raise SystemExit(f"MISMATCH: read_zarr {name} {sl}")

    make = {"damacy": lambda: run_damacy(uris, tasks), "read_zarr": lambda: run_read_zarr(root, tasks)}
    checks = {"damacy": check_damacy, "read_zarr": check_read_zarr}
    for r in readers:  # warm: workers started, values checked
        ds, col = make[r]()
        _, rows = _consume(ds, col, checks[r])
        if rows != n:
            raise SystemExit(f"{r} gave {rows} tiles, not {n}")
    print(f"verified: {', '.join(readers)} give the {n} tiles; the first rows equal zarr-python's")
    seconds: dict[str, list[float]] = {r: [] for r in readers}
    cpu: dict[str, list[float]] = {r: [] for r in readers}
    for _ in range(repeats):
        for r in readers:
            ds, col = make[r]()
            c0 = _tree_cpu()
            s, _ = _consume(ds, col)
            cpu[r].append(_tree_cpu() - c0)
            seconds[r].append(s)
    ray.shutdown()
    rows = {}
    for r in readers:
        med = statistics.median(seconds[r])
        rows[r] = {
            "median_s": med,
            "tiles_per_s": n / med,
            "GBps": n * tile_bytes / med / 1e9,
            "cpu_ms_per_tile": 1e3 * statistics.median(cpu[r]) / n,
            "runs_s": seconds[r],
        }
    print(
        f"\n== {n} tiles of {CHUNKS} uint16 ({tile_bytes >> 20} MiB), {tasks} read tasks, {cpus} CPUs, {repeats} repeats"
    )
    print(f"{'reader':10} {'tiles/s':>9} {'GB/s':>7} {'median s':>9} {'cpu ms/tile':>12}")
    for r, row in rows.items():
        print(
            f"{r:10} {row['tiles_per_s']:9.1f} {row['GBps']:7.3f} {row['median_s']:9.3f} {row['cpu_ms_per_tile']:12.2f}"
        )
    if "read_zarr" in rows:
        ratio = rows["damacy"]["tiles_per_s"] / rows["read_zarr"]["tiles_per_s"]
        print(f"damacy / read_zarr: {ratio:.2f}x")
        rows["damacy"]["vs_read_zarr"] = ratio
    return {"tiles": n, "tasks": tasks, "cpus": cpus, "repeats": repeats, "read_zarr": why or "run", "readers": rows}
