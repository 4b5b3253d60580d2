"""What the deploy tools share: a copy of the model without quantize()'s hooks, where a weight lives."""

from __future__ import annotations

import copy
from collections.abc import Collection

import torch
from torch import nn

from lightning_pin.faults.quantize import is_quantize_hook

__all__ = ["fold_live_codes", "owner_of", "plain_copy"]


def plain_copy(model: nn.Module, inplace: bool = False) -> nn.Module:
    """``model`` (or a deep copy of it) whose forward reads the parameters themselves: quantize()'s hooks dropped."""
    target = model if inplace else copy.deepcopy(model)
    for module in target.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in [k for k, hook in hooks.items() if is_quantize_hook(hook)]:
                del hooks[key]
                module._forward_hooks_always_called.pop(key, None)
    return target


def owner_of(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module that registers parameter ``name`` and the attribute it sits under."""
    prefix, _, attr = name.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), attr


def fold_live_codes(model: nn.Module, target: nn.Module, skip: Collection[str]) -> list[str]:
    """Write into ``target`` (a plain copy of ``model``) the dequantized codes of ``model``'s live quantize() weights
    other than ``skip``: the copy's forward reads what the fake-quantized one did. Returns their names."""
    from lightning_pin.deploy.codes import trained_codes
    from lightning_pin.faults.quantize import quantized_codes

    live = {name: code for name, code in quantized_codes(model).items() if name not in skip}
    if not live:
        return []
    with torch.no_grad():
        for name, weight in trained_codes(model, live).items():
            owner, attr = owner_of(target, name)
            parameter = getattr(owner, attr)
            parameter.copy_(weight.dequantized(parameter.dtype))
    return sorted(live)
