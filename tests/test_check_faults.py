"""``lightning-pin check`` and ``diff`` verify stuck bits (on the stored words) and bounds (by value) in artifacts.

A plain loop with ``pin()`` trains a tiny CNN whose conv weights hold bit faults, whose head holds
cell faults and bounded cells; its weights and pin state are saved; exports are then checked as
they are, and with one stuck bit flipped, one free bit flipped, one bound broken.
"""

from __future__ import annotations

import importlib.util
import warnings
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lightning_pin import Pin, PinError, pin
from lightning_pin.cli import main
from lightning_pin.faults import bit_faults, cell_faults
from lightning_pin.reporting.check import check_artifacts

needs_onnx = pytest.mark.skipif(importlib.util.find_spec("onnx") is None, reason="pip install 'lightning-pin[export]'")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("check_faults")
    torch.manual_seed(0)
    net = Net()
    pins = [
        *bit_faults(net, "conv.weight", rate=0.1, bits=["sign", 23, 24, 25], seed=1),  # no huge values
        *cell_faults(net, "head.weight", rate=0.1, seed=2),
        Pin("head.bias", bounds=(-0.01, 0.01)),
        Pin("conv.bias", indices=[0, 2], bounds=(0.0, 0.02)),
    ]
    optimizer = torch.optim.Adam(net.parameters(), lr=0.05)
    with pin(net, optimizer, pins) as handle:
        for _ in range(3):
            net(torch.randn(8, 1, 6, 6)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        handle.verify()
        state = handle.state_dict()
    net.eval()
    weights = {k: v.detach().clone() for k, v in net.state_dict().items()}
    torch.save({"state_dict": weights, "pins": state}, out / "pinned.ckpt")
    return SimpleNamespace(out=out, net=net, weights=weights, bits=pins[0], ckpt=out / "pinned.ckpt")


def check(capsys, *paths) -> tuple[int, str]:
    code = main(["check", *map(str, paths)])
    return code, capsys.readouterr().out


def flip(weights: dict, name: str, position: tuple, bit: int) -> dict:
    """A copy of ``weights`` with one bit of one float32 element flipped."""
    changed = {k: v.clone() for k, v in weights.items()}
    words = changed[name].view(torch.int32)
    words[position] ^= torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32)
    return changed


def a_stuck_bit(run) -> tuple[tuple[int, ...], int, int]:
    """An element of the conv with a stuck bit: its coordinates, a stuck bit and a free bit."""
    zero, one = run.bits.stuck_at_zero[0].item(), run.bits.stuck_at_one[0].item()
    stuck = (zero | one) & 0xFFFFFFFF
    bit = stuck.bit_length() - 1
    free = next(b for b in range(23) if not stuck >> b & 1)  # mantissa bits are never stuck here
    return tuple(run.bits.indices[0].tolist()), bit, free


def test_faithful_artifacts_hold(run, capsys):
    save_file(run.weights, str(run.out / "model.safetensors"))
    torch.save(run.weights, run.out / "model.pt")
    code, out = check(capsys, run.ckpt, run.out / "model.safetensors", run.out / "model.pt")
    assert code == 0, out
    assert "OK: every pin holds in 2 artifact(s)" in out
    result = check_artifacts(run.ckpt, run.out / "model.pt")
    elements = {p.name: p.elements for p in result.artifacts[0].parameters}
    assert elements == {"conv.weight": len(run.bits.indices), "head.weight": 19, "head.bias": 3, "conv.bias": 2}


def test_a_flipped_stuck_bit_is_named_and_a_flipped_free_bit_is_not(run, capsys):
    position, stuck, free = a_stuck_bit(run)
    save_file(flip(run.weights, "conv.weight", position, stuck), str(run.out / "stuck.safetensors"))
    code, out = check(capsys, run.ckpt, run.out / "stuck.safetensors")
    assert code == 1
    assert "conv.weight" in out and "1 OFF TARGET" in out
    assert f"{list(position)} = " in out and f"wrong: 0x{1 << stuck:08x}" in out
    # The free bits of a bit-pinned element belong to training: another value there still holds.
    save_file(flip(run.weights, "conv.weight", position, free), str(run.out / "free.safetensors"))
    assert check(capsys, run.ckpt, run.out / "free.safetensors")[0] == 0


def test_a_bound_broken_is_named_with_its_interval(run, capsys):
    broken = {k: v.clone() for k, v in run.weights.items()}
    broken["conv.bias"][2] = 0.5
    torch.save(broken, run.out / "broken.pt")
    code, out = check(capsys, run.ckpt, run.out / "broken.pt")
    assert code == 1 and "conv.bias" in out and "[2] = 0.5, bounds [0.0, 0.019999999552965164]" in out
    with pytest.raises(PinError, match=r"conv.bias.*\n.*\[2\] = 0.5"):
        check_artifacts(run.ckpt, run.out / "broken.pt").verify()


def test_stuck_bits_in_an_artifact_of_another_width_cannot_hold(run, capsys):
    torch.save({k: v.half() for k, v in run.weights.items()}, run.out / "half.pt")
    code, out = check(capsys, run.ckpt, run.out / "half.pt")
    assert code == 1
    assert "it is stored as float16 in the artifact: its stuck bits are bits of a 32-bit word" in out


@needs_onnx
def test_onnx_export_faithful_then_one_stuck_bit_flipped(run, capsys):
    import onnx
    from onnx import numpy_helper

    path = run.out / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(run.net, (torch.randn(2, 1, 6, 6),), str(path), dynamo=False, verbose=False)
    code, out = check(capsys, run.ckpt, path)
    assert code == 0, out

    position, stuck, _ = a_stuck_bit(run)
    model = onnx.load(str(path))
    (init,) = [i for i in model.graph.initializer if i.name == "conv.weight"]
    array = numpy_helper.to_array(init).copy()
    words = array.view("int32")
    words[position] ^= (1 << stuck) if stuck < 31 else -(1 << 31)
    init.CopyFrom(numpy_helper.from_array(array, "conv.weight"))
    onnx.save(model, str(run.out / "flipped.onnx"))
    code, out = check(capsys, run.ckpt, run.out / "flipped.onnx")
    assert code == 1
    assert f"{list(position)} = " in out and f"wrong: 0x{1 << stuck:08x}" in out and "1 OFF TARGET" in out


def test_diff_checks_stuck_bits_and_bounds_in_b(run, capsys):
    position, stuck, free = a_stuck_bit(run)
    base = {"state_dict": run.weights, "pins": torch.load(run.ckpt, weights_only=True)["pins"]}
    torch.save(base, run.out / "a.ckpt")
    torch.save(dict(base, state_dict=flip(run.weights, "conv.weight", position, free)), run.out / "free.ckpt")
    assert main(["diff", str(run.out / "a.ckpt"), str(run.out / "free.ckpt")]) == 0
    capsys.readouterr()
    torch.save(dict(base, state_dict=flip(run.weights, "conv.weight", position, stuck)), run.out / "b.ckpt")
    assert main(["diff", str(run.out / "a.ckpt"), str(run.out / "b.ckpt")]) == 1
    out = capsys.readouterr().out
    assert f"on conv.weight ({len(run.bits.indices)} elements, stuck bits): 1 element(s) OFF TARGET" in out
    # The element and its word, as `check` names them.
    assert f"{list(position)} = " in out and f"wrong: 0x{1 << stuck:08x}" in out
    assert "on head.bias (3 elements, bounds): holds" in out
