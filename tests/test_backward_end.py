"""pin() zeroes pinned gradients once per backward, at its end, not with a hook per parameter
(core/backward_end.py), and goes back to per-parameter hooks when a backward bypasses the module."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import nn

from lightning_pin import Pin, pin
from lightning_pin.core.backward_end import EndOfBackward, first_tensor_requiring_grad

LAYERS = 12


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(LAYERS)])


def _pins() -> list[Pin]:
    return [Pin([f"{i}.weight" for i in range(LAYERS)], fraction=0.25, seed=3), Pin("0.bias", value=0.5)]


def _hooks(model: nn.Module) -> int:
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def _pinned_grads(handle) -> list[torch.Tensor]:
    """The gradient values of every active pinned element."""
    found = []
    for target in handle.engine.targets():
        grad = target.parameter.grad
        found.append(grad.reshape(-1) if target.index is None else grad.reshape(-1)[target.index.long()])
    return found


def test_no_hook_per_parameter_and_pinned_grads_zero_when_backward_returns():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    with pin(model, optimizer, _pins()) as handle:
        assert _hooks(model) == LAYERS + 1  # until a backward through the module's output is seen
        for _ in range(3):
            model(torch.randn(4, 8)).square().mean().backward()
            assert _hooks(model) == 0
            grads = _pinned_grads(handle)
            assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
            # ... and the free ones were not touched: some are non-zero.
            assert model[1].weight.grad.abs().sum() > 0
            optimizer.step()
            optimizer.zero_grad()
        handle.verify()


def test_grouped_and_per_parameter_masking_train_bit_identically():
    """The same fit with the grouped mask and with a hook per parameter (forced), clipping included."""

    def fit(grouped: bool) -> list[torch.Tensor]:
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        handle = pin(model, optimizer, _pins())
        if not grouped:  # keep the hooks per parameter it starts with
            handle._end_of_backward.remove()
            handle._handles.remove(handle._end_of_backward)
        torch.manual_seed(1)
        for step in range(6):
            for _ in range(2):  # accumulation
                model(torch.randn(4, 8)).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            optimizer.step()
            optimizer.zero_grad()
        handle.verify()
        assert _hooks(model) == (0 if grouped else LAYERS + 1)
        handle.remove()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(fit(True), fit(False)):
        assert torch.equal(a, b)


def _through_the_layers(model: nn.Sequential) -> torch.Tensor:
    """The loss from the layers called one by one: the module's own forward never runs."""
    x = torch.randn(4, 8)
    for layer in model:
        x = layer(x)
    return x.square().mean()


def test_a_loop_that_calls_submodules_keeps_the_hooks_per_parameter_silently():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pin(model, optimizer, _pins()) as handle, warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            _through_the_layers(model).backward()
            assert all(torch.equal(g, torch.zeros_like(g)) for g in _pinned_grads(handle))
            optimizer.step()
            optimizer.zero_grad()
        handle.verify()
        assert _hooks(model) == LAYERS + 1 and not handle._grouped


def test_a_backward_that_bypasses_the_module_later_falls_back_to_hooks_per_parameter():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    handle = pin(model, optimizer, _pins())
    before = [t.values.clone() for t in handle.engine.targets()]
    model(torch.randn(4, 8)).square().mean().backward()  # through the module: one call per backward from now on
    optimizer.step()
    optimizer.zero_grad()
    assert handle._grouped and _hooks(model) == 0
    _through_the_layers(model).backward()
    with pytest.warns(UserWarning, match="without a backward through Sequential's forward output"):
        optimizer.step()
    handle.verify()
    assert _hooks(model) == LAYERS + 1  # one per pinned parameter: every weight and bias 0
    optimizer.zero_grad()
    _through_the_layers(model).backward()
    assert all(torch.equal(g, torch.zeros_like(g)) for g in _pinned_grads(handle))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()
    handle.verify()
    assert all(torch.equal(t.values, b) for t, b in zip(handle.engine.targets(), before))
    handle.remove()


def test_a_step_with_a_closure_runs_its_backward_inside():
    model = _model()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    x = torch.randn(4, 8)

    def closure():
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    with pin(model, optimizer, _pins()) as handle, warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            optimizer.step(closure)
        handle.verify()
        assert _hooks(model) == 0


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")  # torch's own, expected here
def test_create_graph_and_several_forwards_per_backward():
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    calls = []
    with pin(model, optimizer, _pins()) as handle:
        model(torch.randn(4, 8)).square().mean().backward()  # the first backward through the module
        optimizer.step()
        optimizer.zero_grad()
        original = handle.engine.mask_all_grads
        handle.engine.mask_all_grads = lambda: (calls.append(1), original())[1]
        loss = model(torch.randn(4, 8)).square().mean() + model(torch.randn(4, 8)).abs().mean()
        loss.backward(create_graph=True)
        assert calls == [1]
        assert all(torch.equal(g.detach(), torch.zeros_like(g)) for g in _pinned_grads(handle))
        optimizer.step()
        handle.verify()
        for p in model.parameters():
            p.grad = None


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    extra: object = None


def test_the_output_tensor_is_found_in_mappings_sequences_and_dataclasses():
    t = torch.randn(2, requires_grad=True) * 2
    assert first_tensor_requiring_grad({"loss": None, "logits": (torch.zeros(1), t)}) is t
    assert first_tensor_requiring_grad(_Output(t)) is t
    assert first_tensor_requiring_grad([torch.zeros(2), "text"]) is None


def test_end_of_backward_runs_after_every_gradient_is_accumulated():
    model = _model()
    seen = []
    end = EndOfBackward(model, lambda: seen.append(all(p.grad is not None for p in model.parameters())))
    model(torch.randn(2, 8)).sum().backward()
    with torch.no_grad():
        model(torch.randn(2, 8))  # no graph, no call
    end.remove()
    model(torch.randn(2, 8)).sum().backward()
    assert seen == [True]


def test_a_compiled_module_is_masked_at_the_end_of_backward():
    model = _model()
    compiled = torch.compile(model, backend="eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    with pin(compiled, optimizer, _pins()) as handle, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            compiled(torch.randn(4, 8)).square().mean().backward()
            assert all(torch.equal(g, torch.zeros_like(g)) for g in _pinned_grads(handle))
            optimizer.step()
            optimizer.zero_grad()
        handle.verify()
        assert handle._grouped and _hooks(model) == 0
    assert not [w for w in caught if str(w.message).startswith("pin()")]
