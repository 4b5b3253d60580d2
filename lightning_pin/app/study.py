"""``lightning-pin faults``: the accuracy-against-fault-rate curve, retrained and not, in one command.

1. The job config is composed once, the same way ``lightning-pin train`` composes it (a mistyped
   override fails here, in one line, before any training).
2. One baseline: the app pretrains once (``pretrain.only=true``, into ``DIR/baseline``), or the
   user's ``ckpt_path=`` is used as it is.
3. One app job per (rate, seed): it loads the baseline, draws its faults from (kind, rate, seed)
   alone (common random numbers), measures the forced accuracy (faults in, no retraining) and the
   final one (retrained around them, pins verified bit for bit). Jobs run in this process
   (``--jobs 1``) or in ``--jobs J`` workers forked from it after the imports: no interpreter
   start-up, no import of torch per job. ``--launcher joblib|submitit_local|submitit_slurm`` runs
   them through a Hydra multirun instead (a cluster). Jobs write into
   ``DIR/jobs/<kind>_rate<r>_seed<s>``, whichever runner, and a finished job is not run again.
4. ``--no-retrain`` (and ``--kind flip``, a transient fault): forced accuracy only, every draw in
   this process on one model, the faulty words written before and restored exactly after each
   evaluation (:class:`lightning_pin.faults.WordPatch`).
5. ``fault_curve.csv`` / ``.png`` and a table; with ``--per-layer``, the same at one rate with the
   faults in one parameter at a time (``layer_sensitivity.csv`` / ``.png``).

Every stage says what it does; nothing is silent for more than :data:`HEARTBEAT` seconds.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

from lightning_pin.app.fault_pins import KINDS, check_kind
from lightning_pin.core import kinds
from lightning_pin.app.sweep import RUN_SUMMARY
from lightning_pin.core.errors import PinError
from lightning_pin.reporting import faults as report

__all__ = [
    "BASELINE_DIR", "ForcedCampaign", "HEARTBEAT", "JOBS_DIR", "JOB_LOG", "Job", "LAUNCHERS", "LAYERS_DIR", "LOG",
    "PRETRAINED", "Progress", "STUDY_JSON", "STUDY_KINDS", "Study", "StudyError", "parse_rates", "run_study",
]


BASELINE_DIR = "baseline"
JOBS_DIR = "jobs"
LAYERS_DIR = "layers"
LOG = "study.log"
JOB_LOG = "job.log"
STUDY_JSON = "study.json"
PRETRAINED = "pretrained.ckpt"
#: Kinds of the study: the app's fault kinds, and transient flips (test time only).
STUDY_KINDS = (*KINDS, "flip")
#: Hydra launchers ``--launcher`` runs the jobs on (the default runs them in this process or forked workers).
LAUNCHERS = ("joblib", "submitit_local", "submitit_slurm")
#: Seconds without a line before the study says what it is still doing.
HEARTBEAT = 2.0


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
    #: Forced accuracy only (a test-time campaign); implied by ``kind="flip"``.
    no_retrain: bool = False
    #: A Hydra launcher for the jobs (``joblib``, ``submitit_local``, ``submitit_slurm``); None: this process.
    launcher: Optional[str] = None
    #: A directory of the user's own config groups (``--config-dir``), searched before the app's.
    config_dir: Optional[str] = None
    #: ``"torchao-int8"``: the test-time campaign runs on the trained model quantized by torchao (its int8 codes).
    deploy: Optional[str] = None
    #: Keep each job's full ``pinned.ckpt`` (optimizer state included); by default a job keeps what the study
    #: reads: its summary, its fault map and its pinned weights (``pinned.safetensors`` with the pin state).
    keep_checkpoints: bool = False
    #: Map each job's model onto its faults first (``pin.remap=true``; see :mod:`lightning_pin.app.remap`).
    remap: bool = False

    def __post_init__(self) -> None:
        # ``hydra/launcher=NAME`` among the overrides asks for a launcher, as --launcher does.
        named = [o.split("=", 1)[1] for o in self.overrides if o.split("=", 1)[0].lstrip("+~") == "hydra/launcher"]
        if named and self.launcher is None:
            self.launcher = named[-1]
        if self.kind == "flip":
            self.no_retrain = True

    @property
    def retrain(self) -> bool:
        return not self.no_retrain

    def check(self) -> None:
        """Raise StudyError naming the first bad argument."""
        if self.kind not in STUDY_KINDS:
            raise StudyError(f"unknown --kind {self.kind!r}: use one of {', '.join(STUDY_KINDS)}")
        if self.kind != "flip":
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
        if self.launcher is not None and self.launcher not in LAUNCHERS:
            raise StudyError(f"unknown --launcher {self.launcher!r}: use one of {', '.join(LAUNCHERS)} "
                             "(or none: jobs in this process, --jobs J forked workers)")
        if self.launcher is not None and self.no_retrain:
            what = "--kind flip" if self.kind == "flip" else "--no-retrain"
            raise StudyError(f"{what} measures every draw in this process: drop --launcher {self.launcher}")
        taken = [o for o in self.overrides if o.split("=", 1)[0].lstrip("+~") in _STUDY_KEYS]
        if taken:
            raise StudyError(f"{taken[0]!r} is set by the study itself: use --kind, --rates, --seeds, --out or "
                         "--keep-checkpoints")
        if any(o.startswith("-") for o in self.overrides):
            raise StudyError(f"unknown option {next(o for o in self.overrides if o.startswith('-'))!r}")
        if self.deploy is not None:
            _check_deploy(self)
        if self.config_dir is not None and not Path(self.config_dir).is_dir():
            raise StudyError(f"--config-dir {self.config_dir!r} is not a directory")
        _check_remap(self)


def _check_deploy(study: Study) -> None:
    """``--deploy torchao-int8``: a test-time campaign (``--no-retrain``) of code-bit or cell faults, or flips."""
    from lightning_pin.deploy import DEPLOY_TARGETS

    if study.deploy not in DEPLOY_TARGETS:
        raise StudyError(f"unknown --deploy {study.deploy!r}: use {', '.join(DEPLOY_TARGETS)}")
    if not study.no_retrain:
        raise StudyError(f"--deploy {study.deploy} measures the deployed int8 model, which cannot be retrained: "
                         "add --no-retrain")
    if study.kind not in ("bit", "cell", "flip"):
        raise StudyError(f"--deploy {study.deploy} faults the stored int8 codes: use --kind bit, cell or flip")
    if study.per_layer:
        raise StudyError(f"--deploy {study.deploy} does not take --per-layer yet")
    if any(o.split("=", 1)[0].lstrip("+~") == "pin.code_bits" for o in study.overrides):
        raise StudyError(f"--deploy {study.deploy} faults torchao's own 8-bit codes: drop --code-bits")
    try:
        import torchao  # noqa: F401
    except ImportError:
        from lightning_pin.deploy import DEPLOY_EXTRA

        raise StudyError(f"--deploy {study.deploy} needs torchao: {DEPLOY_EXTRA}") from None


#: Keys the study sets on every job; an override of one of them would break the grid.
_STUDY_KEYS = ("pin", "pin.kind", "pin.rate", "pin.seed", "hydra.sweep.dir", "hydra.sweep.subdir", "hydra.run.dir",
               "skip_finished", "pretrain.only", "hydra.mode", "pinned_checkpoint",
               "callbacks.pin_callback.monitor.baseline")


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


@dataclasses.dataclass(frozen=True)
class Job:
    """One (rate, seed) of the curve, or one (parameter, seed) of the per-layer study."""

    kind: str
    rate: float
    seed: int
    param: Optional[str] = None

    @property
    def name(self) -> str:
        # As Hydra names a multirun job's directory (str() of the float rate): every runner shares them.
        if self.param is not None:
            return f"{self.param}_seed{self.seed}"
        return f"{self.kind}_rate{float(self.rate)}_seed{self.seed}"

    def label(self) -> str:
        where = f" in {self.param}" if self.param is not None else ""
        return f"{self.kind} rate {self.rate:g} seed {self.seed}{where}"


def run_study(study: Study) -> int:
    """Run (or finish) the study; write the files and print the table. Returns the exit status."""
    study.check()
    out = Path(study.out or Path("outputs") / "faults" / datetime.now().strftime("%Y-%m-%d")
               / datetime.now().strftime("%H-%M-%S"))
    if out.exists() and not out.is_dir():
        raise StudyError(f"--out {out} is a file: give a directory (new, or a study's to finish it)")
    progress = Progress()
    try:
        return _run(study, out, progress)
    finally:
        progress.close()


def _run(study: Study, out: Path, progress: "Progress") -> int:
    started = time.perf_counter()
    mode = "forced only (no retraining)" if study.no_retrain else "forced and retrained"
    progress.line(f"lightning-pin faults: kind={study.kind} rates={','.join(f'{r:g}' for r in study.rates)} "
                  f"seeds={study.seeds}, {mode}, into {out}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # the user's own model and data modules, as `lightning-pin train` finds them
    with progress.stage("loading torch, Lightning and the app"):
        from lightning_pin.app import train  # noqa: F401  (the imports every job shares)
    with progress.stage("composing the job config"):
        template = _compose(study, _compose_overrides(study), out / JOBS_DIR / "template")
    out.mkdir(parents=True, exist_ok=True)
    _claim(out, study)
    log_path = out / LOG
    ckpt = _user_ckpt(study.overrides) or _baseline(study, out, log_path, progress)
    if ckpt is None:
        return 1
    curve_jobs = [Job(study.kind, rate, seed) for rate in study.rates for seed in range(study.seeds)]
    layer_jobs: list[Job] = []
    if study.per_layer:
        rate = study.layer_rate if study.layer_rate is not None else max(study.rates)
        names = _param_names(template, ckpt)
        layer_jobs = [Job(study.kind, rate, seed, name) for name in names for seed in range(study.seeds)]

    if study.no_retrain:
        with progress.stage("building the model and its validation batches"):
            campaign = ForcedCampaign(template, ckpt, progress, deploy=study.deploy,
                                      params_given=any(o.split("=", 1)[0].lstrip("+~") == "pin.params"
                                                       for o in study.overrides))
        campaign.recipe = " ".join([*study.overrides, *([f"--deploy {study.deploy}"] if study.deploy else [])])
        rows = campaign.run(curve_jobs, "fault curve")
        layer_rows = campaign.run(layer_jobs, "per layer") if layer_jobs else []
        campaign.check_restored()
        sizes = campaign.sizes
    else:
        failed = _run_jobs(study, template, ckpt, out / JOBS_DIR, curve_jobs, "fault curve", log_path, progress)
        if layer_jobs and not failed:
            failed = _run_jobs(study, template, ckpt, out / LAYERS_DIR, layer_jobs, "per layer", log_path, progress)
        if failed:
            return 1
        with progress.stage("counting the stored bits the faults change"):
            counter = ForcedCampaign(template, ckpt, progress, evaluate=False)
            rows = _rows(out / JOBS_DIR, study, curve_jobs, counter)
            layer_rows = _rows(out / LAYERS_DIR, study, layer_jobs, counter) if layer_jobs else []
            sizes = counter.sizes
    for row in layer_rows:
        row["elements"] = sizes.get(row["param"])

    report.write_csv(rows, out / report.FAULT_CURVE_CSV)
    written = [out / report.FAULT_CURVE_CSV]
    with progress.stage(f"plotting {report.FAULT_CURVE_PNG}"):
        if report.plot_curve(rows, out / report.FAULT_CURVE_PNG) is not None:
            written.append(out / report.FAULT_CURVE_PNG)
    progress.flush()
    report.print_curve(rows, f"lightning-pin faults: kind={study.kind}, {len(rows)} " + (
        "draw(s), forced only" if study.no_retrain else "job(s)"))
    if layer_jobs:
        report.write_csv(layer_rows, out / report.LAYER_CSV, report.LAYER_COLUMNS)
        written.append(out / report.LAYER_CSV)
        with progress.stage(f"plotting {report.LAYER_PNG}"):
            if report.plot_layers(layer_rows, out / report.LAYER_PNG) is not None:
                written.append(out / report.LAYER_PNG)
        progress.flush()
        report.print_curve(layer_rows, f"faults in one parameter at a time, rate {layer_jobs[0].rate:g}", by="param")
    progress.line(f"wrote {', '.join(str(p) for p in written)} in {time.perf_counter() - started:.0f} s")
    return 0


# ----------------------------------------------------------------------------------------------
# Progress


class Progress:
    """Lines on the terminal: each stage, each job with an ETA, and a heartbeat when nothing else was said.

    Writes to a duplicate of stdout's file descriptor, so the lines still reach the terminal while a
    job's own output is redirected into its log.
    """

    def __init__(self, stream: Optional[TextIO] = None) -> None:
        self.stream = stream if stream is not None else _terminal(sys.stdout)
        self._own = stream is None and self.stream is not sys.stdout
        self.last = time.monotonic()
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        with self._lock:
            self.stream.write(text + "\n")
            self.stream.flush()
            self.last = time.monotonic()

    def beat(self, text: Callable[[], str]) -> None:
        """Say ``text()`` when nothing was said for :data:`HEARTBEAT` seconds."""
        if time.monotonic() - self.last >= HEARTBEAT:
            self.line(text())

    def close(self) -> None:
        if self._own:
            self.stream.close()

    def flush(self) -> None:
        with contextlib.suppress(Exception):
            self.stream.flush()
        sys.stdout.flush()

    @contextlib.contextmanager
    def stage(self, what: str) -> Iterator[None]:
        """``what ...``, heartbeats while it runs (from a thread), then ``what: N s``."""
        start = time.monotonic()
        self.line(f"{what} ...")
        with self.heartbeat(lambda: f"  {what}: {time.monotonic() - start:.0f} s ..."):
            yield
        if time.monotonic() - start >= 0.5:
            self.line(f"  {what}: done in {time.monotonic() - start:.1f} s")

    @contextlib.contextmanager
    def heartbeat(self, text: Callable[[], str]) -> Iterator[None]:
        """A thread that calls :meth:`beat` while the block runs (never while forking: see :func:`_run_forked`)."""
        done = threading.Event()

        def beat() -> None:
            while not done.wait(0.25):
                self.beat(text)

        thread = threading.Thread(target=beat, daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()


def _terminal(stream: TextIO) -> TextIO:
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return stream  # not a file (a test's capture): write to it as it is
    stream.flush()
    return os.fdopen(os.dup(fd), "w", buffering=1)


class _Eta:
    """Jobs done, time per job, time left (with ``workers`` jobs at a time)."""

    def __init__(self, what: str, total: int, skipped: int, workers: int) -> None:
        self.what, self.total, self.done, self.workers = what, total, skipped, workers
        self.started = time.monotonic()
        self.ran = 0

    def finished(self, text: str) -> str:
        self.done += 1
        self.ran += 1
        elapsed = time.monotonic() - self.started
        left = (self.total - self.done) * elapsed / self.ran
        return f"[{self.done}/{self.total}] {text}; {elapsed:.0f} s elapsed, ETA {_seconds(left)}"

    def status(self, running: str) -> str:
        return f"  ... {running}; {self.done}/{self.total} done, {time.monotonic() - self.started:.0f} s elapsed"


def _seconds(value: float) -> str:
    value = max(0.0, value)
    return f"{value:.0f} s" if value < 120 else f"{value / 60:.1f} min"


# ----------------------------------------------------------------------------------------------
# Config


def _compose_overrides(study: Study) -> list[str]:
    """The job's overrides for composing here: the user's (without the launcher's), the fault group, no rate yet."""
    kind = "bit" if study.kind == "flip" else study.kind  # flip draws as bit_faults does; the app never retrains it
    keep = [o for o in study.overrides if not o.lstrip("+~").startswith("hydra")]
    remap = ["pin.remap=true"] if study.remap else []
    return [*keep, "pin=faults", f"pin.kind={kind}", "pin.rate=0.0", "pin.seed=0", "skip_finished=true", *remap]


def _check_remap(study: Study) -> None:
    """``--remap`` maps permanent weight faults: refused, in one line, for the kinds it cannot map."""
    from lightning_pin.app.remap import UNMAPPABLE

    if study.remap and study.kind in UNMAPPABLE:
        what = "a transient fault has no fixed cells" if study.kind == "flip" else "stuck neurons are not weights"
        raise StudyError(f"--remap maps weights onto faulty cells, and --kind {study.kind}: {what}; drop --remap")
    if study.remap and study.deploy is not None:
        # torchao's int8 weights are read-only tensor subclasses: their rows cannot be gathered into new slots.
        raise StudyError(f"--remap permutes float weights before they are quantized, and --deploy {study.deploy} "
                         "faults the stored int8 codes of the trained model: use one of them")


def _compose(study: Study, overrides: Sequence[str], output_dir: Path) -> Any:
    """The app's config (:func:`lightning_pin.app.compose.compose_app`), or StudyError in one line."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from lightning_pin.app.compose import compose_app, composition_message
    from lightning_pin.app.train import check_lengths

    try:
        cfg = compose_app(overrides, output_dir.resolve(), config_dir=study.config_dir)
        check_lengths(cfg)
    except (HydraException, OmegaConfBaseException, ValueError) as err:
        raise StudyError(f"the job config does not compose: {composition_message(err)}") from None
    return cfg


def _job_config(template: Any, job: Job, ckpt: str, output_dir: Path, keep_checkpoints: bool = False,
                baseline: Optional[float] = None) -> Any:
    """The template with this job's fault, baseline and directory (what composing each job's overrides gives),
    and what a study job keeps (:func:`_job_outputs`)."""
    from omegaconf import open_dict

    cfg = copy.deepcopy(template)
    with open_dict(cfg):
        for key, value in _job_outputs(template, keep_checkpoints, baseline).items():
            _set(cfg, key, value)
        cfg.pin.kind = "bit" if job.kind == "flip" else job.kind
        cfg.pin.rate = float(job.rate)
        cfg.pin.seed = int(job.seed)
        if job.param is not None:
            cfg.pin.params = job.param
        cfg.ckpt_path = ckpt
        cfg.skip_finished = True
        cfg.paths.output_dir = str(output_dir.resolve())
    return cfg


def _job_outputs(template: Any, keep_checkpoints: bool, baseline: Optional[float]) -> dict[str, Any]:
    """What a study job needs beyond the template: the pinned weights without optimizer state (unless
    ``--keep-checkpoints``), no per-job report files (the study draws its figure once, from the summaries), no
    sanity validation (the baseline's pretraining or the first job ran the same loader), and the baseline when a
    job of the study measured it already (the same model on the same data: measured once)."""
    outputs: dict[str, Any] = {"pinned_checkpoint": "full" if keep_checkpoints else "weights"}
    if template.trainer.get("num_sanity_val_steps") is None:
        outputs["trainer.num_sanity_val_steps"] = 0
    monitor = (template.get("callbacks") or {}).get("pin_callback", {}).get("monitor")
    if monitor is not None and hasattr(monitor, "get"):
        outputs["callbacks.pin_callback.monitor.report"] = False
        if baseline is not None and _shares_baseline(template):
            outputs["callbacks.pin_callback.monitor.baseline"] = float(baseline)
    return outputs


def _shares_baseline(template: Any) -> bool:
    """Whether every job measures the same baseline: not when integer codes are quantized per job (the faults
    choose which parameters the forward reads as codes, before the baseline is measured)."""
    return template.pin.get("code_bits") is None


def _set(cfg: Any, key: str, value: Any) -> None:
    from omegaconf import OmegaConf

    OmegaConf.update(cfg, key, value, force_add=True)


def _claim(out: Path, study: Study) -> None:
    """Record the recipe in DIR/study.json; refuse a DIR that holds another recipe's jobs.

    Job directories are named by (kind, rate, seed) only, so finished jobs of one recipe would be
    taken for the other's, and the CSV would mix them. Other rates or seeds with the same recipe
    extend the study.
    """
    path = out / STUDY_JSON
    recipe = {"overrides": list(study.overrides), "kind": study.kind, "retrain": study.retrain}
    if study.config_dir is not None:
        recipe["config_dir"] = str(Path(study.config_dir).resolve())
    if path.is_file():
        try:
            held = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise StudyError(f"{path} is unreadable ({err}): give this study its own --out") from None
        fix = ("give this recipe its own --out (and ckpt_path=<the first study>/baseline/pretrained.ckpt to share "
               "its baseline)")
        if held.get("overrides") != recipe["overrides"]:
            raise StudyError(f"{out} holds a study with the overrides {held.get('overrides')}, not "
                             f"{recipe['overrides']}: {fix}")
        kind = held.get("kind") or _held_kind(out)
        if kind is not None and kind != study.kind:
            raise StudyError(f"{out} holds a study of --kind {kind}, not --kind {study.kind}: {fix}")
        if held.get("retrain", True) != study.retrain:
            was = "retrained" if held.get("retrain", True) else "--no-retrain"
            raise StudyError(f"{out} holds a {was} study: {fix}")
        if held.get("config_dir") != recipe.get("config_dir"):
            raise StudyError(f"{out} holds a study with --config-dir {held.get('config_dir')}: {fix}")
        if "kind" not in held:
            path.write_text(json.dumps(recipe, indent=2) + "\n")
        return
    path.write_text(json.dumps(recipe, indent=2) + "\n")


def _held_kind(out: Path) -> Optional[str]:
    """The kind of an older study's jobs (its study.json did not record it), from their directory names."""
    for directory in sorted((out / JOBS_DIR).glob("*_rate*_seed*")):
        return directory.name.split("_rate", 1)[0]
    return None


def _user_ckpt(overrides: Sequence[str]) -> Optional[str]:
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+") == "ckpt_path" and value not in ("", "null"):
            return str(Path(value).expanduser().resolve())
    return None


# ----------------------------------------------------------------------------------------------
# Baseline and jobs


def _baseline(study: Study, out: Path, log_path: Path, progress: Progress) -> Optional[str]:
    """Pretrain the one baseline every job starts from (reused when the directory holds it).

    In this process; with forked workers to come (``--jobs`` > 1), in a forked child instead, so
    that this process never runs torch's thread pool before it forks (a fork copies no threads).
    """
    directory = (out / BASELINE_DIR).resolve()
    ckpt = directory / PRETRAINED
    if ckpt.is_file():
        progress.line(f"baseline: {ckpt} (reused)")
        return str(ckpt)
    overrides = [*_compose_overrides(study), "pretrain.only=true"]
    cfg = _compose(study, overrides, directory)
    directory.mkdir(parents=True, exist_ok=True)
    with progress.stage("baseline: pretraining once"):
        with _single_threaded(_forking(study)):
            status = _in_process(cfg, log_path, refuse=True)
    if status != 0 or not ckpt.is_file():
        _show_failure(log_path, "the baseline's pretraining failed")
        return None
    return str(ckpt)


def _forking(study: Study) -> bool:
    """Whether the jobs run in forked workers: ``--jobs`` > 1, no launcher, a system with fork, and a process whose
    torch thread pool never started (a library caller that ran a multi-threaded study before runs them here)."""
    return study.jobs > 1 and study.launcher is None and hasattr(os, "fork") and not _threads_started


#: Whether this process has run a job (or the baseline) already: the data loaded, every lazy import done.
_warm = False
#: Whether this process ran a job on more than one torch thread (its OpenMP pool may be up: do not fork).
_threads_started = False


@contextlib.contextmanager
def _single_threaded(wanted: bool = True) -> Iterator[None]:
    """torch on one thread for the block, when this process forks workers later.

    A fork copies no threads: a child of a process whose OpenMP thread pool was started can hang
    in its first parallel region. On one thread torch never starts that pool, and the work done
    here (the baseline, or a first job) still leaves this process warm (data loaded, lazy imports
    done), which the workers then start from.
    """
    global _warm, _threads_started
    import torch

    threads = torch.get_num_threads()
    if wanted:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        _warm = True
        _threads_started |= torch.get_num_threads() > 1
        if wanted:
            torch.set_num_threads(threads)


def _job_state(directory: Path, progress: Progress) -> bool:
    """Whether the job in ``directory`` finished. A summary that does not read is moved aside (the job runs again)."""
    path = directory / RUN_SUMMARY
    if not path.is_file():
        return False
    try:
        summary = json.loads(path.read_text())
        if not isinstance(summary, dict) or "fault" not in summary:
            raise ValueError("not a job's summary")
    except (ValueError, UnicodeDecodeError) as err:
        aside = path.with_name(RUN_SUMMARY + ".unreadable")
        path.replace(aside)
        progress.line(f"{path} is unreadable ({err}): running that job again (the file is kept as {aside.name})")
        return False
    return True


def _run_jobs(study: Study, template: Any, ckpt: str, sweep_dir: Path, jobs: Sequence[Job], what: str,
              log_path: Path, progress: Progress) -> bool:
    """Run the unfinished jobs; True when one failed (its log's end is shown)."""
    todo = [job for job in jobs if not _job_state(sweep_dir / job.name, progress)]
    skipped = len(jobs) - len(todo)
    where = (f"on Hydra's {study.launcher} launcher" if study.launcher else
             f"in {study.jobs} forked workers" if _forking(study) else "in this process")
    progress.line(f"{what}: {len(jobs)} job(s) {where}" + (f", {skipped} finished before (skipped)" if skipped else ""))
    if not todo:
        return False
    eta = _Eta(what, len(jobs), skipped, study.jobs)
    baseline = _measured_baseline(sweep_dir.parent, template)
    if study.launcher is not None:
        return _run_launcher(study, ckpt, sweep_dir, jobs, todo, log_path, progress, eta, template, baseline)
    forking = _forking(study)
    # Forked workers start from this process: without a baseline trained here, the first job runs
    # here (on one thread) so that they do not each load the data and import what a job imports.
    # Without a measured baseline, the first job runs first too and measures it for all the others.
    first = (forking and not _warm) or (baseline is None and _shares_baseline(template))
    here = todo if not forking else todo[:1] if first else []
    failed = False
    for job in here:
        cfg = _job_config(template, job, ckpt, sweep_dir / job.name, study.keep_checkpoints, baseline)
        started = time.monotonic()
        running = f"{job.label()} running"
        with progress.heartbeat(lambda: eta.status(f"{running} ({time.monotonic() - started:.0f} s)")):
            with _single_threaded(forking):
                status = _in_process(cfg, sweep_dir / job.name / JOB_LOG)
        failed |= _report_job(job, sweep_dir, status, progress, eta)
        if baseline is None:
            baseline = _measured_baseline(sweep_dir.parent, template)
    forked = [(job, _job_config(template, job, ckpt, sweep_dir / job.name, study.keep_checkpoints, baseline))
              for job in todo[len(here):]]
    if forked:
        failed |= _run_forked(forked, study.jobs, sweep_dir, progress, eta, idle=report.preload)
    return failed


def _measured_baseline(out: Path, template: Any) -> Optional[float]:
    """The baseline a finished job of this study measured (every job starts from the same model on the same
    data), or None: then the next job measures it."""
    if not _shares_baseline(template):
        return None
    for directory in (JOBS_DIR, LAYERS_DIR):
        for path in sorted((out / directory).glob(f"*/{RUN_SUMMARY}")):
            try:
                value = json.loads(path.read_text()).get("baseline")
            except (OSError, ValueError):
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
    return None


def _report_job(job: Job, sweep_dir: Path, status: int, progress: Progress, eta: _Eta) -> bool:
    """One line for a finished job; True when it failed."""
    summary_path = sweep_dir / job.name / RUN_SUMMARY
    if status != 0 or not summary_path.is_file():
        _show_failure(sweep_dir / job.name / JOB_LOG, f"job {job.label()} failed")
        return True
    summary = json.loads(summary_path.read_text())
    final = summary.get("final")
    numbers = f"forced {_fmt(summary.get('forced'))}, final {_fmt(final)} ({summary.get('seconds', 0):.1f} s)"
    progress.line(eta.finished(f"{eta.what}: {job.label()}: {numbers}"))
    return False


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}"


@contextlib.contextmanager
def _redirected(log_path: Path) -> Iterator[None]:
    """stdout and stderr (the file descriptors and Python's streams) appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    streams = sys.stdout, sys.stderr
    log = os.fdopen(os.dup(fd), "a", buffering=1)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = sys.stderr = log
        yield
    finally:
        log.flush()
        sys.stdout, sys.stderr = streams
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for handle in (*saved, fd):
            os.close(handle)
        log.close()


@contextlib.contextmanager
def _app_logging() -> Iterator[None]:
    """The app's ``log.info`` lines (what Hydra's job logging would show) into the job's log."""
    import logging

    logger = logging.getLogger("lightning_pin")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _in_process(cfg: Any, log_path: Path, refuse: bool = False) -> int:
    """Run one app job here, its output into ``log_path``; the exit status (1: it raised, traceback in the log).
    ``refuse``: a target or metric of the user's that the app refuses (``ConfigError``) is a StudyError instead."""
    from lightning_pin.app.custom import ConfigError
    from lightning_pin.app.train import run

    with _redirected(log_path), _app_logging():
        print(f"job (in process): pin.kind={cfg.pin.kind} pin.rate={cfg.pin.rate} pin.seed={cfg.pin.seed} "
              f"into {cfg.paths.output_dir}", flush=True)
        try:
            run(cfg)
        except ConfigError as err:  # your model's or data's target, or its metric: one line, exit 2
            print(f"ConfigError: {err}", flush=True)
            if refuse:
                raise StudyError(str(err)) from None
            return 1
        except Exception:
            traceback.print_exc()
            return 1
    return 0


def _fork_job(cfg: Any, log_path: Path, threads: int) -> int:
    """Fork a worker that runs one app job (its output into ``log_path``) and exits; its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid != 0:
        return pid
    status = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        import torch

        torch.set_num_threads(max(1, threads))  # J workers share the cores
        status = _in_process(cfg, log_path)
    except BaseException:
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        os._exit(status)  # no interpreter shutdown, no parent's atexit handlers


def _run_forked(configs: Sequence[tuple[Job, Any]], workers: int, sweep_dir: Path, progress: Progress,
                eta: _Eta, idle: Callable[[], Any] = lambda: None) -> bool:
    """Up to ``workers`` jobs at a time, each in a worker forked from this process (imports done, no threads)."""
    threads = max(1, (os.cpu_count() or 1) // workers)
    queue = list(configs)
    running: dict[int, tuple[Job, float]] = {}
    failed = False
    try:
        while queue or running:
            while queue and len(running) < workers:
                job, cfg = queue.pop(0)
                (sweep_dir / job.name).mkdir(parents=True, exist_ok=True)
                running[_fork_job(cfg, sweep_dir / job.name / JOB_LOG, threads)] = (job, time.monotonic())
            for pid in list(running):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    job, _ = running.pop(pid)
                    failed |= _report_job(job, sweep_dir, os.waitstatus_to_exitcode(status), progress, eta)
            if running and not queue and idle is not None:
                idle()  # the last worker is forked: work that needs no fork after it (imports for the plots)
                idle = None
            if running:
                time.sleep(0.05)
                progress.beat(lambda: eta.status(", ".join(
                    f"{job.label()} ({time.monotonic() - start:.0f} s)" for job, start in running.values())
                    + " running"))
    except BaseException:
        for pid in running:  # only the workers this study forked
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for pid in running:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        raise
    return failed


def _run_launcher(study: Study, ckpt: str, sweep_dir: Path, jobs: Sequence[Job], todo: Sequence[Job],
                  log_path: Path, progress: Progress, eta: _Eta, template: Any,
                  baseline: Optional[float]) -> bool:
    """The jobs as a Hydra multirun (``python -m lightning_pin.train -m``) on ``study.launcher``; True if one failed."""
    sweep_dir = sweep_dir.resolve()
    kind = jobs[0].kind
    if jobs[0].param is not None:
        sweep = [f"pin.rate={float(jobs[0].rate)!r}", "pin.params=" + ",".join(sorted({j.param for j in todo}))]
        subdir = "${pin.params}_seed${pin.seed}"
    else:
        sweep = ["pin.rate=" + ",".join(repr(float(r)) for r in sorted({j.rate for j in todo}))]
        subdir = "${pin.kind}_rate${pin.rate}_seed${pin.seed}"
    seeds = ",".join(str(s) for s in sorted({j.seed for j in todo}))
    launcher = [] if any(o.split("=", 1)[0].lstrip("+~") == "hydra/launcher" for o in study.overrides) else [
        f"hydra/launcher={study.launcher}"]
    if study.launcher == "joblib" and not any(o.startswith("hydra.launcher.n_jobs") for o in study.overrides):
        launcher.append(f"hydra.launcher.n_jobs={study.jobs}")
    config_dir = ["--config-dir", str(Path(study.config_dir).resolve())] if study.config_dir else []
    args = [sys.executable, "-m", "lightning_pin.train", *config_dir, "-m", *study.overrides, "pin=faults",
            f"pin.kind={kind}", *sweep, f"pin.seed={seeds}", f"ckpt_path={ckpt}", "skip_finished=true",
            f"hydra.sweep.dir={sweep_dir}", f"hydra.sweep.subdir={subdir}", *launcher,
            *(f"{key}={str(value).lower() if isinstance(value, bool) else value}"
              for key, value in _job_outputs(template, study.keep_checkpoints, baseline).items())]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    finished = {job.name for job in jobs if (sweep_dir / job.name / RUN_SUMMARY).is_file()}
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(args)}\n")
        log.flush()
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        started = time.monotonic()
        while True:
            alive = process.poll() is None
            for job in todo:
                if job.name not in finished and (sweep_dir / job.name / RUN_SUMMARY).is_file():
                    finished.add(job.name)
                    _report_job(job, sweep_dir, 0, progress, eta)
            if not alive:
                break
            progress.beat(lambda: eta.status(
                f"the {study.launcher} multirun running ({time.monotonic() - started:.0f} s)"))
            time.sleep(0.25)
    if process.returncode != 0:
        _show_failure(log_path, f"a job of the {study.launcher} multirun failed")
        return True
    return False


def _show_failure(log_path: Path, what: str) -> None:
    lines = log_path.read_text(errors="replace").splitlines()[-25:] if log_path.is_file() else []
    print(f"lightning-pin faults: {what}; the end of {log_path}:\n" + "\n".join(lines), file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# Rows


def _rows(sweep_dir: Path, study: Study, jobs: Sequence[Job], counter: "ForcedCampaign") -> list[dict[str, Any]]:
    """The CSV rows of the requested jobs, with the stored bits their faults change (``changed_bits``)."""
    rows = []
    for job in jobs:
        path = sweep_dir / job.name / RUN_SUMMARY
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise StudyError(f"{path} is unreadable ({err}): delete it and run the study again (that job reruns)")
        row = report.job_row(summary, str(path.parent))
        row["recipe"] = " ".join(study.overrides)
        row["changed_bits"] = counter.changed_bits(job, path.parent if study.remap else None)
        rows.append(row)
    return report.sort_rows(rows, "param" if jobs and jobs[0].param is not None else "rate")


def _param_names(template: Any, ckpt: str) -> list[str]:
    """The parameters ``pin.params`` matches, read from the composed config and the baseline checkpoint."""
    from fnmatch import fnmatchcase

    import torch

    from lightning_pin.app.custom import WEIGHTS_2D, default_pin_names

    patterns = template.pin.params if not isinstance(template.pin.params, str) else [template.pin.params]
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    state = state.get("state_dict", state)
    names = list(state)
    if WEIGHTS_2D in patterns:  # a model of your own: the weights of its conv and linear layers
        from lightning_pin.app.custom import build_model

        patterns = [p for p in patterns if p != WEIGHTS_2D]
        patterns += default_pin_names(state.items(), build_model(template, None, announce=False).model)

    def matches(name: str, pattern: str) -> bool:
        return re.fullmatch(pattern[3:], name) is not None if pattern.startswith("re:") else fnmatchcase(name, pattern)

    found = [n for n in names if any(matches(n, p) for p in patterns)]
    if not found:
        raise StudyError(
            f"pin.params={list(patterns)} matches no parameter of the baseline ({', '.join(names[:6])}...)"
        )
    return found


class ForcedCampaign:
    """Many draws on one model in this process: the faults written into the weights, measured, undone exactly.

    The model and its validation batches are built once from the job config (as the app builds them)
    and the baseline loaded; each draw saves only the words it changes (no copy of the model) and
    writes them back after the evaluation. ``evaluate=False``: only count the bits each draw changes
    (``changed_bits`` of a retrained study's rows).
    """

    def __init__(self, template: Any, ckpt: str, progress: Progress, evaluate: bool = True,
                 deploy: Optional[str] = None, params_given: bool = True) -> None:
        import torch
        from hydra.utils import instantiate

        from lightning_pin.app.custom import build_datamodule, build_model, expand_params
        from lightning_pin.app.train import load_weights, tracks_logged_metric

        self.template, self.ckpt, self.progress = template, ckpt, progress
        if template.get("torch_threads"):
            torch.set_num_threads(template.torch_threads)  # as the app's jobs run
        #: The study's overrides, for the rows' ``recipe`` column.
        self.recipe = ""
        optimizer = instantiate(template.optimizer, _convert_="all")
        # Built as the app's jobs build it: a model of your own (any of the three kinds) and your data too.
        built = build_model(template, optimizer, announce=False)
        self.model = built.model
        # Measured as the retrained path measures it: the model's own validation_step and the metric it logs,
        # or (the app's classifier and val_acc) top-1 accuracy of its predictions.
        self.metric = str(template.get("metric", "val_acc"))
        self.logged = tracks_logged_metric(template, built)
        self.model_name = built.target
        load_weights(self.model, ckpt)
        self.model.eval()
        #: ``--deploy torchao-int8``: the int8 weights torchao made (their stored codes are faulted).
        self.deployed: list[str] = []
        if deploy is not None:
            from lightning_pin.deploy import quantize_torchao

            self.deployed = quantize_torchao(self.model)
        self._reference = {n: _stored(p).clone() for n, p in self.model.named_parameters()}
        self._parameters = dict(self.model.named_parameters())
        self.sizes = {n: p.numel() for n, p in self.model.named_parameters()}
        self.batches: list[Any] = []
        if evaluate:
            datamodule = build_datamodule(template)
            datamodule.prepare_data()
            datamodule.setup("fit")
            loader = datamodule.val_dataloader()
            limit = _batch_limit(template.trainer.get("limit_val_batches"), len(loader))
            self.batches = [batch for _, batch in zip(range(limit), loader)]
        self.torch = torch
        # Read once: OmegaConf lookups would cost more per draw than drawing a few faults.
        pin = template.pin
        self._params = expand_params(_plain(pin.params), self.model)  # a model of your own: its 2+-dim weights
        if self.deployed:
            self._params = _deployed_params(self.model, self._params, self.deployed, progress, params_given)
        self._options = {key: _plain(pin.get(key)) for key in ("low", "high", "sa1_fraction", "cell_high", "bits",
                                                               "one_fraction", "code_bits", "neuron_kind", "per",
                                                               "modules")
                         if pin.get(key) is not None}
        monitor = template.callbacks.pin_callback.get("monitor") or {}
        self.tolerance = monitor.get("tolerance") if hasattr(monitor, "get") else None
        if self._options.get("code_bits") is not None:  # integer codes: the forward reads them, baseline included
            from lightning_pin.faults import quantize_codes

            quantize_codes(self.model, self._params, self._options["code_bits"])
        self.baseline = self.evaluate() if evaluate else None

    def evaluate(self) -> float:
        """The tracked metric over the validation batches, as the retrained path's monitor measures it.

        A logged metric (``metric=val_loss``, a model of your own): the model's ``validation_step`` on each
        batch, reduced as Lightning reduces what it logs; the app's classifier and ``val_acc``: micro accuracy
        of the argmax of its predictions, as :class:`~lightning_pin.PinMonitor` counts it.
        """
        from lightning_pin.app.metric import missing_metric
        from lightning_pin.batches import default_predict, run_validation

        torch = self.torch
        if self.logged:
            capture = run_validation(self.model, self.batches)
            value = capture.value(self.metric)
            if value is None:
                raise missing_metric(self.metric, capture.names(), self.model_name)
            return value
        correct = torch.zeros((), dtype=torch.int64)
        total = 0
        with torch.no_grad():
            for batch in self.batches:
                preds, target = default_predict(self.model, batch)
                correct += (preds.argmax(dim=1) == target).sum()
                total += target.numel()
        return float(correct / torch.tensor(total))  # int64 / int64 -> float32, as torchmetrics divides

    def draw(self, job: Job) -> Any:
        """The job's faults on the model, as a patch to enter (:class:`~lightning_pin.faults.WordPatch`)."""
        from lightning_pin.app.fault_pins import draw_faults
        from lightning_pin.faults import flip_bits, forced_patch

        params = job.param if job.param is not None else self._params
        if job.kind == "flip":
            return flip_bits(self.model, params, job.rate, bits=self._options.get("bits"), seed=job.seed)
        pins = draw_faults(self.model, job.kind, job.rate, job.seed, params, **self._options)
        if self.template.pin.get("remap") and self.batches:  # measured draws: map, measure, then unmap exactly
            pins = self._map(pins)
        weight_pins, outputs = kinds.split(pins)
        if outputs:  # stuck neurons: forward hooks for the block, no stored word changed
            from lightning_pin.faults.neurons import NeuronPatch

            return NeuronPatch(self.model, [p for _, held in outputs for p in held])
        return forced_patch(self.model, pins, parameters=self._parameters)

    def _map(self, pins: Sequence[Any]) -> list[Any]:
        from lightning_pin.app.remap import batch_inputs, map_job

        pins, self._mapped, self._mapping = map_job(self.model, pins, batch_inputs(self.batches[0]))
        return pins

    def unmap(self) -> dict[str, Any]:
        """Undo the last draw's mapping (bit for bit); its CSV entries (none without ``pin.remap``)."""
        mapping, mapped = getattr(self, "_mapping", None), getattr(self, "_mapped", {})
        if mapping is not None:
            mapping.undo(self.model)
        self._mapping, self._mapped = None, {}
        return mapped

    def changed_bits(self, job: Job, mapped: Optional[Path] = None) -> int:
        """The stored bits the job's faults change; ``mapped``: on the model as that job mapped it (its remap.pt)."""
        from lightning_pin.app.remap import REMAP_FILE

        mapping = None
        if mapped is not None and (mapped / REMAP_FILE).is_file():
            from lightning_pin.faults import FaultMapping

            mapping = FaultMapping.from_state_dict(self.torch.load(mapped / REMAP_FILE, weights_only=True))
            mapping.apply(self.model)
        try:
            with self.draw(job) as patch:
                pass
        finally:
            if mapping is not None:
                mapping.undo(self.model)
        return patch.changed_bits

    def run(self, jobs: Sequence[Job], what: str) -> list[dict[str, Any]]:
        """One row per job: baseline and forced accuracy, the bits changed; final, gap and recovered_step empty."""
        self.progress.line(f"{what}: {len(jobs)} draw(s) in this process, baseline {self.baseline:.4f}")
        eta = _Eta(what, len(jobs), 0, 1)
        rows = []
        last = time.monotonic()
        for index, job in enumerate(jobs):
            started = time.perf_counter()
            with self.draw(job) as patch:
                forced = self.evaluate()
            mapped = self.unmap()
            seconds = time.perf_counter() - started
            rows.append({
                "kind": job.kind, "rate": job.rate, "seed": job.seed, "param": job.param, "baseline": self.baseline,
                "forced": forced, "final": None, "gap": None, "recovered_step": None, "recovered": None,
                "pinned_elements": patch.elements, "changed_bits": patch.changed_bits, "pins_exact": None,
                "seconds": round(seconds, 4), "tolerance": self.tolerance, "diverged": None,
                "recipe": self.recipe, "job_dir": "", **mapped,
            })
            eta.done += 1
            eta.ran += 1
            if time.monotonic() - last >= HEARTBEAT or index == len(jobs) - 1:
                elapsed = time.monotonic() - eta.started
                left = elapsed / (index + 1) * (len(jobs) - index - 1)
                self.progress.line(f"[{index + 1}/{len(jobs)}] {what}: {job.label()}: forced {forced:.3f}; "
                                   f"{_seconds(elapsed)} elapsed, ETA {_seconds(left)}")
                last = time.monotonic()
        return report.sort_rows(rows, "param" if jobs and jobs[0].param is not None else "rate")

    def check_restored(self) -> None:
        """Every parameter equals the baseline, bit for bit, after all the draws (PinError otherwise)."""
        torch = self.torch
        for name, parameter in self.model.named_parameters():
            before = self._reference[name]
            if not torch.equal(_stored(parameter).view(-1).view(torch.uint8), before.view(-1).view(torch.uint8)):
                raise PinError(f"{name} was not restored exactly after the draws")


def _stored(parameter: Any) -> Any:
    """What a parameter stores: its int8 codes for a torchao weight, else its words."""
    return parameter.qdata.detach() if hasattr(parameter, "qdata") else parameter.detach()


def _deployed_params(model: Any, params: Any, deployed: Sequence[str], progress: Progress,
                     params_given: bool = True) -> list[str]:
    """The torchao int8 weights among those ``params`` matches (torchao leaves the others float: not faulted).

    The app's default weights of a CNN are its convolutions, which torchao leaves float: without
    ``pin.params=`` given, the campaign then faults every int8 weight, and says so.
    """
    from lightning_pin.faults._common import exact_pattern, floating_parameters

    matched = list(floating_parameters(model, params, "faults --deploy"))
    chosen = [name for name in matched if name in deployed]
    if not chosen and not params_given:
        progress.line(f"torchao int8: the default weights ({', '.join(matched)}) stay float in torchao (it quantizes "
                      f"nn.Linear weights only); faults in every int8 weight instead (pin.params= chooses)")
        matched, chosen = list(deployed), list(deployed)
    if not chosen:
        raise PinError(f"--deploy: none of {', '.join(matched)} is an int8 weight of the torchao model "
                       f"(torchao quantizes nn.Linear weights: {', '.join(deployed)})")
    left = [name for name in matched if name not in deployed]
    progress.line(f"torchao int8: faults in the stored codes of {', '.join(chosen)}"
                  + (f"; left float (not faulted): {', '.join(left)}" if left else ""))
    return [exact_pattern(name) for name in chosen]


def _batch_limit(limit: Any, batches: int) -> int:
    """How many validation batches Lightning's ``limit_val_batches`` lets through."""
    if limit is None:
        return batches
    if isinstance(limit, float):
        return batches if limit >= 1.0 else max(1, int(batches * limit)) if limit > 0 else 0
    return min(int(limit), batches)


def _plain(value: Any) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
