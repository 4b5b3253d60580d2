"""flip_bits: transient flips written on entry and undone exactly on exit; forced_patch and changed_bits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pin import PinError
from lightning_pin.core.engine import PinEngine
from lightning_pin.core.plan import resolve
from lightning_pin.faults import bit_faults, cell_faults, changed_bits, flip_bits, forced_patch

WIDTH = {torch.float32: 32, torch.bfloat16: 16, torch.float16: 16, torch.float64: 64}
INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float64: torch.int64}


def words(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone().view(-1).view(INT[p.dtype]) for n, p in module.named_parameters()}


def popcount(x: torch.Tensor, width: int) -> int:
    x = x.to(torch.int64)
    return int(sum(((x >> b) & 1).sum() for b in range(width)))


@pytest.mark.parametrize("dtype", list(WIDTH), ids=str)
def test_flip_bits_flip_exactly_the_drawn_positions_and_restore_every_word(dtype):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 4)).to(dtype)
    before = words(net)
    flips = flip_bits(net, "*.weight", rate=0.02, seed=3)
    assert torch.equal(words(net)["0.weight"], before["0.weight"])  # drawing changes nothing
    with flips:
        inside = words(net)
    for name in ("0.weight", "1.weight"):
        positions = flips.positions[name]
        assert positions.shape[1] == 2 and positions.shape[0] == flips.flipped[name] > 0
        expected = before[name].clone().to(torch.int64)
        for element, bit in positions.tolist():
            expected[element] ^= 1 << bit
        assert torch.equal(inside[name], expected.to(INT[dtype]))  # exactly those bits, nothing else
    assert torch.equal(inside["0.bias"], before["0.bias"])
    assert all(torch.equal(words(net)[n], before[n]) for n in before)  # restored, bit for bit
    assert flips.changed_bits == sum(flips.flipped.values())
    assert "flipped bits" in flips.summary


def test_flip_bits_restore_even_when_the_evaluation_raises_and_after_nan_payloads():
    net = nn.Linear(8, 8)
    with torch.no_grad():
        net.weight.view(-1)[:3] = torch.tensor([float("nan"), -0.0, float("inf")])
        net.weight.view(-1).view(torch.int32)[0] = 0x7FC00123  # a NaN with a payload
    before = words(net)
    flips = flip_bits(net, "weight", rate=0.3, seed=0)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        with flips:
            assert not torch.equal(words(net)["weight"], before["weight"])
            raise RuntimeError("evaluation failed")
    assert all(torch.equal(words(net)[n], before[n]) for n in before)
    with flips:  # and it can be entered again
        pass
    assert all(torch.equal(words(net)[n], before[n]) for n in before)


def test_flip_bits_hit_the_pairs_bit_faults_sticks_and_are_nested_across_rates():
    net = nn.Linear(64, 32)
    previous = set()
    for rate in (1e-3, 0.01, 0.1, 0.6):
        flips = flip_bits(net, "weight", rate=rate, bits="exponent", seed=5)
        current = {tuple(r) for r in flips.positions["weight"].tolist()}
        assert previous <= current and len(current) > len(previous)
        previous = current
        (stuck,) = bit_faults(net, "weight", rate=rate, bits="exponent", seed=5)
        mask = (stuck.stuck_at_zero.to(torch.int64) | stuck.stuck_at_one.to(torch.int64)) & 0xFFFFFFFF
        strides = torch.tensor([64, 1])
        pairs = {(int(e), b) for e, m in zip((stuck.indices * strides).sum(1).tolist(), mask.tolist())
                 for b in range(32) if m >> b & 1}
        assert pairs == current  # one seed: the same (element, bit) pairs stuck or flipped


def test_flip_bits_refuse_as_bit_faults():
    net = nn.Linear(4, 4)
    with pytest.raises(PinError, match=r"rate must be a number in \[0, 1\]"):
        flip_bits(net, "weight", rate=1.5)
    with pytest.raises(PinError, match="seed must be an integer >= 0"):
        flip_bits(net, "weight", rate=0.1, seed=-1)
    module = nn.Module()
    module.steps = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    with pytest.raises(PinError, match="not floating point"):
        flip_bits(module, "steps", rate=0.1)
    with pytest.raises(PinError, match="outside the 32-bit word"):
        flip_bits(net, "weight", rate=0.1, bits=40)
    flips = flip_bits(net, "weight", rate=0.5)
    with flips, pytest.raises(PinError, match="already in the weights"):
        flips.__enter__()


def test_bit_faults_refuse_a_negative_seed_and_cell_faults_sa1_on_an_all_zero_parameter():
    net = nn.Linear(4, 4)
    with pytest.raises(PinError, match="seed must be an integer >= 0"):
        bit_faults(net, "weight", rate=0.1, seed=-1)
    with pytest.raises(PinError, match="seed must be an integer >= 0"):
        cell_faults(net, "weight", rate=0.1, seed=-1)
    zero = nn.Module()
    zero.w = nn.Parameter(torch.zeros(50))
    with pytest.raises(PinError, match="all zeros, so its SA1 cells would read ±0.0"):
        cell_faults(zero, "w", rate=0.5)
    # What the message offers works: no SA1 cells, or SA1 cells at an explicit magnitude.
    assert cell_faults(zero, "w", rate=0.5, sa1_fraction=0.0).faulty == {"w": 25}
    (p,) = cell_faults(zero, "w", rate=0.5, high=1.5)
    assert set(p.value.abs().tolist()) <= {0.0, 1.5} and bool((p.value.abs() == 1.5).any())


@pytest.mark.parametrize("kind", ["cell", "bit"])
def test_forced_patch_writes_what_the_engine_forces_and_counts_changed_bits(kind):
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(20, 10), nn.ReLU(), nn.Linear(10, 3))
    if kind == "cell":
        pins = cell_faults(net, "*.weight", rate=0.3, seed=2)
    else:
        pins = bit_faults(net, "*.weight", rate=0.05, seed=2)
    before = words(net)
    patch = forced_patch(net, pins)
    with patch:
        ours = words(net)
    assert all(torch.equal(words(net)[n], before[n]) for n in before)
    engine = PinEngine(resolve(list(pins), net))
    engine.set_active(range(len(pins)))
    engine.force()
    theirs = words(net)
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    direct = sum(popcount(before[n] ^ theirs[n], 32) for n in before)
    assert patch.changed_bits == direct > 0
    assert changed_bits(before["0.weight"], theirs["0.weight"]) == popcount(before["0.weight"] ^ theirs["0.weight"], 32)


def test_a_parameter_replaced_under_its_name_is_the_one_drawn_on():
    """The generators remember which parameters a pattern matched on a module (a campaign draws hundreds of times):
    a parameter replaced under the same name is matched again, not the stale one."""
    net = nn.Linear(8, 8)
    first = cell_faults(net, "weight", rate=0.5, seed=0)
    net.weight = nn.Parameter(torch.full((8, 8), 3.0))
    (again,) = cell_faults(net, "weight", rate=0.5, seed=0)
    assert torch.equal(first[0].indices, again.indices)  # the same cells (seeded by name) ...
    assert set(again.value.abs().tolist()) <= {0.0, 3.0}  # ... reading the new parameter's magnitude
    with flip_bits(net, "weight", rate=0.5, seed=0):
        assert not torch.equal(net.weight.detach(), torch.full((8, 8), 3.0))
    assert torch.equal(net.weight.detach(), torch.full((8, 8), 3.0))



def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))


def _patches(module: nn.Module, kinds: list[str], seed: int) -> list:
    """Patches that overlap on many elements: bit flips (XOR), stuck cells (values) and stuck bits (AND / OR)."""
    made = []
    for at, kind in enumerate(kinds):
        if kind == "flip":
            made.append(flip_bits(module, "*", rate=0.1, seed=seed + at))
        elif kind == "cell":
            made.append(forced_patch(module, cell_faults(module, "*", rate=0.5, seed=seed + at)))
        else:
            made.append(forced_patch(module, bit_faults(module, "*", rate=0.05, seed=seed + at)))
    return made


def _entered_in_order(kinds: list[str], seed: int, held: list[int]) -> dict[str, torch.Tensor]:
    """The words the patches ``held`` give, entered in their order on a fresh copy of the original weights."""
    module = _net(seed)
    patches = _patches(module, kinds, seed)
    for at in held:
        patches[at].__enter__()
    return words(module)


@settings(max_examples=40, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["flip", "cell", "bit"]), min_size=2, max_size=4),
    order=st.randoms(use_true_random=False),
    seed=st.integers(0, 1000),
)
def test_nested_patches_exited_in_any_order_restore_every_word_exactly(kinds, order, seed):
    """Nested flip_bits / forced patches exited out of order: after each exit the weights are what the patches
    still held give on the original weights (entered in their order), and after the last the original, bit for bit."""
    module = _net(seed)
    original = words(module)
    patches = _patches(module, kinds, seed)
    for patch in patches:
        patch.__enter__()
    held = list(range(len(patches)))
    exits = list(held)
    order.shuffle(exits)
    for at in exits:
        patches[at].__exit__(None, None, None)
        held.remove(at)
        now, want = words(module), _entered_in_order(kinds, seed, held)
        assert all(torch.equal(now[name], want[name]) for name in now), (kinds, exits, at)
    assert all(torch.equal(words(module)[name], original[name]) for name in original)


def test_two_flips_exited_outer_first_leave_the_original_words():
    module = nn.Linear(16, 8)
    original = words(module)
    outer, inner = flip_bits(module, "*", rate=0.2, seed=1), flip_bits(module, "*", rate=0.2, seed=2)
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)
    assert not torch.equal(words(module)["weight"], original["weight"])  # the inner flips are still in
    inner.__exit__(None, None, None)
    assert all(torch.equal(words(module)[name], original[name]) for name in original)
