"""damacy for PyTorch: an iterable of tensors over epochs of a sampler, with the state a
checkpoint needs (``torchdata``'s ``StatefulDataLoader`` protocol: ``state_dict`` /
``load_state_dict``).

::

    sampler = damacy.RandomBoxes(uris, (64, 128, 128), seed=0, samples_per_epoch=10_000)
    loader = damacy.torch.Loader(damacy.Config(samples_per_batch=8, sample_shape=(64, 128, 128), dtype="bf16"), sampler)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x in loader:          # torch tensors, zero-copy views of the batch slots
            ...

The pipeline is made on first iteration, in the process that iterates (so a loader made
before a fork is fine). A tensor keeps its slot until it is deleted; the batch counts as
seen (for ``state_dict``) once its tensor is handed out. It is a
``torch.utils.data.IterableDataset``: ``DataLoader(loader, batch_size=None, num_workers=0)``
works (the pipeline has threads of its own; more DataLoader workers would each read the
whole epoch, so they are refused). With ``num_workers=1`` the pipeline, and so the position in
the epoch, lives in the worker: the training process's ``loader.state_dict()`` does not see it
(take the state in the worker, as torchdata's ``StatefulDataLoader`` does, or use
``num_workers=0``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from damacy_protocol.config import Config
from damacy_protocol.errors import InvalidArgument

__all__ = ["Loader"]


class Loader(IterableDataset):
    """Tensors of ``sampler``'s current epoch, ``config.samples_per_batch`` samples each.

    ``endpoint``: a damacyd (default: the node's when one answers, else embedded, as
    :func:`damacy.Pipeline`); ``device``: move each batch there (``to(device,
    non_blocking=True)``); ``pin_memory``: copy host batches into page-locked memory first
    (needs CUDA); ``with_info``: yield ``(tensor, batch.info)`` (samples, errors, padding)."""

    def __init__(
        self,
        config: Config,
        sampler: Any,
        *,
        endpoint: str | None = None,
        device: str | torch.device | None = None,
        pin_memory: bool = False,
        with_info: bool = False,
    ) -> None:
        if not isinstance(config, Config):
            raise InvalidArgument(f"Loader takes a damacy.Config, got {type(config).__name__}")
        if pin_memory and not torch.cuda.is_available():
            raise InvalidArgument("pin_memory needs CUDA (no CUDA device is available to this torch)")
        self.config = config
        self.sampler = sampler
        self.endpoint = endpoint
        self.device = None if device is None else torch.device(device)
        self.pin_memory = pin_memory
        self.with_info = with_info
        self.epoch = getattr(sampler, "epoch", 0)
        self._pipe = None
        self._pipe_pid = 0  # the process that made _pipe
        self._restore: dict[str, Any] | None = None
        self._yielded = False  # the pipeline has been pushed to
        self._finished = True  # the last iteration read its whole epoch
        self._pipe_epoch = self.epoch  # the epoch the pipeline was pushed

    # -- epochs -------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._restore = None
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        """Batches in an epoch: whole ones (``drop_last``, the Config's default: a short
        last batch is left out), or with the last one short (``drop_last=False``)."""
        n = self.config.samples_per_batch
        return len(self.sampler) // n if self.config.drop_last else (len(self.sampler) + n - 1) // n

    def _pipeline(self):
        if self._pipe is not None and self._pipe_pid != os.getpid():
            # made before a fork (the loader iterated here, then handed to a DataLoader
            # worker): the parent's; this process makes its own
            self._pipe = None
            self._finished = True
        if self._pipe is None:
            from damacy.pipeline import Pipeline

            self._pipe = Pipeline(self.config, endpoint=self.endpoint) if self.endpoint else Pipeline(self.config)
            self._pipe_pid = os.getpid()
        return self._pipe

    def __iter__(self):
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            raise InvalidArgument(
                "damacy.torch.Loader reads with threads of its own: use DataLoader(loader, batch_size=None, num_workers=0)"
            )
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.epoch)
        if self._pipe is not None and self._pipe_pid != os.getpid():
            self._pipe, self._finished = None, True  # the parent's (see _pipeline)
        if self._pipe is not None and (self._restore is not None or not self._finished):
            # an epoch left half read still has samples queued: start over
            self._pipe.close()
            self._pipe = None
        pipe = self._pipeline()
        if self._restore is not None:
            pipe.load_state_dict(self._restore)
            self._restore = None
        pipe.push(self.sampler)
        self._yielded, self._finished, self._pipe_epoch = True, False, self.epoch
        for batch in pipe.batches():  # until the epoch is drained (after a restore: its rest)
            x = torch.from_dlpack(batch)
            batch_info = batch.info
            batch.release()  # the tensor holds the slot now; the batch counts as seen
            if self.pin_memory and x.device.type == "cpu":
                x = x.pin_memory()
            if self.device is not None:
                x = x.to(self.device, non_blocking=True)
            yield (x, batch_info) if self.with_info else x
            x = batch_info = None  # the caller's now: this frame must not keep its slot while the next pops
        # with drop_last, the samples of a short last batch stay queued in the pipeline (a
        # later push would complete that batch with the next epoch's): the next iteration
        # starts over, as after an epoch left half read
        self._finished = not (self.config.drop_last and len(self.sampler) % self.config.samples_per_batch)

    # -- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where training is: the epoch, and the pipeline's position within it (batches
        handed out so far). Plain data."""
        if self._pipe is not None and self._yielded and self._restore is None:
            # the pipeline's position, in the epoch it read (set_epoch since: that one's start)
            pipe = self._pipe.state_dict() if self._pipe_epoch == self.epoch else None
        else:  # not read yet: where a restore put it, or the start
            pipe = self._restore
        return {"epoch": self.epoch, "pipeline": pipe}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` at the next iteration (a new process, the same sampler
        arguments): the rest of that epoch, batch for batch as the first run had them."""
        self.set_epoch(int(state["epoch"]))
        pipe = state.get("pipeline")
        source = None if pipe is None else pipe.get("source_state")
        if source is not None and int(source.get("epoch", state["epoch"])) != int(state["epoch"]):
            pipe = None  # saved after set_epoch moved on: that epoch starts from its beginning
        elif source is not None and hasattr(self.sampler, "load_state_dict"):
            self.sampler.load_state_dict(source)
        self._restore = pipe

    def __getstate__(self) -> dict[str, Any]:
        """A copy for another process (a spawned DataLoader worker): as a forked one, it
        makes its own pipeline, from the start of the epoch or where a restore put it."""
        state = dict(self.__dict__)
        state.update(_pipe=None, _pipe_pid=0, _finished=True)
        return state

    def close(self) -> None:
        if self._pipe is not None:
            self._pipe.close()  # a forked copy's close leaves the parent's pipeline alone
            self._pipe = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
