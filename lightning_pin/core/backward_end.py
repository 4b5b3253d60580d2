"""One call at the end of every backward that runs through a module's forward, for :func:`~lightning_pin.pin`.

Zeroing pinned gradients with a hook per parameter (``register_post_accumulate_grad_hook``) costs
a trip into Python per parameter and backward: the autograd engine takes the GIL and wraps the
tensor for each, several microseconds apiece, which a model of hundreds of small tensors pays
hundreds of times a step. :class:`EndOfBackward` instead hooks the module's forward once: on the
gradient of its output it queues a callback with the autograd engine, which runs once the whole
backward has finished, every parameter's gradient accumulated. That callback queues the real one
a second time, so that it runs after the callbacks queued *during* backward: DDP's reducer
writes the all-reduced gradients back into ``.grad`` from one of those.

A backward that does not go through the module's output (a loss from a submodule called
directly) is not seen; :class:`~lightning_pin.core.handle.PinHandle` notices that before the step
and goes back to a hook per parameter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.autograd import Variable

__all__ = ["EndOfBackward", "first_tensor_requiring_grad"]


def first_tensor_requiring_grad(output: Any, depth: int = 0) -> Optional[Tensor]:
    """The first tensor that requires grad in a module's output (tensors, sequences, mappings and
    dataclasses such as Hugging Face's ``ModelOutput``, a few levels deep), or None."""
    if isinstance(output, Tensor):
        return output if output.requires_grad else None
    if depth > 4:
        return None
    if isinstance(output, Mapping):
        items: Any = output.values()
    elif isinstance(output, (list, tuple)):
        items = output
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        items = (getattr(output, f.name) for f in dataclasses.fields(output))
    else:
        return None
    for item in items:
        found = first_tensor_requiring_grad(item, depth + 1)
        if found is not None:
            return found
    return None


class EndOfBackward:
    """Call ``callback()`` once at the end of each backward through ``module``'s output.

    Example::

        >>> import torch
        >>> model = torch.nn.Linear(3, 1)
        >>> seen = []
        >>> end = EndOfBackward(model, lambda: seen.append(model.weight.grad is not None))
        >>> model(torch.randn(4, 3)).sum().backward()
        >>> seen
        [True]
        >>> end.remove()
    """

    def __init__(self, module: nn.Module, callback: Callable[[], None]) -> None:
        self._callback = callback
        self._queued = False
        self._handle = module.register_forward_hook(self._on_forward)

    def _on_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        # A new forward: a backward that failed after queueing left no callback waiting.
        self._queued = False
        if torch.is_grad_enabled():
            # The usual output, a tensor, without a call (this runs every step: benchmarks/step_calls.py).
            if isinstance(output, Tensor):
                tensor = output if output.requires_grad else None
            else:
                tensor = first_tensor_requiring_grad(output)
            if tensor is not None and tensor.grad_fn is not None:
                tensor.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: Tensor) -> None:
        if not self._queued:  # several forwards, one backward: one call
            self._queued = True
            Variable._execution_engine.queue_callback(self._after_graph)

    def _after_graph(self) -> None:
        Variable._execution_engine.queue_callback(self._run)

    def _run(self) -> None:
        self._queued = False
        self._callback()

    def remove(self) -> None:
        """Stop calling back (a :class:`~torch.utils.hooks.RemovableHandle`-like ``remove``)."""
        self._handle.remove()
