"""``lightning-pin tune``: Optuna >= 3 over the app through Hydra's compose API, on a tiny budget: 3 trials with
SQLite storage (a rerun resumes), the multi-objective NSGA-II form with its Pareto front, per-epoch pruning."""

from __future__ import annotations

import csv

import pytest

optuna = pytest.importorskip("optuna")
if int(optuna.__version__.split(".")[0]) < 3:
    pytest.skip("lightning-pin tune needs optuna >= 3", allow_module_level=True)

from helpers import make_loader, trainer  # noqa: E402
from lightning_pin import Pin, PinCallback, PinMonitor, cli  # noqa: E402
from lightning_pin.app.tune import EpochPruning  # noqa: E402
from test_recovery import ValNet  # noqa: E402

# The pin callback's own tables and reports stay on: tune keeps them in each trial's trial.log.
TINY = ["pretrain.max_epochs=1", "trainer.max_epochs=1", "trainer.limit_train_batches=4", "data.batch_size=128"]
# Three complete trials whatever their accuracies: with 4 training batches a trial's accuracy moves by points with the
# shuffle, and the median pruner (tested on its own below) would prune one or not by chance.
NO_PRUNE = ["--no-prune"]


def read(path):
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune")
    assert cli.main(["tune", "--trials", "3", "--out", str(out), "--param", "optimizer.lr=log:1e-3:1e-2", *NO_PRUNE,
                     *TINY]) == 0
    return out


def test_three_trials_in_sqlite_and_a_rerun_resumes(baseline, capsys):
    rows = read(baseline / "trials.csv")
    assert [r["trial"] for r in rows] == ["0", "1", "2"]
    assert all(1e-3 <= float(r["optimizer.lr"]) <= 1e-2 and 0 <= float(r["final (max)"]) <= 1 for r in rows)
    assert len({r["optimizer.lr"] for r in rows}) == 3
    assert (baseline / "baseline" / "pretrained.ckpt").is_file() and (baseline / "tune.db").is_file()
    # A single objective is plotted too: by trial and against the parameter, axes named by what they measure.
    assert (baseline / "trials.png").read_bytes()[:4] == b"\x89PNG"
    # Each trial's own output (its pin tables and report) is in its log, not on the console.
    log = (baseline / "trial_0" / "trial.log").read_text()
    assert "lightning-pin report" in log and "PinCallback: pins resolved" in log
    capsys.readouterr()
    # The same command with one more trial: the study resumes from SQLite and runs only that one.
    assert cli.main(["tune", "--trials", "4", "--out", str(baseline), "--param", "optimizer.lr=log:1e-3:1e-2",
                     *NO_PRUNE, *TINY]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "3/4 trials done" in out and "trial 3:" in out and "trial 2:" not in out
    assert "baseline: pretraining" not in out
    # One line per trial and a final table of all four: no trial's pin table or report on the console.
    assert "lightning-pin report" not in out + captured.err and "pins resolved" not in out + captured.err
    assert "complete trial(s)" in out and "best trial" in out
    assert len(out.splitlines()) <= 16, out


def test_multi_objective_prints_and_plots_the_pareto_front(baseline, tmp_path, capsys):
    ckpt = baseline / "baseline" / "pretrained.ckpt"
    status = cli.main(["tune", "--trials", "3", "--out", str(tmp_path), "--objectives", "final:max,pin.rate:max",
                       "--param", "pin.rate=float:0.05:0.5", "pin=faults", f"ckpt_path={ckpt}", *TINY])
    assert status == 0
    out = capsys.readouterr().out
    assert "Pareto front:" in out
    rows = read(tmp_path / "trials.csv")
    assert len(rows) == 3 and any(r["pareto"] == "true" for r in rows)
    # pin.rate is both searched and an objective: listed once, as the objective, in the file and the table.
    assert "pin.rate" not in rows[0] and all(line.count("pin.rate") <= 1 for line in out.splitlines()), out
    assert all(0.05 <= float(r["pin.rate (max)"]) <= 0.5 for r in rows)
    # A front is never dominated: no trial is at least as good on both objectives and better on one.
    front = [r for r in rows if r["pareto"] == "true"]
    for f in front:
        fa, fr = float(f["final (max)"]), float(f["pin.rate (max)"])
        assert not any(float(r["final (max)"]) >= fa and float(r["pin.rate (max)"]) >= fr
                       and (float(r["final (max)"]), float(r["pin.rate (max)"])) != (fa, fr) for r in rows)
    assert (tmp_path / "pareto.png").read_bytes()[:4] == b"\x89PNG"


def test_epoch_pruning_reports_the_tracked_accuracy_and_stops_a_pruned_trial():
    class Trial:
        def __init__(self, prune):
            self.prune, self.reports = prune, []

        def report(self, value, step):
            self.reports.append((step, value))

        def should_prune(self):
            return self.prune

    def fit(trial):
        monitor = PinMonitor(accuracy=True, report=False)
        pins = PinCallback([Pin("encoder.weight", fraction=0.2, value=0.0)], monitor=monitor)
        trainer(max_epochs=2, callbacks=[pins, EpochPruning(trial)]).fit(ValNet(), make_loader(n=64),
                                                                          make_loader(n=32, seed=1))
        return monitor

    kept = Trial(prune=False)
    monitor = fit(kept)
    assert kept.reports == [tuple(row) for row in monitor.preservation.history if row[0] > 0]
    assert len(kept.reports) == 2
    pruned = Trial(prune=True)
    with pytest.raises(optuna.TrialPruned):
        fit(pruned)
    assert len(pruned.reports) == 1


def test_only_the_final_accuracy_is_pruned_on():
    from lightning_pin.app.tune import Objective, Tune, prunes

    assert prunes(Tune(objectives=(Objective("final", True),)))
    # The pruning callback reports the accuracy: as intermediate values of another objective it would prune at random.
    for objectives in ("gap:min", "train_loss:min", "pin.rate:max", "final:max,pin.rate:max"):
        assert not prunes(Tune(objectives=Objective.parse_all(objectives)))
    assert not prunes(Tune(prune=False))


@pytest.mark.parametrize(
    ("args", "says"),
    [(["--param", "optimizer.lr=log:0:1"], "LOW > 0"), (["--objectives", "final:up"], "KEY:max or KEY:min"),
     (["--trials", "0"], "--trials must be at least 1"), (["--param", "lr"], "use KEY=float"),
     # Composed before any training: a mistyped override or parameter key, an objective naming nothing.
     (["trainer.max_epoch=1"], "unknown config key 'trainer.max_epoch': did you mean trainer.max_epochs"),
     (["--param", "optimizer.lrr=log:1e-3:1e-2"], "--param optimizer.lrr=log:...: optimizer.lrr=0.001"),
     (["--param", "optimizer=choice:adam,sgdd"], "Could not find 'optimizer/sgdd'"),
     (["--objectives", "nosuch:max"], "'nosuch' is neither a number of the run summary"),
     (["--objectives", "final:max,pin.rat:max", "pin=faults"], "'pin.rat' is neither"),
     (["trainer.max_steps=0"], "trainer.max_steps=0 retrains nothing")],
)
def test_bad_arguments_exit_2_with_one_line(args, says, tmp_path, capsys):
    assert cli.main(["tune", *args, "--out", str(tmp_path / "never")]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    # Refused before the first trial, before the baseline's pretraining: nothing was trained or written.
    assert not (tmp_path / "never").exists() and "trial" not in captured.out
