"""Named benchmark scenarios: a dataset, how samples are drawn, and the batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import damacy
from bench.data import Dataset

DEFAULT = Dataset("default", 4, (256, 512, 512), (128, 256, 256), (32, 64, 64), "zstd")
BLOSC = Dataset("blosc", 4, (256, 512, 512), (128, 256, 256), (32, 64, 64), "blosc")
SMALL = Dataset("small-chunks", 4, (256, 512, 512), (128, 256, 256), (16, 32, 32), "zstd")
# as default, twice the volumes (1 GiB decoded): room for a working set of half of it
NODE = Dataset("node", 8, (256, 512, 512), (128, 256, 256), (32, 64, 64), "zstd")


@dataclass(frozen=True)
class Scenario:
    name: str
    dataset: Dataset
    kind: str  # "box" or "index"
    sample_shape: tuple[int, ...] = (64, 128, 128)
    samples_per_batch: int = 8
    dtype: str = "f32"
    batches: int = 12
    description: str = ""
    extra: dict = field(default_factory=dict)

    def samples(self, uris: list[str], n_batches: int, seed: int = 0) -> list:
        rng = np.random.default_rng(seed)
        out = []
        shape = self.dataset.shape
        for _ in range(n_batches * self.samples_per_batch):
            uri = uris[int(rng.integers(len(uris)))]
            if self.kind == "box":
                start = [int(rng.integers(0, n - s + 1)) for n, s in zip(shape, self.sample_shape)]
                out.append(damacy.Sample(uri, tuple((a, a + s) for a, s in zip(start, self.sample_shape))))
            else:
                z0 = int(rng.integers(0, shape[0] - self.sample_shape[0] + 1))
                sel = [slice(z0, z0 + self.sample_shape[0])]
                for axis in (1, 2):
                    window = 256
                    w0 = int(rng.integers(0, shape[axis] - window + 1))
                    idx = w0 + rng.choice(window, size=self.sample_shape[axis], replace=False)
                    sel.append(idx.tolist())  # scattered, unsorted
                out.append(damacy.IndexQuery(uri, tuple(sel)))
        return out


SCENARIOS = {
    s.name: s
    for s in [
        Scenario("default", DEFAULT, "box", description="uint16 zstd(3), shards 128x256x256, chunks 32x64x64, boxes 64x128x128"),
        Scenario("blosc", BLOSC, "box", description="as default with blosc(zstd, bitshuffle)"),
        Scenario("small-chunks", SMALL, "box", description="as default with inner chunks 16x32x32"),
        Scenario("index", DEFAULT, "index", description="IndexQuery: 64 z-slices x 128 scattered y x 128 scattered x"),
        Scenario("node", NODE, "box", description="as default on 8 volumes (1 GiB decoded), for bench ranks"),
    ]
}
