"""The integer codes a trained model's weights hold: one rule for training, deployment and check.

A weight trained with :func:`~lightning_pin.faults.quantize` (its forward reads its dequantized
code) or held by a code pin stores ``q = clamp(round(w / s) + zero_point, qmin, qmax)``. The
codes written to a deployed file are computed here with
:func:`lightning_pin.core.kinds.quant_code.codes_of`, the function the code pins' restore uses:
no second rounding rule, so a stuck code bit the training held is in the file as it was held.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from lightning_pin.core.errors import PinError
from lightning_pin.core.kinds.quant_code import QuantCode, codes_of, compute_dtype, dequantize, named_scale
from lightning_pin.faults._common import floating_parameters
from lightning_pin.faults.quantize import quantized_codes

__all__ = ["CodedWeight", "DEPLOY_EXTRA", "Codes", "codes_from_checkpoint", "trained_codes"]

#: How to install what the deploy tools need.
DEPLOY_EXTRA = "pip install 'lightning-pin[deploy]'"

#: Which weights carry which code: ``{name: QuantCode or its fields}``, or pins carrying ``code=``.
Codes = Union[Mapping[str, Any], Sequence[Any]]


@dataclasses.dataclass(frozen=True)
class CodedWeight:
    """One weight as its integer codes.

    Attributes:
        name: The parameter's name.
        code: Its :class:`~lightning_pin.QuantCode` (a named scale read into ``scale``).
        codes: The codes, int32, in the weight's shape.
        scale: The scales, 1-D in the compute dtype: one entry, or one per index along ``code.axis``.
        axis: The dimension the scales run along (normalized to >= 0), None for one scale.
    """

    name: str
    code: QuantCode
    codes: Tensor
    scale: Tensor
    axis: Optional[int]

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        """``(q - zero_point) * s`` rounded once to ``dtype``: what the fake-quantized forward reads."""
        return dequantize(self.codes, self._broadcast(), self.code.zero_point, dtype)

    def _broadcast(self) -> Tensor:
        if self.axis is None:
            return self.scale.reshape([])
        shape = [1] * self.codes.ndim
        shape[self.axis] = -1
        return self.scale.reshape(shape)


def trained_codes(model: nn.Module, codes: Optional[Codes] = None) -> dict[str, CodedWeight]:
    """Every weight of ``model`` that carries a code, as its integer codes (:class:`CodedWeight`), by name.

    Args:
        model: The trained model (float weights).
        codes: Which weights carry which code: ``{name or glob: QuantCode}``, or pins (``Pin(..., code=...)``,
            e.g. the code pins it was trained with). None: the codes of the live
            :func:`~lightning_pin.faults.quantize` calls and live ``pin()`` code pins on ``model``.

    Raises:
        PinError: a pattern matching no parameter, two codes for one weight, a scale that does not
            fit its weight, or (with ``codes=None``) a model on which no ``quantize()`` is live.

    Example::

        >>> import torch
        >>> from lightning_pin import QuantCode
        >>> net = torch.nn.Linear(2, 1, bias=False)
        >>> with torch.no_grad():
        ...     _ = net.weight.copy_(torch.tensor([[0.3, -0.7]]))
        >>> trained_codes(net, {"weight": QuantCode(bits=4, scale=0.25)})["weight"].codes
        tensor([[ 1, -3]], dtype=torch.int32)
    """
    wanted = _wanted(model, codes)
    out = {}
    for name, code in wanted.items():
        parameter = dict(model.named_parameters(remove_duplicate=False))[name]
        out[name] = _coded(model, name, parameter, code)
    return out


def _wanted(model: nn.Module, codes: Optional[Codes]) -> dict[str, QuantCode]:
    if codes is None:
        found = quantized_codes(model)
        for name, code in _live_code_pins(model).items():
            if name in found and not _same(found[name], code):
                raise PinError(f"{name!r} is quantized with {found[name]!r} but a code pin holds it with {code!r}")
            found[name] = code
        if not found:
            raise PinError("no weight of the model carries a code: train it with quantize() (or code pins) and pass "
                           "codes={name: QuantCode} or the code pins, or call this while quantize() is live")
        return found
    items: list[tuple[Any, Any]]
    if isinstance(codes, Mapping):
        items = list(codes.items())
    else:
        items = [(p.params, p.code) for p in codes if getattr(p, "code", None) is not None]
        if not items:
            raise PinError("none of the pins carries a code (Pin(..., code=QuantCode(...)))")
    wanted: dict[str, QuantCode] = {}
    for params, raw in items:
        code = QuantCode.from_config(raw)
        for name in floating_parameters(model, params, "codes"):
            if name in wanted and not _same(wanted[name], code):
                raise PinError(f"{name!r} carries two different codes: {wanted[name]!r} and {code!r}")
            wanted[name] = code
    return wanted


def _live_code_pins(model: nn.Module) -> dict[str, QuantCode]:
    """The codes of the code pins of the live ``pin()`` handles on ``model`` (by parameter name)."""
    from lightning_pin.core.driver import LIVE
    from lightning_pin.core.handle import PinHandle

    found: dict[str, QuantCode] = {}
    for handle in LIVE.on(model):
        if not isinstance(handle, PinHandle):
            continue
        for resolved in handle.engine.plan.pins:
            for name, selection in resolved.selections.items():
                code = selection.context.get("code")  # only a code pin carries a QuantCode
                if isinstance(code, QuantCode):
                    found[name] = code
    return found


def _same(a: QuantCode, b: QuantCode) -> bool:
    fields = ("bits", "zero_point", "axis", "signed")
    if any(getattr(a, f) != getattr(b, f) for f in fields):
        return False
    sa, sb = a.scale, b.scale
    if isinstance(sa, Tensor) or isinstance(sb, Tensor):
        ta, tb = torch.as_tensor(sa).reshape(-1).double(), torch.as_tensor(sb).reshape(-1).double()
        return ta.shape == tb.shape and torch.equal(ta, tb) if ta.numel() == tb.numel() else False
    return sa == sb


def _coded(model: nn.Module, name: str, parameter: Tensor, code: QuantCode) -> CodedWeight:
    weight = parameter.detach()
    cdt = compute_dtype(weight.dtype)
    axis = None if code.axis is None else code.axis % max(weight.ndim, 1)
    size = 1 if axis is None else weight.shape[axis]
    if code.named:
        scale = named_scale(f"codes of {name!r}", code, model, name, size).detach().reshape(-1).to(cdt)
    else:
        scale = torch.as_tensor(code.scale).detach().reshape(-1).to(cdt)
    if scale.numel() not in (1, size):
        raise PinError(f"{name!r}: {scale.numel()} scales for axis {code.axis} of {size} entries")
    if axis is not None and scale.numel() == 1:
        scale = scale.expand(size).clone()
    scale = scale.to(weight.device)
    shape = [1] * weight.ndim
    if axis is not None:
        shape[axis] = size
    # The restore's own arithmetic: codes_of in the compute dtype, the scale broadcast per element.
    q = codes_of(weight.to(cdt), scale.reshape(shape) if axis is not None else scale.reshape([]),
                 code.zero_point, code.qmin, code.qmax)
    return CodedWeight(name, code, q.cpu(), scale.cpu(), axis)


def codes_from_checkpoint(pinned: Any) -> dict[str, QuantCode]:
    """The code of every parameter a checkpoint's code pins held (``{name: QuantCode}``), from its saved pin state.

    Args:
        pinned: A checkpoint path (a fit with PinCallback, or a file holding ``PinHandle.state_dict()``)
            or such a dict already loaded.

    Raises:
        PinError: the file holds no pin state, or no code pin.
    """
    from lightning_pin.core.io import load_tensors
    from lightning_pin.core.kinds.quant_code import QuantizedCode, code_of
    from lightning_pin.core.state import PinState, find_pin_states

    loaded = pinned if isinstance(pinned, Mapping) else load_tensors(pinned)
    found: dict[str, QuantCode] = {}
    for key, raw in find_pin_states(loaded).items():
        state = PinState.from_dict(raw, where=f"the pin state {key!r}")
        for selections in state.pins:
            for name, saved in selections.items():
                if saved.kind == QuantizedCode.kind:
                    code = code_of(saved.payload, torch.empty(0))
                    if name in found and not _same(found[name], code):
                        raise PinError(f"{name!r} carries two different codes in the pin state: {found[name]!r} "
                                       f"and {code!r}")
                    found[name] = code
    if not found:
        raise PinError(f"{pinned if not isinstance(pinned, Mapping) else 'the pin state'} holds no code pin "
                       "(Pin(..., code=QuantCode(...))): nothing to write as integer codes")
    return found
