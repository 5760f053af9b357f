"""A DDP training loop fed by damacyd: `torchrun --nproc-per-node 4 deploy/torchrun_example.py DATA.zarr`.

Each rank draws its own random boxes; the node's damacyd (started once, see README) reads
and decodes them with one shared cache. Without a damacyd answering (at $DAMACY_ENDPOINT or the node's default endpoint) the pipeline runs embedded.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import damacy


def samples(uri: str, shape: tuple[int, ...], box: tuple[int, ...], rank: int):
    rng = np.random.default_rng(rank)
    while True:
        start = [int(rng.integers(0, n - b + 1)) for n, b in zip(shape, box)]
        yield damacy.Sample(uri, tuple((a, a + b) for a, b in zip(start, box)))


def main() -> None:
    import torch

    uri = sys.argv[1]
    rank = int(os.environ.get("RANK", "0"))
    shape = damacy.open_array(uri).shape
    box = (64, 128, 128)
    cfg = damacy.Config(samples_per_batch=8, sample_shape=box, dtype="bf16")
    with damacy.Pipeline(cfg) as pipe:  # the node's damacyd when one answers, else embedded
        pipe.push(samples(uri, shape, box, rank))
        for step, batch in enumerate(pipe.batches(100)):
            with batch:
                x = torch.from_dlpack(batch)  # zero-copy view of the slot
                loss = x.float().mean()  # a real model goes here
            if step % 10 == 0:
                print(f"rank {rank} step {step} loss {loss.item():.3f}", flush=True)


if __name__ == "__main__":
    main()
