"""Exactness with a real Trainer for every torch.optim optimizer (for-loop, foreach and fused).

The expected targets are computed here, independently of the engine: explicit values are cast
to float32 by the test, and ``value=None`` targets are snapshots the test takes itself (the
initial weights, for pins active from step 0). A recorder callback compares them with
``torch.equal`` after every optimizer step (``on_train_batch_end`` runs after the step's
post-hook).
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from helpers import TinyNet, make_loader, trainer
from lightning_pin import Pin, PinCallback, PinError
from lightning_pin.core.engine import PARKED_VALUE
from lightning_pin.core.plan import fraction_indices

STEPS = 5
BATCH = 8

# name -> (optimizer class, keyword arguments). Weight decay wherever the optimizer has it.
BASE = {
    "sgd": (torch.optim.SGD, dict(lr=0.1, weight_decay=0.1)),
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1)),
    "adam": (torch.optim.Adam, dict(lr=0.01, weight_decay=0.1)),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    "adam_amsgrad": (torch.optim.Adam, dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
    "adamw_amsgrad": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
    "adamax": (torch.optim.Adamax, dict(lr=0.01, weight_decay=0.1)),
    "nadam": (torch.optim.NAdam, dict(lr=0.01, weight_decay=0.1)),
    "nadam_decoupled": (torch.optim.NAdam, dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True)),
    "radam": (torch.optim.RAdam, dict(lr=0.01, weight_decay=0.1)),
    "radam_decoupled": (torch.optim.RAdam, dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=0.01, weight_decay=0.1)),
    "rmsprop_momentum_centered": (
        torch.optim.RMSprop,
        dict(lr=0.01, momentum=0.9, centered=True, weight_decay=0.1),
    ),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.1, weight_decay=0.1)),
    "adadelta": (torch.optim.Adadelta, dict(lr=1.0, weight_decay=0.1)),
    "asgd": (torch.optim.ASGD, dict(lr=0.05, weight_decay=0.1, t0=2)),
    "rprop": (torch.optim.Rprop, dict(lr=0.01)),
}
if hasattr(torch.optim, "Adafactor"):
    BASE["adafactor"] = (torch.optim.Adafactor, dict(lr=0.01, weight_decay=0.1))


def _works_on_cpu(cls, kwargs) -> bool:
    """Whether the optimizer constructs and steps on CPU with these arguments (incl. a None grad)."""
    a, b = torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))
    try:
        opt = cls([a, b], **kwargs)
        a.grad = torch.randn(3, 2)
        opt.step()
        opt.step()
    except Exception:
        return False
    return True


def _cases():
    cases = []
    for name, (cls, kwargs) in BASE.items():
        params = inspect.signature(cls).parameters
        variants = {"forloop": dict(foreach=False) if "foreach" in params else {}}
        if "foreach" in params:
            variants["foreach"] = dict(foreach=True)
        if "fused" in params:
            variants["fused"] = dict(fused=True)
        for variant, extra in variants.items():
            full = {**kwargs, **extra}
            if _works_on_cpu(cls, full):
                cases.append(pytest.param(cls, full, id=f"{name}-{variant}"))
            elif variant == "forloop":  # the plain variant must always work
                raise AssertionError(f"{name} does not construct on CPU with {full}")
    return cases


CASES = _cases()


def test_fused_variants_are_covered():
    """Guard against silently losing the fused cases (torch offers them on CPU for these)."""
    ids = {c.id for c in CASES}
    for name in ("sgd", "adam", "adamw", "adagrad"):
        if "fused" in inspect.signature(BASE[name][0]).parameters:
            assert f"{name}-fused" in ids
    assert len([i for i in ids if i.endswith("-forloop")]) == len(BASE)
    # Every optimizer that has a foreach variant (all but, possibly, Adafactor on some versions).
    assert len([i for i in ids if i.endswith("-foreach")]) >= len(BASE) - 1


# --------------------------------------------------------------------------------------------
# Expected targets, computed by the test


class Expected:
    """(name, flat row-major index or None for the whole tensor, float32 targets)."""

    def __init__(self):
        self.entries: list[tuple[str, torch.Tensor | None, torch.Tensor]] = []

    def add(self, name, index, values):
        self.entries.append((name, index, values.detach().clone()))


def _element_values(model, name, index):
    return dict(model.named_parameters())[name].detach().reshape(-1)[index].clone()


class StepRecorder(Callback):
    """After every optimizer step, compare every pinned element with its expected target."""

    def __init__(self, expected_at):
        # expected_at(step) -> list of (name, index, values) that must hold after optimizer step `step`.
        self.expected_at = expected_at
        self.steps: list[int] = []
        self.off: list[tuple[int, str, int]] = []
        self.checked = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step - 1  # the optimizer step that just ran
        self.steps.append(step)
        params = dict(pl_module.named_parameters())
        for name, index, values in self.expected_at(step):
            tensor = params[name].detach()
            actual = tensor if index is None else tensor.reshape(-1)[index]
            self.checked += actual.numel()
            if not torch.equal(actual, values):
                self.off.append((step, name, int((actual != values).sum())))


def _pins_and_expected(model):
    """The standard mix: explicit element values, a value=None fraction, a whole-tensor freeze with
    one explicitly forced element inside it (an explicit value beats value=None)."""
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    head_idx = [(0, 1), (2, 5), (1, 15), (0, 7)]
    head_vals = [0.5, -1.25, 3.0, 0.0]
    pins = [
        Pin("head.weight", indices=head_idx, value=head_vals),
        Pin("encoder.weight", fraction=0.25, seed=7),
        Pin("encoder.bias"),
        Pin("encoder.bias", indices=[3], value=1.5),
    ]
    exp = Expected()
    head_flat = torch.tensor([r * 16 + c for r, c in head_idx])
    exp.add("head.weight", head_flat, torch.tensor(head_vals, dtype=torch.float32))
    enc_idx = fraction_indices("encoder.weight", init["encoder.weight"].numel(), 0.25, 7)
    assert enc_idx.numel() == round(0.25 * 128)
    exp.add("encoder.weight", enc_idx, init["encoder.weight"].reshape(-1)[enc_idx])
    bias = init["encoder.bias"].clone()
    bias[3] = 1.5
    exp.add("encoder.bias", None, bias)
    pinned = {
        "head.weight": head_flat,
        "encoder.weight": enc_idx,
        "encoder.bias": torch.arange(16),
        "head.bias": torch.tensor([], dtype=torch.long),
    }
    return pins, exp, init, pinned


def _free_mask(name, numel, pinned):
    free = torch.ones(numel, dtype=torch.bool)
    free[pinned[name]] = False
    return free


@pytest.mark.parametrize("opt_cls,opt_kwargs", CASES)
def test_pins_exact_after_every_step(opt_cls, opt_kwargs):
    model = TinyNet(optimizer_factory=lambda params: opt_cls(params, **opt_kwargs))
    pins, exp, init, pinned = _pins_and_expected(model)
    recorder = StepRecorder(lambda step: exp.entries)
    cb = PinCallback(pins, verbose=False, verify="step")
    trainer(callbacks=[cb, recorder], max_steps=STEPS).fit(model, make_loader(n=STEPS * BATCH, batch_size=BATCH))

    assert recorder.steps == list(range(STEPS)), recorder.steps
    assert recorder.off == [], f"pinned elements off target (step, name, count): {recorder.off}"
    assert recorder.checked == STEPS * (4 + 32 + 16)
    # At the end too, and by the callback's own check.
    params = dict(model.named_parameters())
    for name, index, values in exp.entries:
        actual = params[name].detach() if index is None else params[name].detach().reshape(-1)[index]
        assert torch.equal(actual, values), name
    cb.verify(model)
    # The free elements of the same tensors kept training: every one of them moved.
    for name in ("head.weight", "encoder.weight", "head.bias"):
        now, before = params[name].detach().reshape(-1), init[name].reshape(-1)
        free = _free_mask(name, now.numel(), pinned)
        moved = now[free] != before[free]
        assert bool(moved.all()), f"{name}: {int((~moved).sum())} of {int(free.sum())} free elements never moved"


# --------------------------------------------------------------------------------------------
# Pins that start and stop mid-run (optimizer state exists, and is reset, at activation)

WINDOW_CASES = [
    c
    for c in CASES
    if c.id
    in {
        "sgd_momentum-forloop",
        "sgd_nesterov-foreach",
        "sgd_momentum-fused",
        "adam-forloop",
        "adamw-fused",
        "adam_amsgrad-foreach",
        "rmsprop_momentum_centered-forloop",
        "adagrad-fused",
        "adadelta-foreach",
        "rprop-forloop",
        "asgd-forloop",
        "nadam-foreach",
    }
]


@pytest.mark.parametrize("opt_cls,opt_kwargs", WINDOW_CASES)
def test_step_window_pins_exact_while_active_and_free_after(opt_cls, opt_kwargs):
    start, stop, steps = 2, 4, 6
    model = TinyNet(optimizer_factory=lambda params: opt_cls(params, **opt_kwargs))
    explicit_idx = torch.tensor([0, 17, 40])  # head.weight, flat
    captured_idx = torch.tensor([5, 6, 90, 127])  # encoder.weight, flat
    pins = [
        Pin("head.weight", indices=[(0, 0), (1, 1), (2, 8)], value=[-2.0, 0.25, 4.0], start_step=start, stop_step=stop),
        Pin("encoder.weight", indices=[(0, 5), (0, 6), (11, 2), (15, 7)], start_step=start),
        Pin("head.bias", start_step=start, stop_step=stop),
    ]
    snapshots: dict[str, torch.Tensor] = {}

    class Snapshot(Callback):
        # Values at activation = values after the step before `start` (nothing runs in between).
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == start:
                snapshots["encoder.weight"] = _element_values(pl_module, "encoder.weight", captured_idx)
                snapshots["head.bias"] = pl_module.head.bias.detach().clone()

    def expected_at(step):
        out = []
        if start <= step:
            out.append(("encoder.weight", captured_idx, snapshots["encoder.weight"]))
        if start <= step < stop:
            out.append(("head.weight", explicit_idx, torch.tensor([-2.0, 0.25, 4.0])))
            out.append(("head.bias", None, snapshots["head.bias"]))
        return out

    history: list[torch.Tensor] = []

    class History(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            history.append(_element_values(pl_module, "head.weight", explicit_idx))

    recorder = StepRecorder(expected_at)
    cb = PinCallback(pins, verbose=False)
    trainer(callbacks=[Snapshot(), cb, recorder, History()], max_steps=steps).fit(
        model, make_loader(n=steps * BATCH, batch_size=BATCH)
    )
    assert recorder.steps == list(range(steps))
    assert recorder.off == [], recorder.off
    assert recorder.checked == (steps - start) * 4 + (stop - start) * (3 + 3)
    # Before the window the explicit elements were free (not at their targets yet) ...
    assert not torch.equal(history[start - 1], torch.tensor([-2.0, 0.25, 4.0]))
    # ... and after it they train again.
    assert bool((history[-1] != torch.tensor([-2.0, 0.25, 4.0])).all()), history[-1]
    assert not torch.equal(model.head.bias.detach(), snapshots["head.bias"])
    cb.verify(model)


# --------------------------------------------------------------------------------------------
# Whole-tensor freezes leave the optimizer alone; pinned elements of partly pinned tensors do not
# accumulate optimizer statistics from their own (masked) gradients.


@pytest.mark.parametrize(
    "opt_cls,opt_kwargs",
    [c for c in CASES if c.id in {"adamw-forloop", "adamw-fused", "sgd_momentum-foreach", "rmsprop-forloop"}],
)
def test_whole_tensor_freeze_gets_no_optimizer_state(opt_cls, opt_kwargs):
    model = TinyNet(optimizer_factory=lambda params: opt_cls(params, **opt_kwargs))
    before = copy.deepcopy(model.encoder.state_dict())
    cb = PinCallback([Pin("encoder.*")], verbose=False)
    t = trainer(callbacks=[cb], max_steps=4)
    t.fit(model, make_loader(n=32))
    assert torch.equal(model.encoder.weight.detach(), before["weight"])
    assert torch.equal(model.encoder.bias.detach(), before["bias"])
    state = t.optimizers[0].state
    # grad = None before every step: the optimizer never saw the frozen tensors.
    assert model.encoder.weight not in state or not state[model.encoder.weight]
    assert model.encoder.bias not in state or not state[model.encoder.bias]
    assert state[model.head.weight], "the free head must have optimizer state"


# --------------------------------------------------------------------------------------------
# Masking keeps pinned gradients out of the optimizer statistics, and activation zeroes what
# accumulated before the pin (checked only where neither coupled weight decay nor anything else
# feeds the statistics of a pinned element).

STAT_KEYS = (
    "momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "square_avg", "grad_avg", "acc_delta", "sum", "prev",
)

# Second moments that the engine parks at PARKED_VALUE (a normal float, decaying by beta2 / alpha
# between refreshes) rather than leaving at zero: torch's CPU kernels are slow on roots of zeros.
# Their numerators (exp_avg, the gradient) are zero, so they push nothing (tests/test_fast_statistics.py).
PARKED_KEYS = {
    torch.optim.Adam: ("exp_avg_sq", "max_exp_avg_sq"),
    torch.optim.AdamW: ("exp_avg_sq", "max_exp_avg_sq"),
    torch.optim.NAdam: ("exp_avg_sq",),
    torch.optim.RAdam: ("exp_avg_sq",),
    torch.optim.RMSprop: ("square_avg",),
    torch.optim.Adagrad: ("sum",),
}

STAT_CASES = [
    pytest.param(torch.optim.Adam, dict(lr=0.01), id="adam-forloop"),
    pytest.param(torch.optim.Adam, dict(lr=0.01, amsgrad=True, foreach=True), id="adam_amsgrad-foreach"),
    pytest.param(torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, fused=True), id="adamw_decoupled_wd-fused"),
    pytest.param(torch.optim.SGD, dict(lr=0.1, momentum=0.9, foreach=True), id="sgd_momentum-foreach"),
    pytest.param(torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, fused=True), id="sgd_nesterov-fused"),
    pytest.param(torch.optim.RMSprop, dict(lr=0.01, momentum=0.9, centered=True), id="rmsprop_centered-forloop"),
    pytest.param(torch.optim.Adagrad, dict(lr=0.1, fused=True), id="adagrad-fused"),
    pytest.param(torch.optim.Adadelta, dict(lr=1.0, foreach=True), id="adadelta-foreach"),
    pytest.param(torch.optim.NAdam, dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True), id="nadam_decoupled"),
    pytest.param(torch.optim.RAdam, dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True), id="radam_decoupled"),
    pytest.param(torch.optim.Rprop, dict(lr=0.01, foreach=False), id="rprop-forloop"),
    pytest.param(torch.optim.Rprop, dict(lr=0.01, foreach=True), id="rprop-foreach"),
]


@pytest.mark.parametrize("opt_cls,opt_kwargs", [c for c in STAT_CASES if _works_on_cpu(*c.values)])
def test_pinned_elements_carry_no_optimizer_statistics(opt_cls, opt_kwargs):
    start = 2
    head_idx = torch.tensor([1, 18, 47])  # active from step 0
    enc_idx = torch.tensor([0, 9, 64, 100])  # active from step `start`: its statistics exist by then
    pins = [
        Pin("head.weight", indices=[(0, 1), (1, 2), (2, 15)], value=[0.5, 0.25, -0.75]),
        Pin("encoder.weight", indices=[(0, 0), (1, 1), (8, 0), (12, 4)], start_step=start),
    ]
    model = TinyNet(optimizer_factory=lambda params: opt_cls(params, **opt_kwargs))
    problems: list[str] = []
    seen_keys: set[str] = set()
    rprop_sizes: dict[str, torch.Tensor] = {}

    class Stats(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step - 1
            state = trainer.optimizers[0].state
            checks = [("head.weight", pl_module.head.weight, head_idx)]
            if step >= start:
                checks.append(("encoder.weight", pl_module.encoder.weight, enc_idx))
            elif step == start - 1:
                # Before the pin, its elements do have statistics (so the reset is observable).
                buffers = [b for k, b in state[pl_module.encoder.weight].items() if k in STAT_KEYS]
                if not any(bool((b.reshape(-1)[enc_idx] != 0).any()) for b in buffers):
                    problems.append("no statistics before activation: the test would prove nothing")
                if "step_size" in state[pl_module.encoder.weight]:
                    rprop_sizes["encoder.weight"] = state[pl_module.encoder.weight]["step_size"].reshape(-1)[enc_idx].clone()
            for name, param, index in checks:
                for key, buffer in state[param].items():
                    if key in STAT_KEYS and buffer.shape == param.shape:
                        seen_keys.add(key)
                        at = buffer.reshape(-1)[index]
                        if key in PARKED_KEYS.get(opt_cls, ()):
                            ok = bool(((at > 0) & (at <= PARKED_VALUE)).all())
                        else:
                            ok = bool((at == 0).all())
                        if not ok:
                            problems.append(f"step {step}: {name} {key} at pinned elements = {at.tolist()}")
                if "step_size" in state[param] and name in rprop_sizes:
                    # Rprop step sizes are left alone by activation (and a zero grad keeps them).
                    if not torch.equal(state[param]["step_size"].reshape(-1)[index], rprop_sizes[name]):
                        problems.append(f"step {step}: Rprop step_size of {name} changed at pinned elements")

    trainer(callbacks=[PinCallback(pins, verbose=False), Stats()], max_steps=5).fit(model, make_loader(n=40))
    assert problems == [], problems
    assert seen_keys, "no optimizer statistic was checked"
    if opt_cls is torch.optim.Rprop:
        assert "encoder.weight" in rprop_sizes and bool((rprop_sizes["encoder.weight"] != 0).all())


@pytest.mark.parametrize("opt_cls,opt_kwargs", [c for c in CASES if c.id in {"adamw-forloop", "sgd_momentum-fused"}])
def test_frozen_tensor_with_a_temporarily_forced_element(opt_cls, opt_kwargs):
    model = TinyNet(optimizer_factory=lambda params: opt_cls(params, **opt_kwargs))
    init = model.encoder.bias.detach().clone()
    seen: list[torch.Tensor] = []

    class Watch(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(pl_module.encoder.bias.detach().clone())

    cb = PinCallback([Pin("encoder.bias"), Pin("encoder.bias", indices=[3], value=1.5, stop_step=2)], verbose=False)
    trainer(callbacks=[cb, Watch()], max_steps=4).fit(model, make_loader(n=32))
    others = torch.ones(16, dtype=torch.bool)
    others[3] = False
    for bias in seen:
        assert torch.equal(bias[others], init[others])
    assert seen[0][3].item() == seen[1][3].item() == 1.5
    assert seen[2][3].item() == seen[3][3].item()  # after the window: held, whichever value is chosen
    cb.verify(model)


# --------------------------------------------------------------------------------------------
# Optimizers that need more than `opt(params, **kwargs)`: LBFGS (closure evaluated several times
# per step) and Muon (2-D parameters only, updates mix the elements of a matrix).


def test_lbfgs_pins_exact_after_every_step():
    model = TinyNet(optimizer_factory=lambda params: torch.optim.LBFGS(params, lr=0.5, max_iter=4))
    pins, exp, init, pinned = _pins_and_expected(model)
    recorder = StepRecorder(lambda step: exp.entries)
    cb = PinCallback(pins, verbose=False, verify="step")
    trainer(callbacks=[cb, recorder], max_steps=STEPS).fit(model, make_loader(n=STEPS * BATCH, batch_size=BATCH))
    assert recorder.steps == list(range(STEPS))
    assert recorder.off == [], recorder.off
    params = dict(model.named_parameters())
    for name in ("head.weight", "encoder.weight", "head.bias"):
        now, before = params[name].detach().reshape(-1), init[name].reshape(-1)
        free = _free_mask(name, now.numel(), pinned)
        assert bool((now[free] != before[free]).all()), name


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs a newer torch")
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_pins_exact_after_every_step(nesterov):
    def muon(params):
        matrices = [p for p in params if p.ndim == 2]
        return torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1, nesterov=nesterov)

    model = TinyNet(optimizer_factory=muon)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    head_idx = torch.tensor([0, 21, 47])
    enc_idx = fraction_indices("encoder.weight", 128, 0.1, 0)
    pins = [
        Pin("head.weight", indices=[(0, 0), (1, 5), (2, 15)], value=[1.0, -1.0, 0.5]),
        Pin("encoder.weight", fraction=0.1),
    ]
    expected = [
        ("head.weight", head_idx, torch.tensor([1.0, -1.0, 0.5])),
        ("encoder.weight", enc_idx, init["encoder.weight"].reshape(-1)[enc_idx]),
    ]
    recorder = StepRecorder(lambda step: expected)
    trainer(callbacks=[PinCallback(pins, verbose=False), recorder], max_steps=STEPS).fit(
        model, make_loader(n=STEPS * BATCH)
    )
    assert recorder.steps == list(range(STEPS)) and recorder.off == [], recorder.off
    free = _free_mask("encoder.weight", 128, {"encoder.weight": enc_idx})
    assert bool((model.encoder.weight.detach().reshape(-1)[free] != init["encoder.weight"].reshape(-1)[free]).all())
