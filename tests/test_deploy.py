"""Trained codes to deployed int8 artifacts: to_torchao / to_onnx write the codes the code pins held; check reads
them."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("torchao")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from lightning_pin import PinError, QuantCode, pin  # noqa: E402
from lightning_pin.deploy import to_onnx, to_torchao, trained_codes  # noqa: E402
from lightning_pin.faults import bit_faults, quantize  # noqa: E402
from lightning_pin.faults.quantize import weight_code  # noqa: E402
from lightning_pin.reporting.check import check_artifacts  # noqa: E402
from test_deploy_faults import SmallCNN  # noqa: E402  (the same small CNN the fault tests quantize)




def _codes(model, variant):
    """The code of each weight for one variant (the fc weights per channel, per tensor with zero point, or int4)."""
    if variant == "int8-per-channel":
        return {n: weight_code(p, 8, n) for n, p in model.named_parameters() if n.endswith("weight")}
    if variant == "int8-zero-point":
        return {n: QuantCode(8, scale=float(p.detach().abs().max()) / 100, zero_point=7)
                for n, p in model.named_parameters() if n.endswith("weight")}
    return {n: QuantCode(4, scale=float(p.detach().abs().max()) / 6) for n, p in model.named_parameters()
            if n.endswith("weight")}


def _qat(variant):
    """A small CNN trained a few steps with quantize() and code pins (stuck code bits) on every weight."""
    torch.manual_seed(0)
    model = SmallCNN()
    codes = _codes(model, variant)
    pins = []
    for name, code in codes.items():
        quantize(model, name, code)
        pins += bit_faults(model, name, 0.05, seed=3, code=code)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    handle = pin(model, opt, pins)
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    for _ in range(5):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.eval(), codes, pins, handle


VARIANTS = ["int8-per-channel", "int8-zero-point", "int4-per-tensor"]


@pytest.fixture(scope="module", params=VARIANTS)
def trained(request, tmp_path_factory):
    model, codes, pins, handle = _qat(request.param)
    path = tmp_path_factory.mktemp(request.param) / "model.onnx"
    x = torch.randn(4, 1, 8, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        to_onnx(model, path, x[:1])
    return request.param, model, codes, pins, handle, path, x, caught


def _stuck_hold(stored, pin_, bits):
    """Every stuck code bit of ``pin_`` reads as stuck in ``stored`` (integer codes in the weight's shape)."""
    at = stored[tuple(pin_.indices.t())].to(torch.int64) & ((1 << bits) - 1)
    zero, one = pin_.stuck_at_zero.to(torch.int64), pin_.stuck_at_one.to(torch.int64)
    return torch.equal(at & zero, torch.zeros_like(at)) and torch.equal(at & one, one)


def test_trained_codes_hold_the_stuck_bits_and_are_the_forward_codes(trained):
    _, model, codes, pins, _, _, x, _ = trained
    coded = trained_codes(model)  # the live quantize() calls
    assert set(coded) == set(codes)
    for p in pins:
        assert _stuck_hold(coded[p.params].codes, p, p.code.bits)
    # the codes dequantize to what the fake-quantized forward reads, bit for bit
    for name, weight in coded.items():
        seen = {}
        owner = model.get_submodule(name.rpartition(".")[0])
        hook = owner.register_forward_pre_hook(lambda m, a: seen.update(w=m.weight.detach().clone()))
        model(x)
        hook.remove()
        assert torch.equal(weight.dequantized(torch.float32), seen["w"])


def test_onnx_holds_the_codes_in_integer_initializers_and_runs(trained):
    variant, model, codes, pins, _, path, x, caught = trained
    graph = onnx.load(str(path))
    onnx.checker.check_model(graph)
    inits = {i.name: i for i in graph.graph.initializer}
    expected_type = onnx.TensorProto.INT4 if variant.startswith("int4") else onnx.TensorProto.INT8
    coded = trained_codes(model)
    for name in codes:
        assert inits[name].data_type == expected_type
        stored = torch.from_numpy(onnx.numpy_helper.to_array(inits[name]).astype("int64"))
        assert torch.equal(stored, coded[name].codes.to(torch.int64))
        zp = onnx.numpy_helper.to_array(inits[f"{name}_zero_point"]).astype("int64")
        assert set(zp.reshape(-1).tolist()) == {codes[name].zero_point}
    for p in pins:
        stored = torch.from_numpy(onnx.numpy_helper.to_array(inits[p.params]).astype("int64"))
        assert _stuck_hold(stored, p, p.code.bits)
    dq = [n for n in graph.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == len(codes)
    axes = {n.input[0]: [a.i for a in n.attribute if a.name == "axis"] for n in dq}
    assert axes["fc1.weight"] == ([0] if variant == "int8-per-channel" else [])
    session = ort.InferenceSession(str(path))
    for row in range(x.shape[0]):
        got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x[row:row + 1].numpy()})[0])
        want = model(x[row:row + 1]).detach()
        assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())
    assert not [w for w in caught if "without a code" in str(w.message)]  # every weight had a code


def test_to_torchao_writes_the_trained_codes_or_refuses_in_one_line(trained):
    variant, model, codes, pins, _, _, x, _ = trained
    linear = {n: c for n, c in codes.items() if n.startswith("fc")}
    if variant != "int8-per-channel":
        with pytest.raises(PinError, match="fc1.weight") as info:
            to_torchao(model, linear)
        assert "\n" not in str(info.value)
        return
    with pytest.raises(PinError, match=r"conv\.weight \(a weight of Conv2d"):
        to_torchao(model)  # torchao has no int8 convolution
    int8 = to_torchao(model, linear)
    coded = trained_codes(model, linear)
    for name in linear:
        w = dict(int8.named_parameters())[name]
        assert w.qdata.dtype == torch.int8 and torch.equal(w.qdata.to(torch.int32), coded[name].codes)
        assert torch.equal(w.scale.reshape(-1), coded[name].scale)
    for p in pins:
        if p.params in linear:
            assert _stuck_hold(dict(int8.named_parameters())[p.params].qdata, p, 8)
    assert model.fc1.weight.dtype == torch.float32 and not hasattr(model.fc1.weight, "qdata")  # a copy
    got = int8(x).detach()
    want = model(x).detach()
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())


def test_check_reads_stored_codes_and_names_an_edited_one(trained, tmp_path):
    variant, model, codes, pins, handle, path, _, _ = trained
    state = {"pins": handle.state_dict()}
    assert check_artifacts(state, path).holds
    coded = trained_codes(model)
    ints = {name: w.codes.to(torch.int8) for name, w in coded.items()}
    assert check_artifacts(state, ints).holds
    assert check_artifacts(state, model.state_dict()).holds  # a float artifact still works as before
    # one stuck code bit edited away in the stored integers
    p = pins[0]
    element = tuple(int(i) for i in p.indices[0])
    mask = int(p.stuck_at_zero[0] | p.stuck_at_one[0])
    edited = dict(ints)
    edited[p.params] = ints[p.params].clone()
    edited[p.params][element] = int(edited[p.params][element]) ^ (mask & -mask)
    if p.code.bits == 4:  # stay within an int4 code
        edited[p.params][element] = ((int(edited[p.params][element]) + 8) % 16) - 8
    result = check_artifacts(state, edited)
    assert not result.holds
    text = "\n".join(result.lines())
    assert p.params in text and str(list(element)) in text and "stored code 0x" in text and "expected code" in text
    # the same edit in the ONNX initializer
    graph = onnx.load(str(path))
    for init in graph.graph.initializer:
        if init.name == p.params:
            kind = init.data_type
            new = onnx.helper.make_tensor(p.params, kind, list(init.dims), edited[p.params].reshape(-1).tolist())
            init.CopyFrom(new)
    bad = tmp_path / "edited.onnx"
    onnx.save(graph, str(bad))
    result = check_artifacts(state, bad)
    assert not result.holds and str(list(element)) in "\n".join(result.lines())


def test_torchao_state_dict_file_is_checked(tmp_path):
    model, codes, pins, handle = _qat("int8-per-channel")
    linear = {n: c for n, c in codes.items() if n.startswith("fc")}
    int8 = to_torchao(model, linear)
    torch.save(int8.state_dict(), tmp_path / "int8.pt")
    torch.save({"pins": handle.state_dict()}, tmp_path / "pins.pt")
    result = check_artifacts(tmp_path / "pins.pt", tmp_path / "int8.pt")
    assert result.holds, result.lines()
    p = next(p for p in pins if p.params == "fc1.weight")
    element = tuple(int(i) for i in p.indices[0])
    mask = int(p.stuck_at_zero[0] | p.stuck_at_one[0])
    int8.fc1.weight.qdata[element] ^= mask & -mask
    torch.save(int8.state_dict(), tmp_path / "edited.pt")
    result = check_artifacts(tmp_path / "pins.pt", tmp_path / "edited.pt")
    assert not result.holds and str(list(element)) in "\n".join(result.lines())


def test_weight_without_a_code_is_named_and_stays_float(tmp_path):
    torch.manual_seed(0)
    model = SmallCNN().eval()
    code = weight_code(model.fc1.weight, 8, "fc1.weight")
    with pytest.warns(UserWarning, match=r"2 weight\(s\) without a code stay float: conv\.weight, fc2\.weight"):
        to_onnx(model, tmp_path / "m.onnx", torch.zeros(1, 1, 8, 8), codes={"fc1.weight": code})
    inits = {i.name: i.data_type for i in onnx.load(str(tmp_path / "m.onnx")).graph.initializer}
    assert inits["fc1.weight"] == onnx.TensorProto.INT8 and inits["fc2.weight"] == onnx.TensorProto.FLOAT


def test_deploy_is_not_imported_by_lightning_pin():
    code = ("import sys, lightning_pin, lightning_pin.faults, lightning_pin.reporting.check; "
            "print(lightning_pin.__file__); "
            "print(sorted(m for m in ('torchao', 'onnx', 'onnxruntime', 'lightning_pin.deploy') if m in sys.modules))")
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": root})
    where, loaded = out.stdout.strip().splitlines()
    assert where.startswith(root) and loaded == "[]"


@pytest.mark.parametrize("code", [
    QuantCode(8, 0.01, zero_point=128, signed=False),
    QuantCode(4, 0.1, zero_point=3, signed=False),
    QuantCode(12, 0.001),
    QuantCode(6, torch.linspace(0.01, 0.03, 16), axis=1),
], ids=repr)
def test_every_code_type_runs_in_onnx_runtime(code, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8)).eval()
    to_onnx(model, tmp_path / "m.onnx", torch.zeros(1, 16), codes={"0.weight": code})
    init = next(i for i in onnx.load(str(tmp_path / "m.onnx")).graph.initializer if i.name == "0.weight")
    types = {(8, False): "UINT8", (4, False): "UINT4", (12, True): "INT16", (6, True): "INT8"}
    expected = types[code.bits, code.signed]
    assert onnx.TensorProto.DataType.Name(init.data_type) == expected
    stored = torch.from_numpy(onnx.numpy_helper.to_array(init).astype("int64"))
    coded = trained_codes(model, {"0.weight": code})["0.weight"]
    assert torch.equal(stored, coded.codes.to(torch.int64))
    session = ort.InferenceSession(str(tmp_path / "m.onnx"))
    x = torch.randn(1, 16)
    got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
    want = (x @ coded.dequantized(torch.float32).t() + model[0].bias).detach()
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())


def test_check_artifacts_reads_the_code_pins_themselves():
    """``check_artifacts(pins, {name: int8 tensor})`` with the Pin list bit_faults drew."""
    model, codes, pins, _ = _qat("int8-per-channel")
    ints = {name: w.codes.to(torch.int8) for name, w in trained_codes(model).items()}
    result = check_artifacts(list(pins), ints)
    assert result.holds and result.elements == sum(p.indices.shape[0] for p in pins)
    p = pins[1]
    element = tuple(int(i) for i in p.indices[0])
    mask = int(p.stuck_at_zero[0] | p.stuck_at_one[0])
    ints[p.params][element] = int(ints[p.params][element]) ^ (mask & -mask) if mask & -mask != 0x80 else \
        int(ints[p.params][element]) ^ -128
    result = check_artifacts(list(pins), ints)
    assert not result.holds and f"{p.params}" in "\n".join(result.lines())
    assert str(list(element)) in "\n".join(result.lines())
    with pytest.raises(PinError, match="code pins with indices"):
        check_artifacts([pin_ for pin_ in bit_faults(model, "fc1.weight", 0.01, seed=0)], ints)


def test_live_code_pins_give_the_codes_without_quantize():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    code = QuantCode(8, 0.01)
    pins = bit_faults(model, "0.weight", 0.1, code=code, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(PinError, match="no weight of the model carries a code"):
        trained_codes(model)
    with pin(model, opt, pins):
        coded = trained_codes(model)
        assert list(coded) == ["0.weight"] and coded["0.weight"].code.bits == 8
        assert _stuck_hold(coded["0.weight"].codes, pins[0], 8)
        int8 = to_torchao(model)
        assert torch.equal(int8[0].weight.qdata.to(torch.int32), coded["0.weight"].codes)
    with pytest.raises(PinError, match="no weight of the model carries a code"):
        trained_codes(model)  # the handle is removed
