"""Force single weights to chosen values and keep them there.

A user of ONNX Runtime training forced single conv weights to 25, 5 and 125, re-setting them
every 100 batches, and found that the optimizer moved them between resets: the retrained model
did not hold the values. They also saw 2.58e8 never move (float32 spacing at that size is 16, so
small updates vanish) while 2.58e-8 jumped by about the learning rate each step (Adam normalises
its step size). Here each value is written once, before training, then trained with Adam:
without PinCallback, and with it.

    python examples/force_elements.py
"""

import functools
import warnings

import lightning as L
import torch

from lightning_pin import Pin, PinCallback
from lightning_pin.app.data import DigitsDataModule
from lightning_pin.app.models import Classifier, SmallCNN

NAME = "backbone.features.0.weight"
CELLS = [(0, 0, 1, 1), (5, 0, 2, 2), (12, 0, 0, 1), (3, 0, 1, 2), (7, 0, 2, 0)]
VALUES = [25.0, 5.0, 125.0, 2.58e8, 2.58e-8]


def train(model: Classifier, callbacks: list) -> None:
    L.Trainer(max_epochs=2, callbacks=callbacks, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(model, DigitsDataModule())


def cells(model: Classifier) -> list[float]:
    weight = model.get_parameter(NAME).detach()
    return [weight[c].item() for c in CELLS]


def main() -> None:
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    adam = functools.partial(torch.optim.Adam, lr=1e-3)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny models train fastest on one thread, and never fight over cores
    initial = Classifier(SmallCNN(), optimizer=adam).state_dict()

    # Without PinCallback: write the values once, then train.
    naive = Classifier(SmallCNN(), optimizer=adam)
    naive.load_state_dict(initial)
    with torch.no_grad():
        for cell, value in zip(CELLS, VALUES):
            naive.get_parameter(NAME)[cell] = value
    asked = cells(naive)  # what float32 stores: 2.58e-8 is not representable exactly
    train(naive, [])

    # With PinCallback: the same values, forced before the first step and kept after every step.
    pinned = Classifier(SmallCNN(), optimizer=adam)
    pinned.load_state_dict(initial)
    callback = PinCallback(Pin(NAME, indices=CELLS, value=VALUES))
    train(pinned, [callback])
    callback.verify(pinned)  # raises PinError naming any cell off target

    print(f"\n{'cell':<16}{'stored value':>16}{'without pins':>18}{'with PinCallback':>20}")
    for cell, stored, free, kept in zip(CELLS, asked, cells(naive), cells(pinned)):
        print(f"{str(cell):<16}{stored:>16.6g}{free:>18.6g}{kept:>20.6g}  {'exact' if kept == stored else 'MOVED'}")
        assert kept == stored
    print("pins exact: verified (PinCallback.verify and == on every cell)")


if __name__ == "__main__":
    main()
