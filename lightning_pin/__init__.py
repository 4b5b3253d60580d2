"""lightning-pin: pin chosen parameters, whole tensors or single elements, to exact values while
the rest of the network trains.

``from lightning_pin import pin, Pin, PinError`` imports torch only: the Lightning layer
(:class:`PinCallback`, :class:`PinMonitor`) loads on first use.
"""

from importlib import import_module as _import_module
from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from lightning_pin.core.errors import AccuracyGapError, PinError
from lightning_pin.core.handle import PinHandle, pin
from lightning_pin.core.kinds.neuron import NeuronPin
from lightning_pin.core.kinds.quant_code import QuantCode
from lightning_pin.core.spec import Pin

if _TYPE_CHECKING:
    from lightning_pin.callbacks import PinCallback, PinMonitor

try:
    __version__ = _version("lightning-pin")
except _PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0"

_LIGHTNING_LAYER = {"PinCallback": "lightning_pin.callbacks", "PinMonitor": "lightning_pin.callbacks"}

__all__ = [
    "AccuracyGapError", "NeuronPin", "Pin", "PinCallback", "PinError", "PinHandle", "PinMonitor", "QuantCode", "pin",
]


def __getattr__(name: str) -> _Any:
    if name in _LIGHTNING_LAYER:
        return getattr(_import_module(_LIGHTNING_LAYER[name]), name)
    raise AttributeError(f"module 'lightning_pin' has no attribute {name!r}")
