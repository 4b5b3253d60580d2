"""PinMonitor: what :class:`~lightning_pin.PinCallback` measures, logs and reports.

The callback's hooks call the monitor's methods of the same names; the monitor decides what to
measure and when, feeds the metrics of :mod:`lightning_pin.callbacks.metrics`, logs them through the
trainer's loggers under ``pin/...`` and writes the report of :mod:`lightning_pin.reporting.report`.

What it costs: pin drift and violations read the pinned elements once on logging steps (every
``trainer.log_every_n_steps``); the default monitor keeps no copy of the weights. Weight drift
(opt-in) reads every trainable weight on those steps and keeps one copy of them from fit start.
Between logging steps nothing is measured and nothing is synced
with the host. Accuracy tracking costs two passes over the validation data at train start (before
and after forcing the pins), one forward per validation batch, and one pass at the end when
training stopped after the last validation.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from torchmetrics import Metric
from torchmetrics.classification import BinaryAccuracy, MulticlassAccuracy

from lightning_pin.callbacks._compat import setup_validation_data
from lightning_pin.batches import default_predict
from lightning_pin.reporting import report as reporting
from lightning_pin.reporting.preservation import Preservation
from lightning_pin.core.engine import PinEngine, StepStats
from lightning_pin.core.errors import AccuracyGapError, PinError
from lightning_pin.callbacks.metrics import (
    FreeWeights,
    PinDrift,
    PinViolations,
    WeightDrift,
    count_off_target,
    pinned_indices,
)

__all__ = ["PREFIX", "PinMonitor", "Predict", "default_predict"]


PREFIX = reporting.PREFIX
Predict = Callable[[nn.Module, Any], tuple[Tensor, Tensor]]



class PinMonitor:
    r"""Measure, log and report what pinning does to training: pin drift, weight drift, accuracy.

    Give it to :class:`~lightning_pin.PinCallback` (``PinCallback(pins, monitor=PinMonitor(...))``;
    the callback uses ``PinMonitor()`` by default). Through the trainer's loggers (CSV,
    TensorBoard, ...), on every ``trainer.log_every_n_steps``-th optimizer step, it logs:

    - ``pin/drift_max``, ``pin/drift_mean``: how far that step's update moved the pinned elements
      before the restore wrote them back: how hard training pushes against the pins;
    - ``pin/violations``: pinned elements off target, before the step's forward (anything that
      wrote to them since the last restore) and right after its restore. It must stay 0;
    - with ``weight_drift=True``: ``pin/weight_drift``, ``pin/weight_drift_relative``,
      ``pin/weight_drift/<module>``: L2 distance of the free weights (trainable, never pinned)
      from their values at train start (after a resume: at the resume), in total, relative to
      their norm, and per top-level module.

    With ``accuracy`` it also tracks whether a quality metric is preserved, on the validation data
    (``trainer.val_dataloaders``), with the model in eval mode: ``pin/<name>_baseline`` before any
    pin is forced, ``pin/<name>_forced`` right after forcing the pins of the first step without
    training, then ``pin/<name>`` and ``pin/<name>_gap`` after every validation and at the end.
    The gap is how much worse than the baseline the value is (positive: worse); the metric has
    recovered at the first step where the gap is within ``tolerance``. The pins of the first step
    are therefore forced in ``on_train_start`` rather than in the first ``on_train_batch_start``,
    which changes nothing else: no weight moves in between.

    At the end of training it writes ``pin_report.json`` and ``pin_report.png`` into
    ``report_dir`` (default: the first logger's directory; no logger, no files) and prints the
    report as a table. ``lightning-pin report RUN_DIR`` rebuilds them from a ``CSVLogger``'s
    ``metrics.csv``.

    Args:
        drift: Log pin drift and violations.
        weight_drift: Log weight drift (off by default). It costs a copy of every trainable weight
            from train start, on its device (the model's weight memory once more: a 25M-parameter
            float32 model holds 100 MB more), and a pass over them on logging steps. The other
            metrics need only the pinned elements.
        accuracy: ``False``: no accuracy tracking. ``True``: top-1 accuracy (``MulticlassAccuracy``
            with ``average="micro"``, classes read from the model's output; ``BinaryAccuracy`` for
            one output). Or any torchmetrics ``Metric`` that returns one number, such as
            ``MulticlassAccuracy(num_classes=10, top_k=3)``, ``MulticlassF1Score(num_classes=10)`` or
            ``MeanSquaredError()``.
        name: The metric's name in logs and the report (default: ``"accuracy"`` for ``True``,
            otherwise the metric's class name).
        tolerance: The largest gap that counts as recovered, in the metric's units (0.01 is one
            accuracy point).
        higher_is_better: Direction of the metric (default: the metric's own ``higher_is_better``).
        max_gap: Guard: when, at a validation of epoch ``max_gap_from_epoch`` or later, the gap
            exceeds this, stop training (``on_max_gap="stop"``) or raise
            :class:`~lightning_pin.core.errors.AccuracyGapError` (``"raise"``). ``None``: no guard.
        max_gap_from_epoch: First epoch (0-based) whose validations the guard checks.
        on_max_gap: ``"stop"`` or ``"raise"``.
        predict: ``callable(module, batch) -> (preds, target)`` (or its import path) for batches
            the default does not understand. The default takes ``(x, y)`` sequences and mappings
            with keys such as ``"x"`` / ``"y"`` or ``"input"`` / ``"target"``, calls ``module(x)``,
            and takes ``.logits`` of outputs that have it. A ``validation_step`` that returns a
            mapping with ``"preds"`` and ``"target"`` spares the extra forward during validation.
        dataloader_idx: Which validation dataloader to track.
        report: Write the report files and print the table at the end of training.
        report_dir: Where to write the report (default: the first logger's ``log_dir``).
        baseline: The baseline when it is already known, not measured again: many fits that start from one
            model (the jobs of a fault study) share one measurement of it. ``None``: measured at train start.

    Raises:
        PinError: When built, for an ``accuracy`` that is neither a bool nor a torchmetrics
            ``Metric``, an unknown ``on_max_gap``, a negative or non-finite ``max_gap`` or
            ``tolerance``, or a ``predict`` path that cannot be imported. While measuring, for a
            batch the default ``predict`` cannot split, or a metric that computes more than one
            number.
        AccuracyGapError: With ``on_max_gap="raise"``, when the gap exceeds ``max_gap``.

    Example::

        >>> from torchmetrics.classification import MulticlassAccuracy
        >>> from lightning_pin import Pin, PinCallback, PinMonitor
        >>> monitor = PinMonitor(accuracy=MulticlassAccuracy(num_classes=10, average="micro"), tolerance=0.01,
        ...                      max_gap=0.05, max_gap_from_epoch=3)
        >>> callback = PinCallback([Pin("backbone.features.0.weight", fraction=0.05, value=0.0)], monitor=monitor)
        >>> monitor.name, monitor.preservation.higher_is_better
        ('MulticlassAccuracy', True)
    """

    def __init__(
        self,
        drift: bool = True,
        weight_drift: bool = False,
        accuracy: Union[bool, Metric] = False,
        name: Optional[str] = None,
        tolerance: float = 0.01,
        higher_is_better: Optional[bool] = None,
        max_gap: Optional[float] = None,
        max_gap_from_epoch: int = 0,
        on_max_gap: Literal["stop", "raise"] = "stop",
        predict: Optional[Union[Predict, str]] = None,
        dataloader_idx: int = 0,
        report: bool = True,
        report_dir: Optional[str] = None,
        baseline: Optional[float] = None,
    ) -> None:
        if not (accuracy is True or accuracy is False or accuracy is None or isinstance(accuracy, Metric)):
            raise PinError(f"accuracy must be True, False or a torchmetrics Metric, got {type(accuracy).__name__}")
        if on_max_gap not in ("stop", "raise"):
            raise PinError(f"on_max_gap must be 'stop' or 'raise', got {on_max_gap!r}")
        if max_gap is not None and not (max_gap >= 0 and math.isfinite(max_gap)):
            raise PinError(f"max_gap must be None or a finite number >= 0, got {max_gap!r}")
        if not (tolerance >= 0 and math.isfinite(tolerance)):
            raise PinError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
        self.drift = drift
        self.weight_drift = weight_drift
        self.metric: Optional[Metric] = accuracy if isinstance(accuracy, Metric) else None
        self.tracks_accuracy = bool(accuracy)
        if name is None:
            name = type(self.metric).__name__ if self.metric is not None else "accuracy"
        #: The tracked metric's name in logs (``pin/<name>``) and in the report.
        self.name = name
        if higher_is_better is None:
            higher_is_better = getattr(self.metric, "higher_is_better", None)
        self.higher_is_better = True if higher_is_better is None else bool(higher_is_better)
        self.tolerance = float(tolerance)
        self.max_gap = max_gap
        self.max_gap_from_epoch = max_gap_from_epoch
        self.on_max_gap = on_max_gap
        self.predict: Predict = _import(predict) if isinstance(predict, str) else (predict or default_predict)
        self.dataloader_idx = dataloader_idx
        self.report = report
        self.report_dir = report_dir
        if baseline is not None and not math.isfinite(baseline):
            raise PinError(f"baseline must be None or a finite number, got {baseline!r}")
        #: The given baseline (None: measured at train start).
        self.known_baseline = None if baseline is None else float(baseline)
        self._reset()

    def _reset(self) -> None:
        #: Baseline, forced and current values of the tracked metric (None without accuracy).
        self.preservation: Optional[Preservation] = (
            Preservation(self.higher_is_better, self.tolerance) if self.tracks_accuracy else None
        )
        #: Logged rows: ``pin_drift``: [step, max, mean, violations]; ``weight_drift``: [step, total,
        #: relative, one value per module of :attr:`modules`].
        self.history: dict[str, list[list[float]]] = {"pin_drift": [], "weight_drift": []}
        #: The top-level modules whose weight drift is logged.
        self.modules: list[str] = []
        self.pinned_elements = 0
        self.trainable_elements = 0
        self._engine: Optional[PinEngine] = None
        self._restore_hook: Optional[RemovableHandle] = None
        self._pin_drift = PinDrift()
        self._violations = PinViolations()
        self._free: Optional[FreeWeights] = None
        self._weight_metric: Optional[WeightDrift] = None
        self._measuring = False
        self._batch_start_step = -1
        self._counted_step = -1
        self._report_dir: Optional[str] = None
        self._tracking = False
        self._baseline: Optional[float] = None  # measured before forcing, recorded after

    # ------------------------------------------------------------------------------------------
    # Set-up

    def setup(self, trainer: pl.Trainer, module: pl.LightningModule, engine: PinEngine) -> None:
        """Start afresh for a fit (call from ``on_fit_start``, before :meth:`load_state_dict`) and
        observe the engine's restores (measured on logging steps only)."""
        self._reset()
        self._engine = engine
        if engine.plan.pins:
            self._restore_hook = engine.register_restore_hook(self._after_restore, wants_stats=self._wants_stats)
        self._pin_drift.to(module.device)
        self._violations.to(module.device)
        if self.metric is not None:
            self.metric.reset()  # nothing left over from an earlier fit
            self.metric.to(module.device)
        self.pinned_elements = sum(engine.plan.pinned_counts().values())
        self.trainable_elements = engine.plan.trainable_elements

    def before_force(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Measure the baseline: the tracked metric before any pin is forced (``on_train_start``)."""
        self._report_dir = self._resolve_report_dir(trainer)
        self._baseline = None
        if self.preservation is None or self.preservation.baseline is not None or trainer.global_step > 0:
            return
        if self.known_baseline is not None:
            self._baseline = self.known_baseline
            return
        loader, limit = self._val_loader(trainer)
        if loader is None:
            rank_zero_warn(f"PinMonitor: no validation data (trainer.val_dataloaders), so {self.name} is not tracked")
            return
        with _own_random_stream():
            self._baseline = self._evaluate(trainer, module, loader, limit)

    def after_force(self, trainer: pl.Trainer, module: pl.LightningModule, engine: PinEngine) -> None:
        """Measure the forced value (pins set, no training), snapshot the free weights, log."""
        step = trainer.global_step
        logged: dict[str, float] = {
            f"{PREFIX}pinned_elements": float(self.pinned_elements),
            f"{PREFIX}trainable_elements": float(self.trainable_elements),
        }
        if self.preservation is not None:
            if self.preservation.baseline is not None:
                self._tracking = True  # resumed with its saved baseline
            elif step > 0:
                rank_zero_info(
                    f"PinMonitor: resumed at step {step} without a saved baseline; {self.name} is not tracked"
                )
            elif self._baseline is not None:
                logged.update(self._measure_forced(trainer, module, self._baseline))
        if self.weight_drift and any(type(p).__name__ == "DTensor" for p in module.parameters()):
            # A sharded parameter's distance needs its shard's share of the pins: not measured yet.
            rank_zero_info("PinMonitor: weight drift is not measured for sharded parameters (FSDP)")
        elif self.weight_drift:
            self._free = FreeWeights(module.named_parameters(), pinned_indices(engine.plan))
            self._weight_metric = WeightDrift(self._free.groups).to(module.device)
            # The reference is this fit's start (a resume starts afresh): the distance is 0 here.
            self.modules = list(self._free.groups)
            self.history["weight_drift"].append([step, 0.0, 0.0] + [0.0] * len(self.modules))
            logged[f"{PREFIX}weight_drift"] = logged[f"{PREFIX}weight_drift_relative"] = 0.0
            logged.update({f"{PREFIX}weight_drift/{m}": 0.0 for m in self.modules})
        _log(trainer, logged, step)
        self._write_report(trainer, plot=False)

    def _measure_forced(self, trainer: pl.Trainer, module: pl.LightningModule, baseline: float) -> dict[str, float]:
        step = trainer.global_step
        with _own_random_stream():
            forced = self._evaluate(trainer, module, *self._val_loader(trainer))
        self.preservation.baseline = baseline
        self.preservation.record(step, forced, forced=True)
        self._tracking = True
        return {
            f"{PREFIX}{self.name}_baseline": baseline,
            f"{PREFIX}{self.name}_forced": forced,
            f"{PREFIX}{self.name}": forced,
            f"{PREFIX}{self.name}_gap": self.preservation.gap(forced),
        }

    # ------------------------------------------------------------------------------------------
    # The step

    def on_train_batch_start(self, trainer: pl.Trainer, engine: PinEngine) -> None:
        """Decide whether this step is measured (a logging step); count tampering since the last restore."""
        step = trainer.global_step
        every = trainer.log_every_n_steps
        # The cadence of Lightning's own step logging: the batch that completes step k*every.
        self._measuring = every > 0 and (step + 1) % every == 0
        self._batch_start_step = step
        if not (self.drift and engine.plan.pins):
            return
        if self._measuring and self._counted_step != step:
            # Active pins are all on target here unless something wrote to them since the last
            # restore (another callback, user code). Counted once per step, not per micro-batch.
            self._counted_step = step
            self._violations.update(count_off_target(engine.projections()))

    def _wants_stats(self) -> bool:
        return self._measuring and self.drift

    def _after_restore(self, stats: Optional[StepStats]) -> None:
        """Feed the stats of a measured restore to the metrics (registered with the engine)."""
        if stats is not None:
            self._pin_drift.update(stats)
            self._violations.update(stats.violations)

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """On a logging step that took an optimizer step, compute and log the step metrics."""
        if not self._measuring or trainer.global_step == self._batch_start_step:
            return  # not a logging step, or a micro-batch that only accumulated gradients
        self._measuring = False
        self._log_step_metrics(trainer, trainer.global_step)

    def _log_step_metrics(self, trainer: pl.Trainer, step: int) -> None:
        values: dict[str, Tensor] = {}
        if self.drift and self._engine is not None and self._engine.plan.pins and self._pin_drift.update_count:
            drift = self._pin_drift.compute()
            values["drift_max"], values["drift_mean"] = drift["max"], drift["mean"]
            values["violations"] = self._violations.compute()
        self._pin_drift.reset()
        self._violations.reset()
        groups: list[str] = []
        if self._free is not None:
            self._weight_metric.update(self._free.squared_distances(), self._free.squared_reference)
            weights = self._weight_metric.compute()
            self._weight_metric.reset()
            values["weight_drift"], values["weight_drift_relative"] = weights["total"], weights["relative"]
            groups = self._free.groups
            values["weight_drift_groups"] = weights["groups"]
        if not values:
            return
        # One host sync for everything logged at this step.
        flat = torch.cat([v.detach().reshape(-1).to(torch.float64) for v in values.values()]).cpu().tolist()
        scalars: dict[str, float] = {}
        position = 0
        for key, value in values.items():
            count = value.numel()
            chunk = flat[position : position + count]
            position += count
            if key == "weight_drift_groups":
                scalars.update({f"{PREFIX}weight_drift/{g}": v for g, v in zip(groups, chunk)})
            else:
                scalars[f"{PREFIX}{key}"] = chunk[0]
        if f"{PREFIX}drift_max" in scalars:
            self.history["pin_drift"].append(
                [
                    step,
                    scalars[f"{PREFIX}drift_max"],
                    scalars[f"{PREFIX}drift_mean"],
                    int(scalars[f"{PREFIX}violations"]),
                ]
            )
        if f"{PREFIX}weight_drift" in scalars:
            self.modules = list(groups)
            self.history["weight_drift"].append(
                [step, scalars[f"{PREFIX}weight_drift"], scalars[f"{PREFIX}weight_drift_relative"]]
                + [scalars[f"{PREFIX}weight_drift/{g}"] for g in groups]
            )
        _log(trainer, scalars, step)

    # ------------------------------------------------------------------------------------------
    # Validation

    def _tracking_now(self, trainer: pl.Trainer) -> bool:
        return self._tracking and trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not self._tracking_now(trainer) or dataloader_idx != self.dataloader_idx:
            return
        if isinstance(outputs, Mapping) and "preds" in outputs and "target" in outputs:
            preds, target = outputs["preds"], outputs["target"]
        else:
            with torch.no_grad():
                preds, target = self.predict(module, batch)
        self._update_metric(preds, target)

    def on_validation_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if not self._tracking_now(trainer) or self.metric is None or not self.metric.update_count:
            return
        value = self._compute_metric()
        self._record(trainer, trainer.global_step, value)
        self._guard(trainer, value)

    def _record(self, trainer: pl.Trainer, step: int, value: float) -> None:
        self.preservation.record(step, value)
        _log(trainer, {f"{PREFIX}{self.name}": value, f"{PREFIX}{self.name}_gap": self.preservation.gap(value)}, step)

    def _guard(self, trainer: pl.Trainer, value: float) -> None:
        if self.max_gap is None or trainer.current_epoch < self.max_gap_from_epoch:
            return
        gap = self.preservation.gap(value)
        if gap is None or round(gap, 9) <= self.max_gap:
            return
        message = (
            f"PinMonitor: {self.name} is {value:.4f} after epoch {trainer.current_epoch}, {gap:.4f} worse than its "
            f"baseline {self.preservation.baseline:.4f}, more than max_gap={self.max_gap}"
        )
        if self.on_max_gap == "raise":
            raise AccuracyGapError(message)
        rank_zero_warn(message + ": stopping training")
        trainer.should_stop = True

    # ------------------------------------------------------------------------------------------
    # The end

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule, engine: PinEngine) -> None:
        """Measure the final value if training moved since the last validation; write the report."""
        step = trainer.global_step
        if self._tracking and self.preservation.last_step != step:
            loader, limit = self._val_loader(trainer)
            if loader is not None:
                self._record(trainer, step, self._evaluate(trainer, module, loader, limit))
        last_weights = self.history["weight_drift"][-1][0] if self.history["weight_drift"] else None
        if self._free is not None and last_weights != step and step > 0:
            self._log_step_metrics(trainer, step)
        self._write_report(trainer, plot=True, show=True)

    def teardown(self) -> None:
        """Release the weight snapshot and stop measuring."""
        self._free = None
        self._measuring = False
        if self._restore_hook is not None:
            self._restore_hook.remove()
            self._restore_hook = None

    def results(self) -> dict[str, Any]:
        """The report: the dict written as ``pin_report.json`` (see :func:`~lightning_pin.reporting.report.make_report`)."""
        p = self.preservation
        return reporting.make_report(
            metric=self.name if self._tracking else None,
            higher_is_better=self.higher_is_better,
            tolerance=self.tolerance,
            baseline=p.baseline if p else None,
            forced=p.forced if p else None,
            accuracy=p.history if (p and self._tracking) else [],
            pin_drift=self.history["pin_drift"],
            weight_drift=self.history["weight_drift"],
            modules=self.modules,
            pinned_elements=self.pinned_elements,
            trainable_elements=self.trainable_elements,
        )

    @property
    def baseline(self) -> Optional[float]:
        """The tracked metric before any pin was forced."""
        return self.preservation.baseline if self.preservation else None

    @property
    def forced(self) -> Optional[float]:
        """The tracked metric right after forcing the pins, before training."""
        return self.preservation.forced if self.preservation else None

    @property
    def final(self) -> Optional[float]:
        """The tracked metric at the last measurement (the end of training once fit is done)."""
        return self.preservation.final if self.preservation else None

    def _resolve_report_dir(self, trainer: pl.Trainer) -> Optional[str]:
        if not self.report:
            return None
        if self.report_dir is not None:
            return str(self.report_dir)
        # trainer.log_dir broadcasts from rank 0: every rank must ask.
        return trainer.log_dir if trainer.loggers else None

    def _write_report(self, trainer: pl.Trainer, plot: bool, show: bool = False) -> None:
        if self._report_dir is None or not trainer.is_global_zero:
            return
        report = self.results()
        paths = reporting.write_report(report, self._report_dir, plot=plot)
        if show:
            reporting.print_report(report, note=f"wrote {', '.join(str(p) for p in paths)}")

    # ------------------------------------------------------------------------------------------
    # Evaluation

    def _val_loader(self, trainer: pl.Trainer) -> tuple[Any, float]:
        setup_validation_data(trainer)
        loaders = trainer.val_dataloaders
        if loaders is None:
            return None, 0
        if isinstance(loaders, Mapping):
            loaders = list(loaders.values())
        if isinstance(loaders, (list, tuple)):
            if self.dataloader_idx >= len(loaders):
                return None, 0
            loaders = loaders[self.dataloader_idx]
        limits = trainer.num_val_batches
        limit = limits[self.dataloader_idx] if self.dataloader_idx < len(limits) else float("inf")
        return (loaders, limit) if limit else (None, 0)

    def _evaluate(self, trainer: pl.Trainer, module: pl.LightningModule, loader: Any, limit: float) -> float:
        """The tracked metric over ``loader`` (its first ``limit`` batches), the module in eval mode."""
        # Restore each submodule's own mode afterwards (a user may keep some in eval on purpose).
        modes = {m: m.training for m in module.modules()}
        module.eval()
        try:
            # Batches go through the precision plugin as in Lightning's own validation: with
            # "bf16-true" / "16-true" the inputs are cast to the weights' dtype.
            precision = trainer.precision_plugin
            with torch.no_grad(), precision.val_step_context():
                for batch_idx, batch in enumerate(loader):
                    if batch_idx >= limit:
                        break
                    batch = precision.convert_input(batch)
                    batch = trainer.strategy.batch_to_device(batch, dataloader_idx=self.dataloader_idx)
                    self._update_metric(*self.predict(module, batch))
        finally:
            for m, training in modes.items():
                m.training = training
        return self._compute_metric()

    def _update_metric(self, preds: Tensor, target: Tensor) -> None:
        if self.metric is None:
            self.metric = _default_accuracy(preds).to(preds.device)
        self.metric.update(preds, target)

    def _compute_metric(self) -> float:
        # compute() syncs the metric's state across processes: every rank reaches this together.
        value = self.metric.compute()
        self.metric.reset()
        if isinstance(value, Tensor) and value.numel() != 1:
            raise PinError(f"PinMonitor: {self.name} must compute one number, got shape {tuple(value.shape)}")
        return float(value)

    # ------------------------------------------------------------------------------------------
    # Checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Baseline, forced value, histories: lists, dicts and numbers only (``weights_only`` loads)."""
        return {
            "name": self.name,
            "preservation": self.preservation.state_dict() if self.preservation else None,
            "history": {k: [list(r) for r in v] for k, v in self.history.items()},
            "modules": list(self.modules),
        }

    def load_state_dict(self, state: Optional[Mapping[str, Any]]) -> None:
        if not state:
            return
        if self.preservation is not None and state.get("preservation") and state.get("name") == self.name:
            self.preservation.load_state_dict(state["preservation"])
        for key, rows in state.get("history", {}).items():
            self.history[key] = [list(r) for r in rows]
        self.modules = list(state.get("modules", []))


def _own_random_stream() -> Any:
    """torch's CPU generator as it was, after the block: iterating a DataLoader draws its base seed from it, so
    without this a measurement at train start would shift every later shuffle, and a fit given its ``baseline``
    would train differently from one that measured it."""
    return torch.random.fork_rng(devices=[])


def _default_accuracy(preds: Tensor) -> Metric:
    if preds.ndim >= 2 and preds.shape[1] > 1:
        return MulticlassAccuracy(num_classes=preds.shape[1], average="micro")
    return BinaryAccuracy()


def _import(path: str) -> Predict:
    module_name, _, attr = path.replace(":", ".").rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise PinError(f"PinMonitor: cannot import predict={path!r}: {err}") from err
    if not callable(found):
        raise PinError(f"PinMonitor: predict={path!r} is not callable")
    return found


def _log(trainer: pl.Trainer, metrics: Mapping[str, Optional[float]], step: int) -> None:
    metrics = {k: v for k, v in metrics.items() if v is not None}
    if metrics:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
