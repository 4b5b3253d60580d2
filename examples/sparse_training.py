"""Fixed-mask sparse training: prune 80% of an MLP's weights to zero and train the rest around them.

The mask comes from weight magnitude after a short dense training (global magnitude pruning);
pinning the pruned weights to 0 keeps them exactly zero through every AdamW step, weight decay
and momentum included, with no re-masking loop in the model's code.

    python examples/sparse_training.py
"""

import functools
import warnings

import lightning as L
import torch

from lightning_pin import Pin, PinCallback, PinMonitor
from lightning_pin.app.data import DigitsDataModule
from lightning_pin.app.models import MLP, Classifier

SPARSITY = 0.8


def trainer(callbacks: list, epochs: int) -> L.Trainer:
    return L.Trainer(max_epochs=epochs, callbacks=callbacks, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)


def main() -> None:
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny models train fastest on one thread, and never fight over cores
    data = DigitsDataModule()
    adamw = functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=1e-2)
    model = Classifier(MLP(hidden=(128, 64)), optimizer=adamw)
    trainer([], epochs=3).fit(model, data)

    # Global magnitude pruning over the weight matrices: the smallest 80% become zero.
    weights = {n: p.detach() for n, p in model.named_parameters() if n.endswith("weight")}
    threshold = torch.cat([w.abs().flatten() for w in weights.values()]).quantile(SPARSITY)
    masks = {n: w.abs() <= threshold for n, w in weights.items()}

    monitor = PinMonitor(accuracy=True)  # accuracy before pruning, right after, and after retraining
    callback = PinCallback([Pin(list(masks), mask=masks, value=0.0)], monitor=monitor)
    trainer([callback], epochs=4).fit(model, data)
    callback.verify(model)  # raises PinError if any pruned weight is not exactly 0

    zeros = sum(int((model.get_parameter(n) == 0)[m].sum()) for n, m in masks.items())
    pruned = sum(int(m.sum()) for m in masks.values())
    total = sum(m.numel() for m in masks.values())
    assert zeros == pruned
    print(f"\npruned {pruned:,} of {total:,} weights ({pruned / total:.0%}); all {zeros:,} still exactly 0 "
          f"(pins exact: verified)")
    print(f"accuracy  dense {monitor.baseline:.3f}  pruned {monitor.forced:.3f}  retrained sparse {monitor.final:.3f}")


if __name__ == "__main__":
    main()
