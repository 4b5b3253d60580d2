"""``lightning-pin check`` / ``diff`` verify stuck code bits on stored float weights: the scale from
the pin state (fixed scales) or read from the artifact itself (a learned, named scale).

A plain loop trains a tiny net whose conv weights hold int8 code faults (a fixed scale) and whose
head holds int4 code faults (a learned per-channel scale); exports are checked as they are, with
one stuck code bit undone, and with one free code bit changed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lightning_pin import QuantCode, pin
from lightning_pin.cli import main
from lightning_pin.faults import bit_faults, quantize

CONV = QuantCode(bits=8, scale=2.0**-7)
HEAD = QuantCode(bits=4, scale="head_scale", axis=0)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.head = nn.Linear(4 * 4 * 4, 3)
        self.head_scale = nn.Parameter(torch.full((3,), 2.0**-6))

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("check_codes")
    torch.manual_seed(0)
    net = Net()
    conv = bit_faults(net, "conv.weight", rate=0.1, code=CONV, seed=1)
    head = bit_faults(net, "head.weight", rate=0.05, code=HEAD, seed=2)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.02)
    with quantize(net, "conv.weight", CONV), quantize(net, "head.weight", HEAD):
        with pin(net, optimizer, [*conv, *head]) as handle:
            for _ in range(4):
                net(torch.randn(8, 1, 6, 6)).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            handle.verify()
            state = handle.state_dict()
    assert not torch.equal(net.head_scale.detach(), torch.full((3,), 2.0**-6))  # the scale trained
    weights = {k: v.detach().clone() for k, v in net.state_dict().items()}
    torch.save({"state_dict": weights, "pins": state}, out / "pinned.ckpt")
    return SimpleNamespace(out=out, weights=weights, conv=conv[0], head=head[0], ckpt=out / "pinned.ckpt")


def check(capsys, *paths) -> tuple[int, str]:
    code = main(["check", *map(str, paths)])
    return code, capsys.readouterr().out


def undo(weights: dict, name: str, p, scale: torch.Tensor, which: str) -> tuple[dict, tuple[int, ...], int]:
    """A copy of ``weights`` with one faulty element's code changed: its stuck bit undone, or a free bit flipped."""
    changed = {k: v.clone() for k, v in weights.items()}
    coords = tuple(int(c) for c in p.indices[0])
    zero, one = int(p.stuck_at_zero[0]), int(p.stuck_at_one[0])
    stuck = zero | one
    bits = p.code.bits
    bit = (stuck.bit_length() - 1) if which == "stuck" else next(b for b in range(bits - 1) if not stuck >> b & 1)
    w = changed[name][coords]
    q = int(torch.round(w / scale)) & ((1 << bits) - 1)
    q ^= 1 << bit
    signed = q - (1 << bits) if q >> (bits - 1) else q
    changed[name][coords] = signed * scale
    return changed, coords, 1 << bit


def test_faithful_exports_hold(run, capsys):
    save_file(run.weights, str(run.out / "model.safetensors"))
    torch.save(run.weights, run.out / "model.pt")
    code, out = check(capsys, run.ckpt, run.out / "model.safetensors", run.out / "model.pt")
    assert code == 0, out
    assert "OK: every pin holds in 2 artifact(s)" in out


def test_a_stuck_code_bit_undone_is_named_and_a_free_one_is_not(run, capsys):
    scale = torch.tensor(2.0**-7)
    broken, coords, bit = undo(run.weights, "conv.weight", run.conv, scale, "stuck")
    save_file(broken, str(run.out / "stuck.safetensors"))
    code, out = check(capsys, run.ckpt, run.out / "stuck.safetensors")
    assert code == 1, out
    assert "conv.weight" in out and "1 OFF TARGET" in out
    assert f"{list(coords)} = " in out and f"wrong: 0x{bit:02x}" in out
    free, _, _ = undo(run.weights, "conv.weight", run.conv, scale, "free")
    save_file(free, str(run.out / "free.safetensors"))
    assert check(capsys, run.ckpt, run.out / "free.safetensors")[0] == 0


def test_a_learned_scale_is_read_from_the_artifact(run, capsys):
    channel = int(run.head.indices[0][0])
    scale = run.weights["head_scale"][channel]
    broken, coords, bit = undo(run.weights, "head.weight", run.head, scale, "stuck")
    torch.save(broken, run.out / "head.pt")
    code, out = check(capsys, run.ckpt, run.out / "head.pt")
    assert code == 1 and "head.weight" in out and f"{list(coords)} = " in out and f"wrong: 0x{bit:02x}" in out
    # The artifact's own scale decides: another scale beside the same weights breaks the codes.
    rescaled = dict(run.weights, head_scale=run.weights["head_scale"] * 3)
    torch.save(rescaled, run.out / "rescaled.pt")
    assert check(capsys, run.ckpt, run.out / "rescaled.pt")[0] == 1
    # Without its scale the codes cannot be read: said, not passed.
    torch.save({k: v for k, v in run.weights.items() if k != "head_scale"}, run.out / "noscale.pt")
    code, out = check(capsys, run.ckpt, run.out / "noscale.pt")
    assert code == 1 and "head_scale" in out, out


def test_diff_checks_codes_in_b(run, capsys):
    base = {"state_dict": run.weights, "pins": torch.load(run.ckpt, weights_only=True)["pins"]}
    torch.save(base, run.out / "a.ckpt")
    broken, coords, bit = undo(run.weights, "conv.weight", run.conv, torch.tensor(2.0**-7), "stuck")
    torch.save(dict(base, state_dict=broken), run.out / "b.ckpt")
    assert main(["diff", str(run.out / "a.ckpt"), str(run.out / "a.ckpt")]) == 0
    capsys.readouterr()
    assert main(["diff", str(run.out / "a.ckpt"), str(run.out / "b.ckpt")]) == 1
    out = capsys.readouterr().out
    assert "stuck code bits): 1 element(s) OFF TARGET" in out and f"wrong: 0x{bit:02x}" in out
