"""Fuzz: random, often malformed, Pin specs and `when` results. Every case either trains exactly or
raises PinError; nothing else escapes (no TypeError, IndexError, KeyError, RuntimeError ...).

"Exactly": after every optimizer step, each element of every active pin equals its target bit for
bit (torch.equal). Targets come from an oracle in this file: explicit values from the resolved
selection (and, for a plain number, cast here independently), ``value=None`` targets from the
snapshot this file takes right before the pin activates; explicit values beat captured ones, and
later pins beat earlier ones of the same kind. A spec rejected at construction or resolution
leaves every weight as it was.

``test_properties.py`` covers valid specs in depth; this file is about what users get wrong.
The lead extends it to checkpoint pin states (``PinState``) the same way.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pin import Pin, PinError
from lightning_pin.core.engine import PinEngine
from lightning_pin.core.plan import call_when, resolve

SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
SHAPES = {"a": (4, 3), "b": (5,), "h": (3,), "s": ()}
STEPS = 4


class Model(nn.Module):
    """a (4, 3), b (5,) and the scalar s in float32, h (3,) in float16 (overflows at 65504)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.randn(4, 3, generator=g))
        self.b = nn.Parameter(torch.randn(5, generator=g))
        self.h = nn.Parameter(torch.randn(3, generator=g).half())
        self.s = nn.Parameter(torch.randn((), generator=g))

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a * x[:12].reshape(4, 3)).pow(2).sum() + (self.b * x[:5]).sum() + (self.h.float() * x[:3]).sum() + self.s * x[0]


# --------------------------------------------------------------------------------------------
# Strategies: mostly plausible, often wrong


def _floats() -> st.SearchStrategy:
    return st.one_of(
        st.floats(allow_nan=True, allow_infinity=True, width=64),
        st.sampled_from([0.0, -0.0, 0.1, 1e39, 7e4, -7e4, 1e-45, 1e300, 65504.0, 2.0**-24]),
    )


def _numbers() -> st.SearchStrategy:
    return st.one_of(
        _floats(),
        st.integers(-5, 5),
        st.sampled_from([2**63, 2**70, -(2**64), 10**400, True, False, np.float32(0.5), np.int64(3), np.bool_(True)]),
    )


PARAMS = st.one_of(
    st.sampled_from(["a", "b", "h", "s", "*", "a*", "[ab]", "re:a|b", "re:h", "re:(", "re:", "", "nope", "A"]),
    st.lists(st.sampled_from(["a", "b", "h", "*", "nope", ""]), min_size=0, max_size=3),
    st.sampled_from([5, None, b"a", ("a", "b"), ["a", 3], {"a": 1}, 1.5]),
)

INDICES = st.one_of(
    st.lists(st.tuples(st.integers(-1, 5), st.integers(-1, 4)), min_size=0, max_size=4),
    st.lists(st.integers(-1, 6), min_size=0, max_size=4),
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=3), min_size=1, max_size=3),
    st.lists(st.integers(0, 4), min_size=1, max_size=3).map(torch.tensor),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=3).map(torch.tensor),
    st.sampled_from(["0", 3, 1.5, [(0.5, 1)], [()], [(), 3], [(0, 1), 2], [(True, 0)], torch.tensor([[0.0, 1.0]]), torch.tensor([True, False]),
                     np.array([0, 1]), [(2**64, 0)], {"a": [(0, 0)]}]),
)


def _mask(shape: tuple[int, ...]) -> st.SearchStrategy:
    size = math.prod(shape)
    return st.lists(st.booleans(), min_size=size, max_size=size).map(lambda bits: torch.tensor(bits).reshape(shape))


MASKS = st.one_of(
    _mask((4, 3)),
    _mask((5,)),
    _mask((3,)),
    _mask((3, 4)),
    st.sampled_from([torch.ones(4, 3), torch.ones(5, dtype=torch.uint8), [True, False], "mask.npy", "missing.pt",
                     {"a": torch.ones(4, 3, dtype=torch.bool)}, {"b": "x.pt"}, 7]),
)

FRACTIONS = st.one_of(st.floats(-0.5, 1.5), st.sampled_from([0, 1, 1.0, float("nan"), float("inf"), True, "0.5",
                                                             1e-9]))

VALUES = st.one_of(
    st.none(),
    _numbers(),
    st.lists(_numbers(), min_size=0, max_size=13),
    st.lists(st.floats(-10, 10, width=32), min_size=12, max_size=12).map(lambda v: torch.tensor(v).reshape(4, 3)),
    st.lists(st.floats(-10, 10, width=32), min_size=1, max_size=5).map(torch.tensor),
    st.sampled_from([
        "abc", "values.pt", "values.npy", torch.zeros(3, dtype=torch.complex64), torch.ones(5, dtype=torch.bool),
        torch.tensor(float("nan")), torch.arange(5), {"a": 1.0, "b": [1.0] * 5, "h": 2.0}, {"nope": 1.0},
        {"a": float("nan")}, [[1.0, 2.0], [3.0]], 1 + 2j, object(), ["1", "2"], [[0.5] * 3] * 4,
    ]),
)

WHEN_RESULTS = st.sampled_from(
    [True, False, "no", "", None, 1, 0, 1.0, torch.tensor(True), torch.tensor(False), torch.tensor([True, False]),
     torch.tensor([True]), torch.tensor(1), np.bool_(True), np.bool_(False), [True]]
)


@st.composite
def whens(draw) -> Any:
    kind = draw(st.sampled_from(["none", "none", "returns", "alternates", "one-arg", "path", "bad-path", "int"]))
    if kind == "none":
        return None
    if kind == "returns":
        result = draw(WHEN_RESULTS)
        return lambda batch, batch_idx: result
    if kind == "alternates":
        results = draw(st.lists(WHEN_RESULTS, min_size=STEPS, max_size=STEPS))
        return lambda batch, batch_idx: results[batch_idx]
    if kind == "one-arg":
        return lambda batch: True
    if kind == "path":
        return draw(st.sampled_from(["operator.eq", "operator:truth", "math.isfinite", "os.sep"]))
    if kind == "bad-path":
        return draw(st.sampled_from(["nowhere_xyz.f", "operator.nothing", "noimportpath", ":f", "a."]))
    return draw(st.sampled_from([5, 1.5, b"x"]))


GOOD_WHEN_RESULTS = st.sampled_from([True, False, torch.tensor(True), torch.tensor(False), np.bool_(True)])


@st.composite
def good_whens(draw) -> Any:
    kind = draw(st.sampled_from(["none", "none", "none", "returns", "alternates", "path"]))
    if kind == "none":
        return None
    if kind == "returns":
        result = draw(GOOD_WHEN_RESULTS)
        return lambda batch, batch_idx: result
    if kind == "alternates":
        results = draw(st.lists(GOOD_WHEN_RESULTS, min_size=STEPS, max_size=STEPS))
        return lambda batch, batch_idx: results[batch_idx]
    return "operator.is_not"  # an import path: `batch is not batch_idx`, always True, a bool


@st.composite
def good_pin_kwargs(draw) -> dict[str, Any]:
    """A spec that is right, for one parameter or several."""
    name = draw(st.sampled_from(["a", "b", "h", "s", None]))
    if name is None:  # several parameters: whole tensors, fractions or per-name dicts only
        kwargs: dict[str, Any] = {"params": draw(st.sampled_from(["*", "[ab]", "re:a|b", ["a", "h"], ("b", "h")]))}
        if draw(st.booleans()):
            kwargs["fraction"] = draw(st.floats(0.01, 1.0))
            kwargs["seed"] = draw(st.integers(0, 5))
        kwargs["value"] = draw(st.one_of(st.none(), st.floats(-100, 100, width=16), st.integers(-3, 3),
                                         st.just({"a": 0.5, "b": -1.0, "h": 2.0, "s": 0.25})))
    else:
        shape = SHAPES[name]
        kwargs = {"params": draw(st.sampled_from([name, f"re:{name}", [name]]))}
        kind = draw(st.sampled_from(["whole", "indices", "mask", "fraction"]))
        count = math.prod(shape)
        if kind == "indices":
            coords = draw(st.lists(st.tuples(*(st.integers(0, n - 1) for n in shape)), min_size=1, max_size=4,
                                   unique=True))
            kwargs["indices"] = coords if draw(st.booleans()) else torch.tensor(coords)
            count = len(coords)
        elif kind == "mask":
            bits = draw(st.lists(st.booleans(), min_size=count, max_size=count).filter(any))
            kwargs["mask"] = torch.tensor(bits).reshape(shape)
            count = sum(bits)
        elif kind == "fraction":
            kwargs["fraction"] = draw(st.floats(0.01, 1.0))
            count = max(1, round(kwargs["fraction"] * math.prod(shape)))
        kwargs["value"] = draw(st.one_of(
            st.none(),
            st.floats(-100, 100, width=16),
            st.integers(-3, 3),
            st.lists(st.floats(-100, 100, width=16), min_size=count, max_size=count),
        ))
    start = draw(st.integers(0, STEPS))
    kwargs["start_step"] = start
    kwargs["stop_step"] = draw(st.one_of(st.none(), st.integers(start + 1, STEPS + 2)))
    kwargs["when"] = draw(good_whens())
    return kwargs


WILD = {
    "params": PARAMS,
    "indices": INDICES,
    "mask": MASKS,
    "fraction": FRACTIONS,
    "value": VALUES,
    "seed": st.one_of(st.integers(-3, 2**40), st.sampled_from([1.5, True, "1", None])),
    "start_step": st.one_of(st.integers(-2, STEPS + 1), st.sampled_from([1.0, True, None, "0"])),
    "stop_step": st.one_of(st.integers(-1, STEPS + 2), st.sampled_from([2.5, False, "3"])),
    "when": whens(),
}


BAD_WHEN_RESULTS = st.sampled_from(
    ["no", "", None, 1, 0, 1.0, torch.tensor([True, False]), torch.tensor([True]), torch.tensor(1), [True]]
)


@st.composite
def pin_kwargs(draw, wild: int = 3, bad_whens: bool = True) -> dict[str, Any]:
    """A right spec with up to ``wild`` fields replaced by wild draws; with ``bad_whens``, often
    a `when` that answers well on some batches and returns something else on one."""
    kwargs = draw(good_pin_kwargs())
    for field in draw(st.lists(st.sampled_from(sorted(WILD)), max_size=wild, unique=True)):
        kwargs[field] = draw(WILD[field])
    if bad_whens and draw(st.integers(0, 5)) == 0:
        results = draw(st.lists(GOOD_WHEN_RESULTS, min_size=STEPS, max_size=STEPS))
        results[draw(st.integers(0, STEPS - 1))] = draw(BAD_WHEN_RESULTS)
        kwargs["when"] = lambda batch, batch_idx: results[batch_idx]
    return kwargs


# --------------------------------------------------------------------------------------------
# Running a case through the engine, with the oracle


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _expected(plan, active: list[int], captured: dict[int, dict[str, torch.Tensor]]) -> dict[str, dict[int, Any]]:
    """Per parameter, flat index -> target of the active pins (captured first, explicit last)."""
    expected: dict[str, dict[int, torch.Tensor]] = {}
    for explicit in (False, True):
        for pin_id in sorted(active):
            for name, selection in plan.pins[pin_id].selections.items():
                if (selection.values is not None) != explicit:
                    continue
                numel = selection.parameter.numel()
                index = range(numel) if selection.index is None else selection.index.tolist()
                source = selection.values.reshape(-1) if explicit else captured[pin_id][name].reshape(-1)
                targets = expected.setdefault(name, {})
                for position, flat in enumerate(index):
                    targets[flat] = source[flat] if selection.index is None or not explicit else source[position]
    return expected


def _check_exact(model: nn.Module, expected: dict[str, dict[int, torch.Tensor]], step: int) -> None:
    params = dict(model.named_parameters())
    for name, targets in expected.items():
        flat = params[name].detach().reshape(-1)
        index = torch.tensor(sorted(targets), dtype=torch.long)
        want = torch.stack([targets[i] for i in sorted(targets)])
        got = flat[index]
        assert got.dtype == want.dtype and torch.equal(got, want), (step, name, got, want)


def _check_numbers_independently(plan) -> None:
    """A plain number is stored as Python's float of it, cast to the parameter's dtype."""
    for rp in plan.pins:
        value = rp.pin.value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            for selection in rp.selections.values():
                cast = torch.tensor(float(value), dtype=torch.float64).to(selection.parameter.dtype)
                assert torch.equal(selection.values.reshape(-1), cast.expand(selection.values.numel()))


def run_case(all_kwargs: list[dict[str, Any]], optimizer_name: str) -> str:
    """Build, resolve and train; return "trained" or "PinError: ..." (anything else escapes)."""
    model = Model()
    before = _snapshot(model)
    try:
        pins = [Pin(**kwargs) for kwargs in all_kwargs]
    except PinError as err:
        return f"PinError at construction: {err}"
    try:
        plan = resolve(pins, model, warn=lambda message: None)
    except PinError as err:
        after = _snapshot(model)
        assert all(torch.equal(before[k], after[k]) for k in before), "a rejected spec changed a weight"
        return f"PinError at resolve: {err}"
    _check_numbers_independently(plan)
    engine = PinEngine(plan)
    if optimizer_name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    handles = engine.attach([optimizer])
    captured: dict[int, dict[str, torch.Tensor]] = {}
    active: list[int] = []
    g = torch.Generator().manual_seed(1)
    try:
        for step in range(STEPS):
            batch = torch.randn(12, generator=g)
            candidates = [i for i, rp in enumerate(plan.pins) if rp.when is not None and rp.in_window(step)]
            try:
                hits = [i for i in candidates if call_when(plan.pins[i], batch, step)]
            except PinError as err:
                return f"PinError from when at step {step}: {err}"
            now = sorted(engine.ids_at(step, hits))
            snapshot = _snapshot(model)
            for pin_id in now:
                if pin_id not in active:  # (re)activation: value=None targets are taken now
                    captured[pin_id] = {n: snapshot[n] for n in plan.pins[pin_id].selections}
            active = now
            engine.set_active(now)
            optimizer.zero_grad()
            model.loss(batch).backward()
            engine.mask_grads(optimizer)
            optimizer.step()
            _check_exact(model, _expected(plan, active, captured), step)
        assert engine.violations() == []
    finally:
        for handle in handles:
            handle.remove()
    return "trained"


def test_every_spec_trains_exactly_or_raises_pin_error():
    outcomes: dict[str, int] = {}

    @settings(max_examples=400, **SETTINGS)
    @given(st.lists(pin_kwargs(), min_size=1, max_size=2), st.sampled_from(["sgd", "adamw"]))
    def case(all_kwargs, optimizer_name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outcome = run_case(all_kwargs, optimizer_name)
        kind = outcome.split(" at ")[0] if outcome.startswith("PinError from when") else outcome.split(":")[0]
        outcomes[kind] = outcomes.get(kind, 0) + 1
        if kind != "trained":
            # Every PinError names the offending spec.
            assert "Pin(params=" in outcome, outcome

    case()
    # The fuzz itself reaches every outcome, training often enough to mean something.
    assert set(outcomes) == {"trained", "PinError at construction", "PinError at resolve", "PinError from when"}, outcomes
    assert outcomes["trained"] >= 30, outcomes


# --------------------------------------------------------------------------------------------
# The same through a real Trainer with PinCallback (fewer examples: a fit costs more)


class _FitModule:
    """Built lazily: importing Lightning only for the test that fits."""

    @staticmethod
    def make():
        import lightning as L

        class Module(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.model = Model()

            def training_step(self, batch, batch_idx):
                return self.model.loss(batch[0])

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=0.1, weight_decay=0.1)

        return Module()


def _prefixed(pattern: Any) -> Any:
    if not isinstance(pattern, str) or not pattern:
        return pattern  # wild: stays as wrong as it was
    return "re:model\\.(" + pattern[3:] + ")" if pattern.startswith("re:") else "model." + pattern


def test_fit_with_pin_callback_trains_exactly_or_raises_pin_error():
    from helpers import trainer

    from lightning_pin import PinCallback

    outcomes = {"trained": 0, "PinError": 0}

    @settings(max_examples=15, **SETTINGS)
    @given(st.lists(pin_kwargs(wild=1, bad_whens=False), min_size=1, max_size=2))
    def case(all_kwargs):
        for kwargs in all_kwargs:  # the callback resolves on the LightningModule: names gain "model."
            params = kwargs["params"]
            if isinstance(params, (list, tuple)):
                kwargs["params"] = [_prefixed(p) for p in params]
            else:
                kwargs["params"] = _prefixed(params)
        module = _FitModule.make()
        data = torch.utils.data.TensorDataset(torch.randn(STEPS, 12))
        loader = torch.utils.data.DataLoader(data, batch_size=None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                # verify="step": PinCallback checks every pinned element after every step.
                cb = PinCallback([dict(kwargs) for kwargs in all_kwargs], verbose=False, monitor=False, verify="step")
                trainer(max_steps=STEPS, callbacks=[cb]).fit(module, loader)
            except PinError:
                outcomes["PinError"] += 1
                return
        cb.verify(module)
        outcomes["trained"] += 1

    case()
    assert outcomes["trained"] >= 3 and outcomes["PinError"] >= 1, outcomes
