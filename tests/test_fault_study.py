"""``lightning-pin faults`` on a tiny budget (2 rates x 2 seeds, one epoch): the CSV with every column and the
PNG, identical faults for the same (rate, seed) whatever the recipe, ``--jobs 2`` equal to ``--jobs 1``, resume,
per-layer sensitivity, and bad arguments exiting 2 with one line.

The study runs its jobs as a child ``python -m lightning_pin.train -m ...``; most tests here fork that child from
tests/fork_runner.py's process, which imported torch, Lightning and Hydra once (:func:`forked_jobs`). The joblib
test (``--jobs 2``) starts it as a fresh interpreter, as the study does for a user (joblib's workers, started from a
forked process, took minutes to come up)."""

from __future__ import annotations

import contextlib
import csv
import math
import os
import shutil
import subprocess
import threading
import types
from pathlib import Path

import pytest
import torch

from lightning_pin import cli
from lightning_pin.app import study as study_module
from lightning_pin.reporting import faults as report

# One epoch of a few batches; no per-job report files or tables (the study writes its own).
TINY = ["pretrain.max_epochs=1", "trainer.max_epochs=1", "trainer.limit_train_batches=6", "data.batch_size=128",
        "callbacks.pin_callback.verbose=false", "callbacks.pin_callback.monitor.report=false"]
RATES = "0,0.2"


def faults(*args: str) -> int:
    return cli.main(["faults", *args])


def rows(directory: Path, name: str = report.FAULT_CURVE_CSV) -> list[dict[str, str]]:
    with open(directory / name, newline="") as file:
        return list(csv.DictReader(file))


def bits(path: Path) -> dict[str, torch.Tensor]:
    """A saved fault map, flattened to {key path: raw bytes of each tensor}, so NaN (healthy) cells compare equal."""
    flat: dict[str, torch.Tensor] = {}

    def walk(obj, key):
        if isinstance(obj, torch.Tensor):
            flat[key] = obj.contiguous().view(-1).view(torch.uint8) if obj.numel() else obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{key}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{key}/{i}")
        else:
            flat[key] = torch.tensor([hash(repr(obj))])

    walk(torch.load(path, weights_only=True), "")
    assert flat, f"{path} holds no fault"
    return flat


class _ForkedJobs:
    """What the study needs of ``subprocess.Popen`` (``poll``, ``returncode``), running the command on the fork
    runner in a thread; its output goes to the study's log when it ends."""

    def __init__(self, runner, args, stdout, stderr):
        self.returncode = None
        self._thread = threading.Thread(target=self._run, args=(runner, list(args), stdout), daemon=True)
        self._thread.start()

    def _run(self, runner, args, log):
        done = runner.run(args, cwd=os.getcwd(), env=dict(os.environ), timeout=600)
        log.write(done.stdout + done.stderr)
        log.flush()
        self.returncode = done.returncode

    def poll(self):
        return None if self._thread.is_alive() else self.returncode


@contextlib.contextmanager
def forked_jobs(runner):
    """The study's job processes fork from the fork runner (no interpreter start-up and imports per study)."""
    with pytest.MonkeyPatch.context() as patch:
        forked = types.SimpleNamespace(
            Popen=lambda args, stdout, stderr: _ForkedJobs(runner, args, stdout, stderr), STDOUT=subprocess.STDOUT
        )
        patch.setattr(study_module, "subprocess", forked)
        yield


@pytest.fixture(scope="module")
def study(tmp_path_factory, fork_runner):
    out = tmp_path_factory.mktemp("study")
    with forked_jobs(fork_runner):
        status = faults("--rates", RATES, "--seeds", "2", "--per-layer", "--out", str(out), *TINY)
    assert status == 0, (out / "study.log").read_text()[-3000:]
    return out


def test_writes_every_column_the_png_and_a_table(study, capsys):
    table = rows(study)
    assert list(table[0]) == list(report.COLUMNS)
    assert [(r["kind"], float(r["rate"]), int(r["seed"])) for r in table] == [
        ("value", 0.0, 0), ("value", 0.0, 1), ("value", 0.2, 0), ("value", 0.2, 1)]
    for row in table:
        assert row["pins_exact"] == "true" and row["diverged"] == "false"
        assert 0 <= float(row["forced"]) <= 1 and 0 <= float(row["final"]) <= 1
        assert math.isclose(float(row["gap"]), float(row["baseline"]) - float(row["final"]), abs_tol=1e-6)
    # One baseline for every job; the control (rate 0) pins nothing and starts from it untouched.
    assert len({r["baseline"] for r in table}) == 1
    control, faulty = table[0], table[2]
    assert control["pinned_elements"] == "0" and control["forced"] == control["baseline"]
    assert int(faulty["pinned_elements"]) == round(0.2 * 16 * 9) + round(0.2 * 32 * 16 * 9)
    assert float(faulty["forced"]) < float(faulty["baseline"])  # stuck values in [-2, 2) hurt before retraining
    png = study / report.FAULT_CURVE_PNG
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000
    # --per-layer: one parameter at a time, at the largest rate
    layers = rows(study, report.LAYER_CSV)
    assert sorted({r["param"] for r in layers}) == ["backbone.features.0.weight", "backbone.features.2.weight"]
    assert {float(r["rate"]) for r in layers} == {0.2} and len(layers) == 4
    assert (study / report.LAYER_PNG).read_bytes()[:4] == b"\x89PNG"


def test_same_rate_and_seed_draw_the_same_faults_whatever_the_recipe_and_launcher(study, tmp_path, fork_runner):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    other = tmp_path / "sgd"
    ckpt = study / "baseline" / "pretrained.ckpt"
    # Another recipe (SGD), on submitit's local launcher (what submitit_slurm runs on a cluster): the multirun
    # forks from the fork runner, submitit starts its job in a fresh interpreter.
    with forked_jobs(fork_runner):
        status = faults("--rates", "0.2", "--seeds", "1", "--out", str(other), *TINY, f"ckpt_path={ckpt}",
                        "optimizer=sgd", "hydra/launcher=submitit_local")
    assert status == 0, (other / "study.log").read_text()[-3000:]
    assert (other / "jobs" / ".submitit").is_dir()
    job = "jobs/value_rate0.2_seed0/fault_map.pt"
    first, again = bits(study / job), bits(other / job)
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    # ... and another seed draws other faults (the check above can fail).
    seed1 = bits(study / "jobs/value_rate0.2_seed1/fault_map.pt")
    assert not all(torch.equal(first[k], seed1[k]) for k in first)
    # The same baseline and faults, another optimizer: forced equal, final not.
    a, b = rows(study)[2], rows(other)[0]
    assert (a["baseline"], a["forced"]) == (b["baseline"], b["forced"]) and a["final"] != b["final"]


def test_two_parallel_jobs_give_the_numbers_of_one(study, tmp_path):
    parallel = tmp_path / "parallel"
    ckpt = study / "baseline" / "pretrained.ckpt"
    # The fixture's recipe had no ckpt_path: a new directory for a new recipe (see test_resume... below).
    status = faults("--rates", "0.2", "--seeds", "2", "--jobs", "2", "--out", str(parallel), *TINY, f"ckpt_path={ckpt}")
    assert status == 0, (parallel / "study.log").read_text()[-3000:]
    numbers = ("kind", "rate", "seed", "baseline", "forced", "final", "recovered_step", "pinned_elements")
    assert [[r[c] for c in numbers] for r in rows(parallel)] == [[r[c] for c in numbers] for r in rows(study)[2:]]
    assert "hydra/launcher=joblib" in (parallel / "study.log").read_text()


def test_rerun_skips_finished_jobs(study, tmp_path, fork_runner):
    resumed = tmp_path / "resumed"
    shutil.copytree(study, resumed)
    # An interrupted study: one job never finished.
    shutil.rmtree(resumed / "jobs/value_rate0.2_seed1")
    finished = resumed / "jobs/value_rate0.2_seed0/run_summary.json"
    before = finished.stat().st_mtime_ns
    (resumed / "study.log").write_text("")
    with forked_jobs(fork_runner):
        status = faults("--rates", RATES, "--seeds", "2", "--out", str(resumed), *TINY)
    assert status == 0, (resumed / "study.log").read_text()[-3000:]
    log = (resumed / "study.log").read_text()
    assert "pretrain.only=true" not in log  # the baseline is reused, not pretrained again
    assert log.count("Skipped:") == 3 and finished.stat().st_mtime_ns == before
    same = [c for c in report.COLUMNS if c not in ("seconds", "job_dir")]
    assert [[r[c] for c in same] for r in rows(resumed)] == [[r[c] for c in same] for r in rows(study)]


def test_a_directory_holding_another_recipe_is_refused(study, capsys):
    assert faults("--rates", RATES, "--seeds", "2", "--out", str(study), *TINY, "optimizer=sgd") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "give this recipe its own --out" in err[0]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--rates", "0,1.5"], "--rates must be in [0, 1]"),
        (["--rates", "-0.1"], "--rates must be in [0, 1]"),
        (["--rates", "0,abc"], "--rates takes numbers"),
        (["--seeds", "0"], "--seeds must be at least 1"),
        (["--kind", "laser"], "unknown --kind 'laser'"),
        (["--jobs", "0"], "--jobs must be at least 1"),
        (["pin.rate=0.3"], "is set by the study itself"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, says, tmp_path, capsys):
    assert faults(*args, "--out", str(tmp_path / "never")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and err[0].startswith("lightning-pin faults: error:")
    assert not (tmp_path / "never").exists()  # nothing was started


@pytest.mark.parametrize(
    ("summary", "chance", "expected"),
    [
        ({"train_loss": 0.3, "forced": 0.5, "final": 0.95, "tolerance": 0.01}, 0.1, False),
        ({"train_loss": float("nan"), "forced": 0.5, "final": 0.95, "tolerance": 0.01}, 0.1, True),
        ({"train_loss": 2.3, "forced": 0.5, "final": 0.45, "tolerance": 0.01}, None, True),  # worse than forced
        ({"train_loss": 2.3, "forced": 0.09, "final": 0.091, "tolerance": 0.01}, 0.1, True),  # a constant guess
        ({"train_loss": 2.3, "forced": 0.09, "final": 0.091, "tolerance": 0.01}, None, False),
    ],
)
def test_diverged_says_when_retraining_failed_outright(summary, chance, expected):
    from lightning_pin.app.train import diverged

    assert diverged(summary, chance=chance) is expected


def test_draw_faults_kinds_and_the_control():
    from lightning_pin import PinError
    from lightning_pin.app.fault_pins import draw_faults, value_fault_map
    from lightning_pin.app.models import SmallCNN

    model, params = SmallCNN(), "features.*.weight"
    assert draw_faults(model, "value", 0.0, 0, params) == []  # the control pins nothing
    with pytest.raises(PinError, match="matches no parameter"):
        draw_faults(model, "value", 0.0, 0, "nothing.*")  # ... but a typo still fails there
    with pytest.raises(PinError, match=r"in \[0, 1\]"):
        draw_faults(model, "value", 1.5, 0, params)
    # value: the seeded map, as mask pins holding its stuck values
    stuck = value_fault_map(model, params, 0.2, -2.0, 2.0, seed=4)
    for pin in draw_faults(model, "value", 0.2, 4, params, low=-2.0, high=2.0):
        name = pin.params if isinstance(pin.params, str) else pin.params[0]
        assert torch.equal(pin.mask, ~stuck[name].isnan()) and torch.equal(pin.value, stuck[name][pin.mask])
    # cell: exactly what lightning_pin.faults.cell_faults draws
    faults_module = pytest.importorskip("lightning_pin.faults")
    drawn = draw_faults(model, "cell", 0.2, 4, params, sa1_fraction=0.25)
    direct = faults_module.cell_faults(model, params, 0.2, sa1_fraction=0.25, seed=4)
    assert len(drawn) == len(direct) == 2
    for a, b in zip(drawn, direct):
        assert a.params == b.params and torch.equal(a.indices, b.indices) and torch.equal(a.value, b.value)


def test_bit_and_cell_kinds_run_end_to_end(study, tmp_path, fork_runner):
    """``--kind bit`` (stuck bits, bit_faults) and ``--kind cell`` (stuck-at cells, cell_faults) on the
    study's baseline: every job's pins verified bit for bit, the faulty rate pins something."""
    ckpt = next(study.rglob("pretrained.ckpt"))
    for kind, rate in (("bit", "0.01"), ("cell", "0.2")):
        out = tmp_path / kind
        with forked_jobs(fork_runner):
            status = faults("--kind", kind, "--rates", f"0,{rate}", "--seeds", "1", "--out", str(out),
                            f"ckpt_path={ckpt}", *TINY)
        assert status == 0, (out / "study.log").read_text()[-3000:]
        table = rows(out)
        assert [(r["kind"], float(r["rate"])) for r in table] == [(kind, 0.0), (kind, float(rate))]
        assert all(r["pins_exact"] == "true" for r in table)
        assert table[0]["pinned_elements"] == "0" and int(table[1]["pinned_elements"]) > 0


def test_the_table_is_one_line_per_rate_with_ci_and_says_when_jobs_diverged(capsys):
    rows = [dict(kind="value", rate=r, seed=s, baseline=0.9, forced=f, final=fin, gap=0.9 - fin, tolerance=0.01,
                 recovered_step=None, pins_exact=True, diverged=d)
            for r, s, f, fin, d in [(0.0, 0, 0.9, 0.9, False), (0.0, 1, 0.9, 0.9, False),
                                    (0.5, 0, 0.2, 0.1, True), (0.5, 1, 0.4, 0.5, False)]]
    report.print_curve(rows, "t")
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("│")]
    assert len(lines) == 2 and lines[0].split("│")[1].strip() == "0" and lines[1].split("│")[1].strip() == "0.5"
    # rate 0.5: forced mean 0.3, CI = t(1) * sd / sqrt(2) = 12.706 * 0.1414 / 1.414 = 1.271
    assert "0.300 ± 1.271" in out and "0/2, 1 diverged" in out
    assert "1 job(s) diverged" in out
