"""Pins in a Lightning Fabric loop: setup, pin, train, verify, save and resume.

A small classifier trains with Fabric while ``pin()`` holds three weights of its output layer
at chosen values (a watermark, say) and keeps its first layer's bias frozen. Halfway, the run
saves model, optimizer and pins with ``fabric.save`` (the handle has ``state_dict`` and
``load_state_dict``, so Fabric saves and restores it like the optimizer). A restart builds a
new model with other random weights, a new optimizer and the same pins, loads the checkpoint
with ``fabric.load`` and finishes: it ends bit for bit where an uninterrupted run ends.

    python examples/fabric_loop.py
"""

import tempfile
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_pin import Pin, pin

STEPS, SAVE_AT = 20, 10
PINS = [
    Pin("out.weight", indices=[(0, 0), (1, 5), (2, 9)], value=[0.5, -0.25, 1.0]),  # chosen values
    Pin("hidden.bias"),  # frozen at the values it has when pin() is called (value=None)
]


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(10, 32)
        self.out = nn.Linear(32, 3)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


def data() -> list:
    """Three Gaussian blobs, in fixed batches."""
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(3, 10, generator=g) * 2
    out = []
    for _ in range(STEPS):
        y = torch.randint(0, 3, (32,), generator=g)
        out.append((centers[y] + torch.randn(32, 10, generator=g), y))
    return out


def setup(fabric: Fabric, seed: int):
    """A model with fresh random weights (from ``seed``), its optimizer, and the pins."""
    torch.manual_seed(seed)
    model = Classifier()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1))
    handle = pin(model, optimizer, PINS)  # names as on the Classifier, Fabric's wrapper looked through
    return model, optimizer, handle


def train(fabric: Fabric, model, optimizer, handle, batches) -> None:
    for x, y in batches:
        loss = nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)  # pinned gradients are zero when this returns
        optimizer.step()  # pinned values are written back right after the update
        optimizer.zero_grad()


def main() -> None:
    torch.set_num_threads(1)  # tiny models train fastest on one thread
    fabric = Fabric(accelerator="cpu", devices=1)
    batches = data()

    # Uninterrupted: all steps in one go.
    model, optimizer, handle = setup(fabric, seed=0)
    frozen_bias = model.hidden.bias.detach().clone()
    train(fabric, model, optimizer, handle, batches)
    handle.verify()
    # handle.module is the Classifier inside Fabric's wrapper: its names are the pins' names.
    uninterrupted = {n: p.detach().clone() for n, p in handle.module.named_parameters()}

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "half.ckpt"
        # Interrupted: train to SAVE_AT and save model, optimizer and pins.
        model, optimizer, handle = setup(fabric, seed=0)
        train(fabric, model, optimizer, handle, batches[:SAVE_AT])
        fabric.save(path, {"model": model, "optimizer": optimizer, "pins": handle})

        # Restart: other random weights; pins last in the dict, so they load after the weights.
        model, optimizer, handle = setup(fabric, seed=1)
        fabric.load(path, {"model": model, "optimizer": optimizer, "pins": handle}, weights_only=True)
        assert handle.step == SAVE_AT
        train(fabric, model, optimizer, handle, batches[SAVE_AT:])
        handle.verify()

    resumed = {n: p.detach() for n, p in handle.module.named_parameters()}
    identical = all(torch.equal(resumed[n], uninterrupted[n]) for n in uninterrupted)
    print(f"steps: {handle.step} (saved after {SAVE_AT}, resumed with other random weights)")
    print(f"out.weight at the pinned elements: {resumed['out.weight'][[0, 1, 2], [0, 5, 9]].tolist()}")
    print(f"hidden.bias frozen since step 0: {torch.equal(resumed['hidden.bias'], frozen_bias)}")
    print(f"resumed run identical to the uninterrupted one: {identical}")
    assert identical and torch.equal(resumed["hidden.bias"], frozen_bias)
    print("pins exact: verified (handle.verify before saving and after resuming)")


if __name__ == "__main__":
    main()
