"""lightning_pin.faults: seeded stuck-at cells and stuck bits as ordinary pins, held exactly in training."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pin import Pin, PinError, pin
from lightning_pin.core.plan import resolve
from lightning_pin.faults import FaultPins, cell_faults


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def flat_index(p: Pin, shape) -> torch.Tensor:
    """The row-major flat indices a generated pin selects."""
    strides = torch.tensor([int(torch.tensor(shape[d + 1:]).prod()) for d in range(len(shape))])
    return (p.indices * strides).sum(dim=1)


def by_name(pins) -> dict[str, Pin]:
    return {p.params: p for p in pins}


# ----------------------------------------------------------------------------------------------
# cell_faults


def test_cell_faults_pick_the_cells_a_fraction_pin_picks_and_read_zero_or_signed_high():
    net = Net()
    pins = cell_faults(net, "*.weight", rate=0.1, seed=3)
    assert isinstance(pins, FaultPins) and isinstance(pins, list)
    assert set(by_name(pins)) == {"conv.weight", "fc.weight"}
    plan = resolve([Pin("*.weight", fraction=0.1, seed=3)], net)
    for name, p in by_name(pins).items():
        weights = net.get_parameter(name).detach()
        index = flat_index(p, weights.shape)
        assert torch.equal(index, plan.pins[0].selections[name].index.to(torch.int64))
        assert pins.faulty[name] == round(0.1 * weights.numel()) == index.numel()
        high = weights.abs().max()
        drawn = weights.reshape(-1)[index]
        sa1 = p.value != 0
        assert p.value.dtype == weights.dtype
        assert torch.equal(p.value[sa1], torch.copysign(high.expand(int(sa1.sum())), drawn[sa1]))
        assert 0 < int(sa1.sum()) < index.numel()  # both kinds drawn at sa1_fraction 0.5
    assert "fc.weight: 144 of 1,440 cells stuck" in pins.summary


def test_cell_faults_are_seeded_by_seed_and_name_only():
    torch.manual_seed(1)
    a = Net()
    again = cell_faults(a, "fc.weight", rate=0.05, seed=7)
    torch.manual_seed(123)  # the global RNG plays no part
    same = cell_faults(a, "fc.weight", rate=0.05, seed=7)
    other = cell_faults(a, "fc.weight", rate=0.05, seed=8)
    assert torch.equal(again[0].indices, same[0].indices) and torch.equal(again[0].value, same[0].value)
    assert not torch.equal(again[0].indices, other[0].indices)
    assert again[0].fingerprint() == same[0].fingerprint()


def test_cell_faults_sa1_fraction_and_high():
    net = Net()
    zeros = cell_faults(net, "fc.weight", rate=0.2, sa1_fraction=0.0)[0]
    assert torch.equal(zeros.value, torch.zeros(288))
    ones = cell_faults(net, "fc.weight", rate=0.2, sa1_fraction=1.0, high=0.1)[0]
    signs = net.fc.weight.detach().reshape(-1)[flat_index(ones, (10, 144))].sign()
    # 0.1 as float32 (the parameter's dtype), not as float64: pinned exactly as drawn.
    assert torch.equal(ones.value, signs * torch.tensor(0.1, dtype=torch.float32))
    # The same cells whatever sa1_fraction: the kind of each cell is drawn on its own stream.
    assert torch.equal(zeros.indices, ones.indices)


def test_cell_faults_sa1_of_a_zero_weight_reads_high_with_the_zero_sign():
    net = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        net.weight.copy_(torch.tensor([[0.0, -0.0, 2.0, -3.0]]))
    p = cell_faults(net, "weight", rate=1.0, sa1_fraction=1.0)[0]
    assert torch.equal(p.value, torch.tensor([3.0, -3.0, 3.0, -3.0]))
    assert torch.equal(p.value.signbit(), torch.tensor([False, True, False, True]))


def test_cell_faults_rate_zero_and_rates_that_round_to_zero_draw_nothing():
    net = Net()
    assert cell_faults(net, "*", rate=0.0) == []
    pins = cell_faults(net, "*", rate=0.02)  # 36 conv weights, 4 and 10 biases: under one fault each
    assert set(by_name(pins)) == {"conv.weight", "fc.weight"}
    assert pins.faulty == {"conv.weight": 1, "conv.bias": 0, "fc.weight": 29, "fc.bias": 0}
    assert "fc.bias: no faulty cell (0.02 of 10 rounds to 0)" in pins.summary


def test_cell_faults_keep_half_precision_values_exact():
    net = Net().to(torch.bfloat16)
    p = cell_faults(net, "conv.weight", rate=0.5, sa1_fraction=1.0, high=0.3)[0]
    assert p.value.dtype == torch.bfloat16
    assert set(p.value.abs().tolist()) == {torch.tensor(0.3, dtype=torch.bfloat16).item()}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"params": "nope.*", "rate": 0.1}, "matches no parameter"),
        ({"params": "*", "rate": 1.5}, r"rate must be a number in \[0, 1\]"),
        ({"params": "*", "rate": -0.1}, r"rate must be a number in \[0, 1\]"),
        ({"params": "*", "rate": True}, r"rate must be a number in \[0, 1\]"),
        ({"params": "*", "rate": 0.1, "sa1_fraction": 2}, r"sa1_fraction must be a number in \[0, 1\]"),
        ({"params": "*", "rate": 0.1, "high": 0.0}, "high must be None or a finite number > 0"),
        ({"params": "*", "rate": 0.1, "high": float("inf")}, "high must be None or a finite number > 0"),
        ({"params": "*", "rate": 0.1, "seed": 0.5}, "seed must be an integer"),
    ],
)
def test_cell_faults_refuse_bad_input(kwargs, match):
    with pytest.raises(PinError, match=match):
        cell_faults(Net(), **kwargs)


def test_cell_faults_refuse_integer_parameters_and_unrepresentable_high():
    net = Net()
    net.steps = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    with pytest.raises(PinError, match=r"steps \(torch.int64\) is not floating point"):
        cell_faults(net, "*", rate=0.5)
    with pytest.raises(PinError, match="overflows torch.float16"):
        cell_faults(Net().half(), "fc.weight", rate=0.5, high=1e6)


def test_cell_faults_names_with_glob_characters_are_matched_exactly():
    net = nn.Module()
    net.register_parameter("w[0]", nn.Parameter(torch.ones(4)))
    net.register_parameter("w0", nn.Parameter(torch.ones(4)))
    pins = cell_faults(net, "w[[]0]", rate=0.5)
    assert len(pins) == 1
    assert list(resolve(pins, net).parameters) == ["w[0]"]


def test_cell_faults_hold_exactly_while_the_rest_trains():
    torch.manual_seed(0)
    net = Net()
    pins = cell_faults(net, "*.weight", rate=0.1, seed=1)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1)
    with pin(net, optimizer, pins) as handle:
        for _ in range(4):
            nn.functional.cross_entropy(net(torch.randn(8, 1, 8, 8)), torch.randint(0, 10, (8,))).backward()
            optimizer.step()
            optimizer.zero_grad()
            for p in pins:
                weights = net.get_parameter(p.params).detach()
                assert torch.equal(weights.reshape(-1)[flat_index(p, weights.shape)], p.value)
        handle.verify()
    assert not torch.equal(before["fc.weight"], net.fc.weight)  # the free cells trained


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 7), min_size=0, max_size=3),
    rate=st.floats(0.0, 1.0),
    sa1=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31),
)
def test_cell_faults_property(shape, rate, sa1, seed):
    module = nn.Module()
    module.w = nn.Parameter(torch.randn(shape))
    pins = cell_faults(module, "w", rate=rate, sa1_fraction=sa1, seed=seed)
    count = round(rate * module.w.numel())
    assert len(pins) == (1 if count else 0) and pins.faulty == {"w": count}
    if count:
        p = pins[0]
        drawn = module.w.detach().reshape(-1)[flat_index(p, tuple(shape))] if shape else module.w.detach().reshape(-1)
        assert p.indices.shape == (count, len(shape))
        high = module.w.detach().abs().max()
        assert bool(((p.value == 0) | (p.value == torch.copysign(high, drawn))).all())
        if sa1 == 0:
            assert not bool(p.value.ne(0).any())
        resolve(pins, module)  # an ordinary pin that resolves on the module it was drawn for


def test_generators_draw_the_same_faults_in_a_fresh_process(tmp_path):
    code = (
        "import torch; from torch import nn; from lightning_pin.faults import cell_faults\n"
        "torch.manual_seed(0); net = nn.Linear(64, 32)\n"
        f"torch.save((net.state_dict(), list(cell_faults(net, '*', rate=0.1, seed=5))), {str(tmp_path / 'a.pt')!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    state, theirs = torch.load(tmp_path / "a.pt", weights_only=False)
    net = nn.Linear(64, 32)
    net.load_state_dict(state)
    ours = cell_faults(net, "*", rate=0.1, seed=5)
    assert [p.fingerprint() for p in ours] == [p.fingerprint() for p in theirs]


def test_faults_module_imports_no_lightning():
    code = "import sys, lightning_pin.faults; print([m for m in sys.modules if m.split('.')[0] == 'lightning'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"
