"""A Lightning-style DataModule over damacy: the hooks a ``LightningDataModule`` has
(``setup``, ``train_dataloader``, ``val_dataloader``, ``state_dict``, ``load_state_dict``),
written without Lightning so it runs anywhere; subclass ``lightning.LightningDataModule``
instead of ``object`` to hand it to a Trainer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import damacy
from damacy.torch import Loader


class ZarrDataModule:
    def __init__(self, train_uris: list[str], val_uris: list[str], sample_shape: tuple[int, ...], *, batch: int = 8, samples_per_epoch: int = 1024, seed: int = 0) -> None:
        self.train_uris, self.val_uris = train_uris, val_uris
        self.sample_shape, self.batch = tuple(sample_shape), batch
        self.samples_per_epoch, self.seed = samples_per_epoch, seed
        self.train: Loader | None = None
        self.val: Loader | None = None

    def setup(self, stage: str | None = None) -> None:
        """Samplers read rank and world size from torchrun's environment (RANK, WORLD_SIZE)."""
        cfg = damacy.Config(samples_per_batch=self.batch, sample_shape=self.sample_shape, dtype="f32")
        self.train = Loader(cfg, damacy.RandomBoxes(self.train_uris, self.sample_shape, seed=self.seed, samples_per_epoch=self.samples_per_epoch))
        # every voxel once across ranks (drop_last=False: the last batch short rather than
        # left out); padding windows are marked in the batch's info
        val_cfg = dataclasses.replace(cfg, drop_last=False)
        self.val = Loader(val_cfg, damacy.GridBoxes(self.val_uris, self.sample_shape), with_info=True)

    def train_dataloader(self) -> Loader:
        return self.train

    def val_dataloader(self) -> Loader:
        return self.val

    def state_dict(self) -> dict[str, Any]:
        return {"train": self.train.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train.load_state_dict(state["train"])

    def teardown(self, stage: str | None = None) -> None:
        for loader in (self.train, self.val):
            if loader is not None:
                loader.close()
