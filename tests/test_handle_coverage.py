"""Optimizer coverage in ``pin()``, checked at every step rather than once in ``pin()``.

An optimizer the handle was not given that steps a pinned parameter is refused before its
update lands; a param group added after ``pin()`` (progressive unfreezing) is covered; the
global optimizer hooks that see every optimizer go away with the handle.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from lightning_pin import Pin, PinError, pin


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def _loss(model, step: int, through_output: bool = True):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 4, generator=g)
    y = torch.randint(0, 3, (8,), generator=g)
    out = model(x) if through_output else model[2](model[1](model[0](x)))  # submodules called directly
    return nn.functional.cross_entropy(out, y)


def test_an_optimizer_not_given_to_pin_that_steps_a_pinned_parameter_is_refused_before_its_update():
    model = _net()
    given = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.AdamW(model[0].parameters(), lr=0.1, weight_decay=0.5)  # decays 0.weight too
    target = torch.tensor(0.5)
    with pin(model, given, Pin("0.weight", indices=[(0, 0)], value=0.5)) as handle:
        _loss(model, 0).backward()
        given.step()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(PinError, match=r"AdamW.*not given to pin\(\).*'0.weight'.*pin\(model, \[opt1, opt2\]"):
            other.step()
        for name, parameter in model.named_parameters():  # the update never landed
            assert torch.equal(parameter.detach(), before[name]), name
        assert other.state == {}
        assert torch.equal(model[0].weight.detach()[0, 0], target)
        handle.verify()
    # Without the handle the other optimizer steps as it likes again.
    other.step()
    assert not torch.equal(model[0].weight.detach()[0, 0], target)


def test_other_optimizers_that_hold_no_pinned_parameter_or_only_frozen_ones_step_freely():
    model, second = _net(), _net(1)
    model[2].weight.requires_grad_(False)
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)
    unrelated = torch.optim.SGD(second.parameters(), lr=0.1)
    frozen_holder = torch.optim.SGD([model[2].weight], lr=0.1, weight_decay=0.1)  # grad None: skipped
    with pin(model, optimizer, [Pin("0.bias", value=0.0), Pin("2.weight")]) as handle:
        for step in range(2):
            (_loss(model, step) + _loss(second, step)).backward()
            optimizer.step()
            unrelated.step()
            frozen_holder.step()
            optimizer.zero_grad()
            unrelated.zero_grad()
        handle.verify()


def test_a_trainable_pinned_parameter_no_optimizer_holds_yet_is_accepted_and_covered_once_added():
    # Progressive unfreezing: the encoder joins the optimizer after pin() with add_param_group.
    model = _net()
    optimizer = torch.optim.AdamW(model[2].parameters(), lr=0.05, weight_decay=0.1)
    target = torch.tensor(0.5)
    with pin(model, optimizer, Pin("0.weight", indices=[(0, 0)], value=0.5)) as handle:
        for step in range(2):
            _loss(model, step).backward()
            optimizer.step()
            optimizer.zero_grad()
        encoder_before = model[0].weight.detach().clone()
        optimizer.add_param_group({"params": list(model[0].parameters()), "weight_decay": 0.5})
        for step in range(2, 5):
            _loss(model, step).backward()
            optimizer.step()
            optimizer.zero_grad()
            assert torch.equal(model[0].weight.detach()[0, 0], target)
        handle.verify()
        moved = model[0].weight.detach() != encoder_before
        assert bool(moved.reshape(-1)[1:].all())  # the rest of the encoder trains
        state = optimizer.state[model[0].weight]
        assert torch.equal(state["exp_avg"][0, 0], torch.tensor(0.0))  # its gradient was masked


@pytest.mark.parametrize("through_output", [True, False])
def test_a_parameter_unfrozen_and_added_after_pin_gets_its_pinned_gradient_masked(through_output):
    model = _net()
    model[0].requires_grad_(False)
    optimizer = torch.optim.Adam(model[2].parameters(), lr=0.05)
    target = torch.tensor(0.5)
    with pin(model, optimizer, Pin("0.weight", indices=[(0, 0)], value=0.5)) as handle:
        _loss(model, 0, through_output).backward()
        optimizer.step()
        optimizer.zero_grad()
        model[0].requires_grad_(True)
        optimizer.add_param_group({"params": list(model[0].parameters())})
        for step in range(1, 4):
            _loss(model, step, through_output).backward()
            clipped_grad = model[0].weight.grad[0, 0].clone() if step > 1 else None
            optimizer.step()
            optimizer.zero_grad()
            if clipped_grad is not None:  # from the step after the join on, zero when backward returns
                assert torch.equal(clipped_grad, torch.tensor(0.0))
            assert torch.equal(model[0].weight.detach()[0, 0], target)
        handle.verify()
        state = optimizer.state[model[0].weight]
        assert torch.equal(state["exp_avg"][0, 0], torch.tensor(0.0))
        assert torch.equal(state["exp_avg_sq"][0, 0], torch.tensor(0.0))


def test_the_global_optimizer_hooks_go_with_the_handle(monkeypatch):
    from lightning_pin.core import handle as handle_module

    # Handles other tests left alive (not removed) keep their own global hook: start from none.
    monkeypatch.setattr(handle_module, "_COVERING", {})
    monkeypatch.setattr(handle_module, "_GLOBAL_HOOK", [])
    pre, post = len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)
    models = [_net(seed) for seed in range(3)]
    handles = [pin(m, torch.optim.SGD(m.parameters(), lr=0.1), Pin("0.bias", value=0.0)) for m in models]
    assert len(_global_optimizer_pre_hooks) == pre + 1  # one for every live handle
    handles[0].remove()
    handles[1].remove()
    assert len(_global_optimizer_pre_hooks) == pre + 1
    handles[2].remove()
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == (pre, post)
    # A removed handle no longer refuses another optimizer.
    other = torch.optim.SGD(models[2].parameters(), lr=0.1)
    _loss(models[2], 0).backward()
    other.step()


class _Wrapper(torch.optim.Optimizer):
    """An optimizer that steps an inner one inside its own step (as ZeroRedundancyOptimizer does with `optim`)."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.optim = inner
        super().__init__(inner.param_groups, inner.defaults)

    def step(self, closure=None):
        return self.optim.step(closure)


def test_an_optimizer_stepped_inside_a_given_one_is_covered_by_it():
    model = _net()
    outer = _Wrapper(torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5))
    with pin(model, outer, Pin("0.weight", indices=[(0, 0)], value=0.5)) as handle:
        for step in range(3):
            _loss(model, step).backward()
            outer.step()
            outer.zero_grad()
        handle.verify()
