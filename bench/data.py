"""Benchmark datasets, written by zarr-python with fixed seeds and reused when present."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Dataset:
    name: str
    volumes: int
    shape: tuple[int, int, int]
    shards: tuple[int, int, int] | None
    chunks: tuple[int, int, int]
    compressor: str  # "zstd" or "blosc"
    seed: int = 0

    def paths(self, root: Path) -> list[Path]:
        return [root / self.name / f"vol{i}.zarr" for i in range(self.volumes)]


def _codecs(ds: Dataset):
    from zarr.codecs import BloscCodec, ZstdCodec

    if ds.compressor == "zstd":
        return [ZstdCodec(level=3)]
    if ds.compressor == "blosc":
        return [BloscCodec(cname="zstd", clevel=3, shuffle="bitshuffle", typesize=2)]
    raise ValueError(ds.compressor)


def field(shape, seed: int) -> np.ndarray:
    """A smooth field (mean about 250) plus Poisson noise, as uint16: ~1.7x with zstd."""
    rng = np.random.default_rng(seed)
    z, y, x = (np.arange(n, dtype=np.float32) for n in shape)
    phase = rng.uniform(0, 6.3, size=3).astype(np.float32)
    smooth = (
        1
        + 0.4 * np.sin(z[:, None, None] / 9.0 + phase[0]) * np.cos(y[None, :, None] / 13.0 + phase[1])
        + 0.3 * np.sin(x[None, None, :] / 7.0 + y[None, :, None] / 17.0 + phase[2])
    )
    return rng.poisson(250 * smooth).astype(np.uint16)


def ensure(ds: Dataset, root: Path, log=print) -> list[str]:
    """The volumes of ``ds`` under ``root``, written unless an identical set is there."""
    import zarr

    folder = root / ds.name
    marker = folder / "dataset.json"
    want = json.dumps(asdict(ds), sort_keys=True)
    if marker.is_file() and marker.read_text() == want:
        return [str(p) for p in ds.paths(root)]
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for i, path in enumerate(ds.paths(root)):
        log(f"writing {path} ({'x'.join(map(str, ds.shape))} uint16, chunks {ds.chunks}, shards {ds.shards}, {ds.compressor})")
        arr = zarr.create_array(
            str(path),
            shape=ds.shape,
            dtype="uint16",
            chunks=ds.chunks,
            shards=ds.shards,
            compressors=_codecs(ds),
            fill_value=0,
        )
        step = ds.shards[0] if ds.shards else ds.chunks[0] * 4
        for z in range(0, ds.shape[0], step):
            block = field((min(step, ds.shape[0] - z), *ds.shape[1:]), seed=ds.seed * 1000 + i * 100 + z)
            arr[z : z + block.shape[0]] = block
    marker.write_text(want)
    return [str(p) for p in ds.paths(root)]
