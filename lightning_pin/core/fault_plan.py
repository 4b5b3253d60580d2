"""Resolve the fault-model fields of a pin (stuck bits, bounds) against one parameter.

Called by :func:`~lightning_pin.core.plan.resolve` for pins whose :attr:`~lightning_pin.Pin.kind`
is ``"stuck_bits"`` or ``"bounds"``. Everything here reads and never writes the module: a
rejected spec leaves every weight as it was. The results are tensors on the parameter's device,
one entry per selected element in the selection's order (or of the parameter's shape for a whole
tensor), which :func:`sort_like_index` then sorts along with the index.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_pin.core.bitwords import hex_word
from lightning_pin.core.errors import PinError
from lightning_pin.core.spec import Pin, check_bits, number_leaves
from lightning_pin.core.state import BITS_DTYPES

#: The exponent bits of each float type: a word with all of them at one is inf or NaN.
EXPONENT_BITS = {
    torch.float64: 0x7FF0000000000000,
    torch.float32: 0x7F800000,
    torch.bfloat16: 0x7F80,
    torch.float16: 0x7C00,
}


def bits_dtype(pin: Pin, name: str, dtype: torch.dtype) -> torch.dtype:
    """The signed integer type with ``dtype``'s bits, or a PinError for dtypes without float bits."""
    found = BITS_DTYPES.get(dtype)
    if found is None:
        raise PinError(
            f"{pin!r}: stuck bits on {name!r}, a {dtype} parameter: stuck bits are masks over the bits of a float "
            f"word ({', '.join(str(d) for d in BITS_DTYPES)}); pin integer or bool parameters with value= or bounds="
        )
    return found


def to_signed(value: int, width: int) -> int:
    """An unsigned ``width``-bit pattern as the signed integer with the same bits."""
    return value - (1 << width) if value >= 1 << (width - 1) else value


def stuck_masks(
    pin: Pin, name: str, parameter: Tensor, index: Tensor | None, raw_zero: Any, raw_one: Any, from_file: bool
) -> tuple[Tensor, Tensor]:
    """``(stuck_at_zero, stuck_at_one)`` for the selection, in the signed integer type of the dtype.

    Raises:
        PinError: masks on a parameter without float bits, wider than its dtype, of the wrong
            count or shape, bits stuck at 0 and 1 on one element, or stuck bits that alone make
            an element inf or NaN (every exponent bit stuck at one).
    """
    dtype = bits_dtype(pin, name, parameter.dtype)
    width = torch.iinfo(dtype).bits
    masks = []
    for field, raw in (("stuck_at_zero", raw_zero), ("stuck_at_one", raw_one)):
        if from_file:
            check_bits(pin, field, raw, f" for {name!r}")
        masks.append(_mask_tensor(pin, name, field, parameter, index, raw, dtype, width))
    zero, one = masks
    check_masks_hold(
        zero, one, parameter.dtype,
        overlap=lambda at, bits: (
            f"{pin!r}: stuck_at_zero and stuck_at_one overlap on element {_coords(parameter, index, at)} of "
            f"{name!r} (bits {bits}): a bit cannot be stuck at 0 and at 1"
        ),
        every_exponent=lambda at, ones: (
            f"{pin!r}: stuck_at_one={ones} on element {_coords(parameter, index, at)} of {name!r} sets every "
            f"exponent bit of {parameter.dtype} ({hex_word(EXPONENT_BITS[parameter.dtype], width)}): the element "
            "would be inf or NaN whatever training writes; leave at least one exponent bit free"
        ),
    )
    return zero.to(parameter.device), one.to(parameter.device)


def check_masks_hold(
    zero: Tensor, one: Tensor, dtype: torch.dtype, overlap: Callable[[int, str], str],
    every_exponent: Callable[[int, str], str]
) -> None:
    """Check that stuck-bit masks (per element, in the signed integer type of ``dtype``) can hold:
    no bit stuck at 0 and at 1, and not every exponent bit stuck at 1 (the element would be inf or
    NaN whatever training writes). Used for one pin's masks and for two pins' merged masks.

    The messages come from the caller, which knows the pins and the element: ``overlap(at, bits)``
    and ``every_exponent(at, ones)`` get the first bad element's flat position in the masks and, in
    hex, the bits stuck at both values or the bits stuck at 1.

    Raises:
        PinError: with the first message that applies.
    """
    width = torch.iinfo(zero.dtype).bits
    both = zero & one
    clash = both != 0
    if bool(clash.any()):
        at = _first(clash)
        raise PinError(overlap(at, hex_word(int(both.reshape(-1)[at]), width)))
    exponent = to_signed(EXPONENT_BITS[dtype], width)
    special = (one & exponent) == exponent
    if bool(special.any()):
        at = _first(special)
        raise PinError(every_exponent(at, hex_word(int(one.reshape(-1)[at]), width)))


def _mask_tensor(
    pin: Pin, name: str, field: str, parameter: Tensor, index: Tensor | None, raw: Any, dtype: torch.dtype, width: int
) -> Tensor:
    shape = tuple(parameter.shape)
    count = parameter.numel() if index is None else index.numel()
    if raw is None:
        return torch.zeros(shape if index is None else (count,), dtype=dtype)
    if isinstance(raw, Tensor):
        tensor = raw.detach().cpu()
        if tensor.dtype.itemsize * 8 == width and not tensor.dtype.is_signed and tensor.dtype != torch.bool:
            tensor = tensor.view(dtype)  # an unsigned word of the same width: the same bits
        if tensor.dtype == dtype:
            signed = tensor
        else:
            wide = tensor.to(torch.int64)
            too_wide = wide < 0
            if width < 64:
                too_wide |= (wide >> width) != 0
            _refuse_wide(pin, name, field, parameter, [int(x) for x in wide[too_wide][:3].tolist()], width)
            signed = torch.where(wide >= 1 << (width - 1), wide - (1 << width), wide).to(dtype) if width < 64 else wide
    else:
        leaves = [raw] if isinstance(raw, numbers.Integral) else list(number_leaves(raw))
        _refuse_wide(pin, name, field, parameter, [x for x in leaves if not 0 <= x < 1 << width], width)
        signed = torch.tensor([to_signed(int(x), width) for x in leaves], dtype=dtype)
        if isinstance(raw, numbers.Integral):
            signed = signed.reshape(())
    return _per_element(pin, name, field, signed, shape, index, count)


def _refuse_wide(pin: Pin, name: str, field: str, parameter: Tensor, bad: list[int], width: int) -> None:
    if bad:
        shown = ", ".join(hex(x) if x >= 0 else str(x) for x in bad[:3])
        raise PinError(
            f"{pin!r}: {field} for {name!r} holds {shown}, wider than {parameter.dtype} ({width} bits, masks "
            f"0x0..{hex_word((1 << width) - 1, width)})"
        )


def _per_element(
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
        sides.append(_stored_bound(pin, name, side, _per_element(pin, name, f"bounds {side}", wide, shape, index,
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


def sort_like_index(
    pin: Pin, name: str, user_index: Tensor, tensors: tuple[Tensor, Tensor], what: str
) -> tuple[Tensor, Tensor]:
    """Reorder per-element ``tensors`` (in the order of ``user_index``) to the sorted, unique index.

    Raises:
        PinError: the selection repeats an element with different entries.
    """
    order = torch.argsort(user_index.cpu(), stable=True)
    index = user_index.cpu()[order]
    unique, counts = torch.unique_consecutive(index, return_counts=True)
    out = []
    for tensor in tensors:
        tensor = tensor[order.to(tensor.device)]
        if unique.numel() != index.numel():
            first = tensor[(counts.cumsum(0) - counts).to(tensor.device)]
            if not torch.equal(tensor, first.repeat_interleave(counts.to(tensor.device))):
                raise PinError(f"{pin!r}: indices repeat an element of {name!r} with different {what}")
            tensor = first
        out.append(tensor)
    return out[0], out[1]


def describe_bits(zero: Tensor, one: Tensor, dtype: torch.dtype) -> str:
    """``"stuck at 1: 0x40000000, at 0: 0x00800000"``: the union of the masks (bits stuck somewhere)."""
    width = torch.iinfo(BITS_DTYPES[dtype]).bits
    parts = []
    for label, mask in (("1", one), ("0", zero)):
        union = _union(mask, width)
        if union:
            parts.append(f"{label}: {hex_word(union, width)}")
    return "stuck bits " + (", ".join(parts) if parts else "none")


def _union(mask: Tensor, width: int) -> int:
    flat = mask.reshape(-1).to(torch.int64)
    union = 0
    for bit in range(width):
        if bool(((flat >> bit) & 1).any()):
            union |= 1 << bit
    return union


def _first(flags: Tensor) -> int:
    return int(flags.reshape(-1).to(torch.int8).argmax())


def _coords(parameter: Tensor, index: Tensor | None, at: int) -> tuple[int, ...]:
    flat = at if index is None else int(index.reshape(-1)[at])
    return tuple(int(c) for c in torch.unravel_index(torch.tensor(flat), tuple(parameter.shape)))


#: Both resolvers, for the plan.
Resolver = Callable[..., tuple[Tensor, Tensor]]


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


def check_fault_conflict(first: Pin, a: Any, second: Pin, b: Any, name: str) -> None:
    """Two pins on one parameter at overlapping steps, at least one of them a fault model.

    A value and a fault, or stuck bits and bounds, on one element are an error (each undoes the
    other); stuck bits of two pins merge unless one sticks at 0 a bit the other sticks at 1 (or
    together they stick every exponent bit at 1); bounds of two pins intersect unless that is empty.

    Raises:
        PinError: naming both pins, the parameter and an element.
    """
    parameter = a.parameter
    a_pos, b_pos = shared_positions(a.index, b.index, parameter.numel())
    if a_pos.numel() == 0:
        return
    kinds = {a.kind, b.kind}
    flat = (a_pos if a.index is None else a.index.cpu().long()[a_pos])
    coords = _coords(parameter, None, int(flat[0]))
    both = f"{first!r} and {second!r}"
    if "value" in kinds or kinds == {"stuck_bits", "bounds"}:
        what = {"value": "a value", "stuck_bits": "stuck bits", "bounds": "bounds"}
        raise PinError(
            f"{both} put {what[a.kind]} and {what[b.kind]} on {a_pos.numel()} element(s) of {name!r} at "
            f"overlapping steps (e.g. {coords}): "
            + ("a value fixes every bit, so nothing is left to fault; " if "value" in kinds else
               "clamping can undo a stuck bit; ")
            + "select disjoint elements or separate their step windows"
        )
    if a.kind == "stuck_bits":
        zero = a.stuck_at_zero.reshape(-1).cpu()[a_pos] | b.stuck_at_zero.reshape(-1).cpu()[b_pos]
        one = a.stuck_at_one.reshape(-1).cpu()[a_pos] | b.stuck_at_one.reshape(-1).cpu()[b_pos]
        check_masks_hold(
            zero, one, parameter.dtype,
            overlap=lambda at, bits: (
                f"{both} stick bits {bits} of element {_coords(parameter, None, int(flat[at]))} of {name!r} at 0 "
                "and at 1 at overlapping steps"
            ),
            every_exponent=lambda at, _: (
                f"{both} together stick every exponent bit of element {_coords(parameter, None, int(flat[at]))} of "
                f"{name!r} at 1: it would be inf or NaN whatever training writes"
            ),
        )
        return
    low = torch.maximum(a.low.reshape(-1).cpu()[a_pos], b.low.reshape(-1).cpu()[b_pos])
    high = torch.minimum(a.high.reshape(-1).cpu()[a_pos], b.high.reshape(-1).cpu()[b_pos])
    empty = low > high
    if bool(empty.any()):
        at = _first(empty)
        raise PinError(
            f"{both} bound element {_coords(parameter, None, int(flat[at]))} of {name!r} at overlapping steps to "
            f"intervals that do not meet (together: [{low[at].item()}, {high[at].item()}])"
        )


def describe_bounds(low: Tensor, high: Tensor) -> str:
    """``"bounds [0, 0.5]"``, or the extremes when they vary per element."""
    lo, hi = low.min().item(), high.max().item()
    if bool((low == lo).all()) and bool((high == hi).all()):
        return f"bounds [{lo:g}, {hi:g}]"
    return f"bounds per element within [{lo:g}, {hi:g}]"


def check_fits(pin: Pin, name: str, selection: Any, dtype: torch.dtype) -> None:
    """Check that the stuck bits or bounds of ``selection`` (resolved on its parameter's dtype)
    still hold for ``dtype``, the dtype a trainer is about to cast the parameter to ("16-true").

    Raises:
        PinError: with the message resolving on a cast module would give.
    """
    shell = torch.empty(selection.parameter.shape, dtype=dtype, device="meta")  # a dtype and a shape
    index = None if selection.index is None else selection.index.cpu()
    if selection.kind == "stuck_bits":
        width = torch.iinfo(selection.stuck_at_zero.dtype).bits
        # The resolved masks as unsigned patterns (int64): what the user gave, for another width.
        zero, one = (m.detach().cpu().to(torch.int64) & ((1 << width) - 1) if width < 64 else m.detach().cpu()
                     for m in (selection.stuck_at_zero, selection.stuck_at_one))
        stuck_masks(pin, name, shell, index, zero, one, from_file=False)
    elif selection.kind == "bounds":
        low, high = (t.detach().cpu().to(torch.float64) for t in (selection.low, selection.high))
        bounds_for(pin, name, shell, index, low, high)
