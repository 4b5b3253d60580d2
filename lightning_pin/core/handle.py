"""The torch-native front door: :func:`pin` for plain PyTorch loops, Fabric and other trainers.

Same engine and guarantee as :class:`~lightning_pin.PinCallback`, driven by torch's own hooks
instead of Lightning's:

- pinned gradients are zeroed as backward accumulates them, so they are zero when
  ``loss.backward()`` returns: clipping, a ``GradScaler`` and the optimizer never see them, on
  every micro-batch of an accumulation window. First by a hook per parameter; once a backward is
  seen to run through the module's own forward output, by one callback at the end of each
  backward (:mod:`~lightning_pin.core.backward_end`), one Python call instead of one per
  parameter. Loops whose loss comes from submodules called directly, and sharded parameters,
  keep the hooks;
- a step pre-hook drops the gradients of wholly pinned tensors (the optimizer then skips them,
  weight decay and state included) and checks that ``when`` pins were decided for this batch;
- a step post-hook writes every pinned value back right after each real step (a step the scaler
  skips runs no hook and changes no weight), counts the steps of the first optimizer, and forces
  the values of pins whose window starts at the next step, so that step's forward sees them;
- a global step pre-hook (torch's ``register_optimizer_step_pre_hook``, which sees every
  optimizer) refuses the step of an optimizer the handle was not given that would update a
  pinned parameter, before the update lands. Param groups added to the handle's optimizers after
  :func:`pin` (progressive unfreezing with ``add_param_group``) are covered from their first step.

A step that ``torch.amp.GradScaler`` skips (inf/NaN gradients) calls no ``step()`` of a
for-loop or foreach optimizer: no hook runs and ``handle.step`` does not count it. A fused
optimizer's ``step()`` is called and skips its update on the device (``found_inf``); the handle
counts that step, as reading ``found_inf`` would cost a host-device sync per step.
"""

from __future__ import annotations

import operator
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from lightning_pin.core.backward_end import EndOfBackward
from lightning_pin.core import kinds
from lightning_pin.core.buffers import BufferHold
from lightning_pin.core.compiled_step import install
from lightning_pin.core.driver import (
    LIVE,
    StepDriver,
    load_outputs,
    load_pin_state,
    pin_state,
    ranks_agree,
    torch_collective,
)
from lightning_pin.core.engine import PinEngine, is_sharded
from lightning_pin.core.errors import PinError
from lightning_pin.core.modules import ParameterWatch, unwrap
from lightning_pin.core.plan import refuse_sparse_gradients, resolve
from lightning_pin.core.spec import Pin

__all__ = ["PinHandle", "PinsLike", "as_pins", "load_outputs", "pin", "unwrap_optimizer"]


PinsLike = Union[Pin, Mapping[str, Any], Sequence[Union[Pin, Mapping[str, Any]]]]  # NeuronPins too


def as_pins(pins: PinsLike) -> list[Any]:
    """``pins`` as a list of :class:`Pin` (and of output kinds' pins, such as
    :class:`~lightning_pin.NeuronPin`): one pin or mapping, or a sequence of them.

    Raises:
        PinError: ``pins`` is none of those.
    """
    if isinstance(pins, Mapping) or kinds.output_kind(pins) is not None or isinstance(pins, Pin):
        pins = [pins]
    if isinstance(pins, (str, bytes)) or not isinstance(pins, Sequence):
        raise PinError(f"pins must be a Pin, a mapping or a list of them, got {type(pins).__name__}")
    return [Pin.from_config(p) if kinds.output_kind(p) is None else kinds.output_kind(p).spec.from_config(p)
            for p in pins]


def unwrap_optimizer(optimizer: Any) -> Optimizer:
    """The ``torch.optim.Optimizer`` inside a wrapper (Fabric's ``_FabricOptimizer`` and
    Lightning's ``LightningOptimizer`` keep it in ``_optimizer``, Accelerate's in ``optimizer``).

    The wrappers pass ``isinstance(wrapper, Optimizer)`` (they imitate the wrapped class), so
    they are looked through whatever their type: hooks then sit on the optimizer whose
    ``step()`` runs, and are called with the same object the handle holds.

    Raises:
        PinError: ``optimizer`` is not an optimizer and wraps none.
    """
    for _ in range(4):
        attributes = vars(optimizer) if hasattr(optimizer, "__dict__") else {}
        inner = [attributes[k] for k in ("_optimizer", "optimizer") if isinstance(attributes.get(k), Optimizer)]
        if not inner or inner[0] is optimizer:
            break
        optimizer = inner[0]
    if not isinstance(optimizer, Optimizer):
        raise PinError(f"expected a torch.optim.Optimizer (or a Fabric-wrapped one), got {type(optimizer).__name__}")
    return optimizer


class PinHandle:
    """Pins attached to a module and its optimizers; returned by :func:`pin`.

    Use it as a context manager, or call :meth:`remove` when done. Attributes: ``step`` (the
    completed steps of the first optimizer), ``engine`` (the :class:`PinEngine` at work),
    ``module`` (the module the pins were resolved on, wrappers removed) and ``buffers`` (the
    :class:`~lightning_pin.core.buffers.BufferHold` of the modules the pins freeze).

    Before every step it checks, on the host, that each pinned parameter is still the module's
    (not replaced, cast or moved since :func:`pin`), and raises :class:`PinError` if not.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        engine: PinEngine,
        *,
        strict: bool = True,
        compile_step: bool = False,
        outputs: Sequence[Any] = (),
    ) -> None:
        self.module = module
        #: The runtimes of the output kinds' pins (stuck neurons: forward hooks), by kind name.
        self.outputs: dict[str, Any] = {hold.kind: hold for hold in outputs}
        self.optimizers = list(optimizers)
        self.engine = engine
        #: Default of :meth:`load_state_dict`'s ``strict``.
        self.strict = strict
        # Ids of the optimizers that may step: batch_start ran since their last step. Per
        # optimizer, so one batch_start covers a batch that steps several of them.
        self._decided: set[int] = set()
        self._has_when = any(rp.when is not None for rp in engine.plan.pins)
        self._handles: list[RemovableHandle] = []
        self._removed = False
        #: Buffers of the modules the pins freeze (BatchNorm running statistics), held with them.
        self.buffers = BufferHold(engine.plan, module)
        # The step's order (core/driver.py), shared with PinCallback; this handle adapts an optimizer's
        # hooks to it. Its pending_reset: step-window pins that pin() activated, whose optimizer
        # statistics are zeroed right before the first step rather than in pin(): a resume may load the
        # optimizer's state after pin(), and load_state_dict() then cancels it (the saved run zeroed them).
        self._driver = StepDriver(engine, self.buffers, self.outputs, optimizers=self.optimizers,
                                  masked_at_backward=True)
        self._compile_step = compile_step
        # What each pinned parameter was when the pins were resolved (core/modules.py): a step is
        # refused if the module holds another object under the name, or the tensor was cast or moved.
        self._watch = ParameterWatch(module, engine.plan.parameters)
        # Pinned gradients are zeroed by a hook per parameter as backward accumulates them until a
        # backward is seen to run through the module's own forward output; from then on all at
        # once at the end of each backward (core/backward_end.py), one call instead of one per
        # parameter. A loop whose loss comes from submodules called directly (a multi-head model)
        # keeps the hooks. Sharded parameters (FSDP2 assigns their gradients itself) always do.
        # _masked_for: ids of the optimizers whose parameters were masked since their last step.
        self._grouped = False
        self._may_group = not any(is_sharded(p) for p in engine.plan.parameters.values())
        self._end_of_backward: Optional[EndOfBackward] = None
        self._grad_hooks: list[RemovableHandle] = []
        self._masked_for: set[int] = set()
        self._optimizer_ids = frozenset(id(o) for o in self.optimizers)
        # Ids of the optimizers the handle was given, and of optimizers they wrap (ZeroRedundancyOptimizer
        # steps its `optim` inside its own step, whose post-hook restores after): the global check
        # (_check_any_step) skips them.
        self._own_ids = frozenset(
            [id(o) for o in self.optimizers]
            + [id(v) for o in self.optimizers for v in vars(o).values() if isinstance(v, Optimizer)]
        )
        # With the hooks per parameter: element-pinned parameters frozen when the hooks were
        # placed (no hook can sit on them), watched for a gradient (unfrozen later).
        self._unhooked: list[tuple[str, nn.Parameter]] = []
        # Averaged copies that hold the pins (see hold): id -> (what it is, its module, its handle).
        self._held: dict[int, tuple[str, nn.Module, Any]] = {}

    @property
    def step(self) -> int:
        """Completed steps of the first optimizer: the step the pins' windows refer to."""
        return self._driver.step

    def _attach(self) -> None:
        engine = self.engine
        self._grad_hooks = engine.register_grad_hooks()
        self._handles += self._grad_hooks
        self._unhooked = self._frozen_element_pinned()
        self._handles.append(_Covering(self))
        if self._may_group:
            self._end_of_backward = EndOfBackward(self.module, self._after_backward)
            self._handles.append(self._end_of_backward)
        for optimizer in self.optimizers:
            self._handles.append(optimizer.register_step_pre_hook(self._before_step))
        self._handles += engine.attach(self.optimizers)  # restores after each step
        if self.buffers:
            self._handles.append(self.buffers.attach(engine))
        for optimizer in self.optimizers:  # after the restore: post-hooks run in registration order
            self._handles.append(optimizer.register_step_post_hook(self._after_step))
        if self._compile_step:
            self._handles += install(engine, self.optimizers, lambda m: warnings.warn(m, UserWarning, stacklevel=4))
        for hold in self.outputs.values():
            self._handles += hold.attach()

    # ------------------------------------------------------------------------------------------
    # Checks that the handle still applies

    def _refuse_if_removed(self, call: str) -> None:
        if self._removed:
            raise PinError(
                f"handle.{call}() on a removed PinHandle: its pins were removed (handle.remove() or the end of "
                "its `with` block) and it changes nothing any more; call pin(...) again to pin anew"
            )

    def _check_module(self, when: str) -> None:
        """Raise if a pinned parameter was replaced, cast or moved since :func:`pin` resolved it.

        Host-side only (identity, dtype and device of Python objects): no device sync.
        """
        if self._watch.intact():
            return
        name, change = self._watch.first_change() or ("?", "replaced")
        if change in ("gone", "replaced"):
            now = "is gone from the module" if change == "gone" else "is no longer the tensor pin() resolved"
            raise PinError(
                f"{when}: the pinned parameter {name!r} {now} (re-initialised, tied or replaced by a new "
                "nn.Parameter after pin()?): the pins hold the old tensor, not the one the module trains. Replace "
                "parameters before calling pin(), or call handle.remove() and pin(...) again on the module as it "
                "is now"
            )
        raise PinError(
            f"{when}: the pinned parameter {name!r} was {change} after pin() (model.double(), model.to(...), "
            "Fabric's setup with a '-true' precision?); its targets are in the old dtype. Cast or move the module "
            "first (Fabric: fabric.setup(...)), then call pin()"
        )

    # ------------------------------------------------------------------------------------------
    # The loop

    def batch_start(self, batch: Any, batch_idx: int) -> None:
        """Decide the ``when`` pins for this batch; call before its forward (needed only with ``when`` pins).

        Raises:
            PinError: a ``when`` returned something other than a bool (or 0-d bool tensor), or
                has the wrong signature; the handle was removed; a pinned parameter was
                replaced, cast or moved after :func:`pin`.
        """
        self._refuse_if_removed("batch_start")
        self._check_module("handle.batch_start")
        self._driver.reduce_max = torch_collective()
        self._driver.decide(self._driver.step, batch, batch_idx)
        self._decided = {id(o) for o in self.optimizers}

    def _after_backward(self) -> None:
        if self._grouped:
            self.engine.mask_all_grads()
        else:  # the hooks per parameter masked this backward; the next ones are masked here
            for hook in self._grad_hooks:
                hook.remove()
                self._handles.remove(hook)
            self._grad_hooks = []
            self._grouped = True
        self._masked_for = set(self._optimizer_ids)

    def _check_masked(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """Before a step, in grouped mode: the gradients it reads were masked at the end of a backward.

        If not (the loss came from a submodule called directly, not from the module's output),
        mask them now, so the step is exact, and zero pinned gradients from now on with a hook per
        parameter as backward accumulates them. A step given a closure runs its backward inside."""
        # torch passes the optimizer itself as args[0]; a closure comes after it or by keyword.
        if id(optimizer) in self._masked_for or len(args) > 1 or kwargs.get("closure") is not None:
            return
        held = self.engine._names_of(optimizer)
        if all(p.grad is None for n, p in self.engine.plan.parameters.items() if n in held):
            return
        warnings.warn(
            f"pin(): the gradients of the pinned parameters reached {type(optimizer).__name__}.step() without a "
            f"backward through {type(self.module).__name__}'s forward output, after earlier backwards went through "
            "it (is the loss sometimes computed from a submodule called directly?). They are zeroed now, before "
            "the step, and from now on as backward accumulates them (a hook per parameter); anything that read "
            "them since backward (gradient clipping) saw them unmasked this once.",
            UserWarning,
            stacklevel=4,
        )
        self.engine.mask_all_grads()
        if self._end_of_backward is not None:
            self._end_of_backward.remove()
            self._handles.remove(self._end_of_backward)
            self._end_of_backward = None
        self._grad_hooks = self.engine.register_grad_hooks()
        self._handles += self._grad_hooks
        self._unhooked = self._frozen_element_pinned()
        self._grouped = False

    def _frozen_element_pinned(self) -> list[tuple[str, nn.Parameter]]:
        """Element-pinned parameters without a gradient hook (frozen when the hooks were placed)."""
        plan = self.engine.plan
        elements = {name for rp in plan.pins for name, sel in rp.selections.items() if sel.index is not None}
        return [(n, p) for n, p in plan.parameters.items() if n in elements and not p.requires_grad]

    def _hook_unfrozen(self) -> None:
        """With the hooks per parameter: an element-pinned parameter frozen at :func:`pin` and
        unfrozen since has an unmasked gradient: mask it now, before the step, and hook it from
        now on. Wholly pinned tensors need none of this (their gradient is dropped before the step)."""
        still = []
        for name, parameter in self._unhooked:
            if parameter.grad is not None:
                self.engine._grad_hook(name)(parameter)
            if parameter.requires_grad:
                hooks = self.engine.register_grad_hooks([name])
                self._grad_hooks += hooks
                self._handles += hooks
            else:
                still.append((name, parameter))
        self._unhooked = still

    def _before_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        # Runs at every step: the common case is written out (see benchmarks/step_calls.py).
        if not self._watch.intact():
            self._check_module("before optimizer.step()")
        if self._grouped:
            if id(optimizer) not in self._masked_for:
                self._check_masked(optimizer, args, kwargs)
        elif self._unhooked:
            self._hook_unfrozen()
        if self._has_when and id(optimizer) not in self._decided:
            raise PinError(
                "a pin has `when`, but handle.batch_start(batch, batch_idx) was not called since this "
                "optimizer's last step: call it before each batch's forward, so the pin knows whether this "
                "batch is pinned"
            )
        self._driver.before_step(optimizer)

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self._decided.discard(id(optimizer))
        self._masked_for.discard(id(optimizer))
        if optimizer is not self.optimizers[0]:
            return
        # Counts the step. Pins whose window starts now are forced before the next forward; when pins
        # keep this batch's decision until the next batch_start.
        driver = self._driver
        driver.advance(driver.step + 1)

    # ------------------------------------------------------------------------------------------
    # Checks and state

    def verify(self, module: Optional[nn.Module] = None) -> None:
        """Raise :class:`PinError` naming every pinned element that is off target.

        Checks every pin active at the last optimizer step (before any step: every pin active
        now) against ``module`` (default: the pinned module; wrappers are looked through).

        Raises:
            PinError: an active pinned element is off target, or a pinned parameter is missing
                from ``module`` or changed shape; without ``module``, also when a pinned parameter
                of the pinned module was replaced, cast or moved after :func:`pin`, or an element
                of an averaged copy :meth:`hold` keeps is off target.
        """
        if module is None:
            self._check_module("handle.verify")
        engine = self.engine
        pin_ids = engine.checked_ids
        parameters = None if module is None else dict(unwrap(module).named_parameters(remove_duplicate=False))
        violations: list[Any] = engine.violations(parameters, pin_ids)
        violations += self.buffers.violations(None if module is None else unwrap(module))
        lines = [str(v) for v in violations]
        if module is None:  # the averaged copies hold() keeps, named
            for what, copy, _ in self._held.values():
                held = dict(copy.named_parameters(remove_duplicate=False))
                found = engine.violations(held, pin_ids) + self.buffers.violations(copy)
                violations += found
                lines += [f"in the held copy {what}: {v}" for v in found]
        if violations:
            total = sum(v.count for v in violations)
            raise PinError(f"{total} pinned element(s) off target:\n" + "\n".join(f"  {line}" for line in lines))

    def hold(self, averaged: nn.Module) -> _Undo:
        """Make an averaged copy of the weights hold the pins too: a plain loop's
        ``torch.optim.swa_utils.AveragedModel`` (SWA, EMA or any ``avg_fn`` / ``multi_avg_fn``).

        Averaging moves pinned elements (an EMA rounds a pinned value, an average of words breaks
        their stuck bits), and the copy is what gets evaluated and saved. From now on, right after
        every ``averaged.update_parameters(model)``, the targets of the pins active at the last
        step (values, stuck bits, bounds) are written into its pinned elements, and into the
        buffers the pins hold (with ``use_buffers=True``); also at once, for a copy taken before
        :func:`pin`. Neuron pins stick the same units in the copy's forward (it is the same chip).
        :meth:`verify` then checks the copy too. Removing the returned handle (or
        this one) stops it.

        Example::

            >>> import torch
            >>> from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
            >>> from lightning_pin import Pin, pin
            >>> model = torch.nn.Linear(4, 2)
            >>> optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
            >>> ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))
            >>> with pin(model, optimizer, Pin("weight", indices=[(0, 0)], stuck_at_one=0x80000000)) as handle:
            ...     _ = handle.hold(ema)
            ...     for _ in range(3):
            ...         model(torch.randn(8, 4)).square().sum().backward()
            ...         optimizer.step()
            ...         optimizer.zero_grad()
            ...         ema.update_parameters(model)
            ...     handle.verify()                     # the model and the EMA copy
            >>> bool(ema.module.weight[0, 0] <= 0)     # its sign bit is stuck at 1 in the copy too
            True

        Raises:
            PinError: ``averaged`` is not an ``AveragedModel`` (no ``update_parameters`` and
                ``module``), it lacks a pinned parameter or holds it in another shape, or the
                handle was removed.
        """
        self._refuse_if_removed("hold")
        inner = getattr(averaged, "module", None)
        if not isinstance(averaged, nn.Module) or not isinstance(inner, nn.Module) or not callable(
            getattr(averaged, "update_parameters", None)
        ):
            raise PinError(
                f"hold() takes a torch.optim.swa_utils.AveragedModel (a module with .module and .update_parameters), "
                f"got {_kind(averaged)}"
            )
        copy = unwrap(inner)
        parameters = dict(copy.named_parameters(remove_duplicate=False))
        for name, parameter in self.engine.plan.parameters.items():
            held = parameters.get(name)
            if held is None or held.shape != parameter.shape:
                what = "lacks the pinned parameter" if held is None else f"holds {tuple(held.shape)} for"
                raise PinError(
                    f"hold(): the averaged copy ({type(copy).__name__}) {what} {name!r} "
                    f"{tuple(parameter.shape)}: average a copy of the pinned module (AveragedModel(model))"
                )
        # Stuck neurons are in the chip, not in the weights: the copy's forward has them too.
        neuron_hooks = [h for output in self.outputs.values() for h in output.attach_to(copy)]
        update = averaged.update_parameters

        def update_and_hold(*args: Any, **kwargs: Any) -> Any:
            result = update(*args, **kwargs)
            self._driver.write_into(copy, parameters)
            return result

        # An instance attribute (nn.Module keeps it in __dict__): removing it brings back the method.
        object.__setattr__(averaged, "update_parameters", update_and_hold)
        self._driver.write_into(copy, parameters)
        holds = self._held

        def undo() -> None:
            if vars(averaged).get("update_parameters") is update_and_hold:
                method = getattr(update, "__func__", None)
                if update.__self__ is averaged and method is type(averaged).update_parameters:
                    del vars(averaged)["update_parameters"]
                else:
                    object.__setattr__(averaged, "update_parameters", update)  # another wrapper was there
            holds.pop(id(averaged), None)
            for hook in neuron_hooks:
                hook.remove()

        removable = _Undo(undo)
        holds[id(averaged)] = (type(averaged).__name__, copy, removable)
        self._handles.append(removable)
        return removable

    def state_dict(self) -> dict[str, Any]:
        """Selections, targets (captured ones too), activity and the step count: tensors, lists,
        dicts and primitives only, so ``torch.load(weights_only=True)`` reads it back."""
        return pin_state(self.engine, self.outputs, step=self.step)

    def load_state_dict(self, state: Mapping[str, Any], strict: Optional[bool] = None) -> None:
        """Resume: take the saved targets and step count, and force the targets into the weights.

        Call after loading the model's and optimizers' state (before or after :func:`pin`): the
        saved targets win over whatever the loaded weights hold, and the loaded optimizer
        statistics are kept as saved. ``strict`` (default: the one given to :func:`pin`) refuses
        saved state that does not match these pins; with ``strict=False`` a warning names it and
        the mismatching pins start afresh.

        Raises:
            PinError: the state is corrupt or does not match these pins (with ``strict``), or the
                handle was removed.
        """
        self._refuse_if_removed("load_state_dict")
        self._check_module("handle.load_state_dict")
        saved = load_pin_state(self.engine, self.outputs, state, self.strict if strict is None else strict)
        if saved is not None:
            # The saved run zeroed the statistics of its pins when they activated; the loaded
            # optimizer state already reflects that (pins that start afresh are activated below).
            self._driver.pending_reset = []
            if saved.step is not None:
                self._driver.step = saved.step
        # Forces the saved targets; the loaded weights hold the buffers the saved run held: the held values.
        self._driver.force(self._driver.step)

    def remove(self) -> None:
        """Remove every hook this handle placed; the weights keep their values.

        A removed handle changes nothing any more: :meth:`batch_start` and :meth:`load_state_dict`
        raise :class:`PinError`; :meth:`verify` and :meth:`state_dict` still report on the pins.
        """
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.engine.detach()
        self._removed = True
        LIVE.discard(self)

    def __enter__(self) -> PinHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        plan = self.engine.plan
        return (
            f"PinHandle({len(plan.pins)} pin{'s' if len(plan.pins) != 1 else ''} on {len(plan.parameters)} "
            f"parameter{'s' if len(plan.parameters) != 1 else ''}, step={self.step}, "
            f"active={sorted(self.engine.active)})"
        )


def pin(module: nn.Module, optimizers: Union[Optimizer, Sequence[Optimizer]], pins: PinsLike, *, strict: bool = True,
        compile_step: bool = False, zero_pinned_grads: bool = True) -> PinHandle:
    """Pin ``pins`` on ``module`` for a plain PyTorch loop (or Fabric, or any trainer); return the handle.

    Resolves every pin on ``module`` (a plain ``nn.Module``, a ``torch.compile`` wrapper or a
    Fabric-wrapped module: names are those of the module inside), forces the values of the pins
    active at step 0, and attaches to ``optimizers`` (one or a list, Fabric-wrapped ones too).
    From then on pinned gradients are zero when ``backward()`` returns, and after every
    ``optimizer.step()`` each active pinned element equals its target bit for bit.

    Args:
        module: The module being trained.
        optimizers: Its optimizer, or a list of them; ``handle.step`` counts the first one's steps.
        pins: :class:`Pin`\\ s, or mappings with the same keys.
        strict: Refuse saved pin state that does not match in :meth:`PinHandle.load_state_dict`.
        compile_step: Run each optimizer's step through ``torch.compile`` with the pinning fused
            into it (:mod:`lightning_pin.core.compiled_step`); where it cannot be compiled the step
            stays eager, with one warning saying why.
        zero_pinned_grads: With ``compile_step``, False leaves the gradients of the tensors the
            compiled step holds as backward made them (the step ignores pinned ones), saving a pass
            over those gradients per backward. Only when nothing reads the gradients between
            ``backward()`` and ``step()``: gradient clipping and ``GradScaler.unscale_`` would see
            the pinned ones. Without ``compile_step`` it changes nothing.

    Under torch.distributed, call it on every rank with the same pins: the ranks compare what
    they resolved once (one small all-reduce), and all of them raise if one rejects its pins.

    A pin that freezes whole modules (``Pin("encoder.*")``: every parameter of a module, whole
    tensors, ``value=None``) also holds their buffers (BatchNorm running statistics) unless
    ``buffers=False``.

    Raises:
        PinError: ``module`` is not an ``nn.Module``; no optimizer is given; a pin cannot be
            honoured (named, with what would be right); it gives an element another value than a
            live handle or a fitting PinCallback on the same module; or the ranks of a distributed
            run resolved different pins. No weight has changed and no hook is left behind. Later, at a step: an
            optimizer not in ``optimizers`` is about to update a pinned parameter (refused before
            its update). A pinned parameter no optimizer holds yet is fine: a param group added to
            one of ``optimizers`` later (``add_param_group``) is covered from its first step.

    Example::

        >>> import torch
        >>> from lightning_pin import Pin, pin
        >>> model = torch.nn.Linear(4, 2)
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        >>> with pin(model, optimizer, [Pin("weight", indices=[(0, 0)], value=0.5), Pin("bias")]) as handle:
        ...     for _ in range(3):
        ...         model(torch.randn(8, 4)).square().sum().backward()
        ...         optimizer.step()
        ...         optimizer.zero_grad()
        ...     handle.verify()
        >>> model.weight[0, 0].item(), handle.step
        (0.5, 3)
    """
    if not isinstance(module, nn.Module):
        raise PinError(f"pin() needs the torch.nn.Module being trained as its first argument, got {_kind(module)}")
    optimizer_list = [optimizers] if not isinstance(optimizers, (list, tuple)) else list(optimizers)
    target = unwrap(module)
    try:
        if not optimizer_list:
            raise PinError(
                "pin() was given no optimizer: the pins hook into the optimizers' steps, so without one nothing "
                "would hold them. Pass the optimizer(s) that train the module: pin(model, optimizer, pins)"
            )
        optimizer_list = [unwrap_optimizer(o) for o in optimizer_list]
        weight_pins, output_pins = kinds.split(as_pins(pins))
        engine: Optional[PinEngine] = PinEngine(resolve(weight_pins, target))  # every check, nothing touched
        outputs = [kind.hold(specs, target) for kind, specs in output_pins]
        refuse_sparse_gradients(engine.plan, target)
        LIVE.refuse_conflicts(engine.plan, target, "pin()")
        rejected = None
    except PinError as err:
        engine, rejected = None, err
    reduce_max = torch_collective()
    device = next((p.device for p in target.parameters()), torch.device("cpu"))
    rank = torch.distributed.get_rank() if reduce_max is not None else 0
    ranks_agree(None if engine is None else engine.plan, rejected, reduce_max, device, rank=rank,
                stops="pin() fails on every rank")
    handle = PinHandle(target, optimizer_list, engine, strict=strict, compile_step=compile_step, outputs=outputs)
    engine.grads_read_before_step = bool(zero_pinned_grads)
    try:
        # Capture and force the pins of step 0 before attaching to the optimizers, so that their
        # statistics are zeroed at the first step, not now (see StepDriver.pending_reset).
        started = handle._driver.advance(0, outputs=False)
        handle._driver.pending_reset = [i for i in started if engine.plan.pins[i].when is None]
        handle._attach()
    except BaseException:
        handle.remove()  # no hook left behind
        raise
    LIVE.add(target, handle, "pin()")
    return handle


class _Undo:
    """A removable handle that calls ``undo`` once."""

    def __init__(self, undo: Any) -> None:
        self._undo = undo

    def remove(self) -> None:
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()


def _kind(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


# Every live handle's check of the optimizers it was not given runs from one torch-global step
# pre-hook (register_optimizer_step_pre_hook sees every optimizer), installed while a handle lives:
# per step, one param-group layout and one lookup, whatever the number of handles.
# Live handles by id: the index of that check over the attached pin() handles (the registry of live pins by
# module is core/driver.py's LIVE). A weak reference with a callback, not a WeakSet: a handle collected without
# remove() (dropped in a reference cycle) must also recompute _GIVEN_TO_ALL, or every later step of
# every optimizer would take the slow path of the check below.
_COVERING: dict[int, weakref.ref[PinHandle]] = {}
_GLOBAL_HOOK: list[RemovableHandle] = []
# Per optimizer: (the handles' version, its param-group layout, [(handle, names, parameters)] of
# the live handles it was not given whose pinned parameters it holds).
_HELD: weakref.WeakKeyDictionary[Optimizer, tuple[int, tuple[tuple[int, ...], tuple[int, ...]], list[Any]]] = (
    weakref.WeakKeyDictionary()
)
_VERSION = [0]
# Ids of the optimizers every live handle was given (recomputed when a handle comes or goes): their
# steps need no check, and the usual loop (one handle) pays a set lookup per step.
_GIVEN_TO_ALL: list[frozenset[int]] = [frozenset()]


def _handles_changed() -> None:
    _VERSION[0] += 1
    live = [h for h in (ref() for ref in list(_COVERING.values())) if h is not None]
    _GIVEN_TO_ALL[0] = frozenset.intersection(*(h._own_ids for h in live)) if live else frozenset()


# Which parameter lists an optimizer's groups hold and how long they are (a change means the cached
# answer of _check_any_step is stale), read with C-level map calls only: no Python frame on a check
# that runs on every step of every optimizer while a handle is live.
_PARAMS_OF_GROUP = operator.itemgetter("params")


def _check_any_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    """The global step pre-hook: an optimizer may not update the pinned parameters of a live handle
    it was not given. Host-side only (identity of Python objects, ``requires_grad``, ``grad is None``).

    Raises:
        PinError: before the update lands, naming the optimizer and the parameters.
    """
    if id(optimizer) in _GIVEN_TO_ALL[0]:
        return
    lists = list(map(_PARAMS_OF_GROUP, optimizer.param_groups))
    layout = tuple(map(id, lists)), tuple(map(len, lists))
    cached = _HELD.get(optimizer)
    if cached is None or cached[0] != _VERSION[0] or cached[1] != layout:
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        held = []
        for handle in (ref() for ref in list(_COVERING.values())):
            if handle is None or id(optimizer) in handle._own_ids:
                continue
            mine = [(n, p) for n, p in handle.engine.plan.parameters.items() if id(p) in ids]
            if mine:
                held.append((weakref.ref(handle), mine))
        cached = _HELD[optimizer] = (_VERSION[0], layout, held)
    for _, mine in cached[2]:
        # A frozen parameter without a gradient is skipped by the optimizer: holding it is harmless.
        stepped = [name for name, p in mine if p.requires_grad or p.grad is not None]
        if stepped:
            raise PinError(
                f"{type(optimizer).__name__} (an optimizer not given to pin()) is about to step the pinned "
                f"parameter(s) {stepped[:10]}: its update (weight decay, momentum) would move them with nothing to "
                "restore them, so the step is refused before it changes anything. Pass every optimizer that "
                "updates the module: pin(model, [opt1, opt2], pins), take the pinned parameters out of its param "
                "groups, or handle.remove() the pin() you are done with"
            )


class _Covering:
    """A handle's place in the global check (see :func:`_check_any_step`); ``remove()`` takes it out,
    and the global hook goes when no handle is left."""

    def __init__(self, handle: PinHandle) -> None:
        self._key = id(handle)
        # The callback runs if the handle is collected without remove() (see _COVERING).
        self._handle = weakref.ref(handle, lambda _: self.remove())
        _COVERING[self._key] = self._handle
        _handles_changed()
        if not _GLOBAL_HOOK:
            _GLOBAL_HOOK.append(register_optimizer_step_pre_hook(_check_any_step))

    def remove(self) -> None:
        if _COVERING.get(self._key) is self._handle:  # not yet removed (and the id not reused)
            del _COVERING[self._key]
        _handles_changed()
        if not _COVERING and _GLOBAL_HOOK:
            _GLOBAL_HOOK.pop().remove()
