"""Stuck bits in int8 weight codes against stuck bits in float32 words, at one bit error rate.

An accelerator stores weights as int8 codes with a scale, not as float32 words. A small CNN
pretrained on scikit-learn's digits (no download) is quantized to int8 with
``lightning_pin.faults.quantize`` (per output channel, symmetric: scale = max |w| / 127); its
forward then reads ``q * s`` for every weight. Each (weight, code bit) pair is stuck with
probability 1e-2 (``bit_faults(..., code=QuantCode(...))``), and the network retrains around the
faults (quantization-aware: the free code bits train). The same bit error rate on the float32
words of the float network, over all 32 bits, sticks exponent bits too: a weight with the
exponent's top bit stuck at 1 is at least 2 in magnitude (up to 3e38), which no retraining
survives, while a stuck int8 code bit moves a weight by at most 128 scale steps.

    python examples/int8_faults.py
"""

import copy
import functools
import warnings

import lightning as L
import torch

from lightning_pin import PinCallback, PinMonitor, QuantCode
from lightning_pin.app.data import DigitsDataModule
from lightning_pin.app.models import Classifier, SmallCNN
from lightning_pin.faults import bit_faults, quantize

WEIGHTS = ["backbone.features.0.weight", "backbone.features.2.weight", "backbone.head.weight"]
RATE = 1e-2


def trainer(epochs: int, callbacks: list) -> L.Trainer:
    return L.Trainer(max_epochs=epochs, callbacks=callbacks, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)


def int8_codes(model: Classifier) -> dict[str, QuantCode]:
    """Symmetric per-output-channel int8 codes for each weight: scale = max |w| / 127 per channel."""
    codes = {}
    for name in WEIGHTS:
        weight = model.get_parameter(name).detach()
        scale = weight.abs().reshape(weight.shape[0], -1).amax(dim=1) / 127
        codes[name] = QuantCode(bits=8, scale=scale, axis=0)
    return codes


def retrain(pretrained: Classifier, data: DigitsDataModule, pins: list, codes: dict) -> tuple[Classifier, PinMonitor]:
    """Retrain a copy of ``pretrained`` with ``pins`` held (through int8 codes when ``codes``); verified exact."""
    model = copy.deepcopy(pretrained)
    handles = [quantize(model, name, code) for name, code in codes.items()]
    monitor = PinMonitor(accuracy=True)
    callback = PinCallback(pins, monitor=monitor, verbose=False)
    trainer(3, [callback]).fit(model, data)
    callback.verify(model)
    for handle in handles:
        handle.remove()
    return model, monitor


def show(label: str, monitor: PinMonitor, note: str = "") -> None:
    accuracy = f"baseline {monitor.baseline:.3f}  forced {monitor.forced:.3f}  final {monitor.final:.3f}"
    print(f"{label:<34} {accuracy}  {note}".rstrip())


def check_codes(model: Classifier, pins: list) -> int:
    """verify()'s check spelled out: each faulty weight is its code times its scale, its code reads the stuck bits."""
    faulty = 0
    for p in pins:
        weight, code = model.get_parameter(p.params).detach(), p.code
        for coords, zero, one in zip(p.indices.tolist(), p.stuck_at_zero.tolist(), p.stuck_at_one.tolist()):
            w, s = weight[tuple(coords)], code.scale[coords[0]]
            q = torch.round(w / s)
            assert torch.equal(w, q * s) and -128 <= q <= 127
            assert int(q) & 0xFF & (zero | one) == one
            faulty += 1
    return faulty


def main() -> None:
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny models train fastest on one thread, and never fight over cores
    data = DigitsDataModule()
    pretrained = Classifier(SmallCNN(), optimizer=functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=1e-2))
    trainer(6, []).fit(pretrained, data)
    codes = int8_codes(pretrained)

    # Stuck bits of the int8 codes: drawn over the 8 code bits of each weight, the pins carry the code.
    int8 = [p for name, code in codes.items() for p in bit_faults(pretrained, name, rate=RATE, code=code, seed=0)]
    model, monitor = retrain(pretrained, data, int8, codes)
    stuck = sum(len(p.indices) for p in int8)
    show("int8 codes, stuck code bits", monitor, f"({stuck} faulty weights)")
    faulty = check_codes(model, int8)

    # The same bit error rate on the float32 words of the float network.
    float32 = bit_faults(pretrained, WEIGHTS, rate=RATE, seed=0)
    _, monitor = retrain(pretrained, data, float32, {})
    huge = sum(int((p.stuck_at_one & (1 << 30)).ne(0).sum()) for p in float32)
    show("float32 words, stuck bits", monitor, f"({huge} weight(s) with the exponent's top bit at 1: |w| >= 2)")
    print(f"stuck code bits read exactly in {faulty} int8 weights, each exactly its code times its scale"
          "  (pins exact: verified)")


if __name__ == "__main__":
    main()
