"""The stuck-bits kind: chosen bits of each element's stored word always read 0 or 1.

``Pin(..., stuck_at_zero=M0, stuck_at_one=M1)``: after every optimizer step
``bits = (bits & ~M0) | M1`` on an integer view of the element's own bytes; the other bits keep
what the optimizer wrote, and gradients and optimizer statistics are left alone. Masks are
held in the signed integer type of the parameter's width (:data:`BITS_DTYPES`: int32 for
float32, so ``0x80000000`` is ``-2**31``), per element.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_pin.core.bitwords import describe_stuck, hex_word
from lightning_pin.core.errors import PinError
from lightning_pin.core.kinds._common import clip as _clip
from lightning_pin.core.kinds._common import coords as _coords
from lightning_pin.core.kinds._common import first as _first
from lightning_pin.core.kinds._common import is_int as _is_int
from lightning_pin.core.kinds._common import merge_paired, per_element, shared_positions, sort_with_index
from lightning_pin.core.kinds.base import Expected, Kind, Reader, Unreadable, show
from lightning_pin.core.selection import Selection
from lightning_pin.core.sharding import Target
from lightning_pin.core.spec import Pin, number_leaves

__all__ = [
    "BITS_DTYPES", "EXPONENT_BITS", "StuckBits", "bits_dtype", "check_bits", "check_masks_hold", "describe_bits",
    "overlapping_bits", "stuck_masks", "to_signed", "unsigned",
]


#: The signed integer type whose bits are a float type's bits (stuck-bit masks are held and saved in it).
BITS_DTYPES = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}
#: The exponent bits of each float type: a word with all of them at one is inf or NaN.
EXPONENT_BITS = {
    torch.float64: 0x7FF0000000000000,
    torch.float32: 0x7F800000,
    torch.bfloat16: 0x7F80,
    torch.float16: 0x7C00,
}


class StuckBits(Kind):
    """``bits = (bits & keep) | set`` on an integer view of the element's own bytes.

    The payload of a projection holds ``keep = ~stuck_at_zero`` and ``set = stuck_at_one`` per
    element (last dimension 2), in the signed integer type of the parameter's width.

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
    words = "stuck bits"
    off_words = "with stuck bits off"
    pin_fields = ("stuck_at_zero", "stuck_at_one")
    payload_fields = ("stuck_at_zero", "stuck_at_one")
    copy_words = "its stuck bits are bits of"

    # ------------------------------------------------------------------------------------
    # The spec

    @classmethod
    def check_spec(cls, pin: Pin) -> None:
        zero, one = pin.stuck_at_zero, pin.stuck_at_one
        for name, raw in (("stuck_at_zero", zero), ("stuck_at_one", one)):
            if isinstance(raw, Mapping):
                for key, entry in raw.items():
                    check_bits(pin, name, entry, f" for {key!r}")
            else:
                check_bits(pin, name, raw)
        if cls.claims(pin) and pin.value is not None:
            raise PinError(
                f"{pin!r}: value and stuck bits on the same pin: a value fixes every bit of the element; give either "
                "value= (the whole element) or stuck_at_zero= / stuck_at_one= (some of its bits)"
            )
        if cls.claims(pin) and pin.bounds is not None:
            raise PinError(
                f"{pin!r}: stuck bits and bounds on the same pin: clamping can undo a stuck bit and a stuck bit can "
                "leave the interval; put them on different elements (two pins)"
            )
        if not isinstance(zero, (Mapping, str, Path)) and not isinstance(one, (Mapping, str, Path)):
            both = overlapping_bits(zero, one)
            if both is not None:
                raise PinError(
                    f"{pin!r}: stuck_at_zero and stuck_at_one overlap ({both}): a bit cannot be stuck at 0 and at 1"
                )

    # ------------------------------------------------------------------------------------
    # The plan

    @classmethod
    def resolve(
        cls, pin: Pin, selection: Selection, read: Reader, warn: Callable[[str], Any], module: torch.nn.Module
    ) -> None:
        raws = []
        for field in ("stuck_at_zero", "stuck_at_one"):
            source = getattr(pin, field)
            raws.append(None if source is None else read(field, source))
        from_file = isinstance(pin.stuck_at_zero, (str, Path)) or isinstance(pin.stuck_at_one, (str, Path))
        masks = stuck_masks(pin, selection.name, selection.parameter, selection.index, raws[0], raws[1], from_file)
        zero, one = sort_with_index(pin, selection, masks, "stuck bits")
        device = selection.parameter.device
        selection.payload = {"stuck_at_zero": zero.to(device), "stuck_at_one": one.to(device)}

    @classmethod
    def describe(cls, selection: Selection) -> str:
        zero, one = selection.payload["stuck_at_zero"], selection.payload["stuck_at_one"]
        return describe_bits(zero, one, selection.parameter.dtype)

    @classmethod
    def check_fits(cls, pin: Pin, name: str, selection: Selection, dtype: torch.dtype) -> None:
        shell = torch.empty(selection.parameter.shape, dtype=dtype, device="meta")  # a dtype and a shape
        index = None if selection.index is None else selection.index.cpu()
        masks = selection.payload["stuck_at_zero"], selection.payload["stuck_at_one"]
        width = torch.iinfo(masks[0].dtype).bits
        # The resolved masks as unsigned patterns (int64): what the user gave, for another width.
        zero, one = (m.detach().cpu().to(torch.int64) & ((1 << width) - 1) if width < 64 else m.detach().cpu()
                     for m in masks)
        stuck_masks(pin, name, shell, index, zero, one, from_file=False)

    @classmethod
    def check_overlap(cls, first: Pin, a: Selection, second: Pin, b: Selection, name: str) -> None:
        """Stuck bits of two pins merge unless one sticks at 0 a bit the other sticks at 1, or
        together they stick every exponent bit at 1."""
        parameter = a.parameter
        a_pos, b_pos = shared_positions(a.index, b.index, parameter.numel())
        if a_pos.numel() == 0:
            return
        flat = a_pos if a.index is None else a.index.cpu().long()[a_pos]
        both = f"{first!r} and {second!r}"

        def merged(field: str) -> Tensor:
            return a.payload[field].reshape(-1).cpu()[a_pos] | b.payload[field].reshape(-1).cpu()[b_pos]

        check_masks_hold(
            merged("stuck_at_zero"), merged("stuck_at_one"), parameter.dtype,
            overlap=lambda at, bits: (
                f"{both} stick bits {bits} of element {_coords(parameter, None, int(flat[at]))} of {name!r} at 0 "
                "and at 1 at overlapping steps"
            ),
            every_exponent=lambda at, _: (
                f"{both} together stick every exponent bit of element {_coords(parameter, None, int(flat[at]))} of "
                f"{name!r} at 1: it would be inf or NaN whatever training writes"
            ),
        )

    @classmethod
    def merge(
        cls, name: str, parameter: torch.nn.Parameter, entries: Sequence[Selection],
        captured: Sequence[Optional[Tensor]] = (),
    ) -> StuckBits:
        """Stuck bits of several pins on one element combine: their masks are OR-ed."""
        dtype = entries[0].payload["stuck_at_zero"].dtype  # BITS_DTYPES[parameter.dtype], as resolved
        pairs = [(e.payload["stuck_at_zero"], e.payload["stuck_at_one"]) for e in entries]
        starts = (torch.zeros((), dtype=dtype), torch.zeros((), dtype=dtype))
        index, zero, one = merge_paired(parameter, [e.index for e in entries], pairs, starts, lambda a, b, side: a | b)
        return cls(Target(name, parameter, index, torch.stack([~zero, one], dim=-1)))  # keep = ~stuck_at_zero

    # ------------------------------------------------------------------------------------
    # The pin state

    @classmethod
    def check_saved(cls, payload: Mapping[str, Tensor], at: str, corrupt: Callable[[str], Exception]) -> None:
        zero, one = payload["stuck_at_zero"], payload["stuck_at_one"]
        for key, mask in (("stuck_at_zero", zero), ("stuck_at_one", one)):
            if mask.dtype not in BITS_DTYPES.values():
                raise corrupt(f"{at}: {key!r} must be an int16/int32/int64 tensor, got {show(mask)}")
        if zero.dtype != one.dtype or zero.shape != one.shape:
            raise corrupt(f"{at}: 'stuck_at_zero' and 'stuck_at_one' differ in dtype or shape")
        if bool((zero & one).any()):
            raise corrupt(f"{at}: a bit is stuck at zero and at one")

    # ------------------------------------------------------------------------------------
    # Fault-map files: masks as int64 bit patterns, 0 for no stuck bit

    map_fields = {"stuck_at_zero": 0, "stuck_at_one": 0}
    map_bits = True
    map_fold = {"stuck_at_zero": "or", "stuck_at_one": "or"}
    map_words = ("with stuck bits", "with stuck bits")  # elements

    # ------------------------------------------------------------------------------------
    # The restore kernel

    def _bits(self, tensor: Tensor) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        view, positions, payload = self.target.part(tensor)
        ints = view.view(payload.dtype)  # the same bytes: no copy, no rounding
        keep, set_ = self._halves(payload, ints.device, payload.dtype)
        return ints, positions, keep, set_

    def _flat(self, tensor: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        ints, positions, keep, set_ = self._bits(tensor)
        actual = ints.reshape(-1) if positions is None else ints.index_select(0, positions.to(ints.device))
        return actual, keep.reshape(-1), set_.reshape(-1)

    def kernel(self, tensor: Tensor) -> Callable[[], None]:
        ints, payload, index, scratch, put = self.gather(tensor, self.target.values.dtype)
        keep, set_ = self._halves(payload, ints.device, payload.dtype)
        if index is None:

            def stick_whole() -> None:
                ints.bitwise_and_(keep).bitwise_or_(set_)

            return stick_whole

        def stick() -> None:
            torch.index_select(ints, 0, index, out=scratch)
            scratch.bitwise_and_(keep).bitwise_or_(set_)
            put(0, index, scratch)

        return stick

    def drift(self, tensor: Tensor) -> Tensor:
        actual, keep, set_ = self._flat(tensor)
        before = actual.view(tensor.dtype)
        after = ((actual & keep) | set_).view(tensor.dtype)
        deviation = (before.double() - after.double()).abs()
        # inf - inf is NaN: a stuck bit that made an infinity finite (or one infinite) moved it infinitely.
        return torch.where(deviation.isnan() & (before.isinf() | after.isinf()), torch.inf, deviation).float()

    def off(self, tensor: Tensor) -> tuple[Tensor, Tensor, Expected]:
        """Elements whose stored word breaks a stuck bit.

        Raises:
            Unreadable: ``tensor`` does not store words of the masks' width (a stored tensor in
                another dtype: ``verify`` refuses such a copy first, see :attr:`copy_words`).
        """
        masks = self.target.values
        if not tensor.is_floating_point() or tensor.element_size() != masks.element_size():
            raise Unreadable("stuck bits", f"a {8 * masks.element_size()}-bit word")
        actual, keep, set_ = self._flat(tensor)
        off = ((actual & ~keep) | (~actual & set_)) != 0
        return actual.view(tensor.dtype), off, lambda position: _describe_bits(actual, keep, set_, position)

def _describe_bits(actual: Tensor, keep: Tensor, set_: Tensor, position: int) -> str:
    """``"bits 0x..., stuck at 1: 0x..., stuck at 0: 0x..., wrong: 0x..."`` for one element."""
    word, zero, one = int(actual[position]), int(~keep[position]), int(set_[position])
    return describe_stuck(word, zero, one, torch.iinfo(keep.dtype).bits)


# --------------------------------------------------------------------------------------------
# The masks: forms (no model) and resolution on one parameter


def check_bits(pin: Pin, name: str, raw: Any, where: str = "") -> None:
    """Stuck bits must be non-negative ints, sequences of them, an integer tensor, or a file path.

    How wide they may be depends on the parameter's dtype: the plan checks that.
    """
    if raw is None or isinstance(raw, (str, Path)):
        if isinstance(raw, (str, Path)) and where:
            raise PinError(f"{pin!r}: {name}{where} must be ints or an integer tensor, got the path {str(raw)!r}")
        return
    if isinstance(raw, torch.Tensor):
        if raw.dtype == torch.bool or raw.is_floating_point() or raw.is_complex():
            raise PinError(
                f"{pin!r}: {name}{where} is a {raw.dtype} tensor; bit masks are integer tensors (e.g. int64 holding "
                "0x80000000, or the int32 view of a float32 pattern)"
            )
        return
    if _is_int(raw):
        leaves: list[Any] = [raw]
    elif isinstance(raw, Sequence) and not isinstance(raw, bytes):
        leaves = list(number_leaves(raw))
        if not leaves:
            raise PinError(f"{pin!r}: {name}{where} is an empty sequence; give one int per selected element")
    else:
        raise PinError(
            f"{pin!r}: {name}{where} must be an int bit mask (e.g. 0x80000000), one int per selected element, an "
            f"integer tensor, a dict of them by parameter name or a .pt / .safetensors path; got {_clip(raw)}"
        )
    odd = [x for x in leaves if not _is_int(x)]
    if odd:
        raise PinError(f"{pin!r}: {name}{where} must hold ints (bit masks), got {_clip(odd[0])}")
    negative = [x for x in leaves if x < 0]
    if negative:
        raise PinError(
            f"{pin!r}: {name}{where} holds negative masks {negative[:3]}: masks are read as unsigned bit patterns; "
            f"write the sign bit of float32 as 0x80000000"
        )
def overlapping_bits(zero: Any, one: Any) -> str | None:
    """A description of the first bit stuck both at 0 and 1, where it can be told without a module."""

    def flat(raw: Any) -> list[int] | torch.Tensor | None:
        if raw is None:
            return None
        if isinstance(raw, torch.Tensor):
            return raw.detach().cpu().to(torch.int64).reshape(-1) if raw.dtype != torch.uint64 else None
        if _is_int(raw):
            return [raw]
        return [int(x) for x in number_leaves(raw)]

    a, b = flat(zero), flat(one)
    if a is None or b is None:
        return None
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ta = a if isinstance(a, torch.Tensor) else torch.tensor([x & 0xFFFFFFFFFFFFFFFF for x in a]).to(torch.int64)
        tb = b if isinstance(b, torch.Tensor) else torch.tensor([x & 0xFFFFFFFFFFFFFFFF for x in b]).to(torch.int64)
        if ta.numel() != tb.numel() and 1 not in (ta.numel(), tb.numel()):
            return None
        both = ta & tb
        hit = both != 0
        if not bool(hit.any()):
            return None
        at = int(hit.to(torch.int8).argmax())
        return f"element {at}: bits {int(both[at]) & 0xFFFFFFFFFFFFFFFF:#x}"
    if len(a) != len(b) and 1 not in (len(a), len(b)):
        return None
    for at in range(max(len(a), len(b))):
        both = a[at if len(a) > 1 else 0] & b[at if len(b) > 1 else 0]
        if both:
            return f"bits {both:#x}" if max(len(a), len(b)) == 1 else f"element {at}: bits {both:#x}"
    return None


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
    return per_element(pin, name, field, signed, shape, index, count)


def _refuse_wide(pin: Pin, name: str, field: str, parameter: Tensor, bad: list[int], width: int) -> None:
    if bad:
        shown = ", ".join(hex(x) if x >= 0 else str(x) for x in bad[:3])
        raise PinError(
            f"{pin!r}: {field} for {name!r} holds {shown}, wider than {parameter.dtype} ({width} bits, masks "
            f"0x0..{hex_word((1 << width) - 1, width)})"
        )


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


def unsigned(mask: Tensor) -> Tensor:
    """Bit masks as int64 patterns: the signed view of a 16- / 32-bit word as the unsigned pattern it stands for."""
    if mask.dtype in (torch.int16, torch.int32):
        return mask.to(torch.int64) & ((1 << (8 * mask.element_size())) - 1)
    return mask.to(torch.int64)
