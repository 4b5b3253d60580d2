"""Task ownership: an owner per element of the shared parameters, and what each task does to it
(start and train with pins, prune, commit, view)."""

from __future__ import annotations

import contextlib
import math
import numbers
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, Optional, Union

import torch
from torch import Tensor, nn

from lightning_pin.core.engine import is_sharded
from lightning_pin.core.errors import PinError
from lightning_pin.core.modules import unwrap
from lightning_pin.core.plan import resolve
from lightning_pin.core.spec import Pin
from lightning_pin.tasks._common import (
    _COMMITTED, _DTYPES, _NORM_MODES, _PRUNED, _RELEASES, _TRAINING, _as_patterns, _exact_pattern, _name_seed,
    _norm_types, _smallest,
)
from lightning_pin.tasks.inspection import OwnershipInspection
from lightning_pin.tasks.saved import SavedOwnership

__all__ = ["TaskOwnership"]


class TaskOwnership(SavedOwnership, OwnershipInspection):
    """An owner per element of chosen parameters: PackNet-style task ownership held by pins.

    Args:
        module: The model (wrappers such as ``torch.compile``, DDP and Fabric are looked through).
        params: ``fnmatch`` globs (or ``"re:"`` regexes) over parameter names, as in
            :class:`~lightning_pin.Pin`: the parameters whose elements tasks share. Parameters of
            normalization layers and of ``heads`` are taken out: they are per task as a whole.
        heads: Optional ``{task: patterns}`` of parameters that belong wholly to one task (a
            per-task classifier): held from the next task on, zero in views of earlier tasks,
            part of the task's fingerprint.
        norm: ``"per_task"`` (default): the affine parameters and running statistics of every
            normalization layer (BatchNorm, LayerNorm, GroupNorm, ...) train with each task, are
            snapshotted at :meth:`commit` and swapped in by :meth:`view`. ``"first"``: they are
            held at their values after task 1 (affine parameters pinned from task 2 on; every view
            uses task 1's running statistics; put the layers in ``eval()`` to keep them from
            updating their live statistics in later tasks).
        max_tasks: The largest task id: up to 255 the owner map takes one byte per element
            (``uint8``), up to 32767 two (``int16``).
        seed: Seeds the tie-break among elements of equal magnitude in :meth:`prune`.

    Tasks run in increasing order, one at a time. Every method checks its input first and raises
    :class:`~lightning_pin.PinError` (with what would be right) before changing any weight.

    Example::

        >>> import torch
        >>> from lightning_pin import pin
        >>> from lightning_pin.tasks import TaskOwnership
        >>> model = torch.nn.Linear(4, 2)
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
        >>> own = TaskOwnership(model, "*")
        >>> def train(pins, steps=3):
        ...     with pin(model, optimizer, pins):
        ...         for _ in range(steps):
        ...             model(torch.randn(8, 4)).square().mean().backward()
        ...             optimizer.step()
        ...             optimizer.zero_grad()
        >>> train(own.pins(1))
        >>> own.prune(1, 0.5)                  # pruned elements per parameter
        {'weight': 4, 'bias': 1}
        >>> train(own.pins(1)); own.commit(1)
        >>> before = own.fingerprint(1)
        >>> train(own.pins(2)); own.commit(2)
        >>> own.fingerprint(1) == before, own.capacity()
        (True, {'weight': 0.0, 'bias': 0.0})
    """

    def __init__(
        self,
        module: nn.Module,
        params: Union[str, Sequence[str]] = "*",
        *,
        heads: Optional[Mapping[int, Union[str, Sequence[str]]]] = None,
        norm: Literal["per_task", "first"] = "per_task",
        max_tasks: int = 255,
        seed: int = 0,
    ) -> None:
        if norm not in _NORM_MODES:
            raise PinError(f"TaskOwnership: norm must be one of {_NORM_MODES}, got {norm!r}")
        if isinstance(max_tasks, bool) or not isinstance(max_tasks, numbers.Integral) or not 1 <= max_tasks <= 32767:
            raise PinError(f"TaskOwnership: max_tasks must be an integer in [1, 32767], got {max_tasks!r}")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise PinError(f"TaskOwnership: seed must be an integer, got {seed!r}")
        self.module = unwrap(module)
        self.norm = norm
        self.max_tasks = int(max_tasks)
        self.seed = int(seed)
        self._dtype = next(dtype for limit, dtype in _DTYPES if self.max_tasks <= limit)

        named = self._match(params)  # PinError with the closest names when a pattern matches nothing
        #: Normalization layers by module name: their parameters and buffers are per task.
        self.norm_layers = {n: m for n, m in self.module.named_modules() if isinstance(m, _norm_types())}
        norm_params = {f"{n}.{p}" if n else p for n, m in self.norm_layers.items() for p, _ in m.named_parameters(
            recurse=False)}
        #: Per-task parameters (``heads``), by task.
        self.heads: dict[int, list[str]] = {}
        for task, patterns in (heads or {}).items():
            task = int(task) if isinstance(task, str) and task.isdigit() else task  # YAML keys may be strings
            self._check_task(task, "heads")
            self.heads[int(task)] = list(self._match(patterns))
        head_names = [n for names in self.heads.values() for n in names]
        if len(head_names) != len(set(head_names)):
            raise PinError(f"TaskOwnership: heads {dict(heads or {})!r} give one parameter to two tasks")
        shared = [n for n in named if n not in norm_params and n not in head_names]
        if not shared:
            raise PinError(
                f"TaskOwnership: {params!r} matches only normalization-layer or head parameters ({list(named)}); "
                "name the weights tasks share, e.g. '*' or 're:.*weight'"
            )
        #: The shared parameters, by name.
        self.parameters: dict[str, nn.Parameter] = {n: named[n] for n in shared}
        #: Owner per element (0 = free), on each parameter's device.
        self.owner: dict[str, Tensor] = {
            n: torch.zeros(p.shape, dtype=self._dtype, device=p.device) for n, p in self.parameters.items()
        }
        self._status: dict[int, str] = {}
        self._norm_snapshots: dict[int, dict[str, Tensor]] = {}
        # prune(release="keep"): per parameter, the pruned positions (flat) and their values
        # before the prune, written back at commit().
        self._released: dict[str, tuple[Tensor, Tensor]] = {}
        loose = [n for n, p in self.module.named_parameters()
                 if p.requires_grad and n not in self.parameters and n not in norm_params and n not in head_names]
        if loose:
            # Nothing holds them: later tasks train them, and views of earlier tasks see the change.
            warnings.warn(
                f"TaskOwnership: {len(loose)} trainable parameter(s) are neither shared ({params!r}), nor a head, nor "
                f"part of a normalization layer, so no task owns them and later tasks will change them: "
                f"{loose[:5]}{' ...' if len(loose) > 5 else ''}. Add them to params or heads, or freeze them.",
                UserWarning,
                stacklevel=2,
            )

    # ------------------------------------------------------------------------------------------
    # Names and checks

    def _match(self, params: Union[str, Sequence[str]]) -> dict[str, nn.Parameter]:
        patterns = _as_patterns(params)
        if not patterns or not all(isinstance(p, str) and p for p in patterns):
            raise PinError(f"TaskOwnership: params must be a non-empty pattern or list of patterns, got {params!r}")
        plan = resolve([Pin(patterns)], self.module)
        return dict(plan.parameters)

    def _check_task(self, task: Any, what: str) -> int:
        limit = self.max_tasks
        if isinstance(task, bool) or not isinstance(task, numbers.Integral) or not 1 <= task <= limit:
            raise PinError(
                f"TaskOwnership.{what}: task must be an integer in [1, {limit}] (max_tasks={limit}; the owner map "
                f"is {str(self._dtype).removeprefix('torch.')}: pass max_tasks up to 32767 for more), got {task!r}"
            )
        return int(task)

    def _follow_parameters(self, what: str) -> None:
        """Keep each owner map on its parameter's device (the model may have moved since), and
        refuse sharded parameters, whose elements this process does not all hold."""
        for name, parameter in self.parameters.items():
            if is_sharded(parameter):
                raise PinError(f"TaskOwnership.{what}: {name!r} is sharded (a DTensor); prune, view and "
                               "fingerprint need the full parameters: call them on the unsharded module")
            if self.owner[name].device != parameter.device:
                self.owner[name] = self.owner[name].to(parameter.device)

    @property
    def committed(self) -> list[int]:
        """The committed tasks, in order."""
        return sorted(t for t, s in self._status.items() if s == _COMMITTED)

    @property
    def current(self) -> Optional[int]:
        """The task in progress (started by :meth:`pins`, not committed yet), or None."""
        return next((t for t, s in self._status.items() if s != _COMMITTED), None)

    def _require_status(self, task: int, what: str, allowed: Sequence[str]) -> str:
        status = self._status.get(task)
        if status in allowed:
            return status
        if status is None:
            raise PinError(f"TaskOwnership.{what}({task}): task {task} was never trained; call own.pins({task}) "
                           f"and train it first (tasks so far: {self._describe()})")
        raise PinError(f"TaskOwnership.{what}({task}): task {task} is already {status}; {what}() needs a task that is "
                       f"{' or '.join(allowed)} (tasks so far: {self._describe()})")

    def _describe(self) -> str:
        return ", ".join(f"{t}: {s}" for t, s in sorted(self._status.items())) or "none"

    # ------------------------------------------------------------------------------------------
    # Training a task

    def pins(self, task: int) -> list[Pin]:
        """The pins for training ``task`` (which starts it): every element an earlier task owns
        is held at its current value; after :meth:`prune`, the pruned elements are held at zero.

        A deterministic function of the ownership state (masks, not values: held values are
        captured when the pins activate), so a resumed run builds pins whose saved state matches.

        Raises:
            PinError: ``task`` is outside ``[1, max_tasks]``, is committed, is not after the last
                committed task, or another task is still in progress.
        """
        task = self._check_task(task, "pins")
        done = self.committed
        if self._status.get(task) == _COMMITTED or (done and task < done[-1]):
            raise PinError(f"TaskOwnership.pins({task}): task {task} comes before the last committed task "
                           f"{done[-1]}; its weights are held now. Train a new task (> {done[-1]}) "
                           f"(tasks so far: {self._describe()})")
        current = self.current
        if current is not None and current != task:
            raise PinError(f"TaskOwnership.pins({task}): task {current} is still in progress; own.commit({current}) "
                           "first (tasks so far: " + self._describe() + ")")
        self._status.setdefault(task, _TRAINING)
        pruned = self._status[task] == _PRUNED
        held, zeros = {}, {}
        for name, owner in self.owner.items():
            # Earlier tasks' elements; after the prune, task's own are owner == task and train.
            mask = (owner != 0) & (owner != task)
            if bool(mask.any()):
                held[name] = mask
            if pruned:
                free = owner == 0
                if bool(free.any()):
                    zeros[name] = free
        pins = []
        if held:
            pins.append(Pin([_exact_pattern(n) for n in held], mask=held))
        if zeros:
            pins.append(Pin([_exact_pattern(n) for n in zeros], mask=zeros, value=0.0))
        whole = [n for t in sorted(self.heads) if t < task for n in self.heads[t]]
        if self.norm == "first" and task > 1 and done:
            whole += [f"{m}.{p}" if m else p for m, layer in self.norm_layers.items()
                      for p, _ in layer.named_parameters(recurse=False)]
        if whole:
            pins.append(Pin([_exact_pattern(n) for n in whole]))
        return pins

    @torch.no_grad()
    def prune(self, task: int, fraction: float, *, release: Literal["zero", "keep"] = "zero") -> dict[str, int]:
        """Zero the ``fraction`` of ``task``'s trained elements with the smallest magnitude.

        Per parameter, of the free elements (those ``task`` trained), ``round(fraction * n)``
        with the smallest ``|w|`` (ties broken by a permutation seeded with ``seed`` and the
        parameter's name: the same on every rank) are set to zero and stay free for later tasks;
        the others become owned by ``task``. Fine-tune ``task`` with :meth:`pins` afterwards (the
        pruned elements are held at zero, as ``task``'s views read them).
        Returns the number of pruned elements per parameter.

        ``release`` says what the pruned elements start the next task from: ``"zero"`` (they
        stay 0), or ``"keep"``: :meth:`commit` writes back the values they had before the prune,
        so the next task starts from what ``task`` learned there (``task`` itself never sees
        them: its fine-tuning and its views read 0).

        Raises:
            PinError: ``fraction`` is not in ``[0, 1]``, ``release`` is neither ``"zero"`` nor
                ``"keep"``, or ``task`` is not in training (never trained, already pruned or
                committed). No weight changes then.
        """
        task = self._check_task(task, "prune")
        if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0 <= float(fraction) <= 1:
            raise PinError(f"TaskOwnership.prune({task}, {fraction!r}): fraction must be a number in [0, 1]")
        if release not in _RELEASES:
            raise PinError(
                f"TaskOwnership.prune({task}, {fraction!r}, release={release!r}): release must be one of {_RELEASES} "
                "('zero': the pruned elements start the next task at 0; 'keep': at the values they had)"
            )
        self._require_status(task, "prune", (_TRAINING,))
        self._follow_parameters("prune")
        plans = {}
        for name, owner in self.owner.items():
            free = (owner == 0).reshape(-1).nonzero().squeeze(1)
            count = int(round(float(fraction) * free.numel()))
            values = self.parameters[name].detach().reshape(-1)[free]
            magnitude = values.abs().to(torch.float64 if values.dtype == torch.float64 else torch.float32)
            magnitude = magnitude.nan_to_num(nan=math.inf)  # a NaN weight is pruned last, not never
            plans[name] = (free, free[_smallest(magnitude, count, _name_seed(name, self.seed))])
        self._released = {}
        for name, (free, pruned) in plans.items():
            owner = self.owner[name].view(-1)  # made contiguous in __init__
            owner[free] = task
            owner[pruned] = 0
            parameter = self.parameters[name]
            if release == "keep":  # written back by commit(), once task's fine-tuning is over
                self._released[name] = (pruned.cpu().clone(), parameter.detach().reshape(-1)[pruned].cpu().clone())
            # A mask in the parameter's shape: writes through any layout (channels_last included).
            zero = torch.zeros(parameter.numel(), dtype=torch.bool, device=parameter.device)
            zero[pruned] = True
            parameter.masked_fill_(zero.view(parameter.shape), 0)
        self._status[task] = _PRUNED
        return {name: int(pruned.numel()) for name, (_, pruned) in plans.items()}

    @torch.no_grad()
    def commit(self, task: int) -> None:
        """Close ``task``: it owns the elements it kept (all it trained when it was not pruned)
        and its normalization layers' parameters and running statistics are snapshotted.

        Raises:
            PinError: ``task`` was never trained or is already committed.
        """
        task = self._check_task(task, "commit")
        status = self._require_status(task, "commit", (_TRAINING, _PRUNED))
        if status == _TRAINING:
            for owner in self.owner.values():
                owner.masked_fill_(owner == 0, task)
        for name, (positions, values) in self._released.items():
            # prune(release="keep"): the next task starts the freed elements from their old values.
            parameter = self.parameters[name]
            flat = torch.zeros(parameter.numel(), dtype=parameter.dtype, device=parameter.device)
            flat[positions.to(parameter.device)] = values.to(parameter.device, parameter.dtype)
            chosen = torch.zeros(parameter.numel(), dtype=torch.bool, device=parameter.device)
            chosen[positions.to(parameter.device)] = True
            # Through a mask in the parameter's shape: writes through any layout (channels_last).
            parameter.copy_(torch.where(chosen.view(parameter.shape), flat.view(parameter.shape), parameter))
        self._released = {}
        self._norm_snapshots[task] = {key: t.detach().clone() for key, t in self._norm_tensors().items()}
        self._status[task] = _COMMITTED

    def _norm_tensors(self) -> dict[str, Tensor]:
        tensors = {}
        for prefix, layer in self.norm_layers.items():
            for kind in (layer.named_parameters(recurse=False), layer.named_buffers(recurse=False)):
                for key, tensor in kind:
                    if tensor is not None:
                        tensors[f"{prefix}.{key}" if prefix else key] = tensor
        return tensors

    # ------------------------------------------------------------------------------------------
    # Evaluating a task

    @contextlib.contextmanager
    def view(self, task: int) -> Iterator[nn.Module]:
        """Inside the block the module computes as it was for ``task``: elements owned by later
        tasks (and free ones, once ``task`` is pruned or committed) and later tasks' heads read
        zero, and ``task``'s normalization snapshot is in place. On exit, also through an
        exception, every parameter and buffer is restored bit for bit. Only the elements that
        change are copied aside (no copy of the model). Yields the module.

        Raises:
            PinError: ``task`` was never trained.
        """
        task = self._check_task(task, "view")
        status = self._require_status(task, "view", (_TRAINING, _PRUNED, _COMMITTED))
        self._follow_parameters("view")
        zero_free = status != _TRAINING
        zeroed: list[tuple[Tensor, Tensor, Tensor]] = []
        swapped: list[tuple[Tensor, Tensor]] = []
        try:
            with torch.no_grad():
                for name, owner in self.owner.items():
                    mask = owner > task
                    if zero_free:
                        mask |= owner == 0
                    parameter = self.parameters[name]
                    zeroed.append((parameter, mask, parameter.detach()[mask].clone()))
                    parameter.masked_fill_(mask, 0)
                named = dict(self.module.named_parameters())
                for later in (t for t in sorted(self.heads) if t > task):
                    for name in self.heads[later]:
                        parameter = named[name]
                        swapped.append((parameter, parameter.detach().clone()))
                        parameter.zero_()
                snapshot = self._norm_snapshot_for(task, status)
                if snapshot is not None:
                    live = self._norm_tensors()
                    for key, value in snapshot.items():
                        swapped.append((live[key], live[key].detach().clone()))
                        live[key].copy_(value)
            yield self.module
        finally:
            with torch.no_grad():
                for tensor, saved in reversed(swapped):
                    tensor.copy_(saved)
                for parameter, mask, saved in reversed(zeroed):
                    parameter.masked_scatter_(mask, saved)

    def _norm_snapshot_for(self, task: int, status: str) -> Optional[dict[str, Tensor]]:
        if self.norm == "first":
            return self._norm_snapshots.get(1)
        return self._norm_snapshots.get(task) if status == _COMMITTED else None
