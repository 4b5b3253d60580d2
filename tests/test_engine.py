"""Unit tests of lightning_pin.core.engine, with torch only (no Lightning).

Expected values are computed here by indexing the tensors with the pinned coordinates, never by
asking the engine for its targets.
"""

from __future__ import annotations

import io
import math
import warnings

import pytest
import torch
from torch import nn

from lightning_pin import Pin, PinError
from lightning_pin.core.engine import PinEngine, Violation
from lightning_pin.core.plan import resolve


class Net(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = nn.Parameter(torch.randn(4, 5, generator=g))
        self.b = nn.Parameter(torch.randn(6, generator=g))
        self.c = nn.Parameter(torch.randn(2, 3, 2, generator=g))

    def loss(self):
        return (self.a * torch.arange(1.0, 21.0).reshape(4, 5)).sum() + (self.b**2).sum() + self.c.sum() * 3


def _engine(pins, module, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every value used here is exact in float32
        return PinEngine(resolve(pins, module), **kwargs)


def _activate_all(engine, step=0):
    return engine.set_active(engine.ids_at(step))


def _mask(shape, coords):
    m = torch.zeros(shape, dtype=torch.bool)
    for c in coords:
        m[c] = True
    return m


A_PINNED = [(0, 0), (1, 2), (3, 4), (2, 1)]


# --------------------------------------------------------------------------------------------
# mask_grads


def test_mask_grads_zeroes_exactly_the_pinned_grad_elements():
    net = Net()
    engine = _engine([Pin("a", indices=A_PINNED, value=0.5)], net)
    _activate_all(engine)
    grad = torch.randn(4, 5)
    grad[1, 2] = math.inf  # pinned: must become 0, not NaN
    grad[3, 4] = -math.inf  # pinned
    grad[2, 2] = math.inf  # free: must stay inf
    grad[0, 3] = -math.inf  # free
    net.a.grad = grad.clone()
    b_grad = torch.randn(6)
    net.b.grad = b_grad.clone()

    engine.mask_grads()

    expected = grad.clone()
    for c in A_PINNED:
        expected[c] = 0.0
    assert torch.equal(net.a.grad, expected)
    assert not torch.isnan(net.a.grad).any()
    assert net.a.grad[2, 2].item() == math.inf and net.a.grad[0, 3].item() == -math.inf
    assert torch.equal(net.b.grad, b_grad)  # an unpinned parameter's grad is untouched


def test_mask_grads_does_nothing_for_inactive_pins_and_missing_grads():
    net = Net()
    engine = _engine([Pin("a", indices=A_PINNED, value=0.5, start_step=3)], net)
    assert _activate_all(engine, step=0) == []
    grad = torch.randn(4, 5)
    net.a.grad = grad.clone()
    engine.mask_grads()
    assert torch.equal(net.a.grad, grad)
    assert _activate_all(engine, step=3) == [0]
    net.b.grad = None
    net.a.grad = None
    engine.mask_grads()  # no grad: nothing to do, no error
    assert net.a.grad is None


def test_mask_grads_only_touches_the_given_optimizers_parameters():
    net = Net()
    engine = _engine([Pin("a", indices=A_PINNED, value=0.5), Pin("b", indices=[1], value=2.0)], net)
    opt_a = torch.optim.SGD([net.a], lr=0.1)
    opt_b = torch.optim.SGD([net.b, net.c], lr=0.1)
    handles = engine.attach([opt_a, opt_b])
    _activate_all(engine)
    net.a.grad, net.b.grad = torch.ones(4, 5), torch.ones(6)
    engine.mask_grads(opt_b)
    assert torch.equal(net.a.grad, torch.ones(4, 5))
    assert torch.equal(net.b.grad, torch.tensor([1.0, 0, 1, 1, 1, 1]))
    for h in handles:
        h.remove()


@pytest.mark.parametrize("whole_grads", ["drop", "zero"])
def test_whole_tensor_pin_drops_or_zeroes_the_grad(whole_grads):
    net = Net()
    engine = _engine([Pin("b"), Pin("a", indices=[(0, 0)], value=1.0)], net, whole_grads=whole_grads)
    _activate_all(engine)
    net.b.grad = torch.full((6,), math.inf)
    net.a.grad = torch.ones(4, 5)
    engine.mask_grads()
    if whole_grads == "drop":
        assert net.b.grad is None
    else:
        assert net.b.grad is not None and net.b.grad.shape == (6,)
        assert torch.equal(net.b.grad, torch.zeros(6))
    expected = torch.ones(4, 5)
    expected[0, 0] = 0
    assert torch.equal(net.a.grad, expected)


def test_whole_grads_must_be_drop_or_zero():
    with pytest.raises(PinError, match="whole_grads"):
        PinEngine(resolve([Pin("a")], Net()), whole_grads="none")


@pytest.mark.parametrize("whole_grads", ["drop", "zero"])
@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.5),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.5),
    ],
    ids=["adamw", "sgd"],
)
def test_whole_tensor_freeze_survives_decay_in_both_modes(whole_grads, make_opt):
    net = Net()
    before = net.b.detach().clone()
    engine = _engine([Pin("b")], net, whole_grads=whole_grads)
    opt = make_opt(net.parameters())
    handles = engine.attach([opt])
    for step in range(3):
        _activate_all(engine, step)
        opt.zero_grad()
        net.loss().backward()
        engine.mask_grads(opt)
        opt.step()
        assert torch.equal(net.b.detach(), before), step
    for h in handles:
        h.remove()


class _PushEverything(torch.optim.AdamW):
    """A subclass that moves every parameter, grad or not: the engine may not assume it skips."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(1.0)
        return loss


def test_dropped_whole_tensor_is_restored_for_optimizers_that_do_not_skip_none_grads():
    net = Net()
    before = net.b.detach().clone()
    engine = _engine([Pin("b")], net)
    opt = _PushEverything(net.parameters(), lr=0.1)
    handles = engine.attach([opt])
    _activate_all(engine)
    net.loss().backward()
    engine.mask_grads(opt)
    assert net.b.grad is None
    opt.step()
    assert torch.equal(net.b.detach(), before)
    handles[0].remove()


# --------------------------------------------------------------------------------------------
# restore / activation


def test_activation_forces_and_restore_writes_exactly_the_targets():
    net = Net()
    init = {n: p.detach().clone() for n, p in net.named_parameters()}
    values = [0.5, -2.0, 3.25, 2.0**-100]
    engine = _engine([Pin("a", indices=A_PINNED, value=values), Pin("c")], net)
    _activate_all(engine)
    expected_a = init["a"].clone()
    for c, v in zip(A_PINNED, values):
        expected_a[c] = torch.tensor(v, dtype=torch.float32)
    assert torch.equal(net.a.detach(), expected_a)  # forced at activation
    assert torch.equal(net.c.detach(), init["c"])

    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p))
    perturbed = {n: p.detach().clone() for n, p in net.named_parameters()}
    engine.restore()
    pinned = _mask((4, 5), A_PINNED)
    assert torch.equal(net.a.detach()[pinned], expected_a[pinned])
    assert torch.equal(net.a.detach()[~pinned], perturbed["a"][~pinned])  # free elements untouched
    assert torch.equal(net.c.detach(), init["c"])
    assert torch.equal(net.b.detach(), perturbed["b"])
    assert engine.last_step_active == frozenset({0, 1})


def test_post_step_hook_restores_after_every_step_in_a_plain_loop():
    net = Net()
    init = {n: p.detach().clone() for n, p in net.named_parameters()}
    engine = _engine([Pin("a", indices=A_PINNED, value=[1.0, 2.0, 3.0, 4.0]), Pin("b", indices=[0, 5])], net)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.3)
    handles = engine.attach([opt])
    expected_a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    for step in range(4):
        _activate_all(engine, step)
        opt.zero_grad()
        net.loss().backward()
        engine.mask_grads(opt)
        opt.step()
        assert torch.equal(torch.stack([net.a.detach()[c] for c in A_PINNED]), expected_a)
        assert torch.equal(net.b.detach()[[0, 5]], init["b"][[0, 5]])
    assert bool((net.b.detach()[1:5] != init["b"][1:5]).all())
    free = ~_mask((4, 5), A_PINNED)
    assert bool((net.a.detach()[free] != init["a"][free]).all())
    for h in handles:
        h.remove()
    # Detached: a further step moves the pinned elements again (the hook is gone).
    engine.detach()
    opt.step()
    assert not torch.equal(net.b.detach()[[0, 5]], init["b"][[0, 5]])


def test_non_contiguous_channels_last_conv_weight():
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    assert not conv.weight.is_contiguous()
    coords = [(0, 0, 0, 0), (1, 2, 1, 0), (3, 1, 2, 2), (2, 0, 1, 1)]
    explicit = [1.0, 2.0, 3.0]
    init = conv.weight.detach().clone()
    engine = _engine(
        [
            Pin("weight", indices=coords[:3], value=explicit),
            Pin("weight", indices=coords[3:]),  # value=None
        ],
        conv,
    )
    opt = torch.optim.Adam(conv.parameters(), lr=0.1, weight_decay=0.1)
    handles = engine.attach([opt])
    expected = torch.tensor(explicit + [init[coords[3]].item()])

    def pinned_values(t):
        return torch.stack([t[c] for c in coords])

    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    for step in range(3):
        _activate_all(engine, step)
        opt.zero_grad()
        conv(x).square().sum().backward()
        grad = conv.weight.grad
        assert not grad.is_contiguous()  # the grad is channels_last too: positions by strides
        before = grad.clone()
        engine.mask_grads(opt)
        want = before.clone()
        for c in coords:
            want[c] = 0
        assert torch.equal(conv.weight.grad, want)
        opt.step()
        assert torch.equal(pinned_values(conv.weight.detach()), expected), step
    free = ~_mask(init.shape, coords)
    assert bool((conv.weight.detach()[free] != init[free]).all())
    # reset_optimizer_state on channels_last state buffers.
    exp_avg = opt.state[conv.weight]["exp_avg"]
    assert not exp_avg.is_contiguous()
    exp_avg.fill_(1.0)
    engine.reset_optimizer_state(opt, [0])
    want = torch.ones_like(exp_avg)
    for c in coords[:3]:
        want[c] = 0
    assert torch.equal(exp_avg, want)
    # A tampered element is found (its coordinates: see the next test).
    assert engine.violations() == []
    with torch.no_grad():
        conv.weight[1, 2, 1, 0] = 9.0
    (v,) = engine.violations()
    assert v.count == 1 and v.examples[0][1:] == (9.0, 2.0)
    for h in handles:
        h.remove()


def test_violation_coordinates_on_a_channels_last_weight():
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    engine = _engine([Pin("weight", indices=[(1, 2, 1, 0)], value=2.0)], conv)
    _activate_all(engine)
    with torch.no_grad():
        conv.weight[1, 2, 1, 0] = 9.0
    (v,) = engine.violations()
    assert v.examples == [((1, 2, 1, 0), 9.0, 2.0)]  # reported as (1, 1, 0, 2) today


def test_non_contiguous_parameter_with_storage_offset():
    base = torch.arange(30.0).reshape(6, 5)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(base[1:].t())  # shape (5, 5), strides (1, 5), storage offset 5

    m = M()
    assert not m.w.is_contiguous() and m.w.storage_offset() == 5
    coords = [(0, 0), (4, 1), (2, 3)]
    engine = _engine([Pin("w", indices=coords, value=[-1.0, -2.0, -3.0])], m)
    _activate_all(engine)
    want = base[1:].t().clone()
    for c, v in zip(coords, [-1.0, -2.0, -3.0]):
        want[c] = v
    assert torch.equal(m.w.detach(), want)
    assert torch.equal(base[0], torch.arange(5.0))  # the row before the offset was not written
    assert engine.violations() == []


def test_gapped_parameter_is_an_error_not_a_wrong_write():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 6)[:, ::2])

    m = M()
    before = m.w.detach().clone()
    engine = _engine([Pin("w", indices=[(1, 1)], value=5.0)], m)
    with pytest.raises(PinError, match="strides"):
        _activate_all(engine)
    assert torch.equal(m.w.detach(), before)


# --------------------------------------------------------------------------------------------
# reset_optimizer_state

DESIGN_KEYS = {
    "momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "square_avg", "grad_avg", "acc_delta", "sum", "prev",
}

RESET_OPTIMIZERS = {
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "rmsprop_centered": lambda ps: torch.optim.RMSprop(ps, lr=0.1, momentum=0.5, centered=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "adadelta": lambda ps: torch.optim.Adadelta(ps),
    "adamax": lambda ps: torch.optim.Adamax(ps),
    "nadam": lambda ps: torch.optim.NAdam(ps),
    "asgd": lambda ps: torch.optim.ASGD(ps, t0=0),
    "rprop": lambda ps: torch.optim.Rprop(ps),
}


def _state_snapshot(opt, param):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[param].items()}


@pytest.mark.parametrize("name", list(RESET_OPTIMIZERS))
def test_reset_optimizer_state_zeroes_statistics_only_at_pinned_elements(name):
    net = Net()
    opt = RESET_OPTIMIZERS[name](net.parameters())
    for _ in range(2):
        opt.zero_grad()
        (net.loss() + (net.a**3).sum()).backward()
        opt.step()
    before_a = _state_snapshot(opt, net.a)
    before_b = _state_snapshot(opt, net.b)
    before_c = _state_snapshot(opt, net.c)
    # ASGD keeps only step, eta, mu and the weight average ax: there is nothing to zero.
    assert any(k in DESIGN_KEYS for k in before_a) == (name != "asgd"), sorted(before_a)
    engine = _engine([Pin("a", indices=A_PINNED, value=0.0), Pin("b")], net)
    engine.reset_optimizer_state(opt, [0, 1])
    pinned = _mask((4, 5), A_PINNED)
    for key, old in before_a.items():
        new = opt.state[net.a][key]
        if key in DESIGN_KEYS:
            assert bool((old[pinned] != 0).any()), f"{key} was already 0: the test proves nothing"
            want = old.clone()
            want[pinned] = 0
            assert torch.equal(new, want), key
        elif isinstance(old, torch.Tensor):
            assert torch.equal(new, old), key  # step, step_size, ax, eta, mu, exp_inf, ...
        else:
            assert new == old, key
    for key, old in before_b.items():  # a whole-tensor pin: the whole statistic is zeroed
        new = opt.state[net.b][key]
        if key in DESIGN_KEYS:
            assert torch.equal(new, torch.zeros_like(old)), key
        else:
            assert torch.equal(new, old) if isinstance(old, torch.Tensor) else new == old, key
    if name == "rprop":
        assert "step_size" in before_a and bool((before_a["step_size"] != 0).all())
    # c is not pinned: its state is untouched.
    for key, old in before_c.items():
        new = opt.state[net.c][key]
        assert torch.equal(new, old) if isinstance(old, torch.Tensor) else new == old, key


def test_activation_resets_state_of_attached_optimizers_but_when_pins_leave_it_alone():
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    opt.zero_grad()
    net.loss().backward()
    opt.step()
    momentum = opt.state[net.a]["momentum_buffer"].clone()
    assert bool((momentum != 0).all())
    pins = [
        Pin("a", indices=[(0, 1)], value=0.0, when=lambda batch, i: True),
        Pin("a", indices=[(3, 3)], value=0.0, start_step=1),
    ]
    engine = _engine(pins, net)
    handles = engine.attach([opt])
    assert engine.set_active(engine.ids_at(1, when_hits=[0])) == [0, 1]
    want = momentum.clone()
    want[3, 3] = 0  # the step-window pin zeroes its element; the `when` pin leaves (0, 1) alone
    assert torch.equal(opt.state[net.a]["momentum_buffer"], want)
    assert net.a[0, 1].item() == 0.0 and net.a[3, 3].item() == 0.0
    handles[0].remove()


# --------------------------------------------------------------------------------------------
# Merged targets


@pytest.mark.parametrize("explicit_first", [True, False])
def test_explicit_value_beats_value_none_on_the_same_element(explicit_first):
    net = Net()
    init = net.a.detach().clone()
    whole = Pin("a")
    forced = Pin("a", indices=[(1, 1), (2, 4)], value=[7.0, -7.0])
    fraction = Pin("a", fraction=0.5, seed=3)  # value=None, overlapping both
    pins = [forced, whole, fraction] if explicit_first else [whole, fraction, forced]
    engine = _engine(pins, net)
    _activate_all(engine)
    want = init.clone()
    want[1, 1], want[2, 4] = 7.0, -7.0
    assert torch.equal(net.a.detach(), want)
    with torch.no_grad():
        net.a.add_(1.0)
    engine.restore()
    assert torch.equal(net.a.detach(), want)


def test_value_none_pin_starting_later_captures_the_forced_value():
    net = Net()
    init = net.b.detach().clone()
    engine = _engine([Pin("b", indices=[2], value=5.0), Pin("b", indices=[1, 2, 3], start_step=2)], net)
    _activate_all(engine, 0)
    with torch.no_grad():
        net.b.add_(1.0)  # "training" moves the free elements 1 and 3
    engine.restore()
    moved = net.b.detach().clone()
    _activate_all(engine, 2)
    with torch.no_grad():
        net.b.mul_(3.0)
    engine.restore()
    assert net.b[2].item() == 5.0
    assert torch.equal(net.b.detach()[[1, 3]], moved[[1, 3]])
    assert torch.equal(moved[[1, 3]], init[[1, 3]] + 1.0)


def test_two_explicit_values_on_one_element_are_rejected():
    with pytest.raises(PinError, match="different values"):
        resolve([Pin("a", indices=[(0, 0)], value=1.0), Pin("a", value=2.0)], Net())


# --------------------------------------------------------------------------------------------
# violations


def test_violations_report_coordinates_counts_and_values():
    net = Net()
    engine = _engine([Pin("a", indices=A_PINNED, value=[1.0, 2.0, 3.0, 4.0]), Pin("c")], net)
    _activate_all(engine)
    assert engine.violations() == []
    c_target = net.c.detach().clone()
    with torch.no_grad():
        net.a[1, 2] = 2.5  # pinned to 2.0
        net.a[2, 1] = -4.0  # pinned to 4.0
        net.a[0, 1] = 100.0  # free: not a violation
        net.c[1, 2, 0] += 1.0
    found = {v.name: v for v in engine.violations()}
    assert set(found) == {"a", "c"}
    assert isinstance(found["a"], Violation)
    assert found["a"].count == 2
    assert sorted(found["a"].examples) == [((1, 2), 2.5, 2.0), ((2, 1), -4.0, 4.0)]
    assert found["c"].count == 1
    assert found["c"].examples == [((1, 2, 0), (c_target[1, 2, 0] + 1.0).item(), c_target[1, 2, 0].item())]
    assert "a" in str(found["a"]) and "2 element(s)" in str(found["a"])
    # Only the pins asked about; and against other tensors, by name.
    assert [v.name for v in engine.violations(pin_ids=[1])] == ["c"]
    other = {"a": torch.zeros(4, 5), "c": c_target}
    (v,) = engine.violations(other)
    assert v.name == "a" and v.count == 4
    with pytest.raises(PinError, match="no parameter 'c'"):
        engine.violations({"a": torch.zeros(4, 5)})


def test_violations_examples_are_capped_and_bit_exact():
    net = Net()
    engine = _engine([Pin("b", value=1.0)], net)
    _activate_all(engine)
    with torch.no_grad():
        net.b.add_(torch.finfo(torch.float32).eps)  # one ulp off 1.0: still a violation
    (v,) = engine.violations(examples=2)
    assert v.count == 6 and len(v.examples) == 2
    assert v.examples[0][0] == (0,)


# --------------------------------------------------------------------------------------------
# state_dict / load_state_dict


def _pins_for_state():
    return [
        Pin("a", indices=A_PINNED, value=[1.0, 2.0, 3.0, 4.0]),
        Pin("b", fraction=0.5, seed=1),
        Pin("c"),
        Pin("a", indices=[(0, 4)], start_step=5),  # not active yet: nothing captured
    ]


def _only_plain_types(obj):
    if isinstance(obj, dict):
        return all(isinstance(k, (str, int)) and _only_plain_types(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(_only_plain_types(v) for v in obj)
    return obj is None or isinstance(obj, (torch.Tensor, str, int, float, bool))


def test_state_dict_round_trip_through_torch_save_weights_only():
    net = Net(seed=0)
    engine = _engine(_pins_for_state(), net)
    _activate_all(engine)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.5)
    engine.restore()
    target_b_idx = [i for i in range(6) if net.b[i].item() == Net(seed=0).b[i].item()]
    assert len(target_b_idx) == 3
    state = engine.state_dict()
    assert _only_plain_types(state)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)

    fresh = Net(seed=1)  # other weights: the targets must come from the state, not from these
    engine2 = _engine(_pins_for_state(), fresh)
    engine2.load_state_dict(loaded)
    assert engine2.active == engine.active == frozenset({0, 1, 2})
    assert engine2.last_step_active == engine.last_step_active
    engine2.force()
    original = Net(seed=0)
    assert torch.equal(fresh.c.detach(), original.c.detach())
    assert torch.equal(fresh.b.detach()[target_b_idx], original.b.detach()[target_b_idx])
    assert torch.equal(torch.stack([fresh.a.detach()[c] for c in A_PINNED]), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert engine2.violations() == []
    # The same pins stay active: no fresh capture from the new weights.
    assert engine2.set_active(engine2.ids_at(0)) == []
    with torch.no_grad():
        fresh.c.add_(1.0)
    engine2.restore()
    assert torch.equal(fresh.c.detach(), original.c.detach())
    # The pin that had not started captures when it starts, from the weights at that time.
    assert engine2.set_active(engine2.ids_at(5)) == [3]
    assert fresh.a[0, 4].item() == Net(seed=1).a[0, 4].item()
    # And saving again gives the same state.
    again = engine2.state_dict()
    for old, new in zip(state["pins"][:3], again["pins"][:3]):
        for name in old:
            assert torch.equal(old[name]["target"], new[name]["target"])


@pytest.mark.parametrize(
    "other_pins",
    [
        pytest.param(lambda p: [p[0], Pin("b", fraction=0.5, seed=2), p[2], p[3]], id="other-seed"),
        pytest.param(lambda p: [Pin("a", indices=A_PINNED, value=[1.0, 2.0, 3.0, 5.0]), *p[1:]], id="other-value"),
        pytest.param(lambda p: p[:3], id="fewer-pins"),
        pytest.param(lambda p: [p[0], Pin("b", fraction=0.5, seed=1), Pin(["c", "b"]), p[3]], id="other-params"),
    ],
)
def test_load_state_dict_with_a_mismatching_plan(other_pins):
    net = Net()
    engine = _engine(_pins_for_state(), net)
    _activate_all(engine)
    state = engine.state_dict()
    net2 = Net(seed=4)
    before = {n: p.detach().clone() for n, p in net2.named_parameters()}
    strict_engine = _engine(other_pins(_pins_for_state()), net2)
    with pytest.raises(PinError, match="does not match"):
        strict_engine.load_state_dict(state)
    assert all(torch.equal(p.detach(), before[n]) for n, p in net2.named_parameters())

    loose = _engine(other_pins(_pins_for_state()), net2)
    messages = []
    loose.load_state_dict(state, strict=False, warn=messages.append)
    assert messages and all("strict=False" in m for m in messages)
    # The mismatching pins start afresh (they are not active, nothing is captured for them);
    # the matching ones keep their saved state.
    same = [
        i
        for i, (p, q) in enumerate(zip(_pins_for_state(), other_pins(_pins_for_state())))
        if p.fingerprint() == q.fingerprint()
    ]
    assert loose.active == frozenset(i for i in same if i in engine.active)
    assert set(loose.captured) <= set(same)


def test_load_state_dict_non_strict_warns_by_default():
    engine = _engine(_pins_for_state(), Net())
    _activate_all(engine)
    state = engine.state_dict()
    other = _engine([Pin("a", indices=A_PINNED, value=[1.0, 2.0, 3.0, 5.0]), *_pins_for_state()[1:]], Net(seed=2))
    with pytest.warns(UserWarning, match="strict=False"):
        other.load_state_dict(state, strict=False)


def test_stopping_a_forced_element_inside_a_frozen_tensor_stays_consistent():
    net = Net()
    engine = _engine([Pin("b"), Pin("b", indices=[3], value=1.5, stop_step=2)], net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    handles = engine.attach([opt])
    held = []
    for step in range(4):
        _activate_all(engine, step)
        opt.zero_grad()
        net.loss().backward()
        engine.mask_grads(opt)
        opt.step()
        held.append(net.b[3].item())
        assert engine.violations() == [], (step, [str(v) for v in engine.violations()])
    assert held[0] == held[1] == 1.5
    assert held[2] == held[3]  # whatever the target after the stop is, it stays put
    handles[0].remove()
