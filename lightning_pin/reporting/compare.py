"""Bit-exact comparison of tensors, shared by ``lightning-pin diff`` and ``lightning-pin check``.

How a stored tensor is compared with a pin of each kind belongs to the kind
(:meth:`~lightning_pin.core.kinds.base.Kind.stored_off`); ``differs`` is the value kind's.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_pin.core.kinds.value import differs

__all__ = ["bounds_off", "differs", "select", "stuck_bits_off"]


def select(tensor: Tensor, index: Optional[Tensor]) -> Tensor:
    """The elements at flat row-major ``index`` (every element when ``index`` is None)."""
    flat = tensor.reshape(-1)
    return flat if index is None else flat.index_select(0, index.long())


def stuck_bits_off(values: Tensor, zero: Tensor, one: Tensor) -> Optional[Tensor]:
    """Elements whose stuck bits do not read what they are stuck at (``bits & zero`` must be 0,
    ``bits & one`` must be ``one``), compared on the stored words; None when ``values`` are not
    words of the masks' width (an artifact that stores the parameter in another dtype)."""
    if not values.is_floating_point() or values.element_size() != zero.element_size():
        return None
    words = values.contiguous().view(zero.dtype)
    return ((words & zero) | (~words & one.to(zero.dtype))) != 0


def bounds_off(values: Tensor, low: Tensor, high: Tensor) -> Tensor:
    """Elements outside ``[low, high]`` (NaN is outside), compared by value in float64."""
    wide = values.to(torch.float64)
    return ~((wide >= low.to(torch.float64)) & (wide <= high.to(torch.float64)))
