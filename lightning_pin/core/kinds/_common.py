"""Helpers the kinds share: per-element entries of a selection, sorting them with its index,
the elements two selections share, and coordinates for messages."""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import Tensor

from lightning_pin.core.errors import PinError
from lightning_pin.core.layouts import _Layout
from lightning_pin.core.rules import name_seed  # noqa: F401  (the seed of every seeded draw; kept here too)
from lightning_pin.core.selection import Selection
from lightning_pin.core.spec import Pin

__all__ = [
    "clip", "coords", "first", "is_int", "merge_paired", "merge_rounds", "name_seed", "per_element",
    "shared_positions", "sort_with_index",
]


def per_element(
    pin: Pin, name: str, field: str, tensor: Tensor, shape: tuple[int, ...], index: Tensor | None, count: int
) -> Tensor:
    """A scalar, one entry per selected element, or a tensor of the parameter's shape -> per selection."""
    if tensor.ndim == 0:
        return tensor.expand(shape if index is None else (count,)).clone()
    if tensor.ndim == 1 and tensor.numel() == count:
        # One entry per selected element, in the selection's order (a 1-D sequence always is).
        return tensor.reshape(shape).clone() if index is None else tensor.clone()
    if tuple(tensor.shape) == shape:
        return tensor.clone() if index is None else tensor.reshape(-1)[index.cpu()].clone()
    raise PinError(
        f"{pin!r}: {field} for {name!r} has shape {tuple(tensor.shape)}; expected one entry, {count} entries (one "
        f"per selected element) or a tensor of the parameter's shape {shape}"
    )


def sort_with_index(pin: Pin, selection: Selection, tensors: tuple[Tensor, ...], what: str) -> tuple[Tensor, ...]:
    """Sort and dedupe ``selection.index`` in place, and reorder the per-element ``tensors`` (in the
    order of the user's index) along with it.

    Raises:
        PinError: the selection repeats an element with different entries (``what``: "values").
    """
    if selection.index is None:
        return tensors
    user_index = selection.index.cpu()
    order = torch.argsort(user_index, stable=True)
    index = user_index[order]
    unique, counts = torch.unique_consecutive(index, return_counts=True)
    out = []
    for tensor in tensors:
        tensor = tensor[order.to(tensor.device)]
        if unique.numel() != index.numel():
            # A repeated element is fine only if every repeat asks for the same entry.
            first = tensor[(counts.cumsum(0) - counts).to(tensor.device)]
            if not torch.equal(tensor, first.repeat_interleave(counts.to(tensor.device))):
                raise PinError(f"{pin!r}: indices repeat an element of {selection.name!r} with different {what}")
            tensor = first
        out.append(tensor)
    selection.index = unique.to(selection.index.device)
    return tuple(out)


def shared_positions(a_index: Tensor | None, b_index: Tensor | None, numel: int) -> tuple[Tensor, Tensor]:
    """Positions, in the per-element tensors of two selections, of the elements both select."""
    if a_index is None and b_index is None:
        every = torch.arange(numel)
        return every, every
    if a_index is None:
        return b_index.cpu().long(), torch.arange(b_index.numel())
    if b_index is None:
        return torch.arange(a_index.numel()), a_index.cpu().long()
    a, b = a_index.cpu().long(), b_index.cpu().long()
    in_b = torch.isin(a, b)
    return in_b.nonzero().squeeze(1), torch.searchsorted(b, a[in_b])


def first(flags: Tensor) -> int:
    """The flat position of the first True in ``flags``."""
    return int(flags.reshape(-1).to(torch.int8).argmax())


def coords(parameter: Tensor, index: Tensor | None, at: int) -> tuple[int, ...]:
    """The coordinates of entry ``at`` of a selection (``index``, or the whole tensor) in ``parameter``."""
    flat = at if index is None else int(index.reshape(-1)[at])
    return tuple(int(c) for c in torch.unravel_index(torch.tensor(flat), tuple(parameter.shape)))


def is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def clip(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def merge_paired(
    parameter: torch.nn.Parameter, indices: list[Tensor | None], pairs: list[tuple[Tensor, Tensor]],
    starts: tuple[Tensor, Tensor], combine: Any,
) -> tuple[Tensor | None, Tensor, Tensor]:
    """Merge the paired per-element payloads of several selections of one parameter.

    ``combine(a, b, side)`` folds two entries for one element (side 0 or 1), starting from
    ``starts``. Returns the merged index (None: the whole tensor) and both sides, on the
    parameter's device. Syncs (deduplicating indices): it runs when the active pins change.
    """
    device = parameter.device
    if len(pairs) == 1:
        index, merged = indices[0], list(pairs[0])
    else:
        layout = _Layout.of(indices)
        whole = any(i is None for i in indices)
        index = None if whole else layout.index
        size = parameter.numel() if whole else index.numel()
        merged = [starts[side].to(device).expand(size).clone() for side in (0, 1)]
        for entry_index, pair in zip(indices, pairs):
            if entry_index is None:
                at = None
            elif whole:
                at = entry_index.long()
            else:
                at = torch.searchsorted(index, entry_index).long()
            for side in (0, 1):
                flat = pair[side].reshape(-1).to(device)
                if at is None:
                    merged[side] = combine(merged[side], flat, side)
                else:
                    merged[side][at] = combine(merged[side][at], flat, side)
        if whole:
            merged = [m.reshape(parameter.shape) for m in merged]
    return index, merged[0].to(device), merged[1].to(device)


def merge_rounds(target: Tensor, at: Tensor, given: Tensor, fold: Any) -> None:
    """``target[at] = fold(target[at], given)`` where ``at`` may repeat a row: in rounds of
    distinct rows (a pin can list an element twice), so every entry is folded in."""
    order = torch.argsort(at, stable=True)
    at, given = at[order], given[order]
    _, run, counts = torch.unique_consecutive(at, return_inverse=True, return_counts=True)
    rank = torch.arange(at.numel()) - (counts.cumsum(0) - counts)[run]
    for r in range(int(counts.max()) if counts.numel() else 0):  # rounds of distinct rows
        rows = at[rank == r]
        target[rows] = fold(rows, target[rows], given[rank == r])
