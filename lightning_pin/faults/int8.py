"""Weights stored as int8 codes by a runtime (``torchao``'s ``Int8Tensor``): their codes, their :class:`QuantCode`.

A model quantized with ``torchao.quantization.quantize_(model, Int8WeightOnlyConfig())`` keeps
each quantized weight as a tensor subclass whose ``qdata`` holds the int8 codes and ``scale`` (and
``zero_point``) their scales. The fault tools read and write those codes (bits 0-7), never the
scales. Nothing here imports torchao: a stored int8 weight is recognized by what it holds.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_pin.core.errors import PinError
from lightning_pin.core.kinds.quant_code import QuantCode

__all__ = ["int8_codes", "is_int8_weight", "stored_code"]


def is_int8_weight(tensor: Any) -> bool:
    """Whether ``tensor`` is a weight stored as int8 codes (a torchao ``Int8Tensor``: ``qdata`` int8 and ``scale``).

    Example::

        >>> import torch
        >>> is_int8_weight(torch.zeros(2))
        False
    """
    qdata = getattr(tensor, "qdata", None)
    scale = getattr(tensor, "scale", None)
    return isinstance(qdata, Tensor) and qdata.dtype == torch.int8 and isinstance(scale, Tensor)


def int8_codes(tensor: Any, name: str = "") -> Optional[Tensor]:
    """The stored int8 codes (``qdata``, flat, a view: writes land in the model) of an int8 weight; None otherwise.

    Raises:
        PinError: the codes are not contiguous (they cannot be written in place).
    """
    if not is_int8_weight(tensor):
        return None
    qdata = tensor.qdata
    if not qdata.is_contiguous():
        raise PinError(f"{name!r}: its int8 codes are not contiguous, so they cannot be written in place")
    return qdata.detach().view(-1)


def _axis_and_scale(values: Tensor, shape: tuple[int, ...]) -> tuple[Optional[int], Tensor]:
    """The one axis a per-block tensor of ``shape`` varies along (None: one entry), and its entries along it."""
    flat = values.detach().reshape(-1)
    if flat.numel() == 1 or bool((flat == flat[0]).all()):
        return None, flat[:1]
    spread = [d for d, size in enumerate(values.shape) if size > 1]
    if len(spread) != 1 or values.shape[spread[0]] != shape[spread[0]]:
        raise PinError(f"a scale of shape {tuple(values.shape)} for a weight of shape {shape}: lightning-pin reads "
                       "per-tensor and per-channel (one axis) int8 scales, not per-group ones")
    return spread[0], flat


def stored_code(tensor: Any, name: str = "") -> QuantCode:
    """The :class:`QuantCode` of an int8 weight: 8 signed bits, its scales (per tensor or along one axis), zero point.

    Raises:
        PinError: a per-group scale, or zero points that differ between channels.
    """
    if not is_int8_weight(tensor):
        raise PinError(f"{name!r} is not stored as int8 codes")
    shape = tuple(tensor.qdata.shape)
    try:
        axis, scale = _axis_and_scale(tensor.scale.float(), shape)
    except PinError as error:
        raise PinError(f"{name!r}: {error}") from None
    zero_point = 0
    zp = getattr(tensor, "zero_point", None)
    if isinstance(zp, Tensor) and zp.numel():
        flat = zp.detach().reshape(-1).to(torch.int64)
        if not bool((flat == flat[0]).all()):
            raise PinError(f"{name!r}: its int8 zero points differ between channels; lightning-pin reads one "
                           "zero point per weight")
        zero_point = int(flat[0])
    value: Any = float(scale[0]) if axis is None else scale.to(torch.float32)
    return QuantCode(bits=8, scale=value, zero_point=zero_point, axis=axis, signed=True)
