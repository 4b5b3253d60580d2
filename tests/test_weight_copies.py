"""The guarantee wherever a user keeps the weights under Lightning: averaged models (SWA, EMA and any
WeightAveraging), checkpoints saved during the fit, the module after fit; a foreign write is
reported whatever the callback order; no step means no false pass; several PinCallbacks; corrupt
pin state in a checkpoint; true half precision with the accuracy monitor."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import TinyNet, make_loader, trainer
from lightning.pytorch.callbacks import (
    Callback,
    EMAWeightAveraging,
    ModelCheckpoint,
    StochasticWeightAveraging,
    WeightAveraging,
)

from lightning_pin import Pin, PinCallback, PinError, PinMonitor
from lightning_pin.callbacks import _compat

ELEMENTS = [(0, 0), (1, 3), (2, 7)]
VALUES = [0.5, -0.1, 2.58e-8]  # -0.1 and 2.58e-8 are not dyadic: averaging rounds them


def pins() -> list[Pin]:
    return [Pin("head.weight", indices=ELEMENTS, value=VALUES), Pin("encoder.bias")]


def pinned(module: torch.nn.Module) -> torch.Tensor:
    weight = dict(module.named_parameters())["head.weight"].detach().cpu()
    return torch.stack([weight[i] for i in ELEMENTS])


EXPECTED = torch.tensor(VALUES, dtype=torch.float32)

# The values are chosen to be rounded (that is the point here); the rounding warning is asserted in
# tests/test_plan.py, not in every fit of this file.
pytestmark = pytest.mark.filterwarnings("ignore:.*not representable in torch.float32.*:UserWarning")


class EveryStepAverage(WeightAveraging):
    """A user's own WeightAveraging subclass: a plain running mean, updated after every step."""

    def __init__(self):
        super().__init__()

    def should_update(self, step_idx=None, epoch_idx=None):
        return step_idx is not None


AVERAGERS = {
    "swa": lambda: StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1),
    "ema": lambda: EMAWeightAveraging(decay=0.9),
    "subclass": EveryStepAverage,
}


class AveragedPinsRecorder(Callback):
    """The averaged model's pinned elements after each update, read from the averaging callback
    itself at the batch and epoch ends (listed last, so every update of that hook has happened)."""

    def __init__(self, averager):
        self.averager = averager
        self.seen: list[torch.Tensor] = []

    def _record(self):
        averaged = dict(_compat.averaged_modules(self.trainer_ref)).get(type(self.averager).__name__)
        if averaged is not None:
            self.seen.append(pinned(averaged))

    def on_train_start(self, trainer, pl_module):
        self.trainer_ref = trainer

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._record()

    def on_train_epoch_start(self, trainer, pl_module):
        self._record()


@pytest.mark.parametrize("kind", sorted(AVERAGERS))
@pytest.mark.parametrize("pin_first", [True, False], ids=["pins-first", "averager-first"])
def test_averaged_models_checkpoints_and_module_hold_the_pins(kind, pin_first, tmp_path):
    model = TinyNet()
    encoder_bias = model.encoder.bias.detach().clone()
    cb, averager = PinCallback(pins(), verbose=False, monitor=False), AVERAGERS[kind]()
    recorder = AveragedPinsRecorder(averager)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    ordered = [cb, averager] if pin_first else [averager, cb]
    tr = trainer(max_epochs=3, callbacks=[*ordered, recorder, saver], enable_checkpointing=True)
    tr.fit(model, make_loader())

    assert len(recorder.seen) >= 3
    for values in recorder.seen:
        assert torch.equal(values, EXPECTED)
    checkpoints = sorted(tmp_path.glob("*.ckpt"))
    assert len(checkpoints) >= 3
    for path in checkpoints:
        state = torch.load(path, weights_only=True)["state_dict"]
        assert torch.equal(torch.stack([state["head.weight"][i] for i in ELEMENTS]), EXPECTED), path.name
        assert torch.equal(state["encoder.bias"], encoder_bias), path.name
    # After fit the module holds the average (copied in on_train_end): the pins hold there too.
    assert torch.equal(pinned(model), EXPECTED)
    assert torch.equal(model.encoder.bias.detach(), encoder_bias)
    cb.verify(model)


def test_without_the_watch_ema_rounds_the_pins_and_fit_end_says_so(monkeypatch):
    # The check is real: with the averaged copy left alone, EMA's update moves the non-dyadic pinned
    # values by an ulp, the copy lands in the module at on_train_end, and on_fit_end raises.
    monkeypatch.setattr(
        "lightning_pin.callbacks.pin_callback.watch_weight_averaging", lambda trainer, after_update: []
    )
    cb = PinCallback(pins(), verbose=False, monitor=False)
    tr = trainer(max_epochs=2, callbacks=[cb, EMAWeightAveraging(decay=0.9)])
    with pytest.raises(PinError, match=r"off target[\s\S]*head\.weight"):
        tr.fit(TinyNet(), make_loader())


class WritesAtTrainEnd(Callback):
    """Someone else's callback that changes a pinned element after the last restore."""

    def on_train_end(self, trainer, pl_module):
        with torch.no_grad():
            pl_module.head.weight[0, 0] += 1.0


@pytest.mark.parametrize("pin_first", [True, False])
def test_a_foreign_write_after_the_last_restore_is_reported_in_any_order(pin_first):
    cb = PinCallback(pins(), verbose=False, monitor=False)
    ordered = [cb, WritesAtTrainEnd()] if pin_first else [WritesAtTrainEnd(), cb]
    with pytest.raises(PinError, match=r"head\.weight: 1 element\(s\) off target \(\(0, 0\): 1\.5 != 0\.5"):
        trainer(max_epochs=1, callbacks=ordered).fit(TinyNet(), make_loader())


def test_pins_are_forced_before_any_callback_samples_the_weights():
    seen = {}

    class SamplesAtEpochStart(Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            seen.setdefault("first", pinned(pl_module))

    trainer(max_epochs=1, callbacks=[SamplesAtEpochStart(), PinCallback(pins(), verbose=False, monitor=False)]).fit(
        TinyNet(), make_loader()
    )
    assert torch.equal(seen["first"], EXPECTED)


# ----------------------------------------------------------------------------------------------
# No step, no false pass


@pytest.mark.parametrize("limits", [dict(max_steps=0), dict(limit_train_batches=0)], ids=["max_steps=0", "no-batches"])
def test_verify_end_checks_even_when_no_step_ran(limits):
    cb = PinCallback(pins(), verbose=False, monitor=False)
    with pytest.raises(PinError, match=r"head\.weight: 3 element\(s\) off target"):
        trainer(max_epochs=1, callbacks=[cb], **limits).fit(TinyNet(), make_loader())
    with pytest.raises(PinError, match="off target"):
        cb.verify()


class EditsAndNeverSteps(TinyNet):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.head.weight[0, 0] = 7.0  # a manual edit; no optimizer step ever runs


def test_manual_loop_that_edits_weights_and_never_steps_fails_at_the_end():
    cb = PinCallback(pins(), verbose=False, monitor=False)
    with pytest.raises(PinError, match=r"\(0, 0\): 7\.0 != 0\.5"):
        trainer(max_epochs=1, callbacks=[cb]).fit(EditsAndNeverSteps(), make_loader())


# ----------------------------------------------------------------------------------------------
# Several PinCallbacks


def test_conflicting_explicit_targets_across_callbacks_raise_before_any_step():
    model = TinyNet()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    first = PinCallback([Pin("head.weight", indices=[(0, 0)], value=1.0)], verbose=False, monitor=False)
    second = PinCallback([Pin("head.w*", indices=[(0, 0)], value=2.0)], verbose=False, monitor=False)
    with pytest.raises(PinError, match=r"different values at overlapping steps \(e\.g\. 1\.0 vs 2\.0\)"):
        trainer(max_epochs=1, callbacks=[first, second]).fit(model, make_loader())
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name


def test_two_callbacks_with_identical_pins_get_a_clear_error():
    callbacks = [PinCallback(pins(), verbose=False, monitor=False), PinCallback(pins(), verbose=False, monitor=False)]
    tr = trainer(max_epochs=1, callbacks=callbacks)  # Lightning accepts them: distinct state keys
    with pytest.raises(PinError, match="2 PinCallbacks on this trainer hold identical pins"):
        tr.fit(TinyNet(), make_loader())


def test_callbacks_that_agree_work_together():
    first = PinCallback([Pin("head.weight", indices=[(0, 0)], value=1.0)], verbose=False, monitor=False)
    second = PinCallback([Pin("head.w*", indices=[(0, 0), (1, 1)], value=[1.0, 3.0])], verbose=False, monitor=False)
    model = TinyNet()
    trainer(max_epochs=1, callbacks=[first, second]).fit(model, make_loader())
    assert model.head.weight[0, 0].item() == 1.0 and model.head.weight[1, 1].item() == 3.0


def test_states_saved_under_a_copy_key_resume_by_their_pins(tmp_path):
    bystander = PinCallback(pins(), verbose=False, monitor=False)  # built, never fitted, still alive
    first = PinCallback(pins(), verbose=False, monitor=False)
    assert first.state_key != bystander.state_key  # Lightning would refuse two equal keys in one trainer
    tr = trainer(max_epochs=1, callbacks=[first])
    tr.fit(TinyNet(), make_loader())
    tr.save_checkpoint(tmp_path / "a.ckpt")
    del bystander
    fresh = PinCallback(pins(), verbose=False, monitor=False)
    assert fresh.state_key != first.state_key
    model = TinyNet()
    trainer(max_epochs=2, callbacks=[fresh]).fit(model, make_loader(), ckpt_path=tmp_path / "a.ckpt")
    fresh.verify(model)
    # The captured target of the frozen bias came from the checkpoint, not from the new model.
    assert torch.equal(model.encoder.bias.detach(), first.engine.captured[1]["encoder.bias"])


# ----------------------------------------------------------------------------------------------
# Corrupt pin state in a checkpoint


def _saved(tmp_path):
    # A callback of an earlier test that only a reference cycle keeps alive still counts as live,
    # and a live twin would give this one a copy index in its state key: collect them first, so
    # the key is the plain one the corruption cases below expect (and the new callback's too).
    gc.collect()
    cb = PinCallback(pins(), verbose=False, monitor=False)
    tr = trainer(max_epochs=1, callbacks=[cb])
    tr.fit(TinyNet(), make_loader())
    tr.save_checkpoint(tmp_path / "good.ckpt")
    return torch.load(tmp_path / "good.ckpt", weights_only=False), cb.state_key


def _corruptions():
    def drop(key):
        return lambda s: {k: v for k, v in s.items() if k != key}

    def set_(key, value):
        return lambda s: {**s, key: value}

    def entry(change):
        def corrupt(s):
            pins = [dict(p) for p in s["pins"]]
            pins[0] = {"head.weight": change(dict(pins[0]["head.weight"]))}
            return {**s, "pins": pins}

        return corrupt

    return {
        "not-a-dict": lambda s: "PinCallback state",
        "no-pins": drop("pins"),
        "pins-is-int": set_("pins", 3),
        "pins-is-str": set_("pins", "abc"),
        "pin-entry-is-str": lambda s: {**s, "pins": ["x", *s["pins"][1:]]},
        "active-nan": set_("active", [float("nan")]),
        "active-out-of-range": set_("active", [7]),
        "version-str": set_("version", "one"),
        "version-from-the-future": set_("version", 99),
        "missing-target": entry(lambda e: {k: v for k, v in e.items() if k != "target"}),
        "target-is-list": entry(lambda e: {**e, "target": [0.5, -0.1, 1.0]}),
        "nan-explicit-target": entry(lambda e: {**e, "target": torch.full((3,), float("nan"))}),
        "index-float": entry(lambda e: {**e, "index": e["index"].float()}),
        "index-target-mismatch": entry(lambda e: {**e, "target": e["target"][:2]}),
        "fingerprints-short": set_("fingerprints", ["x"]),
    }


@pytest.mark.parametrize("case", sorted(_corruptions()))
def test_corrupt_pin_state_is_a_pin_error_before_any_step(case, tmp_path):
    checkpoint, key = _saved(tmp_path)
    checkpoint["callbacks"][key] = _corruptions()[case](checkpoint["callbacks"][key])
    torch.save(checkpoint, tmp_path / "bad.ckpt")
    model = TinyNet()
    gc.collect()  # the callback that saved it is gone: this one takes the same key (see _saved)
    cb = PinCallback(pins(), verbose=False, monitor=False)
    steps = []

    class CountSteps(Callback):
        def on_train_batch_start(self, *args):
            steps.append(1)

    with pytest.raises(PinError, match="corrupt|newer lightning-pin"):
        trainer(max_epochs=2, callbacks=[cb, CountSteps()]).fit(model, make_loader(), ckpt_path=tmp_path / "bad.ckpt")
    assert steps == []


def test_corrupt_pin_state_with_strict_false_warns_and_starts_afresh(tmp_path):
    checkpoint, key = _saved(tmp_path)
    checkpoint["callbacks"][key] = {**checkpoint["callbacks"][key], "pins": 3}
    torch.save(checkpoint, tmp_path / "bad.ckpt")
    cb = PinCallback(pins(), verbose=False, monitor=False, strict=False)
    model = TinyNet()
    with pytest.warns(UserWarning, match="corrupt.*every pin starts afresh"):
        trainer(max_epochs=2, callbacks=[cb]).fit(model, make_loader(), ckpt_path=tmp_path / "bad.ckpt")
    cb.verify(model)
    assert torch.equal(pinned(model), EXPECTED)


# ----------------------------------------------------------------------------------------------
# True half precision with the accuracy monitor


class ValidatedNet(TinyNet):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_accuracy_monitor_under_true_half_precision(precision):
    model = ValidatedNet()
    monitor = PinMonitor(accuracy=True, report=False)
    cb = PinCallback([Pin("head.weight", indices=[(0, 0)], value=0.5)], verbose=False, monitor=monitor)
    tr = trainer(max_epochs=2, precision=precision, callbacks=[cb])
    tr.fit(model, make_loader(), make_loader(seed=1))
    dtype = {"bf16-true": torch.bfloat16, "16-true": torch.float16}[precision]
    assert model.head.weight.dtype == dtype
    assert model.head.weight[0, 0].item() == 0.5
    assert monitor.baseline is not None and monitor.forced is not None and monitor.final is not None
    cb.verify(model)


def test_a_value_that_overflows_float16_is_refused_before_lightning_casts_the_module():
    model = ValidatedNet()
    cb = PinCallback([Pin("head.weight", indices=[(0, 0)], value=1e6)], verbose=False, monitor=False)
    with pytest.raises(PinError, match=r"values \[1000000\.0\] overflow torch\.float16 of 'head\.weight'"):
        trainer(max_epochs=1, precision="16-true", callbacks=[cb]).fit(model, make_loader())
    assert model.head.weight.dtype == torch.float32  # the user's module was not cast
