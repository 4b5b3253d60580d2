"""Per-task freezing with Adam in a plain PyTorch loop (no Trainer): ``pin()`` and ``batch_start``.

Batches alternate between two tasks. Both task layers take part in every forward, and each
task's batches must leave the other task's layer alone. The usual first try marks the other
layer ``requires_grad=False`` and zeroes the gradients (``zero_grad(set_to_none=False)``): with
SGD that works, with Adam it does not, because Adam keeps stepping with the moments it stored
while the layer trained. ``pin()`` with ``when`` pins freezes the layer for exactly the batches
its ``when`` selects, Adam's moments notwithstanding; the loop tells it which batch comes next
with ``handle.batch_start(batch, batch_idx)``.

    python examples/plain_loop.py
"""

import torch
from torch import nn

from lightning_pin import Pin, pin


def task_1(batch, batch_idx) -> bool:
    """Batches of task 1 (a pin's ``when``: it must return a bool)."""
    return batch[2] == 1


def task_2(batch, batch_idx) -> bool:
    return batch[2] == 2


class TwoTasks(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(6, 16)
        self.hidden_task1 = nn.Linear(16, 16)
        self.hidden_task2 = nn.Linear(16, 16)
        self.heads = nn.ModuleDict({"1": nn.Linear(32, 1), "2": nn.Linear(32, 1)})

    def forward(self, x, task: int):
        h = torch.relu(self.shared(x))
        features = torch.cat([torch.relu(self.hidden_task1(h)), torch.relu(self.hidden_task2(h))], dim=1)
        return self.heads[str(task)](features).squeeze(-1)


def batches(count: int = 40) -> list:
    """Pre-made batches (x, y, task), alternating task 1 and task 2."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(count):
        x = torch.randn(16, 6, generator=g)
        task = 1 + i % 2
        out.append((x, x[:, :3].sum(1) if task == 1 else x[:, 3:].prod(1), task))
    return out


def frozen_layer(model: TwoTasks, batch) -> nn.Module:
    """The layer this batch must leave alone: the other task's."""
    return model.hidden_task2 if task_1(batch, 0) else model.hidden_task1


def loss_of(model: TwoTasks, batch) -> torch.Tensor:
    x, y, task = batch
    return nn.functional.mse_loss(model(x, task), y)


def largest_move(layer: nn.Module, before: list) -> float:
    return max((p.detach() - b).abs().max().item() for p, b in zip(layer.parameters(), before))


def train_with_requires_grad_false(initial: dict, epochs: int = 2) -> float:
    """The first try: ``requires_grad=False`` on the other task's layer, gradients zeroed."""
    model = TwoTasks()
    model.load_state_dict(initial)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    largest = 0.0
    for _ in range(epochs):
        for batch in batches():
            frozen = frozen_layer(model, batch)
            for layer in (model.hidden_task1, model.hidden_task2):
                layer.requires_grad_(layer is not frozen)
            before = [p.detach().clone() for p in frozen.parameters()]
            loss_of(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            largest = max(largest, largest_move(frozen, before))
    return largest


def train_with_pin(initial: dict, epochs: int = 2) -> tuple[float, int]:
    """The same loop with ``pin()``: one ``when`` pin per task layer, decided per batch."""
    model = TwoTasks()
    model.load_state_dict(initial)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    pins = [Pin("hidden_task2.*", when=task_1), Pin("hidden_task1.*", when=task_2)]
    largest = 0.0
    with pin(model, optimizer, pins) as handle:
        for _ in range(epochs):
            for batch_idx, batch in enumerate(batches()):
                handle.batch_start(batch, batch_idx)  # decide the `when` pins before the forward
                frozen = frozen_layer(model, batch)
                before = [p.detach().clone() for p in frozen.parameters()]
                loss_of(model, batch).backward()  # the frozen layer's gradients are zero from here on
                optimizer.step()  # Adam skips it; pinned values are written back right after
                optimizer.zero_grad()
                largest = max(largest, largest_move(frozen, before))
        handle.verify()  # raises PinError naming any pinned element off target
        steps = handle.step
    return largest, steps


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny models train fastest on one thread
    initial = TwoTasks().state_dict()

    naive = train_with_requires_grad_false(initial)
    pinned, steps = train_with_pin(initial)

    print("largest move of a frozen layer during the other task's batch, under Adam:")
    print(f"  requires_grad=False, zeroed gradients: {naive:.3g}")
    print(f"  pin() with `when` pins:                {pinned:.3g}   ({steps} steps)")
    assert naive > 0 and pinned == 0.0
    print("pins exact: verified (handle.verify, and no frozen layer moved by a single bit)")


if __name__ == "__main__":
    main()
