"""Hypothesis property tests: random shapes, selections, values, start steps and optimizers.

An independent oracle (this file) computes every pinned element's target: explicit values are
drawn exactly representable in the parameter's dtype (float32, float64, bfloat16) and cast here,
``value=None`` targets are snapshots this file takes itself right before the pin activates. Only the fraction selection (which elements a seeded permutation picks) comes
from the library, and a separate property pins that function down.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import Callback
from torch import nn

from helpers import TinyNet, make_loader, trainer
from lightning_pin import Pin, PinCallback
from lightning_pin.core.engine import PinEngine
from lightning_pin.core.plan import fraction_indices, resolve

SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

OPTIMIZERS = {
    "sgd_momentum_wd": lambda ps, foreach: torch.optim.SGD(
        ps, lr=0.05, momentum=0.9, weight_decay=0.01, foreach=foreach
    ),
    "adamw": lambda ps, foreach: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=foreach),
    "rmsprop": lambda ps, foreach: torch.optim.RMSprop(
        ps, lr=0.01, momentum=0.5, weight_decay=0.01, foreach=foreach
    ),
}


# --------------------------------------------------------------------------------------------
# Pin descriptions and the oracle


@dataclasses.dataclass
class Spec:
    """One pin as this file understands it (converted to a lightning_pin.Pin by ``pin()``)."""

    param: str
    shape: tuple[int, ...]
    kind: str  # "indices" | "mask" | "fraction" | "whole"
    coords: list[tuple[int, ...]] | None = None
    coords_form: str = "tuples"  # "tuples" | "ints" (1-D) | "tensor"
    mask: torch.Tensor | None = None
    fraction: float | None = None
    seed: int = 0
    value_kind: str = "none"  # "none" | "scalar" | "list" | "tensor"
    value: Any = None
    start: int = 0
    stop: int | None = None
    dtype: torch.dtype = torch.float32

    def active(self, step: int) -> bool:
        return self.start <= step and (self.stop is None or step < self.stop)

    def pin(self) -> Pin:
        kwargs: dict[str, Any] = dict(start_step=self.start, stop_step=self.stop)
        if self.kind == "indices":
            if self.coords_form == "tensor":
                kwargs["indices"] = torch.tensor(self.coords, dtype=torch.long).reshape(len(self.coords), -1)
            elif self.coords_form == "ints":
                kwargs["indices"] = [c[0] for c in self.coords]
            else:
                kwargs["indices"] = list(self.coords)
        elif self.kind == "mask":
            kwargs["mask"] = self.mask
        elif self.kind == "fraction":
            kwargs.update(fraction=self.fraction, seed=self.seed)
        if self.value_kind != "none":
            kwargs["value"] = self.value
        return Pin(self.param, **kwargs)

    def selected(self) -> torch.Tensor:
        """Flat row-major indices, in the order explicit value lists follow."""
        numel = math.prod(self.shape)
        if self.kind == "indices":
            strides = [math.prod(self.shape[d + 1 :]) for d in range(len(self.shape))]
            return torch.tensor([sum(c * s for c, s in zip(row, strides)) for row in self.coords], dtype=torch.long)
        if self.kind == "mask":
            return self.mask.reshape(-1).nonzero().reshape(-1)
        if self.kind == "fraction":
            return fraction_indices(self.param, numel, self.fraction, self.seed)
        return torch.arange(numel)

    def explicit(self) -> torch.Tensor | None:
        """Targets in the parameter's dtype, one per entry of ``selected()``, or None for value=None.

        The drawn values are exactly representable in that dtype, so the cast is exact."""
        index = self.selected()
        if self.value_kind == "none":
            return None
        if self.value_kind == "scalar":
            return torch.full((index.numel(),), self.value, dtype=torch.float64).to(self.dtype)
        if self.value_kind == "list":
            return torch.tensor(self.value, dtype=torch.float64).to(self.dtype)
        return self.value.reshape(-1)[index].to(self.dtype)


class Oracle:
    """Expected targets, computed from the specs and this file's own snapshots."""

    def __init__(self, specs: list[Spec]):
        self.specs = specs
        self.snapshots: dict[int, torch.Tensor] = {}  # spec id -> flat param values at activation

    def before_activation(self, step: int, params: dict[str, torch.Tensor]) -> None:
        for i, spec in enumerate(self.specs):
            if spec.start == step and spec.value_kind == "none":
                self.snapshots[i] = params[spec.param].detach().reshape(-1).clone()

    def expected(self, step: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per parameter: (flat indices of active pinned elements, their float32 targets)."""
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        by_param: dict[str, list[int]] = {}
        for i, spec in enumerate(self.specs):
            if spec.active(step):
                by_param.setdefault(spec.param, []).append(i)
        for name, ids in by_param.items():
            numel = math.prod(self.specs[ids[0]].shape)
            target = torch.zeros(numel, dtype=self.specs[ids[0]].dtype)
            covered = torch.zeros(numel, dtype=torch.bool)
            # value=None first, earliest activation wins (later ones captured the pinned value) ...
            for i in sorted((i for i in ids if self.specs[i].value_kind == "none"), key=lambda i: self.specs[i].start):
                index = self.specs[i].selected()
                new = index[~covered[index]]
                target[new] = self.snapshots[i][new]
                covered[new] = True
            # ... and an explicit value beats them.
            for i in ids:
                values = self.specs[i].explicit()
                if values is not None:
                    index = self.specs[i].selected()
                    target[index] = values
                    covered[index] = True
            index = covered.nonzero().reshape(-1)
            out[name] = (index, target[index])
        return out

    def check(self, step: int, params: dict[str, torch.Tensor]) -> list[str]:
        problems = []
        for name, (index, values) in self.expected(step).items():
            actual = params[name].detach().reshape(-1)[index]
            if not torch.equal(actual, values):
                off = (actual != values).nonzero().reshape(-1)[:3]
                problems.append(
                    f"step {step} {name}: {int((actual != values).sum())} off, e.g. flat {index[off].tolist()}: "
                    f"{actual[off].tolist()} != {values[off].tolist()}"
                )
        return problems

    def ever_pinned(self, name: str, numel: int) -> torch.Tensor:
        covered = torch.zeros(numel, dtype=torch.bool)
        for spec in self.specs:
            if spec.param == name:
                covered[spec.selected()] = True
        return covered


# --------------------------------------------------------------------------------------------
# Strategies

small_dims = st.integers(1, 5)
shapes = st.integers(1, 4).flatmap(lambda nd: st.tuples(*([small_dims] * nd)))


def float32s(bound: float | None = None):
    if bound is None:
        return st.floats(allow_nan=False, allow_infinity=False, width=32)
    return st.floats(-bound, bound, allow_nan=False, allow_infinity=False, width=32)


def values_for(dtype: torch.dtype):
    """Finite values exactly representable in ``dtype`` (as Python floats)."""
    if dtype == torch.float64:
        return st.floats(allow_nan=False, allow_infinity=False)
    if dtype == torch.bfloat16:
        return st.floats(-(2.0**100), 2.0**100, width=32).map(lambda v: torch.tensor(v).to(torch.bfloat16).item())
    return float32s()


DTYPES = [torch.float32, torch.float64, torch.bfloat16]


@st.composite
def specs_for(
    draw, name: str, shape: tuple[int, ...], max_start: int, values, allow_explicit: bool = True, dtype=torch.float32
):
    numel = math.prod(shape)
    kind = draw(st.sampled_from(["indices", "mask", "fraction", "whole"]))
    spec = Spec(name, shape, kind, start=draw(st.integers(0, max_start)), dtype=dtype)
    if kind == "indices":
        coord = st.tuples(*[st.integers(0, n - 1) for n in shape])
        spec.coords = draw(st.lists(coord, min_size=1, max_size=min(numel, 6)))
        spec.coords_form = draw(st.sampled_from(["tuples", "tensor"] + (["ints"] if len(shape) == 1 else [])))
    elif kind == "mask":
        bits = draw(st.lists(st.booleans(), min_size=numel, max_size=numel))
        bits[draw(st.integers(0, numel - 1))] = True  # select at least one element
        spec.mask = torch.tensor(bits, dtype=torch.bool).reshape(shape)
    elif kind == "fraction":
        spec.fraction = draw(st.floats(0.0, 1.0, exclude_min=True))
        spec.seed = draw(st.integers(0, 2**31))
    count = len(spec.selected()) if kind != "indices" else len(spec.coords)
    kinds = ["none"]
    if allow_explicit:
        kinds += ["scalar", "list"] + (["tensor"] if kind != "indices" else [])
        if kind == "indices" and len(set(spec.coords)) != len(spec.coords):
            kinds.remove("list")  # a repeated element would need the same value twice
    spec.value_kind = draw(st.sampled_from(kinds))
    if spec.value_kind == "scalar":
        spec.value = draw(values)
    elif spec.value_kind == "list":
        spec.value = draw(st.lists(values, min_size=count, max_size=count))
    elif spec.value_kind == "tensor":
        # float64 holds every drawn value exactly; the library casts it to the parameter's dtype.
        spec.value = torch.tensor(draw(st.lists(values, min_size=numel, max_size=numel)), dtype=torch.float64).reshape(
            shape
        )
    return spec


@st.composite
def pin_sets(draw, params: dict[str, tuple[int, ...]], max_start: int, values=None, dtypes=None):
    """At most one explicit pin per parameter (two explicit values on one element are an error),
    plus optional overlapping value=None pins."""
    specs = []
    for name, shape in params.items():
        dtype = (dtypes or {}).get(name, torch.float32)
        vals = values if values is not None else values_for(dtype)
        if draw(st.booleans()) or not specs:
            main = draw(specs_for(name, shape, max_start, vals, dtype=dtype))
            specs.append(main)
            extras = draw(st.integers(0, 1))
            for _ in range(extras):
                specs.append(draw(specs_for(name, shape, max_start, vals, allow_explicit=False, dtype=dtype)))
            if not extras and draw(st.booleans()):
                # A step window, on a parameter no other pin touches: after it the elements are free.
                # (A window ending under another pin's value=None is covered in test_engine.)
                main.stop = main.start + draw(st.integers(1, max_start + 1))
    order = draw(st.permutations(list(range(len(specs)))))
    return [specs[i] for i in order]


class Bag(nn.Module):
    """Parameters of arbitrary shapes; an elementwise loss gives every element a nonzero grad."""

    def __init__(self, shapes: list[tuple[int, ...]], seed: int, dtypes: list[torch.dtype] | None = None):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for i, shape in enumerate(shapes):
            dtype = torch.float32 if dtypes is None else dtypes[i]
            self.register_parameter(f"p{i}", nn.Parameter(torch.randn(shape, generator=g).to(dtype)))
            self.register_buffer(f"d{i}", (torch.randint(0, 2, shape, generator=g) * 2 - 1).to(dtype))

    def loss(self) -> torch.Tensor:
        total = torch.zeros(())
        for i, p in enumerate(self.parameters()):
            total = total + (getattr(self, f"d{i}") * p).sum() + 0.05 * (p * p).sum()
        return total


# --------------------------------------------------------------------------------------------
# Plain torch loop with PinEngine

STEPS = 4


@settings(max_examples=40, **SETTINGS)
@given(
    data=st.data(),
    param_shapes=st.lists(st.tuples(shapes, st.sampled_from(DTYPES)), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
    optimizer=st.sampled_from(sorted(OPTIMIZERS)),
    foreach=st.booleans(),
)
def test_engine_loop_pins_exact_after_every_step(data, param_shapes, seed, optimizer, foreach):
    model = Bag([s for s, _ in param_shapes], seed, [d for _, d in param_shapes])
    named = {n: tuple(p.shape) for n, p in model.named_parameters()}
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    specs = data.draw(pin_sets(named, max_start=STEPS - 1, dtypes=dtypes))
    init = {n: p.detach().clone() for n, p in model.named_parameters()}

    def no_warning(message):
        raise AssertionError(f"float32 values must be stored exactly, got a warning: {message}")

    engine = PinEngine(resolve([s.pin() for s in specs], model, warn=no_warning))
    opt = OPTIMIZERS[optimizer](model.parameters(), foreach)
    handles = engine.attach([opt])
    oracle = Oracle(specs)
    params = dict(model.named_parameters())
    try:
        for step in range(STEPS):
            oracle.before_activation(step, params)
            engine.set_active(engine.ids_at(step))
            # Forced before the forward that should see them.
            assert oracle.check(step, params) == []
            opt.zero_grad()
            model.loss().backward()
            engine.mask_grads(opt)
            opt.step()
            assert oracle.check(step, params) == []
    finally:
        for h in handles:
            h.remove()
    assert engine.violations() == []
    # Elements no pin ever selected kept training.
    for name, p in params.items():
        free = ~oracle.ever_pinned(name, p.numel())
        moved = p.detach().reshape(-1)[free] != init[name].reshape(-1)[free]
        if p.dtype == torch.bfloat16:  # an update below half an ulp of a large weight rounds away
            assert moved.float().mean() >= 0.9 if moved.numel() else True, f"{name}: {moved.tolist()}"
        else:
            assert bool(moved.all()), f"{name}: {int((~moved).sum())} free elements never moved"


# --------------------------------------------------------------------------------------------
# The same through a real Trainer

TRAINER_STEPS = 4
TINY_SHAPES = {"encoder.weight": (16, 8), "encoder.bias": (16,), "head.weight": (3, 16), "head.bias": (3,)}


class OracleRecorder(Callback):
    """Snapshots before activation (it must run before PinCallback), checks after every step."""

    def __init__(self, oracle: Oracle):
        self.oracle = oracle
        self.problems: list[str] = []
        self.steps: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.oracle.before_activation(trainer.global_step, dict(pl_module.named_parameters()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step - 1
        self.steps.append(step)
        self.problems += self.oracle.check(step, dict(pl_module.named_parameters()))


@settings(max_examples=25, **SETTINGS)
@given(
    data=st.data(),
    seed=st.integers(0, 2**16),
    optimizer=st.sampled_from(sorted(OPTIMIZERS)),
    foreach=st.booleans(),
)
def test_trainer_pins_exact_after_every_step(data, seed, optimizer, foreach):
    torch.manual_seed(seed)
    specs = data.draw(pin_sets(TINY_SHAPES, max_start=TRAINER_STEPS - 1, values=float32s(8.0)))
    model = TinyNet(optimizer_factory=lambda ps: OPTIMIZERS[optimizer](ps, foreach))
    recorder = OracleRecorder(Oracle(specs))
    cb = PinCallback([s.pin() for s in specs], verbose=False)
    trainer(callbacks=[recorder, cb], max_steps=TRAINER_STEPS).fit(
        model, make_loader(n=8 * TRAINER_STEPS, seed=seed)
    )
    assert recorder.steps == list(range(TRAINER_STEPS))
    assert recorder.problems == []
    cb.verify(model)


# --------------------------------------------------------------------------------------------
# Fraction selections

names = st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True)


@settings(max_examples=200, **SETTINGS)
@given(
    numel=st.integers(1, 3000),
    fraction=st.floats(0.0, 1.0, exclude_min=True),
    seed=st.integers(0, 2**62),
    name=names,
)
def test_fraction_selects_exactly_round_f_numel_distinct_elements_reproducibly(numel, fraction, seed, name):
    index = fraction_indices(name, numel, fraction, seed)
    assert index.dtype == torch.long
    assert index.numel() == max(1, round(fraction * numel))
    assert index.unique().numel() == index.numel()
    assert int(index.min()) >= 0 and int(index.max()) < numel
    assert torch.equal(index, index.sort().values)
    # Same (seed, name): same elements, whatever else the global RNG did in between.
    torch.rand(7)
    assert torch.equal(fraction_indices(name, numel, fraction, seed), index)


@settings(max_examples=30, **SETTINGS)
@given(
    shape=shapes,
    fraction=st.floats(0.0, 1.0, exclude_min=True),
    seed=st.integers(0, 2**31),
    name=names,
    other_seed=st.integers(0, 2**31),
)
def test_fraction_pins_resolve_identically_across_modules_and_calls(shape, fraction, seed, name, other_seed):
    def module(weights_seed):
        m = nn.Module()
        m.register_parameter(name, nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(weights_seed))))
        return m

    pin = Pin(name, fraction=fraction, seed=seed)
    first = resolve([pin], module(0)).pins[0].selections[name].index
    again = resolve([pin], module(other_seed)).pins[0].selections[name].index  # other weights, same name
    assert torch.equal(first, again)
    numel = math.prod(shape)
    assert first.numel() == max(1, round(fraction * numel)) == first.unique().numel()
    assert torch.equal(first.cpu(), fraction_indices(name, numel, fraction, seed))
    # And what the engine pins is exactly those elements: value=None keeps them, nothing else.
    m = module(other_seed)
    init = getattr(m, name).detach().clone()
    engine = PinEngine(resolve([pin], m))
    engine.set_active(engine.ids_at(0))
    with torch.no_grad():
        getattr(m, name).add_(1.0)
    engine.restore()
    stayed = (getattr(m, name).detach() == init).reshape(-1).nonzero().reshape(-1)
    assert torch.equal(stayed, first.cpu())


@pytest.mark.parametrize("name", ["encoder.weight", "head.weight"])
def test_fraction_selection_depends_on_seed_and_name(name):
    base = fraction_indices(name, 1000, 0.1, 0)
    assert not torch.equal(base, fraction_indices(name, 1000, 0.1, 1))
    assert not torch.equal(base, fraction_indices(name + "_x", 1000, 0.1, 0))
