"""Your own model and data: the tutorial docs/tutorials/fault-study-own-model.md (the README's section "Your own
model and data" before the docs site) run as written, each model kind
(a: its own configure_optimizers, b: takes the optimizer group, c: a plain nn.Module) through ``train``,
``faults`` and ``tune``, ``export`` + ``check`` of a model of your own, the default pins, ``metric=``, the
one-line errors, the torchvision recipes and a lightning-hydra-template project using ``callbacks/pin.yaml``.

The user's module (``mymodels.py``, the README's block) lives in a temporary directory the commands run
from. The console script runs there with no PYTHONPATH entry for that directory: the only PYTHONPATH entry is
the checkout under test (ROOT), because the installed editable package may point at another checkout (a
worktree's tests must run the worktree's code); the user's module must be found from the current directory
alone. Commands where a fresh interpreter is not the point run in processes forked from one that imported
torch, Lightning and Hydra once (tests/fork_runner.py).
"""

from __future__ import annotations

import csv
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightning_pin import cli
from lightning_pin.app.custom import WEIGHTS_2D, ConfigError, expand_params
from lightning_pin.app.pins import UniformValues
from lightning_pin.core.plan import fraction_indices

ROOT = Path(__file__).resolve().parents[1]
#: The whole tutorial page; its section "In your own Hydra project" moved to docs/how-to/hydra-project.md.
SECTION = (ROOT / "docs" / "tutorials" / "fault-study-own-model.md").read_text()
HYDRA_PROJECT = (ROOT / "docs" / "how-to" / "hydra-project.md").read_text()
CONSOLE = Path(sys.executable).parent / "lightning-pin"
TINY = ["trainer.max_epochs=1", "pretrain.max_epochs=1", "trainer.limit_train_batches=3"]
DATA = ["data=custom", "data._target_=mymodels.OwnData"]
KINDS = {
    "a": ["model=custom", "model._target_=mymodels.OwnNet", "+model.hidden=8"],
    "b": ["model=custom", "model._target_=mymodels.OptNet", "+model.hidden=8"],
    "c": ["model=custom", "model._target_=mymodels.TinyNet", "+model.hidden=8"],
}
CLASSES = {"a": "OwnNet", "b": "OptNet", "c": "TinyNet"}


def fenced(kind: str, text: str = SECTION) -> list[str]:
    return [m.group(1) for m in re.finditer(rf"^```{kind}\n(.*?)^```$", text, re.M | re.S)]


def env() -> dict[str, str]:
    """The test's environment with PYTHONPATH holding only the checkout under test (see the module docstring)."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0",
            "LIGHTNING_PIN_TRACEBACK": "0"}


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A directory holding the README's mymodels.py and its config directory (``# path`` first lines)."""
    (tmp_path / "mymodels.py").write_text(fenced("python")[0])
    for block in fenced("yaml"):
        first = block.splitlines()[0]
        if first.startswith("# myconf/"):
            path = tmp_path / first[2:].strip()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block)
    return tmp_path


@pytest.fixture
def user_module(project: Path):
    """``mymodels`` imported in this process from ``project`` (removed again afterwards: another test has its own)."""
    sys.path.insert(0, str(project))
    sys.modules.pop("mymodels", None)
    yield importlib.import_module("mymodels")
    sys.modules.pop("mymodels", None)
    sys.path.remove(str(project))


def console(line: str, cwd: Path, timeout: float = 600, fork_runner=None) -> subprocess.CompletedProcess:
    """One README command line (``a && b`` included), with the installed console script and ``python``: each a
    fresh interpreter, or with ``fork_runner`` the same script file forked from the process that imported torch,
    Lightning and Hydra once (``sys.path[0]`` is the script's directory, as when the shell runs it: the user's
    directory is not on the path)."""
    results = None
    for part in line.split("&&"):
        args = shlex.split(part)
        if fork_runner is None:
            args[0] = {"lightning-pin": str(CONSOLE), "python": sys.executable}[args[0]]
            results = subprocess.run(args, cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)
        else:
            args[:1] = {"lightning-pin": [sys.executable, str(CONSOLE)], "python": [sys.executable]}[args[0]]
            results = fork_runner.run(args, cwd=cwd, env=env(), timeout=timeout)
        results.output = results.stdout + results.stderr
        if results.returncode:
            break
    return results


def forked(fork_runner, module: str, *args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    result = fork_runner.run([sys.executable, "-m", module, *args], cwd=cwd, env=env(), timeout=timeout)
    result.output = result.stdout + result.stderr
    return result


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "run_summary.json").read_text())


def ckpt(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def expected_fraction_pins(module: torch.nn.Module, prefix: str = "") -> dict[str, int]:
    """5% (conf/pin/fraction.yaml) of every *.weight with two or more dimensions."""
    return {prefix + n: max(1, round(0.05 * p.numel())) for n, p in module.named_parameters()
            if n.endswith(".weight") and p.ndim >= 2}


def assert_fraction_pins_hold(run_dir: Path, expected: dict[str, int]) -> None:
    """Every default pin holds its seeded random value bit for bit in pinned.ckpt, and nothing else is pinned."""
    state = ckpt(run_dir / "pinned.ckpt")["state_dict"]
    values = UniformValues(-2.0, 2.0, seed=1)  # conf/pin/fraction.yaml
    for name in expected:
        cells = fraction_indices(name, state[name].numel(), 0.05, 0)
        assert torch.equal(state[name].reshape(-1)[cells], values(name, state[name]).reshape(-1)[cells]), name
    assert summary(run_dir)["pinned_elements"] == sum(expected.values())


# ----------------------------------------------------------------------------------------------
# The README's commands, as written, with the console script


def test_the_readme_commands_run_as_written_from_the_users_directory(project, user_module, fork_runner):
    """The first line with the installed console script in a fresh interpreter; the rest with the same script
    (or ``python -m``) forked from the process that imported torch, Lightning and Hydra once: seconds of imports
    a command, eight times, for nothing this test checks."""
    blocks = [block for block in fenced("bash") if "mymodels" in block or "myconf" in block]
    lines = [line for block in blocks for line in block.splitlines() if line.strip()]
    assert len(lines) == 9, lines  # the two blocks of the section that use your module
    outputs = {}
    for number, line in enumerate(lines):
        result = console(line, project, fork_runner=None if number == 0 else fork_runner)
        assert result.returncode == 0, f"{line}\n{result.output[-3000:]}"
        outputs[line] = result.output
    first = outputs[lines[0]]
    assert ("lightning-pin: model=mymodels.OwnNet data=mymodels.OwnData optimizer=(the model's own) pin=fraction "
            "trainer=cpu") in first
    assert "has its own configure_optimizers: the optimizer group and any optimizer.* override are not used" in first

    # (c) in the app's classifier, with the optimizer group: its parameters are backbone.<name>.
    run = project / "run"
    record = summary(run)
    assert record["targets"]["model"] == "mymodels.TinyNet" and record["targets"]["model_kind"] == "module"
    assert record["targets"]["data"] == "mymodels.OwnData" and record["targets"]["optimizer"] == "torch.optim.AdamW"
    assert record["pins_exact"] is True and record["baseline"] > 0.25  # 4 classes: learned something
    assert_fraction_pins_hold(run, expected_fraction_pins(user_module.TinyNet(), prefix="backbone."))
    assert "backbone.norm.weight" not in expected_fraction_pins(user_module.TinyNet(), "backbone.")  # 1-d: not pinned
    assert (project / "model.safetensors").is_file() and "every pin holds" in outputs[lines[3]]

    # The study: 2 rates x 1 seed, run by 2 jobs at a time.
    rows = list(csv.DictReader((project / "study" / "fault_curve.csv").open()))
    assert [(r["rate"], r["pins_exact"]) for r in rows] == [("0.0", "true"), ("0.2", "true")]
    weights = [p.numel() for n, p in user_module.TinyNet().named_parameters() if n.endswith(".weight") and p.ndim >= 2]
    assert rows[0]["pinned_elements"] == "0" and int(rows[1]["pinned_elements"]) == sum(round(0.2 * n) for n in weights)
    assert (project / "study" / "fault_curve.png").stat().st_size > 0

    # tune: 2 trials of (b), each composed with the searched lr.
    trials = list(csv.DictReader((project / "search" / "trials.csv").open()))
    assert len(trials) == 2
    own_trials = list(csv.DictReader((project / "own_search" / "trials.csv").open()))
    assert len(own_trials) == 2 and "model.lr" in "".join(own_trials[0].keys()) + "".join(own_trials[0].values())

    # The config directory form, and metric=val_loss metric_mode=min read from what the model logs.
    loss_run = next(p.parent for p in project.glob("outputs/*/*/run_summary.json") if "val_loss" in p.read_text())
    report = json.loads((loss_run / "pin_report.json").read_text())
    assert report["metric"] == "val_loss" and report["higher_is_better"] is False
    assert summary(loss_run)["choices"]["model"] == "mymodels.OwnNet"


# ----------------------------------------------------------------------------------------------
# Each kind of model through train, faults and tune


@pytest.mark.parametrize("kind", ["a", "b", "c"])
def test_each_kind_trains_with_the_right_optimizer_and_default_pins(kind, project, user_module, fork_runner):
    run = project / "run"
    extra = ["optimizer=sgd", "optimizer.lr=0.05"]
    result = forked(fork_runner, "lightning_pin.train", *KINDS[kind], *DATA, *TINY, *extra, f"hydra.run.dir={run}",
                    cwd=project)
    assert result.returncode == 0, result.output[-3000:]
    record = summary(run)
    cls = getattr(user_module, CLASSES[kind])
    assert record["choices"]["model"] == f"mymodels.{CLASSES[kind]}" and record["choices"]["data"] == "mymodels.OwnData"
    state = ckpt(run / "pinned.ckpt")
    optimizer_state = state["optimizer_states"][0]
    group = optimizer_state["param_groups"][0]
    if kind == "a":  # its own Adam at its own lr: optimizer=sgd is not used, and one line says so
        assert record["targets"]["optimizer"] == "(the model's own)" and group["lr"] == 3e-3
        assert any("exp_avg" in s for s in optimizer_state["state"].values())
        assert "optimizer group and any optimizer.* override are not used" in result.output
        model = cls(hidden=8)
        prefix = ""
    else:  # the optimizer group: SGD with momentum at lr 0.05
        assert record["targets"]["optimizer"] == "torch.optim.SGD" and group["lr"] == 0.05
        assert any("momentum_buffer" in s for s in optimizer_state["state"].values())
        model = cls(optimizer=None, hidden=8) if kind == "b" else cls(hidden=8)
        prefix = "backbone." if kind == "c" else ""
    assert_fraction_pins_hold(run, expected_fraction_pins(model, prefix))


def test_the_logged_metric_is_what_the_model_reports_in_its_own_validation(project, user_module, fork_runner):
    """(a) measures its logged val_acc: the baseline is exactly what Lightning's validate() reports."""
    import lightning.pytorch as pl

    run = project / "run"
    result = forked(fork_runner, "lightning_pin.train", *KINDS["a"], *DATA, *TINY, f"hydra.run.dir={run}", cwd=project)
    assert result.returncode == 0, result.output[-3000:]
    model = user_module.OwnNet(hidden=8)
    model.load_state_dict(ckpt(run / "pretrained.ckpt")["state_dict"])
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    (validated,) = trainer.validate(model, user_module.OwnData(), verbose=False)
    assert summary(run)["baseline"] == validated["val_acc"] and summary(run)["metric"] == "val_acc"


@pytest.mark.parametrize("kind", ["a", "b"])  # (c) runs in the README's commands (console script)
def test_faults_on_each_kind(kind, project, fork_runner):
    out = project / "study"
    result = forked(fork_runner, "lightning_pin.cli", "faults", "--rates", "0,0.2", "--seeds", "1", "--jobs", "2",
                    "--out", str(out), *KINDS[kind], *DATA, *TINY, cwd=project)
    assert result.returncode == 0, result.output[-3000:]
    rows = list(csv.DictReader((out / "fault_curve.csv").open()))
    assert [(r["rate"], r["pins_exact"]) for r in rows] == [("0.0", "true"), ("0.2", "true")]
    assert rows[0]["pinned_elements"] == "0" and int(rows[1]["pinned_elements"]) > 0
    job_dir = Path(rows[1]["job_dir"])
    job = summary(job_dir if job_dir.is_absolute() else project / job_dir)
    assert job["fault"]["params"] == WEIGHTS_2D and job["targets"]["model"] == f"mymodels.{CLASSES[kind]}"


def test_a_test_time_campaign_on_your_model_restores_its_weights_and_names_the_metric_it_measures(project, fork_runner):
    out = project / "flips"
    result = forked(fork_runner, "lightning_pin.cli", "faults", "--kind", "flip", "--rates", "0,0.01", "--seeds", "2",
                    "--out", str(out), *KINDS["c"], *DATA, *TINY, cwd=project)
    assert result.returncode == 0, result.output[-3000:]
    rows = list(csv.DictReader((out / "fault_curve.csv").open()))
    assert [(r["rate"], r["final"]) for r in rows] == [("0.0", ""), ("0.0", ""), ("0.01", ""), ("0.01", "")]
    assert all(r["forced"] == rows[0]["baseline"] for r in rows[:2])  # rate 0 flips nothing
    assert int(rows[2]["changed_bits"]) > 0 and int(rows[3]["changed_bits"]) > 0
    # A test-time campaign measures the metric the model logs in its own validation_step, a loss too.
    result = forked(fork_runner, "lightning_pin.cli", "faults", "--no-retrain", "--rates", "0,0.2", "--seeds", "1",
                    "--out", str(project / "loss"), *KINDS["a"], *DATA, *TINY, "metric=val_loss", "metric_mode=min",
                    cwd=project)
    assert result.returncode == 0, result.output[-3000:]
    rows = list(csv.DictReader((project / "loss" / "fault_curve.csv").open()))
    assert rows[0]["forced"] == rows[0]["baseline"] and float(rows[1]["forced"]) > float(rows[1]["baseline"])


def test_faults_and_tune_take_a_config_directory(project, fork_runner):
    out = project / "study"
    result = forked(fork_runner, "lightning_pin.cli", "faults", "--config-dir", "myconf", "--rates", "0,0.2",
                    "--seeds", "1", "--jobs", "2", "--out", str(out), "model=own", "data=own", *TINY, cwd=project)
    assert result.returncode == 0, result.output[-3000:]
    assert len(list(csv.DictReader((out / "fault_curve.csv").open()))) == 2
    result = forked(fork_runner, "lightning_pin.cli", "tune", "--trials", "2", "--out", str(project / "search"),
                    "--param", "model.lr=log:1e-3:1e-2", "hydra.searchpath=[file://myconf]", "model=own", "data=own",
                    *TINY, cwd=project)
    assert result.returncode == 0, result.output[-3000:]
    assert len(list(csv.DictReader((project / "search" / "trials.csv").open()))) == 2


@pytest.mark.parametrize("kind", ["c"])  # (a) and (b) run in the README's commands (console script)
def test_tune_on_each_kind(kind, project, fork_runner):
    result = forked(fork_runner, "lightning_pin.cli", "tune", "--trials", "2", "--out", str(project / "search"),
                    *KINDS[kind], *DATA, *TINY, cwd=project)
    assert result.returncode == 0, result.output[-3000:]
    assert len(list(csv.DictReader((project / "search" / "trials.csv").open()))) == 2
    # Each trial's own output (the app's summary among it) goes to its trial_N/trial.log, not to the terminal.
    for trial in (0, 1):
        log = (project / "search" / f"trial_{trial}" / "trial.log").read_text()
        assert "model=mymodels.TinyNet data=mymodels.OwnData optimizer=torch.optim.AdamW" in log


# ----------------------------------------------------------------------------------------------
# Export and check, errors


def test_export_rebuilds_a_model_of_your_own_from_another_directory(project, fork_runner, tmp_path_factory):
    run = project / "run"
    result = forked(fork_runner, "lightning_pin.train", *KINDS["b"], *DATA, *TINY, f"hydra.run.dir={run}", cwd=project)
    assert result.returncode == 0, result.output[-3000:]
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    for suffix in (".safetensors", ".onnx"):
        target = elsewhere / f"model{suffix}"
        result = forked(fork_runner, "lightning_pin.cli", "export", str(run), "--to", str(target), cwd=elsewhere)
        assert result.returncode == 0, result.output[-3000:]
        result = forked(fork_runner, "lightning_pin.cli", "check", str(run / "pinned.ckpt"), str(target), cwd=elsewhere)
        assert result.returncode == 0 and "every pin holds" in result.output, result.output[-3000:]
    # The class is no longer importable: one line, exit 2.
    (project / "mymodels.py").rename(project / "gone.py")
    result = forked(fork_runner, "lightning_pin.cli", "export", str(run), "--to", str(elsewhere / "again.safetensors"),
                    cwd=elsewhere)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "model._target_=mymodels.OptNet: no module 'mymodels'" in result.stderr
    assert str(project) in result.stderr  # where it looked: the directory the run was started in


def one_line_error(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and lines, result.output[-3000:]
    assert len(lines) == 1 or (len(lines) == 2 and lines[1].startswith("(full traceback")), result.stderr
    return lines[0]


def test_an_unimportable_target_is_one_line_from_the_console_script(project, fork_runner):
    result = console("lightning-pin train model=custom model._target_=mymodels.Missing " + " ".join(DATA), project)
    assert result.returncode == 1
    line = one_line_error(result)
    where = project / "mymodels.py"
    assert line == f"ConfigError: model._target_=mymodels.Missing: mymodels ({where}) has no 'Missing'"
    # The same script forked (a fresh interpreter a second time shows nothing new).
    result = console("lightning-pin train data=custom data._target_=nowhere.Data", project, fork_runner=fork_runner)
    assert result.returncode == 1
    line = one_line_error(result)
    assert "data._target_=nowhere.Data: no module 'nowhere'" in line and str(project) in line


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["+model.width=3"], "model._target_=mymodels.TinyNet takes no argument 'width' (model.width; it takes: "
                             "hidden, num_classes; defined in "),
        (["+model.hidden=8", "+data.shuffle=true"], "data._target_=mymodels.OwnData takes no argument 'shuffle'"),
        (["metric_mode=up"], "metric_mode='up' (for metric=val_acc): use max (higher is better) or min"),
    ],
)
def test_a_refused_key_is_one_line_before_anything_trains(overrides, says, project, fork_runner):
    run = project / "run"
    result = forked(fork_runner, "lightning_pin.train", "model=custom", "model._target_=mymodels.TinyNet", *DATA,
                    *overrides, f"hydra.run.dir={run}", cwd=project)
    assert result.returncode == 1
    assert says in one_line_error(result)
    assert not (run / "pretrained.ckpt").exists()


def test_a_model_that_logs_no_such_metric_ends_after_its_first_validation(project, fork_runner):
    run = project / "run"
    result = forked(fork_runner, "lightning_pin.train", *KINDS["a"], *DATA, "metric=val_f1", "pretrain.max_epochs=3",
                    f"hydra.run.dir={run}", cwd=project)
    assert result.returncode == 1
    assert one_line_error(result) == (
        "ConfigError: metric=val_f1: mymodels.OwnNet logs no such validation metric (it logged: train_loss, val_acc, "
        "val_loss): set metric= to one it logs (and metric_mode=max|min)"
    )
    assert not (run / "pretrained.ckpt").exists()
    assert "Epoch 1" not in result.output  # it ended in the first epoch


def test_tune_and_faults_errors_are_one_line(project, fork_runner):
    result = forked(fork_runner, "lightning_pin.cli", "tune", "--trials", "2", "--out", str(project / "s"),
                    "model=custom", "model._target_=mymodels.Nope", cwd=project)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"lightning-pin tune: error: model._target_=mymodels.Nope: mymodels ({project / 'mymodels.py'}) has no 'Nope'"
    )
    result = forked(fork_runner, "lightning_pin.cli", "faults", "--rates", "0,0.2", "--seeds", "1", "--out",
                    str(project / "f"), "model=custom", "model._target_=mymodels.TinyNet", "+model.width=3", cwd=project)
    assert result.returncode == 2
    assert result.stderr.strip().startswith(
        "lightning-pin faults: error: model._target_=mymodels.TinyNet takes no argument 'width' (model.width; "
    ) and result.stderr.count("\n") == 1
    for command in ("tune", "faults"):
        result = forked(fork_runner, "lightning_pin.cli", command, "--config-dir", "nothere", "model=own", cwd=project)
        assert result.returncode == 2
        assert result.stderr.strip() == (
            f"lightning-pin {command}: error: --config-dir nothere: no such directory (it should hold "
            "model/NAME.yaml, data/NAME.yaml)"
        )


# ----------------------------------------------------------------------------------------------
# Default pins, in this process


def compose(tmp_path: Path, *overrides: str):
    from lightning_pin.app.compose import compose_app

    return compose_app(list(overrides), tmp_path)


def test_default_pins_of_your_model_and_of_the_apps_own(tmp_path, user_module):
    from lightning_pin.app.custom import build_model
    from lightning_pin.app.train import build_pins

    app = compose(tmp_path)
    assert app.pin.params == r"re:backbone\.(features\.\d+|layers\.\d+|encoder\.layers\.\d+\.linear\d)\.weight"
    assert compose(tmp_path, "pin=cell_faults").pin.params == "backbone.features.*.weight"
    custom = ["model=custom", "model._target_=mymodels.TinyNet"]
    for pin in ("fraction", "faults", "cell_faults", "bit_faults"):
        assert compose(tmp_path, *custom, f"pin={pin}").pin.params == WEIGHTS_2D
    assert compose(tmp_path, *custom, "pin.params=backbone.fc.weight").pin.params == "backbone.fc.weight"

    cfg = compose(tmp_path, *custom, "pin=cell_faults", "pin.rate=0.1")
    model = build_model(cfg).model
    pins = build_pins(cfg.pin, model)
    assert sorted(p.params for p in pins) == ["backbone.conv.weight", "backbone.fc.weight", "backbone.out.weight"]
    cfg = compose(tmp_path, *custom, "pin.params=[backbone.fc.bias]")
    assert [p.params for p in build_pins(cfg.pin, model)] == [["backbone.fc.bias"]]


def test_expand_params_keeps_patterns_and_refuses_a_model_without_weights():
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2), torch.nn.Linear(2, 2))
    assert expand_params(WEIGHTS_2D, net) == ["0.weight", "2.weight"]
    assert expand_params(["1.*", WEIGHTS_2D], net) == ["1.*", "0.weight", "2.weight"]
    assert expand_params("re:.*bias", net) == "re:.*bias"
    with pytest.raises(ConfigError, match=r"no parameter named \*\.weight with two or more dimensions"):
        expand_params(WEIGHTS_2D, torch.nn.LayerNorm(3))


def test_a_custom_target_receives_exactly_its_keys(tmp_path, user_module):
    from lightning_pin.app.custom import build_datamodule, build_model

    cfg = compose(tmp_path, "model=custom", "model._target_=mymodels.OwnNet", "+model.hidden=5", *DATA,
                  "+data.num_samples=32")
    assert set(cfg.model) == {"_target_", "hidden"} and set(cfg.data) == {"_target_", "num_samples"}
    built = build_model(cfg, announce=False)
    assert built.kind == "own_optimizer" and built.model.net.fc.out_features == 5
    assert build_datamodule(cfg).num_samples == 32


# ----------------------------------------------------------------------------------------------
# The torchvision recipes


def _torchvision_error() -> str | None:
    try:
        import torchvision  # noqa: F401
    except Exception as err:  # a build for another torch fails at import with a RuntimeError, not an ImportError
        return f"{type(err).__name__}: {err}"
    return None


TORCHVISION = _torchvision_error()


def test_without_a_working_torchvision_the_recipe_says_so_in_one_line(tmp_path):
    if TORCHVISION is None:
        pytest.skip("torchvision loads here: the recipe runs in the next test")
    from lightning_pin.app.train import run

    says = r"model=torchvision needs torchvision built for torch .*lightning-pin\[vision\]"
    with pytest.raises(ImportError, match=says):
        run(compose(tmp_path, "model=torchvision", "model.name=resnet18", *TINY))


FAKE_CIFAR = '''
import torchvision


class FakeCIFAR10(torchvision.datasets.FakeData):
    """CIFAR-10's signature over torchvision's FakeData: 3x32x32 images, 10 classes, nothing downloaded."""

    def __init__(self, root, train=True, transform=None, download=False):
        super().__init__(size=96 if train else 32, image_size=(3, 32, 32), num_classes=10, transform=transform,
                         random_offset=0 if train else 1000)
'''


@pytest.mark.skipif(TORCHVISION is not None, reason=f"torchvision does not load beside this torch: {TORCHVISION}")
def test_the_torchvision_recipe_trains_resnet18_on_cifar10_shaped_data(tmp_path, fork_runner):
    (tmp_path / "fakecifar.py").write_text(FAKE_CIFAR)
    run = tmp_path / "run"
    result = forked(fork_runner, "lightning_pin.train", "model=torchvision", "model.name=resnet18", "data=cifar10",
                    "data.download=false", "data.dataset=fakecifar.FakeCIFAR10", "data.batch_size=32", *TINY,
                    f"hydra.run.dir={run}", cwd=tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    record = summary(run)
    assert record["choices"]["model"] == "torchvision.models.resnet18" and record["pins_exact"] is True
    assert "backbone.conv1.weight" in ckpt(run / "pinned.ckpt")["state_dict"]


# ----------------------------------------------------------------------------------------------
# callbacks/pin.yaml in a lightning-hydra-template project

TEMPLATE = ROOT / "examples" / "lightning_hydra_template" / "configs" / "callbacks" / "pin.yaml"
TEMPLATE_FILES = {
    "configs/train.yaml": """
defaults:
  - _self_
  - data: blobs
  - model: blobs
  - callbacks: default
  - trainer: default
  - paths: default
seed: 0
""",
    "configs/data/blobs.yaml": "_target_: src.data.Blobs\nbatch_size: 32\n",
    "configs/model/blobs.yaml": """
_target_: src.model.LitModule
net:
  _target_: src.model.Net
optimizer:
  _target_: torch.optim.Adam
  _partial_: true
  lr: 0.01
""",
    "configs/callbacks/default.yaml": "defaults:\n  - model_summary\n",
    "configs/callbacks/model_summary.yaml": "model_summary:\n  _target_: lightning.pytorch.callbacks.ModelSummary\n",
    "configs/trainer/default.yaml": """
_target_: lightning.pytorch.trainer.Trainer
max_epochs: 2
accelerator: cpu
logger: false
enable_checkpointing: false
enable_progress_bar: false
default_root_dir: ${paths.output_dir}
""",
    "configs/paths/default.yaml": "output_dir: ${hydra:runtime.output_dir}\n",
    "src/__init__.py": "",
    "src/data.py": """
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Blobs(L.LightningDataModule):
    def __init__(self, batch_size: int = 32):
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage=None):
        g = torch.Generator().manual_seed(0)
        y = torch.arange(256) % 4
        x = torch.randn(4, 8, generator=g)[y] + 0.5 * torch.randn(256, 8, generator=g)
        self.train_set, self.val_set = TensorDataset(x[:192], y[:192]), TensorDataset(x[192:], y[192:])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=64)
""",
    "src/model.py": """
import lightning as L
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.model(x)


class LitModule(L.LightningModule):  # the template's MNISTLitModule, in small
    def __init__(self, net, optimizer):
        super().__init__()
        self.net, self.make_optimizer = net, optimizer

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/acc", (self(x).argmax(-1) == y).float().mean())

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())
""",
    "src/train.py": """
# The template's src/train.py, in small: instantiate data, model, every callback node, trainer; fit.
import sys
from pathlib import Path

import hydra
import torch
from hydra.utils import instantiate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # what the template's rootutils.setup_root does


@hydra.main(version_base="1.3", config_path="../configs", config_name="train")
def main(cfg):
    torch.manual_seed(cfg.seed)
    datamodule, model = instantiate(cfg.data), instantiate(cfg.model)
    callbacks = [instantiate(node) for node in cfg.callbacks.values() if "_target_" in node]
    trainer = instantiate(cfg.trainer, callbacks=callbacks)
    trainer.fit(model, datamodule)
    torch.save(model.state_dict(), f"{cfg.paths.output_dir}/model.pt")
    print("callbacks:", ", ".join(type(c).__name__ for c in callbacks))


if __name__ == "__main__":
    main()
""",
}


def test_the_template_callback_file_is_the_one_the_readme_shows():
    assert TEMPLATE.read_text() in fenced("yaml", HYDRA_PROJECT)


def test_a_template_style_project_trains_with_callbacks_pin(tmp_path, fork_runner):
    for name, text in TEMPLATE_FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text.lstrip())
    (tmp_path / "configs" / "callbacks" / "pin.yaml").write_text(TEMPLATE.read_text())  # copied as written
    out = tmp_path / "out"
    result = fork_runner.run([sys.executable, "src/train.py", "callbacks=[default,pin]", f"hydra.run.dir={out}"],
                             cwd=tmp_path, env=env(), timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "callbacks: ModelSummary, PinCallback" in result.stdout
    pin = yaml.safe_load(TEMPLATE.read_text())["pin"]["pins"][0]
    state = torch.load(out / "model.pt", weights_only=True)
    for name in ("net.model.0.weight", "net.model.2.weight"):  # what "net.*.weight" matches
        cells = fraction_indices(name, state[name].numel(), pin["fraction"], pin["seed"])
        assert torch.equal(state[name].reshape(-1)[cells], torch.zeros(len(cells)))  # stuck at 0.0, bit for bit
        assert (state[name] != 0).sum() == state[name].numel() - len(cells)  # the rest trained
    report = json.loads((out / "pin_report.json").read_text())
    assert report["violations"] == 0 and report["baseline"] is not None and report["final"] is not None
