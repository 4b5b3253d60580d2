"""Fault models: stuck bits and stuck-at cells drawn for a CNN, held exactly while the rest retrains.

A faulty accelerator holds some of its weights whatever training writes. Two fault models, drawn
with lightning_pin.faults on a small CNN pretrained on scikit-learn's digits (no download):

- stuck bits: each exponent bit of each conv weight's float32 word is stuck with probability
  1e-3, reading 0 or 1 (SRAM weight memory). The other bits of those weights keep training;
- stuck-at cells: 10% of the conv weights are stuck, SA0 cells at 0.0, SA1 cells at
  sign(w) * the layer's largest magnitude (ReRAM devices stuck at an extreme).

Each run starts from the same pretrained weights; PinMonitor measures the accuracy before the
faults (baseline), right after forcing them (forced) and after retraining around them (final).
An exponent's top bit stuck at 1 multiplies a weight by up to 2**128: the optimizer's small steps
cannot bring it back down, and accuracy does not recover. The second run protects
that bit and draws the same bit error rate over the others.

    python examples/bit_faults.py
"""

import copy
import functools
import warnings

import lightning as L
import torch

from lightning_pin import PinCallback, PinMonitor
from lightning_pin.app.data import DigitsDataModule
from lightning_pin.app.models import Classifier, SmallCNN
from lightning_pin.faults import bit_faults, cell_faults

CONVS = "backbone.features.*.weight"
#: Bit 30 of a float32 word: stuck at 1, it makes every weight at least 2 in magnitude (at most ~3e38).
TOP_EXPONENT_BIT = 1 << 30


def trainer(epochs: int, callbacks: list) -> L.Trainer:
    return L.Trainer(max_epochs=epochs, callbacks=callbacks, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)


def retrain(pretrained: Classifier, data: DigitsDataModule, pins: list) -> tuple[Classifier, PinMonitor]:
    """Retrain a copy of ``pretrained`` with ``pins`` held; raises PinError if any pin moved."""
    model = copy.deepcopy(pretrained)
    monitor = PinMonitor(accuracy=True)
    callback = PinCallback(pins, monitor=monitor, verbose=False)
    trainer(4, [callback]).fit(model, data)
    callback.verify(model)
    return model, monitor


def show(label: str, monitor: PinMonitor, note: str = "") -> None:
    accuracy = f"baseline {monitor.baseline:.3f}  forced {monitor.forced:.3f}  final {monitor.final:.3f}"
    print(f"{label:<30} {accuracy}  {note}".rstrip())


def check_words(model: Classifier, pretrained: Classifier, pins: list) -> tuple[int, int]:
    """The check verify() makes, spelled out on the float32 words: every stuck bit reads what it is
    stuck at. Returns (faulty weights, those whose free bits changed since the pretraining)."""
    faulty = trained = 0
    for p in pins:
        flat = (p.indices * torch.tensor(model.get_parameter(p.params).stride())).sum(dim=1)
        words = model.get_parameter(p.params).detach().reshape(-1).view(torch.int32)[flat]
        before = pretrained.get_parameter(p.params).detach().reshape(-1).view(torch.int32)[flat]
        stuck = p.stuck_at_zero | p.stuck_at_one
        assert torch.equal(words & stuck, p.stuck_at_one)
        faulty += len(flat)
        trained += int(((words ^ before) & ~stuck).ne(0).sum())
    return faulty, trained


def main() -> None:
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny models train fastest on one thread, and never fight over cores
    data = DigitsDataModule()
    pretrained = Classifier(SmallCNN(), optimizer=functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=1e-2))
    trainer(8, []).fit(pretrained, data)

    # Stuck exponent bits, drawn from the seed and each parameter's name (the weights play no part).
    bits = bit_faults(pretrained, CONVS, rate=1e-3, bits="exponent", seed=0)
    print(bits.summary)
    model, monitor = retrain(pretrained, data, bits)
    top = sum(int((p.stuck_at_one & TOP_EXPONENT_BIT).ne(0).sum()) for p in bits)
    show("stuck exponent bits", monitor, f"({top} weight(s) with the exponent's top bit stuck at 1: |w| >= 2)")
    faulty, trained = check_words(model, pretrained, bits)

    # The same bit error rate with the exponent's top bit protected (by ECC, say): bits 23-29 only.
    protected = bit_faults(pretrained, CONVS, rate=1e-3, bits=range(23, 30), seed=0)
    model, monitor = retrain(pretrained, data, protected)
    show("same, top exponent bit safe", monitor)
    more = check_words(model, pretrained, protected)
    faulty, trained = faulty + more[0], trained + more[1]

    # Stuck-at cells: SA1 cells read the pretrained layer's largest magnitude, so draw them on it.
    cells = cell_faults(pretrained, CONVS, rate=0.1, seed=0)
    _, monitor = retrain(pretrained, data, cells)
    show("stuck-at cells (10%)", monitor)
    print(f"stuck bits read exactly in {faulty} faulty float32 words; their free bits trained in {trained}"
          "  (pins exact: verified)")


if __name__ == "__main__":
    main()
