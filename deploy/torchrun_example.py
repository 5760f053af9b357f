"""A DDP training loop fed by damacy, on one node or many::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        deploy/torchrun_example.py --checkpoint ckpt/ data/a.zarr data/b.zarr

Every rank reads its part of each epoch (``damacy.RandomBoxes``: one global list per epoch
from the seed, rank ``r`` of ``W`` taking every ``W``-th sample), through the node's damacyd
when one answers (``$DAMACY_ENDPOINT`` or the node's default endpoint; one per node, shared
by its ranks), else embedded. The loader's state is checkpointed beside the model's; a job
restarted from the checkpoint goes on with the batches it would have seen, on the same
number of ranks, or (elastic) on another number over the samples no rank had read.

``--read-log FILE`` writes what each rank read (for the tests); ``--stop-after N`` stops after
``N`` steps of the last epoch with a checkpoint, as a preempted job would.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

import damacy
from damacy.torch import Loader


def parse(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("uris", nargs="+")
    ap.add_argument("--box", default="16,32,32")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--samples-per-epoch", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", default=None, help="folder of the checkpoint (resumed from when present)")
    ap.add_argument("--stop-after", type=int, default=None, help="stop after N steps of the last epoch, checkpointed")
    ap.add_argument("--read-log", default=None, help="write the samples each rank read here (rank appended)")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    box = tuple(int(n) for n in args.box.split(","))
    sampler = damacy.RandomBoxes(args.uris, box, seed=args.seed, samples_per_epoch=args.samples_per_epoch, rank=rank, world_size=world)
    loader = Loader(damacy.Config(samples_per_batch=args.batch, sample_shape=box, dtype="f32"), sampler)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    start = 0
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    if ckpt is not None and (ckpt / "meta.json").is_file():
        meta = json.loads((ckpt / "meta.json").read_text())
        model.module.load_state_dict(torch.load(ckpt / "model.pt"))
        states = [json.loads((ckpt / f"loader{r}.json").read_text()) for r in range(meta["world_size"])]
        if meta["world_size"] == world:
            loader.load_state_dict(states[rank])  # this rank's own place in the epoch
        else:  # elastic: the epoch's samples no earlier rank had read, shared by these ranks
            sampler.resume([s["pipeline"] for s in states if s["pipeline"] is not None])
            loader.set_epoch(states[0]["epoch"])
        start = meta["epoch"]

    log = []
    for epoch in range(start, args.epochs):
        if epoch != loader.epoch:
            loader.set_epoch(epoch)
        loader.with_info = True
        steps = 0
        for x, info in loader:
            loss = model(x.mean(dim=tuple(range(1, x.ndim))).unsqueeze(1)).pow(2).mean()  # a real model goes here
            opt.zero_grad()
            loss.backward()  # DDP all-reduces the gradients: the ranks step together
            opt.step()
            log += [[epoch, s.uri, [[sl.start, sl.stop] for sl in s.selection]] for s in info.samples]
            steps += 1
            if args.stop_after is not None and epoch == args.epochs - 1 and steps == args.stop_after:
                save(ckpt, loader, model, epoch, rank, world)
                finish(args, log, rank, loader)
                return
        if rank == 0 and steps:  # a resume from an epoch's last step has none left
            print(f"epoch {epoch}: {steps} steps per rank, loss {loss.item():.4f}", flush=True)
    if ckpt is not None:
        save(ckpt, loader, model, args.epochs, rank, world)
    finish(args, log, rank, loader)


def save(ckpt: Path | None, loader: Loader, model, epoch: int, rank: int, world: int) -> None:
    """Each rank writes its loader's state; rank 0 the model's and what run it was."""
    if ckpt is None:
        return
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / f"loader{rank}.json").write_text(json.dumps(loader.state_dict()))
    if rank == 0:
        torch.save(model.module.state_dict(), ckpt / "model.pt")
        (ckpt / "meta.json").write_text(json.dumps({"epoch": epoch, "world_size": world}))
    dist.barrier()


def finish(args, log, rank: int, loader: Loader) -> None:
    if args.read_log:
        Path(f"{args.read_log}.{rank}").write_text(json.dumps(log))
    loader.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
