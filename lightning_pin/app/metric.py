"""The app's tracked metric when it is a metric the model logs (``metric=val_f1 metric_mode=max``).

For the app's own classifier and ``metric=val_acc`` the :class:`~lightning_pin.PinMonitor` measures
top-1 accuracy itself (torchmetrics, over the whole validation set). Any other model or metric is
read from what the model logs in its validation:

- :class:`LoggedMetricMonitor` measures the baseline, the forced value and a final value the way
  Lightning's validation would: it runs the module's ``validation_step`` (and its validation epoch
  hooks) over the validation data and reduces what ``self.log`` received as Lightning does (a mean
  weighted by the batch size, or the ``reduce_fx`` given; a logged torchmetrics ``Metric`` is
  computed over the epoch);
- :class:`LoggedMetric`, a callback, records the value after every validation of the pinned
  retraining and ends the first validation of a model that logs no such metric with one line
  naming the metrics it did log.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torchmetrics import Metric
from typing_extensions import override

from lightning_pin.app.custom import ConfigError
from lightning_pin.batches import run_validation
from lightning_pin.callbacks.monitor import PinMonitor

__all__ = ["LoggedMetric", "LoggedMetricMonitor", "MODES", "check_mode", "missing_metric"]


MODES = ("max", "min")


def check_mode(metric: str, mode: str) -> None:
    """Raise ConfigError unless ``mode`` is ``max`` or ``min``."""
    if mode not in MODES:
        raise ConfigError(f"metric_mode={mode!r} (for metric={metric}): use max (higher is better) or min")


def missing_metric(metric: str, logged: Any, who: str) -> ConfigError:
    names = sorted(str(name) for name in logged if not str(name).startswith("pin/"))
    shown = ", ".join(names) if names else "nothing"
    return ConfigError(
        f"metric={metric}: {who} logs no such validation metric (it logged: {shown}): set metric= to one it logs "
        "(and metric_mode=max|min)"
    )


class LoggedMetricMonitor(PinMonitor):
    """A :class:`~lightning_pin.PinMonitor` whose tracked metric is one the model logs in validation.

    Args:
        metric: The logged name (``val_acc``, ``val_loss``, ``val/f1``).
        mode: ``max`` (higher is better) or ``min``.
        model_name: How the one-line error names the model.
        **kwargs: As :class:`~lightning_pin.PinMonitor` (``accuracy``, ``name`` and ``higher_is_better``
            are set from ``metric`` and ``mode``).

    Raises:
        ConfigError: ``mode`` is neither ``max`` nor ``min``; while measuring, the model logs no
            ``metric``.
    """

    def __init__(
        self, metric: str = "val_acc", mode: str = "max", model_name: str = "the model", **kwargs: Any
    ) -> None:
        check_mode(metric, mode)
        kwargs.update(accuracy=True, name=metric, higher_is_better=mode == "max")
        super().__init__(**kwargs)
        self.logged_metric = metric
        self.model_name = model_name

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        return None  # the value comes from the model's own logging (LoggedMetric), not from predictions

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        return None

    def record_logged(self, trainer: pl.Trainer, value: float) -> None:
        """Record the value the model logged in a validation of the pinned retraining."""
        if not self._tracking_now(trainer):
            return
        self._record(trainer, trainer.global_step, value)
        self._guard(trainer, value)

    @override
    def _evaluate(self, trainer: pl.Trainer, module: pl.LightningModule, loader: Any, limit: float) -> float:
        precision = trainer.precision_plugin

        def prepare(batch: Any) -> Any:
            batch = precision.convert_input(batch)
            return trainer.strategy.batch_to_device(batch, dataloader_idx=self.dataloader_idx)

        def batches() -> Any:
            for batch_idx, batch in enumerate(loader):
                if batch_idx >= limit:
                    return
                yield batch

        with precision.val_step_context():
            capture = run_validation(module, batches(), prepare)

        def reduce(value: torch.Tensor, op: str) -> torch.Tensor:
            if trainer.world_size <= 1:
                return value
            return trainer.strategy.reduce(value.clone(), reduce_op=op)

        value = capture.value(self.logged_metric, reduce)
        if value is None:
            raise missing_metric(self.logged_metric, capture.names(), self.model_name)
        return value


class LoggedMetric(Callback):
    """After every validation (sanity checks aside): the logged ``metric``, into the monitor's record.

    The first validation of a model that logs no ``metric`` raises :class:`ConfigError`, naming what it logged.
    """

    def __init__(self, metric: str, model_name: str, monitor: Optional[LoggedMetricMonitor] = None) -> None:
        self.metric = metric
        self.model_name = model_name
        self.monitor = monitor

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.metric)
        if value is None:
            raise missing_metric(self.metric, trainer.callback_metrics, self.model_name)
        if self.monitor is not None:
            self.monitor.record_logged(trainer, float(value))
