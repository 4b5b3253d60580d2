"""Stuck-at faults: 5% of a CNN's conv weights are stuck at random values; can training recover?

A user of ONNX Runtime training wanted 20% of some layers' weights and 5% of others forced to
chosen values while retraining kept the model's accuracy. This is that job, and the default job
of the Hydra app (`python -m lightning_pin.train`), written out in Python: pretrain a small CNN on
scikit-learn's digits (no download), stick 5% of its conv weights at random values in [-2, 2)
(the same cells and values on every run), and retrain the rest of the network around them.
PinMonitor measures the accuracy before the faults (baseline), right after forcing them (forced)
and after retraining (final).

    python examples/stuck_at_faults.py
"""

import functools
import warnings

import lightning as L
import torch

from lightning_pin import Pin, PinCallback, PinMonitor
from lightning_pin.app.data import DigitsDataModule
from lightning_pin.app.models import Classifier, SmallCNN
from lightning_pin.app.pins import UniformValues, realize


def trainer(epochs: int, callbacks: list) -> L.Trainer:
    return L.Trainer(max_epochs=epochs, callbacks=callbacks, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)


def main() -> None:
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny models train fastest on one thread, and never fight over cores
    data = DigitsDataModule()
    model = Classifier(SmallCNN(), optimizer=functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=1e-2))
    trainer(8, []).fit(model, data)

    # 5% of the cells of every conv weight, chosen by seed 0 and each parameter's name, stuck at
    # values drawn (seed 1) in [-2, 2). realize() turns the value generator into tensors.
    stuck_values = UniformValues(-2.0, 2.0, seed=1)
    faults = realize(Pin("backbone.features.*.weight", fraction=0.05, seed=0, value=stuck_values), model)
    monitor = PinMonitor(accuracy=True)
    callback = PinCallback([faults], monitor=monitor)
    trainer(6, [callback]).fit(model, data)
    callback.verify(model)  # raises PinError if any stuck cell moved

    print(f"accuracy  baseline {monitor.baseline:.3f}  forced {monitor.forced:.3f}  final {monitor.final:.3f}"
          "  (pins exact: verified)")


if __name__ == "__main__":
    main()
