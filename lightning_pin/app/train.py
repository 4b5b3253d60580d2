"""The Hydra app: the whole pinning story in one command.

    python -m lightning_pin.train [overrides]        # or: lightning-pin train [overrides]
    python -m lightning_pin.train -m pin.fraction=0.01,0.05,0.2 optimizer=sgd,adamw

1. Build everything the config describes (data, model, optimizer, pins, callbacks, loggers,
   trainers) and resolve the pins on the model, so a bad config fails in seconds, before any
   training.
2. Pretrain the model without pins (saved as ``pretrained.ckpt``), or load ``ckpt_path``.
3. Retrain with :class:`~lightning_pin.PinCallback`. Its :class:`~lightning_pin.PinMonitor`
   measures the accuracy before any pin (baseline), right after forcing the pins without
   training (forced), and after every validation; at the end it writes ``pin_report.json`` and
   ``pin_report.png`` into the run directory.
4. Verify that every pinned element is on its target bit for bit (``PinCallback.verify``) and save
   ``pinned.ckpt`` (``lightning-pin diff pretrained.ckpt pinned.ckpt`` shows what moved).
5. Write ``run_summary.json`` (what a sweep's summary table is made of) and print a short summary.

The configs are the ``conf/`` directory at the top of the repository, shipped inside the package
as ``lightning_pin/conf`` (see :func:`find_config_dir`); their schema is
:mod:`lightning_pin.app.config`.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import get_class, instantiate
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_pin.app.config import register_configs
from lightning_pin.app.custom import OWN_OPTIMIZER, BuiltModel, build_datamodule, build_model, expand_params
from lightning_pin.app.custom import is_app_data, model_name, data_target
from lightning_pin.app.metric import LoggedMetric, LoggedMetricMonitor, check_mode
from lightning_pin.app.fault_pins import default_neuron_modules, draw_faults, probe_output_pins, save_faults
from lightning_pin.core import kinds
from lightning_pin.app.pins import fault_map_pins, realize
from lightning_pin.app.sweep import RUN_SUMMARY
from lightning_pin.callbacks.pin_callback import PinCallback
from lightning_pin.core.io import TensorFileError, load_checkpoint
from lightning_pin.core.plan import resolve
from lightning_pin.faults.quantize import quantize_pins
from lightning_pin.core.spec import Pin
from lightning_pin.reporting.report import REPORT_JSON, REPORT_PNG, settled_step

__all__ = [
    "CONFIG_DIR", "FAULT_MAP", "OPTIMIZABLE", "PINNED_CKPT", "PRETRAINED_CKPT", "TRACEBACK_ENV", "build_loggers",
    "build_pin_callback", "build_pins", "build_trainer", "check_classes", "check_lengths", "diverged",
    "find_config_dir", "load_weights", "log", "main", "make_summary", "metric_callbacks", "pin_report",
    "print_summary", "run", "run_targets", "tracks_logged_metric",
]


log = logging.getLogger("lightning_pin.train")

PRETRAINED_CKPT = "pretrained.ckpt"
PINNED_CKPT = "pinned.ckpt"
#: ``pinned_checkpoint=weights``: the pinned weights alone, and the pin state ``lightning-pin check`` reads.
PINNED_WEIGHTS = "pinned.safetensors"
PIN_STATE = "pins.pt"
#: What ``pinned_checkpoint`` may say (see :func:`save_pinned`).
PINNED_CHECKPOINTS = ("full", "weights")
#: The faults a ``pin=faults`` job pinned (see :func:`lightning_pin.app.fault_pins.save_faults`).
FAULT_MAP = "fault_map.pt"
#: Keys of run_summary.json a sweeper may optimize (``optimized_metric``).
OPTIMIZABLE = ("baseline", "forced", "final", "gap", "pin_drift_max", "weight_drift", "weight_drift_relative")

register_configs()

# The data sets live in memory: loader workers would only add start-up time.
warnings.filterwarnings("ignore", ".*does not have many workers.*")
# Small data sets of your own have epochs shorter than Lightning's logging interval; the app logs what it reports.
warnings.filterwarnings("ignore", ".*is smaller than the logging interval.*")
# Lightning 2.6 calls a torch pytree API that newer torch deprecates; nothing the user can act on.
warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\).*")


def find_config_dir() -> str:
    """The directory of the Hydra config groups, as an absolute path.

    An installed wheel holds them in ``lightning_pin/conf``; a source or editable checkout has
    ``conf/`` at the top of the repository, which ``lightning_pin/conf`` links to (a checkout
    without symlinks, as git makes on some Windows set-ups, falls back to ``conf/`` itself).
    Absolute, so the app finds it from any working directory and however it is started
    (``python -m``, the ``lightning-pin`` script, a test).

    Raises:
        FileNotFoundError: neither place holds ``train.yaml`` (a broken install).
    """
    package = Path(__file__).resolve().parents[1]
    candidates = (package / "conf", package.parent / "conf")
    for candidate in candidates:
        if (candidate / "train.yaml").is_file():
            return str(candidate.resolve())
    raise FileNotFoundError(
        f"the app's configs (train.yaml) are in neither {candidates[0]} nor {candidates[1]}: reinstall "
        "lightning-pin, or run from a checkout of its repository"
    )


#: The Hydra config groups (``conf/``); their schema is :mod:`lightning_pin.app.config`.
CONFIG_DIR = find_config_dir()


#: Set to 1 (or HYDRA_FULL_ERROR=1) to see the full traceback of an error instead of its one line.
TRACEBACK_ENV = "LIGHTNING_PIN_TRACEBACK"


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def main(cfg: DictConfig) -> Optional[float]:
    """Run one job; return ``optimized_metric`` of its summary (what Optuna optimizes).

    An error ends a single run with one line on stderr (``PinError: ...``) and exit status 1; the
    full traceback comes with ``LIGHTNING_PIN_TRACEBACK=1`` or ``HYDRA_FULL_ERROR=1``. In a
    multirun the error goes to the sweeper, which decides (Optuna records a failed trial).

    Raises:
        PinError, ValueError, FileNotFoundError: as :func:`run`, in a multirun or when a traceback was asked for.
    """
    try:
        summary = run(cfg)
    except Exception as err:
        if _traceback_requested() or _multirun():
            # A sweep handles a failed job itself (Optuna records the trial as failed and goes on).
            raise
        # Hydra would print 20-odd lines of traceback before the message that says what to fix.
        message = " ".join(str(err).split()) or "(no message)"
        print(f"{type(err).__name__}: {message}", file=sys.stderr)
        print(f"(full traceback: {TRACEBACK_ENV}=1 or HYDRA_FULL_ERROR=1)", file=sys.stderr, flush=True)
        sys.exit(1)
    return summary[cfg.optimized_metric]


def _multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _traceback_requested() -> bool:
    return any(os.environ.get(name, "") not in ("", "0") for name in (TRACEBACK_ENV, "HYDRA_FULL_ERROR"))


def run(cfg: DictConfig, extra_callbacks: Sequence[pl.Callback] = ()) -> dict[str, Any]:
    """Pretrain, pin, retrain, verify, report. Returns the run summary (also in ``run_summary.json``).

    ``extra_callbacks`` join the pinned retraining's Trainer (``lightning-pin tune`` passes its
    per-epoch pruning callback this way).

    Raises:
        PinError: a pin cannot be honoured on the model (before any training), or a pinned
            element is off target after training (``PinCallback.verify``).
        ValueError: ``optimized_metric`` is not a key of the summary, the model and the data
            disagree on the number of classes, ``callbacks.pin_callback`` is missing, or
            ``ckpt_path`` is not a checkpoint that loads with ``weights_only=True``.
        FileNotFoundError: ``ckpt_path`` does not exist.
    """
    if cfg.get("continual") is not None:
        from lightning_pin.app.continual import run_continual

        return run_continual(cfg)
    started = time.perf_counter()
    finished = Path(cfg.paths.output_dir) / RUN_SUMMARY
    if cfg.skip_finished and finished.is_file():
        log.info(f"Skipped: {finished} holds the summary of a finished run (skip_finished=true)")
        return json.loads(finished.read_text())
    if cfg.optimized_metric not in OPTIMIZABLE:
        raise ValueError(f"optimized_metric={cfg.optimized_metric!r} is not one of {list(OPTIMIZABLE)}")
    check_mode(cfg.metric, cfg.metric_mode)
    check_lengths(cfg)
    if cfg.get("pinned_checkpoint", "full") not in PINNED_CHECKPOINTS:
        raise ValueError(f"pinned_checkpoint={cfg.pinned_checkpoint!r} is not one of {list(PINNED_CHECKPOINTS)}: "
                         "full keeps pinned.ckpt (resumable), weights keeps pinned.safetensors and pins.pt")
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    output_dir = Path(cfg.paths.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    # 1. Everything is built, and the pins resolved on the model, before the first step.
    datamodule = build_datamodule(cfg)
    if is_app_data(cfg):
        # The app's data sets that download (data=cifar10) get their data, or end in one line, before any training.
        datamodule.prepare_data()
    optimizer = instantiate(cfg.optimizer, _convert_="all")
    # Objects go in through partials: instantiate(node, **objects) would copy them into the config.
    built = build_model(cfg, optimizer)
    model = built.model
    check_classes(model, datamodule)
    pins = build_pins(cfg.pin, model)
    plan = resolve(kinds.split(pins)[0], model)  # raises PinError naming any weight pin that cannot be honoured
    probe_output_pins(model, pins, datamodule)  # and any stuck-neuron pin: its checks need one forward
    pin_callback = build_pin_callback(cfg, pins, built)
    others = [instantiate(node, _convert_="all") for name, node in cfg.callbacks.items() if name != "pin_callback"]
    pretrainer = build_trainer(cfg, "pretrain", callbacks=metric_callbacks(cfg, built, None),
                               max_epochs=cfg.pretrain.max_epochs)
    trainer = build_trainer(cfg, "pinned", callbacks=[pin_callback, *metric_callbacks(cfg, built, pin_callback),
                                                      *others, *extra_callbacks])

    # 2. The model to pin.
    if cfg.ckpt_path:
        load_weights(model, cfg.ckpt_path)
        log.info(f"Loaded the model's weights from {cfg.ckpt_path} (no pretraining)")
    else:
        log.info(f"Pretraining {model_name(model)} without pins for {cfg.pretrain.max_epochs} epochs")
        pretrainer.fit(model, datamodule)
        pretrainer.save_checkpoint(output_dir / PRETRAINED_CKPT, weights_only=False)
    if cfg.pretrain.only:
        summary = make_summary(cfg, {}, output_dir, seconds=time.perf_counter() - started, built=built)
        (output_dir / RUN_SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
        log.info(f"Pretrained {output_dir / PRETRAINED_CKPT} (pretrain.only=true: no pinned retraining)")
        return summary
    if cfg.pin.get("faults") is not None or {"rate", "kind"} <= set(cfg.pin.keys()):
        # Fault generators read the weights (an SA1 cell reads the layer's largest magnitude with
        # its weight's sign): draw the faults again on the model that is retrained, not on the
        # freshly initialised one that step 1 checked them on.
        pins = build_pins(cfg.pin, model, announce=True)
        plan = resolve(kinds.split(pins)[0], model)
        pin_callback = build_pin_callback(cfg, pins, built)
        trainer = build_trainer(cfg, "pinned", callbacks=[pin_callback, *metric_callbacks(cfg, built, pin_callback),
                                                          *others, *extra_callbacks])
    if "rate" in cfg.pin.keys() and pins:
        save_faults(pins, model, output_dir / FAULT_MAP)  # what a study checks for common random numbers
    remapped: dict[str, Any] = {}
    if cfg.pin.get("remap"):
        # The faults' cells stay where they are; the pretrained model's units move onto them (function kept),
        # before the forced accuracy (PinMonitor measures it at train start) and the retraining.
        from lightning_pin.app.remap import example_from, map_job

        pins, remapped, _ = map_job(model, pins, example_from(datamodule), output_dir)
        plan = resolve(kinds.split(pins)[0], model)
        pin_callback = build_pin_callback(cfg, pins, built)
        trainer = build_trainer(cfg, "pinned", callbacks=[pin_callback, *metric_callbacks(cfg, built, pin_callback),
                                                          *others, *extra_callbacks])

    # 3. Baseline, forced, retraining with the pins (PinMonitor measures at train start). Stuck bits of
    # integer codes: from here the forward reads the dequantized codes (quantization-aware retraining).
    quantize_pins(model, pins)
    pinned = sum(plan.pinned_counts().values())
    log.info(f"Retraining with {len(pins)} pin(s) on {pinned:,} elements for {cfg.trainer.max_epochs} epochs")
    trainer.fit(model, datamodule)

    # 4. Exactness, on the model as it came back from training (after ddp_spawn too).
    pin_callback.verify(model)
    save_pinned(cfg.get("pinned_checkpoint", "full"), trainer, pin_callback, model, output_dir)

    # 5. The summary.
    report = pin_report(pin_callback, output_dir)
    summary = make_summary(cfg, report, output_dir, seconds=time.perf_counter() - started, built=built)
    summary["train_loss"] = _last_loss(trainer)
    summary.update(remapped)
    # Pins on module outputs (stuck neurons) hold in every forward, not in weights: counted apart.
    summary["output_pins"] = sum(len(group) for _, group in kinds.split(pins)[1])
    # Which modules, which units, on which axis (resolved in this process; not after ddp_spawn's workers).
    summary["output_pin_modules"] = [
        line for hold in pin_callback.outputs.values() for line in hold.summary().splitlines()
    ]
    classes = getattr(datamodule, "num_classes", None)
    chance = 1.0 / classes if classes and summary.get("metric") == "accuracy" else None
    summary["chance"] = chance
    summary["outcome"] = outcome(summary, higher_is_better=report.get("higher_is_better", True), chance=chance)
    summary["diverged"] = summary["outcome"] is not None
    figure = output_dir / "pin_report.png"
    if chance is not None and figure.is_file() and report.get("history"):
        from lightning_pin.reporting.report import plot_report

        plot_report({**report, "chance": chance}, figure)  # the monitor drew it without knowing the classes
    (output_dir / RUN_SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    print_summary(summary)
    return summary


# ----------------------------------------------------------------------------------------------
# Building


def build_pins(pin_cfg: DictConfig, model: torch.nn.Module, announce: bool = False) -> list[Pin]:
    """The pins of the ``pin`` group, ready for ``model``.

    Each entry of ``pins`` becomes a :class:`~lightning_pin.Pin`; a value given as a generator node
    (``_target_: lightning_pin.app.pins.UniformValues``) becomes one tensor per matched parameter;
    a ``fault_map`` file adds one pin per parameter it marks; a ``faults`` node (a ``_partial_``
    fault generator such as :func:`lightning_pin.faults.cell_faults`) adds the pins it draws on ``model``.

    Raises:
        PinError: an entry is not a valid pin, a generator's pin matches no parameter of
            ``model``, or the fault map is missing, unreadable or marks no faulty cell.
    """
    entries = instantiate(pin_cfg.pins, _convert_="all")
    for entry in entries:
        if isinstance(entry, dict) and "params" in entry:  # a model of your own: every *.weight of 2+ dims
            entry["params"] = expand_params(entry["params"], model)
    pins = [realize(Pin.from_config(entry), model) for entry in entries]
    if "rate" in pin_cfg.keys() and "kind" in pin_cfg.keys():  # pin=faults
        options = ("low", "high", "sa1_fraction", "cell_high", "bits", "one_fraction", "code_bits", "neuron_kind", "per",
                   "modules")
        drawn = {key: _plain(pin_cfg[key]) for key in options if key in pin_cfg.keys()}
        params = expand_params(_plain(pin_cfg.params), model)
        pins += draw_faults(model, pin_cfg.kind, pin_cfg.rate, pin_cfg.seed, params, **drawn)
    # keys(), not `in`: `in` is False for a missing value (???), which must fail here, not be skipped.
    if "fault_map" in pin_cfg.keys():
        pins += fault_map_pins(pin_cfg.fault_map)
    if pin_cfg.get("faults") is not None:
        generator = instantiate(pin_cfg.faults, _convert_="all")
        if isinstance(generator, functools.partial) and "params" in generator.keywords:
            generator = functools.partial(generator, params=expand_params(generator.keywords["params"], model))
        if isinstance(generator, functools.partial) and "modules" in generator.keywords and (
            generator.keywords["modules"] is None
        ):  # pin=neuron_faults without pin.modules: the model's conv and linear layers
            generator = functools.partial(generator, modules=default_neuron_modules(model))
        drawn = generator(model)
        if announce and getattr(drawn, "summary", None):
            log.info(drawn.summary)  # what was drawn, per parameter (announce: once, for the model retrained)
        pins += drawn
    return pins


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


def build_pin_callback(cfg: DictConfig, pins: Sequence[Pin], built: Optional[BuiltModel] = None) -> PinCallback:
    """The :class:`~lightning_pin.PinCallback` of ``callbacks.pin_callback``, holding ``pins``.

    Its monitor tracks ``metric`` as the model logs it (:class:`~lightning_pin.app.metric.LoggedMetricMonitor`)
    unless the model is the app's classifier and ``metric=val_acc metric_mode=max``, which the
    :class:`~lightning_pin.PinMonitor` measures itself (top-1 accuracy, as before).

    Raises:
        ValueError: the config has no ``callbacks.pin_callback``.
    """
    if "pin_callback" not in cfg.callbacks:
        raise ValueError(
            "callbacks.pin_callback is missing: the app retrains with the PinCallback it describes "
            "(callbacks=default has one)"
        )
    node = cfg.callbacks.pin_callback
    if tracks_logged_metric(cfg, built):
        node = OmegaConf.create(OmegaConf.to_container(node, resolve=True))
        for key in ("accuracy", "higher_is_better", "name"):  # set from metric and metric_mode
            node.monitor.pop(key, None)
        node.monitor._target_ = f"{LoggedMetricMonitor.__module__}.{LoggedMetricMonitor.__name__}"
        node.monitor.metric = cfg.metric
        node.monitor.mode = cfg.metric_mode
        node.monitor.model_name = built.target if built is not None else "the model"
    return instantiate(node, _partial_=True, _convert_="all")(pins=list(pins))


def tracks_logged_metric(cfg: DictConfig, built: Optional[BuiltModel]) -> bool:
    """Whether baseline / forced / final are the logged ``metric`` (see :func:`build_pin_callback`)."""
    from lightning_pin.app.models import Classifier

    monitor = cfg.callbacks.get("pin_callback", {}).get("monitor") or {}
    if monitor.get("accuracy") is not True:
        return False  # no tracking, or a torchmetrics Metric of the user's choice
    classifier = built is None or isinstance(built.model, Classifier)
    return not (classifier and cfg.metric == "val_acc" and cfg.metric_mode == "max")


def metric_callbacks(cfg: DictConfig, built: BuiltModel, pin_callback: Optional[PinCallback]) -> list[pl.Callback]:
    """The :class:`~lightning_pin.app.metric.LoggedMetric` of a fit, when the tracked metric is a logged one."""
    if not tracks_logged_metric(cfg, built):
        return []
    monitor = getattr(pin_callback, "monitor", None)
    return [LoggedMetric(cfg.metric, built.target, monitor if isinstance(monitor, LoggedMetricMonitor) else None)]


def build_trainer(cfg: DictConfig, phase: str, callbacks: list[pl.Callback], **overrides: Any) -> pl.Trainer:
    """A Trainer from ``cfg.trainer`` for one phase (``pretrain`` / ``pinned``), logging to its own version."""
    make = instantiate(cfg.trainer, _partial_=True, _convert_="all")
    loggers = build_loggers(cfg, phase)
    # A Trainer announces the hardware and a cloud-logging tip when it is built; the app builds
    # two, and its own summary says what ran. Warnings still show.
    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    lightning_log.setLevel(logging.WARNING)
    if any(isinstance(callback, Checkpoint) for callback in callbacks):
        # conf/trainer turns Lightning's implicit ModelCheckpoint off; a checkpoint callback the
        # callbacks group adds (callbacks=checkpoints) needs checkpointing on.
        overrides.setdefault("enable_checkpointing", True)
    try:
        return make(callbacks=callbacks, logger=loggers, **overrides)
    finally:
        lightning_log.setLevel(level)


def build_loggers(cfg: DictConfig, phase: str) -> list[Logger]:
    loggers = []
    for node in cfg.logger.values():
        # Each phase logs into its own version directory (csv/pretrain, csv/pinned), so the report
        # rebuilt from the newest metrics.csv is the pinned retraining's.
        accepts_version = "version" in inspect.signature(get_class(node._target_)).parameters
        extra = {"version": phase} if accepts_version else {}
        loggers.append(instantiate(node, _partial_=True, _convert_="all")(**extra))
    return loggers


def check_lengths(cfg: DictConfig) -> None:
    """Refuse fits that would never end or never train, before anything is built.

    Lightning reads ``max_epochs=-1`` as "no limit": with no ``max_steps`` the app would retrain for
    ever. ``max_epochs=0`` (or ``max_steps=0``) retrains nothing, so no pin would ever be applied.

    Raises:
        ValueError: naming the key and what would be right.
    """
    epochs, steps = cfg.trainer.max_epochs, cfg.trainer.get("max_steps", -1)
    if steps == 0:
        # Lightning stops a fit with max_steps=0 before its first step, whatever max_epochs says.
        raise ValueError("trainer.max_steps=0 retrains nothing: give trainer.max_steps=1 or more, or -1 for no step "
                         "limit (then trainer.max_epochs bounds the retraining)")
    if (epochs is None or epochs < 1) and not (steps is not None and steps > 0):
        raise ValueError(
            f"trainer.max_epochs={epochs} "
            + ("retrains nothing" if epochs == 0 else "would retrain for ever (Lightning reads it as no limit)")
            + ": give the pinned retraining's length, trainer.max_epochs=1 or more (or trainer.max_steps=N)"
        )
    if cfg.pretrain.max_epochs is None or cfg.pretrain.max_epochs < 0:
        raise ValueError(
            f"pretrain.max_epochs={cfg.pretrain.max_epochs} would pretrain for ever: give 0 or more epochs "
            "(or ckpt_path=... to skip the pretraining)"
        )


def check_classes(model: pl.LightningModule, datamodule: pl.LightningDataModule) -> None:
    """Fail early, with the fix, when the model's outputs do not match the data's classes.

    Raises:
        ValueError: ``model.backbone.num_classes`` differs from ``datamodule.num_classes``.
    """
    model_classes = getattr(getattr(model, "backbone", None), "num_classes", None)
    data_classes = getattr(datamodule, "num_classes", None)
    if model_classes is not None and data_classes is not None and model_classes != data_classes:
        raise ValueError(
            f"the model predicts {model_classes} classes but the data has {data_classes}: "
            f"set model.backbone.num_classes={data_classes}"
        )


def load_weights(model: torch.nn.Module, ckpt_path: str) -> None:
    """Load the weights of a Lightning checkpoint, or of a bare state dict, into ``model``.

    Raises:
        FileNotFoundError: ``ckpt_path`` does not exist.
        ValueError: the file is not a checkpoint or state dict that loads with ``weights_only=True``.
        RuntimeError: its weights do not fit ``model`` (``load_state_dict`` names the keys).
    """
    try:
        checkpoint = load_checkpoint(ckpt_path)
    except TensorFileError as err:
        if err.reason == "missing":
            raise FileNotFoundError(
                f"ckpt_path={ckpt_path!r} does not exist (relative paths are taken from {Path.cwd()})"
            ) from err
        raise ValueError(f"ckpt_path={ckpt_path!r}: {err}") from err
    model.load_state_dict(checkpoint["state_dict"])


def save_pinned(what: str, trainer: pl.Trainer, pin_callback: PinCallback, model: torch.nn.Module,
                output_dir: Path) -> None:
    """Save the pinned model: ``full``, Lightning's ``pinned.ckpt``; ``weights``, ``pinned.safetensors`` (the
    state dict: no optimizer state, a quarter of an AdamW checkpoint) and ``pins.pt`` (the pin state, the targets
    every pinned element holds), so that ``lightning-pin check pins.pt pinned.safetensors`` verifies the weights."""
    if what == "full":
        trainer.save_checkpoint(output_dir / PINNED_CKPT, weights_only=False)
        return
    from safetensors.torch import save_file

    if trainer.is_global_zero:
        # Tied parameters share storage, which safetensors refuses: each name gets its own copy.
        weights = {name: t.detach().cpu().contiguous().clone() for name, t in model.state_dict().items()}
        save_file(weights, str(output_dir / PINNED_WEIGHTS))
        torch.save(pin_callback.state_dict(), output_dir / PIN_STATE)


# ----------------------------------------------------------------------------------------------
# The summary


def pin_report(pin_callback: PinCallback, output_dir: Path) -> dict[str, Any]:
    """The report PinMonitor made: in this process, or the file its rank 0 wrote (ddp_spawn)."""
    monitor = pin_callback.monitor
    if monitor is not None and monitor.final is not None:
        return monitor.results()
    report_dir = Path(monitor.report_dir) if monitor is not None and monitor.report_dir else output_dir
    if (report_dir / REPORT_JSON).exists():
        return json.loads((report_dir / REPORT_JSON).read_text())
    return monitor.results() if monitor is not None else {}


def make_summary(
    cfg: DictConfig, report: dict[str, Any], output_dir: Path, seconds: float, built: Optional[BuiltModel] = None
) -> dict[str, Any]:
    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
    multirun = hydra_cfg is not None and hydra_cfg.mode == RunMode.MULTIRUN
    choices = dict(hydra_cfg.runtime.choices) if hydra_cfg is not None else {}
    targets = run_targets(cfg, built)
    groups: tuple[str, ...] = ("data", "model", "optimizer", "pin", "trainer", "experiment")
    if built is not None and built.custom:
        # A model of your own: the summary names what ran (the class, not the option "custom").
        choices["model"] = targets["model"]
        choices.setdefault("optimizer", targets["optimizer"])  # composed without Hydra's choices (tune)
        groups = ("model", "data", "optimizer", "pin", "trainer", "experiment")
    if not is_app_data(cfg):
        choices["data"] = targets["data"]
    if targets["optimizer"] == OWN_OPTIMIZER:
        choices["optimizer"] = OWN_OPTIMIZER
    keys = (
        "metric",
        "tolerance",
        "baseline",
        "forced",
        "final",
        "gap",
        "recovered_step",
        "pinned_elements",
        "trainable_elements",
        "violations",
        "pin_drift_max",
        "weight_drift",
        "weight_drift_relative",
        "steps",
    )
    fault = {key: _plain(cfg.pin.get(key)) for key in ("kind", "rate", "seed", "params")} if "rate" in cfg.pin else None
    return {
        "job": int(hydra_cfg.job.num) if multirun else None,
        "fault": fault,
        "overrides": list(hydra_cfg.overrides.task) if hydra_cfg is not None else [],
        "tags": list(cfg.tags),
        "choices": {g: choices.get(g) for g in groups},
        # What was built: the model's and the data's classes, the optimizer (or the model's own).
        "targets": targets,
        **{key: report.get(key) for key in keys},
        # From this step on, every measured value stayed within the tolerance (None: ended outside).
        "settled_step": settled_step(report) if report.get("history") else None,
        # verify() raised otherwise: every pinned element equals its target (torch.equal).
        "pins_exact": True,
        "seconds": round(seconds, 1),
        "output_dir": str(output_dir),
        "files": [n for n in (REPORT_JSON, REPORT_PNG, PRETRAINED_CKPT, PINNED_CKPT, PINNED_WEIGHTS, PIN_STATE)
                  if (output_dir / n).exists()],
    }


def run_targets(cfg: DictConfig, built: Optional[BuiltModel]) -> dict[str, Any]:
    """The targets of the run (``run_summary.json``'s ``targets``): what the model, data and optimizer were."""
    return {
        "model": built.target if built is not None else str(cfg.model.get("_target_")),
        "model_kind": built.kind if built is not None else None,
        "data": data_target(cfg),
        "optimizer": built.optimizer if built is not None else str(cfg.optimizer.get("_target_")),
        "metric": cfg.get("metric", "val_acc"),
        "metric_mode": cfg.get("metric_mode", "max"),
    }


def print_summary(summary: dict[str, Any]) -> None:
    choices = " ".join(f"{group}={choice}" for group, choice in summary["choices"].items() if choice)
    trainable = summary.get("trainable_elements")
    of_trainable = f" of {trainable:,} trainable elements" if trainable else ""
    lines = [f"lightning-pin: {choices or 'run'}", f"  pinned    {summary['pinned_elements'] or 0:,}{of_trainable}"]
    if summary.get("baseline") is not None:
        # The app's classifier: "accuracy"; a metric your model logs: its name (val_loss, val/f1).
        label = "accuracy" if summary.get("metric") in (None, "accuracy") else summary["metric"]
        lines.append(
            f"  {label:<8}  baseline {_fmt(summary['baseline'])}  forced {_fmt(summary['forced'])}  "
            f"final {_fmt(summary['final'])}  (gap to baseline {summary['gap']:+.3f}, {_recovery(summary)})"
        )
    if summary.get("outcome"):
        chance = f" (guessing scores {summary['chance']:.3f})" if summary.get("chance") is not None else ""
        why = ("the final accuracy is no better than guessing" + chance if summary["outcome"] == "at chance" else
               "a loss, metric or free weight that is not finite, or an end worse than before retraining")
        lines.append(f"  outcome   {summary['outcome'].upper()}: {why}; the gap above is a failed run, not the "
                     "cost of the pins alone")
    if summary.get("pinned_elements"):
        lines.append(
            "  pins      exact: verified with torch.equal on every pinned element; "
            f"{summary['violations']} violations logged"
        )
    if summary.get("output_pins"):
        lines.append(f"  outputs   {summary['output_pins']} pin(s) on module outputs (stuck neurons), held in every "
                     "forward by their hooks")
        lines += [f"            {line}" for line in summary.get("output_pin_modules", [])[:8]]
    if not summary.get("pinned_elements") and not summary.get("output_pins"):
        lines.append("  pins      nothing pinned (no pin selects an element): nothing to verify")
    drift = []
    if summary.get("pin_drift_max") is not None:
        drift.append(f"pinned elements moved up to {summary['pin_drift_max']:.3g} by a step, before the restore")
    if summary.get("weight_drift") is not None:
        relative = summary.get("weight_drift_relative") or 0.0
        drift.append(f"free weights moved {summary['weight_drift']:.3g} (L2, {100 * relative:.1f}% of their norm)")
    if drift:
        lines.append("  drift     " + "; ".join(drift))
    files = ", ".join(summary["files"] + [RUN_SUMMARY])
    lines.append(f"  run dir   {summary['output_dir']}: {files} (ran in {summary['seconds']:.0f} s)")
    print("\n".join(lines), flush=True)


def _recovery(summary: dict[str, Any]) -> str:
    """What "within the tolerance" can truly say of the whole history (see ``settled_step``)."""
    tolerance, recovered, settled = summary["tolerance"], summary.get("recovered_step"), summary.get("settled_step")
    if recovered is None:
        return f"never within {tolerance:g}"
    if settled is None:
        return f"within {tolerance:g} at step {recovered}, then left it: ended outside"
    return f"within {tolerance:g} from step {settled}"


#: An accuracy this close to guessing (or below it) is "at chance", whatever the tolerance.
AT_CHANCE = 0.02


def outcome(summary: dict[str, Any], higher_is_better: bool = True, chance: Optional[float] = None) -> Optional[str]:
    """How retraining failed outright, if it did: ``"diverged"`` or ``"at chance"``; None when it did not.

    "diverged": a non-finite training loss, final metric or free-weight drift (the free weights blew up), or an
    end worse than not retraining at all (the final metric more than the tolerance below the forced one).
    "at chance" (given ``chance``, the accuracy of guessing): a final accuracy within ``max(AT_CHANCE, tolerance)``
    of guessing, or below it. SGD with momentum can blow up (NaN) or collapse to predicting one class around large
    stuck values; a run or study should say so rather than report a low accuracy as if it were the faults' cost.
    The one rule of ``lightning-pin train``'s summary and of the ``faults`` study's ``diverged`` column.

    Example::

        >>> outcome({"train_loss": 2.3, "forced": 0.09, "final": 0.11, "tolerance": 0.01}, chance=0.1)
        'at chance'
        >>> outcome({"train_loss": 0.3, "forced": 0.5, "final": 0.9, "weight_drift": float("inf")})
        'diverged'
    """
    loss, final, forced = summary.get("train_loss"), summary.get("final"), summary.get("forced")
    drift = summary.get("weight_drift")
    if any(value is not None and not math.isfinite(value) for value in (loss, final, drift)):
        return "diverged"
    if final is None:
        return None
    tolerance = summary.get("tolerance") or 0.0
    if chance is not None and final <= chance + max(AT_CHANCE, tolerance):
        return "at chance"
    if forced is None:
        return None
    worse = final < forced - tolerance if higher_is_better else final > forced + tolerance
    return "diverged" if worse else None


def diverged(summary: dict[str, Any], higher_is_better: bool = True, chance: Optional[float] = None) -> bool:
    """Whether retraining failed outright (:func:`outcome` is not None): the study's ``diverged`` column."""
    return outcome(summary, higher_is_better, chance) is not None


def _last_loss(trainer: pl.Trainer) -> Optional[float]:
    loss = trainer.callback_metrics.get("train_loss")
    return None if loss is None else float(loss)


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
