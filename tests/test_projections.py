"""Stuck bits and bounds through the torch-native front door (``pin()`` in a plain loop), the plan's
refusals (no weight changed), the projections' kernels and checks, and their saved state.

Stuck bits are checked on integer views of the weights (``p.view(torch.int32)``), bounds by value,
after every optimizer step. The Lightning door is in test_projections_trainer.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pin import Pin, PinError, pin
from lightning_pin.core.engine import PinEngine
from lightning_pin.core.plan import resolve
from lightning_pin.core.kinds import Interval, StuckBits
from lightning_pin.core.sharding import Target

INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
SIGN = {torch.float32: 0x80000000, torch.bfloat16: 0x8000, torch.float16: 0x8000}
# One exponent bit and one mantissa bit per dtype: enough to change the value a lot and a little.
EXP_BIT = {torch.float32: 0x40000000, torch.bfloat16: 0x4000, torch.float16: 0x4000}
MANT_BIT = {torch.float32: 0x00400000, torch.bfloat16: 0x0040, torch.float16: 0x0200}


def signed(mask: int, dtype: torch.dtype) -> int:
    width = torch.iinfo(INT_OF[dtype]).bits
    return mask - (1 << width) if mask >= 1 << (width - 1) else mask


class Net(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)
        self.to(dtype)

    def forward(self, x):
        return self.head(torch.relu(self.enc(x)))


ELEMENTS = [(i, j) for i in range(0, 16, 2) for j in range(0, 8, 3)]  # 24 elements of enc.weight


def bit_pins(dtype: torch.dtype) -> tuple[list[Pin], torch.Tensor, torch.Tensor]:
    """Stuck bits on 24 elements of enc.weight: the sign stuck at 0 on all, and per element one of
    an exponent bit or a mantissa bit stuck at 1. Returns the pins and the masks (signed ints)."""
    ones = [EXP_BIT[dtype] if k % 2 else MANT_BIT[dtype] for k in range(len(ELEMENTS))]
    pins = [Pin("enc.weight", indices=ELEMENTS, stuck_at_zero=SIGN[dtype], stuck_at_one=ones)]
    zero = torch.full((len(ELEMENTS),), signed(SIGN[dtype], dtype), dtype=INT_OF[dtype])
    one = torch.tensor([signed(m, dtype) for m in ones], dtype=INT_OF[dtype])
    return pins, zero, one


def enc_bits(net: Net, dtype: torch.dtype) -> torch.Tensor:
    rows = torch.tensor([i for i, _ in ELEMENTS])
    cols = torch.tensor([j for _, j in ELEMENTS])
    return net.enc.weight.detach()[rows, cols].view(INT_OF[dtype])


def assert_bits_hold(bits: torch.Tensor, zero: torch.Tensor, one: torch.Tensor, where: str) -> None:
    assert torch.equal(bits & zero, torch.zeros_like(bits)), f"a bit stuck at 0 reads 1 {where}"
    assert torch.equal(bits & one, one), f"a bit stuck at 1 reads 0 {where}"


OPTIMIZERS = {
    "adamw_wd": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, foreach=False),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=0.05, fused=True),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=0.05, foreach=True),
}


def train(net: Net, opt: torch.optim.Optimizer, steps: int, after_step, dtype=torch.float32, accumulate: int = 2):
    """A plain loop with gradient accumulation and clipping; ``after_step(step)`` after every step."""
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        for _ in range(accumulate):
            x = torch.randn(16, 8, generator=g).to(dtype)
            y = torch.randint(0, 3, (16,), generator=g)
            (nn.functional.cross_entropy(net(x).float(), y) / accumulate).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        after_step(step)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_stuck_bits_hold_after_every_step_and_free_bits_train(optimizer):
    net = Net()
    opt = OPTIMIZERS[optimizer](net.parameters())
    pins, zero, one = bit_pins(torch.float32)
    before = enc_bits(net, torch.float32).clone()
    with pin(net, opt, pins) as handle:
        # Forced at activation: the first forward already sees the stuck bits.
        assert_bits_hold(enc_bits(net, torch.float32), zero, one, "before the first step")
        grads = []

        def check(step):
            assert_bits_hold(enc_bits(net, torch.float32), zero, one, f"after step {step}")

        orig_backward_hook = net.enc.weight.register_hook(lambda g: grads.append(g.detach().clone()))
        train(net, opt, 10, check)
        orig_backward_hook.remove()
        handle.verify()
    after = enc_bits(net, torch.float32)
    free = ~(zero | one)
    # Every bit-pinned element trained: its free bits moved.
    assert bool((((after ^ before) & free) != 0).all()), ((after ^ before) & free)
    # Their gradients were not masked, and their optimizer statistics were left to train.
    rows, cols = torch.tensor([i for i, _ in ELEMENTS]), torch.tensor([j for _, j in ELEMENTS])
    assert bool((torch.stack(grads)[:, rows, cols] != 0).any(0).all())
    state = opt.state[net.enc.weight]
    statistic = state["momentum_buffer"] if "momentum_buffer" in state else state["exp_avg_sq"]
    assert bool((statistic[rows, cols] != 0).all())
    if "exp_avg_sq" in state:
        assert not bool((state["exp_avg_sq"][rows, cols] == 1.0).any())  # not parked


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adamw_wd"])
def test_stuck_bits_on_half_precision_parameters(dtype, optimizer):
    net = Net(dtype)
    opt = OPTIMIZERS[optimizer](net.parameters())
    pins, zero, one = bit_pins(dtype)
    before = enc_bits(net, dtype).clone()
    with pin(net, opt, pins) as handle:
        assert_bits_hold(enc_bits(net, dtype), zero, one, "before the first step")
        train(net, opt, 8, lambda step: assert_bits_hold(enc_bits(net, dtype), zero, one, f"after step {step}"), dtype)
        handle.verify()
    changed = ((enc_bits(net, dtype) ^ before) & ~(zero | one)) != 0
    assert int(changed.sum()) >= len(ELEMENTS) // 2, changed  # half precision moves coarsely


def test_bounds_hold_after_every_step_and_elements_move_inside():
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.02, weight_decay=0.1)
    low = [-0.05 - 0.01 * k for k in range(8)]
    pins = [
        Pin("head.weight", bounds=(-0.03, 0.03)),  # a whole tensor, the same interval
        Pin("enc.bias", indices=list(range(8)), bounds=(low, math.inf)),  # one low bound per element
    ]
    start = net.head.weight.detach().clone().clamp(-0.03, 0.03)
    seen = []
    low_t = torch.tensor(low)

    def check(step):
        w, b = net.head.weight.detach(), net.enc.bias.detach()[:8]
        assert bool(((w >= -0.03) & (w <= 0.03)).all()), f"head.weight out of bounds after step {step}"
        assert bool((b >= low_t).all()), f"enc.bias below its bounds after step {step}"
        seen.append(w.clone())

    with pin(net, opt, pins) as handle:
        assert bool((net.head.weight.detach().abs() <= 0.03).all())  # forced at activation
        train(net, opt, 10, check)
        handle.verify()
    history = torch.stack(seen)
    inside = (history[-1].abs() < 0.03)
    assert int(inside.sum()) > 0 and not torch.equal(history[-1][inside], start[inside])
    assert bool((history[1:] != history[:-1]).any(0).any())  # bounded elements train


def test_bounds_on_integer_parameters_clamp_and_round_inwards():
    net = nn.Module()
    net.q = nn.Parameter(torch.arange(-5, 5, dtype=torch.int32), requires_grad=False)
    plan = resolve([Pin("q", bounds=(-2.5, 3.5))], net)
    selection = plan.pins[0].selections["q"]
    assert selection.low.tolist() == [-2] * 10 and selection.high.tolist() == [3] * 10
    engine = PinEngine(plan)
    engine.set_active({0})
    assert net.q.tolist() == [-2, -2, -2, -2, -1, 0, 1, 2, 3, 3]


def test_float_bounds_are_rounded_inwards():
    net = Net()
    plan = resolve([Pin("head.bias", bounds=(0.1, 0.3))], net)
    selection = plan.pins[0].selections["head.bias"]
    assert bool((selection.low.double() >= 0.1).all()) and bool((selection.high.double() <= 0.3).all())
    # float32(0.1) is above 0.1: kept; float32(0.3) is above 0.3: the next float32 below it.
    assert selection.low[0].item() == torch.tensor(0.1).item()
    assert selection.high[0].item() == torch.nextafter(torch.tensor(0.3), torch.tensor(0.0)).item()


# ----------------------------------------------------------------------------------------------
# Refused inputs: PinError before any weight changes (the front door; the Lightning door in the
# trainer tests)


def int_net() -> nn.Module:
    net = Net()
    net.codes = nn.Parameter(torch.zeros(4, dtype=torch.int32), requires_grad=False)
    net.flags = nn.Parameter(torch.zeros(4, dtype=torch.bool), requires_grad=False)
    return net


REFUSED = {
    "mask wider than float32": ([Pin("enc.weight", stuck_at_one=1 << 32)], "wider than torch.float32"),
    "mask wider than float16": ([Pin("enc.weight", stuck_at_zero=[0x1_0000])], None),
    "int64 tensor mask too wide": ([Pin("enc.bias", stuck_at_one=torch.full((16,), 1 << 33))], "wider"),
    "int64 tensor mask negative": ([Pin("enc.bias", stuck_at_one=torch.full((16,), -1))], "wider"),
    "masks on an int parameter": ([Pin("codes", stuck_at_one=1)], "torch.int32 parameter"),
    "masks on a bool parameter": ([Pin("flags", stuck_at_zero=1)], "torch.bool parameter"),
    "bounds on a bool parameter": ([Pin("flags", bounds=(0, 1))], "bounds need real numbers"),
    "exponent stuck at one": ([Pin("enc.weight", indices=[(1, 1)], stuck_at_one=0x7F800000)], "inf or NaN"),
    "exponent stuck by two pins": (
        [Pin("enc.weight", indices=[(1, 1)], stuck_at_one=0x7F000000),
         Pin("enc.weight", indices=[(1, 1), (2, 2)], stuck_at_one=0x00800000)],
        "together stick every exponent bit",
    ),
    "overlap across pins": (
        [Pin("enc.weight", stuck_at_zero=0x1), Pin("enc.weight", indices=[(3, 4)], stuck_at_one=0x3)],
        r"stick bits 0x00000001 of element \(3, 4\)",
    ),
    "overlap per element, from dicts by name": (
        [Pin("enc.bias", stuck_at_zero={"enc.bias": torch.ones(16, dtype=torch.int32)},
             stuck_at_one={"enc.bias": torch.arange(16, dtype=torch.int32) * 2 + (torch.arange(16) == 5).int()})],
        r"element \(5,\)",
    ),
    "value and stuck bits on one element": (
        [Pin("enc.weight"), Pin("enc.weight", indices=[(0, 0)], stuck_at_one=1)], "a value fixes every bit"
    ),
    "stuck bits and bounds on one element": (
        [Pin("enc.weight", indices=[(0, 0), (1, 1)], stuck_at_one=1), Pin("enc.weight", bounds=(-1, 1))],
        "clamping can undo a stuck bit",
    ),
    "disjoint bounds": (
        [Pin("head.bias", bounds=(0, 1)), Pin("head.bias", indices=[2], bounds=(1.5, 2))], "do not meet"
    ),
    "bounds overflow float32": ([Pin("head.bias", bounds=(-1e39, 0))], "overflow torch.float32"),
    "bounds outside int32": ([Pin("codes", bounds=(0, 2**40))], "outside torch.int32"),
    "no float32 in bounds": ([Pin("head.bias", bounds=(0.1, 0.1))], "no torch.float32 value lies"),
    "mask count": ([Pin("enc.weight", indices=[(0, 0), (1, 1)], stuck_at_one=[1, 2, 4])], "3 entries|shape \\(3,\\)"),
    "bounds count": ([Pin("head.bias", bounds=([0, 0], 1))], "bounds low"),
    "repeated element, different masks": (
        [Pin("enc.weight", indices=[(0, 0), (0, 0)], stuck_at_one=[1, 2])], "different stuck bits"
    ),
    "dict without the parameter": (
        [Pin("enc.bias", stuck_at_one={"head.bias": 1, "head.weight": 2})], "no entry for parameter"
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_before_any_weight_changes(case):
    pins, match = REFUSED[case]
    net = int_net()
    if case == "mask wider than float16":
        net.half()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
    with pytest.raises(PinError, match=match):
        pin(net, opt, pins)
    for key, value in net.state_dict().items():
        assert torch.equal(value, before[key]), key


# One check (fault_plan.check_masks_hold) serves one pin's masks and two pins' merged masks; each
# caller words its own message, pinned here in full.
MASKS_THAT_CANNOT_HOLD = {
    "overlap in one pin": (
        [Pin("enc.weight", indices=[(1, 2), (0, 3)], stuck_at_zero={"enc.weight": torch.tensor([1, 3])},
             stuck_at_one={"enc.weight": torch.tensor([2, 6])})],
        "stuck_at_zero and stuck_at_one overlap on element (0, 3) of 'enc.weight' (bits 0x00000002): a bit "
        "cannot be stuck at 0 and at 1",
    ),
    "every exponent bit in one pin": (
        [Pin("enc.weight", indices=[(1, 1)], stuck_at_one={"enc.weight": torch.tensor([0x7F800001])})],
        "stuck_at_one=0x7f800001 on element (1, 1) of 'enc.weight' sets every exponent bit of torch.float32 "
        "(0x7f800000): the element would be inf or NaN whatever training writes; leave at least one exponent bit free",
    ),
    "overlap across pins": (
        [Pin("enc.weight", stuck_at_zero=0x1), Pin("enc.weight", indices=[(3, 4)], stuck_at_one=0x3)],
        " stick bits 0x00000001 of element (3, 4) of 'enc.weight' at 0 and at 1 at overlapping steps",
    ),
    "every exponent bit across pins": (
        [Pin("enc.weight", indices=[(1, 1)], stuck_at_one=0x7F000000),
         Pin("enc.weight", indices=[(1, 1), (2, 2)], stuck_at_one=0x00800000)],
        " together stick every exponent bit of element (1, 1) of 'enc.weight' at 1: it would be inf or NaN whatever "
        "training writes",
    ),
}


@pytest.mark.parametrize("case", sorted(MASKS_THAT_CANNOT_HOLD))
def test_masks_that_cannot_hold_are_named_in_full(case):
    pins, tail = MASKS_THAT_CANNOT_HOLD[case]
    net = int_net()
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
    with pytest.raises(PinError) as err:
        pin(net, opt, pins)
    named = " and ".join(repr(p) for p in pins)
    assert str(err.value) == (named + tail if "across" in case else f"{named}: {tail}")


def test_masks_from_files_keyed_by_parameter_name(tmp_path):
    from safetensors.torch import save_file

    net = Net()
    full = torch.zeros(16, 8, dtype=torch.int64)
    full[3, 4] = 0x80000000
    torch.save({"enc.weight": full}, tmp_path / "zero.pt")
    save_file({"enc.weight": torch.tensor([0x00400000], dtype=torch.int32)}, str(tmp_path / "one.safetensors"))
    plan = resolve(
        [Pin("enc.weight", indices=[(3, 4)], stuck_at_zero=str(tmp_path / "zero.pt"),
             stuck_at_one=str(tmp_path / "one.safetensors"))],
        net,
    )
    selection = plan.pins[0].selections["enc.weight"]
    assert selection.stuck_at_zero.tolist() == [-(2**31)] and selection.stuck_at_one.tolist() == [0x00400000]
    assert "stuck bits 1: 0x00400000, 0: 0x80000000" in plan.summary()


def test_uint_and_same_width_masks_are_bit_patterns():
    net = Net()
    sign = torch.tensor([0x80000000], dtype=torch.uint32)
    plan = resolve([Pin("enc.weight", indices=[(0, 0)], stuck_at_zero=sign)], net)
    assert plan.pins[0].selections["enc.weight"].stuck_at_zero.tolist() == [-(2**31)]
    as_int32 = torch.tensor([-(2**31)], dtype=torch.int32)  # float32's sign bit as p.view(torch.int32) shows it
    plan = resolve([Pin("enc.weight", indices=[(0, 0)], stuck_at_zero=as_int32)], net)
    assert plan.pins[0].selections["enc.weight"].stuck_at_zero.tolist() == [-(2**31)]


# ----------------------------------------------------------------------------------------------
# Verify, metrics and state


def test_verify_names_the_element_the_bits_and_the_interval():
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    pins = [
        Pin("enc.weight", indices=[(0, 0), (2, 3)], stuck_at_zero=0x80000000, stuck_at_one=0x00400000),
        Pin("head.bias", bounds=(0.0, 0.5)),
    ]
    with pin(net, opt, pins) as handle:
        handle.verify()
        with torch.no_grad():
            net.enc.weight[2, 3] = -1.0  # sign set, mantissa bit clear: both stuck bits off
            net.head.bias[1] = 0.75
        with pytest.raises(PinError) as err:
            handle.verify()
        counts = handle.engine.violations()
    message = str(err.value)
    assert "enc.weight: 1 element(s) with stuck bits off ((2, 3): -1.0 (bits 0xbf800000" in message
    assert "stuck at 1: 0x00400000, stuck at 0: 0x80000000, wrong: 0x80400000" in message
    assert "head.bias: 1 element(s) out of bounds ((1,): 0.75 (in [0.0, 0.5]))" in message
    assert [(v.name, v.kind, v.count) for v in counts] == [("enc.weight", "stuck_bits", 1), ("head.bias", "bounds", 1)]


def test_step_stats_and_violation_count_cover_faults():
    from lightning_pin.callbacks.metrics import count_off_target

    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    pins = [Pin("enc.weight", indices=ELEMENTS, stuck_at_one=0x00400000), Pin("head.weight", bounds=(-0.01, 0.01))]
    stats = []
    with pin(net, opt, pins) as handle:
        handle.engine.register_restore_hook(stats.append, wants_stats=lambda: True)
        train(net, opt, 3, lambda step: None, accumulate=1)
        assert int(count_off_target(handle.engine.projections())) == 0
        with torch.no_grad():
            net.enc.weight[0, 0] = 0.0
            assert torch.isfinite(net.head.weight).all()
            net.head.weight[0, 0] = 1.0
            net.head.weight[1, 0] = float("nan")  # NaN is never inside bounds
        assert int(count_off_target(handle.engine.projections())) == 3
    assert len(stats) == 3 and stats[0].elements == len(ELEMENTS) + 48
    assert all(int(s.violations) == 0 for s in stats)
    assert all(float(s.drift_max) > 0 for s in stats)  # training pushes against the bounds


def test_state_round_trip_and_resume_through_the_front_door():
    pins, zero, one = bit_pins(torch.float32)
    pins = pins + [Pin("head.bias", bounds=(-0.1, 0.1))]
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    handle = pin(net, opt, pins)
    train(net, opt, 3, lambda step: None)
    saved = {"model": net.state_dict(), "opt": opt.state_dict(), "pins": handle.state_dict()}
    train(net, opt, 3, lambda step: None)
    straight = {k: v.clone() for k, v in net.state_dict().items()}
    handle.remove()
    assert saved["pins"]["version"] == 3 and saved["pins"]["pins"][0]["enc.weight"]["kind"] == "stuck_bits"

    again = Net()
    opt2 = torch.optim.AdamW(again.parameters(), lr=0.05)
    handle2 = pin(again, opt2, pins)
    again.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    handle2.load_state_dict(saved["pins"])
    g = torch.Generator().manual_seed(1)
    for _ in range(3 * 2):  # the batches the first run consumed before saving
        torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)

    def resumed_train():
        for step in range(3):
            for _ in range(2):
                x = torch.randn(16, 8, generator=g)
                y = torch.randint(0, 3, (16,), generator=g)
                (nn.functional.cross_entropy(again(x), y) / 2).backward()
            torch.nn.utils.clip_grad_norm_(again.parameters(), 1.0)
            opt2.step()
            opt2.zero_grad()

    resumed_train()
    handle2.remove()
    for key, value in again.state_dict().items():
        assert torch.equal(value.view(torch.int32), straight[key].view(torch.int32)), key


def test_saved_state_of_other_masks_is_refused():
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pin(net, opt, [Pin("enc.bias", stuck_at_one=1)]) as handle:
        state = handle.state_dict()
    state["pins"][0]["enc.bias"]["stuck_at_one"] = torch.full((16,), 2, dtype=torch.int32)
    with pin(net, opt, [Pin("enc.bias", stuck_at_one=1)]) as handle, pytest.raises(PinError, match="stuck_at_one"):
        handle.load_state_dict(state)


def test_write_into_projects_an_averaged_copy():
    net = Net()
    pins = [Pin("enc.weight", indices=ELEMENTS, stuck_at_zero=0x80000000), Pin("head.bias", bounds=(0, 0.01))]
    plan = resolve(pins, net)
    engine = PinEngine(plan)
    engine.set_active({0, 1})
    copy = {name: torch.full_like(p, -3.0) for name, p in net.named_parameters()}
    engine.write_into(copy)
    rows, cols = torch.tensor([i for i, _ in ELEMENTS]), torch.tensor([j for _, j in ELEMENTS])
    assert bool((copy["enc.weight"][rows, cols] == 3.0).all())  # the sign bit cleared, nothing else
    assert bool((copy["head.bias"] == 0).all())
    assert bool((copy["enc.bias"] == -3.0).all())  # not pinned: untouched


def test_channels_last_conv_weights():
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    net = nn.Sequential(conv)
    coords = [(1, 2, 0, 1), (3, 0, 2, 2)]
    plan = resolve([Pin("0.weight", indices=coords, stuck_at_one=0x40000000), Pin("0.bias", bounds=(0, 0.01))], net)
    engine = PinEngine(plan)
    with torch.no_grad():
        conv.weight.fill_(0.25)
        conv.bias.fill_(-1.0)
    engine.set_active({0, 1})
    w = conv.weight.detach()
    assert w.is_contiguous(memory_format=torch.channels_last)
    stuck = (torch.tensor(0.25).view(torch.int32) | 0x40000000).view(torch.float32)  # 0.25 * 2**128
    assert [w[c].item() for c in coords] == [stuck.item()] * 2
    assert int((w == 0.25).sum()) == w.numel() - 2
    assert bool((conv.bias == 0).all())


# ----------------------------------------------------------------------------------------------
# The kernels against a reference, on random patterns


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=12),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.booleans(),
)
def test_stuck_bits_kernel_matches_the_reference(words, zero, one, whole):
    one &= ~zero
    bits = torch.tensor(words, dtype=torch.int32)
    data = bits.view(torch.float32).clone()
    param = nn.Parameter(data.clone())
    n = len(words)
    index = None if whole else torch.arange(0, n, 2, dtype=torch.int32)
    count = n if whole else index.numel()
    keep = torch.full((count,), ~signed(zero, torch.float32), dtype=torch.int32)
    set_ = torch.full((count,), signed(one, torch.float32), dtype=torch.int32)
    projection = StuckBits(Target("p", param, index, torch.stack([keep, set_], -1)))
    tensor = param.detach().clone()
    projection.apply(tensor)
    expected = bits.clone()
    chosen = slice(None) if whole else slice(0, n, 2)
    expected[chosen] = (bits[chosen] & keep) | set_
    assert torch.equal(tensor.view(torch.int32), expected)
    assert not bool(projection.off(tensor)[1].any())
    again = tensor.clone()
    projection.apply(again)  # idempotent
    assert torch.equal(again.view(torch.int32), expected)
    moved = projection.off(param.detach())[1]
    changed = (bits[chosen] & keep | set_) != bits[chosen]
    assert torch.equal(moved, changed)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=12),
    st.floats(-10, 10, width=32),
    st.floats(0, 10, width=32),
)
def test_interval_kernel_matches_the_reference(values, low, width):
    high = torch.tensor(low, dtype=torch.float32) + torch.tensor(width, dtype=torch.float32)
    param = nn.Parameter(torch.tensor(values, dtype=torch.float32))
    n = len(values)
    payload = torch.stack([torch.full((n,), low), high.expand(n)], -1)
    projection = Interval(Target("p", param, torch.arange(n, dtype=torch.int32), payload))
    tensor = param.detach().clone()
    projection.apply(tensor)
    assert torch.equal(tensor, torch.clamp(param.detach(), min=low, max=high.item()))
    assert not bool(projection.off(tensor)[1].any())


def test_a_stuck_bit_window_holds_only_inside_it():
    """start_step / stop_step: forced right after step start-1, held to stop-1, then the bits train."""
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    sign = signed(SIGN[torch.float32], torch.float32)
    pins = [Pin("enc.weight", stuck_at_zero=0x80000000, start_step=2, stop_step=5)]
    negative = []
    with pin(net, opt, pins) as handle:

        def record(step):
            bits = net.enc.weight.detach().view(torch.int32)
            negative.append(int(((bits & sign) != 0).sum()))
            if 1 <= step <= 3:  # after step 1 the pin is active for steps 2, 3 and 4
                assert negative[-1] == 0, f"a sign bit reads 1 after step {step}"

        assert int((net.enc.weight < 0).sum()) > 0  # not active yet: the weights keep their signs
        train(net, opt, 8, record, accumulate=1)
        assert handle.engine.active == frozenset()
    assert negative[0] > 0 and negative[-1] > 0  # free before and after the window


def test_fault_pins_on_whole_modules_leave_their_buffers_training():
    """Stuck bits and bounds fault a module's weights; they freeze nothing, so its BatchNorm running
    statistics keep updating (only value pins that freeze whole modules hold buffers)."""
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    pins = [Pin("1.*", bounds=(-1, 1)), Pin("0.*", stuck_at_zero=0x80000000)]  # each covers a whole module
    before = net[1].running_mean.clone()
    with pin(net, opt, pins) as handle:
        for _ in range(3):
            net(torch.randn(8, 4) + 3.0).sum().backward()
            opt.step()
            opt.zero_grad()
        handle.verify()
    assert not torch.equal(net[1].running_mean, before)
    assert int(net[1].num_batches_tracked) == 3
