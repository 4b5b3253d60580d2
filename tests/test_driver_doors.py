"""The two doors meet in one registry of live pins (core/driver.py): a pin() handle and a fitting
PinCallback on one module may not give an element two values, and a fit leaves nothing registered."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_pin import Pin, PinCallback, PinError, pin
from lightning_pin.core.driver import LIVE
from tests.helpers import TinyNet, make_loader, trainer


class _PinDuringFit(L.Callback):
    """Calls pin() on the module being fitted, from on_train_start (after PinCallback's on_fit_start)."""

    def __init__(self, pins: list[Pin]) -> None:
        self.pins = pins
        self.error: PinError | None = None
        self.live_during_fit: list = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.live_during_fit = LIVE.on(pl_module)
        try:
            pin(pl_module, trainer.optimizers[0], self.pins).remove()
        except PinError as err:
            self.error = err


def test_a_pin_that_contradicts_a_fitting_callback_is_refused_and_the_fit_unregisters():
    model = TinyNet()
    callback = PinCallback([Pin("head.bias", value=0.0)], monitor=False, verbose=False)
    probe = _PinDuringFit([Pin("head.bias", indices=[(1,)], value=1.0)])
    trainer(max_steps=2, callbacks=[callback, probe]).fit(model, make_loader())
    assert probe.live_during_fit == [callback]
    assert probe.error is not None
    assert "different values" in str(probe.error) and "a PinCallback is fitting this module" in str(probe.error)
    assert LIVE.on(model) == []  # teardown took the callback out
    callback.verify(model)


def test_a_pin_that_agrees_with_a_fitting_callback_is_accepted():
    model = TinyNet()
    callback = PinCallback([Pin("head.bias", value=0.0)], monitor=False, verbose=False)
    probe = _PinDuringFit([Pin("head.bias", indices=[(1,)], value=0.0), Pin("encoder.bias", value=2.0)])
    trainer(max_steps=2, callbacks=[callback, probe]).fit(model, make_loader())
    assert probe.error is None


def test_a_fit_refused_for_a_live_pin_handle_registers_nothing():
    model = TinyNet()
    with pin(model, torch.optim.SGD(model.parameters(), lr=0.1), Pin("head.bias", value=1.0)) as handle:
        callback = PinCallback([Pin("head.bias", value=0.0)], monitor=False, verbose=False)
        with pytest.raises(PinError, match=r"different values.*another pin\(\) on this module is still active"):
            trainer(max_steps=1, callbacks=[callback]).fit(model, make_loader())
        assert LIVE.on(model) == [handle]
    assert LIVE.on(model) == []


class _Fails(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        raise RuntimeError("boom")


def test_a_fit_that_raises_unregisters_its_callback():
    model = TinyNet()
    callback = PinCallback([Pin("head.bias", value=0.0)], monitor=False, verbose=False)
    with pytest.raises(RuntimeError, match="boom"):
        trainer(max_steps=1, callbacks=[callback, _Fails()]).fit(model, make_loader())
    assert LIVE.on(model) == []
    pin(model, torch.optim.SGD(model.parameters(), lr=0.1), Pin("head.bias", value=1.0)).remove()
