"""The optimizer's step compiled with the restore of pinned values inside it (``compile_step=True``).

:func:`install` replaces ``optimizer.step`` (an instance attribute; the class is untouched) by a
:class:`CompiledStep`: it runs the optimizer's step pre-hooks, the closure, then one
``torch.compile``-d function that calls torch's own step (the undecorated ``step`` of the
optimizer's class: no optimizer written twice) and restores every pinned element with a
branch-free bit-select on integer views of the same bytes::

    bits = (bits & keep) | (target_bits & ~keep)      # keep: all ones where free, 0 where pinned

then the step post-hooks (the engine's, which here only forces stuck bits and bounds, parks
statistics and calls its observers). Free elements get exactly the bits of the compiled step
without pins; pinned ones exactly their targets. The gradients of pinned elements are zeroed the
same way, one dense ``grad_bits &= keep`` pass (:meth:`CompiledStep.mask_grad`) where the engine
would write zeros at scattered indices, when backward accumulates them (``pin()``) or before
clipping (``PinCallback``): clipping still sees them zero.

The ``keep`` masks and the targets are dense integer tensors, one pair per pinned parameter the
optimizer updates, passed to the compiled function as *data*: when pins start, stop or a ``when``
toggles, :meth:`CompiledStep.refresh` rewrites them in place (index ops, no sync) and nothing
recompiles. Memory: two tensors of the parameter's size per pinned parameter, i.e.
``2 * itemsize / f`` bytes per pinned element at a pinned fraction ``f`` of its tensor (8 bytes
at 100%, 10 at 80%, 16 at 50%, 40 at 20%, 800 at 1% for float32), on top of the engine's own
index and targets.

Where the step cannot be compiled (an optimizer that is not one of torch's own, sharded
parameters, no C++ compiler for a CPU parameter, a compile error) the optimizer keeps its eager
step and the engine restores after it as without ``compile_step``: one warning says why.
"""

from __future__ import annotations

import inspect
import os
import shutil
import types
import warnings
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from lightning_pin.core.sharding import copy_at, fill_at, is_sharded
from lightning_pin.core.state import BITS_DTYPES

__all__ = ["CompiledStep", "install", "why_not_compiled"]

# torch's own optimizers that torch.compile traces (exact types: a subclass may change step()).
# LBFGS re-evaluates its closure inside the step and SparseAdam wants sparse gradients.
_COMPILABLE = frozenset(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "ASGD", "Rprop")
    if hasattr(torch.optim, name)
)


def _has_cxx() -> bool:
    try:
        from torch._inductor import config

        named = config.cpp.cxx[0] if isinstance(config.cpp.cxx, tuple) else config.cpp.cxx
    except Exception:  # pragma: no cover - inductor internals moved
        named = None
    candidates = [os.environ.get("CXX"), named, "g++", "c++", "clang++"]
    return any(c and shutil.which(c) for c in candidates)


def why_not_compiled(optimizer: Optimizer, parameters: Sequence[Tensor]) -> Optional[str]:
    """Why ``optimizer``'s step cannot run compiled with these pinned parameters (None: it can)."""
    kind = type(optimizer)
    if kind not in _COMPILABLE:
        return (
            f"{kind.__module__}.{kind.__qualname__} is not one of torch's own optimizers that torch.compile "
            f"traces ({', '.join(sorted(c.__name__ for c in _COMPILABLE))})"
        )
    if not hasattr(kind.step, "__wrapped__"):
        return f"{kind.__qualname__}.step is not torch's hooked step (it was replaced)"
    if any(group.get("differentiable") for group in optimizer.param_groups):
        return "a param group has differentiable=True"
    if any(group.get("fused") for group in optimizer.param_groups):
        return "it runs torch's fused kernels (fused=True), which torch.compile does not trace; use foreach"
    if any(is_sharded(p) for p in parameters):
        return "pinned parameters are sharded (DTensor): the compiled restore works on local dense tensors"
    if any(p.dtype not in BITS_DTYPES for p in parameters):
        return "a pinned parameter is not float16, bfloat16, float32 or float64"
    devices = {p.device.type for group in optimizer.param_groups for p in group["params"]}
    if "cpu" in devices and not _has_cxx():
        return "no C++ compiler was found for torch.compile on CPU (set CXX or install g++)"
    return None


def _fused_step(step: Callable[[Optimizer], Any], optimizer: Optimizer, params: list[Tensor],
                keeps: list[Tensor], targets: list[Tensor]) -> None:
    """torch's step, then the bit-select restore of every pinned element: one compiled graph."""
    step(optimizer)
    with torch.no_grad():
        for param, keep, target in zip(params, keeps, targets):
            bits = param.view(keep.dtype)
            bits.copy_((bits & keep) | (target & ~keep))


def _fused_step_measured(step: Callable[[Optimizer], Any], optimizer: Optimizer, params: list[Tensor],
                         keeps: list[Tensor], targets: list[Tensor]) -> list[Tensor]:
    """:func:`_fused_step` that also returns ``|value - target|`` of the pinned elements before the
    restore (0 elsewhere), flat, for the engine's step statistics on the steps an observer logs."""
    step(optimizer)
    moved = []
    with torch.no_grad():
        for param, keep, target in zip(params, keeps, targets):
            bits = param.view(keep.dtype)
            deviation = (param.detach() - target.view(param.dtype)).abs().reshape(-1)
            if deviation.dtype not in (torch.float32, torch.float64):
                deviation = deviation.float()
            moved.append(torch.where(keep.reshape(-1) == 0, deviation, torch.zeros_like(deviation)))
            bits.copy_((bits & keep) | (target & ~keep))
    return moved


#: The pinned fraction of a tensor (all its pins together) from which the compiled step restores and
#: masks it densely; below it the engine's index ops do (measured in benchmarks/compiled_step.py:
#: at 1% the dense passes cost more than the scattered writes they replace).
DENSE_FROM = 0.25


def _pinned_fractions(plan: Any) -> dict[str, float]:
    """Per parameter, the fraction of its elements some pin selects (overlaps counted twice)."""
    counts: dict[str, int] = {}
    for rp in plan.pins:
        for name, selection in rp.selections.items():
            if selection.kind == "value":
                size = selection.parameter.numel() if selection.index is None else selection.index.numel()
                counts[name] = counts.get(name, 0) + size
    return {name: min(1.0, n / max(plan.parameters[name].numel(), 1)) for name, n in counts.items()}


def _own_code(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with a code object of its own. Dynamo keeps compiled graphs on the code object,
    guarded on the optimizer and the tensors, up to ``recompile_limit`` (8) of them: with one code
    object for all, the ninth optimizer of a process (a second fit, several optimizers) would run
    eager. One per optimizer keeps each to its own one or two graphs."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__)


class CompiledStep:
    """``optimizer.step`` with the restore of ``engine``'s pins compiled into it (see the module docstring)."""

    def __init__(self, engine: Any, optimizer: Optimizer) -> None:
        self.engine = engine
        self.optimizer = optimizer
        # torch's own step without its wrappers: the hook runner, and the grad-mode switch whose
        # deliberate graph breaks keep AOT from seeing an inference graph (we call it under no_grad).
        self._step = inspect.unwrap(type(optimizer).step)
        self._eager = type(optimizer).step.__wrapped__  # the fallback: eager, without the hook runner
        names = sorted(engine._names_of(optimizer))
        pinned = _pinned_fractions(engine.plan)
        # Dense select where many elements are pinned; where few are, the engine's index mask and
        # restore touch only those (they stay eager, after the compiled step) and need no dense copy.
        self.names = [
            n for n in names if engine.plan.parameters[n].requires_grad and pinned.get(n, 0.0) >= DENSE_FROM
        ]
        self.params = [engine.plan.parameters[n] for n in self.names]
        self._names = frozenset(self.names)
        self._index = {name: i for i, name in enumerate(self.names)}
        #: Per parameter: all ones where free, 0 where pinned (the gradient mask and the restore's select).
        self.keeps = [torch.full_like(p, -1, dtype=BITS_DTYPES[p.dtype]) for p in self.params]
        self.targets = [torch.zeros_like(k) for k in self.keeps]
        self._for: Optional[list[Any]] = None  # the engine's target list the buffers hold
        self._compiled = torch.compile(_own_code(_fused_step), fullgraph=True, dynamic=False)
        self._compiled_measured = torch.compile(_own_code(_fused_step_measured), fullgraph=True, dynamic=False)
        #: Why the step runs eager after all (a compile error), or None while it runs compiled.
        self.failed: Optional[str] = None

    @torch.no_grad()
    def refresh(self) -> None:
        """Write the masks and targets of the engine's active pins (only when they changed: a new
        target list means pins started or stopped, or a ``when`` pin captured new values)."""
        current = self.engine.targets()
        if current is self._for:
            return
        self._for = current
        at = {name: i for i, name in enumerate(self.names)}
        for keep in self.keeps:
            keep.fill_(-1)
        for target in current:
            i = at.get(target.name)
            if i is None:
                continue
            keep, held = self.keeps[i], self.targets[i]
            values = target.values.to(device=keep.device, dtype=self.params[i].dtype).view(keep.dtype)
            view, positions, _ = target.part(keep)
            if positions is None:
                keep.zero_()
                held.copy_(values)
            else:
                held_view, _, _ = target.part(held)
                fill_at(view, positions, 0)
                copy_at(held_view, positions, values.reshape(-1))

    #: An LR scheduler wraps ``optimizer.step`` on the instance to notice steps (``_opt_called``);
    #: this step sets that flag itself, and the marker keeps a later scheduler from wrapping it.
    _wrapped_by_lr_sched = True

    @torch.no_grad()
    def mask_grad(self, name: str, grad: Tensor) -> bool:
        """Zero the pinned elements of ``grad`` (of parameter ``name``) with one dense ``bits &= keep``
        pass (no scattered index writes; a NaN or inf gradient becomes +0.0 too); False when the
        gradient's layout differs from the parameter's and the engine's index mask must do it."""
        i = self._index.get(name)
        if i is None:
            return False
        keep = self.keeps[i]
        if grad.dtype != self.params[i].dtype or grad.stride() != keep.stride() or is_sharded(grad):
            return False
        self.refresh()
        grad.view(keep.dtype).bitwise_and_(keep)
        return True

    def __call__(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        optimizer = self.optimizer
        optimizer._opt_called = True  # what an LR scheduler's wrapper of step() records
        args: tuple[Any, ...] = (optimizer,)
        kwargs: dict[str, Any] = {} if closure is None else {"closure": closure}
        with torch.autograd.profiler.record_function(f"Optimizer.step#{type(optimizer).__name__}.step"):
            for pre_hook in (*_global_optimizer_pre_hooks.values(),
                             *optimizer._optimizer_step_pre_hooks.values()):
                result = pre_hook(optimizer, args, kwargs)
                if result is not None:
                    args, kwargs = result
            closure = kwargs.get("closure")
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if self.failed is None:
                self._run()
            else:
                self._eager(optimizer)
            optimizer._optimizer_step_code()
            for post_hook in (*optimizer._optimizer_step_post_hooks.values(),
                              *_global_optimizer_post_hooks.values()):
                post_hook(optimizer, args, kwargs)
        return loss

    def _run(self) -> None:
        self.refresh()
        measured = self.engine._wants_stats()
        function = self._compiled_measured if measured else self._compiled
        try:
            with torch.no_grad():
                moved = function(self._step, self.optimizer, self.params, self.keeps, self.targets)
        except Exception as err:  # the first call compiles: nothing ran (fullgraph) if it failed
            if not _is_compile_error(err) or isinstance(err, torch._dynamo.exc.RecompileError):
                raise  # a recompile refused by config.error_on_recompile is the caller's to see
            self.failed = f"torch.compile failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            warnings.warn(
                f"compile_step=True: the step of {type(self.optimizer).__name__} runs eager, pins restored after "
                f"it as without compile_step, because {self.failed}",
                UserWarning,
                stacklevel=4,
            )
            self._eager(self.optimizer)
            return
        self.engine._fused[id(self.optimizer)] = (self._names, moved if measured else None)


def _float_lr(optimizer: Optimizer) -> bool:
    return any(not isinstance(group.get("lr"), Tensor) for group in optimizer.param_groups)


def _is_compile_error(err: Exception) -> bool:
    from torch._dynamo import exc

    return isinstance(err, (exc.TorchDynamoException, exc.Unsupported)) or type(err).__module__.startswith(
        ("torch._dynamo", "torch._inductor")
    )


class _Installed:
    """Undoes :func:`install` for one optimizer (a removable handle)."""

    def __init__(self, optimizer: Optimizer, step: CompiledStep, replaced: Any) -> None:
        self.optimizer, self.step, self.replaced = optimizer, step, replaced

    def remove(self) -> None:
        if self.optimizer.__dict__.get("step") is self.step:
            if self.replaced is None:
                del self.optimizer.__dict__["step"]
            else:
                self.optimizer.__dict__["step"] = self.replaced
        self.step.engine._fused.pop(id(self.optimizer), None)
        for name in self.step.names:
            if self.step.engine._dense_grad_masks.get(name) is self.step:
                del self.step.engine._dense_grad_masks[name]
                self.step.engine._grad_masks = None


def install(engine: Any, optimizers: Sequence[Optimizer], warn: Callable[[str], Any]) -> list[_Installed]:
    """Run each optimizer's step compiled with ``engine``'s restore inside it where it can be; ``warn``
    once per optimizer that cannot, saying why. Returns handles whose ``remove()`` undo it."""
    handles = []
    for optimizer in optimizers:
        names = engine._names_of(optimizer)
        reason = why_not_compiled(optimizer, [engine.plan.parameters[n] for n in names])
        replaced = optimizer.__dict__.get("step")
        if reason is None and replaced is not None and not getattr(replaced, "_wrapped_by_lr_sched", False):
            # Only an LR scheduler's wrapper (it calls the class's step) may be replaced.
            reason = "its step() was already replaced on the instance (by something other than an LR scheduler)"
        if reason is None and replaced is not None and _float_lr(optimizer):
            reason = (
                "an LR scheduler changes its float lr, and torch.compile specialises the step on it: every change "
                "would recompile, and after 8 the step would run eager anyway. Give the optimizer a tensor "
                "learning rate (lr=torch.tensor(0.001)) to compile it once"
            )
        if reason is not None:
            warn(f"compile_step=True: the step of {type(optimizer).__name__} runs eager, pins restored after it "
                 f"as without compile_step, because {reason}")
            continue
        step = CompiledStep(engine, optimizer)  # compiles the step even when no tensor is dense
        optimizer.__dict__["step"] = step
        for name in step.names:
            engine._dense_grad_masks[name] = step
            engine._grad_masks = None
        handles.append(_Installed(optimizer, step, replaced))
    return handles
