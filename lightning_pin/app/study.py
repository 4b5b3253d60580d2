"""``lightning-pin faults``: the accuracy-against-fault-rate curve, retrained and not, in one command.

1. One baseline: the app pretrains once (``pretrain.only=true``, into ``DIR/baseline``), or the
   user's ``ckpt_path=`` is used as it is.
2. One app job per (rate, seed), as a Hydra multirun over ``pin=faults``: every job loads the
   baseline, draws its faults from (kind, rate, seed) alone (common random numbers), measures the
   forced accuracy (faults in, no retraining) and the final one (retrained around them, pins
   verified bit for bit). ``--jobs J`` runs them on Hydra's joblib launcher; any launcher override
   (``hydra/launcher=submitit_slurm``) passes through. Jobs write into ``DIR/jobs/<kind>_rate<r>_seed<s>``
   and a finished job is not run again (``skip_finished=true``): re-running an interrupted study with
   the same ``--out`` finishes it.
3. ``fault_curve.csv`` / ``.png`` and a table; with ``--per-layer``, the same at one rate with the
   faults in one parameter at a time (``layer_sensitivity.csv`` / ``.png``).

The jobs run in a child process (``python -m lightning_pin.train -m ...``) whose output goes to
``DIR/study.log``; this process shows a progress bar over the jobs by watching their summaries.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from lightning_pin.app.fault_pins import KINDS, check_kind
from lightning_pin.app.sweep import RUN_SUMMARY
from lightning_pin.core.errors import PinError
from lightning_pin.reporting import faults as report

BASELINE_DIR = "baseline"
JOBS_DIR = "jobs"
LAYERS_DIR = "layers"
LOG = "study.log"
STUDY_JSON = "study.json"
PRETRAINED = "pretrained.ckpt"


class StudyError(ValueError):
    """A bad argument of ``lightning-pin faults`` (exit status 2)."""


@dataclasses.dataclass
class Study:
    kind: str = "value"
    rates: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2, 0.5)
    seeds: int = 3
    per_layer: bool = False
    layer_rate: Optional[float] = None
    jobs: int = 1
    out: Optional[str] = None
    overrides: tuple[str, ...] = ()
    #: A config directory of your own (``--config-dir``): DIR/model/NAME.yaml, DIR/data/NAME.yaml.
    config_dir: Optional[str] = None

    def check(self) -> None:
        """Raise StudyError naming the first bad argument."""
        if self.kind not in KINDS:
            raise StudyError(f"unknown --kind {self.kind!r}: use one of {', '.join(KINDS)}")
        try:
            check_kind(self.kind)
        except PinError as err:
            raise StudyError(str(err)) from None
        if not self.rates:
            raise StudyError("--rates needs at least one rate, e.g. --rates 0,0.05,0.1,0.2")
        bad = [r for r in self.rates if not 0.0 <= r <= 1.0]
        if bad:
            raise StudyError(f"--rates must be in [0, 1] (a fraction of the cells), got {bad[0]:g}")
        if self.seeds < 1:
            raise StudyError(f"--seeds must be at least 1, got {self.seeds}")
        if self.jobs < 1:
            raise StudyError(f"--jobs must be at least 1, got {self.jobs}")
        if self.layer_rate is not None and not 0.0 < self.layer_rate <= 1.0:
            raise StudyError(f"--layer-rate must be in (0, 1], got {self.layer_rate:g}")
        if self.per_layer and self.layer_rate is None and not any(r > 0 for r in self.rates):
            raise StudyError("--per-layer needs a rate above 0 (in --rates, or --layer-rate)")
        taken = [o for o in self.overrides if o.split("=", 1)[0].lstrip("+~") in _STUDY_KEYS]
        if taken:
            raise StudyError(f"{taken[0]!r} is set by the study itself: use --kind, --rates, --seeds or --out")
        if any(o.startswith("-") for o in self.overrides):
            raise StudyError(f"unknown option {next(o for o in self.overrides if o.startswith('-'))!r}")


#: Keys the study sets on every job; an override of one of them would break the grid.
_STUDY_KEYS = ("pin", "pin.kind", "pin.rate", "pin.seed", "hydra.sweep.dir", "hydra.sweep.subdir", "hydra.run.dir",
               "skip_finished", "pretrain.only", "hydra.mode")


def parse_rates(text: str) -> tuple[float, ...]:
    """``"0,0.05,0.1"`` -> (0.0, 0.05, 0.1), sorted, without repeats.

    Raises:
        StudyError: an entry is not a number.
    """
    rates = []
    for part in text.split(","):
        try:
            rates.append(float(part))
        except ValueError:
            raise StudyError(f"--rates takes numbers separated by commas, got {part.strip()!r}") from None
    return tuple(sorted(set(rates)))


def run_study(study: Study) -> int:
    """Run (or finish) the study; write the files and print the table. Returns the exit status."""
    study.check()
    out = Path(study.out or Path("faults") / datetime.now().strftime("%Y-%m-%d") / datetime.now().strftime("%H-%M-%S"))
    out.mkdir(parents=True, exist_ok=True)
    _claim(out, study)
    log_path = out / LOG
    print(f"lightning-pin faults: kind={study.kind} rates={','.join(f'{r:g}' for r in study.rates)} "
          f"seeds={study.seeds} into {out} (log: {log_path})", flush=True)
    started = time.perf_counter()

    ckpt = _user_ckpt(study.overrides) or _baseline(study, out, log_path)
    if ckpt is None:
        return 1
    grid = [(rate, seed) for rate in study.rates for seed in range(study.seeds)]
    sweep = ["pin=faults", f"pin.kind={study.kind}", f"pin.rate={_list(study.rates)}", f"pin.seed={_seeds(study)}"]
    subdir = "${pin.kind}_rate${pin.rate}_seed${pin.seed}"
    # Hydra names the directories from the job's config: str() of the float rate.
    expected = [f"{study.kind}_rate{float(rate)}_seed{seed}" for rate, seed in grid]
    if not _multirun(study, out / JOBS_DIR, subdir, sweep, ckpt, expected, "fault curve", log_path):
        return 1
    rows = _rows(out / JOBS_DIR, study, {(study.kind, r, s) for r, s in grid}, by_param=False)
    report.write_csv(rows, out / report.FAULT_CURVE_CSV)
    written = [out / report.FAULT_CURVE_CSV]
    if report.plot_curve(rows, out / report.FAULT_CURVE_PNG) is not None:
        written.append(out / report.FAULT_CURVE_PNG)
    report.print_curve(rows, f"lightning-pin faults: kind={study.kind}, {len(rows)} job(s)")

    if study.per_layer:
        rate = study.layer_rate if study.layer_rate is not None else max(study.rates)
        names = _param_names(study.overrides, ckpt, study.config_dir)
        sweep = ["pin=faults", f"pin.kind={study.kind}", f"pin.rate={rate!r}", f"pin.seed={_seeds(study)}",
                 "pin.params=" + ",".join(names)]
        subdir = "${pin.params}_seed${pin.seed}"
        expected = [f"{name}_seed{seed}" for name in names for seed in range(study.seeds)]
        if not _multirun(study, out / LAYERS_DIR, subdir, sweep, ckpt, expected, "per layer", log_path):
            return 1
        wanted = {(study.kind, rate, s, n) for s in range(study.seeds) for n in names}
        layer_rows = _rows(out / LAYERS_DIR, study, wanted, by_param=True)
        report.write_csv(layer_rows, out / report.LAYER_CSV, report.LAYER_COLUMNS)
        written.append(out / report.LAYER_CSV)
        if report.plot_layers(layer_rows, out / report.LAYER_PNG) is not None:
            written.append(out / report.LAYER_PNG)
        report.print_curve(layer_rows, f"faults in one parameter at a time, rate {rate:g}", by="param")
    print(f"wrote {', '.join(str(p) for p in written)} in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


def _claim(out: Path, study: Study) -> None:
    """Record the recipe in DIR/study.json; refuse a DIR that holds another recipe's jobs.

    Job directories are named by (kind, rate, seed) only, so finished jobs of one recipe would be
    taken for the other's. Other rates or seeds with the same recipe extend the study.
    """
    path = out / STUDY_JSON
    recipe = {"overrides": list(study.overrides)}
    if path.is_file():
        held = json.loads(path.read_text())
        if held.get("overrides") != recipe["overrides"]:
            raise StudyError(
                f"{out} holds a study with the overrides {held.get('overrides')}, not {recipe['overrides']}: "
                "give this recipe its own --out (and ckpt_path=<the first study>/baseline/pretrained.ckpt to share "
                "its baseline)"
            )
        return
    path.write_text(json.dumps(recipe, indent=2) + "\n")


def _list(rates: Sequence[float]) -> str:
    return ",".join(repr(float(r)) for r in rates)


def _seeds(study: Study) -> str:
    return ",".join(str(s) for s in range(study.seeds))


def _user_ckpt(overrides: Sequence[str]) -> Optional[str]:
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+") == "ckpt_path" and value not in ("", "null"):
            return str(Path(value).expanduser().resolve())
    return None


def _app(args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "lightning_pin.train", *args]


def _baseline(study: Study, out: Path, log_path: Path) -> Optional[str]:
    """Pretrain the one baseline every job starts from (reused when the directory holds it).

    In this process (the jobs' multirun is a child process): one import of torch and Lightning
    fewer, and a bad override fails here, before any job starts.
    """
    import contextlib
    import traceback

    directory = (out / BASELINE_DIR).resolve()
    ckpt = directory / PRETRAINED
    if ckpt.is_file():
        print(f"baseline: {ckpt} (reused)", flush=True)
        return str(ckpt)
    print("baseline: pretraining once ...", flush=True)
    # Rate 0 pins nothing (an experiment's pin options still apply, and a bad pin.params fails here).
    overrides = [*study.overrides, "pin=faults", "pin.rate=0.0", "pretrain.only=true"]
    from lightning_pin.app.custom import ConfigError

    refused: Optional[ConfigError] = None
    with open(log_path, "a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        print(f"baseline (in process): {' '.join(overrides)}", flush=True)
        try:
            from lightning_pin.app.compose import compose_app
            from lightning_pin.app.train import run

            run(compose_app(overrides, directory, config_dir=study.config_dir))
        except ConfigError as err:  # your model's or data's target, or its metric: one line (exit 2)
            print(f"ConfigError: {err}", flush=True)
            refused = err
        except Exception:  # the log gets the traceback; the terminal its end
            traceback.print_exc()
    if refused is not None:
        raise StudyError(str(refused))
    if not ckpt.is_file():
        _show_failure(log_path, "the baseline's pretraining failed")
        return None
    return str(ckpt)


def _multirun(study: Study, sweep_dir: Path, subdir: str, sweep: Sequence[str], ckpt: str, expected: Sequence[str],
              what: str, log_path: Path) -> bool:
    """Run the jobs through Hydra's multirun, with a progress bar over them; False when it failed."""
    sweep_dir = sweep_dir.resolve()
    launcher = ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={study.jobs}"] if study.jobs > 1 else []
    config_dir = ["--config-dir", study.config_dir] if study.config_dir else []
    args = _app([*config_dir, "-m", *study.overrides, *sweep, f"ckpt_path={ckpt}", "skip_finished=true",
                 f"hydra.sweep.dir={sweep_dir}", f"hydra.sweep.subdir={subdir}", *launcher])
    before = _finished(sweep_dir, expected)
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(args)}\n")
        log.flush()
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        with _Progress(what, len(expected), skipped=before) as bar:
            while process.poll() is None:
                bar.update(_finished(sweep_dir, expected))
                time.sleep(0.5)
            bar.update(_finished(sweep_dir, expected))
    if process.returncode != 0:
        _show_failure(log_path, f"a {what} job failed")
        return False
    return True


def _finished(sweep_dir: Path, expected: Sequence[str]) -> int:
    """How many of the expected job directories hold a summary."""
    return sum((sweep_dir / name / RUN_SUMMARY).is_file() for name in expected)


def _rows(sweep_dir: Path, study: Study, wanted: set[tuple], by_param: bool) -> list[dict[str, Any]]:
    """The CSV rows of the requested jobs (a directory may hold jobs of an earlier, larger study)."""
    rows = []
    for path in sweep_dir.glob(f"*/{RUN_SUMMARY}"):
        summary = json.loads(path.read_text())
        fault = summary.get("fault") or {}
        key = (fault.get("kind"), fault.get("rate"), fault.get("seed"))
        if by_param:
            key = (*key, fault.get("params"))
        if key in wanted:
            row = report.job_row(summary, str(path.parent))
            row["recipe"] = " ".join(study.overrides)
            rows.append(row)
    return report.sort_rows(rows, "param" if by_param else "rate")


def _param_names(overrides: Sequence[str], ckpt: str, config_dir: Optional[str] = None) -> list[str]:
    """The parameters ``pin.params`` matches, read from the composed config and the baseline checkpoint."""
    from fnmatch import fnmatchcase

    import torch
    from hydra import compose, initialize_config_dir

    from lightning_pin.app.compose import with_config_dir
    from lightning_pin.app.config import register_configs
    from lightning_pin.app.custom import WEIGHTS_2D
    from lightning_pin.app.train import CONFIG_DIR

    register_configs()
    keep = [o for o in overrides if not o.startswith("hydra") or o.startswith("hydra.searchpath")]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=with_config_dir([*keep, "pin=faults"], config_dir))
    patterns = cfg.pin.params if not isinstance(cfg.pin.params, str) else [cfg.pin.params]
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    state = state.get("state_dict", state)
    names = list(state)
    if WEIGHTS_2D in patterns:  # a model of your own: every *.weight with two or more dimensions
        patterns = [p for p in patterns if p != WEIGHTS_2D]
        patterns += [n for n in names if n.endswith(".weight") and getattr(state[n], "ndim", 0) >= 2]

    def matches(name: str, pattern: str) -> bool:
        return re.fullmatch(pattern[3:], name) is not None if pattern.startswith("re:") else fnmatchcase(name, pattern)

    found = [n for n in names if any(matches(n, p) for p in patterns)]
    if not found:
        raise StudyError(
            f"pin.params={list(patterns)} matches no parameter of the baseline ({', '.join(names[:6])}...)"
        )
    return found


def _show_failure(log_path: Path, what: str) -> None:
    lines = log_path.read_text().splitlines()[-25:]
    print(f"lightning-pin faults: {what}; the end of {log_path}:\n" + "\n".join(lines), file=sys.stderr)


class _Progress:
    """A bar over the jobs (rich when installed; else one line per finished job)."""

    def __init__(self, what: str, total: int, skipped: int) -> None:
        self.what, self.total, self.done, self.skipped = what, total, skipped, skipped
        self._rich: Any = None

    def __enter__(self) -> "_Progress":
        note = f" ({self.skipped} finished before, skipped)" if self.skipped else ""
        try:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:
            print(f"{self.what}: {self.skipped}/{self.total} jobs{note}", flush=True)
            return self
        self._rich = Progress(TextColumn(f"{self.what}{note}"), BarColumn(), MofNCompleteColumn(),
                              TimeElapsedColumn(), transient=False)
        self._rich.start()
        self._task = self._rich.add_task(self.what, total=self.total, completed=self.skipped)
        return self

    def update(self, done: int) -> None:
        done = min(done, self.total)
        if done == self.done:
            return
        self.done = done
        if self._rich is not None:
            self._rich.update(self._task, completed=done)
        else:
            print(f"{self.what}: {done}/{self.total} jobs", flush=True)

    def __exit__(self, *exc: Any) -> None:
        if self._rich is not None:
            self._rich.stop()
