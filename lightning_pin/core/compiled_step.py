"""The optimizer's step compiled with the pinning inside it (``compile_step=True``).

:func:`install` replaces ``optimizer.step`` (an instance attribute; the class is untouched) by a
:class:`CompiledStep`: it runs the optimizer's step pre-hooks, the closure, then one
``torch.compile``-d function that calls torch's own step (the undecorated ``step`` of the
optimizer's class: no optimizer written twice) and *holds* every pinned element, and every
per-element optimizer statistic of it, where it was before the step::

    param = where(keep != 0, param_after_step, param_before_step)     # keep: 1 free, 0 pinned
    exp_avg = where(keep != 0, exp_avg_after_step, exp_avg_before)   # ... each statistic alike

Inductor fuses the select into the update's own kernel and never materialises the "before"
copies: one pass over each tensor, reading a 2-byte mask more than the unpinned step. Pinned
elements keep their targets (they held them when the step started: pins write their targets when
they activate, and :meth:`CompiledStep._undo_foreign_writes` writes them again into a parameter
that anything else wrote since the last step, seen by its version counter and storage; an
in-place write through ``.data`` is not seen). Their gradients never reach the update or the
statistics, so the step may ignore them: the separate pass that zeroes pinned gradients in memory
is needed only where something reads the gradients between backward and the step. ``pin()``
keeps its promise that they are zero when ``backward()`` returns (one dense compiled pass,
:meth:`CompiledStep.mask_grad`); ``PinCallback`` skips it when the Trainer does not clip
(``engine.grads_read_before_step``). Free elements get exactly the bits of the compiled step
without pins. The first step, which creates the optimizer's statistics from the gradients, always
runs with them masked, so pinned statistics start at zero as without ``compile_step``.

What differs from the eager engine: there, a ``when`` pin's elements see zero gradients on their
pinned steps, so their momentum decays; here it is held unchanged until the pin lets go.

The masks are passed to the compiled function as *data*: when pins start, stop or a ``when``
toggles, :meth:`CompiledStep.refresh` rewrites them in place (index ops, no sync) and nothing
recompiles. Memory: one bfloat16 mask of each held parameter's size, ``2 / f`` bytes per pinned
element at a pinned fraction ``f`` of its tensor (2.5 bytes at 80%, 4 at 50%, 10 at 20%, 40 at 5%);
below :data:`DENSE_FROM` the engine's index mask and restore serve the tensor and it costs nothing.
Four graphs at most per optimizer (the first step and the rest, each with and without the step
statistics an observer logs), compiled once each.

Where the step cannot be compiled (an optimizer that is not one of torch's own, sharded
parameters, no C++ compiler for a CPU parameter, a compile error) the optimizer keeps its eager
step and the engine restores after it as without ``compile_step``: one warning says why.
"""

from __future__ import annotations

import contextlib
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

from lightning_pin.core import kinds
from lightning_pin.core.sharding import fill_at, is_sharded
from lightning_pin.core.kinds.stuck_bits import BITS_DTYPES

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


def _statistics(optimizer: Optimizer, param: Tensor) -> list[Tensor]:
    """Every per-element optimizer statistic of ``param`` (momentum, moments, step sizes), read at
    trace time: holding them all is stepping as if the pinned elements were not there."""
    state = optimizer.state.get(param, {})
    return [v for v in state.values() if isinstance(v, Tensor) and v.shape == param.shape]


def _before_step(optimizer: Optimizer, params: list[Tensor], keeps: list[Tensor]) -> list[tuple[Tensor, ...]]:
    """Per held parameter: its mask, the parameter and its statistics, and their values now."""
    held = []
    for param, keep in zip(params, keeps):
        tensors = [param, *_statistics(optimizer, param)]
        held.append((keep, tensors, [t.clone() for t in tensors]))
    return held


def _hold(held: list[tuple[Tensor, ...]]) -> None:
    """Put every pinned element of each held tensor back to its value of :func:`_before_step`."""
    for keep, tensors, before in held:
        free = keep != 0
        for tensor, old in zip(tensors, before):
            tensor.copy_(torch.where(free, tensor, old))


def _held_step(step: Callable[[Optimizer], Any], optimizer: Optimizer, params: list[Tensor],
               keeps: list[Tensor]) -> None:
    """torch's step, then every pinned element of ``params`` and of their statistics back to what it
    held before the step: one compiled graph, one pass per tensor (the copies before the step are
    never materialised: inductor reads the inputs once and selects in the update's own kernel)."""
    held = _before_step(optimizer, params, keeps)
    step(optimizer)
    _hold(held)


def _held_step_measured(step: Callable[[Optimizer], Any], optimizer: Optimizer, params: list[Tensor],
                        keeps: list[Tensor]) -> list[Tensor]:
    """:func:`_held_step` that also returns ``|value - target|`` of the pinned elements after the
    update, before the hold (0 elsewhere), flat, for the engine's statistics on the steps it logs."""
    held = _before_step(optimizer, params, keeps)
    step(optimizer)
    moved = []
    for keep, tensors, before in held:
        deviation = (tensors[0] - before[0]).abs().reshape(-1)
        if deviation.dtype not in (torch.float32, torch.float64):
            deviation = deviation.float()
        moved.append(torch.where(keep.reshape(-1) != 0, torch.zeros_like(deviation), deviation))
    _hold(held)
    return moved


def _mask_dense(grad: Tensor, keep: Tensor) -> None:
    """Zero ``grad`` where ``keep`` is 0, in one pass (a NaN or inf gradient becomes 0 too)."""
    grad.copy_(torch.where(keep != 0, grad, 0.0))


#: The pinned fraction of a tensor (all its pins together) from which the compiled step holds it
#: with a dense mask; below it the engine's index ops do (benchmarks/compiled_step.py: at 1% the
#: scattered writes touch few cache lines, from a few percent on they touch most of them).
DENSE_FROM = 0.05


def _pinned_fractions(plan: Any) -> dict[str, float]:
    """Per parameter, the fraction of its elements some element pin selects (overlaps counted
    twice). Whole-tensor pins do not count: their gradients are dropped, the step skips them."""
    counts: dict[str, int] = {}
    for rp in plan.pins:
        for name, selection in rp.selections.items():
            if kinds.of(selection.kind).frozen and selection.index is not None:
                counts[name] = counts.get(name, 0) + selection.index.numel()
    return {name: min(1.0, n / max(plan.parameters[name].numel(), 1)) for name, n in counts.items()}


def _own_code(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with a code object of its own. Dynamo keeps compiled graphs on the code object,
    guarded on the optimizer and the tensors, up to ``recompile_limit`` (8) of them: with one code
    object for all, the ninth optimizer of a process (a second fit, several optimizers) would run
    eager. One per optimizer keeps each to its own one or two graphs. Defaults and closure are kept."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)


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
        # Held in the compiled kernel where many elements are pinned; where few are, the engine's
        # index mask and restore touch only those (eager, after the compiled step) and need no mask.
        self.names = [
            n for n in names if engine.plan.parameters[n].requires_grad and pinned.get(n, 0.0) >= DENSE_FROM
        ]
        self.params = [engine.plan.parameters[n] for n in self.names]
        self._names = frozenset(self.names)
        self._index = {name: i for i, name in enumerate(self.names)}
        #: Per parameter: 1 where free, 0 where pinned, in bfloat16 (2 bytes an element: inductor
        #: loads it vectorised, where a bool or int8 mask made the kernel 2-3x slower here).
        self.keeps = [torch.ones_like(p, dtype=torch.bfloat16) for p in self.params]
        self._for: Optional[frozenset[int]] = None  # the active pins the masks hold
        # (version, data_ptr) of each parameter right after the last compiled step: anything else
        # that writes it in between (load_state_dict, a copy_, a .data swap) is undone before the
        # next step, which holds pinned elements at what they hold when it starts.
        self._seen: list[Optional[tuple[int, int]]] = [None] * len(self.params)
        # One code object (so one graph) per variant. Dynamo creates the optimizer's state while it
        # traces the first step and does not guard on it, so the graph of the first step (which
        # finds no statistics to hold: they are made from masked gradients) is never reused for
        # the steps after it, which hold them.
        self._compiled, self._compiled_measured, self._first, self._first_measured = (
            torch.compile(_own_code(function), fullgraph=True, dynamic=False)
            for function in (_held_step, _held_step_measured, _held_step, _held_step_measured)
        )
        self._mask = torch.compile(_own_code(_mask_dense), fullgraph=True, dynamic=True)
        #: Why the step runs eager after all (a compile error), or None while it runs compiled.
        self.failed: Optional[str] = None
        self._has_state = False

    def refresh(self) -> None:
        """Write the masks of the engine's active pins (only when the set of active pins changed)."""
        active = self.engine.active
        if active == self._for:  # every step but the few where pins start or stop: no work at all
            return
        self._for = active
        with torch.no_grad():
            self._write_masks()

    def _write_masks(self) -> None:
        """1 where free, 0 where an active pin holds the element, in every mask."""
        at = self._index
        for keep in self.keeps:
            keep.fill_(1)
        for target in self.engine.targets():
            i = at.get(target.name)
            if i is None:
                continue
            keep = self.keeps[i]
            view, positions, _ = target.part(keep)
            if positions is None:
                keep.zero_()
            else:
                fill_at(view, positions, 0)

    #: An LR scheduler wraps ``optimizer.step`` on the instance to notice steps (``_opt_called``);
    #: this step sets that flag itself, and the marker keeps a later scheduler from wrapping it.
    _wrapped_by_lr_sched = True

    @property
    def ready(self) -> bool:
        """Whether the next step may ignore pinned gradients: it runs compiled and every held
        parameter has its optimizer state (the first step creates it from the gradients, which
        must then be masked: the statistics of pinned elements start at zero, as without compile_step)."""
        if not self._has_state:  # once made, an optimizer's state is only ever replaced, not dropped
            state = self.optimizer.state
            self._has_state = all(p in state for p in self.params)
        return self.failed is None and self._has_state

    def mask_grad(self, name: str, grad: Tensor) -> bool:
        """Zero the pinned elements of ``grad`` (of parameter ``name``) with one dense pass (a NaN or
        inf gradient becomes 0 too), or nothing when no one reads the gradients before the step
        (``engine.grads_read_before_step`` is False) and the compiled step holds the tensor: it
        ignores pinned gradients. False when the engine's index mask must do it."""
        i = self._index.get(name)
        if i is None:
            return False
        if not self.engine.grads_read_before_step and self.ready:
            return True  # the step holds the whole tensor, whatever its gradient holds
        keep = self.keeps[i]
        if grad.dtype != self.params[i].dtype or grad.shape != keep.shape or is_sharded(grad):
            return False
        self.refresh()
        with torch.no_grad():
            try:
                self._mask(grad, keep)
            except Exception as err:
                if not _is_compile_error(err):
                    raise
                _mask_dense(grad, keep)
        return True

    def __call__(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        optimizer = self.optimizer
        optimizer._opt_called = True  # what an LR scheduler's wrapper of step() records
        args: tuple[Any, ...] = (optimizer,)
        kwargs: dict[str, Any] = {} if closure is None else {"closure": closure}
        # torch's own step names itself to the profiler; entering that context costs ~10 us a step,
        # so only while a profiler listens.
        profiling = torch._C._autograd._profiler_enabled()
        with (torch.autograd.profiler.record_function(f"Optimizer.step#{type(optimizer).__name__}.step")
              if profiling else contextlib.nullcontext()):
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
                self._eager(optimizer)  # the engine's post-step hook restores, as without compile_step
            optimizer._optimizer_step_code()
            for post_hook in (*optimizer._optimizer_step_post_hooks.values(),
                              *_global_optimizer_post_hooks.values()):
                post_hook(optimizer, args, kwargs)
        return loss

    def _run(self) -> None:
        self.refresh()
        self._undo_foreign_writes()
        measured = self.engine._wants_stats()
        if self.ready:
            function = self._compiled_measured if measured else self._compiled
        else:
            function = self._first_measured if measured else self._first
        try:
            with torch.no_grad():
                moved = function(self._step, self.optimizer, self.params, self.keeps)
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
            self.engine.mask_grads(self.optimizer)  # the compiled step did not ignore them: mask now
            self._eager(self.optimizer)
            return
        self._seen = [(p._version, p.data_ptr()) for p in self.params]
        self.engine._fused[id(self.optimizer)] = (self._names, moved if measured else None)

    def _undo_foreign_writes(self) -> None:
        """Write the targets of every held parameter something else wrote since the last step."""
        stale = {
            name for name, p, seen in zip(self.names, self.params, self._seen)
            if seen is None or seen != (p._version, p.data_ptr())
        }
        if stale:
            with torch.no_grad():
                self.engine._write([t for t in self.engine.targets() if t.name in stale])


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
