"""Stuck bits in quantized integer codes (``Pin(..., code=QuantCode(...))``), held exactly while training.

After every optimizer step each faulty element's weight is the dequantized faulty code
``(q' - zero_point) * s`` (checked here by re-deriving the code from the weight, independently
of the library's arithmetic: the weight is on the code's grid and its code reads the stuck
bits), its free code bits keep training, and free elements train. Both doors (``pin()`` in a
plain loop, ``PinCallback`` in a real Trainer), int8 / int4, per-tensor / per-channel / learned
(named) scales, AdamW with weight decay, SGD with momentum and Adam, with and without
``quantize()``; every refusal before any weight changes; the saved state and a bit-identical resume.
"""

from __future__ import annotations

import dataclasses
import io
import math

import lightning as L
import pytest
import torch
from helpers import trainer
from torch import nn

from lightning_pin import Pin, PinCallback, PinError, QuantCode, pin
from lightning_pin.faults import bit_faults, quantize

def groups(params, lr: float) -> list[dict]:
    """Weights at ``lr``, learned scales (0-d or one column) 100 times slower, as LSQ trains them."""
    params = list(params)
    scales = [p for p in params if p.ndim == 0 or (p.ndim == 2 and p.shape[1] == 1)]
    return [{"params": [p for p in params if all(p is not s for s in scales)], "lr": lr},
            {"params": scales, "lr": lr / 100}]


OPTIMIZERS = {
    "adamw_wd": lambda ps: torch.optim.AdamW(groups(ps, 0.1), weight_decay=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(groups(ps, 0.3), momentum=0.5),
    "adam": lambda ps: torch.optim.Adam(groups(ps, 0.1)),
}
PER_CHANNEL = torch.tensor([2.0**-5, 2.0**-4] * 4)
CODES = {
    "int8": lambda: QuantCode(bits=8, scale=2.0**-6),
    "int4_per_channel": lambda: QuantCode(bits=4, scale=PER_CHANNEL, axis=0),
    "int8_learned": lambda: QuantCode(bits=8, scale="s"),
    "int4_learned_per_channel": lambda: QuantCode(bits=4, scale="s_channel", axis=0, signed=False, zero_point=8),
}


class Net(nn.Module):
    """A tiny MLP with a learned per-tensor scale ``s`` and a learned per-channel one ``s_channel``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 8)
        self.fc2 = nn.Linear(8, 4)
        self.s = nn.Parameter(torch.tensor(2.0**-5))
        self.s_channel = nn.Parameter(torch.full((8, 1), 2.0**-4))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def scales_of(module: nn.Module, code: QuantCode, flat: torch.Tensor) -> torch.Tensor:
    """Each element's scale, in float32, by the code's rule (read from the module for a named scale)."""
    scale = getattr(module, code.scale).detach() if code.named else torch.as_tensor(code.scale)
    scale = scale.reshape(-1).float()
    if scale.numel() == 1:
        return scale.expand(flat.numel())
    columns = 16  # fc1.weight is 8 x 16: the channel of a flat position along axis 0
    return scale[flat // columns]


def codes_held(module: nn.Module, pins: list[Pin]) -> dict[int, int]:
    """Assert every faulty element holds its dequantized faulty code; return the codes by flat position."""
    weight = module.fc1.weight.detach().reshape(-1)
    found = {}
    for p in pins:
        code = p.code
        coords = torch.as_tensor(p.indices).reshape(-1, 2)
        flat = coords[:, 0] * 16 + coords[:, 1]
        w, s = weight[flat], scales_of(module, code, flat)
        q = torch.round(w / s) + code.zero_point
        assert torch.equal(w, (q - code.zero_point) * s), "a faulty weight is off its code's grid"
        assert bool(((q >= code.qmin) & (q <= code.qmax)).all())
        pattern = q.long() & ((1 << code.bits) - 1)
        zero, one = (torch.as_tensor(m).long().reshape(-1) for m in (p.stuck_at_zero, p.stuck_at_one))
        assert torch.equal(pattern & one, one) and not bool((pattern & zero).any()), "a stuck code bit does not hold"
        found.update(zip(flat.tolist(), pattern.tolist()))
    return found


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)


def faulty_pins(net: nn.Module, code: QuantCode) -> list[Pin]:
    pins = bit_faults(net, "fc1.weight", rate=0.05, code=code, seed=3)
    assert len(pins) == 1 and len(pins[0].indices) >= 10
    return list(pins)


def plain_loop(code_name: str, optimizer: str, quantized: bool, steps: int = 16):
    torch.manual_seed(0)
    net, code = Net(), CODES[code_name]()
    pins = faulty_pins(net, code)
    start = {k: v.detach().clone() for k, v in net.named_parameters()}
    opt = OPTIMIZERS[optimizer](net.parameters())
    seen = []
    q = quantize(net, "fc1.weight", code) if quantized else None
    with pin(net, opt, pins) as handle:
        seen.append(codes_held(net, pins))  # the forward of the first step already sees the faulty codes
        for step in range(steps):
            x, y = data(step)
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
            seen.append(codes_held(net, pins))
        handle.verify()
    if q is not None:
        q.remove()
    return net, pins, start, seen


def assert_trained(net, pins, start, seen, code_name, quantized):
    # Free code bits of the faulty elements moved, and the free elements trained.
    assert any(seen[0][k] != seen[-1][k] for k in seen[0]), "no free code bit of a faulty element changed"
    free = torch.ones(8 * 16, dtype=torch.bool)
    free[list(seen[0])] = False
    moved = net.fc1.weight.detach().reshape(-1)[free] != start["fc1.weight"].reshape(-1)[free]
    assert int(moved.sum()) > free.sum() // 2
    if CODES[code_name]().named:
        # The pins read the scale wherever it is: trained through quantize()'s forward, or left alone.
        name = CODES[code_name]().scale
        assert torch.equal(getattr(net, name).detach(), start[name]) != quantized


@pytest.mark.parametrize("quantized", [False, True], ids=["float_forward", "quantize"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("code_name", list(CODES))
def test_plain_loop_holds_faulty_codes_exactly(code_name, optimizer, quantized):
    net, pins, start, seen = plain_loop(code_name, optimizer, quantized)
    assert_trained(net, pins, start, seen, code_name, quantized)


class Lit(L.LightningModule):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Net()
        self.optimizer = optimizer

    @property
    def fc1(self):
        return self.net.fc1

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return OPTIMIZERS[self.optimizer](self.parameters())


class Watch(L.Callback):
    def __init__(self, pins, net) -> None:
        self.pins, self.net, self.seen = pins, net, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(codes_held(self.net, self.pins))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(codes_held(self.net, self.pins))


def loader():
    xs, ys = zip(*(data(step) for step in range(8)))
    dataset = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
    return torch.utils.data.DataLoader(dataset, batch_size=16)


@pytest.mark.parametrize(
    ("code_name", "optimizer", "quantized"),
    [("int8", "adamw_wd", True), ("int8", "sgd_momentum", False), ("int4_per_channel", "adam", True),
     ("int8_learned", "adamw_wd", True), ("int4_learned_per_channel", "sgd_momentum", True)],
)
def test_trainer_holds_faulty_codes_exactly(code_name, optimizer, quantized, caplog):
    lit = Lit(optimizer)
    local_code = CODES[code_name]()
    # A named scale is a tensor of the module being pinned (the LightningModule): its name there.
    code = dataclasses.replace(local_code, scale=f"net.{local_code.scale}") if local_code.named else local_code
    pins = bit_faults(lit, "net.fc1.weight", rate=0.05, code=code, seed=3)
    local = [Pin("fc1.weight", indices=p.indices, stuck_at_zero=p.stuck_at_zero, stuck_at_one=p.stuck_at_one,
                 code=local_code) for p in pins]  # the same faults, named inside lit.net for the watcher
    start = {k: v.detach().clone() for k, v in lit.net.named_parameters()}
    watch = Watch(local, lit.net)
    callback = PinCallback(list(pins))
    q = quantize(lit, "net.fc1.weight", code) if quantized else None
    with caplog.at_level("INFO"):
        trainer(max_epochs=2, callbacks=[callback, watch]).fit(lit, loader())
    if q is not None:
        q.remove()
    callback.verify(lit)
    assert len(watch.seen) == 32
    assert_trained(lit.net, local, start, watch.seen, code_name, quantized)
    # The fit-start summary says the code and the stuck bits.
    assert f"{code.describe() if not code.named else ''}" in caplog.text
    assert "code" in caplog.text and "stuck bits at 1: 0x" in caplog.text


def test_the_summary_line_names_the_code_the_stuck_bits_and_the_elements():
    net = Net()
    handle = pin(net, torch.optim.SGD(net.parameters(), lr=0.1), [
        Pin("fc1.weight", indices=[(0, 1), (2, 3), (5, 5)], stuck_at_one=[0x40, 0x01, 0], stuck_at_zero=[0x01, 0, 0x80],
            code=QuantCode(bits=8, scale=2.0**-6))])
    row = next(line for line in handle.engine.plan.summary().splitlines() if line.startswith("fc1.weight"))
    assert "3" in row and "int8 code (scale 0.015625), stuck bits at 1: 0x41 / at 0: 0x81" in row
    handle.remove()


def test_a_code_bit_undone_is_named_by_verify_with_its_code_and_stuck_bits():
    net = Net()
    code = QuantCode(bits=8, scale=2.0**-6)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pin(net, opt, [Pin("fc1.weight", indices=[(2, 3)], stuck_at_one=0x40, code=code)]) as handle:
        q = int(torch.round(net.fc1.weight[2, 3] / 2.0**-6))
        assert q & 0x40
        with torch.no_grad():
            net.fc1.weight[2, 3] = (q - 0x40) * 2.0**-6  # bit 6 of the code undone
        with pytest.raises(PinError, match=r"fc1.weight: 1 element\(s\) with stuck code bits off .*\(2, 3\).*"
                                           r"code 0x[0-9a-f]{2}, stuck at 1: 0x40, wrong: 0x40"):
            handle.verify()


# --------------------------------------------------------------------------------------------
# Refusals: PinError, no weight changed


def test_refused_at_construction():
    code = QuantCode(bits=8, scale=0.5)
    cases = [
        (lambda: Pin("w", stuck_at_one=0x100, code=code), "wider than the 8-bit code"),
        (lambda: Pin("w", stuck_at_zero=0x3, stuck_at_one=0x1, code=code), "overlap"),
        (lambda: Pin("w", value=1.0, code=code), "code= and value= on the same pin"),
        (lambda: Pin("w", bounds=(0.0, 1.0), code=code), "code= and bounds= on the same pin"),
        (lambda: QuantCode(bits=8, scale=0.0), "not a positive finite number"),
        (lambda: QuantCode(bits=8, scale=-1.0), "not a positive finite number"),
        (lambda: QuantCode(bits=8, scale=math.nan), "not a positive finite number"),
        (lambda: QuantCode(bits=8, scale=math.inf), "not a positive finite number"),
        (lambda: QuantCode(bits=8, scale=torch.tensor([0.1, 0.0]), axis=0), "not a positive finite number"),
        (lambda: QuantCode(bits=8, scale=torch.tensor([0.1, 0.2])), "need the axis"),
        (lambda: QuantCode(bits=1, scale=0.1), "bits must be an integer from 2 to 16"),
        (lambda: QuantCode(bits=17, scale=0.1), "bits must be an integer from 2 to 16"),
        (lambda: QuantCode(bits=8), "QuantCode needs a scale"),
        (lambda: QuantCode(bits=4, scale=0.1, zero_point=8), r"zero_point must be an integer in \[-8, 7\]"),
    ]
    for make, message in cases:
        with pytest.raises(PinError, match=message):
            make()


def test_refused_on_the_module_before_any_weight_changes():
    class WithInt(Net):
        def __init__(self) -> None:
            super().__init__()
            self.counts = nn.Parameter(torch.zeros(3, dtype=torch.int32), requires_grad=False)
            self.register_buffer("b_scale", torch.tensor(2.0**-4))

    good = Pin("fc2.weight", indices=[(0, 0)], stuck_at_one=0x40, code=QuantCode(bits=8, scale=2.0**-6))
    cases = [
        (Pin("fc1.weight", stuck_at_one=0x1, code=QuantCode(bits=8, scale="nope")),
         "the scale 'nope' is not a parameter or buffer of the module"),
        (Pin("fc1.weight", stuck_at_one=0x1, code=QuantCode(bits=8, scale=torch.tensor([0.1, 0.2, 0.3]), axis=0)),
         "3 scales for 'fc1.weight', whose axis 0 has 8 entries"),
        (Pin("fc1.weight", stuck_at_one=0x1, code=QuantCode(bits=8, scale="s_channel", axis=1)),
         "the scale 's_channel' is a torch.float32 tensor of 8 entries"),
        (Pin("counts", stuck_at_one=0x1, code=QuantCode(bits=8, scale=0.1)), "code= on 'counts', a torch.int32"),
        (Pin("fc1.weight", indices=[(0, 0)], stuck_at_one=[0x1, 0x2], code=QuantCode(bits=8, scale=0.1)),
         "expected one entry, 1 entries"),
        (Pin("fc1.weight", stuck_at_one={"fc1.weight": 0x10}, code=QuantCode(bits=4, scale=0.1)),
         "stuck_at_one for 'fc1.weight' holds 0x10, wider than the 4-bit code"),
    ]
    for bad, message in cases:
        net = WithInt()
        before = {k: v.detach().clone() for k, v in net.state_dict().items()}
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with pytest.raises(PinError, match=message):
            pin(net, opt, [good, bad])
        assert all(torch.equal(before[k], v) for k, v in net.state_dict().items()), message
    # A buffer is a valid learned scale too.
    net = WithInt()
    pin(net, torch.optim.SGD(net.parameters(), lr=0.1), [
        Pin("fc1.weight", indices=[(0, 0)], stuck_at_one=0x1, code=QuantCode(bits=8, scale="b_scale"))]).remove()


def test_two_code_pins_on_one_parameter_must_share_the_code():
    net = Net()
    a = Pin("fc1.weight", indices=[(0, 0)], stuck_at_one=0x1, code=QuantCode(bits=8, scale=0.5))
    b = Pin("fc1.weight", indices=[(1, 0)], stuck_at_one=0x1, code=QuantCode(bits=8, scale=0.25))
    with pytest.raises(PinError, match="different codes"):
        pin(net, torch.optim.SGD(net.parameters(), lr=0.1), [a, b])
    c = Pin("fc1.weight", indices=[(0, 0)], stuck_at_zero=0x1, code=QuantCode(bits=8, scale=0.5))
    with pytest.raises(PinError, match="stick code bits 0x1 of element \\(0, 0\\)"):
        pin(net, torch.optim.SGD(net.parameters(), lr=0.1), [a, c])
    float_bits = Pin("fc1.weight", indices=[(0, 0)], stuck_at_one=0x1)
    with pytest.raises(PinError, match="put stuck code bits and stuck bits on 1 element"):
        pin(net, torch.optim.SGD(net.parameters(), lr=0.1), [a, float_bits])


def test_bit_faults_with_a_code_draws_over_the_code_bits_and_refuses_float_names():
    net = Net()
    pins = bit_faults(net, "fc1.weight", rate=0.2, code=QuantCode(bits=4, scale=0.1), seed=0)
    stuck = torch.as_tensor(pins[0].stuck_at_zero) | torch.as_tensor(pins[0].stuck_at_one)
    assert bool((stuck > 0).all()) and int(stuck.max()) < 16 and "int4 code" in pins.summary
    sign = bit_faults(net, "fc1.weight", rate=0.5, bits="sign", code=QuantCode(bits=8, scale=0.1), seed=0)
    assert set((torch.as_tensor(sign[0].stuck_at_zero) | torch.as_tensor(sign[0].stuck_at_one)).tolist()) == {0x80}
    with pytest.raises(PinError, match="an integer code has no exponent or mantissa"):
        bit_faults(net, "fc1.weight", rate=0.1, bits="exponent", code=QuantCode(bits=8, scale=0.1))
    with pytest.raises(PinError, match="outside the 8-bit code"):
        bit_faults(net, "fc1.weight", rate=0.1, bits=8, code=QuantCode(bits=8, scale=0.1))
    with pytest.raises(PinError, match="an unsigned code: it has no sign bit"):
        bit_faults(net, "fc1.weight", rate=0.1, bits="sign", code=QuantCode(bits=8, scale=0.1, signed=False))


def test_healthy_elements_are_not_snapped_onto_the_grid():
    torch.manual_seed(0)
    net = Net()
    code = QuantCode(bits=8, scale=2.0**-6)
    pins = bit_faults(net, "fc1.weight", rate=0.05, code=code, seed=3)
    before = net.fc1.weight.detach().clone().reshape(-1)
    with pin(net, torch.optim.SGD(net.parameters(), lr=0.1), pins):
        flat = set(codes_held(net, list(pins)))
        after = net.fc1.weight.detach().reshape(-1)
        healthy = torch.tensor([i not in flat for i in range(128)])
        assert torch.equal(after[healthy], before[healthy])
        assert not torch.equal(after[~healthy], before[~healthy])


# --------------------------------------------------------------------------------------------
# quantize(): the forward sees the codes; names unchanged


def test_quantize_forward_reads_dequantized_codes_and_keeps_the_parameters():
    torch.manual_seed(0)
    net = Net()
    names = [n for n, _ in net.named_parameters()]
    code = QuantCode(bits=4, scale=PER_CHANNEL, axis=0)
    x = torch.randn(3, 16)
    w = net.fc1.weight.detach()
    s = PER_CHANNEL.reshape(8, 1)
    deq = (torch.clamp(torch.round(w / s), -8, 7)) * s
    expected = net.fc2(torch.relu(nn.functional.linear(x, deq, net.fc1.bias)))
    with quantize(net, "fc1.weight", code) as handle:
        assert torch.equal(net(x), expected) and [n for n, _ in net.named_parameters()] == names
        net(x).sum().backward()
        assert net.fc1.weight.grad is not None and isinstance(net.fc1.weight, nn.Parameter)
    assert "removed" in repr(handle) and not torch.equal(net(x), expected)
    with pytest.raises(PinError, match="the scale 'missing' is not a parameter or buffer"):
        quantize(net, "fc1.weight", QuantCode(bits=8, scale="missing"))


def test_quantize_gives_a_learned_scale_its_gradient():
    net = Net()
    with quantize(net, "fc1.weight", QuantCode(bits=8, scale="s")):
        net(torch.randn(4, 16)).pow(2).sum().backward()
    assert net.s.grad is not None and float(net.s.grad.abs()) > 0


# --------------------------------------------------------------------------------------------
# Pin state and resume


def test_resume_is_bit_identical_and_the_state_saves_the_code():
    def run(steps: range, state=None):
        torch.manual_seed(0)
        net = Net()
        pins = [*bit_faults(net, "fc1.weight", rate=0.05, code=QuantCode(bits=8, scale="s"), seed=3),
                *bit_faults(net, "fc2.weight", rate=0.05, code=QuantCode(bits=4, scale=torch.tensor([0.25] * 4),
                                                                        axis=0), seed=4)]
        opt = torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1)
        q = quantize(net, "fc1.weight", QuantCode(bits=8, scale="s"))
        handle = pin(net, opt, pins)
        if state is not None:
            net.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            handle.load_state_dict(state["pins"])
        for step in steps:
            x, y = data(step)
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
        handle.verify()
        saved = {"model": net.state_dict(), "optimizer": opt.state_dict(), "pins": handle.state_dict()}
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        q.remove()
        handle.remove()
        buffer.seek(0)
        return net, torch.load(buffer, weights_only=True)

    whole, _ = run(range(8))
    _, halfway = run(range(4))
    resumed, _ = run(range(4, 8), halfway)
    for (name, a), (_, b) in zip(whole.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), name


def test_the_saved_selection_holds_the_code_spec_and_the_scale_name():
    from lightning_pin.core.state import PinState

    net = Net()
    handle = pin(net, torch.optim.SGD(net.parameters(), lr=0.1), [
        Pin("fc1.weight", indices=[(0, 1)], stuck_at_one=0x2, code=QuantCode(bits=4, scale="s_channel", axis=0,
                                                                              signed=False, zero_point=8))])
    state = PinState.from_dict(handle.engine.pin_state().to_dict())
    saved = state.pins[0]["fc1.weight"]
    assert saved.kind == "quant_code" and saved.spec.tolist() == [4, 8, 0, 0]
    assert bytes(saved.scale_name.tolist()).decode() == "s_channel" and saved.scale.numel() == 0
    assert saved.channel.tolist() == [0] and saved.stuck_at_one.tolist() == [2]
    handle.remove()


# --------------------------------------------------------------------------------------------
# Fault-map files carry the code


@pytest.mark.parametrize("with_module", [False, True], ids=["pins_alone", "with_module"])
@pytest.mark.parametrize("code_name", ["int4_per_channel", "int8_learned"])
def test_a_fault_map_carries_the_code_and_pins_the_same_faults(tmp_path, code_name, with_module):
    from lightning_pin.faults import load_fault_map, save_fault_map

    torch.manual_seed(0)
    net, code = Net(), CODES[code_name]()
    pins = bit_faults(net, "fc1.weight", rate=0.05, code=code, seed=3)
    path = save_fault_map(pins, tmp_path / "chip.safetensors", module=net if with_module else None)
    loaded = load_fault_map(path)
    assert len(loaded) == 1 and "with stuck code bits" in loaded.summary
    again = loaded[0].code
    assert (again.bits, again.zero_point, again.axis, again.signed) == (code.bits, code.zero_point, code.axis,
                                                                        code.signed)
    assert again.scale == code.scale if code.named else torch.equal(again.scale, code.scale.double())
    held = []
    for chosen in (list(pins), list(loaded)):
        torch.manual_seed(0)
        fresh = Net()
        with pin(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), chosen):
            held.append(fresh.fc1.weight.detach().clone())
    assert torch.equal(held[0], held[1])


def test_a_fault_map_refuses_two_codes_for_one_parameter(tmp_path):
    from lightning_pin.faults import save_fault_map

    a = Pin("fc1.weight", indices=[(0, 0)], stuck_at_one=0x1, code=QuantCode(bits=8, scale=0.5))
    b = Pin("fc1.weight", indices=[(1, 0)], stuck_at_one=0x1, code=QuantCode(bits=4, scale=0.5))
    with pytest.raises(PinError, match="store it in different codes"):
        save_fault_map([a, b], tmp_path / "chip.pt")
    assert not (tmp_path / "chip.pt").exists()


# --------------------------------------------------------------------------------------------
# torch.ao's quantization-aware training: its fake-quant scale is a buffer a code can name


def test_torch_ao_qat_reads_the_faulty_codes_the_pins_hold():
    import warnings

    import torch.ao.quantization as tq

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 8)

        def forward(self, x):
            return self.fc(x)

    torch.manual_seed(0)
    model = M().train()
    model.qconfig = tq.get_default_qat_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tq.prepare_qat(model, inplace=True)
    model(torch.randn(32, 16))  # calibrate the observers, then freeze the scales the pins read
    model.apply(tq.disable_observer)
    fake = model.fc.weight_fake_quant
    assert [n for n, _ in model.named_parameters()] == ["fc.weight", "fc.bias"]
    code = QuantCode(bits=8, scale="fc.weight_fake_quant.scale", axis=fake.ch_axis)
    pins = bit_faults(model, "fc.weight", rate=0.05, code=code, seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    with pin(model, opt, pins) as handle:
        for _ in range(5):
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            weight = model.fc.weight.detach()
            where = tuple(pins[0].indices.T)
            assert torch.equal(fake(weight)[where], weight[where])  # the forward sees the pinned faulty weights
        handle.verify()


def test_a_code_from_a_config_mapping_is_the_same_pin():
    built = Pin("fc1.weight", indices=[(0, 1)], stuck_at_one=0x1, code=QuantCode(bits=4, scale=0.25, axis=None))
    from_config = Pin.from_config({"params": "fc1.weight", "indices": [(0, 1)], "stuck_at_one": 0x1,
                                   "code": {"bits": 4, "scale": 0.25}})
    assert isinstance(from_config.code, QuantCode) and from_config.fingerprint() == built.fingerprint()
    assert Pin("fc1.weight", stuck_at_one=0x1, code=QuantCode(bits=4, scale=0.5)).fingerprint() != built.fingerprint()
    # Pins without a code keep the fingerprints (and checkpoint keys) they had before codes existed.
    assert Pin("fc1.weight", indices=[(0, 1)], stuck_at_one=0x1).kind == "stuck_bits"
    per_channel = Pin.from_config({"params": "fc1.weight", "stuck_at_one": 0x1,
                                   "code": {"bits": 8, "scale": [0.5] * 8, "axis": 0}})
    assert torch.equal(per_channel.code.scale, torch.full((8,), 0.5, dtype=torch.float64))
    with pytest.raises(PinError, match="unknown keys \\['scales'\\]"):
        Pin.from_config({"params": "fc1.weight", "code": {"bits": 8, "scales": 0.5}})


def test_the_stored_comparison_agrees_with_the_kernel_for_per_channel_scales():
    from lightning_pin.core import kinds
    from lightning_pin.core.state import PinState

    net, pins, _, _ = plain_loop("int4_per_channel", "adam", True, steps=3)
    handle = pin(net, torch.optim.SGD(net.parameters(), lr=0.1), pins)
    saved = PinState.from_dict(handle.engine.pin_state().to_dict()).pins[0]["fc1.weight"]
    handle.remove()
    kind = kinds.of(saved.kind)
    values = net.fc1.weight.detach().reshape(-1)[saved.index.long()].clone()
    off, _ = kind.stored_off(values, saved)
    assert not bool(off.any())
    # A stuck bit undone in an element of an odd channel (scale 2**-4): found there, read with that scale.
    at = int((saved.channel % 2 == 1).to(torch.int8).argmax())
    s = PER_CHANNEL[int(saved.channel[at])]
    assert s == 2.0**-4
    q = int(torch.round(values[at] / s)) & 0xF
    stuck = int(saved.stuck_at_zero[at]) | int(saved.stuck_at_one[at])
    q ^= 1 << (stuck.bit_length() - 1)
    values[at] = (q - 16 if q & 0x8 else q) * s
    off, expected = kind.stored_off(values, saved)
    assert off.nonzero().reshape(-1).tolist() == [at] and "wrong: 0x" in expected(at)


def test_drift_measures_how_far_the_optimizer_moved_the_faulty_weights():
    torch.manual_seed(0)
    net, code = Net(), QuantCode(bits=8, scale=2.0**-6)
    pins = faulty_pins(net, code)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    with pin(net, opt, pins) as handle:
        stats = []
        handle.engine.register_restore_hook(stats.append, wants_stats=lambda: True)
        before = net.fc1.weight.detach().clone()
        x, y = data(0)
        nn.functional.mse_loss(net(x), y).backward()
        moved = (net.fc1.weight.grad * 0.5).reshape(-1)
        opt.step()
        flat = torch.tensor(sorted(codes_held(net, pins)))
        # The weights the step wrote, before the restore: exactly before - lr * grad (plain SGD).
        written = before.reshape(-1)[flat] - moved[flat]
        held = net.fc1.weight.detach().reshape(-1)[flat]
        (last,) = stats
        assert torch.equal(last.drift_max, (written.double() - held.double()).abs().max().float())
        assert float(last.drift_max) > 0 and int(last.violations) == 0


@pytest.mark.parametrize("masks", [{}, {"stuck_at_one": 0}, {"stuck_at_zero": 0, "stuck_at_one": [0, 0]},
                                   {"stuck_at_zero": torch.zeros(3, dtype=torch.int32)}])
def test_a_code_pin_without_a_stuck_bit_is_refused_pointing_to_quantize(masks):
    """Pin(code=...) alone marks no fault and would only snap its elements onto the grid: refused, naming quantize()."""
    code = QuantCode(bits=8, scale=2.0**-6)
    with pytest.raises(PinError, match=r"code= without a stuck bit .* lightning_pin\.faults\.quantize\(model, params"):
        Pin("fc1.weight", indices=[(0, 1), (2, 3), (5, 5)], code=code, **masks)
    with pytest.raises(PinError, match="code= without a stuck bit"):
        Pin.from_config({"params": "fc1.weight", "code": {"bits": 8, "scale": 0.01}, **masks})
    # One stuck bit among zeros is a fault: accepted.
    Pin("fc1.weight", indices=[(0, 1), (2, 3), (5, 5)], code=code, stuck_at_zero=[0, 0x10, 0])
