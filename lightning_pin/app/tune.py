"""``lightning-pin tune``: Optuna (3 or newer) driving the app directly, one or several objectives.

Each trial asks Optuna for its parameters, composes the app's config with them through Hydra's
compose API (the same ``conf/`` and overrides as ``lightning-pin train``), runs the app's job
in this process and tells Optuna the result. The study lives in SQLite (``DIR/tune.db``), so
running the same command again resumes it until it holds ``--trials`` finished trials.

- One objective (``--objectives final:max``, the default): TPE, and per-epoch pruning of
  unpromising trials (:class:`EpochPruning` reports the tracked accuracy after every validation).
- Several (``--objectives final:max,pin.rate:max``): NSGA-II; the Pareto front is printed and
  plotted (``pareto.png``, ``trials.csv``). An objective is a key of the run summary (``final``,
  ``gap``, ``forced``, ...) or a config key of the trial (``pin.rate``, ``pin.fraction``), so
  "final accuracy against the fault rate" is ``final:max,pin.rate:max`` with ``pin=faults``.

Parameters: ``--param KEY=SPEC``, SPEC one of ``float:LOW:HIGH``, ``log:LOW:HIGH``,
``int:LOW:HIGH`` or ``choice:A,B,C`` (a config key, or a config group such as ``optimizer``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_pin.app.compose import compose_app
from lightning_pin.reporting import tune as tune_report

DEFAULT_PARAMS = ("optimizer.lr=log:3e-4:3e-2",)
STUDY_DB = "tune.db"


class TuneError(ValueError):
    """A bad argument of ``lightning-pin tune`` (exit status 2)."""


@dataclasses.dataclass(frozen=True)
class Param:
    key: str
    kind: str
    low: Any = None
    high: Any = None
    choices: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> "Param":
        """``KEY=float:LOW:HIGH`` | ``KEY=log:LOW:HIGH`` | ``KEY=int:LOW:HIGH`` | ``KEY=choice:A,B``.

        Raises:
            TuneError: anything else, or ``LOW >= HIGH``.
        """
        key, sep, spec = text.partition("=")
        kind, _, rest = spec.partition(":")
        if not sep or not key or kind not in ("float", "log", "int", "choice") or not rest:
            raise TuneError(f"--param {text!r}: use KEY=float:LOW:HIGH, KEY=log:LOW:HIGH, KEY=int:LOW:HIGH or "
                            "KEY=choice:A,B,...")
        if kind == "choice":
            return cls(key, kind, choices=tuple(c for c in rest.split(",") if c))
        try:
            low, high = (int(v) if kind == "int" else float(v) for v in rest.split(":"))
        except ValueError:
            raise TuneError(f"--param {text!r}: LOW and HIGH must be numbers") from None
        if not low < high or (kind == "log" and low <= 0):
            raise TuneError(f"--param {text!r}: needs LOW < HIGH" + (" and LOW > 0 (log)" if kind == "log" else ""))
        return cls(key, kind, low, high)

    def suggest(self, trial: Any) -> Any:
        if self.kind == "choice":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.key, self.low, self.high)
        return trial.suggest_float(self.key, self.low, self.high, log=self.kind == "log")


@dataclasses.dataclass(frozen=True)
class Objective:
    key: str
    maximize: bool

    @classmethod
    def parse_all(cls, text: str) -> tuple["Objective", ...]:
        """``final:max,pin.rate:max`` -> objectives.

        Raises:
            TuneError: an entry without ``:max`` / ``:min``, or a repeated key.
        """
        objectives = []
        for part in text.split(","):
            key, _, way = part.strip().rpartition(":")
            if not key or way not in ("max", "min"):
                raise TuneError(f"--objectives: {part.strip()!r} must be KEY:max or KEY:min (e.g. final:max)")
            objectives.append(cls(key, way == "max"))
        if len({o.key for o in objectives}) != len(objectives):
            raise TuneError(f"--objectives {text!r} names a key twice")
        return tuple(objectives)


@dataclasses.dataclass
class Tune:
    trials: int = 12
    params: tuple[Param, ...] = ()
    objectives: tuple[Objective, ...] = (Objective("final", True),)
    out: Optional[str] = None
    study_name: str = "lightning_pin"
    seed: int = 0
    prune: bool = True
    overrides: tuple[str, ...] = ()

    def check(self) -> None:
        if self.trials < 1:
            raise TuneError(f"--trials must be at least 1, got {self.trials}")
        keys = {p.key for p in self.params}
        clash = [o for o in self.overrides if o.split("=", 1)[0] in keys]
        if clash:
            raise TuneError(f"{clash[0]!r} is searched (--param): leave it out of the overrides")


class EpochPruning(Callback):
    """Report the tracked accuracy to an Optuna trial after every validation; stop a pruned trial.

    Reads the :class:`~lightning_pin.PinMonitor` of the trainer's PinCallback, so it prunes on the
    value the run summary reports as ``final``. Raises ``optuna.TrialPruned`` out of ``fit``.
    """

    def __init__(self, trial: Any, maximize: bool = True) -> None:
        self.trial = trial
        self.maximize = maximize

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import optuna

        if trainer.sanity_checking:
            return
        monitors = [getattr(cb, "monitor", None) for cb in trainer.callbacks if type(cb).__name__ == "PinCallback"]
        monitor = next((m for m in monitors if m is not None and m.preservation is not None), None)
        if monitor is None or not monitor.preservation.history:
            return
        step, value = monitor.preservation.history[-1]
        if step != trainer.global_step:
            return
        self.trial.report(float(value), step=int(step))
        if self.trial.should_prune():
            raise optuna.TrialPruned(f"pruned at step {step}: accuracy {value:.4f}")


def run_tune(tune: Tune) -> int:
    """Run (or resume) the study; print and plot what it found. Returns the exit status."""
    import optuna

    tune.check()
    out = Path(tune.out or Path("tune") / datetime.now().strftime("%Y-%m-%d") / datetime.now().strftime("%H-%M-%S"))
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    params = tune.params or tuple(Param.parse(p) for p in DEFAULT_PARAMS)
    multi = len(tune.objectives) > 1
    sampler = optuna.samplers.NSGAIISampler(seed=tune.seed) if multi else optuna.samplers.TPESampler(seed=tune.seed)
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2) if tune.prune and not multi else optuna.pruners.NopPruner()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=tune.study_name,
        storage=f"sqlite:///{out / STUDY_DB}",
        load_if_exists=True,
        sampler=sampler,
        pruner=pruner,
        directions=["maximize" if o.maximize else "minimize" for o in tune.objectives],
    )
    wanted = ["maximize" if o.maximize else "minimize" for o in tune.objectives]
    if [d.name.lower() for d in study.directions] != wanted:
        raise TuneError(f"{out / STUDY_DB} holds a study with other objectives: give this search its own --out")
    ckpt = _baseline(tune, out)
    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    done = len(study.get_trials(deepcopy=False, states=finished))
    print(f"lightning-pin tune: {len(tune.objectives)} objective(s), {done}/{tune.trials} trials done, study "
          f"{out / STUDY_DB}", flush=True)
    while done < tune.trials:
        trial = study.ask()
        values = {p.key: p.suggest(trial) for p in params}
        started = time.perf_counter()
        try:
            result = _trial(tune, trial, values, ckpt, out / f"trial_{trial.number}")
        except optuna.TrialPruned as pruned:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            print(f"  trial {trial.number}: {_show(values)} -> pruned ({pruned})", flush=True)
        except Exception as err:  # a trial that fails (diverged, bad combination) must not end the study
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            print(f"  trial {trial.number}: {_show(values)} -> failed: {type(err).__name__}: {err}", flush=True)
            if trial.number == 0 or isinstance(err, (TuneError, KeyError)):
                raise
        else:
            study.tell(trial, result if multi else result[0])
            shown = ", ".join(f"{o.key}={v:.4g}" for o, v in zip(tune.objectives, result))
            print(f"  trial {trial.number}: {_show(values)} -> {shown} ({time.perf_counter() - started:.0f} s)",
                  flush=True)
        done = len(study.get_trials(deepcopy=False, states=finished))
    _report(study, tune, out)
    return 0


def _show(values: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


def _baseline(tune: Tune, out: Path) -> str:
    """The checkpoint every trial starts from: the user's ``ckpt_path=``, or one pretraining (reused)."""
    from lightning_pin.app.train import PRETRAINED_CKPT, run

    given = [o.split("=", 1)[1] for o in tune.overrides if o.split("=", 1)[0] == "ckpt_path"]
    if given and given[-1] not in ("", "null"):
        return str(Path(given[-1]).expanduser().resolve())
    directory = out / "baseline"
    ckpt = directory / PRETRAINED_CKPT
    if not ckpt.is_file():
        print("baseline: pretraining once ...", flush=True)
        run(compose_app([*tune.overrides, "pretrain.only=true"], directory))
    return str(ckpt)


def _trial(tune: Tune, trial: Any, values: dict[str, Any], ckpt: str, directory: Path) -> list[float]:
    from lightning_pin.app.train import run

    searched = [f"{k}={v!r}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()]
    cfg = compose_app([*tune.overrides, *searched, f"ckpt_path={ckpt}"], directory)
    pruning = [EpochPruning(trial)] if tune.prune and len(tune.objectives) == 1 else []
    summary = run(cfg, extra_callbacks=pruning)
    result = []
    for objective in tune.objectives:
        value = summary.get(objective.key)
        if value is None and "." in objective.key:
            from omegaconf import OmegaConf

            value = OmegaConf.select(cfg, objective.key)
        if value is None:
            raise TuneError(f"objective {objective.key!r} is neither a key of the run summary nor of the config")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"objective {objective.key} is {value} (diverged?)")
        result.append(value)
    return result


def _report(study: Any, tune: Tune, out: Path) -> None:
    import optuna

    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    trials = [{"number": t.number, "params": dict(t.params), "values": list(t.values)} for t in complete]
    names = [f"{o.key} ({'max' if o.maximize else 'min'})" for o in tune.objectives]
    if len(tune.objectives) == 1:
        best = study.best_trial
        print(f"best trial {best.number}: {_show(best.params)} -> {tune.objectives[0].key}={best.value:.4g}")
        tune_report.write_trials(trials, [], out / tune_report.TRIALS_CSV, names)
        return
    front = {t.number for t in study.best_trials}
    tune_report.write_trials(trials, front, out / tune_report.TRIALS_CSV, names)
    tune_report.print_front(trials, front, names)
    written = tune_report.plot_front(trials, front, names, out / tune_report.PARETO_PNG)
    print(f"wrote {out / tune_report.TRIALS_CSV}" + (f", {written}" if written else ""))
