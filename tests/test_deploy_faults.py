"""Test-time faults in torchao-quantized models: the stored int8 codes (qdata), bits 0-7, never the scales."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

pytest.importorskip("torchao")
from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_  # noqa: E402

from lightning_pin import Pin, PinError, pin  # noqa: E402
from lightning_pin.faults import bit_faults, cell_faults, changed_bits, flip_bits, forced_patch  # noqa: E402


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc1 = nn.Linear(4 * 6 * 6, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(torch.relu(self.conv(x)).flatten(1))))


def _mlp():
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _quantized(make, config):
    torch.manual_seed(0)
    model = make()
    float_model = copy.deepcopy(model)
    quantize_(model, config)  # default filter: every nn.Linear (torchao has no int8 convolution)
    return float_model, model


@pytest.fixture(scope="module", params=["mlp-weight-only", "cnn-weight-only", "mlp-dynamic"])
def models(request):
    make = SmallCNN if request.param.startswith("cnn") else _mlp
    config = Int8DynamicActivationInt8WeightConfig() if request.param.endswith("dynamic") else Int8WeightOnlyConfig()
    float_model, model = _quantized(make, config)
    x = torch.randn(6, 1, 8, 8) if make is SmallCNN else torch.randn(6, 16)
    return float_model, model, x


def _int8_names(model):
    return [n for n, p in model.named_parameters() if hasattr(p, "qdata")]


def _snapshot(model):
    return {n: (p.qdata.clone(), p.scale.clone()) for n, p in model.named_parameters() if hasattr(p, "qdata")}


def _code_bits_only(before, model):
    """Bits changed per int8 weight (the scales untouched) and every change within the 8-bit codes."""
    changed = 0
    for name, p in model.named_parameters():
        if name in before:
            q0, s0 = before[name]
            assert torch.equal(p.scale, s0)
            assert p.qdata.dtype == torch.int8
            changed += changed_bits(q0, p.qdata)
    return changed


def test_bit_faults_draw_what_code8_draws_on_the_float_model(models):
    float_model, model, _ = models
    names = _int8_names(model)
    assert names
    pattern = [n for n in names]
    on_int8 = bit_faults(model, pattern, 0.03, seed=5)
    on_float = bit_faults(float_model, pattern, 0.03, seed=5, code=8)
    assert len(on_int8) == len(on_float) == len(names)
    for a, b in zip(on_int8, on_float):
        assert a.params == b.params
        assert torch.equal(a.indices, b.indices)
        assert torch.equal(a.stuck_at_zero, b.stuck_at_zero) and torch.equal(a.stuck_at_one, b.stuck_at_one)
        assert int((a.stuck_at_zero | a.stuck_at_one).max()) <= 0xFF  # code bits 0-7 only
    assert "stored int8 codes" in on_int8.summary


def test_forced_patch_writes_stuck_code_bits_and_restores_them_exactly(models):
    _, model, x = models
    before, out = _snapshot(model), model(x).detach()
    pins = bit_faults(model, _int8_names(model), 0.05, seed=1)
    with forced_patch(model, pins) as patch:
        for p in pins:
            q = dict(model.named_parameters())[p.params].qdata
            at = q[tuple(p.indices.t())].to(torch.int64) & 0xFF
            assert torch.equal(at & p.stuck_at_zero.to(torch.int64), torch.zeros_like(at))
            assert torch.equal(at & p.stuck_at_one.to(torch.int64), p.stuck_at_one.to(torch.int64))
        changed = _code_bits_only(before, model)
        assert changed == patch.changed_bits > 0
        assert not torch.equal(model(x), out)
    after = _snapshot(model)
    assert all(torch.equal(after[n][0], before[n][0]) for n in before)
    assert torch.equal(model(x), out)


def test_flip_bits_flip_the_drawn_code_bits_and_restore(models):
    float_model, model, x = models
    before, out = _snapshot(model), model(x).detach()
    names = _int8_names(model)
    with flip_bits(model, names, 0.02, seed=2) as flips:
        changed = _code_bits_only(before, model)
        assert changed == flips.changed_bits == sum(flips.flipped.values()) > 0
        for name in names:
            rows = flips.positions[name]
            assert bool((rows[:, 1] < 8).all())
            diff = before[name][0].reshape(-1) ^ dict(model.named_parameters())[name].qdata.reshape(-1)
            expected = torch.zeros(diff.numel(), dtype=torch.int64).index_add_(0, rows[:, 0], 1 << rows[:, 1])
            assert torch.equal(diff.to(torch.int64) & 0xFF, expected)
        assert not torch.equal(model(x), out)
    assert all(torch.equal(_snapshot(model)[n][0], before[n][0]) for n in before)
    assert torch.equal(model(x), out)
    # the same (element, bit) pairs as bit_faults' code=8 draw on the float model
    for stuck in bit_faults(float_model, names, 0.02, seed=2, code=8):
        rows = flips.positions[stuck.params]
        cells = stuck.indices.t()
        flat = torch.tensor([p.stride() for p in [dict(float_model.named_parameters())[stuck.params]]][0])
        elements = (stuck.indices * flat).sum(1)
        masks = (stuck.stuck_at_zero | stuck.stuck_at_one).to(torch.int64)
        expected = torch.zeros(int(elements.max()) + 1, dtype=torch.int64).index_add_(0, elements, masks)
        got = torch.zeros_like(expected).index_add_(0, rows[:, 0], 1 << rows[:, 1])
        assert cells.shape[1] == rows[:, 0].unique().numel() and torch.equal(got, expected)


def test_cell_faults_stick_codes(models):
    _, model, x = models
    before, out = _snapshot(model), model(x).detach()
    names = _int8_names(model)
    pins = cell_faults(model, names, 0.1, seed=0)
    assert all(p.value.dtype == torch.int8 for p in pins)
    with forced_patch(model, pins) as patch:
        for p in pins:
            q = dict(model.named_parameters())[p.params].qdata
            assert torch.equal(q[tuple(p.indices.t())], p.value)
        assert _code_bits_only(before, model) == patch.changed_bits > 0
        assert not torch.equal(model(x), out)
    assert torch.equal(model(x), out)


def test_restore_on_error_and_float_weights_beside_int8_ones():
    float_model, model = _quantized(SmallCNN, Int8WeightOnlyConfig())
    conv_before = model.conv.weight.detach().clone()
    before = _snapshot(model)
    pins = bit_faults(model, "*weight", 0.05, seed=0)  # conv (float32 words) and fc (int8 codes)
    stuck = {p.params: int((p.stuck_at_zero | p.stuck_at_one).max()) for p in pins}
    assert stuck["fc1.weight"] <= 0xFF and pins[0].stuck_at_zero.dtype == torch.int32
    with pytest.raises(RuntimeError, match="boom"):
        with forced_patch(model, pins):
            assert not torch.equal(model.conv.weight, conv_before)
            raise RuntimeError("boom")
    assert torch.equal(model.conv.weight.detach().view(torch.int32), conv_before.view(torch.int32))
    assert all(torch.equal(_snapshot(model)[n][0], before[n][0]) for n in before)


def test_code_that_does_not_describe_int8_is_refused():
    _, model = _quantized(_mlp, Int8WeightOnlyConfig())
    with pytest.raises(PinError, match="stored as int8 codes; code=4"):
        bit_faults(model, "0.weight", 0.01, code=4)
    with pytest.raises(PinError, match="stored as int8 codes"):
        forced_patch(model, [Pin("0.weight", value=0.0)])


def test_float_code_pins_patch_code_bits_not_float_bits():
    """A code pin drawn on a float model is patched on its code (the kind's rewrite), not as float word bits."""
    torch.manual_seed(0)
    net = nn.Linear(32, 8)
    pins = bit_faults(net, "weight", 0.05, seed=0, code=8)
    with forced_patch(net, pins):
        inside = net.weight.detach().clone()
    code = pins[0].code
    s = code.scale.reshape(-1, 1)
    assert torch.equal(inside[tuple(pins[0].indices.t())], (torch.round(inside / s) * s)[tuple(pins[0].indices.t())])


def test_pinning_a_torchao_model_is_refused_in_one_line():
    _, model = _quantized(_mlp, Int8WeightOnlyConfig())
    before = _snapshot(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with pytest.raises(PinError, match="stored as int8 codes by torchao and is not trainable") as info:
        pin(model, opt, [Pin("0.weight", indices=[[0, 0]], value=0.0)])
    assert "\n" not in str(info.value)
    assert all(torch.equal(_snapshot(model)[n][0], before[n][0]) for n in before)


def test_pin_callback_on_a_torchao_model_is_refused_before_training():
    from helpers import TinyNet, make_loader, trainer

    from lightning_pin import PinCallback

    torch.manual_seed(0)
    lit = TinyNet()
    quantize_(lit, Int8WeightOnlyConfig())
    before = _snapshot(lit)
    callback = PinCallback([Pin("encoder.weight", indices=[[0, 0]], value=0.0)])
    with pytest.raises(PinError, match="'encoder.weight' is stored as int8 codes by torchao"):
        trainer(max_epochs=1, callbacks=[callback]).fit(lit, make_loader())
    assert all(torch.equal(_snapshot(lit)[n][0], before[n][0]) for n in before)


def test_changed_bits_of_int8_weights_counts_code_bits():
    _, model = _quantized(_mlp, Int8WeightOnlyConfig())
    before = copy.deepcopy(model[0].weight)
    with flip_bits(model, "0.weight", 0.05, seed=0) as flips:
        assert changed_bits(before, model[0].weight) == flips.flipped["0.weight"] > 0


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(2, 40), rate=st.sampled_from([0.0, 0.01, 0.2, 1.0]),
       seed=st.integers(0, 2**31), bits=st.sampled_from([None, "sign", 0, [1, 7]]))
def test_one_seed_draws_the_same_pairs_as_code8_on_the_float_model(rows, cols, rate, seed, bits):
    torch.manual_seed(seed % 1000)
    float_model = nn.Sequential(nn.Linear(cols, rows))
    model = copy.deepcopy(float_model)
    quantize_(model, Int8WeightOnlyConfig())
    a = bit_faults(model, "0.weight", rate, seed=seed, bits=bits)
    b = bit_faults(float_model, "0.weight", rate, seed=seed, bits=bits, code=8)
    assert a.faulty == b.faulty
    for p, q in zip(a, b):
        assert torch.equal(p.indices, q.indices) and torch.equal(p.stuck_at_zero, q.stuck_at_zero)
        assert torch.equal(p.stuck_at_one, q.stuck_at_one)
