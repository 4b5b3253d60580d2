"""Recovery around pinned faults: DistillFromBaseline (teacher = the unpinned model at fit start) and
StopWhenRecovered (stop once within tolerance of the baseline for N validations), on short real fits."""

from __future__ import annotations

import math

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from torch import nn

from helpers import TinyNet, make_loader, snapshot, trainer
from lightning_pin import Pin, PinCallback, PinError, PinMonitor
from lightning_pin.app.config import register_configs
from lightning_pin.app.train import CONFIG_DIR
from lightning_pin.callbacks import DistillFromBaseline, StopWhenRecovered, distillation_loss


class ValNet(TinyNet):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        return {"loss": nn.functional.cross_entropy(logits, y), "preds": logits, "target": y}


def pretrained(epochs: int = 3) -> ValNet:
    torch.manual_seed(0)
    model = ValNet()
    trainer(max_epochs=epochs).fit(model, make_loader(n=128))
    return model


def test_distillation_loss_is_the_softened_kl_times_t_squared():
    student, teacher = torch.zeros(1, 2), torch.tensor([[math.log(3.0), 0.0]])
    # softmax(teacher) = (3/4, 1/4) against (1/2, 1/2)
    kl = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    assert math.isclose(float(distillation_loss(student, teacher, temperature=1.0)), kl, rel_tol=1e-6)
    # At T=2 the teacher is (sqrt 3, 1) / (sqrt 3 + 1); the T^2 factor keeps the gradient's scale.
    p = math.sqrt(3) / (math.sqrt(3) + 1)
    kl2 = p * math.log(p / 0.5) + (1 - p) * math.log((1 - p) / 0.5)
    assert math.isclose(float(distillation_loss(student, teacher, temperature=2.0)), 4 * kl2, rel_tol=1e-6)
    assert float(distillation_loss(teacher, teacher)) == 0.0


def test_distill_teaches_the_unpinned_model_and_pins_hold():
    model = pretrained()
    before = snapshot(model)
    pins = [Pin("encoder.weight", fraction=0.5, value=1.5)]
    pin_cb = PinCallback(pins, monitor=PinMonitor(accuracy=True, report=False))
    distill = DistillFromBaseline(weight=2.0, temperature=3.0)
    t = trainer(max_epochs=2, callbacks=[pin_cb, distill])
    t.fit(model, make_loader(n=128), make_loader(n=64, seed=1))
    pin_cb.verify(model)
    # The teacher is the model before any pin was forced, frozen.
    teacher = distill.teacher.state_dict()
    assert all(torch.equal(teacher[k], before[k]) for k in before)
    assert not any(p.requires_grad for p in distill.teacher.parameters())
    assert float(t.callback_metrics["distill_loss"]) > 0
    # The module's own training_step shows through again after the fit.
    assert "training_step" not in vars(model)
    # The saved state holds the teacher, so a resume distills from the unpinned weights.
    assert all(torch.equal(distill.state_dict()["teacher"][k], before[k]) for k in before)


def test_distill_changes_training_and_weight_zero_changes_nothing():
    def fit(*extra):
        model = pretrained()
        pin_cb = PinCallback([Pin("encoder.weight", fraction=0.5, value=1.5)], monitor=False)
        trainer(max_epochs=1, callbacks=[pin_cb, *extra]).fit(model, make_loader(n=128))
        return snapshot(model)

    plain, zero, distilled = fit(), fit(DistillFromBaseline(weight=0.0)), fit(DistillFromBaseline(weight=1.0))
    assert all(torch.equal(plain[k], zero[k]) for k in plain)
    assert not torch.equal(plain["head.weight"], distilled["head.weight"])


def test_distill_resumes_from_the_saved_teacher():
    saved = DistillFromBaseline()
    saved.teacher = pretrained(epochs=1)
    state = saved.state_dict()
    resumed = DistillFromBaseline()
    resumed.load_state_dict(state)
    other = ValNet()  # the pinned weights a checkpoint would hold
    resumed.on_fit_start(None, other)
    try:
        assert all(torch.equal(resumed.teacher.state_dict()[k], v) for k, v in state["teacher"].items())
    finally:
        resumed.teardown(None, other, "fit")


def test_distill_needs_a_step_that_calls_the_module():
    class NoCall(ValNet):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.head(torch.relu(self.encoder(x))), y)

    with pytest.raises(PinError, match="never calls the module"):
        trainer(max_steps=1, callbacks=[DistillFromBaseline()]).fit(NoCall(), make_loader())


@pytest.mark.parametrize(("kwargs", "says"), [({"weight": -1.0}, "weight"), ({"temperature": 0.0}, "temperature")])
def test_distill_rejects_bad_settings(kwargs, says):
    with pytest.raises(PinError, match=says):
        DistillFromBaseline(**kwargs)


def test_stop_when_recovered_stops_after_patience_validations_within_tolerance():
    model = pretrained()
    # One pinned element at its own value: within tolerance at every validation.
    pin_cb = PinCallback([Pin("head.bias", indices=[(0,)])], monitor=PinMonitor(accuracy=True, report=False))
    stop = StopWhenRecovered(patience=2)
    t = trainer(max_epochs=10, callbacks=[pin_cb, stop])
    t.fit(model, make_loader(n=128), make_loader(n=64, seed=1))
    steps_per_epoch = 128 // 8
    history = pin_cb.monitor.preservation.history
    assert stop.stopped_step == t.global_step < 10 * steps_per_epoch  # stopped early, not at the budget
    # The last two validations are within tolerance, the one before (if any) was not.
    within = [pin_cb.monitor.preservation.within(v) for _, v in history]
    assert within[-2:] == [True, True] and (len(within) == 2 or not within[-3])
    assert stop.recovered_step == history[-2][0] == t.global_step - steps_per_epoch


def test_stop_when_recovered_runs_the_whole_budget_when_never_within_tolerance():
    model = pretrained()
    monitor = PinMonitor(accuracy=True, tolerance=0.0, report=False)
    # Every encoder weight stuck at 0: the net predicts one class, far under its baseline.
    pin_cb = PinCallback([Pin("encoder.weight", value=0.0)], monitor=monitor)
    stop = StopWhenRecovered(patience=1)
    t = trainer(max_epochs=2, callbacks=[pin_cb, stop])
    t.fit(model, make_loader(n=128), make_loader(n=64, seed=1))
    assert monitor.final < monitor.baseline
    assert stop.stopped_step is None and t.global_step == 2 * (128 // 8)


def test_stop_when_recovered_needs_a_monitor_tracking_accuracy():
    with pytest.raises(PinError, match="needs a PinCallback"):
        trainer(max_steps=1, callbacks=[StopWhenRecovered()]).fit(ValNet(), make_loader())
    with pytest.raises(PinError, match="patience"):
        StopWhenRecovered(patience=0)


@pytest.mark.parametrize(
    ("option", "expected"),
    [("distill", {"distill"}), ("until_recovered", {"stop_when_recovered"}),
     ("distill_until_recovered", {"distill", "stop_when_recovered"})],
)
def test_recovery_group_adds_its_callbacks(option, expected):
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[f"recovery={option}", "paths.output_dir=.", "paths.work_dir=."])
    built = {name: instantiate(node) for name, node in cfg.callbacks.items() if name in expected}
    assert set(built) == expected
    types = {type(cb) for cb in built.values()}
    assert types <= {DistillFromBaseline, StopWhenRecovered}
