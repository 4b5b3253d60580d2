"""The interval kind: the selected elements are clamped into ``[low, high]`` and keep training inside.

``Pin(..., bounds=(low, high))`` models a bounded cell (``(0.0, math.inf)`` keeps a weight's
sign). Bounds the parameter's dtype cannot represent exactly are moved inwards; bounds of
several pins on one element intersect. Gradients and optimizer statistics are left alone.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_pin.core.errors import PinError
from lightning_pin.core.kinds._common import clip as _clip
from lightning_pin.core.kinds._common import coords as _coords
from lightning_pin.core.kinds._common import first as _first
from lightning_pin.core.kinds._common import merge_paired, per_element, shared_positions, sort_with_index
from lightning_pin.core.kinds.base import Expected, Kind, Reader
from lightning_pin.core.selection import Selection
from lightning_pin.core.sharding import Target
from lightning_pin.core.spec import Pin, _is_bool, number_leaves

__all__ = ["Interval", "bounds_for", "check_bounds", "describe_bounds"]


class Interval(Kind):
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
    words = "bounds"
    off_words = "out of bounds"
    pin_fields = ("bounds",)
    payload_fields = ("low", "high")
    dtype_field = "low"
    example = "{coords}: {actual!r} (in {expected})"
    stored_example = "bounds {expected}"
    fixes_words = False  # the element trains inside its interval: a forced fault writes no word
    mixed_reason = "clamping can undo a stuck bit; "

    # ------------------------------------------------------------------------------------
    # The spec

    @classmethod
    def check_spec(cls, pin: Pin) -> None:
        if pin.bounds is not None:
            check_bounds(pin, pin.bounds)
            if pin.value is not None:
                raise PinError(
                    f"{pin!r}: value and bounds on the same pin: a value fixes the element, bounds let it train "
                    "inside an interval; give one of them"
                )

    # ------------------------------------------------------------------------------------
    # The plan

    @classmethod
    def resolve(
        cls, pin: Pin, selection: Selection, read: Reader, warn: Callable[[str], Any], module: torch.nn.Module
    ) -> None:
        low, high = (read("bounds", side) for side in pin.bounds)
        sides = bounds_for(pin, selection.name, selection.parameter, selection.index, low, high)
        low, high = sort_with_index(pin, selection, sides, "bounds")
        device = selection.parameter.device
        selection.payload = {"low": low.to(device), "high": high.to(device)}

    @classmethod
    def describe(cls, selection: Selection) -> str:
        return describe_bounds(selection.payload["low"], selection.payload["high"])

    @classmethod
    def check_fits(cls, pin: Pin, name: str, selection: Selection, dtype: torch.dtype) -> None:
        shell = torch.empty(selection.parameter.shape, dtype=dtype, device="meta")  # a dtype and a shape
        index = None if selection.index is None else selection.index.cpu()
        low, high = (selection.payload[f].detach().cpu().to(torch.float64) for f in cls.payload_fields)
        bounds_for(pin, name, shell, index, low, high)

    @classmethod
    def check_overlap(cls, first: Pin, a: Selection, second: Pin, b: Selection, name: str) -> None:
        """Bounds of two pins on one element intersect, unless that is empty."""
        parameter = a.parameter
        a_pos, b_pos = shared_positions(a.index, b.index, parameter.numel())
        if a_pos.numel() == 0:
            return
        flat = a_pos if a.index is None else a.index.cpu().long()[a_pos]
        low = torch.maximum(a.payload["low"].reshape(-1).cpu()[a_pos], b.payload["low"].reshape(-1).cpu()[b_pos])
        high = torch.minimum(a.payload["high"].reshape(-1).cpu()[a_pos], b.payload["high"].reshape(-1).cpu()[b_pos])
        empty = low > high
        if bool(empty.any()):
            at = _first(empty)
            raise PinError(
                f"{first!r} and {second!r} bound element {_coords(parameter, None, int(flat[at]))} of {name!r} at "
                f"overlapping steps to intervals that do not meet (together: [{low[at].item()}, {high[at].item()}])"
            )

    @classmethod
    def merge(
        cls, name: str, parameter: torch.nn.Parameter, entries: Sequence[Selection],
        captured: Sequence[Optional[Tensor]] = (),
    ) -> Interval:
        """Bounds of several pins on one element intersect (the plan has refused empty ones)."""
        dtype = entries[0].payload["low"].dtype  # the parameter's (bounds are resolved in it)
        extremes = (-torch.inf, torch.inf) if dtype.is_floating_point else (torch.iinfo(dtype).min,
                                                                            torch.iinfo(dtype).max)
        starts = tuple(torch.tensor(x, dtype=dtype) for x in extremes)

        def combine(a: Tensor, b: Tensor, side: int) -> Tensor:
            return torch.maximum(a, b) if side == 0 else torch.minimum(a, b)

        pairs = [(e.payload["low"], e.payload["high"]) for e in entries]
        index, low, high = merge_paired(parameter, [e.index for e in entries], pairs, starts, combine)
        return cls(Target(name, parameter, index, torch.stack([low, high], dim=-1)))

    # ------------------------------------------------------------------------------------
    # The pin state

    @classmethod
    def check_saved(cls, payload: Mapping[str, Tensor], at: str, corrupt: Callable[[str], Exception]) -> None:
        low, high = payload["low"], payload["high"]
        if low.dtype != high.dtype or low.shape != high.shape or low.dtype == torch.bool or low.is_complex():
            raise corrupt(f"{at}: 'low' and 'high' must be real tensors of one dtype and shape")
        if low.is_floating_point() and bool((low.isnan() | high.isnan()).any()):
            raise corrupt(f"{at}: bounds hold NaN")
        if bool((low > high).any()):
            raise corrupt(f"{at}: bounds with low > high")

    # ------------------------------------------------------------------------------------
    # Fault-map files: float64 bounds, -inf / +inf for no bound

    map_fields = {"low": -math.inf, "high": math.inf}
    map_fold = {"low": "max", "high": "min"}  # bounds intersect
    map_words = ("bounded", "bounded")

    @classmethod
    def map_entries(cls, pin: Pin, selection: Optional[Selection]) -> dict[str, Any]:
        if selection is None:
            return dict(zip(("low", "high"), pin.bounds or (None, None)))
        return super().map_entries(pin, selection)  # float64

    @classmethod
    def map_pin(
        cls, pattern: str, fields: Mapping[str, Tensor], marked: Tensor, select: dict[str, Any],
        spec: Mapping[str, Tensor], where: str,
    ) -> Pin:
        count = int(marked.sum())
        pair = tuple(
            fields[f][marked] if f in fields else torch.full((count,), healthy, dtype=torch.float64)
            for f, healthy in cls.map_fields.items()
        )
        return Pin(pattern, bounds=pair, **select)

    # ------------------------------------------------------------------------------------
    # The restore kernel

    def _parts(self, tensor: Tensor) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        view, positions, payload = self.target.part(tensor)
        low, high = self._halves(payload, view.device, view.dtype)
        return view, positions, low, high

    def _flat(self, tensor: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        view, positions, low, high = self._parts(tensor)
        actual = view.reshape(-1) if positions is None else view.index_select(0, positions.to(view.device))
        return actual, low.reshape(-1), high.reshape(-1)

    def kernel(self, tensor: Tensor) -> Callable[[], None]:
        view, payload, index, scratch, put = self.gather(tensor)
        low, high = self._halves(payload, view.device, view.dtype)
        if index is None:

            def clamp_whole() -> None:
                view.clamp_(min=low, max=high)

            return clamp_whole

        def clamp() -> None:
            torch.index_select(view, 0, index, out=scratch)
            scratch.clamp_(min=low, max=high)
            put(0, index, scratch)

        return clamp

    def drift(self, tensor: Tensor) -> Tensor:
        actual, low, high = self._flat(tensor)
        wide = actual.double()
        return ((low.double() - wide).clamp_min(0) + (wide - high.double()).clamp_min(0)).float()

    def off(self, tensor: Tensor) -> tuple[Tensor, Tensor, Expected]:
        """Elements outside ``[low, high]`` (NaN is outside); in a tensor of another dtype than the
        bounds (a copy, a stored tensor) compared by value in float64 with the bounds as they are."""
        view, positions, payload = self.target.part(tensor)
        actual = view.reshape(-1) if positions is None else view.index_select(0, positions.to(view.device))
        low, high = (half.reshape(-1) for half in self._halves(payload, view.device, payload.dtype))
        if actual.dtype == low.dtype:
            off = ~((actual >= low) & (actual <= high))
        else:
            wide = actual.to(torch.float64)
            off = ~((wide >= low.to(torch.float64)) & (wide <= high.to(torch.float64)))
        return actual, off, lambda position: f"[{low[position].item()!r}, {high[position].item()!r}]"


# --------------------------------------------------------------------------------------------
# Bounds: forms (no model) and resolution on one parameter


def check_bounds(pin: Pin, bounds: Any) -> None:
    """``bounds`` must be a ``(low, high)`` pair of numbers / sequences / tensors / dicts, no NaN, ``low <= high``."""
    if isinstance(bounds, (str, bytes, Mapping, torch.Tensor)) or not isinstance(bounds, Sequence) or len(bounds) != 2:
        raise PinError(
            f"{pin!r}: bounds must be a pair (low, high), e.g. bounds=(-0.5, 0.5) or (0.0, math.inf); got "
            f"{_clip(bounds)}"
        )
    for side, raw in zip(("low", "high"), bounds):
        if isinstance(raw, Mapping):
            for key, entry in raw.items():
                _check_bound(pin, side, entry, f" for {key!r}")
        else:
            _check_bound(pin, side, raw, "")
    low, high = bounds
    if isinstance(low, Mapping) or isinstance(high, Mapping):
        return
    lo, hi = _bound_tensor(low), _bound_tensor(high)
    if lo.numel() != hi.numel() and 1 not in (lo.numel(), hi.numel()) and lo.shape != hi.shape:
        return  # shapes are checked against the selection by the plan
    try:
        wrong = lo > hi
    except RuntimeError:
        return
    if bool(wrong.any()):
        at = int(wrong.reshape(-1).to(torch.int8).argmax())
        lo_at = lo.reshape(-1)[at if lo.numel() > 1 else 0].item()
        hi_at = hi.reshape(-1)[at if hi.numel() > 1 else 0].item()
        where = "" if wrong.numel() == 1 else f" at element {at}"
        raise PinError(f"{pin!r}: bounds have low > high{where} ({lo_at} > {hi_at}); give low <= high")


def _bound_tensor(raw: Any) -> torch.Tensor:
    if isinstance(raw, torch.Tensor):
        return raw.detach().cpu().to(torch.float64)
    return torch.tensor(list(number_leaves(raw)) if not isinstance(raw, numbers.Number) else [raw], dtype=torch.float64)


def _check_bound(pin: Pin, side: str, raw: Any, where: str) -> None:
    what = f"bounds {side}{where}"
    if raw is None or isinstance(raw, (str, bytes, Path)):
        raise PinError(
            f"{pin!r}: {what} is {_clip(raw)}; give a number, one number per selected element or a tensor "
            f"(use math.inf / -math.inf for no {side} bound)"
        )
    if _is_bool(raw) or (isinstance(raw, torch.Tensor) and raw.dtype == torch.bool):
        raise PinError(f"{pin!r}: {what} is a bool; give numbers")
    if isinstance(raw, torch.Tensor):
        if raw.is_complex():
            raise PinError(f"{pin!r}: {what}: complex bounds are not supported")
        values = raw.detach().cpu().to(torch.float64).reshape(-1)
    elif isinstance(raw, numbers.Number) or (isinstance(raw, Sequence) and not isinstance(raw, bytes)):
        leaves = [raw] if isinstance(raw, numbers.Number) else list(number_leaves(raw))
        if not leaves:
            raise PinError(f"{pin!r}: {what} is an empty sequence; give one number per selected element")
        odd = [x for x in leaves if _is_bool(x) or not isinstance(x, numbers.Real)]
        if odd:
            raise PinError(f"{pin!r}: {what} must hold real numbers, got {_clip(odd[0])}")
        values = torch.tensor([float(x) for x in leaves], dtype=torch.float64)
    else:
        raise PinError(f"{pin!r}: {what} must be a number, a sequence of numbers or a tensor; got {_clip(raw)}")
    if bool(values.isnan().any()):
        raise PinError(f"{pin!r}: {what} holds NaN; give numbers (math.inf for no bound)")
    wrong_inf = math.inf if side == "low" else -math.inf
    if bool((values == wrong_inf).any()):
        raise PinError(
            f"{pin!r}: {what} holds {wrong_inf}: no finite weight lies in such an interval; "
            f"use {-wrong_inf} for no {side} bound"
        )


def bounds_for(
    pin: Pin, name: str, parameter: Tensor, index: Tensor | None, raw_low: Any, raw_high: Any
) -> tuple[Tensor, Tensor]:
    """``(low, high)`` for the selection, in the parameter's dtype.

    Bounds the dtype cannot represent exactly are moved inwards to the nearest representable
    number (low up, high down), so every stored value inside them is inside the bounds asked for.

    Raises:
        PinError: bounds on a bool or complex parameter, a finite bound beyond the dtype's range,
            bounds of the wrong count or shape, or an interval that holds no value of the dtype.
    """
    dtype = parameter.dtype
    if dtype == torch.bool or dtype.is_complex:
        raise PinError(f"{pin!r}: bounds on {name!r}, a {dtype} parameter: bounds need real numbers")
    shape = tuple(parameter.shape)
    count = parameter.numel() if index is None else index.numel()
    sides = []
    for side, raw in (("low", raw_low), ("high", raw_high)):
        if isinstance(raw, Tensor):
            wide = raw.detach().cpu().to(torch.float64)
        else:
            leaves = [raw] if isinstance(raw, numbers.Number) else list(number_leaves(raw))
            wide = torch.tensor([float(x) for x in leaves], dtype=torch.float64)
            wide = wide.reshape(()) if isinstance(raw, numbers.Number) else wide
        sides.append(_stored_bound(pin, name, side, per_element(pin, name, f"bounds {side}", wide, shape, index,
                                                                 count), dtype))
    low, high = sides
    empty = low > high
    if bool(empty.any()):
        at = _first(empty)
        asked = (_wide_at(raw_low, at), _wide_at(raw_high, at))
        raise PinError(
            f"{pin!r}: no {dtype} value lies in the bounds [{asked[0]}, {asked[1]}] of element "
            f"{_coords(parameter, index, at)} of {name!r}; widen them (or pin that element to a value)"
        )
    return low.to(parameter.device), high.to(parameter.device)


def _wide_at(raw: Any, at: int) -> Any:
    if isinstance(raw, numbers.Number):
        return raw
    flat = raw.reshape(-1) if isinstance(raw, Tensor) else list(number_leaves(raw))
    return flat[at].item() if isinstance(flat, Tensor) and at < flat.numel() else (flat[at] if at < len(flat) else "?")


def _stored_bound(pin: Pin, name: str, side: str, wide: Tensor, dtype: torch.dtype) -> Tensor:
    """``wide`` (float64) in ``dtype``, rounded inwards; infinities become the dtype's extremes for integers."""
    finite = torch.isfinite(wide)
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        outside = finite & (wide.abs() > info.max)
        if bool(outside.any()):
            raise PinError(
                f"{pin!r}: bounds {side} {wide[outside][:3].tolist()} for {name!r} overflow {dtype} (largest finite: "
                f"{info.max:g}); use {'-' if side == 'low' else ''}math.inf for no {side} bound"
            )
        stored = wide.to(dtype)
        back = stored.to(torch.float64)
        wrong_way = (back < wide) if side == "low" else (back > wide)
        if bool(wrong_way.any()):
            towards = torch.full_like(stored, math.inf if side == "low" else -math.inf)
            stored = torch.where(wrong_way, torch.nextafter(stored, towards), stored)
        return stored
    info = torch.iinfo(dtype)
    outside = finite & ((wide < info.min) | (wide > info.max))
    if bool(outside.any()):
        raise PinError(
            f"{pin!r}: bounds {side} {wide[outside][:3].tolist()} for {name!r} are outside {dtype} "
            f"({info.min}..{info.max}); use {'-' if side == 'low' else ''}math.inf for no {side} bound"
        )
    rounded = torch.ceil(wide) if side == "low" else torch.floor(wide)
    rounded = rounded.clamp(info.min, info.max)  # infinities: the extremes
    return rounded.to(dtype)


def describe_bounds(low: Tensor, high: Tensor) -> str:
    """``"bounds [0, 0.5]"``, or the extremes when they vary per element."""
    lo, hi = low.min().item(), high.max().item()
    if bool((low == lo).all()) and bool((high == hi).all()):
        return f"bounds [{lo:g}, {hi:g}]"
    return f"bounds per element within [{lo:g}, {hi:g}]"
