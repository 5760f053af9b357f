"""``damacy demo``: the main job on a volume damacy writes itself, with live figures.

Without a uri, a sharded, zstd-compressed Zarr v3 volume (a smooth field plus noise, as
microscopy and CT data look) is written once into the user's cache folder and reused; then
random boxes stream through a pipeline (embedded, or a damacyd's with ``--endpoint``) into
float32 batches while a line shows batches, samples/s, GB/s and where the time goes.

The writer is small on purpose: one array layout (regular grid, default chunk keys, the
``sharding_indexed`` codec with ``bytes`` + ``zstd`` inner chunks and a ``bytes`` +
``crc32c`` index at the end), the same bytes zarr-python writes for that layout (the tests
read it with zarr-python).
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from damacy_protocol.enums import Stage

SIZES = {
    # name: (shape, shard shape, inner chunk shape)
    "small": ((64, 128, 128), (64, 128, 128), (32, 64, 64)),  # 2 MiB decoded, for tests
    "default": ((256, 512, 512), (128, 256, 256), (32, 64, 64)),  # 128 MiB decoded
}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "damacy"


def demo_volume(size: str = "default", folder: Path | None = None, log: Callable[[str], None] = lambda s: None) -> Path:
    """The demo volume of ``size``, written on first use (in ``folder``, by default the
    user's cache folder) and reused after."""
    shape, shards, chunks = SIZES[size]
    path = (folder or cache_dir()) / f"demo-{size}.zarr"
    if (path / "zarr.json").exists():
        return path
    log(f"writing the demo volume {'x'.join(map(str, shape))} uint16 to {path} (once)...")
    write_volume(path, _field(shape), shards, chunks)
    return path


def _field(shape: tuple[int, ...], seed: int = 0, slab: int = 16) -> np.ndarray:
    """A smooth field (mean about 200) with Poisson noise, as uint16; made ``slab`` planes at
    a time, so its float and int64 temporaries stay small (whole, they took 1.6 GB for the
    default volume's 128 MiB)."""
    rng = np.random.default_rng(seed)
    out = np.empty(shape, dtype=np.uint16)
    axes = np.meshgrid(*(np.linspace(0, 4 * np.pi, n, dtype=np.float32) for n in shape), indexing="ij", sparse=True)
    for z in range(0, shape[0], slab):
        smooth = 200 + 100 * np.sin(axes[0][z : z + slab]) * np.cos(axes[1] + 0.5 * axes[2])
        out[z : z + slab] = rng.poisson(np.maximum(smooth, 0))
    return out


def write_volume(path: Path, data: np.ndarray, shards: tuple[int, ...], chunks: tuple[int, ...], level: int = 3) -> None:
    """Write ``data`` as a sharded, zstd-compressed Zarr v3 array at ``path``. The array's
    zarr.json is written last (and atomically), so a volume cut short is written again. Each
    writer writes a folder of its own and moves it into place under a lock: of two writing at
    once (two demos started together) one's volume is kept whole, the other's dropped."""
    import crc32c
    import zstandard

    if any(s % c for s, c in zip(shards, chunks)):
        raise ValueError(f"inner chunks {chunks} must tile the shards {shards}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".part-", dir=path.parent))
    try:
        compressor = zstandard.ZstdCompressor(level=level)
        grid = [-(-n // s) for n, s in zip(data.shape, shards)]
        per_shard = [s // c for s, c in zip(shards, chunks)]
        for shard in itertools.product(*map(range, grid)):
            blob = bytearray()
            index = np.full((int(np.prod(per_shard)), 2), 2**64 - 1, dtype="<u8")  # missing: all ones
            for k, inner in enumerate(itertools.product(*map(range, per_shard))):
                start = [(s * n + i * c) for s, n, i, c in zip(shard, shards, inner, chunks)]
                if any(a >= n for a, n in zip(start, data.shape)):
                    continue  # wholly past the array's end
                piece = np.zeros(chunks, dtype="<u2")
                region = data[tuple(slice(a, a + c) for a, c in zip(start, chunks))]
                piece[tuple(slice(0, n) for n in region.shape)] = region
                encoded = compressor.compress(piece.tobytes())
                index[k] = (len(blob), len(encoded))
                blob += encoded
            raw = index.tobytes()
            blob += raw + crc32c.crc32c(raw).to_bytes(4, "little")
            key = tmp / "c" / Path(*map(str, shard))
            key.parent.mkdir(parents=True, exist_ok=True)
            key.write_bytes(bytes(blob))
        meta = {
            "zarr_format": 3,
            "node_type": "array",
            "shape": list(data.shape),
            "data_type": "uint16",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(shards)}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": 0,
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": list(chunks),
                        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd", "configuration": {"level": level, "checksum": False}}],
                        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                        "index_location": "end",
                    },
                }
            ],
            "attributes": {"written_by": "damacy demo"},
        }
        (tmp / "zarr.json").write_text(json.dumps(meta, indent=2))
        os.chmod(tmp, 0o777 & ~_umask())  # (mkdtemp makes it 700: a daemon of another user could not read it)
    except BaseException:  # interrupted (Ctrl-C) or failed: nothing half written is left
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / "zarr.json").exists():  # another writer finished first: its volume stays
            shutil.rmtree(tmp, ignore_errors=True)
            return
        shutil.rmtree(path, ignore_errors=True)  # one cut short
        os.replace(tmp, path)


def _umask() -> int:
    """The process's umask, read without setting it (os.umask sets it, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


STAGES = (Stage.PLAN, Stage.READ, Stage.DECODE, Stage.ASSEMBLE)  # "native" and "direct" are parts of these


def _stage_line(stats: dict) -> str:
    """Where the time went so far: each stage's share of the seconds all threads spent."""
    stages = stats.get("stages", {})
    seconds = {name: stages[name]["seconds"] for name in STAGES if name in stages}
    total = sum(seconds.values())
    if total <= 0:
        return ""
    return " ".join(f"{name} {100 * s / total:.0f}%" for name, s in seconds.items())


def run(uri: str, batches: int, batch_size: int, endpoint: str | None, out=sys.stdout) -> dict:
    """Stream ``batches`` batches of random boxes of ``uri``; print a live line, then a
    summary. Returns the figures."""
    from damacy.pipeline import Pipeline
    from damacy_protocol.config import Config
    from damacy_protocol.samples import Sample
    from damacy_server.read import open_array

    meta = open_array(uri)
    box = tuple(min(n, b) for n, b in zip(meta.shape, (64, 128, 128) if meta.ndim == 3 else (64,) * meta.ndim))
    rng = np.random.default_rng(0)
    samples = [
        Sample(uri, tuple((a, a + b) for a, b in zip((int(rng.integers(0, n - b + 1)) for n, b in zip(meta.shape, box)), box)))
        for _ in range(batches * batch_size)
    ]
    cfg = Config(samples_per_batch=batch_size, sample_shape=box, dtype="f32")
    where = f"damacyd at {endpoint}" if endpoint else "embedded"
    print(f"streaming {batches} batches of {batch_size} x {box} float32 from {uri} ({where})", file=out)
    t0 = time.perf_counter()
    first = None
    done = 0
    nbytes = 0
    # as it says: embedded unless an endpoint is given (a node's damacyd may not serve ~/.cache)
    with (Pipeline(cfg, endpoint=endpoint) if endpoint else Pipeline(cfg, embedded=True)) as pipe:
        pipe.push(samples)
        for batch in pipe.batches():
            with batch:
                nbytes += batch.numpy().nbytes
            done += 1
            now = time.perf_counter()
            first = first if first is not None else now - t0
            if done == batches or done % 4 == 0:
                seconds = now - t0
                print(
                    f"\r  {done}/{batches} batches  {done * batch_size / seconds:7.1f} samples/s  "
                    f"{nbytes / seconds / 1e9:5.2f} GB/s  {_stage_line(pipe.stats_dict())}   ",
                    end="",
                    file=out,
                    flush=True,
                )
        stats = pipe.stats_dict()
    seconds = time.perf_counter() - t0
    print(file=out)
    stages = stats.get("stages", {})
    busy = ", ".join(f"{name} {stages[name]['seconds']:.2f} s" for name in STAGES if name in stages and stages[name]["seconds"] > 0)
    print(
        f"done: {done * batch_size} samples in {seconds:.2f} s ({done * batch_size / seconds:.1f} samples/s, "
        f"{nbytes / seconds / 1e9:.2f} GB/s); first batch after {first or 0:.2f} s",
        file=out,
    )
    if busy:
        print(f"time per stage, summed over threads: {busy}", file=out)
    return {"batches": done, "samples": done * batch_size, "seconds": seconds, "bytes": nbytes}
