"""``lightning-pin faults`` on a tiny budget (2 rates x 2 seeds, one epoch): the CSV with every column and the
PNG, identical faults and numbers for the same (rate, seed) whatever the runner (this process, forked workers,
Hydra's joblib and submitit_local launchers) and the recipe, resume (also past an unreadable job summary), per-layer
sensitivity, ``--no-retrain`` and ``--kind flip`` campaigns, ``changed_bits``, progress lines, and bad arguments
exiting 2 with one line before any work.

The study runs its jobs in the test's own process (``--jobs 1``) or in workers it forks (``--jobs 2``). The
launcher tests start the multirun child on tests/fork_runner.py (imports done once, :func:`forked_jobs`); the jobs
of joblib (its loky workers) and submitit_local are fresh interpreters, as they are for a user."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import shutil
import subprocess
import threading
import time
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
#: Columns that must agree between two runs of the same jobs (not seconds, not where they ran).
NUMBERS = ("kind", "rate", "seed", "baseline", "forced", "final", "gap", "recovered_step", "pinned_elements",
           "changed_bits", "pins_exact")


def faults(*args: str) -> int:
    return cli.main(["faults", *args])


def rows(directory: Path, name: str = report.FAULT_CURVE_CSV) -> list[dict[str, str]]:
    with open(directory / name, newline="") as file:
        return list(csv.DictReader(file))


def numbers(table, columns=NUMBERS):
    return [[r[c] for c in columns] for r in table]


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

    def __init__(self, runner, args, stdout, stderr, env=None):
        self.returncode = None
        self._thread = threading.Thread(target=self._run, args=(runner, list(args), stdout, env), daemon=True)
        self._thread.start()

    def _run(self, runner, args, log, env):
        done = runner.run(args, cwd=os.getcwd(), env=dict(env or os.environ), timeout=600)
        log.write(done.stdout + done.stderr)
        log.flush()
        self.returncode = done.returncode

    def poll(self):
        return None if self._thread.is_alive() else self.returncode


@contextlib.contextmanager
def forked_jobs(runner):
    """A launcher's multirun child forks from the fork runner (no interpreter start-up and imports per study)."""
    with pytest.MonkeyPatch.context() as patch:
        forked = types.SimpleNamespace(
            Popen=lambda args, stdout, stderr, env=None: _ForkedJobs(runner, args, stdout, stderr, env),
            STDOUT=subprocess.STDOUT,
        )
        patch.setattr(study_module, "subprocess", forked)
        yield


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    status = faults("--rates", RATES, "--seeds", "2", "--per-layer", "--out", str(out), *TINY)
    assert status == 0, (out / "study.log").read_text()[-3000:]
    return out


def popcount_difference(a: torch.Tensor, b: torch.Tensor) -> int:
    x = (a.view(-1).view(torch.int32) ^ b.view(-1).view(torch.int32)).to(torch.int64) & 0xFFFFFFFF
    return int(sum(((x >> bit) & 1).sum() for bit in range(32)))


def baseline_model(study: Path):
    """The app's model with the study's baseline weights, its config and state dict."""
    from hydra.utils import instantiate

    from lightning_pin.app.compose import compose_app

    state = torch.load(study / "baseline" / "pretrained.ckpt", weights_only=True)["state_dict"]
    cfg = compose_app([*TINY, "pin=faults"], study / "x")
    model = instantiate(cfg.model, _partial_=True, _convert_="all")(optimizer=instantiate(cfg.optimizer))
    model.load_state_dict(state)
    return model, cfg, state


def test_writes_every_column_the_png_and_a_table(study):
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
    assert control["changed_bits"] == "0"
    assert int(faulty["pinned_elements"]) == round(0.2 * 16 * 9) + round(0.2 * 32 * 16 * 9)
    assert float(faulty["forced"]) < float(faulty["baseline"])  # stuck values in [-2, 2) hurt before retraining
    png = study / report.FAULT_CURVE_PNG
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000
    # --per-layer: one parameter at a time, at the largest rate, with each parameter's size
    layers = rows(study, report.LAYER_CSV)
    assert sorted({r["param"] for r in layers}) == ["backbone.features.0.weight", "backbone.features.2.weight"]
    assert {float(r["rate"]) for r in layers} == {0.2} and len(layers) == 4
    assert {r["param"]: r["elements"] for r in layers} == {"backbone.features.0.weight": "144",
                                                           "backbone.features.2.weight": "4608"}
    assert (study / report.LAYER_PNG).read_bytes()[:4] == b"\x89PNG"


def test_changed_bits_is_a_direct_count_of_the_stored_bits_the_faults_change(study):
    """Load the baseline, force the job's saved faults with the engine, count differing bits one by one."""
    from lightning_pin.app.fault_pins import draw_faults
    from lightning_pin.core.engine import PinEngine
    from lightning_pin.core.plan import resolve

    table = rows(study)
    model, cfg, state = baseline_model(study)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for row in table[2:]:
        pins = draw_faults(model, "value", 0.2, int(row["seed"]), cfg.pin.params, low=-2.0, high=2.0)
        engine = PinEngine(resolve(pins, model))
        engine.set_active(range(len(pins)))
        engine.force()
        direct = sum(popcount_difference(before[n], p.detach()) for n, p in model.named_parameters())
        assert int(row["changed_bits"]) == direct > 0
        model.load_state_dict(state)


def test_every_runner_gives_the_same_faults_and_numbers(study, tmp_path, fork_runner):
    """This process, forked workers (--jobs 2), Hydra's joblib and submitit_local launchers: one (rate, seed), one
    answer."""
    ckpt = study / "baseline" / "pretrained.ckpt"
    expected = numbers(rows(study)[2:])
    # joblib's loky workers and submitit_local's jobs are fresh interpreters (about 10 CPU s of imports each): one
    # job, seed 0, on each; the two forked workers each run a job of their own (seeds 0 and 1).
    runs = {"forked": ["--jobs", "2"], "joblib": ["--launcher", "joblib", "--jobs", "2"]}
    if pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="submitit") is not None:
        runs["submitit_local"] = ["--launcher", "submitit_local"]
    for name, options in runs.items():
        out = tmp_path / name
        seeds = 2 if name == "forked" else 1
        # The fixture's recipe had no ckpt_path: a new directory for a new recipe.
        args = ["--rates", "0.2", "--seeds", str(seeds), *options, "--out", str(out), *TINY, f"ckpt_path={ckpt}"]
        runner = forked_jobs(fork_runner) if name != "forked" else contextlib.nullcontext()
        with runner:
            status = faults(*args)
        assert status == 0, (name, (out / "study.log").read_text()[-3000:] if (out / "study.log").exists() else "")
        assert numbers(rows(out)) == expected[:seeds], name
        job = "jobs/value_rate0.2_seed0/fault_map.pt"
        first, again = bits(study / job), bits(out / job)
        assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first), name
    assert "hydra/launcher=joblib" in (tmp_path / "joblib" / "study.log").read_text()
    if "submitit_local" in runs:
        assert (tmp_path / "submitit_local" / "jobs" / ".submitit").is_dir()
    # ... and another seed draws other faults (the check above can fail).
    seed1 = bits(study / "jobs/value_rate0.2_seed1/fault_map.pt")
    first = bits(study / "jobs/value_rate0.2_seed0/fault_map.pt")
    assert not all(torch.equal(first[k], seed1[k]) for k in first)


def test_another_recipe_meets_the_same_faults(study, tmp_path):
    ckpt = study / "baseline" / "pretrained.ckpt"
    other = tmp_path / "sgd"
    assert faults("--rates", "0.2", "--seeds", "1", "--out", str(other), *TINY, f"ckpt_path={ckpt}",
                  "optimizer=sgd") == 0
    job = "jobs/value_rate0.2_seed0/fault_map.pt"
    first, again = bits(study / job), bits(other / job)
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    # The same baseline and faults, another optimizer: forced equal, final not.
    a, b = rows(study)[2], rows(other)[0]
    assert (a["baseline"], a["forced"], a["changed_bits"]) == (b["baseline"], b["forced"], b["changed_bits"])
    assert a["final"] != b["final"]


def test_rerun_skips_finished_jobs_and_reruns_one_whose_summary_is_unreadable(study, tmp_path, capsys):
    resumed = tmp_path / "resumed"
    shutil.copytree(study, resumed)
    shutil.rmtree(resumed / "jobs/value_rate0.2_seed1")  # an interrupted study: one job never finished
    broken = resumed / "jobs/value_rate0.0_seed1/run_summary.json"
    broken.write_text('{"job": nul')  # and one summary cut short
    finished = resumed / "jobs/value_rate0.2_seed0/run_summary.json"
    before = finished.stat().st_mtime_ns
    assert faults("--rates", RATES, "--seeds", "2", "--out", str(resumed), *TINY) == 0
    out = capsys.readouterr().out
    assert "baseline: " in out and "(reused)" in out  # the baseline is reused, not pretrained again
    assert f"{broken} is unreadable" in out and "running that job again" in out
    assert "fault curve: 4 job(s) in this process, 2 finished before (skipped)" in out
    assert finished.stat().st_mtime_ns == before and json.loads(broken.read_text())["fault"]["seed"] == 1
    same = [c for c in report.COLUMNS if c not in ("seconds", "job_dir")]
    assert numbers(rows(resumed), same) == numbers(rows(study), same)


def test_progress_says_every_stage_and_each_job_with_an_eta(study, capsys):
    # A rerun of the fixture (every job finished) still says each stage; a fresh one is in the fixture's log.
    assert faults("--rates", RATES, "--seeds", "2", "--per-layer", "--out", str(study), *TINY) == 0
    out = capsys.readouterr().out
    for stage in ("loading torch, Lightning and the app", "composing the job config", "baseline: ",
                  "fault curve: 4 job(s)", "per layer: 4 job(s)", "plotting fault_curve.png",
                  "plotting layer_sensitivity.png", "wrote "):
        assert stage in out, stage


def test_progress_lines_for_jobs_carry_an_eta_and_a_heartbeat_breaks_silence(study, tmp_path, capsys):
    ckpt = study / "baseline" / "pretrained.ckpt"
    assert faults("--rates", "0.2", "--seeds", "2", "--out", str(tmp_path / "p"), *TINY, f"ckpt_path={ckpt}") == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in lines] == ["[1/2", "[2/2"]
    assert all("ETA" in line and "forced" in line and "final" in line for line in lines)
    stream = io.StringIO()
    progress = study_module.Progress(stream)
    with progress.stage("a slow stage"):
        time.sleep(study_module.HEARTBEAT + 0.6)
    said = stream.getvalue().splitlines()
    assert said[0] == "a slow stage ..." and any("a slow stage: 2 s ..." in line for line in said[1:-1])
    assert said[-1].startswith("  a slow stage: done in")


def test_no_retrain_rows_are_the_retrained_studys_forced_numbers(study, tmp_path):
    ckpt = study / "baseline" / "pretrained.ckpt"
    out = tmp_path / "forced"
    assert faults("--rates", RATES, "--seeds", "2", "--no-retrain", "--per-layer", "--out", str(out), *TINY,
                  f"ckpt_path={ckpt}") == 0
    table, retrained = rows(out), rows(study)
    assert list(table[0]) == list(report.COLUMNS)
    forced = ("kind", "rate", "seed", "baseline", "forced", "pinned_elements", "changed_bits")
    assert numbers(table, forced) == numbers(retrained, forced)  # the same draws, the same evaluation, bit for bit
    assert all(r["final"] == r["gap"] == r["recovered_step"] == "" for r in table)
    assert not (out / "jobs").exists()  # one process, no job directories
    layers = rows(out, report.LAYER_CSV)
    assert numbers(layers, ("param", *forced)) == numbers(rows(study, report.LAYER_CSV), ("param", *forced))
    assert (out / report.FAULT_CURVE_PNG).is_file()


def test_many_draws_restore_the_weights_exactly_without_copying_the_model(study, tmp_path, monkeypatch):
    """--seeds 30 --no-retrain: every draw undone bit for bit (checked after the campaign), and no deep copy of
    the model per draw (counted on copy.deepcopy and state_dict, the two ways a copy would be made)."""
    ckpt = study / "baseline" / "pretrained.ckpt"
    import copy

    copies = []
    real = copy.deepcopy
    def counting(obj, *args, **kwargs):
        copies.append(type(obj).__name__)
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(copy, "deepcopy", counting)
    out = tmp_path / "many"
    assert faults("--kind", "cell", "--rates", "0.1,0.3", "--seeds", "30", "--no-retrain", "--out", str(out),
                  *TINY, f"ckpt_path={ckpt}") == 0
    assert len(rows(out)) == 60 and len({r["forced"] for r in rows(out)}) > 5
    assert not [name for name in copies if "Classifier" in name or "Module" in name]


def test_kind_flip_flips_the_drawn_bits_for_the_evaluation_only(study, tmp_path):
    from lightning_pin.faults import flip_bits

    ckpt = study / "baseline" / "pretrained.ckpt"
    out = tmp_path / "flip"
    assert faults("--kind", "flip", "--rates", "0,1e-3,0.01", "--seeds", "2", "--out", str(out), *TINY,
                  f"ckpt_path={ckpt}") == 0
    table = rows(out)
    assert [r["kind"] for r in table] == ["flip"] * 6 and all(r["final"] == "" for r in table)
    # Every flip changes exactly one stored bit: changed_bits is the number of flips flip_bits draws.
    model, cfg, _ = baseline_model(study)
    for row in table:
        flips = flip_bits(model, cfg.pin.params, float(row["rate"]), seed=int(row["seed"]))
        assert int(row["changed_bits"]) == sum(flips.flipped.values())
    assert int(table[-1]["changed_bits"]) > int(table[2]["changed_bits"]) > 0
    assert json.loads((out / "study.json").read_text())["retrain"] is False


@pytest.mark.parametrize("kind", ["bit", "cell"])
def test_bit_and_cell_kinds_run_end_to_end(study, tmp_path, kind):
    """``--kind bit`` (stuck bits) and ``--kind cell`` (stuck-at cells) on the study's baseline: every job's pins
    verified bit for bit, the faulty rate pins something, and a stuck-at study changes about half the bits a flip
    study changes at the same positions (the other half already held the stuck value)."""
    ckpt = study / "baseline" / "pretrained.ckpt"
    rate = "0.01" if kind == "bit" else "0.2"
    out = tmp_path / kind
    assert faults("--kind", kind, "--rates", f"0,{rate}", "--seeds", "1", "--out", str(out), f"ckpt_path={ckpt}",
                  *TINY) == 0
    table = rows(out)
    assert [(r["kind"], float(r["rate"])) for r in table] == [(kind, 0.0), (kind, float(rate))]
    assert all(r["pins_exact"] == "true" for r in table)
    assert table[0]["pinned_elements"] == "0" and int(table[1]["pinned_elements"]) > 0
    if kind == "bit":
        flips = tmp_path / "flips"
        assert faults("--kind", "flip", "--rates", rate, "--seeds", "1", "--out", str(flips), f"ckpt_path={ckpt}",
                      *TINY) == 0
        stuck, flipped = int(table[1]["changed_bits"]), int(rows(flips)[0]["changed_bits"])
        assert 0.35 * flipped < stuck < 0.65 * flipped


def test_a_directory_holding_another_recipe_or_kind_is_refused(study, tmp_path, capsys):
    assert faults("--rates", RATES, "--seeds", "2", "--out", str(study), *TINY, "optimizer=sgd") == 2
    for args in (["--kind", "cell"], ["--no-retrain"]):
        assert faults(*args, "--rates", RATES, "--seeds", "2", "--out", str(study), *TINY) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all("give this recipe its own --out" in line for line in err)
    assert "holds a study of --kind value, not --kind cell" in err[1]
    # An older study.json without the kind: read from its jobs' directories.
    old = tmp_path / "old"
    (old / "jobs" / "cell_rate0.2_seed0").mkdir(parents=True)
    (old / "study.json").write_text(json.dumps({"overrides": TINY}))
    assert faults("--rates", RATES, "--out", str(old), *TINY) == 2
    assert "holds a study of --kind cell, not --kind value" in capsys.readouterr().err


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
        (["--launcher", "ray"], "unknown --launcher 'ray'"),
        (["--kind", "flip", "--launcher", "joblib"], "--kind flip measures every draw in this process"),
        (["trainer.max_epoch=1"], "the job config does not compose"),
        (["optimizer=nosuch"], "the job config does not compose"),
        (["trainer.max_epochs=0"], "trainer.max_epochs=0 retrains nothing"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_before_any_work(args, says, tmp_path, capsys):
    assert faults(*args, "--out", str(tmp_path / "never")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and err[0].startswith("lightning-pin faults: error:"), err
    assert not (tmp_path / "never").exists()  # nothing was started


def test_out_naming_a_file_exits_2_with_one_line(tmp_path, capsys):
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    assert faults("--out", str(path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a file: give a directory" in err[0] and path.read_text() == "mine"


def _figure(monkeypatch):
    """The Figure a plot function saves (its savefig writes nothing)."""
    from matplotlib.figure import Figure

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda self, path, **kw: saved.append(self))
    return saved


def _curve_rows(seeds, forced=lambda r, s: 0.9 - r - 0.3 * s, final=lambda r, s: 0.95):
    return [dict(kind="cell", rate=r, seed=s, baseline=0.9, tolerance=0.01, forced=forced(r, s), final=final(r, s))
            for r in (0.0, 0.1, 0.3) for s in range(seeds)]


def test_the_curve_draws_every_seed_and_no_band_below_three_seeds(monkeypatch, tmp_path):
    from matplotlib.collections import PathCollection, PolyCollection

    saved = _figure(monkeypatch)
    report.plot_curve(_curve_rows(2), tmp_path / "c.png")
    ax = saved[-1].axes[0]
    points = sum(len(c.get_offsets()) for c in ax.collections if isinstance(c, PathCollection))
    bands = [c for c in ax.collections if isinstance(c, PolyCollection) and "CI" in str(c.get_label())]
    assert points == 2 * 3 * 2 and not bands  # every seed's forced and final point; no t-band of 2 seeds
    assert "no confidence band with fewer than 3 seeds" in ax.get_title()
    # 3 seeds: a band, and when it reaches past [0, 1] it is clipped and says so.
    report.plot_curve(_curve_rows(3, forced=lambda r, s: [0.05, 0.95, 0.5][s]), tmp_path / "c.png")
    ax = saved[-1].axes[0]
    labels = [str(c.get_label()) for c in ax.collections if isinstance(c, PolyCollection)]
    assert "95% CI of the mean (Student's t, n = 3), clipped to [0, 1]" in labels
    assert "clipped to [0, 1]" in ax.get_title()
    ys = [v[1] for c in ax.collections if isinstance(c, PolyCollection) for p in c.get_paths() for v in p.vertices]
    assert 0.0 <= min(ys) and max(ys) <= 1.0


def test_a_forced_only_curve_has_no_final_series(monkeypatch, tmp_path):
    saved = _figure(monkeypatch)
    report.plot_curve(_curve_rows(3, final=lambda r, s: None), tmp_path / "c.png")
    labels = [str(h.get_label()) for h in saved[-1].axes[0].get_legend().legend_handles]
    assert any("forced" in text for text in labels) and not any("final" in text for text in labels)


def test_layer_sensitivity_bars_stay_on_the_axis_name_sizes_and_keep_the_legend_off_the_bars(monkeypatch, tmp_path):
    saved = _figure(monkeypatch)
    layer = [dict(kind="cell", rate=0.3, seed=s, param=p, elements=e, baseline=0.9, forced=f, final=0.97,
                  pinned_elements=round(0.3 * e))
             for p, e in (("backbone.layers.0.weight", 1024), ("backbone.layers.1.weight", 256))
             for s, f in enumerate([0.05, 0.95, 0.5])]
    report.plot_layers(layer, tmp_path / "l.png")
    fig = saved[-1]
    ax = fig.axes[0]
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == ["layers.0.weight\n1,024 elements, 307 faulty", "layers.1.weight\n256 elements, 77 faulty"]
    from matplotlib.collections import LineCollection

    ys = [v[1] for c in ax.collections if isinstance(c, LineCollection) for seg in c.get_segments() for v in seg]
    assert ys and 0.0 <= min(ys) and max(ys) <= 1.0  # error bars clipped to [0, 1] ...
    assert "clipped to [0, 1]" in ax.get_title()  # ... and the figure says so
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    legend = ax.get_legend().get_window_extent()
    assert legend.y1 <= ax.get_window_extent().y0  # below the axis: over no bar


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


def test_the_table_is_one_line_per_rate_with_ci_and_says_when_jobs_diverged(capsys):
    rows = [dict(kind="value", rate=r, seed=s, baseline=0.9, forced=f, final=fin, gap=0.9 - fin, tolerance=0.01,
                 recovered_step=None, pins_exact=True, diverged=d)
            for r, s, f, fin, d in [(0.0, 0, 0.9, 0.9, False), (0.0, 1, 0.9, 0.9, False),
                                    (0.5, 0, 0.2, 0.1, True), (0.5, 1, 0.4, 0.5, False)]]
    report.print_curve(rows, "t")
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("│")]
    assert len(lines) == 2 and lines[0].split("│")[1].strip() == "0" and lines[1].split("│")[1].strip() == "0.5"
    # rate 0.5: forced mean 0.3 over 2 seeds: the range, not a t interval (12.706 * 0.1414 / 1.414 = 1.271)
    assert "0.300 (range 0.200 to 0.400)" in out and "± 1.271" not in out and "0/2, 1 diverged" in out
    assert "fewer than 3 seeds give no confidence interval" in out
    assert "1 job(s) diverged" in out


def test_a_config_dir_of_the_users_own_groups_composes_every_job(tmp_path, capsys):
    """Study.config_dir (``--config-dir``): the user's config groups are searched before the app's, for the
    baseline and every draw."""
    groups = tmp_path / "conf" / "model"
    groups.mkdir(parents=True)
    (groups / "tiny_mlp.yaml").write_text("defaults:\n  - mlp\n  - _self_\n\nbackbone:\n  hidden: [8]\n")
    out = tmp_path / "study"
    study = study_module.Study(kind="cell", rates=(0.0, 0.3), seeds=1, no_retrain=True, out=str(out),
                               config_dir=str(tmp_path / "conf"),
                               overrides=("model=tiny_mlp", "pin.params=backbone.layers.*.weight", *TINY))
    assert study_module.run_study(study) == 0
    table = rows(out)
    assert int(table[1]["pinned_elements"]) == round(0.3 * 64 * 8)  # the user's 64 -> 8 layer, not the app's MLP
    missing = study_module.Study(out=str(tmp_path / "never"), config_dir=str(tmp_path / "nowhere"))
    with pytest.raises(study_module.StudyError, match="is not a directory"):
        study_module.run_study(missing)


def test_a_job_keeps_what_the_study_reads_and_check_verifies_its_weights(study, capsys):
    """By default: the summary, the fault map and the pinned weights (no optimizer state, no per-job figure);
    ``lightning-pin check pins.pt pinned.safetensors`` verifies every pinned element of the kept weights."""
    from safetensors.torch import load_file

    model, _, _ = baseline_model(study)
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    job = study / "jobs" / "value_rate0.2_seed0"
    assert {p.name for p in job.iterdir() if p.is_file()} == {
        "run_summary.json", "fault_map.pt", "pinned.safetensors", "pins.pt", "job.log"}
    weights = load_file(job / "pinned.safetensors")
    assert weights.keys() == model.state_dict().keys()
    assert (job / "pinned.safetensors").stat().st_size < 1.1 * weight_bytes  # no optimizer moments
    assert cli.main(["check", str(job / "pins.pt"), str(job / "pinned.safetensors")]) == 0
    assert "hold" in capsys.readouterr().out
    # A pinned element moved in the file: check finds it.
    state = torch.load(job / "pins.pt", weights_only=True)
    name = next(n for n in weights if n.startswith("backbone.features.2.weight"))
    from safetensors.torch import save_file

    weights[name] = weights[name] + 1.0
    save_file(weights, str(job.parent / "moved.safetensors"))
    assert state and cli.main(["check", str(job / "pins.pt"), str(job.parent / "moved.safetensors")]) == 1


def test_keep_checkpoints_keeps_pinned_ckpt_and_the_baseline_is_measured_once(study, tmp_path, monkeypatch):
    from lightning_pin.callbacks.monitor import PinMonitor

    measured = []
    evaluate = PinMonitor._evaluate

    def counted(self, *args, **kwargs):
        value = evaluate(self, *args, **kwargs)
        measured.append(value)
        return value

    monkeypatch.setattr(PinMonitor, "_evaluate", counted)
    ckpt = study / "baseline" / "pretrained.ckpt"
    out = tmp_path / "kept"
    assert faults("--rates", "0.2", "--seeds", "2", "--keep-checkpoints", "--out", str(out), *TINY,
                  f"ckpt_path={ckpt}") == 0
    job = out / "jobs" / "value_rate0.2_seed1"
    assert (job / "pinned.ckpt").is_file() and not (job / "pinned.safetensors").exists()
    # One baseline for the two jobs (the first measures it), one forced value each: 3 evaluations, not 4;
    # and the numbers of the jobs are the fixture's, whichever job measured the baseline.
    assert len(measured) == 3
    assert numbers(rows(out)) == numbers(rows(study)[2:])
    summary = json.loads((job / "run_summary.json").read_text())
    assert summary["baseline"] == measured[0]
    # What a job keeps is the study's to set: --keep-checkpoints, not the override.
    assert faults("--rates", "0.2", "--out", str(tmp_path / "x"), *TINY, "pinned_checkpoint=full") == 2
