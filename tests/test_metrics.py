"""The metrics of lightning_pin.callbacks.metrics on hand-computed cases, with the engine and no Lightning.

Every value below is exact in float32 (sums and products of small dyadic numbers), so the
assertions compare with == and torch.equal, never with a tolerance.
"""

import pytest
import torch
from torch import nn

from lightning_pin import Pin
from lightning_pin.core.engine import PinEngine, StepStats
from lightning_pin.callbacks.metrics import (
    FreeWeights,
    PinDrift,
    PinViolations,
    WeightDrift,
    count_off_target,
    pinned_indices,
    top_level_groups,
)
from lightning_pin.core.plan import resolve
from lightning_pin.reporting.preservation import Preservation

PINNED = [(0, 0), (1, 1)]  # flat indices 0 and 3 of a.weight
PIN_VALUES = [0.5, -2.0]


class TwoPart(nn.Module):
    """Two top-level modules with hand-set weights: a.weight = [[1, 0], [0, 4]], b.weight = [[6, 8]]."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2, bias=False)
        self.b = nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            self.a.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 4.0]]))
            self.b.weight.copy_(torch.tensor([[6.0, 8.0]]))


def _setup(weight_decay=0.0):
    model = TwoPart()
    engine = PinEngine(resolve([Pin("a.weight", indices=PINNED, value=PIN_VALUES)], model))
    # The reference is taken before the pins are forced: forcing must not count as weight drift.
    free = FreeWeights(model.named_parameters(), pinned_indices(engine.plan))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, weight_decay=weight_decay)
    handles = engine.attach([optimizer])
    engine.set_active(engine.ids_at(0))
    # Known gradients: pinned elements get 0.25 and -0.5, free ones 6 (a[0,1]), 0 (a[1,0]), 8 and 0 (b).
    model.a.weight.grad = torch.tensor([[0.25, 6.0], [0.0, -0.5]])
    model.b.weight.grad = torch.tensor([[8.0, 0.0]])
    return model, engine, free, optimizer, handles


def measured_step(engine, optimizer):
    """One optimizer step observed by a restore hook that asks for the step's stats."""
    seen = []
    handle = engine.register_restore_hook(seen.append, wants_stats=lambda: True)
    optimizer.step()
    handle.remove()
    assert len(seen) == 1 and seen[0] is not None
    return seen[0]


def test_pin_drift_and_weight_drift_of_one_sgd_step_without_masking():
    model, engine, free, optimizer, _ = _setup()
    assert torch.equal(model.a.weight.detach().view(-1)[[0, 3]], torch.tensor(PIN_VALUES))  # forced
    stats = measured_step(engine, optimizer)  # lr 0.5: pinned elements move by 0.125 and 0.25 before the restore
    assert stats.drift_max.item() == 0.25
    assert stats.drift_sum.item() == 0.375
    assert stats.elements == 2
    assert stats.violations.item() == 0
    # The restore put the pins back, bit for bit.
    assert torch.equal(model.a.weight.detach().view(-1)[[0, 3]], torch.tensor(PIN_VALUES))

    drift = PinDrift()
    drift.update(stats)
    result = drift.compute()
    assert result["max"].item() == 0.25
    assert result["mean"].item() == 0.1875

    # Free elements moved by 3 (a[0,1]) and 4 (b[0,0]): distances 3 and 4 per module, 5 in total.
    # The free elements' norm at the reference is ||(0, 0, 6, 8)|| = 10 (the pinned 1 and 4 excluded).
    assert free.groups == ["a", "b"]
    assert free.elements == 4
    assert free.squared_reference.tolist() == [0.0, 100.0]
    weights = WeightDrift(free.groups)
    weights.update(free.squared_distances(), free.squared_reference)
    result = weights.compute()
    assert result["groups"].tolist() == [3.0, 4.0]
    assert result["total"].item() == 5.0
    assert result["relative"].item() == 0.5


def test_masked_pins_are_pushed_only_by_weight_decay():
    model, engine, free, optimizer, _ = _setup(weight_decay=0.5)
    engine.mask_grads(optimizer)  # pinned gradients -> 0: only the coupled decay lr*wd*p moves them
    stats = measured_step(engine, optimizer)
    # |0.5 * 0.5 * 0.5| = 0.125 and |0.5 * 0.5 * -2.0| = 0.5
    assert stats.drift_max.item() == 0.5
    assert stats.drift_sum.item() == 0.625
    assert stats.violations.item() == 0
    assert torch.equal(model.a.weight.detach().view(-1)[[0, 3]], torch.tensor(PIN_VALUES))


def test_nothing_is_measured_unless_asked():
    _, engine, _, optimizer, _ = _setup()
    seen = []
    handle = engine.register_restore_hook(seen.append)
    optimizer.step()
    assert seen == [None]
    handle.remove()
    optimizer.step()
    assert seen == [None]  # removed: not called again


def test_drift_accumulates_max_and_mean_over_updates():
    drift = PinDrift()
    drift.update(StepStats(torch.tensor(0.25), torch.tensor(0.375), elements=2, violations=torch.tensor(0)))
    drift.update(StepStats(torch.tensor(0.125), torch.tensor(0.125), elements=2, violations=torch.tensor(0)))
    result = drift.compute()
    assert result["max"].item() == 0.25
    assert result["mean"].item() == 0.125  # (0.375 + 0.125) / 4
    drift.reset()
    assert (drift.max_move.item(), drift.sum_move.item(), drift.elements.item()) == (0.0, 0.0, 0)


def test_violations_count_tampering_between_steps():
    model, engine, _, optimizer, _ = _setup()
    optimizer.step()
    assert count_off_target(engine.targets()).item() == 0
    with torch.no_grad():  # someone else writes to two pinned elements and one free one
        model.a.weight.view(-1)[[0, 3]] += 1.0
        model.a.weight.view(-1)[1] += 1.0
    off = count_off_target(engine.targets())
    assert off.item() == 2
    violations = PinViolations()
    violations.update(off)
    violations.update(torch.tensor(0))
    assert violations.compute().item() == 2
    # The next restore repairs them.
    optimizer.step()
    assert count_off_target(engine.targets()).item() == 0


def test_violations_count_a_restore_that_does_not_restore(monkeypatch):
    _, engine, _, optimizer, _ = _setup()
    monkeypatch.setattr(engine, "_write", lambda targets: None)  # a broken restore: writes nothing
    stats = measured_step(engine, optimizer)
    assert stats.violations.item() == 2  # both pinned elements moved and stayed off
    assert stats.drift_max.item() == 0.25


def test_a_wholly_pinned_or_frozen_parameter_has_no_free_elements():
    model = TwoPart()
    model.b.weight.requires_grad_(False)
    engine = PinEngine(resolve([Pin("a.weight")], model))
    free = FreeWeights(model.named_parameters(), pinned_indices(engine.plan))
    assert free.elements == 0
    assert free.squared_distances().tolist() == [0.0]  # group "a" only: b is frozen


def test_pinned_indices_is_the_union_over_pins_and_time():
    model = TwoPart()
    plan = resolve(
        [
            Pin("a.weight", indices=[(0, 0)], value=1.0),
            Pin("a.weight", indices=[(0, 0), (1, 0)], start_step=5),
            Pin("b.weight"),
        ],
        model,
    )
    pinned = pinned_indices(plan)
    assert pinned["a.weight"].tolist() == [0, 2]
    assert pinned["b.weight"] is None


@pytest.mark.parametrize(
    "names, expected",
    [
        (["encoder.0.weight", "encoder.0.bias", "head.weight"], ["encoder", "encoder", "head"]),
        (
            ["backbone.features.0.weight", "backbone.features.2.weight", "backbone.head.weight"],
            ["backbone.features", "backbone.features", "backbone.head"],
        ),
        (["model.backbone.x.w", "model.backbone.y.w"], ["model.backbone.x", "model.backbone.y"]),
        (["backbone.weight", "backbone.sub.weight"], ["backbone.weight", "backbone.sub"]),
        (["weight"], ["weight"]),
    ],
)
def test_top_level_groups_look_through_single_child_wrappers(names, expected):
    assert list(top_level_groups(names).values()) == expected


def test_preservation_higher_is_better():
    p = Preservation(higher_is_better=True, tolerance=0.01)
    p.baseline = 0.75
    p.record(0, 0.5, forced=True)
    assert p.gap(0.5) == 0.25 and p.recovered_step is None
    p.record(10, 0.73125)  # gap 0.01875 > 0.01
    assert p.recovered_step is None
    p.record(20, 0.740234375)  # gap 0.009765625 <= 0.01
    p.record(30, 0.5)  # falling back does not undo the first recovery
    assert (p.forced, p.final, p.recovered_step, p.last_step) == (0.5, 0.5, 20, 30)


def test_preservation_compares_the_gap_at_decimal_resolution():
    p = Preservation(higher_is_better=True, tolerance=0.01)
    p.baseline = 0.967
    assert p.gap(0.957) > 0.01  # 0.010000000000000009 in binary ...
    assert p.within(0.957)  # ... but one point is one point
    assert not p.within(0.9569)


def test_preservation_lower_is_better():
    p = Preservation(higher_is_better=False, tolerance=0.1)
    p.baseline = 0.25
    p.record(0, 0.5, forced=True)
    assert p.gap(0.5) == 0.25 and p.gap(0.125) == -0.125
    assert p.recovered_step is None
    p.record(7, 0.3125)
    assert p.recovered_step == 7
    restored = Preservation(higher_is_better=False, tolerance=0.1)
    restored.load_state_dict(p.state_dict())
    assert restored.state_dict() == p.state_dict()


def test_preservation_rejects_a_bad_tolerance():
    with pytest.raises(ValueError, match="tolerance"):
        Preservation(tolerance=float("nan"))
