"""``lightning-pin check``: do the pins a checkpoint saved still hold in exported models?

Real exports from the installed torch (both ONNX exporters, with and without the options that
keep pinned weights), safetensors and ``.pt`` state dicts, names with and without the module
prefix, a one-ulp change, and every usage error.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from helpers import trainer
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pin import Pin, PinCallback, PinError
from lightning_pin.cli import main
from lightning_pin.core.state import PinState, SavedSelection
from lightning_pin.reporting.check import CheckError, check_artifacts

# ONNX support is the 'export' extra (make test installs it); the other tests run without it.
needs_onnx = pytest.mark.skipif(importlib.util.find_spec("onnx") is None, reason="pip install 'lightning-pin[export]'")
needs_onnxscript = pytest.mark.skipif(
    importlib.util.find_spec("onnxscript") is None, reason="the dynamo exporter needs onnxscript (the 'export' extra)"
)

CELLS = [(0, 0, 0, 0), (1, 0, 1, 2), (2, 0, 2, 1), (3, 0, 0, 2), (0, 0, 2, 2)]
VALUES = [25.0, 5.0, 125.0, 2.58e8, 2.58e-8]
NAME = "net.conv1.weight"  # 4 x 1 x 3 x 3


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv1(x))).flatten(1))


class Lit(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = ConvBN()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def flat(coords) -> list[int]:
    """Row-major flat indices of cells of a 4 x 1 x 3 x 3 tensor."""
    return [sum(c * s for c, s in zip(cell, (9, 9, 3, 1))) for cell in coords]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A fit that forces five conv cells and freezes 20% of the layer; its checkpoint, callback and module."""
    out = tmp_path_factory.mktemp("check")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, 1, 6, 6, generator=g), torch.randint(0, 3, (24,), generator=g))
    lit = Lit()
    callback = PinCallback(
        [Pin(NAME, indices=CELLS, value=VALUES), Pin(NAME, fraction=0.2, seed=1)], verbose=False, monitor=False
    )
    fit = trainer(max_steps=3, callbacks=[callback])
    fit.fit(lit, DataLoader(data, batch_size=8))
    fit.save_checkpoint(out / "pinned.ckpt")
    callback.verify(lit)
    lit.eval()
    state = PinState.from_dict(callback.state_dict())
    pinned = sorted({i for sel in (state.pins[0][NAME], state.pins[1][NAME]) for i in sel.index.tolist()})
    return SimpleNamespace(out=out, ckpt=out / "pinned.ckpt", lit=lit, callback=callback, pinned=pinned)


def param_off(run, deployed: torch.Tensor) -> int:
    """Pinned elements of conv1.weight whose value in ``deployed`` is not the trained one."""
    trained = run.lit.net.conv1.weight.detach().reshape(-1)
    return sum(deployed.reshape(-1)[i].item() != trained[i].item() for i in run.pinned)


def export(module: nn.Module, path, **options) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation, tracer warnings
        torch.onnx.export(module, (torch.randn(2, 1, 6, 6),), str(path), verbose=False, **options)


def initializers(path) -> dict[str, torch.Tensor]:
    """An ONNX file's initializers, read with the onnx package directly."""
    import onnx
    from onnx import numpy_helper

    return {i.name: torch.from_numpy(numpy_helper.to_array(i).copy()) for i in onnx.load(str(path)).graph.initializer}


def check(capsys, *paths) -> tuple[int, str, str]:
    code = main(["check", *map(str, paths)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ----------------------------------------------------------------------------------------------
# ONNX: each exporter of the installed torch, folding and the option that keeps the pins


@pytest.fixture(scope="module")
def dynamo_exports(run):
    default, kept = run.out / "dynamo.onnx", run.out / "dynamo_keep.onnx"
    export(run.lit.net, default, dynamo=True)
    export(run.lit.net, kept, dynamo=True, optimize=False)
    return default, kept


@needs_onnx
@needs_onnxscript
def test_dynamo_exporter_folds_batchnorm_into_pinned_conv_and_optimize_false_keeps_it(run, dynamo_exports, capsys):
    default, kept = dynamo_exports
    # Exported `lit_module.net`: the artifact says conv1.weight where the pins say net.conv1.weight.
    assert "conv1.weight" in initializers(default) and NAME not in initializers(default)
    code, out, err = check(capsys, run.ckpt, default)
    assert (code, err) == (1, "")
    assert f"{NAME} (as 'conv1.weight')" in out and "OFF TARGET" in out
    assert "dynamo=True" in out and "optimize=False" in out and "FuseBatchNormIntoConv" in out

    result = check_artifacts(run.ckpt, default)
    (param,) = result.artifacts[0].parameters
    assert result.artifacts[0].exporter == "dynamo" and not result.holds
    assert param.tensor == "conv1.weight" and param.elements == len(run.pinned)
    folded = initializers(default)["conv1.weight"]
    trained = run.lit.net.conv1.weight.detach()
    assert param.off_target == param_off(run, folded) > 0
    # The values shown are the deployed ones; the targets, what training held.
    for element in param.shown:
        assert element.value == folded[element.position].item()
        assert element.target == trained[element.position].item()
    with pytest.raises(PinError, match="conv1.weight"):
        result.verify()

    code, out, err = check(capsys, run.ckpt, kept)
    assert (code, err) == (0, "")
    assert f"all {len(run.pinned)} pinned element(s) hold, bit for bit" in out
    assert check_artifacts(run.ckpt, kept).artifacts[0].exporter == "dynamo"


@needs_onnx
def test_torchscript_exporter_renames_the_folded_conv_and_do_constant_folding_false_keeps_it(run, capsys):
    folded, kept = run.out / "ts.onnx", run.out / "ts_keep.onnx"
    export(run.lit, folded, dynamo=False)  # the whole LightningModule: names as the pins say
    export(run.lit, kept, dynamo=False, do_constant_folding=False)
    renamed = [n for n in initializers(folded) if "Conv" in n]
    assert NAME not in initializers(folded) and len(renamed) == 2  # folded weight and bias

    code, out, err = check(capsys, run.ckpt, folded)
    assert (code, err) == (1, "")
    assert f"{NAME}, {len(run.pinned)} pinned element(s) (pins 0, 1): MISSING" in out
    assert "dynamo=False" in out and "do_constant_folding=False" in out
    (param,) = check_artifacts(run.ckpt, folded).artifacts[0].parameters
    assert param.problem == "missing" and param.off_target is None
    (weight,) = [n for n in renamed if initializers(folded)[n].shape == (4, 1, 3, 3)]
    (candidate,) = param.candidates  # the folded weight, under its new name
    assert (candidate.name, candidate.transposed) == (weight, False)
    assert candidate.off_target == param_off(run, initializers(folded)[weight]) > 0
    assert [e.value for e in candidate.shown] == [initializers(folded)[weight][e.position].item()
                                                  for e in candidate.shown]  # fmt: skip
    assert f"the only unmatched tensor of its shape, '{weight}', differs at {candidate.off_target} of them" in out

    code, out, err = check(capsys, run.ckpt, kept)
    assert (code, err) == (0, "") and "TorchScript exporter" in out


@needs_onnx
def test_linear_weights_stored_transposed_for_matmul(tmp_path, capsys):
    # With inputs of more than 2 dims (sequences), both exporters store a Linear weight transposed
    # for MatMul under a new name; the options that keep BatchNorm apart keep it too.
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).eval()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    pinned = saved([{"0.weight": (None, weights["0.weight"], False)}], weights=weights)
    torch.save(pinned, tmp_path / "pinned.ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, options in (("folded", {}), ("kept", {"do_constant_folding": False})):
            torch.onnx.export(model, (torch.randn(2, 5, 4),), str(tmp_path / f"{name}.onnx"), dynamo=False,
                              verbose=False, **options)  # fmt: skip
    assert "0.weight" not in initializers(tmp_path / "folded.onnx")
    code, out, _ = check(capsys, tmp_path / "pinned.ckpt", tmp_path / "folded.onnx")
    assert code == 1 and "0.weight, 12 pinned element(s) (pin 0): MISSING" in out
    (param,) = check_artifacts(tmp_path / "pinned.ckpt", tmp_path / "folded.onnx").artifacts[0].parameters
    (copy,) = [c for c in param.candidates if c.off_target == 0]
    assert copy.transposed and torch.equal(initializers(tmp_path / "folded.onnx")[copy.name].t(), weights["0.weight"])
    assert f"'{copy.name}' (transposed) holds every pinned element: a renamed copy of it?" in out
    assert "do_constant_folding=False" in out
    assert check(capsys, tmp_path / "pinned.ckpt", tmp_path / "kept.onnx")[0] == 0


@needs_onnx
def test_onnx_external_data_is_read_and_checked(run, tmp_path, capsys):
    import onnx

    source = tmp_path / "src.onnx"
    export(run.lit, source, dynamo=False, do_constant_folding=False)
    model = onnx.load(str(source))
    onnx.save_model(
        model, str(tmp_path / "ext.onnx"), save_as_external_data=True, location="weights.bin", size_threshold=0
    )
    assert check(capsys, run.ckpt, tmp_path / "ext.onnx")[0] == 0

    # One ulp at a forced cell, written into the external data file only.
    (init,) = [i for i in onnx.load(str(tmp_path / "ext.onnx"), load_external_data=False).graph.initializer
               if i.name == NAME]  # fmt: skip
    offset = int({e.key: e.value for e in init.external_data}["offset"]) + 4 * flat(CELLS[:1])[0]
    data = bytearray((tmp_path / "weights.bin").read_bytes())
    stored = torch.frombuffer(data[offset : offset + 4], dtype=torch.float32).clone()
    assert stored.item() == 25.0
    data[offset : offset + 4] = torch.nextafter(stored, torch.tensor(float("inf"))).numpy().tobytes()
    (tmp_path / "weights.bin").write_bytes(bytes(data))
    code, out, _ = check(capsys, run.ckpt, tmp_path / "ext.onnx")
    assert code == 1 and "1 OFF TARGET" in out and "[0, 0, 0, 0] = 25.000002, target 25" in out

    (tmp_path / "weights.bin").unlink()
    code, out, err = check(capsys, run.ckpt, tmp_path / "ext.onnx")
    assert (code, out) == (2, "") and "external data" in err and len(err.strip().splitlines()) == 1


# ----------------------------------------------------------------------------------------------
# State dicts: safetensors, .pt, .ckpt; names; one ulp


def test_safetensors_pt_and_ckpt_artifacts_hold(run, capsys):
    save_file({k: v.contiguous() for k, v in run.lit.state_dict().items()}, str(run.out / "lit.safetensors"))
    torch.save(run.lit.net.state_dict(), run.out / "net.pt")  # exported `lit_module.net`: no "net."
    torch.save({"model": run.lit.state_dict()}, run.out / "wrapped.pth")
    paths = [run.out / "lit.safetensors", run.out / "net.pt", run.out / "wrapped.pth", run.ckpt]
    code, out, err = check(capsys, run.ckpt, *paths)
    assert (code, err) == (0, "")
    assert out.count(f"all {len(run.pinned)} pinned element(s) hold") == 4
    result = check_artifacts(run.ckpt, paths)
    assert [a.kind for a in result.artifacts] == ["safetensors", "torch", "torch", "torch"]
    assert [a.parameters[0].tensor for a in result.artifacts] == [NAME, "conv1.weight", NAME, NAME]
    assert result.holds and result.elements == len(run.pinned)


def test_one_ulp_off_target_fails(run, tmp_path, capsys):
    weights = {k: v.clone() for k, v in run.lit.net.state_dict().items()}
    w = weights["conv1.weight"]
    w[CELLS[3]] = torch.nextafter(w[CELLS[3]], torch.tensor(float("inf")))  # 2.58e8 + 16: float32's spacing there
    captured = next(i for i in run.pinned if i not in flat(CELLS))
    w.view(-1)[captured] = torch.nextafter(w.view(-1)[captured], torch.tensor(float("-inf")))
    torch.save(weights, tmp_path / "net.pt")
    code, out, err = check(capsys, run.ckpt, tmp_path / "net.pt")
    assert (code, err) == (1, "")
    assert f"{NAME} (as 'conv1.weight')" in out and "2 OFF TARGET" in out
    assert "[3, 0, 0, 2] = 2.5800002e+08, target 2.58e+08" in out
    assert "ONNX" not in out and "note:" not in out  # exporter advice is for ONNX files only
    (param,) = check_artifacts(run.ckpt, tmp_path / "net.pt").artifacts[0].parameters
    assert param.off_target == 2
    assert sorted(e.position for e in param.shown) == sorted(
        [CELLS[3], tuple(torch.unravel_index(torch.tensor(captured), (4, 1, 3, 3)))]
    )


def test_pinned_file_with_a_handle_state(run, tmp_path, capsys):
    # The plain-loop front door saves {"model": ..., "pins": handle.state_dict()}, or the state alone.
    state = run.callback.state_dict()
    torch.save({"model": run.lit.state_dict(), "pins": state}, tmp_path / "loop.pt")
    torch.save(state, tmp_path / "pins.pt")
    torch.save(run.lit.net.state_dict(), tmp_path / "net.pt")
    for pinned in ("loop.pt", "pins.pt"):
        code, out, err = check(capsys, tmp_path / pinned, tmp_path / "net.pt")
        assert (code, err) == (0, ""), out
        assert f"2 checked pin(s) on 1 parameter(s), {len(run.pinned)} pinned element(s)" in out


def test_half_precision_export_rounds_pinned_values_away(run, tmp_path):
    torch.save({k: v.half() for k, v in run.lit.net.state_dict().items()}, tmp_path / "half.pt")
    (param,) = check_artifacts(run.ckpt, tmp_path / "half.pt").artifacts[0].parameters
    by_position = {e.position: e for e in param.shown}
    assert CELLS[4] in by_position and by_position[CELLS[4]].value == 0.0  # 2.58e-8 is below float16's range
    assert CELLS[0] not in by_position  # 25.0 is exact in float16


# ----------------------------------------------------------------------------------------------
# Names and merged pins, on hand-made pin states (no training)


def saved(pins, active=None, weights=None) -> dict:
    """A pin state as PinCallback saves it: ``pins`` is a list of {name: (index, target, explicit)}."""
    state = PinState(
        fingerprints=tuple(f"pin{i}" for i in range(len(pins))),
        pins=tuple({n: SavedSelection(*sel) for n, sel in p.items()} for p in pins),
        active=frozenset(range(len(pins)) if active is None else active),
        last_step_active=None,
    ).to_dict()
    return {"state_dict": weights or {}, "callbacks": {"PinCallback{test}": state}}


def test_an_explicit_value_wins_over_a_captured_one_on_the_same_element():
    w = torch.arange(6.0).reshape(2, 3)
    state = saved(
        [
            {"enc.w": (None, w.clone(), False)},  # freeze the layer as it was...
            {"enc.w": (torch.tensor([4]), torch.tensor([25.0]), True)},  # ...but force one element
        ]
    )
    deployed = w.clone()
    deployed.view(-1)[4] = 25.0
    result = check_artifacts(state, {"enc.w": deployed})
    assert result.holds and result.artifacts[0].parameters[0].elements == 6
    result = check_artifacts(state, {"enc.w": w})  # the forced element kept its old value
    (param,) = result.artifacts[0].parameters
    assert param.off_target == 1 and param.shown[0].position == (1, 1) and param.shown[0].target == 25.0


def test_prefix_matching_in_both_directions_and_ambiguity():
    w = torch.ones(3)
    both = {"enc.conv.w": w, "dec.conv.w": w * 2}
    pins = [{"enc.conv.w": (None, w.clone(), True)}]
    # The artifact drops leading module names, or adds some (a wrapper, torch.compile's _orig_mod).
    for artifact in ({"conv.w": w}, {"model.enc.conv.w": w}, {"_orig_mod.enc.conv.w": w, "_orig_mod.dec.conv.w": w}):
        result = check_artifacts(saved(pins, weights={"enc.conv.w": w}), artifact)
        assert result.holds, artifact
    # "conv.w" could be the decoder's: the trained model (the checkpoint's weights) has both.
    (param,) = check_artifacts(saved(pins, weights=both), {"conv.w": w}).artifacts[0].parameters
    assert param.off_target is None and "ambiguous" in param.problem and not param.holds
    # Two wrappers in one artifact: either could be it.
    (param,) = check_artifacts(saved(pins), {"a.enc.conv.w": w, "b.enc.conv.w": w}).artifacts[0].parameters
    assert "ambiguous" in param.problem
    # A name that only ends alike is not a match: "xconv.w" is not "conv.w".
    (param,) = check_artifacts(saved([{"conv.w": (None, w, True)}]), {"xconv.w": w}).artifacts[0].parameters
    assert param.problem == "missing"


def test_reshaped_missing_and_inactive_pins(capsys, tmp_path):
    w = torch.zeros(2, 3)
    state = saved(
        [{"a.w": (torch.tensor([0, 5]), torch.tensor([1.0, 2.0]), True)}, {"b.w": (None, w, True)}],
        active=[0],
        weights={"a.w": w, "b.w": w},
    )
    result = check_artifacts(state, {"a.w": torch.tensor([1.0, 0, 0, 0, 0, 2.0])})
    (param,) = result.artifacts[0].parameters  # pin 1 is not active: not checked
    assert "shape is (6,) in the artifact, (2, 3) in the trained model" in param.problem
    assert [(s.pin, s.reason) for s in result.skipped] == [(1, "not active at the last optimizer step")]
    torch.save(state, tmp_path / "pins.ckpt")
    torch.save({"b.w": w}, tmp_path / "other.pt")
    code, out, _ = check(capsys, tmp_path / "pins.ckpt", tmp_path / "other.pt")
    assert code == 1 and "a.w, 2 pinned element(s) (pin 0): MISSING" in out
    assert "pin 1: not checked, not active at the last optimizer step" in out


# ----------------------------------------------------------------------------------------------
# Usage errors: exit 2, one line, no traceback


def test_usage_errors_exit_2_with_one_line(run, tmp_path, capsys, monkeypatch):
    torch.save(run.lit.state_dict(), tmp_path / "weights.pt")
    (tmp_path / "model.txt").write_text("not a model")
    (tmp_path / "garbage.onnx").write_bytes(b"not an onnx model" * 4)
    corrupt = torch.load(run.ckpt, weights_only=True)
    key = next(k for k in corrupt["callbacks"] if k.startswith("PinCallback"))
    corrupt["callbacks"][key]["active"] = [7]
    torch.save(corrupt, tmp_path / "corrupt.ckpt")
    good = tmp_path / "weights.pt"
    (tmp_path / "empty.ckpt").write_bytes(b"")
    (tmp_path / "cut.ckpt").write_bytes(run.ckpt.read_bytes()[:400])
    (tmp_path / "empty.onnx").write_bytes(b"")
    cases = {
        "empty.ckpt is empty (0 bytes)": [tmp_path / "empty.ckpt", good],
        "cut.ckpt is truncated (400 bytes": [tmp_path / "cut.ckpt", good],
        "empty.onnx is empty (0 bytes)": [run.ckpt, tmp_path / "empty.onnx"],
        "does not exist": [tmp_path / "missing.ckpt", good],
        "missing.onnx does not exist": [run.ckpt, good, tmp_path / "missing.onnx"],
        "holds no pin state": [good, good],
        "unknown artifact type": [run.ckpt, tmp_path / "model.txt"],
        "is corrupt: 'active' names pins [7]": [tmp_path / "corrupt.ckpt", good],
    }
    if importlib.util.find_spec("onnx") is not None:
        cases["as an ONNX model"] = [run.ckpt, tmp_path / "garbage.onnx"]
    for expected, paths in cases.items():
        code, out, err = check(capsys, *paths)
        assert (code, out) == (2, ""), expected
        assert err.startswith("lightning-pin check: error: ") and expected in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    with pytest.raises(CheckError, match="unknown artifact type"):
        check_artifacts(run.ckpt, [tmp_path / "model.txt"])

    monkeypatch.setitem(sys.modules, "onnx", None)  # as if the extra were not installed
    code, out, err = check(capsys, run.ckpt, tmp_path / "garbage.onnx")
    assert (code, out) == (2, "") and "pip install 'lightning-pin[export]'" in err
    assert len(err.strip().splitlines()) == 1
