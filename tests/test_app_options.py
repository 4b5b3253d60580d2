"""Every option of the config-group table of docs/how-to/hydra-app.md runs the app for one short epoch, and the app
refuses lengths that would never end (``trainer.max_epochs=-1``) or never train.

The runs go through :func:`lightning_pin.app.train.run` in this process (the subprocess path, Hydra's
own ``main``, is covered by tests/test_train_app.py), on a few batches of each phase.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import open_dict

from lightning_pin.app.pins import random_fault_map
from lightning_pin.app.models import Classifier, SmallCNN
from lightning_pin.app.train import PINNED_CKPT, run

from test_config import CONF, compose_train

#: The page with the table of the app's config groups (the README's table before the docs site).
TABLE_PAGE = Path(__file__).resolve().parents[1] / "docs" / "how-to" / "hydra-app.md"
SHORT = [
    "trainer.max_epochs=1", "pretrain.max_epochs=1", "trainer.limit_train_batches=3", "trainer.limit_val_batches=2"
]
# Options the table names that run elsewhere: a GPU needs a GPU, ddp_sim spawns two processes and
# Optuna is a sweeper (tests/test_train_app.py runs both through the real command).
# experiment=continual trains tasks in sequence and has a summary of its own (tests/test_tasks_app.py).
# Your own model and data (custom) and the torchvision recipes run in tests/test_custom_model.py; the fake
# data sets are shaped for real networks, not the digits CNN (tests/test_fake_data.py runs them), and model=hf
# needs a name or a config (tests/test_hf_models.py).
ELSEWHERE = {("trainer", "gpu"), ("trainer", "ddp_sim"), ("hparams_search", "optuna"), ("experiment", "continual"),
             ("model", "custom"), ("data", "custom"), ("model", "torchvision"), ("data", "cifar10"),
             ("data", "fake_images"), ("data", "fake_text"), ("model", "hf")}
# Building blocks, not options: the base the trainer options extend, and the callbacks that the
# callbacks options combine (one more is added as the table says: 'callbacks=[default,early_stopping]').
BLOCKS = {
    ("trainer", "default"),
    ("callbacks", "pin_callback"),
    ("callbacks", "model_checkpoint"),
    ("callbacks", "early_stopping"),
}


def table_rows() -> dict[str, str]:
    """The table's ``| `group` | options |`` rows, by group."""
    rows = {}
    for line in TABLE_PAGE.read_text().splitlines():
        match = re.match(r"\| `(\w+)` \| (.+) \|$", line)
        if match and (CONF / match.group(1)).is_dir():
            rows[match.group(1)] = match.group(2)
    return rows


def defaults() -> dict[str, str]:
    """The default option of each group, from conf/train.yaml's defaults list."""
    entries = yaml.safe_load((CONF / "train.yaml").read_text())["defaults"]
    return {k: v for entry in entries if isinstance(entry, dict) for k, v in entry.items() if v}


def table_options() -> list[tuple[str, str]]:
    return [
        (group, path.stem)
        for group in table_rows()
        for path in sorted((CONF / group).glob("*.yaml"))
        if (group, path.stem) not in BLOCKS
    ]


def test_the_table_names_every_option_of_every_group():
    rows = table_rows()
    assert {"data", "model", "optimizer", "pin", "trainer", "callbacks", "logger", "experiment"} <= set(rows)
    for group, option in table_options():
        assert f"`{option}`" in rows[group], f"{TABLE_PAGE.name}'s `{group}` row does not name `{option}`"
    assert "early_stopping" in rows["callbacks"]


def runnable_options() -> list[tuple[str, str]]:
    """Each option once; the defaults of all groups are one run (the first of the list)."""
    default = defaults()
    chosen = [(g, o) for g, o in table_options() if (g, o) not in ELSEWHERE and default.get(g) != o]
    return [("data", default["data"])] + chosen + [("callbacks", "[default,early_stopping]")]


@pytest.mark.parametrize("group,option", runnable_options(), ids=lambda x: x)
def test_every_option_of_the_table_runs_one_short_epoch(tmp_path, group, option):
    extra = []
    if (group, option) == ("pin", "fault_map"):
        torch.manual_seed(0)
        faults = random_fault_map(Classifier(SmallCNN()), "backbone.features.*.weight", fraction=0.05)
        torch.save(faults, tmp_path / "faults.pt")
        extra.append(f"pin.fault_map={tmp_path / 'faults.pt'}")
    cfg = compose_train(tmp_path, f"{group}={option}", *extra)
    with open_dict(cfg):  # after the option, so an experiment's own lengths are shortened too
        for override in SHORT:
            key, value = override.split("=")
            section, name = key.split(".")
            cfg[section][name] = int(value)
        if (group, option) != ("data", defaults()["data"]) and "pin_callback" in cfg.callbacks:
            # Drawing the PNG is most of a short run's time; the defaults' run draws it.
            cfg.callbacks.pin_callback.monitor.report = False
    summary = run(cfg)
    # run() verified every pin bit for bit (verify() raises otherwise) and saved the pinned model.
    assert summary["pins_exact"] is True and summary["violations"] == 0
    assert (tmp_path / PINNED_CKPT).is_file()
    assert (tmp_path / "pin_report.png").is_file() == ((group, option) == ("data", defaults()["data"]))
    if (group, option) == ("pin", "none"):
        assert not summary["pinned_elements"]
    elif (group, option) == ("pin", "neuron_faults"):  # stuck neurons pin no weight: they sit in the outputs
        assert not summary["pinned_elements"]
        saved = torch.load(tmp_path / "fault_map.pt", weights_only=True)["neuron_pins"]
        assert [p["modules"] for p in saved] == ["backbone.features.0", "backbone.features.2"]
    else:
        assert summary["pinned_elements"] > 0
    if option == "checkpoints":
        assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    if option in ("tensorboard", "many_loggers"):
        assert list((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["trainer.max_epochs=-1"], "trainer.max_epochs=-1 would retrain for ever"),
        (["trainer.max_epochs=0"], "trainer.max_epochs=0 retrains nothing"),
        (["pretrain.max_epochs=-1"], "pretrain.max_epochs=-1 would pretrain for ever"),
        (["trainer.max_steps=0"], "trainer.max_steps=0 retrains nothing"),
        (["trainer.max_epochs=-1", "trainer.max_steps=0"], "trainer.max_steps=0 retrains nothing"),
    ],
)
def test_endless_or_empty_lengths_are_refused_before_anything_runs(tmp_path, overrides, message):
    cfg = compose_train(tmp_path, *overrides)
    with pytest.raises(ValueError, match=re.escape(message)):
        run(cfg)
    assert list(tmp_path.iterdir()) == []  # nothing pretrained, nothing written


def test_max_steps_bounds_an_open_ended_epoch_count(tmp_path):
    cfg = compose_train(tmp_path, "trainer.max_epochs=-1", "trainer.max_steps=2", "pretrain.max_epochs=1",
                        "trainer.limit_train_batches=3", "trainer.limit_val_batches=2")
    summary = run(cfg)
    assert summary["steps"] == 2 and summary["pins_exact"] is True


def test_pinned_checkpoint_weights_keeps_the_weights_and_the_pin_state_that_check_reads(tmp_path):
    from safetensors.torch import load_file

    from lightning_pin.app.train import PIN_STATE, PINNED_WEIGHTS
    from lightning_pin.reporting.check import check_artifacts

    cfg = compose_train(tmp_path, "pinned_checkpoint=weights", *SHORT, "callbacks.pin_callback.monitor.report=false")
    summary = run(cfg)
    assert not (tmp_path / PINNED_CKPT).exists()
    assert {PINNED_WEIGHTS, PIN_STATE} <= set(summary["files"])
    weights = load_file(tmp_path / PINNED_WEIGHTS)
    assert summary["pinned_elements"] > 0 and "backbone.features.0.weight" in weights
    result = check_artifacts(tmp_path / PIN_STATE, [tmp_path / PINNED_WEIGHTS])
    result.verify()  # every pinned element of the kept weights is on its target, bit for bit
    assert result.holds


def test_an_unknown_pinned_checkpoint_is_refused_before_anything_runs(tmp_path):
    cfg = compose_train(tmp_path, "pinned_checkpoint=optimizer", *SHORT)
    with pytest.raises(ValueError, match=r"pinned_checkpoint='optimizer' is not one of \['full', 'weights'\]"):
        run(cfg)
    assert list(tmp_path.iterdir()) == []
