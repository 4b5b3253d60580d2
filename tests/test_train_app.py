"""The Hydra app end to end, in subprocesses as a user runs it: a 1-epoch run writes a report with
exact pins, the console script forwards overrides, bad configs fail before training, and sweeps
(basic and Optuna) leave a summary with one row per job."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightning_pin import cli
from lightning_pin.app.models import Classifier, SmallCNN
from lightning_pin.app.pins import UniformValues
from lightning_pin.core.plan import fraction_indices

ROOT = Path(__file__).resolve().parents[1]
# Tiny runs: one epoch of pretraining and of retraining, a few batches each.
TINY = ["trainer.max_epochs=1", "pretrain.max_epochs=1", "trainer.limit_train_batches=6"]
CELLS = [(0, 0, 1, 1), (5, 0, 2, 2), (12, 0, 0, 1)]


def run(args: list[str], cwd: Path, timeout: float = 240, runner=None, **env_vars: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1", "LIGHTNING_PIN_TRACEBACK": "0", **env_vars}
    if runner is None:
        result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    else:
        result = runner.run(args, cwd=cwd, env=env, timeout=timeout)
    result.output = result.stdout + result.stderr
    return result


@pytest.fixture
def train(fork_runner):
    """``python -m lightning_pin.train [overrides]`` as a user runs it, in a process of its own forked from one that
    imported torch, Lightning and Hydra once (tests/fork_runner.py). The console script's test below forks its file
    too; tests/test_custom_model.py's console script and tests/test_packaging.py's installed wheel start the app in
    fresh interpreters."""

    def train(*overrides: str, cwd: Path, **env_vars: str) -> subprocess.CompletedProcess:
        return run([sys.executable, "-m", "lightning_pin.train", *overrides], cwd=cwd, runner=fork_runner, **env_vars)

    return train


def state_dict(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def test_one_epoch_default_run_writes_a_report_with_exact_pins(tmp_path, train):
    result = train(*TINY, f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.output
    assert "Pretraining SmallCNN" in result.output and "pins      exact: verified" in result.output

    report = json.loads((tmp_path / "pin_report.json").read_text())
    assert report["violations"] == 0 and report["pinned_elements"] == 7 + 230
    assert None not in (report["baseline"], report["forced"], report["final"])
    assert (tmp_path / "pin_report.png").stat().st_size > 0
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    assert summary["pins_exact"] is True and summary["final"] == report["final"]
    assert summary["choices"]["pin"] == "fraction" and summary["job"] is None

    # The stuck cells hold their seeded random values bit for bit in the final weights, and
    # differ from what pretraining left there: the pins were forced, not merely kept.
    pretrained, pinned = state_dict(tmp_path / "pretrained.ckpt"), state_dict(tmp_path / "pinned.ckpt")
    values = UniformValues(-2.0, 2.0, seed=1)  # conf/pin/fraction.yaml
    for name in ("backbone.features.0.weight", "backbone.features.2.weight"):
        cells = fraction_indices(name, pinned[name].numel(), 0.05, 0)
        expected = values(name, pinned[name]).reshape(-1)[cells]
        assert torch.equal(pinned[name].reshape(-1)[cells], expected)
        assert not torch.equal(pretrained[name].reshape(-1)[cells], expected)
    # The free weights trained around them.
    assert not torch.equal(pretrained["backbone.head.weight"], pinned["backbone.head.weight"])
    # The report rebuilt from the logged CSV, and the checkpoint diff, agree that the pins held.
    assert cli.main(["diff", str(tmp_path / "pretrained.ckpt"), str(tmp_path / "pinned.ckpt"), "--json"]) == 0
    assert (tmp_path / "csv" / "pinned" / "metrics.csv").exists()

    # The README's recipe from the run to a deployable file: export, then check the pins in it.
    exported = tmp_path / "deploy" / "model.safetensors"
    assert cli.main(["export", str(tmp_path), "--to", str(exported)]) == 0
    assert cli.main(["check", str(tmp_path / "pinned.ckpt"), str(exported)]) == 0
    # An earlier export at the same place is replaced without --force (it is a model export).
    assert cli.main(["export", str(tmp_path), "--to", str(exported)]) == 0
    from safetensors.torch import load_file

    assert torch.equal(load_file(exported)["backbone.features.0.weight"], pinned["backbone.features.0.weight"])
    # And back into Python: the run's model from its config, or Lightning's loader with a backbone.
    from lightning_pin.app.export import load_run_model

    lightning_loaded = Classifier.load_from_checkpoint(tmp_path / "pinned.ckpt", backbone=SmallCNN())
    for model in (load_run_model(tmp_path), lightning_loaded):
        assert all(torch.equal(model.state_dict()[name], value) for name, value in pinned.items())
    if importlib.util.find_spec("onnxscript") and importlib.util.find_spec("onnx"):
        assert cli.main(["export", str(tmp_path), "--to", str(tmp_path / "deploy" / "model.onnx")]) == 0
        assert cli.main(["check", str(tmp_path / "pinned.ckpt"), str(tmp_path / "deploy" / "model.onnx")]) == 0


def test_export_refuses_what_is_not_a_run_or_a_format(tmp_path, capsys):
    assert cli.main(["export", str(tmp_path), "--to", str(tmp_path / "model.safetensors")]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("lightning-pin export: error: ") and "is not the directory of a finished" in line
    assert "\n" not in line and not (tmp_path / "model.safetensors").exists()
    assert cli.main(["export", str(tmp_path), "--to", str(tmp_path / "model.pkl")]) == 2
    assert "one of .safetensors, .onnx" in capsys.readouterr().err


def test_export_of_a_run_whose_checkpoint_is_empty_or_truncated_names_the_file(tmp_path, capsys, monkeypatch):
    from lightning_pin.app import export

    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("{}\n")
    monkeypatch.setattr(export, "_rebuild", lambda cfg, run_dir: torch.nn.Linear(4, 2))
    torch.save({"state_dict": torch.nn.Linear(4, 2).state_dict()}, tmp_path / "whole.ckpt")
    for content, words in [(b"", "is empty (0 bytes)"), ((tmp_path / "whole.ckpt").read_bytes()[:200], "is truncated")]:
        (tmp_path / "pinned.ckpt").write_bytes(content)
        assert cli.main(["export", str(tmp_path), "--to", str(tmp_path / "model.safetensors")]) == 2
        line = capsys.readouterr().err.strip()
        assert "\n" not in line and f"{tmp_path / 'pinned.ckpt'} {words}" in line, line
        assert not (tmp_path / "model.safetensors").exists()


def test_export_checks_its_destination_before_rebuilding_the_model(tmp_path, capsys):
    # A directory: one line, status 2, before the run is read (tmp_path is not a run, and that is not what it says).
    (tmp_path / "deploy").mkdir()
    assert cli.main(["export", str(tmp_path), "--to", str(tmp_path / "deploy")]) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "is a directory" in line and "--to" in line and "finished" not in line
    # An existing file that is not a model export is never replaced without --force.
    notes = tmp_path / "notes.safetensors"
    notes.write_text("my notes")
    for name in ("notes.safetensors", "notes.onnx"):
        (tmp_path / name).write_text("my notes")
        assert cli.main(["export", str(tmp_path), "--to", str(tmp_path / name)]) == 2
        line = capsys.readouterr().err.strip()
        assert "\n" not in line and "is not a model export" in line and "--force" in line
        assert (tmp_path / name).read_text() == "my notes"
    # With --force it goes on (here to the run directory's own check).
    assert cli.main(["export", str(tmp_path), "--to", str(notes), "--force"]) == 2
    assert "is not the directory of a finished" in capsys.readouterr().err
    # A file in the way of the destination's directory.
    assert cli.main(["export", str(tmp_path), "--to", str(notes / "model.safetensors")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


def test_the_readmes_fault_map_pins_the_apps_cnn(tmp_path, train, fork_runner):
    # The block of docs/how-to/fault-maps.md writes chip.safetensors; the sentence after it runs the app with that map.
    from test_readme import python_blocks

    text = (ROOT / "docs" / "how-to" / "fault-maps.md").read_text()
    (block,) = [code for _, code in python_blocks(text) if 'save_fault_map(pins, "chip.safetensors")' in code]
    assert "pin=fault_map pin.fault_map=chip.safetensors" in text
    (tmp_path / "block.py").write_text(block)
    written = run([sys.executable, "block.py"], cwd=tmp_path, runner=fork_runner)
    assert written.returncode == 0, written.output
    result = train(*TINY, "pin=fault_map", "pin.fault_map=chip.safetensors", f"hydra.run.dir={tmp_path / 'run'}",
                   cwd=tmp_path)
    assert result.returncode == 0, result.output
    assert "pins      exact: verified" in result.output
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    assert summary["pinned_elements"] == 3 and summary["pins_exact"] is True


def test_cell_faults_are_drawn_on_the_pretrained_model_and_hold(tmp_path, train):
    from lightning_pin.faults import cell_faults

    result = train(*TINY, "pin=cell_faults", "pin.rate=0.1", "pin.seed=2", f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.output
    assert "cell faults (rate 0.1, sa1_fraction 0.5, seed 2)" in result.output  # the summary, logged once
    assert result.output.count("cell faults (rate") == 1
    model = Classifier(SmallCNN())
    model.load_state_dict(state_dict(tmp_path / "pretrained.ckpt"))
    pinned = state_dict(tmp_path / "pinned.ckpt")
    # SA1 cells read the pretrained layer's largest magnitude, with the pretrained weight's sign.
    pins = cell_faults(model, "backbone.features.*.weight", 0.1, seed=2)
    for p in pins:
        held = pinned[p.params][tuple(p.indices.T)]
        assert torch.equal(held, p.value)
        assert held.abs().max() == model.get_parameter(p.params).detach().abs().max()


def test_console_script_forwards_overrides_and_loads_ckpt_path(tmp_path, fork_runner):
    """The installed console script's file, forked from the process that imported torch, Lightning and Hydra once
    (what it forwards does not depend on a fresh interpreter: tests/test_custom_model.py starts the console script
    in fresh interpreters, tests/test_packaging.py the installed wheel's app)."""
    torch.manual_seed(0)
    start = Classifier(SmallCNN())
    torch.save({"state_dict": start.state_dict()}, tmp_path / "start.pt")
    script = Path(sys.executable).with_name("lightning-pin")
    result = run(
        [sys.executable, str(script), "train", *TINY, "pin=elements", "optimizer=adam", "ckpt_path=start.pt",
         "hydra.run.dir=out"],
        cwd=tmp_path, runner=fork_runner,
    )
    assert result.returncode == 0, result.output
    assert "Loaded the model's weights from start.pt" in result.output and "Pretraining" not in result.output
    out = tmp_path / "out"
    assert not (out / "pretrained.ckpt").exists()
    weight = state_dict(out / "pinned.ckpt")["backbone.features.0.weight"]
    assert [weight[c].item() for c in CELLS] == [25.0, 5.0, 125.0]
    assert json.loads((out / "run_summary.json").read_text())["choices"]["optimizer"] == "adam"


@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.max_epoch=3", "unknown config key 'trainer.max_epoch': did you mean trainer.max_epochs"),
        ("pin.params=backbone.nothing.*", "matches no parameter of the module being trained"),
        ("pin=fault_map", "Missing mandatory value: pin.fault_map"),
    ],
)
def test_bad_config_fails_before_training(tmp_path, override, message, train):
    result = train(override, f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    # A key that is not in the config is a usage error (status 2, one line); the others end the run (status 1).
    assert result.returncode == (2 if "unknown config key" in message else 1)
    assert message in result.output
    assert "Pretraining" not in result.output and not (tmp_path / "pretrained.ckpt").exists()
    # The message, not a traceback before it.
    assert "Traceback" not in result.output and 'File "' not in result.output
    if override.startswith("pin.params"):  # an app error (Hydra's own are composition errors)
        error = [line for line in result.stderr.splitlines() if line.startswith("PinError: ")]
        assert len(error) == 1 and message in error[0], result.stderr
        assert "LIGHTNING_PIN_TRACEBACK=1" in result.stderr


def test_an_empty_ckpt_path_ends_in_one_line_naming_the_file_before_training(tmp_path, train):
    (tmp_path / "start.ckpt").write_bytes(b"")
    result = train(*TINY, "ckpt_path=start.ckpt", f"hydra.run.dir={tmp_path / 'out'}", cwd=tmp_path)
    assert result.returncode == 1
    error = [line for line in result.stderr.splitlines() if line.startswith("ValueError: ")]
    assert len(error) == 1 and "start.ckpt is empty (0 bytes)" in error[0], result.stderr
    assert "Traceback" not in result.output and not (tmp_path / "out" / "pinned.ckpt").exists()


def test_app_error_shows_the_traceback_on_request(tmp_path, train):
    full = train(
        "pin.params=backbone.nothing.*", f"hydra.run.dir={tmp_path}", cwd=tmp_path, LIGHTNING_PIN_TRACEBACK="1"
    )
    assert full.returncode == 1
    assert "Traceback" in full.stderr and "matches no parameter" in full.stderr


def test_multirun_writes_a_summary_row_per_job(tmp_path, train):
    # A given checkpoint skips each job's pretraining (what the summary rows hold does not need it).
    torch.save({"state_dict": Classifier(SmallCNN()).state_dict()}, tmp_path / "start.pt")
    result = train(
        "-m", *TINY, f"ckpt_path={tmp_path / 'start.pt'}", "pin.fraction=0.01,0.2", f"hydra.sweep.dir={tmp_path}",
        "hydra.sweep.subdir=job${hydra.job.num}", cwd=tmp_path,
    )
    assert result.returncode == 0, result.output
    with open(tmp_path / "sweep_summary.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert [row["overrides"].split()[-1] for row in rows] == ["pin.fraction=0.01", "pin.fraction=0.2"]
    assert [int(row["pinned_elements"]) for row in rows] == [round(0.01 * 144) + round(0.01 * 4608), 29 + 922]
    for row in rows:
        assert row["pins_exact"] == "true" and row["violations"] == "0"
        assert float(row["final"]) - float(row["baseline"]) == pytest.approx(-float(row["gap"]))
        assert float(row["weight_drift"]) > 0
    # The printed table shows what differs between the jobs, and what they share once, above it.
    assert "lightning-pin sweep: 2 job(s)" in result.output and "pin.fraction=0.2" in result.output
    assert "all jobs: trainer.max_epochs=1" in result.output


def test_optuna_search_runs_two_trials(tmp_path, train):
    # hparams_search=optuna needs the Hydra plugin (the optuna-sweeper extra); `lightning-pin tune` does not.
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    result = train(
        "hparams_search=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.n_startup_trials=2", *TINY,
        f"hydra.sweep.dir={tmp_path}", cwd=tmp_path,
    )
    assert result.returncode == 0, result.output
    best = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert set(best["best_params"]) == {"optimizer.lr", "pin.fraction"}
    with open(tmp_path / "sweep_summary.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 2 and best["best_value"] == max(float(row["final"]) for row in rows)


def test_optuna_search_without_its_plugin_is_one_line_pointing_to_lightning_pin_tune(tmp_path, train):
    # `make` installs the tune extra (optuna >= 3); Hydra's Optuna sweeper pins optuna < 3, so it is not there.
    if importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is not None:
        pytest.skip("Hydra's Optuna sweeper plugin is installed: hparams_search=optuna runs (test above)")
    for args in (["hparams_search=optuna"], ["hparams_search=optuna", "hydra.sweeper.n_trials=2", *TINY]):
        result = train(*args, f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.output
        assert "lightning-pin tune" in lines[0] and "optuna-sweeper" in lines[0]
        assert "Could not find" not in result.output and not (tmp_path / "sweep").exists()


@pytest.mark.xdist_group("processes")  # one multi-process test at a time (see test_ddp.py)
def test_ddp_sim_run_verifies_pins_from_spawned_workers(tmp_path, train):
    # A given checkpoint skips the pretraining: one spawn of two processes instead of two. The synthetic data (shaped
    # like the digits, for the same model) spare the app and each rank scikit-learn's import and a bigger set.
    torch.save({"state_dict": Classifier(SmallCNN()).state_dict()}, tmp_path / "start.pt")
    result = train(
        *TINY, "trainer=ddp_sim", "pin=elements", "ckpt_path=start.pt", "data=synthetic", "data.num_samples=256",
        f"hydra.run.dir={tmp_path}", cwd=tmp_path,
    )
    assert result.returncode == 0, result.output
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    assert summary["choices"]["trainer"] == "ddp_sim" and summary["violations"] == 0
    assert summary["final"] is not None  # read from the report rank 0 wrote
    weight = state_dict(tmp_path / "pinned.ckpt")["backbone.features.0.weight"]
    assert [weight[c].item() for c in CELLS] == [25.0, 5.0, 125.0]


def test_true_half_precision_run_tracks_accuracy_and_holds_the_pins(tmp_path, train):
    # bf16-true casts the module: the monitor's accuracy passes go through the precision plugin.
    result = train(*TINY, "+trainer.precision=bf16-true", f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.output
    assert "pins      exact: verified" in result.output
    report = json.loads((tmp_path / "pin_report.json").read_text())
    assert report["violations"] == 0 and None not in (report["baseline"], report["forced"], report["final"])
    assert state_dict(tmp_path / "pinned.ckpt")["backbone.head.weight"].dtype == torch.bfloat16


def test_a_run_that_ends_at_chance_says_so_in_its_summary_and_draws_the_chance_line(tmp_path, train):
    """Every weight frozen at 0: the model guesses one class. The summary and run_summary.json say "at chance"
    (as the faults study's diverged column does), with the accuracy of guessing; the figure is redrawn with it."""
    result = train(*TINY, "pin=freeze_layers", "pin.pins=[{params: '*', value: 0.0}]", f"hydra.run.dir={tmp_path}",
                   cwd=tmp_path)
    assert result.returncode == 0, result.output
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    assert summary["chance"] == 0.1 and summary["final"] <= 0.12  # digits: 10 classes
    assert summary["outcome"] == "at chance" and summary["diverged"] is True
    said = "  outcome   AT CHANCE: the final accuracy is no better than guessing (guessing scores 0.100)"
    assert said in result.stdout
    assert (tmp_path / "pin_report.png").stat().st_size > 0
