"""No silent wrong at the seams (issue 15, items 1-8 and 10): each input that used to be accepted
and then trained wrong now gives a clear PinError before anything changes, or behaves correctly.

Expected values are computed here (snapshots, explicit numbers) and compared with ``torch.equal``.
"""

from __future__ import annotations

import copy
import pickle

import lightning as L
import pytest
import torch
from helpers import TinyNet, first_label_is_zero, make_loader, trainer
from torch import nn

from lightning_pin import Pin, PinCallback, PinError, pin
from lightning_pin.core.state import CorruptPinState, PinState


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3, handle=None) -> None:
    for batch_idx in range(steps):
        if handle is not None:
            handle.batch_start(None, batch_idx)
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# --------------------------------------------------------------------------------------------
# 1. Keyed value and mask sources match by name


def test_a_value_file_keyed_by_another_parameter_is_refused(tmp_path):
    model = _net()
    path = tmp_path / "values.pt"
    # 2.bias has shape (2,), as 0.bias[:2] would: the old code applied it to the pinned parameter.
    torch.save({"2.bias": torch.tensor([7.0, 8.0])}, path)
    before = _snapshot(model)
    spec = Pin("2.weight", indices=[(0, 0), (1, 1)], value=str(path))
    words = r"value has no entry for parameter '2.weight'; its keys are \['2.bias'\], and \['2.bias'\] name other"
    with pytest.raises(PinError, match=words):
        pin(model, torch.optim.SGD(model.parameters(), lr=0.1), spec)
    assert _unchanged(model, before)


def test_a_mask_dict_keyed_by_another_parameter_is_refused():
    model = _net()
    mask = {"0.bias": torch.tensor([True, False, True])}
    words = r"mask has no entry for parameter '2.weight'; its keys are \[.*\], and .* name other parameters"
    with pytest.raises(PinError, match=words):
        pin(model, torch.optim.SGD(model.parameters(), lr=0.1), Pin("2.weight", mask=mask))


def test_keyed_sources_apply_by_name_and_unnamed_single_entries_by_shape(tmp_path):
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1)
    by_name = {"2.bias": torch.tensor([7.0, 8.0]), "0.bias": torch.tensor([1.0, 2.0, 3.0])}
    path = tmp_path / "one.pt"
    torch.save({"anything": torch.full((2, 3), 0.25)}, path)  # names no parameter: by shape, as before
    with pin(model, optimizer, [Pin("2.bias", value=by_name), Pin("2.weight", value=str(path))]) as handle:
        _train(model, optimizer)
        handle.verify()
    assert torch.equal(model[2].bias.detach(), torch.tensor([7.0, 8.0]))
    assert torch.equal(model[2].weight.detach(), torch.full((2, 3), 0.25))


# --------------------------------------------------------------------------------------------
# 2-5. The pin() door: what it is given, and a removed handle


def test_pin_refuses_what_is_not_a_module():
    with pytest.raises(PinError, match="needs the torch.nn.Module being trained.*got str 'model'"):
        pin("model", [], Pin("weight"))


def test_pin_refuses_an_empty_optimizer_list():
    model = _net()
    before = _snapshot(model)
    with pytest.raises(PinError, match="no optimizer"):
        pin(model, [], Pin("0.weight", value=1.0))
    assert _unchanged(model, before)


def test_pin_accepts_a_trainable_pinned_parameter_no_given_optimizer_holds_and_refuses_another_stepping_it():
    # Coverage is checked at each step (tests/test_handle_coverage.py): a parameter no optimizer
    # holds yet may join one later; an optimizer pin() was not given may not step it.
    model = _net()
    head = torch.optim.SGD(model[2].parameters(), lr=0.1)
    encoder = torch.optim.SGD(model[0].parameters(), lr=0.1, weight_decay=0.1)
    with pin(model, head, [Pin("0.bias", value=0.0), Pin("2.bias", value=1.0)]) as handle:
        model(torch.randn(4, 4)).sum().backward()
        head.step()
        before = _snapshot(model)
        with pytest.raises(PinError, match=r"SGD \(an optimizer not given to pin\(\)\).*\['0.bias'\]"):
            encoder.step()
        assert _unchanged(model, before)
        handle.verify()
    # Every optimizer given: both step.
    with pin(model, [head, encoder], [Pin("0.bias", value=0.0)]) as handle:
        model(torch.randn(4, 4)).sum().backward()
        head.step()
        encoder.step()
        handle.verify()


def test_a_second_pin_with_conflicting_targets_is_refused_while_the_first_lives():
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first = pin(model, optimizer, Pin("0.weight", indices=[(0, 0)], value=1.0))
    before = _snapshot(model)
    with pytest.raises(PinError, match=r"different values.*another pin\(\) on this module is still active"):
        pin(model, optimizer, Pin("0.weight", indices=[(0, 0), (1, 1)], value=[2.0, 3.0]))
    assert _unchanged(model, before)
    # The same value, or another element, is no conflict; nor is anything once the first is removed.
    pin(model, optimizer, Pin("0.weight", indices=[(0, 0), (1, 1)], value=[1.0, 3.0])).remove()
    first.remove()
    pin(model, optimizer, Pin("0.weight", indices=[(0, 0)], value=2.0)).remove()


def test_a_removed_handle_changes_nothing():
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pin(model, optimizer, Pin("0.weight", indices=[(0, 0)], value=1.0, when=lambda b, i: True)) as handle:
        _train(model, optimizer, handle=handle)
    state = handle.state_dict()
    with torch.no_grad():
        model[0].weight.zero_()
    before = _snapshot(model)
    for call in (lambda: handle.batch_start(None, 0), lambda: handle.load_state_dict(state)):
        with pytest.raises(PinError, match="removed"):
            call()
    assert _unchanged(model, before)
    handle.remove()  # removing twice is fine
    _train(model, optimizer)  # no hook of the handle is left


# --------------------------------------------------------------------------------------------
# 6, 10. A pinned parameter replaced, cast or moved after pin()


def test_a_parameter_replaced_after_pin_is_refused_at_the_next_step_and_at_verify():
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = pin(model, optimizer, Pin("0.weight", value=0.5))
    model[0].weight = nn.Parameter(torch.randn(3, 4))  # e.g. a re-initialisation
    with pytest.raises(PinError, match="'0.weight' is no longer the tensor pin\\(\\) resolved"):
        handle.verify()
    optimizer.add_param_group({"params": [model[0].weight]})
    model(torch.randn(5, 4)).sum().backward()
    before = _snapshot(model)
    with pytest.raises(PinError, match="before optimizer.step\\(\\): the pinned parameter '0.weight'"):
        optimizer.step()
    assert _unchanged(model, before)  # refused before the update
    handle.remove()


def test_a_module_cast_after_pin_is_refused_before_the_step_acts():
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    handle = pin(model, optimizer, [Pin("0.weight", indices=[(0, 0)], value=0.5), Pin("2.bias")])
    model.double()
    model(torch.randn(5, 4, dtype=torch.float64)).sum().backward()
    before = _snapshot(model)
    with pytest.raises(PinError, match="'0.weight' was cast or moved from torch.float32 on cpu to torch.float64"):
        optimizer.step()
    assert _unchanged(model, before)
    with pytest.raises(PinError, match="cast or moved"):
        handle.verify()
    handle.remove()


# --------------------------------------------------------------------------------------------
# 8. Non-finite saved targets are corruption


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_captured_targets_are_corrupt(bad):
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pin(model, optimizer, Pin("0.weight", indices=[(0, 0), (1, 1)])) as handle:
        state = handle.state_dict()
    state["pins"][0]["0.weight"]["target"][1] = bad
    with pytest.raises(CorruptPinState, match=r"is corrupt: .*captured targets hold NaN or infinity"):
        PinState.from_dict(state)
    handle = pin(model, optimizer, Pin("0.weight", indices=[(0, 0), (1, 1)]))
    before = _snapshot(model)
    with pytest.raises(CorruptPinState):
        handle.load_state_dict(state)
    assert _unchanged(model, before)
    handle.remove()


# --------------------------------------------------------------------------------------------
# 7. Weights loaded after the pins were set: every active pin holds after the next step


def test_load_state_dict_after_pin_is_undone_by_the_next_step():
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    whole_target = model[0].weight.detach().clone()  # captured when pinned (value=None)
    pins = [Pin("0.weight"), Pin("2.bias", value=0.5), Pin("2.weight", indices=[(0, 0)], value=2.0)]
    with pin(model, optimizer, pins) as handle:
        _train(model, optimizer, steps=2)
        other = _net()
        with torch.no_grad():
            for p in other.parameters():
                p.add_(1.0)  # every loaded value differs from its target
        model.load_state_dict(other.state_dict())
        _train(model, optimizer, steps=1)
        assert torch.equal(model[0].weight.detach(), whole_target)
        assert torch.equal(model[2].bias.detach(), torch.full((2,), 0.5))
        assert model[2].weight[0, 0].item() == 2.0
        handle.verify()


class _LoadsMidway(TinyNet):
    """Loads other weights into itself in the middle of training (a user's reset, a hot swap)."""

    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            other = TinyNet()
            with torch.no_grad():
                for p in other.parameters():
                    p.add_(1.0)
            self.load_state_dict(other.state_dict())
        return super().training_step(batch, batch_idx)


def test_load_state_dict_during_fit_is_undone_by_the_callback():
    model = _LoadsMidway()
    target = model.encoder.weight.detach().clone()
    cb = PinCallback([Pin("encoder.weight"), Pin("head.bias", value=0.5)], monitor=False, verbose=False, verify="step")
    trainer(callbacks=[cb], max_steps=4).fit(model, make_loader(n=32))
    assert torch.equal(model.encoder.weight.detach(), target)
    assert torch.equal(model.head.bias.detach(), torch.full((3,), 0.5))


# --------------------------------------------------------------------------------------------
# 10. A fit that ran no step; a lambda `when` under ddp_spawn


@pytest.mark.parametrize("limit", [dict(max_steps=0), dict(limit_train_batches=0), dict(max_epochs=0)])
def test_a_fit_without_a_step_says_the_pins_were_never_applied(limit):
    cb = PinCallback([Pin("head.bias", value=1.0)], monitor=False, verbose=False)
    with pytest.raises(PinError, match="ran no training step .* so the pins were never applied: 3 pinned element"):
        trainer(callbacks=[cb], **limit).fit(TinyNet(), make_loader(n=16))


def test_a_lambda_when_under_ddp_spawn_names_the_pin_and_the_fix_before_spawning():
    cb = PinCallback([Pin("head.bias", value=1.0, when=lambda batch, batch_idx: True)], monitor=False, verbose=False)
    model = TinyNet()
    before = _snapshot(model)
    with pytest.raises(PinError, match=r"when=.*<lambda> cannot be sent to the processes strategy='ddp_spawn'.*"
                                       r"import path as a string"):
        trainer(callbacks=[cb], strategy="ddp_spawn", devices=2, max_steps=1).fit(model, make_loader(n=16))
    assert _unchanged(model, before)
    # Outside a spawn (deepcopy, plain pickling of an importable `when`) the callback still copies.
    copy.deepcopy(cb)
    pickle.loads(pickle.dumps(PinCallback([Pin("head.bias", when=first_label_is_zero)])))


def test_fabric_bf16_true_set_up_after_pin_is_refused_before_the_step():
    from lightning.fabric import Fabric

    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    handle = pin(model, optimizer, Pin("2.bias", value=0.5))
    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-true")
    wrapped, wrapped_optimizer = fabric.setup(model, optimizer)
    fabric.backward(wrapped(torch.randn(5, 4)).sum())
    before = _snapshot(model)
    with pytest.raises(PinError, match=r"'2.bias' was cast or moved from torch.float32 .* to torch.bfloat16.*"
                                       r"then call pin\(\)"):
        wrapped_optimizer.step()
    assert _unchanged(model, before)
    handle.remove()


class _ReinitAtStep(L.Callback):
    """A callback that replaces a pinned parameter in the middle of fit."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 2:
            pl_module.encoder.weight = torch.nn.Parameter(torch.zeros_like(pl_module.encoder.weight))


def test_the_callback_refuses_a_parameter_replaced_during_fit(tmp_path):
    from helpers import TinyNet, make_loader, trainer

    model = TinyNet()
    callback = PinCallback([Pin("encoder.weight", fraction=0.5, seed=1)], verbose=False, monitor=False)
    t = trainer(max_steps=5, callbacks=[callback, _ReinitAtStep()], default_root_dir=tmp_path)
    with pytest.raises(PinError, match="'encoder.weight' is no longer the tensor the pins were resolved on"):
        t.fit(model, make_loader(n=32, batch_size=4))
    assert t.global_step == 2  # refused before the third step, which would have trained the new tensor
