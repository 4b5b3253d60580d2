"""Every command's and example's default output lands under ``outputs/`` (as the app's runs do), which git ignores:
nothing a default writes shows up in ``git status``."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from lightning_pin import cli

ROOT = Path(__file__).resolve().parents[1]


def ignored(path: str) -> bool:
    """Does the repository's .gitignore ignore ``path`` (relative to the repository's root)?"""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and the repository")
    result = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT, capture_output=True)
    return result.returncode == 0


def test_tune_writes_under_outputs():
    from lightning_pin.app.tune import default_out

    out = default_out()
    assert out.parts[:2] == ("outputs", "tune") and ignored(str(out / "tune.db"))


def test_faults_writes_under_outputs(tmp_path, monkeypatch, capsys):
    from lightning_pin.app import study

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(study, "_baseline", lambda *args: None)  # stop right after the study's directory is made
    assert cli.main(["faults", "--rates", "0", "--seeds", "1"]) == 1
    (made,) = [p.relative_to(tmp_path) for p in tmp_path.glob("*/*/*/*")]
    assert made.parts[:2] == ("outputs", "faults") and ignored(str(made / "fault_curve.csv"))
    assert f"into {made}" in capsys.readouterr().out


def test_the_continual_example_writes_under_outputs():
    tree = ast.parse((ROOT / "examples" / "continual_packnet.py").read_text())
    (default,) = [
        kw.value.value for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "attr", "")
        == "add_argument" and node.args and getattr(node.args[0], "value", None) == "--out"
        for kw in node.keywords if kw.arg == "default"
    ]
    assert default.startswith("outputs/") and ignored(f"{default}/continual_report.json")


def test_export_writes_into_the_run_directory_by_default(tmp_path, monkeypatch, capsys):
    from lightning_pin.app import export

    # The model is a stand-in: where the file goes is the point, not what it holds (tests/test_train_app.py).
    monkeypatch.setattr(export, "load_run_model", lambda run_dir: torch.nn.Linear(2, 1))
    run = tmp_path / "outputs" / "2026-01-01" / "00-00-00"
    run.mkdir(parents=True)
    assert cli.main(["export", str(run)]) == 0
    assert (run / "model.safetensors").is_file() and f"wrote {run / 'model.safetensors'}" in capsys.readouterr().out
    assert ignored("outputs/2026-01-01/00-00-00/model.safetensors")


@pytest.mark.parametrize("legacy", ["faults/x/fault_curve.csv", "tune/x/tune.db", "continual_out/r.json",
                                    "model.onnx", "model.safetensors"])
def test_what_older_defaults_wrote_is_ignored_too(legacy):
    assert ignored(legacy)


def test_the_package_itself_is_not_ignored():
    assert not ignored("lightning_pin/faults/bits.py") and not ignored("lightning_pin/app/tune.py")
