"""The selection types: what one pin selects in one parameter, live (:class:`Selection`, built by the
plan on a module) and saved (:class:`SavedSelection`, in the pin state and the files ``check`` and
``diff`` read).

Plain data that the kinds fill and read, so it sits below them: the kinds, the plan, the engine and
the state all import it, and it imports none of them (a payload field is read by name through
:mod:`~lightning_pin.core.registry`). ``lightning_pin.core.plan.Selection`` and
``lightning_pin.core.state.SavedSelection`` are these classes too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_pin.core.registry import DEFAULT_KIND, payload_field

__all__ = ["SavedSelection", "Selection"]


@dataclasses.dataclass
class Selection:
    """The elements one pin selects in one parameter, and their explicit targets."""

    name: str
    parameter: nn.Parameter
    #: Sorted, unique flat (row-major) element indices on the parameter's device: int32 when the
    #: parameter has fewer than 2**31 elements, else int64.
    #: ``None`` selects the whole tensor.
    index: Tensor | None
    #: Explicit targets in the parameter's dtype and device: one per element of ``index``, or
    #: of the parameter's shape when ``index`` is None. ``None``: captured when the pin activates.
    values: Tensor | None
    #: How the elements were chosen, for the summary ("indices", "mask", "fraction 0.05", "whole").
    how: str
    #: The name of the kind that holds the elements (see :mod:`lightning_pin.core.kinds`).
    kind: str = DEFAULT_KIND
    #: The kind's per-element tensors by field (its ``payload_fields``: ``stuck_at_zero`` /
    #: ``stuck_at_one`` masks, ``low`` / ``high`` bounds), one entry per element of ``index`` or
    #: of the parameter's shape, on the parameter's device. Empty for value pins (``values``).
    payload: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    #: Tensors of the module the kind reads at every restore (a quantized code's learned scale):
    #: live references, never saved or fingerprinted (see ``Kind.resolve``).
    context: dict[str, Tensor] = dataclasses.field(default_factory=dict)

    def __getattr__(self, field: str) -> Any:
        return payload_field(self, field)  # a payload field by name (``selection.low``), or None

    @property
    def count(self) -> int:
        return self.parameter.numel() if self.index is None else int(self.index.numel())


@dataclasses.dataclass(frozen=True, init=False)
class SavedSelection:
    """What one pin selects in one parameter, and the targets it holds there.

    The kind's per-element tensors are in ``payload`` and read as attributes too
    (``saved.stuck_at_zero``, ``saved.low``); they may be given by keyword when building one.

    Example::

        >>> bounds = SavedSelection(None, None, True, "bounds", low=torch.zeros(2), high=torch.ones(2))
        >>> bounds.high
        tensor([1., 1.])
    """

    #: Sorted flat row-major indices (int32 or int64), or None for the whole tensor.
    index: Optional[Tensor]
    #: One value per index (the parameter's shape for a whole tensor); None for a ``value=None``
    #: pin that never activated.
    target: Optional[Tensor]
    #: Whether the target came from the spec (True) or was captured at activation (False).
    explicit: bool
    #: The name of the kind that holds the elements: ``"value"`` (``target``), ``"stuck_bits"``
    #: (``stuck_at_zero`` / ``stuck_at_one``), ``"bounds"`` (``low`` / ``high``), ...
    kind: str = DEFAULT_KIND
    #: The kind's per-element tensors by field name (its ``payload_fields``), one per index (the
    #: parameter's shape for a whole tensor). Stuck-bit masks are in the signed integer type of
    #: the parameter's width (see :data:`~lightning_pin.core.state.BITS_DTYPES`), bounds in the parameter's dtype.
    payload: Mapping[str, Tensor] = dataclasses.field(default_factory=dict)

    def __init__(
        self, index: Optional[Tensor], target: Optional[Tensor], explicit: bool, kind: str = DEFAULT_KIND,
        payload: Optional[Mapping[str, Tensor]] = None, **fields: Optional[Tensor],
    ) -> None:
        merged = dict(payload or {})
        merged.update((field, tensor) for field, tensor in fields.items() if tensor is not None)
        for field, value in (("index", index), ("target", target), ("explicit", explicit), ("kind", kind),
                             ("payload", merged)):
            object.__setattr__(self, field, value)

    def __getattr__(self, field: str) -> Any:
        return payload_field(self, field)  # a payload field by name (``selection.low``), or None
