"""Task ownership of weights for continual learning (PackNet and kin), with torch only.

:class:`TaskOwnership` keeps an owner per element of the chosen parameters (0 = free, task ids
from 1) and turns it into :class:`~lightning_pin.Pin`\\ s: while task ``t`` trains, every element an
earlier task owns is pinned at its value, so the engine holds it bit for bit under any optimizer,
weight decay, clipping, accumulation, mixed precision and resume, and learning task ``t`` cannot
change tasks ``1..t-1`` at all (backward transfer exactly zero). The same pins work with both doors:
``PinCallback(own.pins(t))`` in a ``Trainer`` and ``pin(model, optimizer, own.pins(t))`` in a plain
loop. Moving to the next task keeps the optimizer, its parameter groups and its scheduler: a new
set of pins activates and zeroes the optimizer statistics of the elements it newly holds.

The life of a task ``t``::

    own.pins(t)            # start t: train with these pins (earlier tasks held)
    own.prune(t, 0.5)      # optional: zero t's smallest half, which stays free for later tasks
    own.pins(t)            # fine-tune t: its kept elements train, the pruned ones stay at 0
    own.commit(t)          # t owns what it kept; its normalization layers are snapshotted
    with own.view(t): ...  # evaluate t: later tasks' and free elements read 0, restored on exit

:class:`AccuracyMatrix` records the accuracy matrix, average accuracy, backward transfer and the
fingerprints after each task; :func:`lightning_pin.reporting.continual.write_continual_report`
writes them as JSON and draws the heat map.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import numbers
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, Optional, Union

import torch
from torch import Tensor, nn

from lightning_pin.core.engine import is_sharded
from lightning_pin.core.errors import PinError
from lightning_pin.core.modules import unwrap
from lightning_pin.core.plan import resolve
from lightning_pin.core.spec import Pin

__all__ = ["AccuracyMatrix", "TaskOwnership"]

_FORMAT = "lightning_pin.tasks"
_VERSION = 2  # 2: the values prune(release="keep") set aside
_READS = (1, 2)
# Task ids up to 255 fit a byte per element; torch's CPU kernels lack comparisons on uint16, so
# more tasks take int16 (up to 32767).
_DTYPES = ((255, torch.uint8), (32767, torch.int16))
_TRAINING, _PRUNED, _COMMITTED = "training", "pruned", "committed"
_NORM_MODES = ("per_task", "first")
_RELEASES = ("zero", "keep")


def _norm_types() -> tuple[type, ...]:
    types: list[type] = [nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm]
    if hasattr(nn, "RMSNorm"):
        types.append(nn.RMSNorm)
    return tuple(types)


def _as_patterns(params: Union[str, Sequence[str]]) -> list[str]:
    return [params] if isinstance(params, str) else list(params)


def _exact_pattern(name: str) -> str:
    # Pins take globs; a name with glob characters is matched exactly through a regex instead.
    return name if not any(c in name for c in "*?[") else "re:" + re.escape(name)


class TaskOwnership:
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

    # ------------------------------------------------------------------------------------------
    # Inspection and state

    def capacity(self) -> dict[str, float]:
        """The free fraction of each shared parameter (what later tasks can still train)."""
        return {name: float((owner == 0).sum()) / max(owner.numel(), 1) for name, owner in self.owner.items()}

    def fingerprint(self, task: int) -> str:
        """SHA-256 (hex) over the values of the elements ``task`` owns, its heads and its
        normalization snapshot: unchanged for as long as later tasks respect ``task``.

        Raises:
            PinError: ``task`` is not committed.
        """
        task = self._check_task(task, "fingerprint")
        self._require_status(task, "fingerprint", (_COMMITTED,))
        self._follow_parameters("fingerprint")
        digest = hashlib.sha256()
        named = dict(self.module.named_parameters())
        for name in sorted(self.owner):
            values = self.parameters[name].detach()[self.owner[name] == task]
            _feed(digest, name, values)
        for name in self.heads.get(task, []):
            _feed(digest, name, named[name].detach())
        for key, value in sorted(self._norm_snapshots.get(task, {}).items()):
            _feed(digest, key, value)
        return digest.hexdigest()

    def state_dict(self) -> dict[str, Any]:
        """The owner maps, task states and normalization snapshots: CPU tensors, strings and
        numbers only, so ``torch.load(path, weights_only=True)`` reads it back."""
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "max_tasks": self.max_tasks,
            "norm": self.norm,
            "seed": self.seed,
            "owner": {name: owner.cpu().clone() for name, owner in self.owner.items()},
            "status": {str(t): s for t, s in sorted(self._status.items())},
            "norm_snapshots": {str(t): {k: v.cpu().clone() for k, v in s.items()}
                               for t, s in sorted(self._norm_snapshots.items())},
            "heads": {str(t): list(names) for t, names in sorted(self.heads.items())},
            "released": {name: {"index": index.clone(), "values": values.clone()}
                         for name, (index, values) in self._released.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the ownership saved by :meth:`state_dict` (before or after the model's weights).

        Raises:
            PinError: the state is not this format, or its parameters, shapes, heads or settings
                differ from this ownership's. Nothing changes then.
        """
        if not isinstance(state, Mapping) or state.get("format") != _FORMAT:
            raise PinError("TaskOwnership.load_state_dict: not a TaskOwnership state (no format "
                           f"{_FORMAT!r}); pass what own.state_dict() returned")
        if state.get("version") not in _READS:
            raise PinError(f"TaskOwnership.load_state_dict: state version {state.get('version')!r}, "
                           f"this version reads {list(_READS)}")
        owner = state["owner"]
        if sorted(owner) != sorted(self.owner):
            raise PinError(f"TaskOwnership.load_state_dict: the state owns parameters {sorted(owner)}, this "
                           f"ownership {sorted(self.owner)}; build it with the same module and params")
        for name, saved in owner.items():
            if tuple(saved.shape) != tuple(self.owner[name].shape) or saved.dtype != self._dtype:
                raise PinError(f"TaskOwnership.load_state_dict: owner map of {name!r} is {saved.dtype} "
                               f"{tuple(saved.shape)}, expected {self._dtype} {tuple(self.owner[name].shape)}")
        for key in ("max_tasks", "norm"):
            if state[key] != getattr(self, key):
                raise PinError(f"TaskOwnership.load_state_dict: saved {key}={state[key]!r}, this ownership has "
                               f"{key}={getattr(self, key)!r}")
        saved_heads = {int(t): list(n) for t, n in state["heads"].items()}
        if saved_heads != self.heads:
            raise PinError(f"TaskOwnership.load_state_dict: saved heads {saved_heads}, this ownership has {self.heads}")
        live = self._norm_tensors()
        for snapshot in state["norm_snapshots"].values():
            if sorted(snapshot) != sorted(live):
                raise PinError("TaskOwnership.load_state_dict: the saved normalization snapshots cover "
                               f"{sorted(snapshot)}, this module has {sorted(live)}")
        status = {int(t): str(s) for t, s in state["status"].items()}
        for name, saved in owner.items():
            # An element owned by a task the state has no status for: the map and the task list disagree.
            unknown = sorted(set(saved.unique().tolist()) - {0} - set(status))
            if unknown:
                raise PinError(f"TaskOwnership.load_state_dict: the owner map of {name!r} names task(s) {unknown[:5]} "
                               f"that the state has no status for (it lists {sorted(status) or 'none'}); the state is "
                               "corrupt or edited: save it again with own.state_dict()")
        released = state.get("released", {})  # version 1 had none
        for name, entry in released.items():
            if name not in self.owner or tuple(entry["index"].shape) != tuple(entry["values"].shape):
                raise PinError(f"TaskOwnership.load_state_dict: the saved values released by prune for {name!r} do "
                               f"not fit this ownership (parameters {sorted(self.owner)})")
        self.seed = int(state["seed"])
        for name, saved in owner.items():
            self.owner[name].copy_(saved)
        self._status = status
        self._released = {name: (entry["index"].clone(), entry["values"].clone()) for name, entry in released.items()}
        self._norm_snapshots = {int(t): {k: v.to(live[k].device) for k, v in s.items()}
                                for t, s in state["norm_snapshots"].items()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch.multiprocessing (ddp_spawn) hands tensors to the workers in shared memory: every
        # process must own its copy, or the ranks prune one map in turn and derive different ones.
        self.__dict__.update(state)
        self.owner = {name: owner.clone() for name, owner in self.owner.items()}
        self._norm_snapshots = {t: {k: v.clone() for k, v in s.items()} for t, s in self._norm_snapshots.items()}
        self._released = {n: (i.clone(), v.clone()) for n, (i, v) in self.__dict__.get("_released", {}).items()}

    def __repr__(self) -> str:
        return (f"TaskOwnership({len(self.owner)} parameters, tasks: {self._describe()}, "
                f"free: {self.free_fraction():.3f})")

    def free_fraction(self) -> float:
        """The free fraction of all shared elements together."""
        total = sum(o.numel() for o in self.owner.values())
        return float(sum(int((o == 0).sum()) for o in self.owner.values())) / max(total, 1)


def _smallest(magnitude: Tensor, count: int, seed: int) -> Tensor:
    """Positions of the ``count`` smallest entries of ``magnitude``; among entries equal to the
    ``count``-th smallest, a permutation seeded with ``seed`` chooses (the same on every rank).
    One selection pass (``kthvalue``), no full sort: pruning tens of millions of elements stays fast."""
    if count <= 0:
        return torch.zeros(0, dtype=torch.long, device=magnitude.device)
    if count >= magnitude.numel():
        return torch.arange(magnitude.numel(), device=magnitude.device)
    kth = torch.kthvalue(magnitude, count).values
    below = (magnitude < kth).nonzero().squeeze(1)
    tied = (magnitude == kth).nonzero().squeeze(1)
    order = torch.randperm(tied.numel(), generator=torch.Generator().manual_seed(seed)).to(tied.device)
    return torch.cat([below, tied[order[: count - below.numel()]]])


def _name_seed(name: str, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def _feed(digest: Any, name: str, tensor: Tensor) -> None:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    digest.update(f"{name}:{flat.dtype}:{flat.numel()}:".encode())
    digest.update(flat.view(torch.uint8).numpy().tobytes())


class AccuracyMatrix:
    """The accuracy matrix of a sequence of tasks: ``R[i][j]`` is the accuracy on task ``j``
    after training task ``i`` (1-based), with average accuracy and backward transfer.

    Call :meth:`measure` after each task; with ``own`` it evaluates each task inside
    ``own.view(j)`` and records the fingerprints of the committed tasks.

    Args:
        tasks: How many tasks (ids ``1..tasks``), or the task ids themselves in the order they
            are learned (``[1, 5, 9]``) when they are not ``1, 2, 3, ...``.

    Example::

        >>> log = AccuracyMatrix(3)
        >>> for i in (1, 2, 3):
        ...     _ = log.measure(i, lambda j: [0.9, 0.8, 0.7][j - 1] - 0.1 * (i - j))
        >>> round(log.bwt(), 6), round(log.average_accuracy(), 6)
        (-0.15, 0.7)
        >>> log = AccuracyMatrix(5)
        >>> log.measure(1, lambda j: 0.9)
        [0.9]
        >>> log.measure(5, lambda j: 0.9)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_pin.core.errors.PinError: AccuracyMatrix.measure(5): no row was measured for task(s) [2, 3, 4] ...
    """

    def __init__(self, tasks: Union[int, Sequence[int]]) -> None:
        if isinstance(tasks, Sequence) and not isinstance(tasks, (str, bytes)):
            ids = list(tasks)
            whole = all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 1 for t in ids)
            if not ids or not whole or any(b <= a for a, b in zip(ids, ids[1:])):
                raise PinError(f"AccuracyMatrix: task ids must be increasing positive integers, got {tasks!r}")
        elif isinstance(tasks, bool) or not isinstance(tasks, numbers.Integral) or tasks < 1:
            raise PinError(f"AccuracyMatrix: tasks must be a positive integer or a list of task ids, got {tasks!r}")
        else:
            ids = list(range(1, int(tasks) + 1))
        #: The task ids, in the order they are learned (rows and columns of :attr:`matrix`).
        self.task_ids: list[int] = [int(t) for t in ids]
        self.tasks = len(self.task_ids)
        #: ``matrix[i][j]``: accuracy on the j-th task after the i-th (0-based positions in
        #: :attr:`task_ids`); None where not measured.
        self.matrix: list[list[Optional[float]]] = [[None] * self.tasks for _ in range(self.tasks)]
        #: Per task trained so far: the fingerprint of every committed task right after it.
        self.fingerprints: dict[int, dict[int, str]] = {}

    def measure(
        self, after: int, evaluate: Callable[[int], float], own: Optional[TaskOwnership] = None
    ) -> list[float]:
        """Record ``evaluate(j)`` for every task ``j`` up to ``after`` (inside ``own.view(j)`` when given).

        Raises:
            PinError: ``after`` is not one of the task ids, a task before it has no row yet (ids
                that skip, 1 then 5, must be declared: ``AccuracyMatrix([1, 5])``), or
                ``evaluate`` returned something that is not a finite-or-infinite number (NaN, None).
                Nothing is recorded then.
        """
        if isinstance(after, bool) or after not in self.task_ids:
            raise PinError(f"AccuracyMatrix.measure: after must be one of the task ids {self.task_ids}, got {after!r}")
        position = self.task_ids.index(after)
        missing = [t for i, t in enumerate(self.task_ids[:position]) if self.matrix[i][i] is None]
        if missing:
            raise PinError(
                f"AccuracyMatrix.measure({after}): no row was measured for task(s) {missing} before it. Measure after "
                "every task in order, or, if the task ids skip, declare the ones learned: "
                f"AccuracyMatrix({[t for t in self.task_ids if t not in missing]})"
            )
        row = []
        for j in self.task_ids[: position + 1]:
            context = own.view(j) if own is not None else contextlib.nullcontext()
            with context:
                result = evaluate(j)
            try:
                value = float(result)
            except (TypeError, ValueError) as err:
                raise PinError(
                    f"AccuracyMatrix.measure({after}): evaluate({j}) returned {result!r}, not a number"
                ) from err
            if math.isnan(value):
                raise PinError(f"AccuracyMatrix.measure({after}): evaluate({j}) returned NaN; an accuracy must be a "
                               "number (a NaN loss or an empty test set?)")
            row.append(value)
        self.matrix[position][: position + 1] = row
        if own is not None:
            self.fingerprints[after] = {j: own.fingerprint(j) for j in own.committed}
        return row

    def _last(self) -> int:
        rows = [i for i, row in enumerate(self.matrix) if row[i] is not None]
        if not rows:
            raise PinError("AccuracyMatrix: nothing measured yet")
        last = rows[-1]
        # Rows before the last need their diagonal (R[j][j]); the last row needs every entry.
        needed = [(i, i) for i in range(last)] + [(last, j) for j in range(last + 1)]
        for i, j in needed:
            if self.matrix[i][j] is None:
                raise PinError(
                    f"AccuracyMatrix: the row after task {self.task_ids[i]} has no accuracy for task "
                    f"{self.task_ids[j]} (never measured); measure(after={self.task_ids[i]}, ...) fills it"
                )
        return last

    def average_accuracy(self) -> float:
        """Mean accuracy over the tasks up to the last measured task ``T``, after ``T``.

        Raises:
            PinError: nothing was measured, or a row it needs was never measured.
        """
        last = self._last()
        return sum(self.matrix[last][: last + 1]) / (last + 1)  # type: ignore[arg-type]

    def bwt(self) -> float:
        """Backward transfer ``1/(T-1) * sum_{j<T} (R[T][j] - R[j][j])`` (0.0 for one task):
        negative when learning later tasks made earlier ones worse.

        Raises:
            PinError: nothing was measured, or a row it needs was never measured (named).
        """
        last = self._last()
        if last == 0:
            return 0.0
        gaps = [self.matrix[last][j] - self.matrix[j][j] for j in range(last)]  # type: ignore[operator]
        return sum(gaps) / last

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data: ``matrix`` (None where not measured), ``average_accuracy``,
        ``bwt``, ``fingerprints`` and ``fingerprints_unchanged`` (each task's fingerprint stayed
        the same after every later task)."""
        first_seen: dict[int, str] = {}
        unchanged = True
        for after in sorted(self.fingerprints):
            for task, fingerprint in self.fingerprints[after].items():
                unchanged &= first_seen.setdefault(task, fingerprint) == fingerprint
        measured = any(self.matrix[i][i] is not None for i in range(self.tasks))
        return {
            "tasks": self.tasks,
            "task_ids": list(self.task_ids),
            "matrix": [list(row) for row in self.matrix],
            "average_accuracy": self.average_accuracy() if measured else math.nan,
            "bwt": self.bwt() if measured else math.nan,
            "fingerprints": {str(i): {str(j): fp for j, fp in f.items()} for i, f in self.fingerprints.items()},
            "fingerprints_unchanged": unchanged if self.fingerprints else None,
        }

