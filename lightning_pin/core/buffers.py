"""Buffers of frozen modules: a pin that freezes every parameter of a module holds its buffers too.

Freezing an encoder (``Pin("encoder.*")``) holds its weights, but a BatchNorm inside keeps
updating ``running_mean``, ``running_var`` and ``num_batches_tracked`` in every training forward,
so the frozen encoder's outputs in eval mode change all the same. Lightning's
``BaseFinetuning.freeze(train_bn=False)`` covers this; here the pin does: for each pin that
freezes whole modules (every parameter of the module, whole tensors, ``value=None``, no
``when``, ``buffers=True``), :class:`BufferHold` captures the persistent buffers of those modules
when the pin activates, writes them back after every optimizer step (through the engine's
restore hooks) and checks them in ``verify``. Torch only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_pin.core import kinds
from lightning_pin.core.errors import PinError
from lightning_pin.core.plan import PinPlan, ResolvedPin

__all__ = ["BufferHold", "BufferViolation", "freezes_modules", "held_buffers"]


@dataclasses.dataclass
class BufferViolation:
    """A held buffer found off its captured value (reads like the engine's parameter violations)."""

    name: str
    count: int
    examples: list[tuple[tuple[int, ...], Any, Any]]

    def __str__(self) -> str:
        shown = ", ".join(f"{c}: {a!r} != {t!r}" for c, a, t in self.examples)
        more = ", ..." if self.count > len(self.examples) else ""
        return f"{self.name} (buffer): {self.count} element(s) off target ({shown}{more})"


def freezes_modules(rp: ResolvedPin) -> bool:
    """Whether ``rp`` can freeze modules: whole tensors at their own values, on every step of its window."""
    return (
        rp.pin.buffers
        and kinds.for_pin(rp.pin).frozen  # other kinds (stuck bits, bounds) let the elements train
        and rp.when is None
        and bool(rp.selections)
        and all(s.index is None and s.values is None for s in rp.selections.values())
    )


def held_buffers(rp: ResolvedPin, module: nn.Module) -> list[str]:
    """Names of the persistent buffers of the modules whose every parameter ``rp`` pins.

    A module with no parameters of its own (``BatchNorm(affine=False)``) is covered through the
    smallest enclosing module with parameters that the pin freezes.
    """
    if not freezes_modules(rp):
        return []
    pinned = {id(s.parameter) for s in rp.selections.values()}
    names: list[str] = []
    for prefix, sub in module.named_modules():
        parameters = list(sub.parameters())
        if not parameters or not all(id(p) in pinned for p in parameters):
            continue
        for inner_prefix, inner in sub.named_modules(prefix=prefix):
            for key, buffer in inner._buffers.items():
                if buffer is None or key in inner._non_persistent_buffers_set:
                    continue
                name = f"{inner_prefix}.{key}" if inner_prefix else key
                if name not in names:
                    names.append(name)
    return names


class BufferHold:
    """Holds the buffers of modules that pins freeze, in one module, pin by pin.

    Drivers call :meth:`update` right after every change of the engine's active pins (a pin's
    buffers are captured when it activates, as its parameters are), :meth:`attach` once (the
    buffers are written back after every restore), and :meth:`violations` in their checks.

    Example::

        >>> import torch
        >>> from lightning_pin import Pin
        >>> from lightning_pin.core.plan import resolve
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1))
        >>> hold = BufferHold(resolve([Pin("1.*")], model), model)
        >>> hold.names
        ['1.running_mean', '1.running_var', '1.num_batches_tracked']
        >>> hold.update([0]); _ = model(torch.randn(4, 2)); hold.restore()
        >>> hold.violations()
        []
    """

    def __init__(self, plan: PinPlan, module: nn.Module) -> None:
        self.module = module
        #: Buffer names held by each pin id that freezes modules.
        self.by_pin: dict[int, list[str]] = {}
        for pin_id, rp in enumerate(plan.pins):
            names = held_buffers(rp, module)
            if names:
                self.by_pin[pin_id] = names
        #: Captured values by buffer name, for the pins active now.
        self.targets: dict[str, Tensor] = {}
        self._captured: set[int] = set()

    @property
    def names(self) -> list[str]:
        """Every buffer some pin may hold, in module order."""
        seen: list[str] = []
        for names in self.by_pin.values():
            seen += [n for n in names if n not in seen]
        return seen

    def __bool__(self) -> bool:
        return bool(self.by_pin)

    @torch.no_grad()
    def update(self, active: Iterable[int], recapture: bool = False) -> None:
        """Capture the buffers of pins that became active; let go of those of pins that stopped.

        ``recapture`` takes the values of every active pin afresh (after weights were loaded on
        resume: they hold what the saved run held).
        """
        active_here = {i for i in active if i in self.by_pin}
        if recapture:
            self._captured.clear()
        for pin_id in sorted(active_here - self._captured):
            for name in self.by_pin[pin_id]:
                if recapture or name not in self.targets:
                    self.targets[name] = self.module.get_buffer(name).detach().clone()
        self._captured = active_here
        still = {n for i in active_here for n in self.by_pin[i]}
        for name in [n for n in self.targets if n not in still]:
            del self.targets[name]

    @torch.no_grad()
    def restore(self) -> None:
        """Write the captured values back into the buffers (after an optimizer step)."""
        for name, target in self.targets.items():
            self.module.get_buffer(name).copy_(target)

    @torch.no_grad()
    def write_into(self, module: nn.Module) -> None:
        """Write the captured values into the same-named buffers of another copy of the module (an
        averaged model), so that it holds the frozen modules' statistics too; names it lacks are
        skipped."""
        for name, target in self.targets.items():
            try:
                buffer = module.get_buffer(name)
            except AttributeError:
                continue
            if buffer is not None and buffer.shape == target.shape:
                buffer.copy_(target)

    def attach(self, engine: Any) -> RemovableHandle:
        """Restore the buffers after every restore of ``engine``; returns the removable handle."""
        return engine.register_restore_hook(lambda stats: self.restore())

    @torch.no_grad()
    def off_count(self) -> Optional[Tensor]:
        """How many held elements of our module's buffers are off, as a 0-d tensor (no sync); None
        when a buffer is gone or reshaped (:meth:`violations` says how)."""
        counts = []
        for name, target in self.targets.items():
            try:
                buffer = self.module.get_buffer(name)
            except AttributeError:
                return None
            if buffer is None or buffer.shape != target.shape:
                return None
            counts.append((buffer.detach() != target.to(buffer.device)).sum())
        return torch.stack(counts).sum() if counts else None

    @torch.no_grad()
    def violations(self, module: Optional[nn.Module] = None, examples: int = 5) -> list[BufferViolation]:
        """Held buffers off their captured values (``torch.equal`` semantics), in ``module`` (default: ours)."""
        module = self.module if module is None else module
        found = []
        for name, target in self.targets.items():
            try:
                buffer = module.get_buffer(name)
            except AttributeError:
                buffer = None
            if buffer is None:
                raise PinError(
                    f"verify: the module has no buffer {name!r}, which a pin holds with its frozen module; verify "
                    "the module that was trained"
                )
            buffer = buffer.detach()
            if buffer.shape != target.shape:
                found.append(BufferViolation(name, target.numel(), [((), tuple(buffer.shape), tuple(target.shape))]))
                continue
            off = (buffer != target.to(buffer.device)).reshape(-1)
            if bool(off.any()):
                where = off.nonzero().squeeze(1)[:examples]
                if target.ndim:
                    coords = torch.stack(torch.unravel_index(where, tuple(target.shape)), dim=1).tolist()
                else:  # num_batches_tracked is a 0-d tensor
                    coords = [[]] * len(where)
                shown = [
                    (tuple(c), buffer.reshape(-1)[w].item(), target.reshape(-1)[w].item())
                    for c, w in zip(coords, where.tolist())
                ]
                found.append(BufferViolation(name, int(off.sum()), shown))
        return found

    def summary(self) -> str:
        """One line per pin that holds buffers, for the fit-start summary ('' when none does)."""
        lines = []
        for names in self.by_pin.values():
            sizes = ", ".join(f"{n} ({self.module.get_buffer(n).numel():,})" for n in names)
            lines.append(f"buffers held with their frozen modules: {sizes}")
        if lines:
            lines.append(
                "  (they keep the values they had when the pin activated; Pin(..., buffers=False) lets them update)"
            )
        return "\n".join(lines)
