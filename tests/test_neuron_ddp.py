"""Stuck neurons under DDP (``ddp_spawn``, two CPU processes): on both ranks every forward reads the
stuck values, no gradient reaches them (their filters never move under SGD without weight decay),
and the ranks stay identical. Each rank writes what it saw to a file the test process checks.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers import trainer
from lightning_pin import NeuronPin, Pin, PinCallback

# Under pytest-xdist (make test) every test that starts several processes runs on one worker, one at a time:
# two process groups starting side by side compete for ports and for the two cores.
pytestmark = pytest.mark.xdist_group("processes")

CHANNELS = [1, 4]


class DDPCNN(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 6, 3, padding=1)
        self.fc1 = nn.Linear(6 * 5 * 5, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.fc1(torch.relu(self.conv(x)).flatten(1))))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def teardown(self, stage):
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


class SeenOnRank(L.Callback):
    """A forward hook after the pins on ``conv`` and ``fc1``; writes what it saw, per rank."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer, pl_module):
        self.conv, self.fc1 = [], []
        self.init = pl_module.conv.weight.detach().clone()
        self.hooks = [
            pl_module.conv.register_forward_hook(lambda m, a, o: self.conv.append(o[:, CHANNELS].detach().clone())),
            pl_module.fc1.register_forward_hook(lambda m, a, o: self.fc1.append(o.detach().clone())),
        ]

    def on_train_end(self, trainer, pl_module):
        for hook in self.hooks:
            hook.remove()
        torch.save(
            {"conv": self.conv, "fc1": self.fc1, "init": self.init,
             "final": {n: p.detach().clone() for n, p in pl_module.named_parameters()}},
            Path(self.out_dir) / f"rank{trainer.global_rank}.pt",
        )


def _loader():
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(32, 1, 5, 5, generator=g), torch.randint(0, 3, (32,), generator=g)),
                      batch_size=4)


def test_ddp_spawn_neuron_pins_hold_on_both_ranks(tmp_path):
    torch.manual_seed(0)
    model = DDPCNN()
    pins = [NeuronPin("conv", channels=CHANNELS, value=0.0), NeuronPin("fc1", fraction=0.25, seed=1, value=0.5),
            Pin("head.bias", value=0.0)]
    callback = PinCallback(pins, verbose=False)
    trainer(strategy="ddp_spawn", devices=2, max_epochs=1, callbacks=[callback, SeenOnRank(str(tmp_path))]).fit(
        model, _loader())
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    from lightning_pin.core.kinds.neuron import fraction_positions

    stuck = fraction_positions("fc1", 8, 0.25, 1)
    for rank, seen in enumerate(ranks):
        assert len(seen["conv"]) == 4 and len(seen["fc1"]) == 4  # 32 samples, 2 ranks, batches of 4
        for out in seen["conv"]:
            assert torch.equal(out, torch.zeros_like(out)), f"rank {rank}"
        for out in seen["fc1"]:
            assert torch.equal(out[:, stuck], torch.full_like(out[:, stuck], 0.5)), f"rank {rank}"
        weight = seen["final"]["conv.weight"]
        assert torch.equal(weight[CHANNELS], seen["init"][CHANNELS]), f"rank {rank}: a stuck channel's filter moved"
        assert not torch.equal(weight, seen["init"])  # the rest trained
    for name in ranks[0]["final"]:
        assert torch.equal(ranks[0]["final"][name], ranks[1]["final"][name]), name
