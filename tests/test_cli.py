"""The ``lightning-pin`` command's own surface: ``--version``, a description that names every
subcommand, and ``train --help`` listing every config option and no internal ``schema/*`` group."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_pin
from lightning_pin import cli

CONF = Path(__file__).resolve().parents[1] / "conf"


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"lightning-pin {lightning_pin.__version__}"


def test_help_names_every_subcommand(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    subcommands = {"train", *cli.COMMANDS}
    assert {"train", "report", "diff", "check", "export"} <= subcommands
    description = out.split("positional arguments")[0]
    for name in subcommands:
        assert name in description, f"the description does not name {name}"
        assert f"    {name} " in out  # listed with its summary


def test_train_help_lists_every_option_and_hides_the_schema_groups(tmp_path, fork_runner):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # python -m lightning_pin.train --help, forked from a process that imported the app (tests/fork_runner.py).
    command = [sys.executable, "-m", "lightning_pin.train", "--help"]
    result = fork_runner.run(command, cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    groups = result.stdout.split("== Config (")[0]
    assert "schema" not in groups
    shown = ("data", "model", "optimizer", "pin", "trainer", "callbacks", "logger", "experiment", "hparams_search")
    for group in shown:
        line = next((line for line in groups.splitlines() if line.startswith(f"{group}: ")), None)
        assert line is not None, f"train --help lists no {group} group"
        for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
            if (group, option) != ("trainer", "default"):  # the base the trainer options extend
                assert option in line, f"train --help does not list {group}={option}"
    assert "LIGHTNING_PIN_TRACEBACK=1" in result.stdout


ROOT = Path(__file__).resolve().parents[1]


def test_the_app_extra_brings_jsonargparse_and_the_license_file_is_there():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(req.startswith("jsonargparse") for req in project["optional-dependencies"]["app"])
    assert project["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize(
    "index,expected",
    [
        ("cpu", '--timeout 5 --retries 0 --index-url "https://download.pytorch.org/whl/cpu" "torch=='),
        ("https://example.org/whl", '--index-url "https://example.org/whl" "torch=='),
        ("default", None),
    ],
)
def test_make_install_tries_the_chosen_torch_index_first_then_the_default(tmp_path, index, expected):
    recipe = subprocess.run(
        ["make", "-n", "-B", "-C", str(ROOT), "install", f"TORCH_INDEX={index}", f"VENV={tmp_path / 'venv'}"],
        capture_output=True, text=True, timeout=60,
    ).stdout
    torch_step = recipe[recipe.index('-c "import torch"') :].split("--no-compile -e")[0]
    fallback = f'{tmp_path / "venv"}/bin/python -m pip install -q --no-compile "torch=='
    assert fallback in torch_step  # the default index, when the first try fails (or is skipped)
    if expected is None:
        assert "--index-url" not in torch_step.replace('--index-url ""', "")
    else:
        assert expected in torch_step
        assert torch_step.index(expected) < torch_step.index(fallback)


def test_make_keeps_the_bytecode_python_compiles_even_where_the_environment_says_not_to():
    # The install skips compiling bytecode (pip --no-compile); with PYTHONDONTWRITEBYTECODE passed on, every
    # process of the suite would then compile torch and this package again.
    probe = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "--eval", "probe-env: ; @env", "probe-env"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert probe.returncode == 0, probe.stderr
    assert "PATH=" in probe.stdout and "PYTHONDONTWRITEBYTECODE" not in probe.stdout
    assert "--no-compile" in subprocess.run(
        ["make", "-n", "-B", "-C", str(ROOT), "install"], capture_output=True, text=True, timeout=60
    ).stdout


@pytest.mark.parametrize(
    "argv,phrase",
    [
        (["report"], "lightning-pin report: error: the following arguments are required: run_dir"),
        (["report", "run", "--tolerance", "x"], "argument --tolerance: invalid float value: 'x'"),
        (["nosuch"], "lightning-pin: error: argument COMMAND: invalid choice: 'nosuch'"),
    ],
)
def test_usage_errors_are_one_line_with_status_2(capsys, argv, phrase):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and phrase in err, err


@pytest.mark.parametrize(
    "command",
    [
        ["train"],
        ["faults", "--rates", "0", "--seeds", "1"],
        ["tune", "--trials", "1"],
    ],
    ids=["train", "faults", "tune"],
)
def test_a_mistyped_config_key_ends_in_one_line_naming_the_closest_valid_keys(tmp_path, capsys, monkeypatch, command):
    """trainer.max_epoch=1 (no such key): one line naming it and trainer.max_epochs, status 2, nothing run."""
    if command[0] == "tune":
        pytest.importorskip("optuna")
    monkeypatch.chdir(tmp_path)
    if command[0] == "train":
        from lightning_pin.train import refuse_unknown_keys

        with pytest.raises(SystemExit) as info:
            refuse_unknown_keys(["model=mlp", "trainer.max_epoch=1"])
        status = info.value.code
    else:
        status = cli.main([*command, "--out", str(tmp_path / "out"), "trainer.max_epoch=1"])
    err = capsys.readouterr().err
    assert status == 2
    lines = [line for line in err.splitlines() if line.startswith("lightning-pin")]
    assert len(lines) == 1 and "reference_type" not in err and "object_type" not in err, err
    assert f"lightning-pin {command[0]}: error:" in lines[0]
    assert "unknown config key 'trainer.max_epoch'" in lines[0] and "did you mean trainer.max_epochs" in lines[0]
    assert not (tmp_path / "outputs").exists()


def test_a_key_of_a_group_option_and_of_a_nested_node_are_named_with_their_path(capsys):
    from lightning_pin.train import refuse_unknown_keys

    for overrides, words in [
        (["callbacks.pin_callback.monitor.tolerence=0.1"], "did you mean callbacks.pin_callback.monitor.tolerance?"),
        (["modle=mlp"], "unknown config key 'modle': did you mean model?"),
        (["trainer.zzz=1"], "the keys of trainer (TrainerConfig) are accelerator, devices"),
    ]:
        with pytest.raises(SystemExit) as info:
            refuse_unknown_keys(overrides)
        assert info.value.code == 2 and words in capsys.readouterr().err
    refuse_unknown_keys(["model=mlp", "trainer.max_epochs=1"])  # valid keys: no exit, nothing printed
    refuse_unknown_keys(["-m", "trainer.max_epoch=1,2"])  # a sweep: left to Hydra
    assert capsys.readouterr().err == ""
