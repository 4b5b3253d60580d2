"""lightning-pin: pin chosen parameters, whole tensors or single elements, to exact values while
the rest of the network trains."""

from lightning_pin.callback import PinCallback
from lightning_pin.errors import AccuracyGapError, PinError
from lightning_pin.monitor import PinMonitor
from lightning_pin.spec import Pin

__all__ = ["AccuracyGapError", "Pin", "PinCallback", "PinError", "PinMonitor"]
__version__ = "0.1.0"
