"""Parked optimizer statistics: the second moments of pinned elements are kept at a normal value
(torch's CPU kernels take the square root of exact zeros and subnormals 3-10x slower) without
moving any free element by a single bit.

Every test trains twice from the same start: once as the engine does now, once with
``engine.park = False`` (the statistics of pinned elements stay at zero, as engines before
parking kept them), and compares the two with ``torch.equal`` after every step. Which elements
are parked, and which optimizers and settings park at all, is written out here, not asked of the
engine.
"""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from helpers import StepRecorder, TinyNet, make_loader, trainer
from lightning_pin import Pin, PinCallback
from lightning_pin.core.engine import PARKED_VALUE, PinEngine
from lightning_pin.core.parking import _refresh_interval
from lightning_pin.core.plan import resolve

STEPS = 13
O = torch.optim

# The statistics each optimizer parks (they reach the update only under a square root).
PARKED_KEYS = {
    O.Adam: ("exp_avg_sq", "max_exp_avg_sq"),
    O.AdamW: ("exp_avg_sq", "max_exp_avg_sq"),
    O.NAdam: ("exp_avg_sq",),
    O.RAdam: ("exp_avg_sq",),
    O.RMSprop: ("square_avg",),
    O.Adagrad: ("sum",),
}

# name -> (class, kwargs, parks). Parking needs a masked gradient to stay exactly zero inside the
# step: no weight decay or decoupled decay. Coupled L2 decay feeds wd * value into the statistics,
# so they are not zeros and stay as they are; Adadelta and Adamax never take the root of a zero.
CASES = {
    "adamw": (O.AdamW, dict(lr=0.01, weight_decay=0.1), True),
    "adamw_amsgrad": (O.AdamW, dict(lr=0.01, weight_decay=0.1, amsgrad=True), True),
    "adam": (O.Adam, dict(lr=0.01), True),
    "adam_amsgrad": (O.Adam, dict(lr=0.01, amsgrad=True), True),
    "adam_l2": (O.Adam, dict(lr=0.01, weight_decay=0.1), False),
    "nadam_decoupled": (O.NAdam, dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True), True),
    "nadam_l2": (O.NAdam, dict(lr=0.01, weight_decay=0.1), False),
    "radam_decoupled": (O.RAdam, dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True), True),
    "radam": (O.RAdam, dict(lr=0.01), True),
    "rmsprop": (O.RMSprop, dict(lr=0.01), True),
    "rmsprop_centered_momentum": (O.RMSprop, dict(lr=0.01, momentum=0.9, centered=True), True),
    "rmsprop_l2": (O.RMSprop, dict(lr=0.01, weight_decay=0.1), False),
    "adagrad": (O.Adagrad, dict(lr=0.1), True),
    "adagrad_l2": (O.Adagrad, dict(lr=0.1, weight_decay=0.1), False),
    "adagrad_initial_accumulator": (O.Adagrad, dict(lr=0.1, initial_accumulator_value=0.1), False),
    "adadelta": (O.Adadelta, dict(lr=1.0, weight_decay=0.1), False),
    "adamax": (O.Adamax, dict(lr=0.01, weight_decay=0.1), False),
    "sgd_momentum": (O.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1), False),
}
if "decoupled_weight_decay" in inspect.signature(O.Adam).parameters:
    CASES["adam_decoupled"] = (O.Adam, dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True), True)


def _steps_on_cpu(cls, kwargs) -> bool:
    p = nn.Parameter(torch.randn(3))
    try:
        opt = cls([p], **kwargs)
        p.grad = torch.randn(3)
        opt.step()
    except Exception:
        return False
    return True


def _cases():
    cases = []
    for name, (cls, kwargs, parks) in CASES.items():
        params = inspect.signature(cls).parameters
        variants = {"forloop": dict(foreach=False) if "foreach" in params else {}}
        if "foreach" in params:
            variants["foreach"] = dict(foreach=True)
        if "fused" in params:
            variants["fused"] = dict(fused=True)
        for variant, extra in variants.items():
            if _steps_on_cpu(cls, {**kwargs, **extra}):
                cases.append(pytest.param(cls, {**kwargs, **extra}, parks, id=f"{name}-{variant}"))
    return cases


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(12, 10, generator=g) * 0.3)
        self.b1 = nn.Parameter(torch.randn(12, generator=g) * 0.1)
        self.w2 = nn.Parameter(torch.randn(5, 12, generator=g) * 0.3)
        self.b2 = nn.Parameter(torch.randn(5, generator=g) * 0.1)

    def loss(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(16, 10, generator=g), torch.randn(16, 5, generator=g)
        hidden = torch.tanh(x @ self.w1.T + self.b1)
        return ((hidden @ self.w2.T + self.b2 - y) ** 2).mean()


def _random_mask(shape, fraction, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) < fraction


W1_WINDOW = _random_mask((12, 10), 0.5, 1)  # steps 0-6, captured values, released at step 7
W2_WINDOW = _random_mask((5, 12), 0.4, 2)  # from step 3 on, pinned to 0.0
W1_WHEN = _random_mask((12, 10), 0.3, 3)  # odd steps only: its statistics are never touched


def _odd_batches(batch, batch_idx):
    return batch_idx % 2 == 1


PINS = [
    Pin("w1", mask=W1_WINDOW, stop_step=7),
    Pin("w2", mask=W2_WINDOW, value=0.0, start_step=3),
    Pin("w1", mask=W1_WHEN, when=_odd_batches),
    Pin("b1", start_step=2, stop_step=9),  # a whole tensor: its gradient is dropped, nothing parked
]


def parked_masks(step: int) -> dict[str, torch.Tensor]:
    """Elements whose statistics are parked after the restore of ``step``: the step-window element pins."""
    none = torch.zeros_like
    return {"w1": W1_WINDOW if step < 7 else none(W1_WINDOW), "w2": W2_WINDOW if step >= 3 else none(W2_WINDOW)}


def active_masks(step: int) -> dict[str, torch.Tensor]:
    masks = {"w1": (W1_WINDOW if step < 7 else torch.zeros_like(W1_WINDOW)) | (W1_WHEN if step % 2 else False)}
    if step >= 3:
        masks["w2"] = W2_WINDOW
    return masks


class Run:
    """One training run in a plain loop, driven step by step."""

    def __init__(self, cls, kwargs, park: bool, pins=PINS, active=active_masks) -> None:
        self.active = active
        self.net = Net()
        self.engine = PinEngine(resolve(pins, self.net))
        self.engine.park = park
        self.opt = cls(self.net.parameters(), **kwargs)
        self.handles = self.engine.attach([self.opt])

    def step(self, step: int) -> None:
        when = {i for i, p in enumerate(self.engine.plan.pins) if p.when is not None and _odd_batches(None, step)}
        self.engine.set_active(self.engine.ids_at(step, when))
        self.opt.zero_grad()
        self.net.loss(step).backward()
        self.engine.mask_grads(self.opt)
        for name, mask in self.active(step).items():
            grad = self.net.get_parameter(name).grad
            assert bool((grad[mask] == 0).all()), f"pinned gradients of {name} not zero at step {step}"
        torch.nn.utils.clip_grad_norm_(self.net.parameters(), max_norm=0.05)
        self.opt.step()
        assert self.engine.violations() == [], f"step {step}"


def _assert_same_state_dicts(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index, state in a["state"].items():
        assert state.keys() == b["state"][index].keys()
        for key, value in state.items():
            other = b["state"][index][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, (index, key)


def _check_step(parked: Run, reference: Run, step: int, cls, parks: bool) -> int:
    """Free elements bit-identical; parked statistics normal where the reference holds zeros.
    Returns how many statistics were parked."""
    for name, p in parked.net.named_parameters():
        assert torch.equal(p, reference.net.get_parameter(name)), f"{name} differs at step {step}"
    masks = parked_masks(step) if parks else {}
    tiny = math.sqrt(torch.finfo(torch.float32).tiny)
    count = 0
    for name, p in parked.net.named_parameters():
        state, expected = parked.opt.state[p], reference.opt.state[reference.net.get_parameter(name)]
        assert state.keys() == expected.keys()
        for key, value in state.items():
            want = expected[key]
            if not isinstance(value, torch.Tensor):
                assert value == want, (name, key)
                continue
            mask = masks.get(name)
            if key not in PARKED_KEYS.get(cls, ()) or mask is None or not bool(mask.any()):
                assert torch.equal(value, want), f"{name}.{key} differs at step {step}"
                continue
            assert torch.equal(value[~mask], want[~mask]), f"{name}.{key} of free elements differs at step {step}"
            assert bool((want[mask] == 0).all()), "the reference's statistics are not zero: the test proves nothing"
            assert bool((value[mask] >= tiny).all() & value[mask].isfinite().all()), f"{name}.{key} not parked"
            count += int(mask.sum())
    return count


@pytest.mark.parametrize("cls, kwargs, parks", _cases())
def test_free_elements_follow_the_unparked_trajectory_bit_for_bit(cls, kwargs, parks):
    parked, reference = Run(cls, kwargs, park=True), Run(cls, kwargs, park=False)
    parked_somewhere = 0
    for step in range(STEPS):
        for run in (parked, reference):
            run.step(step)
            if step == 5:
                # A checkpoint mid-run: it holds what it held before parking existed (the
                # statistics of pinned elements zero), and the run goes on unchanged.
                run.saved = copy.deepcopy(run.opt.state_dict())
            if step == 9:
                # A resume: new state tensors (those of step 5), parked again after the next step.
                run.opt.load_state_dict(run.saved)
        if step == 5:
            _assert_same_state_dicts(parked.saved, reference.saved)
        if step == 9:
            continue  # both just loaded the state of step 5: compared after the next step
        # Right after state_dict() the statistics are unparked: everything equal.
        parked_somewhere += _check_step(parked, reference, step, cls, parks and step != 5)
    _assert_same_state_dicts(parked.opt.state_dict(), reference.opt.state_dict())
    assert (parked_somewhere > 0) == parks
    # A plain optimizer (no pins) loads the checkpoint and trains on.
    net = Net()
    plain = cls(net.parameters(), **kwargs)
    plain.load_state_dict(parked.opt.state_dict())
    net.loss(0).backward()
    plain.step()
    assert all(bool(p.isfinite().all()) for p in net.parameters())


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        pytest.param(O.AdamW, dict(lr=0.01, betas=(0.9, 0.5), foreach=False), id="adamw-beta2-0.5"),
        pytest.param(O.RMSprop, dict(lr=0.01, alpha=0.5, foreach=True), id="rmsprop-alpha-0.5"),
    ],
)
def test_parked_statistics_stay_normal_for_any_run_length(cls, kwargs):
    # With a decay of 0.5 per step, 1.0 would fall below float32's smallest normal (2**-126) in
    # 127 steps: the engine must write it again before then, and only where it parked it.
    pins = [Pin("w1", mask=W1_WINDOW), Pin("w2", mask=W2_WINDOW, value=0.0)]
    runs = [Run(cls, kwargs, park, pins, lambda step: {"w1": W1_WINDOW, "w2": W2_WINDOW}) for park in (True, False)]
    parked, reference = runs
    key = PARKED_KEYS[cls][0]
    floor = math.sqrt(torch.finfo(torch.float32).tiny)
    rewritten = 0
    for step in range(200):
        for run in (parked, reference):
            run.step(step)
        for name in ("w1", "w2"):
            p, q = parked.net.get_parameter(name), reference.net.get_parameter(name)
            assert torch.equal(p, q), f"{name} differs at step {step}"
            mask = W1_WINDOW if name == "w1" else W2_WINDOW
            value, want = parked.opt.state[p][key], reference.opt.state[q][key]
            assert torch.equal(value[~mask], want[~mask])
            assert bool((value[mask] >= floor).all()), f"{name}.{key} fell to {value[mask].min().item()} at step {step}"
        rewritten += int(bool((parked.opt.state[parked.net.w1][key][W1_WINDOW] == PARKED_VALUE).all()))
    assert rewritten >= 200 // (_refresh_interval(0.5, torch.float32) + 1)  # written again, more than once
    assert bool((reference.opt.state[reference.net.w1][key][W1_WINDOW] == 0).all())


@pytest.mark.parametrize("decay", [0.5, 0.9, 0.99, 0.999, 0.9999])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_refresh_interval_keeps_the_value_and_its_root_normal(decay, dtype):
    steps = _refresh_interval(decay, dtype)
    tiny = torch.finfo(dtype).tiny
    assert steps > 0
    # Repeated multiplication in the statistic's own dtype, as the optimizer does it.
    value = torch.tensor(PARKED_VALUE, dtype=torch.float64) * decay**steps
    assert value >= math.sqrt(tiny) and math.sqrt(value) >= tiny
    assert PARKED_VALUE * decay ** (steps + 2) < math.sqrt(tiny)  # and not needlessly often


class _NoParking(Callback):
    """Put after a PinCallback: its engine keeps the statistics of pinned elements at zero."""

    def __init__(self, pin_callback: PinCallback) -> None:
        self.pin_callback = pin_callback

    def on_fit_start(self, trainer, pl_module) -> None:
        self.pin_callback.engine.park = False


class _SmallestStatistic(Callback):
    """At the end of training (before teardown), the smallest exp_avg_sq of a pin's elements."""

    def __init__(self, pin_callback: PinCallback, pin_id: int, name: str) -> None:
        self.pin_callback, self.pin_id, self.name = pin_callback, pin_id, name
        self.smallest = None

    def on_train_end(self, trainer, pl_module) -> None:
        index = self.pin_callback.engine.plan.pins[self.pin_id].selections[self.name].index.long()
        state = trainer.optimizers[0].state[pl_module.get_parameter(self.name)]
        self.smallest = float(state["exp_avg_sq"].view(-1)[index].min())


def test_trainer_run_is_bit_identical_with_accumulation_clipping_and_windows():
    def fit(park: bool):
        torch.manual_seed(0)
        model = TinyNet(lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1))
        pins = [
            Pin("encoder.weight", fraction=0.5, seed=1, start_step=1, stop_step=4),
            Pin("head.weight", fraction=0.3, seed=2, value=0.0),
            Pin("encoder.weight", fraction=0.2, seed=3, when=_odd_batches),
        ]
        callback = PinCallback(pins, verbose=False, monitor=False, verify="step")
        smallest = _SmallestStatistic(callback, 1, "head.weight")
        recorder = StepRecorder()
        extra = [] if park else [_NoParking(callback)]
        t = trainer(
            max_epochs=2,
            accumulate_grad_batches=2,
            gradient_clip_val=0.05,
            callbacks=[callback, *extra, smallest, recorder],
        )
        t.fit(model, make_loader(n=96))
        # After fit the engine has let go of the optimizer and left its statistics unparked.
        return recorder.steps, t.optimizers[0].state_dict(), smallest.smallest

    steps, state, smallest = fit(True)
    ref_steps, ref_state, ref_smallest = fit(False)
    assert len(steps) == len(ref_steps) == 12
    for got, want in zip(steps, ref_steps):
        for name, value in got["params"].items():
            assert torch.equal(value, want["params"][name]), (got["step"], name)
    _assert_same_state_dicts(state, ref_state)
    assert ref_smallest == 0.0 and smallest >= math.sqrt(torch.finfo(torch.float32).tiny)
