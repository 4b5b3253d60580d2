"""Small models, data and recorders shared by the tests (module level, so ddp_spawn can pickle them)."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_loader(n: int = 64, features: int = 8, classes: int = 3, batch_size: int = 8, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


class TinyNet(L.LightningModule):
    """A two-layer MLP; the optimizer is chosen by a factory so tests can sweep them."""

    def __init__(self, optimizer_factory=None, features: int = 8, hidden: int = 16, classes: int = 3):
        super().__init__()
        self.encoder = nn.Linear(features, hidden)
        self.head = nn.Linear(hidden, classes)
        self.optimizer_factory = optimizer_factory

    def forward(self, x):
        return self.head(torch.relu(self.encoder(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        if self.optimizer_factory is None:
            return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)
        return self.optimizer_factory(self.parameters())


def trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)
