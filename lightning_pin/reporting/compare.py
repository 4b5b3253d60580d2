"""Bit-exact comparison of tensors, shared by ``lightning-pin diff`` and ``lightning-pin check``."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def differs(ta: Tensor, tb: Tensor) -> Tensor:
    """Elements that differ bit for bit (so NaN equals NaN and -0.0 differs from 0.0).

    Tensors of different dtypes are compared by value in float64: a pinned 25.0 stored as
    float16 still equals 25.0, a 2.58e-8 that float16 flushes to zero does not.
    """
    if ta.dtype != tb.dtype:
        return ta.to(torch.float64) != tb.to(torch.float64)
    if ta.is_floating_point() and ta.element_size() in _SAME_WIDTH_INT:
        as_int = _SAME_WIDTH_INT[ta.element_size()]
        return ta.contiguous().view(as_int) != tb.contiguous().view(as_int)
    return ta != tb


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
