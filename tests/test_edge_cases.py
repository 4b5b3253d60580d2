"""Edge cases a review found: param groups added mid-training, channels_last freezes with a
forced element, integer parameters, partial `when`s across processes, sparse gradients, state
handed back after ddp_spawn, compiled modules, bool values."""

from __future__ import annotations

import functools
import sys
import textwrap
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import make_loader, trainer
from lightning.pytorch.callbacks import BackboneFinetuning
from torch import nn

from lightning_pin import Pin, PinCallback, PinError
from lightning_pin.core.plan import resolve


class BackboneNet(L.LightningModule):
    """The shape BackboneFinetuning expects: a `backbone`, frozen first, unfrozen later."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.head(torch.relu(self.backbone(x))), y)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.05, weight_decay=0.1)


class AfterEveryStep(L.Callback):
    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(pl_module.backbone.weight[0, 0].item())


def test_pins_hold_on_param_groups_added_mid_training():
    torch.manual_seed(0)
    model = BackboneNet()
    start = model.backbone.weight.detach().clone()
    record = AfterEveryStep()
    cb = PinCallback([Pin("backbone.weight", indices=[(0, 0)], value=0.5)], verbose=False, monitor=False)
    finetune = BackboneFinetuning(unfreeze_backbone_at_epoch=1, verbose=False)
    trainer(max_epochs=3, callbacks=[finetune, cb, record]).fit(model, make_loader())
    assert record.values and all(v == 0.5 for v in record.values)
    cb.verify(model)
    # The backbone did train once unfrozen: the pin is not merely a frozen tensor.
    assert not torch.equal(model.backbone.weight[1:], start[1:])


class ConvNet(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.head = nn.Linear(4, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.conv(x.view(-1, 2, 2, 2).repeat(1, 1, 2, 2)).mean(dim=(2, 3))
        return nn.functional.cross_entropy(self.head(h), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)


def test_channels_last_frozen_weight_with_a_forced_element():
    torch.manual_seed(0)
    model = ConvNet().to(memory_format=torch.channels_last)
    assert not model.conv.weight.is_contiguous()
    start = model.conv.weight.detach().clone()
    cb = PinCallback([Pin("conv.weight"), Pin("conv.weight", indices=[(1, 0, 2, 1)], value=1.0)], verbose=False)
    trainer(max_epochs=1, callbacks=[cb]).fit(model, make_loader())
    expected = start.clone()
    expected[1, 0, 2, 1] = 1.0
    assert torch.equal(model.conv.weight, expected)
    cb.verify(model)


class IntModule(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.q = nn.Parameter(torch.zeros(4, dtype=dtype), requires_grad=False)


@pytest.mark.parametrize("dtype, value", [(torch.int8, 300), (torch.int8, -1000), (torch.uint8, -1), (torch.int8, 1e10)])
def test_integer_parameters_reject_out_of_range_values(dtype, value):
    with pytest.raises(PinError, match=f"overflow {dtype}"):
        resolve([Pin("q", value=value)], IntModule(dtype))


def test_integer_parameters_store_in_range_values_exactly():
    plan = resolve([Pin("q", indices=[1, 3], value=[-128, 127])], IntModule(torch.int8))
    assert torch.equal(plan.pins[0].selections["q"].values, torch.tensor([-128, 127], dtype=torch.int8))


def is_task(batch, batch_idx, task):
    return batch_idx % 2 == task


def test_partial_when_has_the_same_fingerprint_in_another_process(tmp_path, fork_runner):
    pin = Pin("w", when=functools.partial(is_task, task=1))
    script = textwrap.dedent(
        f"""
        import functools, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_edge_cases import is_task
        from lightning_pin import Pin
        print(Pin("w", when=functools.partial(is_task, task=1)).fingerprint())
        """
    )
    (tmp_path / "other.py").write_text(script)
    # Another interpreter (with its own hash seed), forked from one that imported Lightning already.
    other = fork_runner.run([sys.executable, str(tmp_path / "other.py")], cwd=tmp_path)
    assert other.returncode == 0, other.stderr
    assert other.stdout.strip() == pin.fingerprint()
    assert Pin("w", when=functools.partial(is_task, task=0)).fingerprint() != pin.fingerprint()


class SparseNet(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4, sparse=True)
        self.head = nn.Linear(4, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.embed((x.abs() * 3).long().clamp(max=9)).mean(1)), y)

    def configure_optimizers(self):
        return torch.optim.SparseAdam([self.embed.weight], lr=0.01)


def test_element_pins_on_sparse_gradients_are_refused_before_training():
    model = SparseNet()
    before = model.embed.weight.detach().clone()
    cb = PinCallback([Pin("embed.weight", indices=[(0, 0)], value=1.0)], verbose=False)
    with pytest.raises(PinError, match="sparse gradients"):
        trainer(max_steps=1, callbacks=[cb]).fit(model, make_loader())
    assert torch.equal(model.embed.weight, before)


def test_state_left_by_spawned_rank_zero_is_what_the_main_process_saves(tmp_path):
    torch.manual_seed(0)
    from helpers import TinyNet

    pins = [Pin("encoder.bias", fraction=0.5, seed=1), Pin("head.weight", indices=[(0, 0)], value=2.0)]
    fitted = PinCallback(pins, verbose=False)
    trainer(max_epochs=1, callbacks=[fitted]).fit(TinyNet(), make_loader())
    main_copy = PinCallback(pins, verbose=False)  # what the main process holds after ddp_spawn
    torch.save(fitted.state_dict(), main_copy._handoff)
    saved = main_copy.state_dict()
    assert saved["fingerprints"] == fitted.state_dict()["fingerprints"]
    target = saved["pins"][0]["encoder.bias"]["target"]
    assert target is not None and torch.equal(target, fitted.state_dict()["pins"][0]["encoder.bias"]["target"])


def test_value_dicts_from_an_uncompiled_model_serve_a_compiled_one():
    model = nn.Module()
    model.net = torch.compile(nn.Linear(3, 2))
    values = {"net.weight": torch.full((2, 3), 0.5), "net.bias": torch.tensor([1.0, 2.0])}
    plan = resolve([Pin("net.*", value=values)], model)
    assert torch.equal(plan.pins[0].selections["net._orig_mod.bias"].values, torch.tensor([1.0, 2.0]))


def test_bool_sequences_are_not_values():
    with pytest.raises(PinError, match="bools"):
        resolve([Pin("weight", indices=[(0, 0), (1, 1)], value=[True, False])], nn.Linear(3, 2))
