"""The Lightning layer: :class:`PinCallback` (a thin adapter over the core engine) and
:class:`PinMonitor` with its torchmetrics metrics. The only package that imports Lightning."""

from lightning_pin.callbacks.monitor import PinMonitor
from lightning_pin.callbacks.pin_callback import PinCallback
from lightning_pin.callbacks.recovery import DistillFromBaseline, StopWhenRecovered, distillation_loss

__all__ = ["DistillFromBaseline", "PinCallback", "PinMonitor", "StopWhenRecovered", "distillation_loss"]
