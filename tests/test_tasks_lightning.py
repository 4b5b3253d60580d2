"""Task ownership with Lightning: PinCallback(own.pins(t)) and one trainer.fit per phase of a task on
the same LightningModule (a model with BatchNorm); bf16-mixed; resume in the middle of a task from a
Lightning checkpoint; DDP (ddp_spawn, 2 processes) derives the same owner map on both ranks.

Lightning re-creates the optimizer in configure_optimizers on every fit; holding earlier tasks does
not depend on that (the plain-loop tests keep one optimizer and scheduler across tasks)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from helpers import trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pin import PinCallback
from lightning_pin.tasks import TaskOwnership

TASKS = 3


def task_loader(task: int, n: int = 48, batch_size: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(task)
    x = torch.randn(n, 6, generator=g) + task
    y = (x[:, task % 6] > task).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


class TaskNet(L.LightningModule):
    """Linear -> BatchNorm -> ReLU -> shared head, two output columns per task (``self.task``)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.bn = nn.BatchNorm1d(12)
        self.fc2 = nn.Linear(12, 2 * TASKS)
        self.task = 1
        self.own = None  # set by the tests; saved with the checkpoint

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x)[:, 2 * (self.task - 1): 2 * self.task], y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.01)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["task_ownership"] = self.own.state_dict()


PROBE = torch.randn(16, 6, generator=torch.Generator().manual_seed(5))


def probe(model, own, task):
    model.eval()
    with torch.no_grad(), own.view(task):
        out = model(PROBE + task).clone()
    model.train()
    return out


def fit(model, own, task, epochs, ckpt_path=None, **kwargs):
    model.task = task
    callback = PinCallback(own.pins(task), verbose=False, monitor=False)
    tr = trainer(max_epochs=epochs, callbacks=[callback], **kwargs)
    tr.fit(model, task_loader(task), ckpt_path=ckpt_path, weights_only=True if ckpt_path else None)
    callback.verify(model)
    return tr


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_backward_transfer_zero_with_the_callback_and_batchnorm(precision):
    torch.manual_seed(0)
    model = TaskNet()
    own = model.own = TaskOwnership(model, "*")
    after = {}
    for task in range(1, TASKS + 1):
        fit(model, own, task, 2, precision=precision)
        own.prune(task, 0.5)
        fit(model, own, task, 1, precision=precision, accumulate_grad_batches=2, gradient_clip_val=0.1)
        own.commit(task)
        after[task] = (probe(model, own, task), own.fingerprint(task))
    assert sorted(own.norm_layers) == ["bn"]
    for task in range(1, TASKS + 1):
        assert torch.equal(probe(model, own, task), after[task][0]), f"task {task} moved"
        assert own.fingerprint(task) == after[task][1]
    assert own.capacity()["fc1.weight"] < 0.2  # later tasks trained and took their share


@pytest.mark.parametrize("phase", ["before_prune", "after_prune"])
def test_resume_mid_task_from_a_lightning_checkpoint(phase, tmp_path):
    def task_one(model):
        own = model.own = TaskOwnership(model, "*")
        fit(model, own, 1, 2)
        own.prune(1, 0.5)
        fit(model, own, 1, 1)
        own.commit(1)
        return own

    def to_phase(model, own):
        if phase == "after_prune":
            fit(model, own, 2, 2)
            own.prune(2, 0.5)

    torch.manual_seed(0)
    model = TaskNet()
    own = task_one(model)
    to_phase(model, own)
    fit(model, own, 2, 4)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    reference_fingerprint = own.fingerprint(1)

    torch.manual_seed(0)
    model = TaskNet()
    own = task_one(model)
    to_phase(model, own)
    tr = fit(model, own, 2, 2)  # interrupted after two of the four epochs
    path = tmp_path / "mid_task.ckpt"
    tr.save_checkpoint(path)

    torch.manual_seed(1)
    resumed = TaskNet()  # other random weights: everything must come from the checkpoint
    saved = torch.load(path, weights_only=True)
    own = resumed.own = TaskOwnership(resumed, "*")
    own.load_state_dict(saved["task_ownership"])
    fit(resumed, own, 2, 4, ckpt_path=str(path))
    for key, value in reference.items():
        assert torch.equal(resumed.state_dict()[key], value), key
    assert own.fingerprint(1) == reference_fingerprint


class RankTaskNet(TaskNet):
    """Prunes and commits at the end of the fit on every rank and writes what it derived."""

    def __init__(self, out_dir: str):
        super().__init__()
        self.out_dir = out_dir

    def on_train_end(self):
        own = self.own
        own.prune(self.task, 0.5)
        own.commit(self.task)
        torch.save(
            {"own": own.state_dict(), "fingerprint": own.fingerprint(self.task),
             "next_pins": [p.fingerprint() for p in own.pins(self.task + 1)],
             "weights": {n: p.detach().clone() for n, p in own.parameters.items()}},
            Path(self.out_dir) / f"rank{self.global_rank}.pt",
        )

    def teardown(self, stage):
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


@pytest.mark.xdist_group("processes")  # one multi-process test at a time (see test_ddp.py)
def test_ddp_ranks_derive_the_same_owner_map(tmp_path):
    """Each rank prunes its own copy (no communication) and gets the same owner map and the same
    pins for the next task. (Holding pins under DDP: tests/test_ddp.py.)"""
    torch.manual_seed(0)
    model = RankTaskNet(str(tmp_path))
    own = model.own = TaskOwnership(model, "*")
    tr = trainer(strategy="ddp_spawn", devices=2, max_epochs=1,
                 callbacks=[PinCallback(own.pins(1), verbose=False, monitor=False)])
    tr.fit(model, task_loader(1))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for name in ranks[0]["own"]["owner"]:
        assert torch.equal(ranks[0]["own"]["owner"][name], ranks[1]["own"]["owner"][name]), name
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name
    assert set(ranks[0]["own"]["owner"]["fc1.weight"].unique().tolist()) == {0, 1}
    assert ranks[0]["next_pins"] == ranks[1]["next_pins"] and len(ranks[0]["next_pins"]) == 1
    # The test process takes rank 0's ownership; rank 0's pruned weights came back with the fit.
    own.load_state_dict(ranks[0]["own"])
    assert own.fingerprint(1) == ranks[0]["fingerprint"]
    assert [p.fingerprint() for p in own.pins(2)] == ranks[0]["next_pins"]
