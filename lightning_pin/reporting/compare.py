"""Bit-exact comparison of tensors, shared by ``lightning-pin diff`` and ``lightning-pin check``.

How a stored tensor is compared with a pin of each kind belongs to the kind
(:meth:`~lightning_pin.core.kinds.base.Kind.stored_off`); ``differs`` is the value kind's.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from lightning_pin.core.kinds.value import differs

__all__ = ["differs", "select"]


def select(tensor: Tensor, index: Optional[Tensor]) -> Tensor:
    """The elements at flat row-major ``index`` (every element when ``index`` is None)."""
    flat = tensor.reshape(-1)
    return flat if index is None else flat.index_select(0, index.long())
