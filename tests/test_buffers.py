"""Pins that freeze whole modules hold their buffers (BatchNorm running statistics) too (issue 15, item 17).

A frozen module's buffers keep the values they had when the pin activated, after every step, in
both doors; ``verify`` checks them like parameters; ``Pin(..., buffers=False)`` lets them update;
pins that do not freeze a module (element pins, explicit values, part of a module) hold none.
"""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
from helpers import make_loader, trainer
from torch import nn

from lightning_pin import Pin, PinCallback, PinError, pin

BN_BUFFERS = ("encoder.1.running_mean", "encoder.1.running_var", "encoder.1.num_batches_tracked")


class BNNet(L.LightningModule):
    """An encoder with a BatchNorm, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.ReLU())
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.encoder(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def _plain_loop(model: nn.Module, optimizer, steps: int = 3) -> None:
    model.train()
    for x, y in list(make_loader(n=8 * steps))[:steps]:
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_freezing_a_module_holds_its_batchnorm_statistics_in_a_plain_loop():
    torch.manual_seed(0)
    model = BNNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    before = _buffers(model)
    probe = torch.randn(4, 8)
    model.eval()
    frozen_out = model.encoder(probe).detach()
    with pin(model, optimizer, Pin("encoder.*")) as handle:
        assert handle.buffers.names == list(BN_BUFFERS)
        _plain_loop(model, optimizer)
        handle.verify()
        after = _buffers(model)
        assert all(torch.equal(after[n], before[n]) for n in BN_BUFFERS)
        model.eval()
        assert torch.equal(model.encoder(probe), frozen_out)  # the frozen encoder's outputs did not change
        with torch.no_grad():
            model.encoder[1].running_mean[2] += 1.0  # a write by someone else
        with pytest.raises(PinError, match=r"encoder.1.running_mean \(buffer\): 1 element\(s\) off target"):
            handle.verify()


def test_buffers_false_lets_the_statistics_update_and_partial_pins_hold_no_buffers():
    torch.manual_seed(0)
    cases = (
        [Pin("encoder.*", buffers=False)],  # opted out
        [Pin("encoder.0.*"), Pin("encoder.1.weight")],  # no single pin covers the BatchNorm
        [Pin("encoder.*", value=0.5)],  # explicit values: not a freeze
        [Pin("encoder.*", fraction=1.0)],  # element pins
        [Pin("head.*")],  # a module without buffers
    )
    for pins in cases:
        model = BNNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        before = _buffers(model)
        with pin(model, optimizer, pins) as handle:
            assert handle.buffers.names == []
            _plain_loop(model, optimizer)
            handle.verify()
        after = _buffers(model)
        assert not torch.equal(after["encoder.1.running_mean"], before["encoder.1.running_mean"]), pins
        assert int(after["encoder.1.num_batches_tracked"]) == 3


def test_a_pin_activating_later_holds_the_statistics_it_found_then():
    torch.manual_seed(0)
    model = BNNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with pin(model, optimizer, Pin("encoder.*", start_step=2)) as handle:
        _plain_loop(model, optimizer, steps=2)
        at_start = _buffers(model)
        assert int(at_start["encoder.1.num_batches_tracked"]) == 2
        _plain_loop(model, optimizer, steps=2)
        handle.verify()
    assert all(torch.equal(_buffers(model)[n], at_start[n]) for n in BN_BUFFERS)


def test_the_callback_holds_checks_and_shows_the_buffers(caplog):
    torch.manual_seed(0)
    model = BNNet()
    before = _buffers(model)
    cb = PinCallback([Pin("encoder.*")], monitor=False, verify="step")
    with caplog.at_level(logging.INFO):
        trainer(callbacks=[cb], max_steps=3).fit(model, make_loader(n=32))
    assert "buffers held with their frozen modules: encoder.1.running_mean (6)" in caplog.text
    after = _buffers(model)
    assert all(torch.equal(after[n], before[n]) for n in BN_BUFFERS)
    cb.verify(model)
    with torch.no_grad():
        model.encoder[1].num_batches_tracked += 1
    with pytest.raises(PinError, match=r"encoder.1.num_batches_tracked \(buffer\)"):
        cb.verify(model)


def test_the_buffers_field_is_checked_and_leaves_default_fingerprints_alone():
    with pytest.raises(PinError, match="buffers must be True or False, got 'no'"):
        Pin("encoder.*", buffers="no")
    assert Pin("encoder.*", buffers=True).fingerprint() == Pin("encoder.*").fingerprint()
    assert Pin("encoder.*", buffers=False).fingerprint() != Pin("encoder.*").fingerprint()
    assert repr(Pin("encoder.*", buffers=False)) == "Pin(params='encoder.*', buffers=False)"
    assert Pin.from_config({"params": "encoder.*", "buffers": False}).buffers is False


def test_resume_holds_the_loaded_statistics_and_verify_names_a_missing_buffer():
    torch.manual_seed(0)
    model = BNNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    _plain_loop(model, optimizer, steps=2)  # statistics move before the freeze
    with pin(model, optimizer, Pin("encoder.*")) as handle:
        _plain_loop(model, optimizer, steps=2)
        saved = {"model": model.state_dict(), "pins": handle.state_dict()}
    held = {n: saved["model"][n].clone() for n in BN_BUFFERS}
    torch.manual_seed(1)
    resumed = BNNet()
    optimizer = torch.optim.SGD(resumed.parameters(), lr=0.05)
    with pin(resumed, optimizer, Pin("encoder.*")) as handle:  # captures the fresh model's statistics
        resumed.load_state_dict(saved["model"])
        handle.load_state_dict(saved["pins"])  # ... and takes the loaded ones instead
        _plain_loop(resumed, optimizer, steps=2)
        handle.verify()
        assert all(torch.equal(_buffers(resumed)[n], held[n]) for n in BN_BUFFERS)
        without = BNNet()
        without.encoder[1] = nn.BatchNorm1d(6, track_running_stats=False)  # no running statistics
        without.load_state_dict(resumed.state_dict(), strict=False)
        with pytest.raises(PinError, match="has no buffer 'encoder.1.running_mean'"):
            handle.verify(without)


def test_averaged_copies_hold_the_frozen_statistics_too(tmp_path):
    """EMA averages buffers with the weights (use_buffers=True). A pin that starts at step 2 holds the
    statistics it found then, but the average has been following the moving ones before: it would
    only approach the held values, and at the end it is copied into the module. The held values are
    written into the averaged copy after each of its updates, so both hold them bit for bit."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    torch.manual_seed(0)
    model = BNNet()
    captured = {}

    class Capture(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 2 and not captured:
                captured.update({n: b.clone() for n, b in _buffers(pl_module).items() if n in BN_BUFFERS})

    callback = PinCallback([Pin("encoder.*", start_step=2)], verbose=False, monitor=False)
    ema = EMAWeightAveraging(decay=0.7, use_buffers=True)
    t = trainer(max_epochs=2, callbacks=[Capture(), callback, ema], default_root_dir=tmp_path)
    t.fit(model, make_loader(n=32, batch_size=4))
    averaged = dict(ema._average_model.module.named_buffers())
    for name, value in captured.items():
        assert torch.equal(averaged[name], value), name
        assert torch.equal(model.get_buffer(name), value), name
    callback.verify(model)
