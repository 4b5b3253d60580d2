"""The app's building blocks: seeded data splits, the backbones, and the Classifier with the monitor."""

from __future__ import annotations

import functools

import pytest
import torch

from helpers import trainer
from lightning_pin import Pin, PinCallback, PinMonitor

pytest.importorskip("sklearn")
from lightning_pin.app.data import DigitsDataModule, SyntheticDataModule  # noqa: E402
from lightning_pin.app.models import MLP, Classifier, SmallCNN, TinyTransformer  # noqa: E402


def _split(data):
    data.setup()
    return data.train_set.tensors, data.val_set.tensors


def test_digits_split_is_fixed_by_its_seed():
    (xt, yt), (xv, yv) = _split(DigitsDataModule(seed=0))
    assert (len(yt), len(yv)) == (1348, 449)
    assert xt.shape[1:] == (1, 8, 8) and xt.dtype == torch.float32
    assert float(xt.min()) == 0.0 and float(xt.max()) == 1.0
    (xt2, _), (xv2, _) = _split(DigitsDataModule(seed=0))
    assert torch.equal(xt, xt2) and torch.equal(xv, xv2)
    (_, _), (xv3, _) = _split(DigitsDataModule(seed=1))
    assert not torch.equal(xv, xv3)
    # Train and validation are disjoint: no validation image appears among the training ones.
    train_rows = {tuple(r.tolist()) for r in xt.flatten(1)}
    assert sum(tuple(r.tolist()) in train_rows for r in xv.flatten(1)) < 5  # digits has a few exact duplicates


def test_synthetic_data_is_deterministic_and_balanced():
    (x, y), _ = _split(SyntheticDataModule(num_samples=200, num_classes=4, seed=3))
    (x2, y2), _ = _split(SyntheticDataModule(num_samples=200, num_classes=4, seed=3))
    assert torch.equal(x, x2) and torch.equal(y, y2)
    full = torch.cat([y, _split(SyntheticDataModule(num_samples=200, num_classes=4, seed=3))[1][1]])
    assert torch.bincount(full).tolist() == [50, 50, 50, 50]


@pytest.mark.parametrize("backbone", [SmallCNN, MLP, TinyTransformer])
def test_each_backbone_learns_the_synthetic_set(backbone):
    torch.manual_seed(0)
    data = SyntheticDataModule(num_samples=512, noise=1.0)
    model = Classifier(
        backbone(),
        optimizer=functools.partial(torch.optim.AdamW, lr=3e-3),
        scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.9),
    )
    tr = trainer(max_epochs=3)
    tr.fit(model, data)
    assert tr.callback_metrics["val_acc"] > 0.5  # chance is 0.1; 18 steps
    assert tr.lr_scheduler_configs[0].scheduler.last_epoch == 3


def test_classifier_outputs_spare_the_monitor_a_forward_during_validation():
    calls = []

    def predict(module, batch):
        calls.append(len(batch[1]))
        return module(batch[0]), batch[1]

    torch.manual_seed(0)
    data = SyntheticDataModule(num_samples=256, val_batch_size=32)  # 64 validation samples: 2 batches
    cb = PinCallback(
        [Pin("backbone.head.weight", indices=[(0, 0)], value=0.0)],
        verbose=False,
        monitor=PinMonitor(accuracy=True, predict=predict),
    )
    trainer(max_epochs=2, callbacks=[cb]).fit(Classifier(SmallCNN()), data)
    assert len(calls) == 2 * 2  # the baseline and forced passes only; validation reused its outputs
    assert [s for s, _ in cb.monitor.preservation.history] == [0, 3, 6]
