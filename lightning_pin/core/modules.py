"""The module whose parameter names pins are written against, under the wrappers users hold.

Users write pins against the names they see in their own code (``encoder.layer.0.weight``),
but often hold a wrapper: ``torch.compile`` returns an ``OptimizedModule`` whose parameters are
named ``_orig_mod.<name>``, Fabric's ``setup`` a ``_FabricModule`` (``_forward_module.<name>``),
``DistributedDataParallel`` / ``DataParallel`` a module whose names start with ``module.``. The
wrappers share the user's parameter tensors, so checking them through the unwrapped module checks
the same memory.
"""

from __future__ import annotations

from torch import nn

# Attributes through which wrappers hold the module the user built, in the order they are tried.
# Fabric is detected by its attribute, not imported: core stays free of Lightning.
_WRAPPED_AT = (
    "_orig_mod",  # torch.compile's OptimizedModule
    "_original_module",  # lightning.fabric's _FabricModule (the module given to Fabric.setup)
)


def unwrap(module: nn.Module) -> nn.Module:
    """The module whose ``named_parameters()`` names pins are written against.

    Strips, repeatedly and in any nesting, ``torch.compile``'s ``OptimizedModule``
    (``_orig_mod``), Lightning Fabric's ``_FabricModule`` (``_original_module``), and
    ``DistributedDataParallel`` / ``DataParallel`` (``.module``). Any other module is returned
    as it is.

    Example::

        >>> import torch
        >>> model = torch.nn.Linear(2, 2)
        >>> unwrap(torch.nn.DataParallel(model)) is model
        True
    """
    seen: set[int] = set()
    while id(module) not in seen:
        seen.add(id(module))
        inner = _wrapped(module)
        if inner is None:
            return module
        module = inner
    return module  # a wrapper that wraps itself: stop rather than loop forever


def _wrapped(module: nn.Module) -> nn.Module | None:
    if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return module.module
    for attribute in _WRAPPED_AT:
        # Only a child registered (or, for Fabric, stored) under the wrapper's own attribute: a
        # user module that happens to have such an attribute but is no wrapper still needs it to
        # be a module.
        inner = module.__dict__.get(attribute, module._modules.get(attribute))
        if isinstance(inner, nn.Module) and inner is not module:
            return inner
    return None
