"""The quantized-code kind: stuck bits in the integer code of a quantized weight.

``Pin(..., stuck_at_zero=M0, stuck_at_one=M1, code=QuantCode(bits=8, scale=s))``: the weight is
stored as an integer code ``q = clamp(round(w / s) + zero_point, qmin, qmax)`` (an int8 / int4
accelerator's weight memory) and bits of that code are stuck. After every optimizer step each
selected element is written ``w = (q' - zero_point) * s`` with ``q' = (q & ~M0) | M1`` on the code's
``bits``-bit pattern (two's complement for a signed code): its code reads the stuck bits and the
weight is exactly the dequantized faulty code. The other bits of the code keep training:
gradients and optimizer statistics are left alone, as for stuck bits of a float word.

Where the arithmetic happens: ``w / s``, the rounding (half to even, as ``torch.round``) and
``(q' - zero_point) * s`` are computed in float32 for parameters of 32 bits or fewer and in
float64 for float64 parameters, the scale held in that dtype; the product is rounded once to the
parameter's dtype (for a float32 parameter: computed in float32). :func:`dequantize` is that
arithmetic, shared with :func:`lightning_pin.faults.quantize` and ``lightning-pin check``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from lightning_pin.core.errors import PinError
from lightning_pin.core.kinds._common import coords as _coords
from lightning_pin.core.kinds._common import first as _first
from lightning_pin.core.kinds._common import is_int as _is_int
from lightning_pin.core.kinds._common import merge_paired, per_element, shared_positions, sort_with_index
from lightning_pin.core.kinds.base import Expected, Kind, Reader, Unreadable
from lightning_pin.core.selection import Selection
from lightning_pin.core.sharding import Target, is_sharded
from lightning_pin.core.spec import Pin, number_leaves

__all__ = [
    "QuantCode", "QuantizedCode", "Scale", "channels", "check_code", "code_of", "codes_of", "compute_dtype",
    "dequantize", "named_scale", "stick",
]


Scale = Union[float, Tensor, str]


@dataclasses.dataclass(frozen=True, eq=False)
class QuantCode:
    """How a parameter is stored: ``bits``-bit integer codes with a scale and a zero point.

    The code of an element is ``q = clamp(round(w / scale) + zero_point, qmin, qmax)``, with
    ``[qmin, qmax] = [-2**(bits-1), 2**(bits-1) - 1]`` for a signed code (two's complement) or
    ``[0, 2**bits - 1]``; its weight is ``(q - zero_point) * scale``.

    Args:
        bits: Bits of the code, 2 to 16.
        scale: A positive number (one scale for the tensor), a 1-D tensor of positive scales, one
            per index along ``axis`` (per-channel), or the name of a parameter or buffer of the
            pinned module (a learned scale, as in LSQ: read at every restore; one entry, or one
            per index along ``axis``).
        zero_point: The code of 0.0, an integer in ``[qmin, qmax]``.
        axis: The dimension a per-channel scale runs along (None: one scale).
        signed: Two's complement codes (True) or unsigned ones.

    Raises:
        PinError: at construction, for bits outside 2..16, a scale that is not positive and
            finite (or an empty name), a tensor scale that is not 1-D or lacks an ``axis``, a
            zero point outside the code's range, or fields of the wrong type.

    Example::

        >>> code = QuantCode(bits=8, scale=0.5)
        >>> (code.qmin, code.qmax), code.describe()
        ((-128, 127), 'int8 code (scale 0.5)')
        >>> QuantCode(bits=4, scale="fc.weight_scale", signed=False).describe()
        "uint4 code (scale 'fc.weight_scale')"
    """

    bits: int = 8
    scale: Optional[Scale] = None
    zero_point: int = 0
    axis: Optional[int] = None
    signed: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.scale, Tensor):
            object.__setattr__(self, "scale", self.scale.detach().cpu().clone())
        check_code(self)

    @classmethod
    def from_config(cls, config: QuantCode | Mapping[str, Any]) -> QuantCode:
        """A ``QuantCode`` from itself or a mapping of its fields (Hydra / YAML: ``{bits: 8, scale: 0.01}``).

        Raises:
            PinError: ``config`` is neither, or has keys that are not fields of ``QuantCode``.
        """
        if isinstance(config, QuantCode):
            return config
        if not isinstance(config, Mapping):
            raise PinError(f"code must be a QuantCode or a mapping of its fields, got {type(config).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(map(str, config)) - set(names) - {"_target_"})
        if unknown:
            raise PinError(f"code {dict(config)!r} has unknown keys {unknown}; the fields of a QuantCode are {names}")
        scale = config.get("scale")
        if isinstance(scale, Sequence) and not isinstance(scale, str):
            scale = torch.tensor([float(s) for s in scale], dtype=torch.float64)
        fields = {k: config[k] for k in names if k in config}
        if "scale" in config:
            fields["scale"] = scale
        return cls(**fields)

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1)) if self.signed else 0

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.signed else (1 << self.bits) - 1

    @property
    def named(self) -> bool:
        """Whether the scale is the name of a tensor of the module (read at every restore)."""
        return isinstance(self.scale, str)

    def describe(self) -> str:
        """``"int8 code (scale 0.01)"``: the code's type and its scale in words."""
        if self.named:
            scale = repr(self.scale)
        elif isinstance(self.scale, Tensor) and self.scale.numel() > 1:
            scale = f"{self.scale.numel()} scales along axis {self.axis}"
        else:
            scale = f"{float(self.scale):g}"
        zero = f", zero point {self.zero_point}" if self.zero_point else ""
        return f"{'' if self.signed else 'u'}int{self.bits} code (scale {scale}{zero})"

    def __repr__(self) -> str:
        scale = self.scale
        if isinstance(scale, Tensor):
            scale = f"tensor({scale.tolist()})" if scale.numel() <= 6 else f"tensor(shape={tuple(scale.shape)})"
        else:
            scale = repr(scale)
        defaults = (("zero_point", 0), ("axis", None), ("signed", True))
        extra = "".join(f", {name}={getattr(self, name)!r}" for name, default in defaults
                        if getattr(self, name) != default)
        return f"QuantCode(bits={self.bits}, scale={scale}{extra})"


def check_code(code: QuantCode) -> None:
    """The checks of a :class:`QuantCode` that need no module (at construction)."""
    bits = code.bits
    if not _is_int(bits) or not 2 <= bits <= 16:
        raise PinError(f"{code!r}: bits must be an integer from 2 to 16, got {bits!r}")
    if not isinstance(code.signed, bool):
        raise PinError(f"{code!r}: signed must be True or False, got {code.signed!r}")
    if code.axis is not None and not _is_int(code.axis):
        raise PinError(f"{code!r}: axis must be None or an integer (the dimension of per-channel scales)")
    scale = code.scale
    if scale is None:
        raise PinError("QuantCode needs a scale: a positive number, a tensor of per-channel scales, or the name of "
                       "a parameter or buffer of the module (a learned scale)")
    if isinstance(scale, str):
        if not scale:
            raise PinError(f"{code!r}: the scale's name is empty; name a parameter or buffer of the module")
    elif isinstance(scale, Tensor):
        if not scale.is_floating_point() or scale.ndim > 1 or scale.numel() == 0:
            raise PinError(
                f"{code!r}: a tensor scale must be a non-empty 0-D or 1-D float tensor (one scale per index along "
                f"axis), got a {scale.dtype} tensor of shape {tuple(scale.shape)}"
            )
        bad = ~(torch.isfinite(scale) & (scale > 0))
        if bool(bad.any()):
            raise PinError(f"{code!r}: scale {scale.reshape(-1)[_first(bad)].item()!r} (entry {_first(bad)}) is not "
                           "a positive finite number; every scale must be > 0 and finite")
        if scale.numel() > 1 and code.axis is None:
            raise PinError(f"{code!r}: {scale.numel()} per-channel scales need the axis they run along (axis=0 for "
                           "the output channels of a conv or linear weight)")
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise PinError(f"{code!r}: scale must be a number, a tensor or a name, got {type(scale).__name__}")
    elif not (math.isfinite(float(scale)) and float(scale) > 0):
        raise PinError(f"{code!r}: scale {scale!r} is not a positive finite number; a scale must be > 0 and finite")
    if not _is_int(code.zero_point) or not code.qmin <= code.zero_point <= code.qmax:
        raise PinError(f"{code!r}: zero_point must be an integer in [{code.qmin}, {code.qmax}] (the code's range), "
                       f"got {code.zero_point!r}")


# --------------------------------------------------------------------------------------------
# The arithmetic (one place: the kernel, quantize(), check)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype codes are computed in for a parameter of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def codes_of(weights: Tensor, scale: Tensor, zero_point: int, qmin: int, qmax: int) -> Tensor:
    """``clamp(round(w / s) + zero_point, qmin, qmax)`` as int32 (``weights``, ``scale`` in the compute dtype)."""
    return torch.clamp(torch.round(weights / scale) + zero_point, qmin, qmax).to(torch.int32)


def stick(codes: Tensor, zero: Tensor, one: Tensor, bits: int, signed: bool) -> Tensor:
    """``q' = (q & ~M0) | M1`` on the ``bits``-bit pattern of the int32 ``codes`` (two's complement if signed)."""
    full = (1 << bits) - 1
    pattern = ((codes & full) & ~zero) | one
    if signed:
        pattern = pattern - ((pattern >> (bits - 1)) & 1) * (1 << bits)
    return pattern


def dequantize(codes: Tensor, scale: Tensor, zero_point: int, dtype: torch.dtype) -> Tensor:
    """``(q - zero_point) * s`` in the scale's (compute) dtype, rounded once to ``dtype``."""
    return ((codes - zero_point).to(scale.dtype) * scale).to(dtype)


def channels(shape: Sequence[int], axis: Optional[int], flat: Tensor) -> Tensor:
    """The index along ``axis`` of each row-major position ``flat`` (zeros when ``axis`` is None)."""
    if axis is None:
        return torch.zeros(flat.shape, dtype=torch.int64)
    stride = 1
    for size in shape[axis + 1:]:
        stride *= size
    return (flat.long() // stride) % shape[axis]


# --------------------------------------------------------------------------------------------
# The kind


class QuantizedCode(Kind):
    """``w = (((q & ~M0) | M1) - zero_point) * s`` with ``q`` the element's code: stuck code bits.

    The kernel holds the merged masks (last dimension 2: ``stuck_at_zero``, ``stuck_at_one``,
    int32 patterns of the code's bits), each element's index into the scale (its channel), and
    the scale: a fixed vector in the compute dtype, or the module's named tensor, read at every
    restore (no host read: the step stays sync-free).

    Example::

        >>> import torch
        >>> from lightning_pin.core.sharding import Target
        >>> weight = torch.nn.Parameter(torch.tensor([0.5, -0.25, 1.0]))
        >>> masks = torch.tensor([[0, 0x01]], dtype=torch.int32)           # bit 0 of the code stuck at 1
        >>> kernel = QuantizedCode(Target("w", weight, torch.tensor([1]), masks), QuantCode(8, 0.25),
        ...                        torch.tensor([0]), torch.tensor([0.25]))
        >>> kernel.apply(weight.data)                                      # code -1 = 0xff: bit 0 already 1
        >>> weight.data
        tensor([ 0.5000, -0.2500,  1.0000])
        >>> weight.data[1] = 0.0; kernel.apply(weight.data); weight.data   # code 0 -> 1: 0.25
        tensor([0.5000, 0.2500, 1.0000])
    """

    kind = "quant_code"
    words = "stuck code bits"
    off_words = "with stuck code bits off"
    pin_fields = ("code",)
    #: Per element: the masks (int32 code-bit patterns) and the element's channel (int64);
    #: per selection: the scales (compute dtype; empty for a named scale), the code's
    #: ``[bits, zero_point, signed, axis or -1]`` (int64) and the scale's name (UTF-8, uint8).
    payload_fields = ("stuck_at_zero", "stuck_at_one", "channel", "scale", "spec", "scale_name")
    selection_fields = ("scale", "spec", "scale_name")
    named_fields = {"scale": "scale_name"}  # a learned scale: stored beside the weight, by its name
    saved_owner = "the code on "
    copy_words = "its codes dequantize to"
    mixed_reason = "a quantized code rewrites the whole element at every step, so the other pin would be undone; "

    # ------------------------------------------------------------------------------------
    # The spec

    @classmethod
    def check_spec(cls, pin: Pin) -> None:
        if pin.code is None:
            return
        if not isinstance(pin.code, QuantCode):
            raise PinError(f"{pin!r}: code must be a QuantCode (or a mapping of its fields), got "
                           f"{type(pin.code).__name__}")
        if pin.value is not None:
            raise PinError(f"{pin!r}: code= and value= on the same pin: a value fixes the whole element, a code's "
                           "stuck bits only some bits of its code; give one of them (two pins on other elements)")
        if pin.bounds is not None:
            raise PinError(f"{pin!r}: code= and bounds= on the same pin: clamping can undo a stuck code bit; put "
                           "them on different elements (two pins)")
        masks = [getattr(pin, field) for field in ("stuck_at_zero", "stuck_at_one")]
        if all(raw is None or (not isinstance(raw, (Mapping, str, Path)) and _no_bit(raw)) for raw in masks):
            # Such a pin would only snap the selected elements onto the code's grid at every step, silently.
            raise PinError(f"{pin!r}: code= without a stuck bit (no stuck_at_zero= / stuck_at_one=, or masks of 0) "
                           "marks no fault; it would only move the elements onto the code's grid. To train on the "
                           "grid use lightning_pin.faults.quantize(model, params, code); for faulty code bits give "
                           "stuck_at_zero= / stuck_at_one=")
        for field in ("stuck_at_zero", "stuck_at_one"):
            raw = getattr(pin, field)
            if raw is not None and not isinstance(raw, (Mapping, str, Path)):
                wide = _too_wide(raw, pin.code.bits)
                if wide is not None:
                    raise PinError(f"{pin!r}: {field} holds {wide:#x}, wider than the {pin.code.bits}-bit code "
                                   f"(masks 0x0..{(1 << pin.code.bits) - 1:#x})")

    # ------------------------------------------------------------------------------------
    # The plan

    @classmethod
    def resolve(
        cls, pin: Pin, selection: Selection, read: Reader, warn: Callable[[str], Any], module: nn.Module
    ) -> None:
        code, name, parameter = pin.code, selection.name, selection.parameter
        if not parameter.is_floating_point():
            raise PinError(f"{pin!r}: code= on {name!r}, a {parameter.dtype} parameter: a quantized code "
                           "describes how a float weight is stored; pin integer parameters with value= or bounds=")
        if code.axis is not None and not -parameter.ndim <= code.axis < max(parameter.ndim, 1):
            raise PinError(f"{pin!r}: axis {code.axis} of {code!r} for {name!r} of shape {tuple(parameter.shape)}")
        axis = None if code.axis is None else code.axis % parameter.ndim
        count = parameter.numel() if selection.index is None else selection.index.numel()
        shape = tuple(parameter.shape)
        masks = []
        for field in ("stuck_at_zero", "stuck_at_one"):
            source = getattr(pin, field)
            raw = None if source is None else read(field, source)
            masks.append(_mask(pin, name, field, raw, code.bits, shape, selection.index, count))
        zero, one = sort_with_index(pin, selection, tuple(masks), "stuck code bits")
        both = zero & one
        if bool((both != 0).any()):
            at = _first(both != 0)
            raise PinError(f"{pin!r}: stuck_at_zero and stuck_at_one overlap on element "
                           f"{_coords(parameter, selection.index, at)} of {name!r} (code bits "
                           f"{int(both.reshape(-1)[at]):#x}): a bit cannot be stuck at 0 and at 1")
        cdt = compute_dtype(parameter.dtype)
        size = 1 if axis is None else shape[axis]
        if code.named:
            scale_tensor = named_scale(pin, code, module, name, size)
            fixed = torch.zeros(0, dtype=cdt)
            selection.context["scale"] = scale_tensor
            largest = scale_tensor.detach().abs().max().to(cdt)
        else:
            fixed = torch.as_tensor(code.scale).reshape(-1).to(cdt)
            if fixed.numel() not in (1, size) or (fixed.numel() > 1 and axis is None):
                raise PinError(f"{pin!r}: {fixed.numel()} scales for {name!r}, whose axis {code.axis} has {size} "
                               f"entries: give one scale per index along the axis (or one number)")
            if fixed.numel() == 1 and size > 1:
                fixed = fixed.expand(size).clone()
            if not bool((torch.isfinite(fixed) & (fixed > 0)).all()):
                raise PinError(f"{pin!r}: the scale of {code!r} is 0 or infinite in {cdt}: scales must be positive "
                               f"and finite in the dtype codes are computed in")
            largest = fixed.max()
        extreme = max(code.qmax - code.zero_point, code.zero_point - code.qmin)
        if not math.isfinite(float((largest * extreme).to(parameter.dtype))):
            raise PinError(f"{pin!r}: codes of {code!r} overflow {parameter.dtype} on {name!r} (the largest is "
                           f"{extreme} x {float(largest):g})")
        flat = torch.arange(parameter.numel()) if selection.index is None else selection.index.cpu().long()
        device = parameter.device
        selection.context["code"] = dataclasses.replace(code, axis=axis)  # the axis counted from 0
        selection.payload = {
            "stuck_at_zero": zero.to(device), "stuck_at_one": one.to(device),
            "channel": channels(shape, axis, flat).reshape(zero.shape).to(device),
            "scale": fixed.to(device),
            "spec": torch.tensor([code.bits, code.zero_point, int(code.signed), -1 if axis is None else axis]),
            "scale_name": torch.tensor(list(code.scale.encode()) if code.named else [], dtype=torch.uint8),
        }

    @classmethod
    def describe(cls, selection: Selection) -> str:
        code = code_of(selection.payload, selection.parameter)
        zero, one = (int(_union(selection.payload[f])) for f in ("stuck_at_zero", "stuck_at_one"))
        width = max(2, (code.bits + 3) // 4)
        return f"{code.describe()}, stuck bits at 1: 0x{one:0{width}x} / at 0: 0x{zero:0{width}x}"

    @classmethod
    def check_fits(cls, pin: Pin, name: str, selection: Selection, dtype: torch.dtype) -> None:
        if not dtype.is_floating_point:
            raise PinError(f"{pin!r}: code= on {name!r}, cast to {dtype}: codes describe float weights")

    @classmethod
    def check_overlap(cls, first: Pin, a: Selection, second: Pin, b: Selection, name: str) -> None:
        """Two code pins on one parameter must describe the same code (one weight memory); their
        stuck bits merge unless one sticks at 0 a bit the other sticks at 1."""
        for field in ("spec", "scale", "scale_name"):
            if not torch.equal(a.payload[field].cpu(), b.payload[field].cpu()):
                raise PinError(f"{first!r} and {second!r} give {name!r} different codes ({first.code!r} and "
                               f"{second.code!r}) at overlapping steps: a parameter is stored in one code")
        a_pos, b_pos = shared_positions(a.index, b.index, a.parameter.numel())
        if a_pos.numel() == 0:
            return
        zero = a.payload["stuck_at_zero"].reshape(-1).cpu()[a_pos] | b.payload["stuck_at_zero"].reshape(-1).cpu()[b_pos]
        one = a.payload["stuck_at_one"].reshape(-1).cpu()[a_pos] | b.payload["stuck_at_one"].reshape(-1).cpu()[b_pos]
        clash = (zero & one) != 0
        if bool(clash.any()):
            at = _first(clash)
            flat = a_pos if a.index is None else a.index.cpu().long()[a_pos]
            element = _coords(a.parameter, None, int(flat[at]))
            raise PinError(f"{first!r} and {second!r} stick code bits {int((zero & one)[at]):#x} of element "
                           f"{element} of {name!r} at 0 and at 1 at overlapping steps")

    @classmethod
    def merge(
        cls, name: str, parameter: nn.Parameter, entries: Sequence[Selection],
        captured: Sequence[Optional[Tensor]] = (),
    ) -> QuantizedCode:
        if is_sharded(parameter):
            raise PinError(f"quantized codes on {name!r}, a sharded parameter (FSDP2), are not supported: its scale "
                           "would have to be gathered at every step; pin it under DDP or in one process")
        pairs = [(e.payload["stuck_at_zero"], e.payload["stuck_at_one"]) for e in entries]
        zeros = torch.zeros((), dtype=torch.int32)
        index, zero, one = merge_paired(parameter, [e.index for e in entries], pairs, (zeros, zeros),
                                        lambda a, b, side: a | b)
        # Sync-free (it runs when a `when` pin toggles): the code from the context, not the payload
        # (a saved form, read by check / diff, has no context: the code from its payload).
        first = entries[0]
        code = first.context.get("code") or code_of(first.payload, parameter)
        if len(entries) == 1:
            channel = first.payload["channel"]
        else:
            flat = torch.arange(parameter.numel()) if index is None else index.cpu().long()
            channel = channels(tuple(parameter.shape), code.axis, flat).to(parameter.device)
        # A learned scale: the module's tensor (context), or the artifact's that stored_bind read
        # beside a stored one (empty if none: off refuses to read the code then).
        scale = first.context.get("scale", first.payload["scale"])
        return cls(Target(name, parameter, index, torch.stack([zero.reshape(-1), one.reshape(-1)], dim=-1)),
                   code, channel, scale)

    # ------------------------------------------------------------------------------------
    # The pin state

    @classmethod
    def check_saved(cls, payload: Mapping[str, Tensor], at: str, corrupt: Callable[[str], Exception]) -> None:
        spec, zero, one = payload["spec"], payload["stuck_at_zero"], payload["stuck_at_one"]
        if spec.dtype != torch.int64 or tuple(spec.shape) != (4,) or not 2 <= int(spec[0]) <= 16:
            raise corrupt(f"{at}: 'spec' must be an int64 tensor [bits 2..16, zero_point, signed, axis]")
        if zero.dtype != torch.int32 or one.dtype != torch.int32 or zero.shape != one.shape:
            raise corrupt(f"{at}: 'stuck_at_zero' and 'stuck_at_one' must be int32 code-bit masks of one shape")
        if bool(((zero | one) >> int(spec[0])).ne(0).any()) or bool((zero & one).ne(0).any()):
            raise corrupt(f"{at}: code-bit masks wider than the code, or a bit stuck at zero and at one")
        scale, name = payload["scale"], payload["scale_name"]
        if name.dtype != torch.uint8 or (name.numel() == 0) == (scale.numel() == 0):
            raise corrupt(f"{at}: a code holds either fixed scales or the name of a learned one")
        if scale.numel() and not (scale.is_floating_point() and bool((torch.isfinite(scale) & (scale > 0)).all())):
            raise corrupt(f"{at}: scales must be positive and finite")

    # ------------------------------------------------------------------------------------
    # Fault-map files: the code-bit masks as int64 patterns (0: no stuck bit) and the code

    map_fields = {"code_stuck_at_zero": 0, "code_stuck_at_one": 0}
    map_bits = True
    map_fold = {"code_stuck_at_zero": "or", "code_stuck_at_one": "or"}
    map_words = ("with stuck code bits", "with stuck code bits")
    bit_words = "code bits"

    map_spec_fields = ("code", "code_scale", "code_scale_name")

    @classmethod
    def map_entries(cls, pin: Pin, selection: Optional[Selection]) -> dict[str, Any]:
        """The code-bit masks (``code_stuck_at_zero`` / ``code_stuck_at_one``, int64) and, per parameter,
        ``code``: int64 ``[bits, zero_point, signed, has axis, axis]``; ``code_scale`` (float64) or
        ``code_scale_name`` (UTF-8 bytes, uint8) for a learned scale."""
        if selection is None:
            code = pin.code
            entries: dict[str, Any] = {"code_stuck_at_zero": pin.stuck_at_zero, "code_stuck_at_one": pin.stuck_at_one}
        else:
            code = selection.context["code"]
            entries = {f"code_{f}": selection.payload[f].detach().cpu().reshape(-1).to(torch.int64)
                       for f in ("stuck_at_zero", "stuck_at_one")}
        entries["code"] = torch.tensor([code.bits, code.zero_point, int(code.signed), int(code.axis is not None),
                                        0 if code.axis is None else code.axis], dtype=torch.int64)
        if code.named:
            entries["code_scale_name"] = torch.tensor(list(code.scale.encode()), dtype=torch.uint8)
        else:
            entries["code_scale"] = torch.as_tensor(code.scale).detach().cpu().reshape(-1).to(torch.float64)
        return entries

    @classmethod
    def map_pin(
        cls, pattern: str, fields: Mapping[str, Tensor], marked: Tensor, select: dict[str, Any],
        spec: Mapping[str, Tensor], where: str,
    ) -> Pin:
        if not spec:
            raise PinError(f"load_fault_map: {pattern!r} has stuck code bits but the file holds no code for it")
        raw = spec.get("code")
        if raw is None or raw.dtype != torch.int64 or tuple(raw.shape) != (5,):
            raise PinError(f"{where}: a code must be an int64 tensor [bits, zero_point, signed, has axis, axis]")
        bits, zero_point, signed, has_axis, axis = (int(x) for x in raw)
        if "code_scale_name" in spec:
            scale: Scale = bytes(spec["code_scale_name"].tolist()).decode()
        elif "code_scale" in spec:
            values = spec["code_scale"]
            scale = float(values[0]) if values.numel() == 1 else values.clone()
        else:
            raise PinError(f"{where}: a code without its scale (code_scale, or code_scale_name for a learned one)")
        code = QuantCode(bits, scale, zero_point, axis if has_axis else None, bool(signed))
        masks = {f: fields[f"code_{f}"][marked] for f in ("stuck_at_zero", "stuck_at_one") if f"code_{f}" in fields}
        return Pin(pattern, code=code, **masks, **select)

    # ------------------------------------------------------------------------------------
    # The restore kernel

    def __init__(self, target: Target, code: QuantCode, channel: Tensor, scale: Tensor) -> None:
        super().__init__(target)
        self.code = code
        self.channel = channel.reshape(-1)
        #: The fixed scales (compute dtype) or the module's named tensor (read at every restore).
        self.scale = scale
        self._compute = compute_dtype(target.parameter.dtype)

    def _scales(self, device: torch.device) -> Tensor:
        scale = self.scale.detach().reshape(-1).to(device=device, dtype=self._compute)
        if scale.numel() == 1:
            return scale.expand(self.channel.numel())
        return scale.index_select(0, self.channel.to(device))

    def _codes(self, flat: Tensor, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(codes, s, zero, one)`` of the elements ``flat`` (in the selection's order)."""
        s = self._scales(device)
        zero, one = self._halves(self.target.values, device, torch.int32)
        code = self.code
        return codes_of(flat.to(self._compute), s, code.zero_point, code.qmin, code.qmax), s, zero, one

    def _held(self, flat: Tensor, device: torch.device) -> Tensor:
        """What the elements ``flat`` must hold: their dequantized faulty codes, in ``flat``'s dtype."""
        codes, s, zero, one = self._codes(flat, device)
        code = self.code
        return dequantize(stick(codes, zero, one, code.bits, code.signed), s, code.zero_point, flat.dtype)

    def kernel(self, tensor: Tensor) -> Callable[[], None]:
        # The constants of _held (scales per element, code-bit masks) bound once: the restore is then
        # the arithmetic alone. A learned scale (code.named) is read at every restore, in the call.
        view, _, index, scratch, put = self.gather(tensor)
        # A whole tensor is worked on flat, in row-major order (the order of its channels): in place
        # where it is contiguous, else in a contiguous copy read and written back at every call.
        strided = index is None and not view.is_contiguous()
        if index is None:
            scratch = torch.empty(view.shape, dtype=view.dtype, device=view.device) if strided else view
            scratch = scratch.view(-1)
        device, dtype, compute = view.device, view.dtype, self._compute
        code = self.code
        zero, one = self._halves(self.target.values, device, torch.int32)
        zero_point, qmin, qmax, bits, signed = code.zero_point, code.qmin, code.qmax, code.bits, code.signed
        keep = ((1 << bits) - 1) & ~zero  # stick()'s (q & full) & ~zero in one mask
        fixed = None if code.named else self._scales(device)
        learned, channel = self.scale, self.channel.to(device)

        def restore() -> None:
            if index is not None:
                torch.index_select(view, 0, index, out=scratch)
            elif strided:
                scratch.view(view.shape).copy_(view)
            s = fixed
            if s is None:  # a learned scale: what the module holds now (_scales)
                s = learned.detach().reshape(-1).to(device=device, dtype=compute)
                s = s.expand(channel.numel()) if s.numel() == 1 else s.index_select(0, channel)
            codes = torch.clamp(torch.round(scratch.to(compute) / s) + zero_point, qmin, qmax).to(torch.int32)
            pattern = (codes & keep) | one
            if signed:
                pattern = pattern - ((pattern >> (bits - 1)) & 1) * (1 << bits)
            scratch.copy_(((pattern - zero_point).to(compute) * s).to(dtype))
            if index is not None:
                put(0, index, scratch)
            elif strided:
                view.copy_(scratch.view(view.shape))

        return restore

    def drift(self, tensor: Tensor) -> Tensor:
        _, _, _, actual = self.elements_of(tensor)
        deviation = (actual.double() - self._held(actual, actual.device).double()).abs()
        return deviation.float()

    def off(self, tensor: Tensor) -> tuple[Tensor, Tensor, Expected]:
        """Elements that are not their dequantized faulty codes; in a tensor of integers (a deployed
        artifact's stored codes: int8 / uint8 / int4 ONNX initializers, torchao's qdata) the stuck
        bits are read in the codes themselves, no scale needed.

        Raises:
            Unreadable: a float ``tensor`` whose learned scale was not read beside it (see
                :meth:`stored_bind`), or a tensor of neither floats nor integers.
        """
        _, _, _, actual = self.elements_of(tensor)
        code = self.code
        if not actual.is_floating_point() and not actual.is_complex() and actual.dtype != torch.bool:
            codes = actual.to(torch.int32)
            zero, one = (half.reshape(-1) for half in self._halves(self.target.values, codes.device, torch.int32))
            held = stick(codes, zero, one, code.bits, code.signed)
            return actual, held != codes, lambda i: _describe_stored(codes, zero, one, held, code.bits, i)
        if self.scale.numel() == 0:
            raise Unreadable("stuck code bits", f"a code whose scale {code.scale!r} is stored beside it")
        if not actual.is_floating_point():
            raise Unreadable("stuck code bits", "a float weight")
        codes, s, zero, one = self._codes(actual, actual.device)
        held = dequantize(stick(codes, zero, one, code.bits, code.signed), s, code.zero_point, actual.dtype)
        off = held != actual
        return actual, off, lambda i: _describe_code(codes, zero, one, held, code.bits, i)

def _describe_code(codes: Tensor, zero: Tensor, one: Tensor, held: Tensor, bits: int, i: int) -> str:
    """``"code 0x5a, stuck at 1: 0x01, stuck at 0: 0x40, wrong: 0x01; expected 0.25"`` for one element."""
    width = max(2, (bits + 3) // 4)
    full = (1 << bits) - 1
    word, z, o = int(codes[i]) & full, int(zero[i]), int(one[i])
    wrong = ((word & z) | (~word & o)) & full
    parts = [f"code 0x{word:0{width}x}"]
    if o:
        parts.append(f"stuck at 1: 0x{o:0{width}x}")
    if z:
        parts.append(f"stuck at 0: 0x{z:0{width}x}")
    parts.append(f"wrong: 0x{wrong:0{width}x}" if wrong else "off the code's grid")
    return ", ".join(parts) + f"; expected {held[i].item()!r}"


def _describe_stored(codes: Tensor, zero: Tensor, one: Tensor, held: Tensor, bits: int, i: int) -> str:
    """``"stored code 0x5a, stuck at 1: 0x01, wrong: 0x01; expected code 0x5b"`` for one stored integer code."""
    width = max(2, (bits + 3) // 4)
    full = (1 << bits) - 1
    word, z, o = int(codes[i]) & full, int(zero[i]), int(one[i])
    wrong = ((word & z) | (~word & o)) & full
    parts = [f"stored code 0x{word:0{width}x}"]
    if o:
        parts.append(f"stuck at 1: 0x{o:0{width}x}")
    if z:
        parts.append(f"stuck at 0: 0x{z:0{width}x}")
    parts.append(f"wrong: 0x{wrong:0{width}x}" if wrong else f"outside the {bits}-bit code")
    return ", ".join(parts) + f"; expected code 0x{int(held[i]) & full:0{width}x}"


def code_of(payload: Mapping[str, Tensor], parameter: Tensor) -> QuantCode:
    """The :class:`QuantCode` a resolved payload holds (a named scale by its name)."""
    bits, zero_point, signed, axis = (int(x) for x in payload["spec"])
    name = bytes(payload["scale_name"].tolist()).decode()
    scale: Scale = name if name else payload["scale"].detach().cpu()
    if not name and payload["scale"].numel() and bool((payload["scale"] == payload["scale"].reshape(-1)[0]).all()):
        scale = float(payload["scale"].reshape(-1)[0])
    return QuantCode(bits, scale, zero_point, None if axis < 0 else axis, bool(signed))


def named_scale(pin: Any, code: QuantCode, module: nn.Module, name: str, size: int) -> Tensor:
    """The module's parameter or buffer ``code.scale``, checked: float, positive, finite, 1 or ``size`` entries."""
    tensors = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(module.named_buffers(remove_duplicate=False))
    found = tensors.get(code.scale)
    if found is None:
        close = difflib.get_close_matches(code.scale, list(tensors), n=3)
        raise PinError(f"{pin!r}: the scale {code.scale!r} is not a parameter or buffer of the module"
                       + (f" (closest: {', '.join(map(repr, close))})" if close else "")
                       + "; name a tensor of the module, or give the scale as a number or tensor")
    if not found.is_floating_point() or found.numel() not in (1, size) or (found.numel() > 1 and code.axis is None):
        raise PinError(f"{pin!r}: the scale {code.scale!r} is a {found.dtype} tensor of {found.numel()} entries; "
                       f"{name!r} needs a float scale of 1 entry" + (f" or {size} (one per index along axis "
                                                                     f"{code.axis})" if code.axis is not None else ""))
    if not bool((torch.isfinite(found) & (found > 0)).all()):
        raise PinError(f"{pin!r}: the scale {code.scale!r} holds values that are not positive and finite")
    return found


def _mask(pin: Pin, name: str, field: str, raw: Any, bits: int, shape: tuple[int, ...], index: Optional[Tensor],
          count: int) -> Tensor:
    """A code-bit mask per selected element, int32, each within the code's ``bits``."""
    if raw is None:
        return torch.zeros(shape if index is None else (count,), dtype=torch.int32)
    if isinstance(raw, Tensor):
        if raw.is_floating_point() or raw.dtype == torch.bool or raw.is_complex():
            raise PinError(f"{pin!r}: {field} for {name!r} must be an integer tensor, got {raw.dtype}")
        wide = raw.detach().cpu().to(torch.int64)
    else:
        leaves = [raw] if isinstance(raw, numbers.Integral) else list(number_leaves(raw))
        if not all(_is_int(x) for x in leaves):
            raise PinError(f"{pin!r}: {field} for {name!r} must hold ints (code-bit masks)")
        wide = torch.tensor([int(x) for x in leaves], dtype=torch.int64)
        if isinstance(raw, numbers.Integral):
            wide = wide.reshape(())
    bad = (wide < 0) | ((wide >> bits) != 0)
    if bool(bad.any()):
        raise PinError(f"{pin!r}: {field} for {name!r} holds {int(wide.reshape(-1)[_first(bad)]):#x}, wider than the "
                       f"{bits}-bit code (masks 0x0..{(1 << bits) - 1:#x})")
    return per_element(pin, name, field, wide.to(torch.int32), shape, index, count)


def _no_bit(raw: Any) -> bool:
    """Whether a mask given in memory (an int, ints, a tensor) marks no bit at all."""
    if isinstance(raw, Tensor):
        return not raw.is_floating_point() and raw.dtype != torch.bool and not bool(raw.detach().cpu().any())
    leaves = [raw] if _is_int(raw) else list(number_leaves(raw))
    return bool(leaves) and all(_is_int(x) and int(x) == 0 for x in leaves)


def _too_wide(raw: Any, bits: int) -> Optional[int]:
    """The first mask in ``raw`` (an int, ints, a tensor) that does not fit ``bits`` bits, if any."""
    if isinstance(raw, Tensor):
        if raw.is_floating_point() or raw.dtype == torch.bool:
            return None
        flat = raw.detach().cpu().to(torch.int64).reshape(-1)
        bad = (flat < 0) | ((flat >> bits) != 0)
        return int(flat[_first(bad)]) if bool(bad.any()) else None
    leaves = [raw] if _is_int(raw) else [x for x in number_leaves(raw) if _is_int(x)]
    return next((int(x) for x in leaves if not 0 <= int(x) < 1 << bits), None)


def _union(mask: Tensor) -> int:
    flat = mask.detach().reshape(-1).cpu().to(torch.int64)
    union = 0
    for bit in range(17):
        if bool(((flat >> bit) & 1).any()):
            union |= 1 << bit
    return union
