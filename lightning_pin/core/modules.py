"""Finding the module whose parameter names pins are written against, through wrappers."""

from __future__ import annotations

from torch import nn

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
