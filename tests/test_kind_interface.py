"""The kind interface (issue 37 item 2): what a kind implements is the short list ``HOOKS``, the rest is
generic; and a new kind is one module plus one registration: ``tests/grid_kind.py`` registered here, pinned
through pin() and a Trainer, saved and resumed in a checkpoint, checked in a stored tensor and forced as a fault."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from helpers import TinyNet, make_loader, trainer
from lightning_pin import Pin, PinCallback, PinError, QuantCode, pin
from lightning_pin.core import kinds, registry
from lightning_pin.core.kinds.base import HOOKS, Kind
from lightning_pin.faults import forced_patch, load_fault_map, save_fault_map
from lightning_pin.reporting.check import check_artifacts

from grid_kind import Grid

STEP = 0.125


@pytest.fixture
def grid(monkeypatch):
    """Grid registered for one test (the registry is restored after it)."""
    monkeypatch.setattr(kinds, "KINDS", kinds.KINDS)
    monkeypatch.setattr(kinds, "LATER_FIELDS", kinds.LATER_FIELDS)
    monkeypatch.setattr(kinds, "BY_NAME", dict(kinds.BY_NAME))
    monkeypatch.setattr(registry, "_KINDS", registry._KINDS)  # what Pin asks (filled again by register)
    return kinds.register(Grid)


def _overridden(kind: type) -> set[str]:
    """The methods of Kind that ``kind`` defines itself."""
    return {name for name in vars(kind) if callable(getattr(Kind, name, None)) and not name.startswith("__")}


@pytest.mark.parametrize("kind", [*kinds.KINDS, Grid], ids=lambda k: k.kind)
def test_a_kind_implements_only_the_hooks(kind):
    generic = {name for name, _ in inspect.getmembers(Kind, callable) if not name.startswith("_")} - set(HOOKS)
    assert "saved" in generic and "word_rewrite" in generic and "map_merge" in generic  # the generic protocol
    assert "apply" in generic and "stored_off" in generic  # the kernel built and run once; off of the saved form
    assert _overridden(kind) <= set(HOOKS), _overridden(kind) - set(HOOKS)
    assert len(HOOKS) <= 12  # was 33 hooks, then 14 (apply and kernel, stored_off overridden by four kinds)


def test_registration_claims_pins_of_the_new_field_and_refuses_what_is_wrong(grid):
    assert kinds.for_pin(Pin("w", kind_args={"grid": STEP})) is Grid
    assert Pin("w", kind_args={"grid": STEP}).kind == "grid" and Pin("w").kind == "value"
    with pytest.raises(PinError, match="grid must be a positive finite number"):
        Pin("w", kind_args={"grid": -1.0})
    with pytest.raises(PinError, match=r"kind_args must be a dict of the fields of registered kinds \(\['grid'\]"):
        Pin("w", kind_args={"grids": STEP})
    with pytest.raises(PinError, match="needs pin fields of its own"):
        kinds.register(type("Twice", (Grid,), {"kind": "twice"}))
    # Pins that do not use it keep their fingerprints (and so their checkpoint keys).
    assert Pin("w", fraction=0.5).fingerprint() == "1e10ff772ef7b90a"


def test_an_unregistered_field_is_refused():
    with pytest.raises(PinError, match="none is registered"):
        Pin("w", kind_args={"grid": STEP})


def _on_grid(tensor: torch.Tensor) -> torch.Tensor:
    return tensor == torch.round(tensor / STEP) * STEP


def test_pin_holds_the_grid_saves_and_resumes_it(grid, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    pins = [Pin("0.weight", fraction=0.5, seed=1, kind_args={"grid": STEP})]
    x = torch.randn(8, 6)
    with pin(model, optimizer, pins) as handle:
        (selection,) = handle.engine.plan.pins[0].selections.values()
        index = selection.index.long()
        assert "multiples of 0.125" in handle.engine.plan.summary()
        before = model[0].weight.detach().clone()
        for _ in range(4):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        weight = model[0].weight.detach().reshape(-1)
        assert bool(_on_grid(weight[index]).all()) and not bool(_on_grid(weight).all())
        assert not torch.equal(weight[index], before.reshape(-1)[index])  # they train, on the grid
        handle.verify()
        state = handle.state_dict()
        torch.save({"model": model.state_dict(), "pins": state}, tmp_path / "run.pt")
    saved = state["pins"][0]["0.weight"]
    assert saved["kind"] == "grid" and torch.equal(saved["grid"], torch.full((index.numel(),), STEP))
    # Resuming against the same pins takes the state; against another grid it is refused.
    again = torch.optim.AdamW(model.parameters(), lr=0.05)
    with pin(model, again, pins) as resumed:
        resumed.load_state_dict(torch.load(tmp_path / "run.pt")["pins"])
    other = [Pin("0.weight", fraction=0.5, seed=1, kind_args={"grid": 0.25})]
    with pin(model, torch.optim.AdamW(model.parameters()), other) as changed:
        with pytest.raises(PinError, match="spec changed"):
            changed.load_state_dict(state)
    # check reads the stored tensor through the saved form (off of the kernel merged from it).
    assert check_artifacts(tmp_path / "run.pt", {"0.weight": model[0].weight.detach()}).holds
    moved = model[0].weight.detach().clone()
    moved.view(-1)[index[0]] += STEP / 3
    off = check_artifacts(tmp_path / "run.pt", {"0.weight": moved})
    assert not off.holds and "a multiple of 0.125" in "\n".join(off.lines())


def test_a_trainer_holds_the_grid_and_its_checkpoint_resumes(grid, tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    pins = [Pin("encoder.weight", fraction=0.25, seed=2, kind_args={"grid": STEP})]
    fit = trainer(max_steps=4, callbacks=[PinCallback(pins, verify="step")])
    fit.fit(model, make_loader())
    fit.save_checkpoint(tmp_path / "last.ckpt")
    held = _on_grid(model.encoder.weight.detach().reshape(-1))
    assert round(0.25 * held.numel()) <= int(held.sum()) < held.numel()
    assert check_artifacts(tmp_path / "last.ckpt", tmp_path / "last.ckpt").holds
    again = TinyNet()
    resumed = trainer(max_steps=8, max_epochs=3, callbacks=[PinCallback(pins, verify="step")])
    resumed.fit(again, make_loader(), ckpt_path=tmp_path / "last.ckpt")
    assert resumed.global_step == 8
    assert bool(_on_grid(again.encoder.weight.detach().reshape(-1))[held].all())


def test_a_forced_fault_writes_the_grid_and_a_fault_map_round_trips(grid, tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    pins = [Pin("weight", indices=[(0, 1), (2, 3)], kind_args={"grid": STEP})]
    before = model.weight.detach().clone()
    with forced_patch(model, pins):
        held = model.weight.detach()
        assert bool(_on_grid(held[[0, 2], [1, 3]]).all())
        assert torch.equal(held[[0, 2], [1, 3]], torch.round(before[[0, 2], [1, 3]] / STEP) * STEP)
    assert torch.equal(model.weight.detach(), before)
    path = save_fault_map(pins, tmp_path / "chip.pt", module=model)
    (loaded,) = load_fault_map(path)
    assert loaded.kind == "grid" and loaded.kind_args["grid"].tolist() == [STEP, STEP]


def test_the_generic_map_merge_speaks_each_kinds_words(tmp_path):
    # "same" fields (values) refuse two different entries; "or" fields (code bits) bits stuck both ways.
    values = [Pin("w", indices=[[0]], value=1.0), Pin("w", indices=[[0]], value=2.0)]
    with pytest.raises(PinError, match=r"element \(0,\) of 'w' is given two different stuck values"):
        save_fault_map(values, tmp_path / "a.pt")
    code = QuantCode(bits=8, scale=0.5)
    codes = [Pin("w", indices=[[1]], code=code, stuck_at_zero=0x3),
             Pin("w", indices=[[1]], code=code, stuck_at_one=0x1)]
    with pytest.raises(PinError, match=r"element \(1,\) of 'w' has code bits 0x1 stuck at zero and at one"):
        save_fault_map(codes, tmp_path / "b.pt")
    merged = save_fault_map([Pin("w", indices=[[0]], value=1.0), Pin("w", indices=[[0], [2]], value=[1.0, 3.0])],
                            tmp_path / "c.pt")
    assert torch.load(merged)["w:value"].tolist() == [1.0, 3.0]


@pytest.mark.parametrize("spec", [dict(value=0.75), dict(stuck_at_zero=0x80000000, stuck_at_one=0x00400000),
                                  dict(code=QuantCode(bits=8, scale=0.01), stuck_at_one=0x41)], ids=str)
def test_a_forced_fault_writes_what_the_kernel_writes(spec):
    # word_rewrite is one generic path for every kind: the kernel's apply on the stored words.
    torch.manual_seed(3)
    model = nn.Linear(6, 5)
    pins = [Pin("weight", fraction=0.4, seed=1, **spec)]
    expected = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pin(model, opt, pins) as handle:
        forced = model.weight.detach().clone()  # pin() writes the pins when they activate
        (selection,) = handle.engine.plan.pins[0].selections.values()
    model.weight.data.copy_(expected)
    with forced_patch(model, pins):
        assert torch.equal(model.weight.detach().view(torch.int32), forced.view(torch.int32))
        assert not torch.equal(forced, expected)
    assert torch.equal(model.weight.detach(), expected)
    assert selection.index is not None


def test_a_registered_kind_may_not_take_an_argument_of_pin(grid):
    with pytest.raises(PinError, match=r"Seeded needs pin fields of its own \(given \('seed',\); taken: \['seed'\]"):
        kinds.register(type("Seeded", (Grid,), {"kind": "seeded", "pin_fields": ("seed",)}))
    assert Pin("w", seed=3).kind == "value"  # nothing was registered


def test_a_code_pin_holds_a_whole_channels_last_weight():
    # One kernel (kernel(tensor)) for the step plan and apply: a whole tensor stored channels_last is worked on
    # in row-major order and written back (the general path used to write a copy of it and lose it).
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(conv.parameters(), lr=0.1)
    with pin(conv, opt, [Pin("weight", code=QuantCode(bits=8, scale=0.01, axis=0), stuck_at_one=0x01)]) as handle:
        for _ in range(2):
            conv(torch.randn(2, 3, 6, 6)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert not conv.weight.is_contiguous()
        handle.verify()
        codes = torch.round(conv.weight.detach() / 0.01).to(torch.int32)
        assert bool(((codes & 0x01) == 1).all())


def test_the_step_plan_binds_its_kernels_to_the_storage_and_again_once_it_moves():
    model = nn.Linear(5, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pin(model, opt, [Pin("weight", fraction=0.5, seed=0, bounds=(-0.01, 0.01))]) as handle:
        engine = handle.engine
        model(torch.randn(2, 5)).sum().backward()
        opt.step()
        assert engine._step_plan(opt).storage == (model.weight.data_ptr(),)
        model.weight.data = model.weight.data.clone() + 1.0  # a .data swap: every element out of bounds
        model(torch.randn(2, 5)).sum().backward()
        opt.step()
        assert engine._step_plan(opt).storage == (model.weight.data_ptr(),)
        handle.verify()


def _value_checkpoint(path, weight, target):
    """A checkpoint whose pin state holds ``target`` for element 2 of ``weight`` (a value pin), B's weights beside."""
    model = nn.Linear(2, 2)
    from lightning_pin.core.engine import PinEngine
    from lightning_pin.core.plan import resolve
    engine = PinEngine(resolve([Pin("weight", indices=[(1, 0)], value=target)], model))
    engine.set_active(engine.ids_at(0))
    engine.restore()
    torch.save({"state_dict": {"weight": weight}, "callbacks": {"PinCallback{}": engine.state_dict()}}, path)
    return path


def test_diff_reads_a_value_pin_through_the_kind_as_check_does(tmp_path):
    # B stores the weight in float16: 0.1 there is not the float32 target 0.1. check said so; diff, which compared
    # values of its own (the target cast to B's dtype), said it held. Both read the saved form through the kind now.
    from lightning_pin.reporting.diff import diff_checkpoints, read_checkpoint
    weight = torch.zeros(2, 2, dtype=torch.float16)
    target = torch.tensor(0.1).item()  # a float32 number: no rounding to warn about
    weight[1, 0] = target
    path = _value_checkpoint(tmp_path / "b.ckpt", weight, target)
    checked = check_artifacts(path, {"weight": weight})
    (pin_check,) = diff_checkpoints(read_checkpoint(path), read_checkpoint(path)).pins
    assert checked.artifacts[0].parameters[0].off_target == 1 and pin_check.off_target == 1
    assert pin_check.shown == checked.artifacts[0].parameters[0].shown
    weight[1, 0] = 0.5  # where float16 holds the target exactly, both say it holds
    path = _value_checkpoint(tmp_path / "c.ckpt", weight, 0.5)
    assert check_artifacts(path, {"weight": weight}).holds
    (pin_check,) = diff_checkpoints(read_checkpoint(path), read_checkpoint(path)).pins
    assert pin_check.holds

