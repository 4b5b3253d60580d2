"""lightning_pin.faults: seeded stuck-at cells and stuck bits as ordinary pins, held exactly in training."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pin import Pin, PinError, pin
from lightning_pin.core.plan import resolve
from lightning_pin.faults import FaultPins, bit_faults, cell_faults


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


def test_cell_faults_stick_a_rate_of_the_cells_at_zero_or_signed_high():
    net = Net()
    pins = cell_faults(net, "*.weight", rate=0.1, seed=3)
    assert isinstance(pins, FaultPins) and isinstance(pins, list)
    assert set(by_name(pins)) == {"conv.weight", "fc.weight"}
    for name, p in by_name(pins).items():
        weights = net.get_parameter(name).detach()
        index = flat_index(p, weights.shape)
        assert torch.equal(index, index.unique())  # sorted, distinct
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


def test_cell_faults_are_nested_across_rates():
    """Common random numbers for a rate sweep: a higher rate keeps every fault of a lower one, unchanged."""
    net = Net()
    previous = {}
    for rate in (0.01, 0.05, 0.1, 0.13, 0.3, 0.6, 1.0):  # across any sparse / dense boundary of the draw
        (p,) = cell_faults(net, "fc.weight", rate=rate, seed=9)
        current = dict(zip(flat_index(p, (10, 144)).tolist(), p.value.tolist()))
        assert len(current) == round(rate * 1440)
        assert all(current[cell] == value for cell, value in previous.items())
        previous = current


def test_cell_faults_cells_are_uniform():
    module = nn.Module()
    module.w = nn.Parameter(torch.ones(100, 100))
    hits = torch.zeros(100, 100)
    for seed in range(20):
        (p,) = cell_faults(module, "w", rate=0.1, seed=seed)
        hits[tuple(p.indices.T)] += 1
    # 20 draws of 1,000 cells: every row and column near 200 hits (binomial sd ~13.4).
    assert float((hits.sum(dim=1) - 200).abs().max()) < 5 * 13.4
    assert float((hits.sum(dim=0) - 200).abs().max()) < 5 * 13.4


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


def test_fault_pins_travel_to_spawned_processes_with_their_summary():
    import pickle

    pins = bit_faults(Net(), "*.weight", rate=0.01, seed=2)
    again = pickle.loads(pickle.dumps(pins))  # ddp_spawn pickles the callback and its pins
    assert type(again) is FaultPins and again.summary == pins.summary and again.faulty == pins.faulty
    assert [p.fingerprint() for p in again] == [p.fingerprint() for p in pins]


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


# ----------------------------------------------------------------------------------------------
# bit_faults

WORDS = {torch.float32: (32, 23), torch.bfloat16: (16, 7), torch.float16: (16, 10), torch.float64: (64, 52)}


def stuck_pairs(p: Pin) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks of a stuck-bit pin as int64 with only the word's bits (undoing the signed view)."""
    width = {torch.int16: 16, torch.int32: 32, torch.int64: 64}[p.stuck_at_zero.dtype]
    keep = (1 << width) - 1 if width < 64 else -1
    return p.stuck_at_zero.to(torch.int64) & keep, p.stuck_at_one.to(torch.int64) & keep


def bits_of(mask: torch.Tensor, width: int) -> torch.Tensor:
    """(k, width) bool: which bits each mask has."""
    positions = torch.arange(width, dtype=torch.int64)
    return (mask.unsqueeze(1).bitwise_right_shift(positions) & 1).bool()


@pytest.mark.parametrize("dtype", list(WORDS), ids=str)
@pytest.mark.parametrize("which", ["sign", "exponent", "mantissa", None, [0, 3]])
def test_bit_faults_stick_only_the_chosen_bits_of_the_dtype(dtype, which):
    width, mantissa = WORDS[dtype]
    allowed = {
        "sign": {width - 1},
        "exponent": set(range(mantissa, width - 1)),
        "mantissa": set(range(mantissa)),
        None: set(range(width)),
    }.get(which, {0, 3}) if not isinstance(which, list) else {0, 3}
    net = nn.Linear(64, 32).to(dtype)
    pins = bit_faults(net, "weight", rate=0.05, bits=which, seed=2)
    (p,) = pins
    assert p.stuck_at_zero.dtype == p.stuck_at_one.dtype == {16: torch.int16, 32: torch.int32, 64: torch.int64}[width]
    zero, one = stuck_pairs(p)
    assert not bool((zero & one).any())  # no bit stuck both ways
    stuck = bits_of(zero | one, width)
    assert bool(stuck.any(dim=1).all())  # every listed element has a stuck bit
    assert {int(b) for b in stuck.any(dim=0).nonzero().squeeze(1)} <= allowed
    index = flat_index(p, (32, 64))
    assert torch.equal(index, index.unique())  # sorted, distinct
    assert pins.faulty == {"weight": index.numel()}


@pytest.mark.parametrize(
    ("numel", "rate"),
    [(20_000, 1e-3), (20_000, 0.2), (40_000, 1e-3), (40_000, 0.05)],  # a draw per pair; a binomial, then pairs
)
def test_bit_faults_are_a_bit_error_rate(numel, rate):
    module = nn.Module()
    module.w = nn.Parameter(torch.zeros(numel))
    (p,) = bit_faults(module, "w", rate=rate, one_fraction=0.25, seed=11)
    zero, one = stuck_pairs(p)
    ones, zeros = bits_of(one, 32), bits_of(zero, 32)
    pairs = numel * 32
    stuck = int(ones.sum() + zeros.sum())
    sigma = (pairs * rate * (1 - rate)) ** 0.5
    assert abs(stuck - pairs * rate) < 5 * sigma
    assert abs(int(ones.sum()) - 0.25 * stuck) < 5 * (stuck * 0.25 * 0.75) ** 0.5
    # Uniform over positions and elements: every bit position and both halves of the tensor get their share.
    per_bit = (ones | zeros).sum(dim=0).double()
    assert bool((per_bit - pairs / 32 * rate).abs().lt(5 * (pairs / 32 * rate) ** 0.5 + 3).all())
    index = flat_index(p, (numel,))
    first_half = int((index < numel // 2).sum())
    assert abs(first_half - index.numel() / 2) < 5 * (index.numel() / 4) ** 0.5 + 2


@pytest.mark.parametrize("numel", [1_000, 40_000])  # a draw per pair; a binomial, then a stream of pairs
def test_bit_faults_are_nested_across_rates(numel):
    """Common random numbers for a rate sweep: a higher rate keeps every stuck bit of a lower one, reading the same."""
    module = nn.Module()
    module.w = nn.Parameter(torch.zeros(numel))
    previous = torch.zeros(0, dtype=torch.int64)
    for rate in (1e-4, 1e-3, 5e-3, 0.05, 0.3):
        (p,) = bit_faults(module, "w", rate=rate, seed=6)
        element = flat_index(p, (numel,))
        codes = []  # (element * 32 + bit) * 2 + reads-one, per stuck bit
        for reads_one, mask in enumerate(stuck_pairs(p)):
            row, bit = bits_of(mask, 32).nonzero().unbind(1)
            codes.append((element[row] * 32 + bit) * 2 + reads_one)
        current = torch.cat(codes)
        assert bool(torch.isin(previous, current).all()) and current.numel() > previous.numel()
        previous = current


def test_bit_faults_are_seeded_by_seed_and_name_only():
    net = nn.Linear(64, 32)
    a = bit_faults(net, "*", rate=0.01, seed=4)
    torch.manual_seed(99)
    b = bit_faults(net, "*", rate=0.01, seed=4)
    c = bit_faults(net, "*", rate=0.01, seed=5)
    assert [p.fingerprint() for p in a] == [p.fingerprint() for p in b]
    assert a[0].fingerprint() != c[0].fingerprint()
    # Drawn from the name, not from the module's weights: another module with the same names draws the same faults.
    assert [p.fingerprint() for p in bit_faults(nn.Linear(64, 32), "*", rate=0.01, seed=4)] == [
        p.fingerprint() for p in a
    ]


def test_bit_faults_keep_patterns_that_would_read_inf_or_nan_finite_by_their_last_exponent_bit():
    """A pattern whose stuck bits alone read inf / NaN (every exponent bit stuck at one) has the exponent bit
    drawn last read zero: nothing is skipped, and (unlike re-drawing all its polarities) the draws stay nested."""
    module = nn.Module()
    module.w = nn.Parameter(torch.zeros(4096))
    # Every exponent bit stuck: at one_fraction 0.5, 1 in 256 elements first draws all of them at one.
    pins = bit_faults(module, "w", rate=1.0, bits="exponent", seed=0)
    zero, one = stuck_pairs(pins[0])
    assert torch.equal(zero | one, torch.full((4096,), 0x7F800000))  # nothing skipped
    assert not bool((one == 0x7F800000).any())
    assert 0 < pins.redrawn < 60 and pins.skipped == 0
    assert f"{pins.redrawn} re-drawn, 0 skipped" in pins.summary
    # At one_fraction 1 every element would read inf: each keeps exactly one exponent bit at zero.
    ones = bit_faults(module, "w", rate=1.0, bits="exponent", one_fraction=1.0)
    zero, one = stuck_pairs(ones[0])
    assert ones.redrawn == 4096 and ones.skipped == 0
    assert torch.equal(zero | one, torch.full((4096,), 0x7F800000))
    assert bool((bits_of(zero, 32).sum(dim=1) == 1).all())
    # Stuck mantissa bits do not save an element whose exponent reads all ones: the same rule.
    some = bit_faults(module, "w", rate=1.0, bits=["exponent", "mantissa"], one_fraction=1.0)
    zero, one = stuck_pairs(some[0])
    assert some.redrawn == 4096 and bool(((zero & 0x7F800000) != 0).all())


@pytest.mark.parametrize("one_fraction", [0.5, 0.9, 1.0])
def test_bit_faults_stay_nested_where_patterns_are_kept_finite(one_fraction):
    """The case that re-drawing polarities broke: exponent bits at a high one_fraction. Every stuck bit of a lower
    rate is stuck at a higher one, reading the same, while the words stay finite."""
    module = nn.Module()
    module.w = nn.Parameter(torch.zeros(3000))
    previous: dict[tuple[int, int], int] = {}
    for rate in (0.2, 0.5, 0.8, 0.95, 1.0):
        pins = bit_faults(module, "w", rate=rate, bits="exponent", one_fraction=one_fraction, seed=3)
        (p,) = pins
        element = flat_index(p, (3000,))
        current = {}
        for reads_one, mask in enumerate(stuck_pairs(p)):
            row, bit = bits_of(mask, 32).nonzero().unbind(1)
            current.update({(int(e), int(b)): reads_one for e, b in zip(element[row], bit)})
        assert all(current.get(pair) == reads for pair, reads in previous.items())
        assert not bool((stuck_pairs(p)[1] == 0x7F800000).any())
        previous = current
    assert pins.redrawn > 0  # the rule was exercised



@contextlib.contextmanager
def counting_randint():
    """The numbers of random numbers each torch.randint call in the block draws (every draw goes through it)."""
    drawn: list[int] = []
    real = torch.randint

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        drawn.append(out.numel())
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "randint", counting)
        yield drawn

@pytest.mark.parametrize("numel", [1_000, 200_000])
def test_bit_faults_draw_in_time_of_their_faults(numel):
    """Drawing grows with the number of stuck bits, not of (element, bit) pairs: the generator draws about
    as many random numbers as there are faults (counted on torch.randint, which every draw goes through)."""
    module = nn.Module()
    module.w = nn.Parameter(torch.zeros(numel))
    with counting_randint() as drawn:
        (p,) = bit_faults(module, "w", rate=1e-4, seed=1)
    stuck = int(bits_of(stuck_pairs(p)[0] | stuck_pairs(p)[1], 32).sum())
    assert 0 < sum(drawn) <= 1.1 * stuck + 200


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=0, max_size=3),
    dtype=st.sampled_from(list(WORDS)),
    rate=st.sampled_from([0.0, 1e-3, 0.03, 0.3, 1.0]),
    positions=st.one_of(st.none(), st.sampled_from(["sign", "exponent", "mantissa"]), st.sets(st.integers(0, 15))),
    one_fraction=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**40),
)
def test_bit_faults_property(shape, dtype, rate, positions, one_fraction, seed):
    if positions is not None and not isinstance(positions, str) and not positions:
        positions = None
    module = nn.Module()
    module.w = nn.Parameter(torch.randn(shape).to(dtype))
    pins = bit_faults(module, "w", rate=rate, bits=positions, one_fraction=one_fraction, seed=seed)
    width, mantissa = WORDS[dtype]
    exponent = ((1 << (width - 1 - mantissa)) - 1) << mantissa
    assert pins.faulty["w"] == sum(len(p.indices) for p in pins)
    for p in pins:
        zero, one = stuck_pairs(p)
        assert not bool((zero & one).any()) and bool(((zero | one) != 0).all())
        assert not bool(((one & exponent) == exponent).any())  # never inf / NaN by stuck bits alone
        assert p.indices.shape[1] == len(shape)
        resolve(pins, module)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bits": 16}, r"bit 16 is outside the 16-bit word of torch.bfloat16 of 'w'"),
        ({"bits": [-1]}, r"bit -1 is outside the 16-bit word"),
        ({"bits": "fraction"}, "bits 'fraction' is not one of 'sign', 'exponent', 'mantissa'"),
        ({"bits": [1.5]}, "bits must be None, 'sign', 'exponent', 'mantissa' or ints"),
        ({"bits": []}, "bits names no bit position"),
        ({"one_fraction": -0.5}, r"one_fraction must be a number in \[0, 1\]"),
        ({"rate": 2}, r"rate must be a number in \[0, 1\]"),
    ],
)
def test_bit_faults_refuse_bad_input(kwargs, match):
    module = nn.Module()
    module.w = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(PinError, match=match):
        bit_faults(module, "w", **{"rate": 0.1, **kwargs})


def test_bit_faults_refuse_words_without_a_stuck_bit_model():
    module = nn.Module()
    module.w = nn.Parameter(torch.zeros(3, dtype=torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(PinError, match="'w' is torch.float8_e4m3fn; stuck bits are modelled for torch.float64"):
        bit_faults(module, "w", rate=0.1)


def held_bits(p: Pin, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(stuck bits as they read in the weights, free bits) of a stuck-bit pin's elements."""
    words = weights.detach().reshape(-1).view(p.stuck_at_zero.dtype)[flat_index(p, tuple(weights.shape))]
    stuck = p.stuck_at_zero | p.stuck_at_one
    return words & stuck, words & ~stuck


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bit_faults_hold_bit_for_bit_while_the_free_bits_train(dtype):
    torch.manual_seed(0)
    net = Net().to(dtype)
    pins = bit_faults(net, "*.weight", rate=0.02, bits=["sign", "exponent", "mantissa"], seed=3)
    free_before = {p.params: held_bits(p, net.get_parameter(p.params))[1] for p in pins}
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    with pin(net, optimizer, pins) as handle:
        for _ in range(4):
            x = torch.randn(8, 1, 8, 8, dtype=dtype)
            nn.functional.cross_entropy(net(x).float(), torch.randint(0, 10, (8,))).backward()
            optimizer.step()
            optimizer.zero_grad()
            for p in pins:
                stuck, _ = held_bits(p, net.get_parameter(p.params))
                assert torch.equal(stuck, p.stuck_at_one)  # every stuck bit reads what it is stuck at
        handle.verify()
    for p in pins:
        _, free = held_bits(p, net.get_parameter(p.params))
        assert not torch.equal(free, free_before[p.params])  # the other bits of the same elements trained


def test_bit_and_cell_faults_hold_under_pin_callback():
    import lightning as L

    from lightning_pin import PinCallback

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    lit = Lit()
    pins = bit_faults(lit, "net.conv.weight", rate=0.05, seed=1) + cell_faults(lit, "net.fc.weight", rate=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,)))
    callback = PinCallback(pins, verbose=False, monitor=False)
    L.Trainer(
        max_steps=4, callbacks=[callback], enable_progress_bar=False, logger=False, enable_checkpointing=False,
        enable_model_summary=False,
    ).fit(lit, torch.utils.data.DataLoader(data, batch_size=8))
    callback.verify(lit)
    bits, cells = pins[0], pins[1]
    stuck, _ = held_bits(bits, lit.net.conv.weight)
    assert torch.equal(stuck, bits.stuck_at_one)
    assert torch.equal(lit.net.fc.weight.detach()[tuple(cells.indices.T)], cells.value)


@pytest.mark.parametrize("generator", ["cell", "flip"])
def test_cell_faults_and_flip_bits_draw_in_time_of_their_faults(generator):
    """As bit_faults: about as many random numbers as faults, however large the parameter."""
    from lightning_pin.faults import flip_bits

    module = nn.Module()
    module.w = nn.Parameter(torch.ones(1_000_000))
    with counting_randint() as drawn:
        if generator == "cell":
            faults = cell_faults(module, "w", rate=1e-4, seed=1).faulty["w"]
        else:
            faults = flip_bits(module, "w", rate=1e-5, seed=1).flipped["w"]
    assert faults > 50 and 0 < sum(drawn) <= 1.1 * faults + 200
