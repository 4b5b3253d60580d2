"""The app and the CLI with stuck bits of integer codes: ``pin=bit_faults pin.code_bits=8`` and
``lightning-pin faults --kind bit --code-bits 8``: the faults are drawn over each weight's int8
code (per-channel scales from the pretrained weights) and held exactly through retraining."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import torch
from test_train_app import TINY, run, state_dict

from lightning_pin import cli
from lightning_pin.app.models import Classifier, SmallCNN
from lightning_pin.faults import bit_faults

CONVS = "backbone.features.*.weight"


def test_the_app_holds_stuck_bits_of_int8_codes(tmp_path, fork_runner):
    args = [sys.executable, "-m", "lightning_pin.train", *TINY, "pin=bit_faults", "pin.code_bits=8", "pin.rate=0.01",
            "pin.seed=1", f"hydra.run.dir={tmp_path}"]
    result = run(args, cwd=tmp_path, runner=fork_runner)
    assert result.returncode == 0, result.output
    assert "bit faults (rate 0.01, one_fraction 0.5, seed 1, int8 codes per channel)" in result.output
    model = Classifier(SmallCNN())
    model.load_state_dict(state_dict(tmp_path / "pretrained.ckpt"))
    pinned = state_dict(tmp_path / "pinned.ckpt")
    pins = bit_faults(model, CONVS, rate=0.01, code=8, seed=1)  # the same draw, on the pretrained weights
    assert len(pins) == 2
    for p in pins:
        w = pinned[p.params][tuple(p.indices.T)]
        s = p.code.scale[p.indices[:, 0]]
        q = torch.round(w / s)
        assert torch.equal(w, q * s)
        pattern = q.long() & 0xFF
        assert torch.equal(pattern & (p.stuck_at_zero | p.stuck_at_one), p.stuck_at_one.long())


def test_lightning_pin_faults_with_code_bits(tmp_path, fork_runner, capsys):
    out = tmp_path / "study"
    args = [sys.executable, "-m", "lightning_pin.cli", "faults", "--kind", "bit", "--code-bits", "8", "--rates",
            "0,0.02", "--seeds", "1", "--out", str(out), *TINY]
    result = run(args, cwd=tmp_path, runner=fork_runner, timeout=400)
    assert result.returncode == 0, result.output
    rows = list(csv.DictReader((out / "fault_curve.csv").open()))
    faulty = [r for r in rows if float(r["rate"]) > 0]
    assert faulty and all(r["pins_exact"] == "true" and "pin.code_bits=8" in r["recipe"] for r in faulty), rows
    # A code for another kind of fault is a usage error: one line, exit 2.
    assert cli.main(["faults", "--kind", "cell", "--code-bits", "8", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "integer codes are for --kind bit" in err[0]
    assert cli.main(["faults", "--kind", "bit", "--code-bits", "20", "--out", str(tmp_path / "x")]) == 2
    assert "codes have 2 to 16 bits" in capsys.readouterr().err
    assert not Path(tmp_path / "x").exists()


def test_a_test_time_campaign_with_code_bits_reads_the_codes(tmp_path, fork_runner):
    out = tmp_path / "study"
    args = [sys.executable, "-m", "lightning_pin.cli", "faults", "--kind", "bit", "--code-bits", "8", "--rates",
            "0,0.02", "--seeds", "1", "--no-retrain", "--out", str(out), *TINY]
    result = run(args, cwd=tmp_path, runner=fork_runner, timeout=400)
    assert result.returncode == 0, result.output
    rows = {float(r["rate"]): r for r in csv.DictReader((out / "fault_curve.csv").open())}
    assert rows[0.0]["forced"] == rows[0.0]["baseline"] and int(rows[0.02]["pinned_elements"]) > 0


def test_quantize_codes_gives_each_weight_its_own_per_channel_code():
    from lightning_pin.faults import quantize_codes
    from lightning_pin.faults.quantize import weight_code

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    x = torch.randn(5, 6)
    deq = []
    for layer in (net[0], net[2]):
        w = layer.weight.detach()
        s = (w.abs().amax(dim=1) / 127).reshape(-1, 1)
        deq.append(torch.clamp(torch.round(w / s), -128, 127) * s)
        assert torch.equal(weight_code(w, 8).scale, s.reshape(-1))
    expected = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, deq[0], net[0].bias)), deq[1],
                                          net[2].bias)
    handles = quantize_codes(net, "*.weight", 8)
    assert len(handles) == 2 and torch.equal(net(x), expected)
