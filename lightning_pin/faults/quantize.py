"""Quantization-aware training with pins: :func:`quantize`, the forward sees the dequantized codes.

The parameters stay what they are (same names, same tensors, what optimizers and pins address);
only the forward of the modules that hold them reads, in their place, each weight's dequantized
code ``(q - zero_point) * s`` with ``q = clamp(round(w / s) + zero_point, qmin, qmax)``: the
arithmetic of :mod:`lightning_pin.core.kinds.quant_code`, so an element a code pin holds is seen
by the forward exactly as it is stored. Gradients pass the rounding straight through (STE) and
are zero where the code clamps; a learned scale (a parameter named by the code) gets the LSQ
gradient ``round(w / s) - w / s`` (``qmin`` / ``qmax`` minus the zero point where it clamps).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_pin.core.errors import PinError
from lightning_pin.core.kinds.quant_code import QuantCode, compute_dtype, named_scale
from lightning_pin.faults._common import Params, exact_pattern, floating_parameters

__all__ = ["QuantizeHandle", "fake_quantize", "quantize", "quantize_codes", "quantize_pins", "weight_code"]


class _RoundSTE(torch.autograd.Function):
    """``torch.round`` forward (exact), identity backward: the straight-through estimator."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # noqa: D102
        return torch.round(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # noqa: D102
        return grad


def fake_quantize(weight: Tensor, scale: Tensor, code: QuantCode) -> Tensor:
    """``(clamp(round(w / s) + zero_point, qmin, qmax) - zero_point) * s`` in the compute dtype, rounded
    once to ``weight``'s dtype; differentiable (STE) in ``weight`` and ``scale``."""
    cdt = compute_dtype(weight.dtype)
    s = scale.to(cdt)
    q = torch.clamp(_RoundSTE.apply(weight.to(cdt) / s) + code.zero_point, code.qmin, code.qmax)
    return ((q - code.zero_point) * s).to(weight.dtype)


#: Per module :func:`quantize` was called on: the code of each parameter it quantizes now (what
#: :func:`lightning_pin.deploy.to_torchao` / ``to_onnx`` write when given no codes).
_CODES: "weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[QuantCode, int]]]" = weakref.WeakKeyDictionary()


def quantized_codes(module: nn.Module) -> dict[str, QuantCode]:
    """The code of every parameter of ``module`` whose forward reads its dequantized code now (live :func:`quantize`).

    Example::

        >>> net = torch.nn.Linear(2, 1)
        >>> handle = quantize(net, "weight", {"bits": 8, "scale": 0.5})
        >>> quantized_codes(net)
        {'weight': QuantCode(bits=8, scale=0.5)}
        >>> handle.remove(); quantized_codes(net)
        {}
    """
    return {name: code for name, (code, _) in _CODES.get(module, {}).items()}


def is_quantize_hook(hook: Any) -> bool:
    """Whether a module hook is one :func:`quantize` registered (a copy of the module keeps them)."""
    return bool(getattr(hook, "_lightning_pin_quantize", False))


class QuantizeHandle:
    """What :func:`quantize` returns: ``remove()`` ends it (also a context manager).

    Example::

        >>> import torch
        >>> from lightning_pin import QuantCode
        >>> net = torch.nn.Linear(2, 1, bias=False)
        >>> with torch.no_grad():
        ...     _ = net.weight.copy_(torch.tensor([[0.3, -0.7]]))
        >>> handle = quantize(net, "weight", QuantCode(bits=4, scale=0.25))
        >>> net(torch.tensor([[1.0, 0.0]])).item(), net.weight[0, 0].item()   # code 1 (0.25); weight unchanged
        (0.25, 0.30000001192092896)
        >>> handle.remove(); net(torch.tensor([[1.0, 0.0]])).item()
        0.30000001192092896
    """

    def __init__(self, hooks: list[Any], names: list[str], module: Optional[nn.Module] = None) -> None:
        self._hooks = hooks
        #: The parameters whose forward reads dequantized codes.
        self.names = names
        self._module = None if module is None else weakref.ref(module)

    def remove(self) -> None:
        """The forward reads the parameters again."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        module = None if self._module is None else self._module()
        held = _CODES.get(module) if module is not None else None
        if held is not None:
            for name in self.names:
                if name in held and held[name][1] == id(self):
                    del held[name]

    def __enter__(self) -> QuantizeHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"QuantizeHandle({len(self.names)} parameter(s){'' if self._hooks else ', removed'})"


def quantize(module: nn.Module, params: Params, code: QuantCode | Any) -> QuantizeHandle:
    """The forward of every parameter ``params`` matches uses its dequantized code (fake quantization).

    Args:
        module: The module to be trained (a named scale is looked up in it).
        params: ``fnmatch`` globs (or ``"re:"`` expressions) over its parameter names.
        code: The :class:`~lightning_pin.QuantCode` (or a mapping of its fields) they are stored in.

    Returns:
        A :class:`QuantizeHandle`; ``handle.remove()`` ends it.

    Raises:
        PinError: a pattern matching no parameter, a non-float parameter, a scale that does not
            fit a parameter (length along ``axis``) or a named scale the module does not hold.
    """
    code = QuantCode.from_config(code)
    named = floating_parameters(module, params, "quantize")
    owners = {id(p): (m, attr) for m in module.modules() for attr, p in m._parameters.items() if p is not None}
    tensors = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(module.named_buffers(remove_duplicate=False))
    by_module: dict[int, tuple[nn.Module, list[tuple[str, Any]]]] = {}
    for name, parameter in named.items():
        if tensors.get(name) is None or id(parameter) not in owners:
            continue
        owner, attr = owners[id(parameter)]
        by_module.setdefault(id(owner), (owner, []))[1].append((attr, _scale_of(code, module, name, parameter)))
    hooks = []
    for owner, entries in by_module.values():

        def before(mod: nn.Module, args: Any, entries: list[tuple[str, Any]] = entries) -> None:
            for attr, scale in entries:
                # An instance attribute shadows the registered parameter for `mod.attr` inside
                # forward; named_parameters(), state_dict() and optimizers still see the parameter.
                mod.__dict__[attr] = fake_quantize(mod._parameters[attr], scale(), code)

        def after(mod: nn.Module, args: Any, output: Any, entries: list[tuple[str, Any]] = entries) -> None:
            for attr, _ in entries:
                mod.__dict__.pop(attr, None)

        before._lightning_pin_quantize = after._lightning_pin_quantize = True  # type: ignore[attr-defined]
        hooks.append(owner.register_forward_pre_hook(before))
        hooks.append(owner.register_forward_hook(after, always_call=True))
    handle = QuantizeHandle(hooks, list(named), module)
    held = _CODES.setdefault(module, {})
    for name in named:
        held[name] = (code, id(handle))
    return handle


def weight_code(weight: Tensor, bits: int, name: str = "") -> QuantCode:
    """A symmetric signed ``bits``-bit code for ``weight`` with one scale per output channel (axis 0):
    ``max |w| / (2**(bits-1) - 1)`` of each channel (1.0 for a channel of zeros), in float32.

    Example::

        >>> weight_code(torch.tensor([[0.5, -1.27], [0.0, 0.0]]), 8)
        QuantCode(bits=8, scale=tensor([0.009999999776482582, 1.0]), axis=0)

    Raises:
        PinError: ``bits`` outside 2..16.
    """
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 16:
        raise PinError(f"code bits for {name!r} must be an integer from 2 to 16, got {bits!r}")
    rows = weight.detach().reshape(weight.shape[0], -1) if weight.ndim else weight.detach().reshape(1, 1)
    largest = rows.abs().amax(dim=1).float().cpu()
    scale = torch.where(largest > 0, largest / ((1 << (bits - 1)) - 1), torch.ones_like(largest))
    return QuantCode(bits=bits, scale=scale, axis=0 if weight.ndim else None)


def quantize_codes(module: nn.Module, params: Params, bits: int) -> list[QuantizeHandle]:
    """:func:`quantize` each parameter ``params`` matches with its own :func:`weight_code` of ``bits`` bits
    (the codes ``bit_faults(..., code=bits)`` draws over, while the weights stay as they are now)."""
    named = floating_parameters(module, params, "quantize")
    return [quantize(module, exact_pattern(name), weight_code(parameter, bits, name))
            for name, parameter in named.items()]


def quantize_pins(module: nn.Module, pins: Any) -> list[QuantizeHandle]:
    """:func:`quantize` the parameters of every pin that carries a code, with its code (the app's QAT)."""
    return [quantize(module, p.params, p.code) for p in pins if getattr(p, "code", None) is not None]


def _scale_of(code: QuantCode, module: nn.Module, name: str, parameter: Tensor) -> Any:
    """``scale()``: the scale of ``parameter``, shaped to broadcast along the code's axis."""
    axis: Optional[int] = None if code.axis is None else code.axis % max(parameter.ndim, 1)
    size = 1 if axis is None else parameter.shape[axis]
    shape = [1] * parameter.ndim
    if axis is not None:
        shape[axis] = size
    if code.named:
        tensor = named_scale(f"quantize({name!r})", code, module, name, size)
        return lambda: tensor.reshape(shape if tensor.numel() > 1 else [])
    fixed = torch.as_tensor(code.scale).reshape(-1).to(compute_dtype(parameter.dtype))
    if fixed.numel() not in (1, size) or (fixed.numel() > 1 and axis is None):
        raise PinError(f"quantize: {fixed.numel()} scales for {name!r}, whose axis {code.axis} has {size} entries")
    fixed = fixed.to(parameter.device).reshape(shape if fixed.numel() > 1 else [])
    return lambda: fixed
