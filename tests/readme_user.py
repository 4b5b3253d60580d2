"""Stand-ins for the names the README's snippets call the user's own: ``model`` (a LightningModule
with an ``encoder``, four ``blocks.<i>.conv`` and a ``head``), ``datamodule``, ``loader``,
``optimizer`` and ``loss_fn``. tests/test_readme.py imports, into a snippet, only those of these
names the snippet uses without defining them; everything else a snippet needs, it creates itself.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x.unsqueeze(1))).squeeze(1)


class UserModel(L.LightningModule):
    """A tiny regression model shaped like the README's examples."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.encoder(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return loss_fn(self(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loss_fn(output: torch.Tensor) -> torch.Tensor:
    return (output - 1.0).pow(2).mean()


class UserData(L.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.randn(64, 8, generator=torch.Generator().manual_seed(0)), batch_size=16)


torch.manual_seed(0)
model = UserModel()
datamodule = UserData()
loader = datamodule.train_dataloader()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
