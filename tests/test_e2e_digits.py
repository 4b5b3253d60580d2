"""End to end on real data shipped with scikit-learn (the 8x8 digits, no download): 5% of a small
CNN's conv weights stuck at random values in [-2, 2]. Forcing them costs accuracy; retraining the free weights
around them brings it back to within one point of the baseline, and the report says so."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import trainer
from lightning.pytorch.loggers import CSVLogger

from lightning_pin import Pin, PinCallback, PinMonitor
from lightning_pin.cli import main
from lightning_pin.core.plan import resolve

pytest.importorskip("sklearn")
from lightning_pin.app.data import DigitsDataModule  # noqa: E402
from lightning_pin.app.models import Classifier, SmallCNN  # noqa: E402

CONV = ("backbone.features.0.weight", "backbone.features.2.weight")
LR, WEIGHT_DECAY = 3e-3, 1e-2  # Classifier's default AdamW


def accuracy(model, loader) -> float:
    """Top-1 accuracy the way torchmetrics computes it (float32 hits / float32 count)."""
    model.eval()
    hits = count = 0
    with torch.no_grad():
        for x, y in loader:
            hits += int((model(x).argmax(1) == y).sum())
            count += len(y)
    return (torch.tensor(hits, dtype=torch.float32) / torch.tensor(count, dtype=torch.float32)).item()


def stuck_at_pins(model) -> list[Pin]:
    """5% of every conv weight stuck at values drawn uniformly from [-2, 2], the same on every run.

    The conv weights are within about +-0.3, so these are large faults: on six other seeds they
    cost 7 to 20 points before retraining, and retraining recovered to within a point every time.
    """
    pins = []
    for i, name in enumerate(CONV):
        count = round(0.05 * model.get_parameter(name).numel())
        stuck = (torch.rand(count, generator=torch.Generator().manual_seed(i)) * 2 - 1) * 2
        pins.append(Pin(name, fraction=0.05, seed=0, value=stuck))
    return pins


def test_stuck_at_faults_on_digits_recover_and_the_report_says_so(tmp_path):
    L.seed_everything(0)
    data = DigitsDataModule(seed=0)
    model = Classifier(SmallCNN())
    trainer(max_epochs=8, limit_val_batches=0).fit(model, data)  # pretrain
    before = copy.deepcopy(model)
    pins = stuck_at_pins(model)

    # The forced model, independently: write the stuck values by hand at the selected elements.
    forced_model = copy.deepcopy(before)
    plan = resolve(pins, forced_model)
    with torch.no_grad():
        for rp in plan.pins:
            for name, selection in rp.selections.items():
                forced_model.get_parameter(name).view(-1)[selection.index] = rp.pin.value

    callback = PinCallback(pins, verbose=False, monitor=PinMonitor(accuracy=True, tolerance=0.01, weight_drift=True))
    logger = CSVLogger(tmp_path, name="digits")
    trainer(max_epochs=6, logger=logger, log_every_n_steps=5, callbacks=[callback]).fit(model, data)
    callback.verify(model)

    monitor, val = callback.monitor, data.val_dataloader()
    assert monitor.baseline == accuracy(before, val)
    assert monitor.forced == accuracy(forced_model, val)
    assert monitor.final == accuracy(model, val)
    assert monitor.forced <= monitor.baseline - 0.05  # stuck weights cost accuracy ...
    assert monitor.final >= monitor.baseline - 0.01  # ... and retraining brings it back within one point
    print(f"digits: baseline {monitor.baseline:.4f}  forced {monitor.forced:.4f}  final {monitor.final:.4f}")

    run = Path(logger.log_dir)
    report = json.loads((run / "pin_report.json").read_text())
    assert (report["metric"], report["baseline"], report["forced"], report["final"]) == (
        "accuracy", monitor.baseline, monitor.forced, monitor.final
    )
    assert report["gap"] == monitor.baseline - monitor.final
    assert report["recovered_step"] is not None and report["recovered_step"] <= report["steps"]
    assert report["pinned_elements"] == 7 + 230 and report["trainable_elements"] == 9930
    assert report["violations"] == 0
    # Gradients of pinned elements are masked and their Adam moments stay zero, so the only push is
    # AdamW's decoupled decay, lr * wd * |value|: its largest value belongs to the largest stuck value.
    # (A float32 product and subtraction, so compared to 1e-3 relative rather than exactly.)
    largest = max(float(p.value.abs().max()) for p in pins)
    assert report["pin_drift_max"] == pytest.approx(LR * WEIGHT_DECAY * largest, rel=1e-3)
    assert report["weight_drift"] > 0 and set(report["weight_drift_by_module"]) == {
        "backbone.features", "backbone.head"
    }
    png = (run / "pin_report.png").read_bytes()
    assert png[:4] == b"\x89PNG" and len(png) > 20_000

    # Rebuilt on demand from the logger's CSV: the same numbers.
    assert main(["report", str(run), "--out", str(tmp_path / "from_csv"), "--no-plot"]) == 0
    assert json.loads((tmp_path / "from_csv" / "pin_report.json").read_text()) == report
