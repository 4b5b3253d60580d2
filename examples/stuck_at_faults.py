"""Stuck-at faults: 5% of a CNN's conv weights are stuck at random values; can training recover?

The story of the ONNX Runtime user in the seeds: force chosen weights to fixed values and
retrain the rest of the network around them. Runs in well under a minute on 2 CPU cores, on
scikit-learn's digits (no download).

    python examples/stuck_at_faults.py
"""

import lightning as L
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pin import Pin, PinCallback


def digits_loaders(batch_size: int = 64) -> tuple[DataLoader, DataLoader]:
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, val = order[:1400], order[1400:]
    return (
        DataLoader(TensorDataset(x[train], y[train]), batch_size=batch_size, shuffle=True),
        DataLoader(TensorDataset(x[val], y[val]), batch_size=256),
    )


class SmallCNN(L.LightningModule):
    def __init__(self, lr: float = 3e-3):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
        )
        self.lr = lr

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=1e-2)


@torch.no_grad()
def accuracy(model: nn.Module, loader: DataLoader) -> float:
    model.eval()
    hits = sum(int((model(x).argmax(1) == y).sum()) for x, y in loader)
    model.train()
    return hits / len(loader.dataset)


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    train, val = digits_loaders()
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)

    model = SmallCNN()
    L.Trainer(max_epochs=8, **quiet).fit(model, train)
    baseline = accuracy(model, val)

    # 5% of every conv weight stuck at random values in [-1, 1], the same cells on every run.
    pins = []
    for name in ("net.0.weight", "net.2.weight"):
        numel = model.get_parameter(name).numel()
        count = max(1, round(0.05 * numel))
        stuck = torch.rand(count, generator=torch.Generator().manual_seed(1)) * 2 - 1
        pins.append(Pin(name, fraction=0.05, seed=0, value=stuck))
    callback = PinCallback(pins)

    # Force the faults without training (a zero-step fit applies nothing, so do it by hand here).
    faulty = SmallCNN()
    faulty.load_state_dict(model.state_dict())
    from lightning_pin.engine import PinEngine
    from lightning_pin.plan import resolve

    engine = PinEngine(resolve(pins, faulty))
    engine.set_active(engine.ids_at(0))
    forced = accuracy(faulty, val)

    L.Trainer(max_epochs=6, callbacks=[callback], **quiet).fit(faulty, train)
    callback.verify(faulty)  # raises PinError if any stuck cell moved
    final = accuracy(faulty, val)
    print(f"accuracy  baseline {baseline:.3f}  forced {forced:.3f}  final {final:.3f}  (pins exact: verified)")


if __name__ == "__main__":
    main()
