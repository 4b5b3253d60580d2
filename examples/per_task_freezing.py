"""Per-task freezing with Adam.

A tutorial on per-task freezing shows that with Adam, requires_grad=False does not stop a layer
from moving. Batches alternate between two tasks, both task layers take part in every forward,
and each task's batches must leave the other task's layer alone. The tutorial's first try zeroes
the frozen layer's gradients (or sets requires_grad=False with zeroed grads): with SGD that
works, with Adam it does not, because Adam keeps stepping with its stored moments. Its fix is to
set grad = None so Adam skips the layer, state included. PinCallback does that for `when` pins.

    python examples/per_task_freezing.py
"""

import warnings

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_pin import Pin, PinCallback


def task_1(batch, batch_idx) -> bool:
    """Batches of task 1 (module level, so the pin can name it and spawned processes can import it)."""
    return int(batch[2]) == 1


def task_2(batch, batch_idx) -> bool:
    return int(batch[2]) == 2


class TwoTasks(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(6, 16)
        self.hidden_task1 = nn.Linear(16, 16)
        self.hidden_task2 = nn.Linear(16, 16)
        self.heads = nn.ModuleDict({"1": nn.Linear(32, 1), "2": nn.Linear(32, 1)})

    def training_step(self, batch, batch_idx):
        x, y, task = batch
        h = torch.relu(self.shared(x))
        features = torch.cat([torch.relu(self.hidden_task1(h)), torch.relu(self.hidden_task2(h))], dim=1)
        return nn.functional.mse_loss(self.heads[str(int(task))](features).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def batches(count: int = 40) -> list:
    """Pre-made batches (x, y, task), alternating task 1 and task 2."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(count):
        x = torch.randn(16, 6, generator=g)
        task = 1 + i % 2
        out.append((x, x[:, :3].sum(1) if task == 1 else x[:, 3:].prod(1), torch.tensor(task)))
    return out


class ZeroFrozenGrads(L.Callback):
    """The tutorial's first try: zero the frozen layer's gradients before the optimizer step."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.frozen = module.hidden_task2 if task_1(batch, batch_idx) else module.hidden_task1

    def on_before_optimizer_step(self, trainer, module, optimizer):
        for p in self.frozen.parameters():
            p.grad.zero_()


class FrozenMoves(L.Callback):
    """Largest change of a layer over a batch of the other task, i.e. while it should be frozen."""

    def __init__(self):
        self.largest = 0.0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.frozen = module.hidden_task2 if task_1(batch, batch_idx) else module.hidden_task1
        self.before = [p.detach().clone() for p in self.frozen.parameters()]

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        after = list(self.frozen.parameters())
        self.largest = max([self.largest] + [(a - b).abs().max().item() for a, b in zip(after, self.before)])


def fit(callbacks: list, initial: dict) -> TwoTasks:
    model = TwoTasks()
    model.load_state_dict(initial)
    L.Trainer(max_epochs=2, callbacks=callbacks, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(model, DataLoader(batches(), batch_size=None))
    return model


def main() -> None:
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny models train fastest on one thread, and never fight over cores
    initial = TwoTasks().state_dict()

    naive = FrozenMoves()
    fit([ZeroFrozenGrads(), naive], initial)

    pinned = FrozenMoves()
    callback = PinCallback([Pin("hidden_task2.*", when=task_1), Pin("hidden_task1.*", when=task_2)])
    model = fit([callback, pinned], initial)
    callback.verify(model)  # the pins active at the last step are on target

    print("\nlargest move of a frozen layer during the other task's batch, under Adam:")
    print(f"  zeroed gradients (the tutorial's first try): {naive.largest:.3g}")
    print(f"  PinCallback with `when` pins:                {pinned.largest:.3g}")
    assert naive.largest > 0 and pinned.largest == 0.0
    print("pins exact: verified (PinCallback.verify, and no frozen layer moved by a single bit)")


if __name__ == "__main__":
    main()
