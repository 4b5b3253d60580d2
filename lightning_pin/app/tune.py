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

import contextlib
import dataclasses
import logging
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

__all__ = [
    "DEFAULT_PARAMS", "EpochPruning", "Objective", "Param", "STUDY_DB", "SUMMARY_OBJECTIVES", "TRIAL_LOG", "Tune",
    "TuneError", "check_config", "default_out", "prunes", "run_tune",
]


DEFAULT_PARAMS = ("optimizer.lr=log:3e-4:3e-2",)
STUDY_DB = "tune.db"
#: Where a trial's own output goes (its pin tables, reports, Lightning's messages): the console gets one line.
TRIAL_LOG = "trial.log"
#: Numeric keys of the run summary (``run_summary.json``) an objective may name.
SUMMARY_OBJECTIVES = ("baseline", "forced", "final", "gap", "recovered_step", "settled_step", "pinned_elements",
                      "trainable_elements", "violations", "pin_drift_max", "weight_drift", "weight_drift_relative",
                      "steps", "seconds", "train_loss")


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


def prunes(tune: Tune) -> bool:
    """Does the study prune trials? Only one objective, and only ``final``: :class:`EpochPruning` reports the
    tracked accuracy, which is no intermediate value of ``gap``, ``train_loss`` or a config key."""
    return tune.prune and len(tune.objectives) == 1 and tune.objectives[0].key == "final"


def default_out() -> Path:
    """``outputs/tune/<date>/<time>``: under ``outputs/`` with the app's runs (and ignored by git)."""
    now = datetime.now()
    return Path("outputs") / "tune" / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S")


def check_config(tune: Tune, params: tuple[Param, ...], out: Path) -> None:
    """Compose every trial's config once, before any training: a mistyped override or ``--param`` key,
    a length that never trains, or an objective that names nothing is one line, not a trial's traceback.

    Every choice of a ``choice:`` parameter is composed (``optimizer=choice:adam,sgdd`` fails here);
    numeric parameters are composed at ``LOW``.

    Raises:
        TuneError: naming the override, parameter or objective, with Hydra's reason.
    """
    from omegaconf import OmegaConf

    from lightning_pin.app.train import check_lengths

    def compose(extra: list[str], blame: str) -> Any:
        try:
            cfg = compose_app([*tune.overrides, *extra], out)
            check_lengths(cfg)
            return cfg
        except Exception as err:  # noqa: BLE001  (Hydra and OmegaConf raise several kinds; all are the user's)
            raise TuneError(f"{blame}: {_reason(err)}") from None

    compose([], f"the overrides {' '.join(tune.overrides)!r}" if tune.overrides else "the app's config")
    first = {p.key: p.choices[0] if p.kind == "choice" else p.low for p in params}
    for p in params:
        # One parameter at a time, so that the error names the one at fault.
        for value in p.choices if p.kind == "choice" else (p.low,):
            compose([_override(p.key, value)], f"--param {p.key}={p.kind}:...: {_override(p.key, value)}")
    cfg = compose([_override(k, v) for k, v in first.items()], "--param " + ", ".join(first))
    for objective in tune.objectives:
        if objective.key in SUMMARY_OBJECTIVES:
            continue
        value = OmegaConf.select(cfg, objective.key, default=None, throw_on_missing=False)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            summary_keys = ", ".join(SUMMARY_OBJECTIVES[:5])
            raise TuneError(
                f"--objectives: {objective.key!r} is neither a number of the run summary ({summary_keys}, ...) nor "
                "a number of the trial's config (pin.rate with pin=faults, optimizer.lr, ...)"
            )


def run_tune(tune: Tune) -> int:
    """Run (or resume) the study; print and plot what it found. Returns the exit status."""
    import optuna

    tune.check()
    out = Path(tune.out or default_out()).resolve()
    params = tune.params or tuple(Param.parse(p) for p in DEFAULT_PARAMS)
    check_config(tune, params, out)
    out.mkdir(parents=True, exist_ok=True)
    multi = len(tune.objectives) > 1
    sampler = optuna.samplers.NSGAIISampler(seed=tune.seed) if multi else optuna.samplers.TPESampler(seed=tune.seed)
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2) if prunes(tune) else optuna.pruners.NopPruner()
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
          f"{out / STUDY_DB}; each trial's own output goes to its trial_N/{TRIAL_LOG}", flush=True)
    while done < tune.trials:
        trial = study.ask()
        values = {p.key: p.suggest(trial) for p in params}
        # A key that is an objective too is shown once, as the objective.
        shown = {k: v for k, v in values.items() if k not in {o.key for o in tune.objectives}}
        started = time.perf_counter()
        directory = out / f"trial_{trial.number}"
        try:
            with _into_log(directory / TRIAL_LOG):
                result = _trial(tune, trial, values, ckpt, directory)
        except optuna.TrialPruned as pruned:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            print(f"  trial {trial.number}: {_show(shown)} -> pruned ({pruned})", flush=True)
        except Exception as err:  # a trial that fails (diverged, bad combination) must not end the study
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            reason = " ".join(f"{type(err).__name__}: {err}".split())
            print(f"  trial {trial.number}: {_show(shown)} -> failed: {reason} (see {directory / TRIAL_LOG})",
                  flush=True)
            if trial.number == 0 or isinstance(err, (TuneError, KeyError)):
                raise
        else:
            study.tell(trial, result if multi else result[0])
            measured = ", ".join(f"{o.key}={v:.4g}" for o, v in zip(tune.objectives, result))
            print(f"  trial {trial.number}: {_show(shown)} -> {measured} ({time.perf_counter() - started:.0f} s)",
                  flush=True)
        done = len(study.get_trials(deepcopy=False, states=finished))
    _report(study, tune, out)
    return 0


@contextlib.contextmanager
def _into_log(path: Path) -> Any:
    """Everything a trial prints (its pin tables, report, Lightning's messages) into ``path``, not the console."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as file, contextlib.redirect_stdout(file), contextlib.redirect_stderr(file):
        # Lightning's loggers hold the console stream they were made with (or pass records up to the
        # root's handlers): for the trial, they write to the file alone.
        handler = logging.StreamHandler(file)
        handler.setFormatter(logging.Formatter("%(message)s"))
        saved = []
        for name in ("lightning.pytorch", "lightning.fabric", "lightning_pin"):
            logger = logging.getLogger(name)
            saved.append((logger, logger.handlers[:], logger.propagate, logger.level))
            logger.handlers[:] = [handler]
            logger.propagate = False
            if logger.getEffectiveLevel() > logging.INFO:
                logger.setLevel(logging.INFO)
        try:
            yield
        finally:
            for logger, handlers, propagate, level in saved:
                logger.handlers[:] = handlers
                logger.propagate = propagate
                logger.setLevel(level)


def _reason(err: BaseException) -> str:
    """Hydra's message in one line, with the first line of its cause ("Key 'lrr' not in 'AdamConfig'"); a key that is
    not in the config, with the closest valid ones (:func:`lightning_pin.app.compose.unknown_key`)."""
    from lightning_pin.app.compose import unknown_key

    unknown = unknown_key(err)
    if unknown is not None:
        return unknown
    reason = " ".join(str(err).split()) or type(err).__name__
    cause = err.__cause__
    if cause is not None and str(cause).strip():
        first = str(cause).strip().splitlines()[0].strip()
        if first not in reason:
            reason = f"{reason.rstrip('.')}: {first}"
    return reason


def _override(key: str, value: Any) -> str:
    """``key=value`` as Hydra reads it back to the same value (a float by its repr: no digit lost)."""
    return f"{key}={value!r}" if isinstance(value, float) else f"{key}={value}"


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
        print(f"baseline: pretraining once ... (its output: {directory / TRIAL_LOG})", flush=True)
        with _into_log(directory / TRIAL_LOG):
            run(compose_app([*tune.overrides, "pretrain.only=true"], directory))
    return str(ckpt)


def _trial(tune: Tune, trial: Any, values: dict[str, Any], ckpt: str, directory: Path) -> list[float]:
    from lightning_pin.app.train import run

    searched = [_override(k, v) for k, v in values.items()]
    cfg = compose_app([*tune.overrides, *searched, f"ckpt_path={ckpt}"], directory)
    pruning = [EpochPruning(trial)] if prunes(tune) else []
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
    if not trials:
        print("no trial finished: nothing to tabulate or plot")
        return
    if len(tune.objectives) == 1:
        best = study.best_trial
        tune_report.write_trials(trials, {best.number}, out / tune_report.TRIALS_CSV, names)
        states = [t.state for t in study.get_trials(deepcopy=False)]
        others = ", ".join(f"{states.count(state)} {state.name.lower()}" for state in
                           (optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL) if state in states)
        tune_report.print_trials(trials, best.number, names, others)
        print(f"best trial {best.number}: {_show(best.params)} -> {tune.objectives[0].key}={best.value:.4g}")
        searched = {p.key: (p.kind, p.low, p.high)
                    for p in (tune.params or tuple(Param.parse(p) for p in DEFAULT_PARAMS))}
        written = tune_report.plot_trials(trials, best.number, names, searched, out / tune_report.TRIALS_PNG, others)
    else:
        front = {t.number for t in study.best_trials}
        tune_report.write_trials(trials, front, out / tune_report.TRIALS_CSV, names)
        tune_report.print_front(trials, front, names)
        written = tune_report.plot_front(trials, front, names, out / tune_report.PARETO_PNG)
    print(f"wrote {out / tune_report.TRIALS_CSV}" + (f", {written}" if written else ""))
