"""The smallest use: one PinCallback in a plain Lightning Trainer.

Freeze a layer and force two elements of another to chosen values, under AdamW (whose weight
decay would otherwise shrink them every step), then check that they held bit for bit.

    python examples/plain_trainer.py
"""

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pin import Pin, PinCallback


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.encoder(x))).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny models train fastest on one thread, and never fight over cores
    x = torch.randn(512, 8)
    loader = DataLoader(TensorDataset(x, x.sum(1)), batch_size=32, shuffle=True)
    model = Regressor()
    encoder_before = model.encoder.weight.detach().clone()

    pins = PinCallback([
        Pin("encoder.*"),                                                  # keep the encoder as it is
        Pin("head.weight", indices=[(0, 0), (0, 5)], value=[0.5, -2.0]),  # force two elements
    ])
    trainer = L.Trainer(max_epochs=3, callbacks=[pins], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)

    pins.verify(model)  # raises PinError naming every pinned element that is off target
    assert torch.equal(model.encoder.weight, encoder_before)
    assert model.head.weight[0, 0].item() == 0.5 and model.head.weight[0, 5].item() == -2.0
    moved = (model.head.weight.detach()[0, [1, 2, 3, 4]]).tolist()
    print(f"after {trainer.global_step} AdamW steps: encoder unchanged, head.weight[0, 0] = "
          f"{model.head.weight[0, 0].item()}, head.weight[0, 5] = {model.head.weight[0, 5].item()} "
          f"(pins exact: verified); free head weights trained to {[round(v, 3) for v in moved]}")


if __name__ == "__main__":
    main()
