"""Finding the module whose parameter names pins are written against, through wrappers, and
watching that it still holds the parameters they were resolved on."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_pin.core.sharding import is_sharded

__all__ = ["ParameterWatch", "unwrap"]


# Wrapper attribute -> what it holds, outermost first: torch.compile's OptimizedModule keeps the
# module in `_orig_mod`, Lightning Fabric's _FabricModule in `_original_module` (found by
# attribute, so core never imports Lightning), DistributedDataParallel and DataParallel in `module`.
_WRAPPED = ("_orig_mod", "_original_module")


def unwrap(module: nn.Module) -> nn.Module:
    """The user's own module inside ``torch.compile``, Fabric, DDP and DataParallel wrappers.

    Example::

        >>> import torch
        >>> net = torch.nn.Linear(2, 2)
        >>> unwrap(torch.compile(net)) is net
        True
    """
    seen = set()
    while id(module) not in seen:
        seen.add(id(module))
        for attribute in _WRAPPED:
            inner = getattr(module, attribute, None)
            if isinstance(inner, nn.Module):
                module = inner
                break
        else:
            if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
                module = module.module
    return module


class ParameterWatch:
    """Whether a module still trains the parameter objects pins were resolved on, checked on the host.

    Pins hold tensors: a parameter replaced by a new ``nn.Parameter`` (re-initialised, tied,
    swapped by a callback), or cast or moved (``model.double()``), would leave them restoring into
    a tensor the module no longer uses, or failing inside the step. :meth:`intact` costs two dict
    lookups per parameter (it runs before every step); :meth:`first_change` says what changed.
    Sharded parameters (FSDP2 swaps sharded and unsharded ones around forward and backward by
    design) are not watched.

    Example::

        >>> import torch
        >>> net = torch.nn.Linear(2, 2)
        >>> watch = ParameterWatch(net, dict(net.named_parameters()))
        >>> watch.intact()
        True
        >>> net.weight = torch.nn.Parameter(torch.zeros(2, 2))
        >>> watch.intact(), watch.first_change()
        (False, ('weight', 'replaced'))
    """

    def __init__(self, module: nn.Module, parameters: Mapping[str, nn.Parameter]) -> None:
        self.module = module
        self._planned = {
            name: (parameter, parameter.dtype, parameter.device)
            for name, parameter in parameters.items()
            if not is_sharded(parameter)
        }
        self._path: tuple[list[tuple[nn.Module, str, nn.Module]], list[tuple[Any, ...]]] | None = None

    def intact(self) -> bool:
        """Every submodule on the way to a watched parameter is the one seen first and holds the
        planned tensor, uncast and unmoved. False: see :meth:`first_change`."""
        if self._path is None:
            hops: dict[tuple[int, str], tuple[nn.Module, str, nn.Module]] = {}
            owners = []
            for name, (planned, dtype, device) in self._planned.items():
                *path, attr = name.split(".")
                module = self.module
                for part in path:
                    child = module._modules.get(part)
                    if child is None:
                        return False
                    hops[(id(module), part)] = (module, part, child)
                    module = child
                owners.append((module._parameters, attr, planned, dtype, device))
            self._path = (list(hops.values()), owners)
        hops_seen, owners = self._path
        for module, part, child in hops_seen:
            if module._modules.get(part) is not child:
                return False
        for parameters, attr, planned, dtype, device in owners:
            if parameters.get(attr) is not planned or planned.dtype != dtype or planned.device != device:
                return False
        return True

    def first_change(self) -> tuple[str, str] | None:
        """``(name, what)`` of the first watched parameter that changed: ``"gone"``, ``"replaced"``
        or ``"cast or moved from <dtype> on <device> to <dtype> on <device>"``; None if none did."""
        for name, (planned, dtype, device) in self._planned.items():
            try:
                current = self.module.get_parameter(name)
            except AttributeError:
                return name, "gone"
            if current is not planned:
                return name, "replaced"
            if planned.dtype != dtype or planned.device != device:
                return name, f"cast or moved from {dtype} on {device} to {planned.dtype} on {planned.device}"
        return None
