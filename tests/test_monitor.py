"""PinMonitor inside a real Trainer: what is logged (and when), accuracy preservation against an
independent evaluation, the guard, resume, CSV and TensorBoard, and agreement across two DDP ranks."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import TinyNet, trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from test_ddp import ddp_run  # noqa: F401  (the fixture: its one ddp_spawn run also serves the DDP test here)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.regression import MeanSquaredError

from lightning_pin import AccuracyGapError, Pin, PinCallback, PinMonitor


class MemoryLogger(Logger):
    """Keeps every (step, metrics) it is given."""

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    @property
    def name(self):
        return "memory"

    @property
    def version(self):
        return 0

    @rank_zero_only
    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(step, m[key]) for step, m in self.rows if key in m]


# ----------------------------------------------------------------------------------------------
# A hand-computed step inside Lightning


class KnownGrads(L.LightningModule):
    """a.weight = [[1, 0], [0, 4]], b.weight = [[0, 16]], and a loss whose gradients are constants."""

    GRAD_A = torch.tensor([[0.25, 24.0], [0.0, -0.5]])
    GRAD_B = torch.tensor([[6.0, 0.0]])

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2, bias=False)
        self.b = nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            self.a.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 4.0]]))
            self.b.weight.copy_(torch.tensor([[0.0, 16.0]]))

    def training_step(self, batch, batch_idx):
        return (self.a.weight * self.GRAD_A).sum() + (self.b.weight * self.GRAD_B).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, weight_decay=0.5)


def one_batch_per_step(steps: int) -> DataLoader:
    return DataLoader(TensorDataset(torch.zeros(steps, 1)), batch_size=1)


def known_pins() -> list[Pin]:
    return [Pin("a.weight", indices=[(0, 0), (1, 1)], value=[0.5, -2.0])]


def test_one_sgd_step_is_logged_as_computed_by_hand():
    logger = MemoryLogger()
    cb = PinCallback(known_pins(), verbose=False, monitor=PinMonitor(weight_drift=True))
    trainer(max_steps=1, logger=logger, log_every_n_steps=1, callbacks=[cb]).fit(KnownGrads(), one_batch_per_step(1))
    (step, logged), = [(s, m) for s, m in logger.rows if "pin/drift_max" in m]
    assert step == 1  # logged after optimizer step 0, with the number of steps taken
    # Pinned gradients are masked; the coupled decay lr*wd*p moves 0.5 and -2.0 by 0.125 and 0.5.
    assert logged["pin/drift_max"] == 0.5
    assert logged["pin/drift_mean"] == 0.3125
    assert logged["pin/violations"] == 0
    # Free elements: a[0,1] moves by 0.5 * 24 = 12; b moves by 0.5 * 6 = 3 and 0.5 * 0.5 * 16 = 4.
    # ||(12)|| = 12, ||(3, 4)|| = 5, total 13; the free weights' norm at train start is 16.
    assert logged["pin/weight_drift/a"] == 12.0
    assert logged["pin/weight_drift/b"] == 5.0
    assert logged["pin/weight_drift"] == 13.0
    assert logged["pin/weight_drift_relative"] == 0.8125
    assert cb.monitor.history["pin_drift"] == [[1, 0.5, 0.3125, 0]]
    cb.verify()


class MeasureRecorder(Callback):
    """Which steps the engine measured (it must measure only on logging steps): an observer of the
    engine's restores that never asks for stats itself, so it sees them only when the monitor does."""

    def __init__(self):
        self.measured: list[int] = []
        self._seen = False

    def on_train_start(self, trainer, pl_module):
        engine = next(cb for cb in trainer.callbacks if isinstance(cb, PinCallback)).engine
        self._handle = engine.register_restore_hook(self._observe)

    def _observe(self, stats):
        self._seen = self._seen or stats is not None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._seen:
            self.measured.append(trainer.global_step)
        self._seen = False

    def on_train_end(self, trainer, pl_module):
        self._handle.remove()


def test_measures_and_logs_only_every_log_every_n_steps():
    logger, recorder = MemoryLogger(), MeasureRecorder()
    cb = PinCallback(known_pins(), verbose=False, monitor=PinMonitor(weight_drift=True))
    tr = trainer(max_steps=7, logger=logger, log_every_n_steps=3, callbacks=[cb, recorder])
    tr.fit(KnownGrads(), one_batch_per_step(7))
    assert recorder.measured == [3, 6]
    assert [s for s, _ in logger.series("pin/drift_max")] == [3, 6]
    # Weight drift: 0 at train start, the logging steps, and once more at the end.
    assert [s for s, _ in logger.series("pin/weight_drift")] == [0, 3, 6, 7]


def test_no_logging_steps_when_log_every_n_steps_is_zero():
    logger, recorder = MemoryLogger(), MeasureRecorder()
    cb = PinCallback(known_pins(), verbose=False)
    trainer(max_steps=3, logger=logger, log_every_n_steps=0, callbacks=[cb, recorder]).fit(
        KnownGrads(), one_batch_per_step(3)
    )
    assert recorder.measured == []
    assert logger.series("pin/drift_max") == []


def test_monitor_false_logs_nothing():
    logger = MemoryLogger()
    cb = PinCallback(known_pins(), verbose=False, monitor=False)
    trainer(max_steps=2, logger=logger, log_every_n_steps=1, callbacks=[cb]).fit(KnownGrads(), one_batch_per_step(2))
    assert not any(k.startswith("pin/") for _, m in logger.rows for k in m)
    cb.verify()


class Tamper(Callback):
    """Writes into a pinned element after every batch, behind the pins' back."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with torch.no_grad():
            pl_module.a.weight[0, 0] += 1.0


def test_violations_count_tampering_between_steps():
    logger = MemoryLogger()
    cb = PinCallback(known_pins(), verbose=False, verify="never")
    trainer(max_steps=4, logger=logger, log_every_n_steps=1, callbacks=[cb, Tamper()]).fit(
        KnownGrads(), one_batch_per_step(4)
    )
    # Step 0 starts clean; before every later step one pinned element is off target.
    assert logger.series("pin/violations") == [(1, 0), (2, 1), (3, 1), (4, 1)]
    assert cb.monitor.results()["violations"] == 3


# ----------------------------------------------------------------------------------------------
# Accuracy preservation


def learnable_loader(n: int, seed: int, batch_size: int = 16) -> DataLoader:
    """Labels are the argmax of the first three features: a small MLP learns it in a few epochs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, x[:, :3].argmax(1)), batch_size=batch_size, shuffle=False)


class ValNet(TinyNet):
    """TinyNet with a validation step that returns nothing: the monitor runs the model itself."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))


def accuracy(model: nn.Module, loader: DataLoader, batches: int = 10**9) -> float:
    """Top-1 accuracy as torchmetrics computes it: float32 hits / float32 count."""
    model.eval()
    hits = count = 0
    with torch.no_grad():
        for i, (x, y) in enumerate(loader):
            if i >= batches:
                break
            hits += int((model(x).argmax(1) == y).sum())
            count += len(y)
    model.train()
    return (torch.tensor(hits, dtype=torch.float32) / torch.tensor(count, dtype=torch.float32)).item()


@pytest.fixture(scope="module")
def pretrained():
    torch.manual_seed(0)
    model = ValNet(optimizer_factory=lambda p: torch.optim.Adam(p, lr=0.02))
    trainer(max_epochs=6, limit_val_batches=0).fit(model, learnable_loader(128, seed=1))
    return model


def test_baseline_forced_and_final_match_an_independent_evaluation(pretrained):
    model = copy.deepcopy(pretrained)
    train, val = learnable_loader(128, seed=1), learnable_loader(48, seed=2)  # 3 validation batches
    before = copy.deepcopy(model)
    forced_model = copy.deepcopy(model)  # the pins below, written by hand
    with torch.no_grad():
        forced_model.head.weight[0] = 0.0
        forced_model.head.bias.copy_(torch.tensor([1.0, 0.0, 0.0]))
    logger = MemoryLogger()
    cb = PinCallback(
        [Pin("head.weight", indices=[(0, i) for i in range(16)], value=0.0), Pin("head.bias", value=[1.0, 0.0, 0.0])],
        verbose=False,
        monitor=PinMonitor(accuracy=True),
    )
    # 8 steps per epoch; stop mid-epoch 2 so the final value needs its own pass at the end.
    tr = trainer(max_epochs=5, max_steps=12, logger=logger, limit_val_batches=2, callbacks=[cb])
    tr.fit(model, train, val)
    monitor = cb.monitor
    # limit_val_batches=2: every pass sees the first two validation batches, as validation does.
    assert monitor.baseline == accuracy(before, val, batches=2)
    assert monitor.forced == accuracy(forced_model, val, batches=2)
    assert monitor.final == accuracy(model, val, batches=2)
    assert monitor.forced < monitor.baseline  # the test means something: forcing hurt
    assert [step for step, _ in monitor.preservation.history] == [0, 8, 12]
    assert logger.series("pin/accuracy_baseline") == [(0, monitor.baseline)]
    assert logger.series("pin/accuracy_forced") == [(0, monitor.forced)]
    assert logger.series("pin/accuracy")[-1] == (12, monitor.final)
    assert logger.series("pin/accuracy_gap")[-1] == (12, monitor.baseline - monitor.final)
    results = monitor.results()
    assert (results["metric"], results["baseline"], results["forced"], results["final"]) == (
        "accuracy",
        monitor.baseline,
        monitor.forced,
        monitor.final,
    )
    assert results["pinned_elements"] == 16 + 3
    cb.verify(model)


def test_a_lower_is_better_metric_and_a_custom_predict():
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
    loader = DataLoader(TensorDataset(x, y), batch_size=16)

    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.fc(batch[0]).squeeze(-1), batch[1])

        def validation_step(self, batch, batch_idx):
            pass

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Regressor()
    trainer(max_epochs=5, limit_val_batches=0).fit(model, loader)
    monitor = PinMonitor(accuracy=MeanSquaredError(), predict=lambda m, b: (m.fc(b[0]).squeeze(-1), b[1]))
    assert (monitor.name, monitor.higher_is_better) == ("MeanSquaredError", False)
    cb = PinCallback([Pin("fc.weight", indices=[(0, 3)], value=0.0)], verbose=False, monitor=monitor)
    trainer(max_epochs=3, callbacks=[cb]).fit(model, loader, loader)
    p = monitor.preservation
    assert p.forced > p.baseline  # zeroing the largest coefficient raises the error
    assert p.gap(p.forced) == p.forced - p.baseline  # lower is better: worse is positive
    assert p.final < p.forced


def _pinned_head_zero(**monitor_kwargs) -> PinCallback:
    # The whole head pinned at zero: the model cannot recover.
    monitor = PinMonitor(accuracy=True, **monitor_kwargs)
    return PinCallback([Pin("head.weight", value=0.0)], verbose=False, monitor=monitor)


def test_guard_stops_training_when_the_gap_stays_too_large(pretrained):
    cb = _pinned_head_zero(max_gap=0.05, max_gap_from_epoch=1)
    tr = trainer(max_epochs=5, callbacks=[cb])
    with pytest.warns(UserWarning, match="stopping training"):
        tr.fit(copy.deepcopy(pretrained), learnable_loader(128, seed=1), learnable_loader(48, seed=2))
    # Checked from epoch 1 on: validations after epochs 0 and 1, then the stop.
    assert tr.current_epoch == 2
    assert [s for s, _ in cb.monitor.preservation.history] == [0, 8, 16]


def test_guard_can_fail_the_run(pretrained):
    cb = _pinned_head_zero(max_gap=0.05, on_max_gap="raise")
    with pytest.raises(AccuracyGapError, match="max_gap=0.05"):
        trainer(max_epochs=3, callbacks=[cb]).fit(
            copy.deepcopy(pretrained), learnable_loader(128, seed=1), learnable_loader(48, seed=2)
        )


def test_no_validation_data_warns_and_tracks_nothing(pretrained):
    cb = _pinned_head_zero()
    with pytest.warns(UserWarning, match="no validation data"):
        trainer(max_steps=2, callbacks=[cb]).fit(copy.deepcopy(pretrained), learnable_loader(32, seed=1))
    assert cb.monitor.baseline is None and cb.monitor.results()["metric"] is None


def test_resume_keeps_the_baseline_and_the_history(pretrained, tmp_path):
    train, val = learnable_loader(128, seed=1), learnable_loader(48, seed=2)
    pins = [Pin("head.weight", indices=[(0, i) for i in range(16)], value=0.0)]
    first = PinCallback(pins, verbose=False, monitor=PinMonitor(accuracy=True))
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    model = copy.deepcopy(pretrained)
    trainer(max_epochs=2, callbacks=[first, checkpoint], enable_checkpointing=True).fit(model, train, val)
    history = [list(r) for r in first.monitor.preservation.history]

    second = PinCallback(pins, verbose=False, monitor=PinMonitor(accuracy=True))
    resumed = copy.deepcopy(pretrained)
    trainer(max_epochs=3, callbacks=[second]).fit(resumed, train, val, ckpt_path=str(tmp_path / "last.ckpt"))
    assert second.monitor.baseline == first.monitor.baseline
    assert second.monitor.forced == first.monitor.forced
    assert second.monitor.preservation.history[: len(history)] == history
    assert [s for s, _ in second.monitor.preservation.history] == [0, 8, 16, 24]
    # Re-measuring at the resume would have seen the pinned, retrained model instead.
    assert accuracy(resumed, val) == second.monitor.final


def test_csv_and_tensorboard_loggers_both_receive_the_metrics(pretrained, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    csv, tb = CSVLogger(tmp_path, name="csv"), TensorBoardLogger(tmp_path, name="tb")
    cb = PinCallback(
        [Pin("head.weight", indices=[(0, i) for i in range(16)], value=0.0)],
        verbose=False,
        monitor=PinMonitor(accuracy=True, weight_drift=True),
    )
    tr = trainer(max_epochs=2, logger=[csv, tb], log_every_n_steps=4, callbacks=[cb])
    tr.fit(copy.deepcopy(pretrained), learnable_loader(128, seed=1), learnable_loader(48, seed=2))
    header = (Path(csv.log_dir) / "metrics.csv").read_text().splitlines()[0].split(",")
    events = EventAccumulator(tb.log_dir)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for key in ("pin/drift_max", "pin/drift_mean", "pin/violations", "pin/weight_drift", "pin/accuracy",
                "pin/accuracy_baseline", "pin/accuracy_forced", "pin/accuracy_gap", "pin/weight_drift/encoder"):
        assert key in header, key
        assert key in tags, key
    assert [e.step for e in events.Scalars("pin/drift_max")] == [4, 8, 12, 16]
    # The report goes to the first logger's directory.
    report = json.loads((Path(csv.log_dir) / "pin_report.json").read_text())
    assert report["final"] == cb.monitor.final and (Path(csv.log_dir) / "pin_report.png").exists()


# ----------------------------------------------------------------------------------------------
# Two DDP ranks


@pytest.mark.xdist_group("processes")  # the run of tests/test_ddp.py, on the worker that runs the group
def test_metric_values_agree_across_two_ddp_ranks(ddp_run):
    """tests/test_ddp.py's ddp_spawn run (its pins, ``PinMonitor(accuracy=True)``, a validation set, logs every 2
    steps): one run of two processes serves both modules."""
    (zero, one), model, before, val = ddp_run.results, ddp_run.model, ddp_run.before, ddp_run.val
    assert zero["world_size"] == one["world_size"] == 2
    assert zero["results"] == one["results"]
    results = zero["results"]
    # 64 training samples (32 per rank, 4 steps per epoch); 32 validation samples, 16 per rank.
    assert [s for s in results["history"]["pin_drift"]["step"]] == [2, 4, 6, 8]
    assert results["history"]["accuracy"]["step"] == [0, 4, 8]
    # Each rank saw half of the validation data: the synced values are the whole set's.
    assert results["baseline"] == accuracy(before, val)
    assert results["final"] == accuracy(model, val)  # ddp_spawn hands rank 0's weights back
    # Rank-dependent updates reduce as documented, to the same values on both ranks.
    for rank in (zero, one):
        assert rank["synced"]["drift"] == {"max": 2.0, "mean": 2.0}  # max(1, 2); (4 + 8) / (2 + 4)
        assert rank["synced"]["violations"] == 3  # the worst rank
        assert rank["synced"]["weight_drift"] == {"total": [3.0], "relative": [0.5], "groups": [3.0]}  # mean(8, 10)


def test_hydra_builds_the_callback_with_its_monitor():
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    config = OmegaConf.create(
        """
        _target_: lightning_pin.PinCallback
        pins: [{params: "head.weight", indices: [[0, 1]], value: 0.0}]
        monitor:
          _target_: lightning_pin.PinMonitor
          accuracy: {_target_: torchmetrics.classification.MulticlassAccuracy, num_classes: 3, top_k: 2}
          tolerance: 0.02
          max_gap: 0.1
          max_gap_from_epoch: 2
          on_max_gap: raise
        """
    )
    callback = instantiate(config)
    monitor = callback.monitor
    assert isinstance(monitor, PinMonitor) and monitor.name == "MulticlassAccuracy"
    assert (monitor.metric.top_k, monitor.tolerance, monitor.max_gap, monitor.on_max_gap) == (2, 0.02, 0.1, "raise")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(accuracy="yes"), "accuracy must be"),
        (dict(on_max_gap="ignore"), "on_max_gap"),
        (dict(max_gap=-1.0), "max_gap"),
        (dict(tolerance=float("inf")), "tolerance"),
        (dict(predict="no_such_module.predict"), "cannot import predict"),
    ],
)
def test_bad_monitor_arguments_are_rejected_up_front(kwargs, match):
    from lightning_pin import PinError

    with pytest.raises(PinError, match=match):
        PinMonitor(**kwargs)
    with pytest.raises(PinError, match="monitor must be"):
        PinCallback([], monitor="yes")


def test_the_default_monitor_keeps_no_copy_of_the_weights():
    """Weight drift (a copy of every trainable weight) is opt-in: the default logs no weight drift
    and holds no copy while training; ``weight_drift=True`` logs it from a copy taken at train start."""
    from lightning.pytorch.callbacks import Callback

    class Probe(Callback):
        def __init__(self, cb):
            self.cb, self.copies = cb, []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.copies.append(self.cb.monitor._free is not None)

    for weight_drift in (None, True):
        logger = MemoryLogger()
        monitor = PinMonitor() if weight_drift is None else PinMonitor(weight_drift=True)
        cb = PinCallback(known_pins(), verbose=False, monitor=monitor)
        probe = Probe(cb)
        trainer(max_steps=2, logger=logger, log_every_n_steps=1, callbacks=[cb, probe]).fit(
            KnownGrads(), one_batch_per_step(2)
        )
        assert probe.copies == [bool(weight_drift)] * 2
        assert bool(logger.series("pin/weight_drift")) == bool(weight_drift)
        assert logger.series("pin/drift_max")
