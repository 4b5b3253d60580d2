"""How the selections of several pins on one parameter merge into one index (later entries win)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_pin.core.sharding import copy_at

__all__ = []


@dataclasses.dataclass
class _Layout:
    """How the entries ``(index, values)`` of one parameter merge, later entries winning.

    It depends on the indices only: :meth:`of` works it out once (deduplicating indices syncs
    with the host), and :meth:`apply` merges any values into it without a sync.
    """

    #: The entries' indices (None: the whole tensor).
    indices: list[Tensor | None]
    #: The merged, sorted, unique index; None for a single entry or when a whole tensor is pinned.
    index: Tensor | None
    #: Positions in the concatenated values that supply each merged value (None: no gather).
    take: Tensor | None
    #: Storage positions of ``index`` per stride pattern, shared by the targets merged with it.
    by_strides: dict[Any, Tensor] = dataclasses.field(default_factory=dict)

    @staticmethod
    def of(indices: Sequence[Tensor | None]) -> _Layout:
        indices = list(indices)
        if len(indices) == 1 or any(index is None for index in indices):
            return _Layout(indices, None, None)
        index = torch.cat(indices)
        order = torch.argsort(index, stable=True)
        unique, counts = torch.unique_consecutive(index[order], return_counts=True)
        take = order[counts.cumsum(0) - 1]
        if take.numel() <= torch.iinfo(torch.int32).max:
            take = take.to(torch.int32)  # index_select takes int32: half the memory
        return _Layout(indices, unique, take)

    def apply(self, values: Sequence[Tensor]) -> tuple[Tensor | None, Tensor]:
        """``(index, values)`` of the merge of ``values`` (one per entry, in the entries' order)."""
        if len(values) == 1:
            return self.indices[0], values[0]
        if self.take is not None:
            return self.index, torch.cat(list(values)).index_select(0, self.take)
        first = max(i for i, index in enumerate(self.indices) if index is None)
        full = values[first].clone(memory_format=torch.contiguous_format)
        flat = full.view(-1)
        for index, entry_values in zip(self.indices[first + 1 :], values[first + 1 :]):
            copy_at(flat, index, entry_values)
        return None, full
