"""An example pin kind that a test registers (one module plus one registration): the selected
elements stay multiples of a step, ``Pin(..., kind_args={"grid": 0.125})``.

After every optimizer step each selected element is rounded to the nearest multiple of its step
(a weight memory that holds multiples of a fixed quantum); the elements keep their gradients and
optimizer statistics and train on the grid. What it implements is what every kind implements
(see ``lightning_pin.core.kinds.base.HOOKS``); its saved form, ``check`` / ``diff`` on stored
tensors and its words come from the data below.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_pin import PinError
from lightning_pin.core.kinds import (
    Expected, Kind, Target, coords, first, merge_paired, per_element, pin_field, shared_positions, sort_with_index,
)

__all__ = ["Grid"]


class Grid(Kind):
    """Round the selected elements to multiples of ``grid`` (payload: the step of each element)."""

    kind = "grid"
    words = "a grid"
    off_words = "off the grid"
    pin_fields = ("grid",)
    payload_fields = ("grid",)  # saved in the pin state as resolved
    dtype_field = "grid"  # held in the parameter's dtype
    map_fields = {"grid": 0.0}
    map_words = ("on a grid", "on a grid")

    @classmethod
    def check_spec(cls, pin: Any) -> None:
        step = pin_field(pin, "grid")
        if step is None:
            return
        steps = torch.as_tensor(step, dtype=torch.float64) if not isinstance(step, bool) else None
        if steps is None or steps.numel() == 0 or not bool(((steps > 0) & (steps < math.inf)).all()):
            raise PinError(f"{pin!r}: grid must be a positive finite number (or one per element), got {step!r}")

    @classmethod
    def resolve(cls, pin: Any, selection: Any, read: Callable[[str, Any], Any], warn: Callable[[str], Any],
                module: nn.Module) -> None:
        parameter, index = selection.parameter, selection.index
        given = torch.as_tensor(pin_field(pin, "grid"), dtype=torch.float64)
        count = parameter.numel() if index is None else index.numel()
        steps = per_element(pin, selection.name, "grid", given, tuple(parameter.shape), index, count)
        (steps,) = sort_with_index(pin, selection, (steps,), "grids")
        held = steps.to(parameter.dtype)
        if not torch.equal(held.double(), steps):
            raise PinError(f"{pin!r}: a grid step of {selection.name!r} is not a {parameter.dtype} number")
        selection.payload = {"grid": held.to(parameter.device)}

    @classmethod
    def describe(cls, selection: Any) -> str:
        return f"multiples of {selection.payload['grid'].reshape(-1)[0].item():g}"

    @classmethod
    def check_overlap(cls, first_pin: Any, a: Any, second: Any, b: Any, name: str) -> None:
        a_pos, b_pos = shared_positions(a.index, b.index, a.parameter.numel())
        differ = a.payload["grid"].reshape(-1).cpu()[a_pos] != b.payload["grid"].reshape(-1).cpu()[b_pos]
        if bool(differ.any()):
            element = coords(a.parameter, a.index, int(a_pos[first(differ)]))
            raise PinError(f"{first_pin!r} and {second!r} give element {element} of {name!r} two grids at overlapping "
                           "steps")

    @classmethod
    def merge(cls, name: str, parameter: nn.Parameter, entries: Sequence[Any],
              captured: Sequence[Optional[Tensor]] = ()) -> Grid:
        pairs = [(e.payload["grid"], e.payload["grid"]) for e in entries]
        zero = torch.zeros((), dtype=parameter.dtype)
        index, step, _ = merge_paired(parameter, [e.index for e in entries], pairs, (zero, zero), lambda a, b, side: b)
        return cls(Target(name, parameter, index, step))

    def kernel(self, tensor: Tensor) -> Callable[[], None]:
        view, step, index, scratch, put = self.gather(tensor)
        step = step.reshape(view.shape if index is None else (-1,)).to(device=view.device, dtype=view.dtype)
        if index is None:

            def round_whole() -> None:
                view.copy_(torch.round(view / step) * step)

            return round_whole

        def round_elements() -> None:
            torch.index_select(view, 0, index, out=scratch)
            scratch.copy_(torch.round(scratch / step) * step)
            put(0, index, scratch)

        return round_elements

    def drift(self, tensor: Tensor) -> Tensor:
        _, _, step, actual = self.elements_of(tensor)
        step = step.reshape(-1).to(actual.device)
        return (actual - torch.round(actual / step) * step).abs().float()

    def off(self, tensor: Tensor) -> tuple[Tensor, Tensor, Expected]:
        _, _, step, actual = self.elements_of(tensor)
        step = step.reshape(-1).to(device=actual.device, dtype=actual.dtype)
        return actual, actual != torch.round(actual / step) * step, lambda i: f"a multiple of {step[i].item()!r}"
