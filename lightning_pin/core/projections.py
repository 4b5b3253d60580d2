"""What the engine does to pinned elements after every optimizer step: one projection per pin kind.

A projection maps a weight onto the set the pin allows and is idempotent:

- :class:`ExactValue` writes the target (value pins: the element equals it bit for bit);
- :class:`StuckBits` forces stuck bits in the element's own storage, through an integer view of
  the same bytes: ``bits = (bits & ~stuck_at_zero) | stuck_at_one``; the other bits keep what
  the optimizer wrote;
- :class:`Interval` clamps into ``[low, high]``.

Each holds a :class:`~lightning_pin.core.sharding.Target` (the merged elements of one parameter
and a per-element payload), so its kernels are index based, sync-free and work on dense,
permuted and sharded tensors alike through :meth:`Target.part`. Each has the same four methods:
:meth:`~Projection.apply` (the restore kernel), :meth:`~Projection.drift` (``|x - P(x)|``, how
far the optimizer pushed the elements out of the allowed set) and :meth:`~Projection.off` (which
elements are outside it and what they should hold, for verify and the violation count). A new
fault kind is one class here, one resolver in :mod:`~lightning_pin.core.fault_plan` and one saved
form in :mod:`~lightning_pin.core.state`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

import torch
from torch import Tensor

from lightning_pin.core.bitwords import describe_stuck
from lightning_pin.core.layouts import _Layout
from lightning_pin.core.sharding import Target, copy_at, wide_index
from lightning_pin.core.state import BITS_DTYPES


class Projection:
    """One parameter's elements under one kind of pin (see the module docstring)."""

    kind: ClassVar[str]

    def __init__(self, target: Target) -> None:
        self.target = target
        self._split: dict[tuple[int, torch.device], tuple[Tensor, Tensor, Tensor]] = {}
        self._scratch: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def elements(self) -> int:
        """How many elements the projection holds (from shapes only: no sync)."""
        raise NotImplementedError

    def apply(self, tensor: Tensor) -> None:
        """Project ``tensor`` (the parameter's data, or a copy of the weights) in place."""
        raise NotImplementedError

    def drift(self, tensor: Tensor) -> Tensor:
        """``|x - P(x)|`` of the elements, flat, in float32 or wider (0 where they hold)."""
        raise NotImplementedError

    def off(self, tensor: Tensor) -> tuple[Tensor, Tensor, Callable[[int], float | str]]:
        """``(actual, off, expected)``: the elements of ``tensor`` (flat), where they break the
        pin, and ``expected(position)``: what element ``position`` must hold (a target value, or
        in words the stuck bits or the interval). Nothing is kept once the result is dropped."""
        raise NotImplementedError

    def _elements(self, tensor: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
        """``(view, positions, payload, actual)``: :meth:`Target.part` plus the elements, flat."""
        view, positions, payload = self.target.part(tensor)
        actual = view.reshape(-1) if positions is None else view.index_select(0, positions)
        return view, positions, payload, actual

    def _update_at(self, flat: Tensor, positions: Tensor, update: Callable[[Tensor], object]) -> None:
        """``flat[positions] = update(flat[positions])`` with ``update`` working in place on a
        gathered copy: three kernels and, in steady state, no allocation and no index conversion
        (the gathered elements live in a scratch buffer kept per dtype and device)."""
        positions = positions.to(flat.device)
        wide = wide_index(positions)
        if wide is None:  # too many elements to keep a second index: the general path
            gathered = flat.index_select(0, positions)
            update(gathered)
            copy_at(flat, positions, gathered)
            return
        key = (flat.dtype, flat.device)
        scratch = self._scratch.get(key)
        if scratch is None or scratch.numel() != wide.numel():
            scratch = self._scratch[key] = torch.empty(wide.numel(), dtype=flat.dtype, device=flat.device)
        torch.index_select(flat, 0, wide, out=scratch)
        update(scratch)
        flat.index_copy_(0, wide, scratch)

    def _halves(self, payload: Tensor, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The two halves of a paired payload (last dimension 2), contiguous, on ``device``.

        Split once per payload (a shard has its own) and device, then reused at every step.
        """
        key = (id(payload), device)
        cached = self._split.get(key)
        if cached is None or cached[0] is not payload:
            first, second = (payload[..., i].contiguous().to(device=device, dtype=dtype) for i in (0, 1))
            cached = self._split[key] = (payload, first, second)
        return cached[1], cached[2]


class ExactValue(Projection):
    """Write the target: the element equals it bit for bit (``torch.equal``)."""

    kind = "value"

    @property
    def elements(self) -> int:
        return self.target.values.numel()

    def apply(self, tensor: Tensor) -> None:
        view, positions, values = self.target.part(tensor)
        if values.device != view.device or values.dtype != view.dtype:
            values = values.to(device=view.device, dtype=view.dtype)  # a copy elsewhere (an averaged model)
        if positions is None:
            view.copy_(values)
        else:
            copy_at(view, positions.to(view.device), values)

    def drift(self, tensor: Tensor) -> Tensor:
        _, _, values, actual = self._elements(tensor)
        deviation = (actual - values.reshape(-1).to(actual.device)).abs()
        return deviation if deviation.dtype in (torch.float32, torch.float64) else deviation.float()

    def off(self, tensor: Tensor) -> tuple[Tensor, Tensor, Callable[[int], float | str]]:
        _, _, values, actual = self._elements(tensor)
        expected = values.reshape(-1).to(actual.device)
        return actual, actual != expected, lambda position: expected[position].item()


class StuckBits(Projection):
    """``bits = (bits & keep) | set`` on an integer view of the element's own bytes.

    The payload holds ``keep = ~stuck_at_zero`` and ``set = stuck_at_one`` per element (last
    dimension 2), in the signed integer type of the parameter's width.

    Example::

        >>> import torch
        >>> from lightning_pin.core.sharding import Target
        >>> weight = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
        >>> keep, set_ = ~torch.tensor(-2**31, dtype=torch.int32), torch.tensor(0, dtype=torch.int32)
        >>> sign_at_zero = StuckBits(Target("w", weight, torch.tensor([1]), torch.stack([keep, set_]).reshape(1, 2)))
        >>> sign_at_zero.apply(weight.data)      # the sign bit of element 1 is stuck at 0
        >>> weight.data
        tensor([1., 2., 3.])
    """

    kind = "stuck_bits"

    @property
    def elements(self) -> int:
        return self.target.values.numel() // 2

    def _bits(self, tensor: Tensor) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        view, positions, payload = self.target.part(tensor)
        ints = view.view(payload.dtype)  # the same bytes: no copy, no rounding
        keep, set_ = self._halves(payload, ints.device, payload.dtype)
        return ints, positions, keep, set_

    def _flat(self, tensor: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        ints, positions, keep, set_ = self._bits(tensor)
        actual = ints.reshape(-1) if positions is None else ints.index_select(0, positions.to(ints.device))
        return actual, keep.reshape(-1), set_.reshape(-1)

    def apply(self, tensor: Tensor) -> None:
        ints, positions, keep, set_ = self._bits(tensor)
        if positions is None:
            ints.bitwise_and_(keep).bitwise_or_(set_)
        else:
            self._update_at(ints, positions, lambda bits: bits.bitwise_and_(keep).bitwise_or_(set_))

    def drift(self, tensor: Tensor) -> Tensor:
        actual, keep, set_ = self._flat(tensor)
        before = actual.view(tensor.dtype)
        after = ((actual & keep) | set_).view(tensor.dtype)
        deviation = (before.double() - after.double()).abs()
        # inf - inf is NaN: a stuck bit that made an infinity finite (or one infinite) moved it infinitely.
        return torch.where(deviation.isnan() & (before.isinf() | after.isinf()), torch.inf, deviation).float()

    def off(self, tensor: Tensor) -> tuple[Tensor, Tensor, Callable[[int], float | str]]:
        actual, keep, set_ = self._flat(tensor)
        off = ((actual & ~keep) | (~actual & set_)) != 0
        return actual.view(tensor.dtype), off, lambda position: _describe_bits(actual, keep, set_, position)


def _describe_bits(actual: Tensor, keep: Tensor, set_: Tensor, position: int) -> str:
    """``"bits 0x..., stuck at 1: 0x..., stuck at 0: 0x..., wrong: 0x..."`` for one element."""
    word, zero, one = int(actual[position]), int(~keep[position]), int(set_[position])
    return describe_stuck(word, zero, one, torch.iinfo(keep.dtype).bits)


class Interval(Projection):
    """Clamp into ``[low, high]`` (payload: ``low`` and ``high`` per element, last dimension 2).

    Example::

        >>> import torch
        >>> from lightning_pin.core.sharding import Target
        >>> weight = torch.nn.Parameter(torch.tensor([-1.0, 0.25, 3.0]))
        >>> Interval(Target("w", weight, None, torch.tensor([[0.0, 1.0]]).expand(3, 2))).apply(weight.data)
        >>> weight.data
        tensor([0.0000, 0.2500, 1.0000])
    """

    kind = "bounds"

    @property
    def elements(self) -> int:
        return self.target.values.numel() // 2

    def _parts(self, tensor: Tensor) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        view, positions, payload = self.target.part(tensor)
        low, high = self._halves(payload, view.device, view.dtype)
        return view, positions, low, high

    def _flat(self, tensor: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        view, positions, low, high = self._parts(tensor)
        actual = view.reshape(-1) if positions is None else view.index_select(0, positions.to(view.device))
        return actual, low.reshape(-1), high.reshape(-1)

    def apply(self, tensor: Tensor) -> None:
        view, positions, low, high = self._parts(tensor)
        if positions is None:
            view.clamp_(min=low, max=high)
        else:
            self._update_at(view, positions, lambda values: values.clamp_(min=low, max=high))

    def drift(self, tensor: Tensor) -> Tensor:
        actual, low, high = self._flat(tensor)
        wide = actual.double()
        return ((low.double() - wide).clamp_min(0) + (wide - high.double()).clamp_min(0)).float()

    def off(self, tensor: Tensor) -> tuple[Tensor, Tensor, Callable[[int], float | str]]:
        actual, low, high = self._flat(tensor)
        off = ~((actual >= low) & (actual <= high))  # NaN is off
        return actual, off, lambda position: f"in [{low[position].item()!r}, {high[position].item()!r}]"


#: The projection class of each pin kind.
KINDS: dict[str, type[Projection]] = {cls.kind: cls for cls in (ExactValue, StuckBits, Interval)}


def merge_faults(kind: str, name: str, parameter: torch.nn.Parameter, entries: Sequence[object]) -> Projection:
    """One projection of ``kind`` for the fault selections ``entries`` of one parameter.

    Stuck bits of several pins on one element combine (their masks are OR-ed), bounds intersect:
    the plan has refused combinations that cannot hold. Runs when the set of active pins changes
    (it syncs to deduplicate indices); the result is cached by the engine for that set.
    """
    if kind == "stuck_bits":
        dtype = BITS_DTYPES[parameter.dtype]
        firsts = [(e.stuck_at_zero, e.stuck_at_one) for e in entries]
        starts = (torch.zeros((), dtype=dtype), torch.zeros((), dtype=dtype))

        def combine(a: Tensor, b: Tensor, side: int) -> Tensor:
            return a | b
    else:
        dtype = parameter.dtype
        firsts = [(e.low, e.high) for e in entries]
        if dtype.is_floating_point:
            extremes = (-torch.inf, torch.inf)
        else:
            extremes = (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
        starts = tuple(torch.tensor(x, dtype=dtype) for x in extremes)

        def combine(a: Tensor, b: Tensor, side: int) -> Tensor:
            return torch.maximum(a, b) if side == 0 else torch.minimum(a, b)

    indices = [e.index for e in entries]
    device = parameter.device
    if len(entries) == 1:
        index, merged = indices[0], list(firsts[0])
    else:
        layout = _Layout.of(indices)
        whole = any(i is None for i in indices)
        index = None if whole else layout.index
        size = parameter.numel() if whole else index.numel()
        merged = [starts[side].to(device).expand(size).clone() for side in (0, 1)]
        for entry_index, pair in zip(indices, firsts):
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
    first, second = merged
    if kind == "stuck_bits":
        first = ~first  # keep = ~stuck_at_zero
    payload = torch.stack([first.to(device), second.to(device)], dim=-1)
    return KINDS[kind](Target(name, parameter, index, payload))
