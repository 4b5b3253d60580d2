"""Tensor mechanics on a :class:`~lightning_pin.core.plan.PinPlan`, with torch only (no Lightning).

:class:`PinEngine` masks the gradients of pinned elements before an optimizer step, restores
pinned values right after it (from a ``register_step_post_hook``), zeroes the optimizer
statistics of elements whose pin activates, and checks values against their targets. It decides
nothing about *when*: its drivers do, :class:`~lightning_pin.PinCallback` from Lightning's hooks
and :func:`~lightning_pin.pin` from torch's own hooks. Observers (the monitor, step checks)
register with :meth:`PinEngine.register_restore_hook` and get a removable handle.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_pin.core.errors import PinError
from lightning_pin.core.plan import PinPlan, Selection, call_when
from lightning_pin.core.state import CorruptPinState, PinState, SavedSelection

# torch.distributed.tensor costs seconds to import (it pulls in sympy), and a plain loop never
# needs it: a tensor can only be a DTensor once that module has been imported by someone else.
_DTENSOR_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")  # public from torch 2.4

#: Per-element optimizer statistics that push an element, zeroed when a step-window pin activates.
#: Step sizes (Rprop ``step_size``) and weight averages (ASGD ``ax``) are left alone.
OPTIMIZER_STATE_KEYS = (
    "momentum_buffer",
    "exp_avg",
    "exp_avg_sq",
    "max_exp_avg_sq",
    "square_avg",
    "grad_avg",
    "acc_delta",
    "sum",
    "prev",
)

#: The value at which the engine keeps the second-moment statistics of pinned elements between
#: their pin's start and stop (see :meth:`PinEngine.park_statistics`): a normal float, whose square
#: root torch's CPU kernels take at full speed (on exact zeros they are 3-10x slower).
PARKED_VALUE = 1.0


def _second_beta(group: Mapping[str, Any]) -> float:
    return float(group["betas"][1])


# Optimizers (exact types: a subclass may compute its step differently) whose statistics may be
# parked, each with the keys of the statistics that reach the update only under a square root,
# dividing a numerator that is exactly zero for a pinned element (its masked gradient and its
# first moment, zeroed at activation), and the factor by which the group's statistics decay each
# step. Adadelta adds eps under its roots and Adamax takes a max with ``|grad| + eps``: neither
# ever takes the root of a zero, so they are left alone, as are SGD's momentum (no root) and
# every other optimizer.
_PARKABLE: dict[type, tuple[tuple[str, ...], Callable[[Mapping[str, Any]], float]]] = {
    torch.optim.Adam: (("exp_avg_sq", "max_exp_avg_sq"), _second_beta),
    torch.optim.AdamW: (("exp_avg_sq", "max_exp_avg_sq"), _second_beta),
    torch.optim.NAdam: (("exp_avg_sq",), _second_beta),
    torch.optim.RAdam: (("exp_avg_sq",), _second_beta),
    torch.optim.RMSprop: (("square_avg",), lambda group: float(group["alpha"])),
    torch.optim.Adagrad: (("sum",), lambda group: 1.0),
}

# Optimizers that leave a parameter whose grad is None completely alone (no update, no weight
# decay, no state change). Exact types only: a subclass may override step(). For these, a
# whole-tensor pin whose grad was dropped needs no restore after the step.
_SKIPS_NONE_GRADS = frozenset(
    getattr(torch.optim, name)
    for name in (
        "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "ASGD", "Rprop",
        "Adafactor",
    )
    if hasattr(torch.optim, name)
)


@dataclasses.dataclass
class Target:
    """The merged targets of one parameter under one set of active pins.

    Indices and values are in full-tensor coordinates. For a sharded parameter (a DTensor, under
    FSDP2) :meth:`part` maps them once onto the shard this process holds, so masking and
    restoring touch local memory only and need no communication.
    """

    name: str
    parameter: nn.Parameter
    #: Sorted flat (row-major) indices, or None for the whole tensor.
    index: Tensor | None
    #: One value per index, or of the parameter's shape when ``index`` is None. None when only
    #: the positions matter (zeroing optimizer state).
    values: Tensor | None
    #: Storage-order positions for tensors that are not contiguous (e.g. channels_last), by strides.
    _by_strides: dict[Any, Tensor] = dataclasses.field(default_factory=dict)
    #: The pinned elements of each shard layout this process holds.
    _shards: dict[Any, LocalPart] = dataclasses.field(default_factory=dict)

    def part(self, tensor: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``(view, positions, targets)``: what of ``tensor`` (the parameter, its grad or an
        optimizer statistic) this process pins.

        For element pins ``view`` is a flat view of the local data and ``positions`` index the
        pinned elements in it; for a whole tensor ``positions`` is None and ``view`` is the
        local data itself.
        """
        if is_sharded(tensor):
            key = (tuple(tensor.placements), tuple(tensor.shape))
            if key not in self._shards:
                self._shards[key] = local_part(tensor, self.index, self.values, self.name)
            shard = self._shards[key]
            data, index, values, cache_key = tensor.to_local(), shard.index, shard.values, key
        else:
            data, index, values, cache_key = tensor, self.index, self.values, None
        if index is None:
            return data, None, values
        flat, positions = flat_view(data, index, self._by_strides, cache_key)
        return flat, positions, values

    def flat(self, tensor: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(view, positions)`` of :meth:`part`, without the targets."""
        view, positions, _ = self.part(tensor)
        return view, positions

    def flat_index_of(self, tensor: Tensor, positions_taken: Tensor) -> Tensor:
        """Full-tensor row-major indices of the entries ``positions_taken`` of :meth:`part`."""
        if is_sharded(tensor):
            shard = self._shards[(tuple(tensor.placements), tuple(tensor.shape))]
            if shard.global_index is not None:
                return shard.global_index[positions_taken]
            coords = torch.stack(torch.unravel_index(positions_taken, shard.shape), dim=1)
            coords = coords + torch.tensor(shard.offset, device=coords.device)
            strides = torch.tensor(_row_major_strides(tuple(tensor.shape)), device=coords.device)
            return (coords * strides).sum(1)
        return positions_taken if self.index is None else self.index[positions_taken]


@dataclasses.dataclass
class LocalPart:
    """The pinned elements of a sharded tensor that lie in this process's shard."""

    #: Row-major indices into the local shard, or None when the whole tensor is pinned.
    index: Tensor | None
    #: Their targets (local shape for a whole tensor), or None.
    values: Tensor | None
    #: Their full-tensor indices (None for a whole tensor).
    global_index: Tensor | None
    #: Where the shard starts in the full tensor, and its shape.
    offset: tuple[int, ...]
    shape: tuple[int, ...]


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (FSDP2, tensor parallel), without importing DTensor."""
    for name in _DTENSOR_MODULES:
        module = sys.modules.get(name)
        if module is not None and isinstance(tensor, module.DTensor):
            return True
    return False


def local_part(tensor: Tensor, index: Tensor | None, values: Tensor | None, name: str) -> LocalPart:
    """Map full-tensor indices and targets onto the shard of ``tensor`` this process holds."""
    try:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # torch 2.3
        from torch.distributed._tensor import Replicate, Shard
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset

    unsupported = [p for p in tensor.placements if type(p) not in (Shard, Replicate)]
    if unsupported:
        raise PinError(
            f"{name!r} is laid out as {tuple(tensor.placements)}; pins support Shard and Replicate placements "
            "(FSDP2's fully_shard, data parallel), not {unsupported}"
        )
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if index is None:
        local = None if values is None else values[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        return LocalPart(None, None if local is None else local.contiguous(), None, tuple(offset), tuple(shape))
    coords = torch.stack(torch.unravel_index(index, tuple(tensor.shape)), dim=1)
    low = torch.tensor(offset, device=coords.device)
    inside = ((coords >= low) & (coords < low + torch.tensor(shape, device=coords.device))).all(dim=1)
    local_coords = coords[inside] - low
    strides = torch.tensor(_row_major_strides(tuple(shape)), device=coords.device)
    return LocalPart(
        index=(local_coords * strides).sum(1),
        values=None if values is None else values[inside],
        global_index=index[inside],
        offset=tuple(offset),
        shape=tuple(shape),
    )


def _row_major_strides(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def local_tensor(tensor: Tensor) -> Tensor:
    """The data of ``tensor`` this process holds: a DTensor's local shard, else the tensor."""
    return tensor.to_local() if is_sharded(tensor) else tensor


@dataclasses.dataclass
class Violation:
    """Pinned elements of one parameter found off target."""

    name: str
    count: int
    #: Up to a few ``(coordinates, actual, target)`` examples.
    examples: list[tuple[tuple[int, ...], float, float]]

    def __str__(self) -> str:
        shown = ", ".join(f"{c}: {a!r} != {t!r}" for c, a, t in self.examples)
        return f"{self.name}: {self.count} element(s) off target ({shown}{', ...' if self.count > len(self.examples) else ''})"


@dataclasses.dataclass
class StepStats:
    """Pinned elements at one optimizer step, as 0-d device tensors (read them only to log)."""

    #: Largest ``|value - target|`` after the optimizer's update, before the restore.
    drift_max: Tensor
    #: Sum of ``|value - target|`` over the pinned elements, after the update, before the restore.
    drift_sum: Tensor
    #: Pinned elements measured (those of tensors the optimizer skipped count with drift 0).
    elements: int
    #: Pinned elements off target after the restore (0 unless something is badly wrong).
    violations: Tensor

    @property
    def drift_mean(self) -> Tensor:
        return self.drift_sum / max(self.elements, 1)


def _step_stats(
    owned: Sequence[Target], untouched: Sequence[Target], moved: Sequence[Tensor], after: Sequence[Tensor]
) -> StepStats:
    device = owned[0].values.device if owned else torch.device("cpu")
    zero = torch.zeros((), device=device)
    elements = sum(t.values.numel() for t in owned)
    if not moved:
        return StepStats(zero, zero, elements, zero.long())
    return StepStats(
        drift_max=torch.stack([m.max() for m in moved]).max().to(device),
        drift_sum=torch.stack([m.sum() for m in moved]).sum().to(device),
        elements=elements,
        violations=torch.stack([(a != 0).sum() for a in after]).sum().to(device),
    )


def flat_view(tensor: Tensor, index: Tensor, cache: dict | None = None, key: Any = None) -> tuple[Tensor, Tensor]:
    """A 1-D view of ``tensor``'s storage and the storage positions of row-major ``index``.

    Contiguous tensors need no translation. Dense but permuted ones (channels_last weights and
    their grads) get the positions recomputed once per stride pattern and cached in ``cache``.
    """
    if tensor.is_contiguous():
        return tensor.view(-1), index
    strides = tensor.stride()
    positions = None if cache is None else cache.get((key, strides))
    if positions is None:
        if not _is_dense(tensor):
            raise PinError(f"cannot pin elements of a tensor with overlapping or gapped strides {strides}")
        coords = torch.stack(torch.unravel_index(index, tensor.shape), dim=1)
        positions = (coords * torch.tensor(strides, device=coords.device)).sum(1)
        if cache is not None:
            cache[(key, strides)] = positions
    return tensor.as_strided((tensor.numel(),), (1,)), positions


#: Indices converted to int64 at a time: bounds the transient memory of int32 -> int64 to 8 MiB.
_CONVERT_CHUNK = 1 << 20


def fill_at(flat: Tensor, positions: Tensor, value: float) -> None:
    """``flat[positions] = value``. Positions are stored as int32 where they fit (half the memory
    of int64); ``index_fill_`` wants int64, so they are widened a chunk at a time."""
    if positions.dtype == torch.int64:
        flat.index_fill_(0, positions, value)
        return
    for start in range(0, positions.numel(), _CONVERT_CHUNK):
        flat.index_fill_(0, positions[start : start + _CONVERT_CHUNK].long(), value)


def copy_at(flat: Tensor, positions: Tensor, values: Tensor) -> None:
    """``flat[positions] = values``, widening int32 positions a chunk at a time (see :func:`fill_at`)."""
    if positions.dtype == torch.int64:
        flat.index_copy_(0, positions, values)
        return
    for start in range(0, positions.numel(), _CONVERT_CHUNK):
        stop = start + _CONVERT_CHUNK
        flat.index_copy_(0, positions[start:stop].long(), values[start:stop])


def _is_dense(tensor: Tensor) -> bool:
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=lambda s: s[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


class PinEngine:
    """Executes a :class:`PinPlan`: activation, gradient masking, restoring, optimizer state.

    Args:
        plan: The resolved pins.
        whole_grads: What to do with the gradient of a wholly pinned tensor: ``"drop"`` sets it to
            ``None`` so every torch optimizer skips the tensor (state and weight decay included);
            ``"zero"`` fills it with zeros (for sharded parameters that need optimizer state).
    """

    def __init__(self, plan: PinPlan, *, whole_grads: str = "drop") -> None:
        if whole_grads not in ("drop", "zero"):
            raise PinError(f"whole_grads must be 'drop' or 'zero', got {whole_grads!r}")
        self.plan = plan
        self.whole_grads = whole_grads
        #: Ids (positions in ``plan.pins``) of the pins active now.
        self.active: frozenset[int] = frozenset()
        #: Ids of the pins that were active at the last optimizer step, None before any step.
        self.last_step_active: frozenset[int] | None = None
        #: Targets captured at activation for pins with ``value=None``: pin id -> name -> values.
        self.captured: dict[int, dict[str, Tensor]] = {}
        self._targets: dict[frozenset[int], list[Target]] = {}
        # Merge layouts by parameter and entries (see _merge): they outlive captured values.
        self._layouts: dict[tuple[str, tuple[tuple[int, bool], ...]], _Layout] = {}
        #: Keep the statistics of pinned elements on torch's fast path (see park_statistics);
        #: False keeps them at zero as engines before parking did.
        self.park = True
        self._parked: dict[int, _Parked] = {}
        self._stat_targets: dict[tuple[int, str], Target] = {}
        self._optimizer_names: dict[int, tuple[tuple[int, ...], frozenset[str]]] = {}
        self._optimizers: list[Optimizer] = []
        self._dropped: set[str] = set()
        # Version counters of whole pinned tensors right after the engine wrote them (writes
        # through .data do not count): another write since (model.load_state_dict, a user's
        # copy_) moves the counter, and the restore must not take the tensor as untouched.
        self._written_version: dict[str, int] = {}
        self._by_name: dict[frozenset[int], dict[str, Target]] = {}
        # Observers of each restore: id -> (hook, wants_stats). See register_restore_hook.
        self._restore_hooks: OrderedDict[int, tuple[Callable[[Optional[StepStats]], None], Callable[[], bool]]] = (
            OrderedDict()
        )

    @property
    def sharded(self) -> bool:
        """Whether any pinned parameter is sharded (a DTensor): checks then need a reduction."""
        return any(is_sharded(p) for p in self.plan.parameters.values())

    @property
    def device(self) -> torch.device:
        """Where the pinned parameters live (the first one's device; CPU without pins)."""
        return next((p.device for p in self.plan.parameters.values()), torch.device("cpu"))

    # ----------------------------------------------------------------------------------------
    # Which pins are active

    def ids_at(self, step: int, when_hits: Iterable[int] = ()) -> frozenset[int]:
        """Pins active at optimizer step ``step``; ``when`` pins only if their id is in ``when_hits``."""
        hits = set(when_hits)
        return frozenset(
            i for i, rp in enumerate(self.plan.pins) if rp.in_window(step) and (rp.when is None or i in hits)
        )

    def when_hits(
        self,
        step: int,
        batch: Any,
        batch_idx: int,
        agree: Callable[[list[bool]], list[bool]] | None = None,
    ) -> frozenset[int]:
        """Ids of the ``when`` pins in their window at ``step`` whose ``when`` selects this batch.

        ``agree`` combines the decisions across processes (each sees its own batch, and a pin
        must hold on every replica or none): an element-wise "any rank" of a list of flags.

        Raises:
            PinError: a ``when`` answered badly, here or, with ``agree``, on another process (every
                process raises together rather than leave the others waiting in the reduction).
        """
        candidates = [i for i, rp in enumerate(self.plan.pins) if rp.when is not None and rp.in_window(step)]
        if not candidates:
            return frozenset()
        failed: PinError | None = None
        try:
            hits = [call_when(self.plan.pins[i], batch, batch_idx) for i in candidates]
        except PinError as err:
            failed, hits = err, [False] * len(candidates)
        if agree is not None:
            any_failed, *hits = agree([failed is not None, *hits])
            if any_failed and failed is None:
                raise PinError(f"a `when` failed on another process at batch {batch_idx} (see its error)")
        if failed is not None:
            raise failed
        return frozenset(i for i, hit in zip(candidates, hits) if hit)

    def set_active(self, pin_ids: Iterable[int]) -> list[int]:
        """Make exactly ``pin_ids`` active; activate (capture, force, reset state) those that start.

        When pins stop, elements still held by other pins get those pins' targets: a pin that
        overrode part of another (force one element of a frozen layer) hands it back.
        """
        new = frozenset(pin_ids)
        started = sorted(new - self.active)
        stopped = self.active - new
        self.active = new
        if started:
            self._activate(started)
        if stopped:
            self._release_statistics(stopped)
            touched = {name for pin_id in stopped for name in self.plan.pins[pin_id].selections}
            with torch.no_grad():
                self._write([t for t in self.targets() if t.name in touched])
        return started

    @torch.no_grad()
    def _activate(self, started: Sequence[int]) -> None:
        for pin_id in started:
            rp = self.plan.pins[pin_id]
            to_capture = {name: s for name, s in rp.selections.items() if s.values is None}
            if to_capture:
                self.captured[pin_id] = {name: self._read(s) for name, s in to_capture.items()}
                self._forget(pin_id)
        touched = {name for pin_id in started for name in self.plan.pins[pin_id].selections}
        self._write([t for t in self.targets() if t.name in touched])
        step_window_pins = [i for i in started if self.plan.pins[i].when is None]
        for optimizer in self._optimizers:
            self.reset_optimizer_state(optimizer, step_window_pins)

    def _forget(self, pin_id: int) -> None:
        for cache in (self._targets, self._by_name):
            for key in [k for k in cache if pin_id in k]:
                del cache[key]

    # ----------------------------------------------------------------------------------------
    # Targets

    def targets(self, pin_ids: Iterable[int] | None = None) -> list[Target]:
        """Per parameter, the merged targets of ``pin_ids`` (default: the active pins).

        An explicit value beats a captured one on the same element (the plan has already
        rejected two different explicit values that can be active together).
        """
        key = self.active if pin_ids is None else frozenset(pin_ids)
        if key not in self._targets:
            self._targets[key] = self._merge(key)
        return self._targets[key]

    def _merge(self, pin_ids: frozenset[int]) -> list[Target]:
        # Lowest priority first: captured values, then explicit ones; later entries win.
        parts: dict[str, list[tuple[int, bool, Tensor | None, Tensor]]] = {}
        for explicit in (False, True):
            for pin_id in sorted(pin_ids):
                for name, selection in self.plan.pins[pin_id].selections.items():
                    values = selection.values if explicit else self.captured.get(pin_id, {}).get(name)
                    if (selection.values is not None) == explicit and values is not None:
                        parts.setdefault(name, []).append((pin_id, explicit, selection.index, values))
        merged = []
        for name, entries in parts.items():
            # Where each merged value comes from depends only on the selections, never on the
            # values: work it out once per combination (it syncs with the host) and keep it when
            # captured values change, so that a `when` pin re-capturing at every activation
            # merges its targets without a sync.
            layout_key = (name, tuple((pin_id, explicit) for pin_id, explicit, _, _ in entries))
            layout = self._layouts.get(layout_key)
            if layout is None:
                layout = self._layouts[layout_key] = _Layout.of([index for _, _, index, _ in entries])
            index, values = layout.apply([values for _, _, _, values in entries])
            merged.append(Target(name, self.plan.parameters[name], index, values, _by_strides=layout.by_strides))
        return merged

    # ----------------------------------------------------------------------------------------
    # The optimizer step

    def attach(self, optimizers: Sequence[Optimizer]) -> list[RemovableHandle]:
        """Restore pinned values after every ``step()`` of each optimizer; returns the hook handles."""
        handles = []
        for optimizer in optimizers:
            self._optimizers.append(optimizer)
            handles.append(optimizer.register_step_post_hook(self._post_step_hook))
            handles.append(optimizer.register_state_dict_pre_hook(self._unpark_before_saving))
        return handles

    def _names_of(self, optimizer: Optimizer) -> frozenset[str]:
        """The pinned parameters ``optimizer`` updates. Re-read when its groups change:
        fine-tuning callbacks add param groups mid-training (``add_param_group``)."""
        layout = tuple(len(group["params"]) for group in optimizer.param_groups)
        cached = self._optimizer_names.get(id(optimizer))
        if cached is None or cached[0] != layout:
            by_param = {id(p): name for name, p in self.plan.parameters.items()}
            names = frozenset(
                by_param[id(p)] for group in optimizer.param_groups for p in group["params"] if id(p) in by_param
            )
            cached = self._optimizer_names[id(optimizer)] = (layout, names)
        return cached[1]

    def detach(self) -> None:
        """Forget the attached optimizers (call after removing the handles ``attach`` returned)."""
        for optimizer in self._optimizers:
            self._unpark(optimizer)  # leave the statistics as they would be without parking
        self._optimizers.clear()
        self._optimizer_names.clear()
        self._dropped.clear()

    def _post_step_hook(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self.restore(optimizer)
        self.park_statistics(optimizer)

    def register_restore_hook(
        self, hook: Callable[[Optional[StepStats]], None], wants_stats: Callable[[], bool] = lambda: False
    ) -> RemovableHandle:
        """Call ``hook(stats)`` after every restore; returns a handle whose ``remove()`` unregisters it.

        ``stats`` is a :class:`StepStats` of that restore when some registered ``wants_stats()``
        returned True before it (measuring reads the pinned elements twice: ask only on the
        steps you log), else None.
        """
        handle = RemovableHandle(self._restore_hooks)
        self._restore_hooks[handle.id] = (hook, wants_stats)
        return handle

    def register_grad_hooks(self) -> list[RemovableHandle]:
        """Zero the gradients of active pinned elements as soon as backward accumulates them.

        For drivers without an "after backward" moment (plain loops, Fabric): each pinned
        parameter gets a ``register_post_accumulate_grad_hook``, so pinned gradients are zero when
        ``loss.backward()`` returns, before any clipping or scaler sees them, on every micro-batch
        of an accumulation window, and before DDP's reducer reads them (it hooks the same
        accumulation, after these). Wholly pinned tensors get a zero gradient here (DDP expects
        one); :meth:`drop_whole_grads` drops it right before the step.
        """
        return [
            parameter.register_post_accumulate_grad_hook(self._grad_hook(name))
            for name, parameter in self.plan.parameters.items()
            if parameter.requires_grad
        ]

    def _grad_hook(self, name: str) -> Callable[[Tensor], None]:
        def hook(parameter: Tensor) -> None:
            target = self._targets_by_name().get(name)
            if target is not None and parameter.grad is not None:
                with torch.no_grad():
                    _zero_grad_of(target, parameter.grad)

        return hook

    def _targets_by_name(self) -> dict[str, Target]:
        by_name = self._by_name.get(self.active)
        if by_name is None:
            by_name = self._by_name[self.active] = {t.name: t for t in self.targets()}
        return by_name

    @torch.no_grad()
    def drop_whole_grads(self, optimizer: Optimizer | None = None) -> None:
        """Set the gradients of wholly pinned tensors ``optimizer`` updates (default: all) to None,
        so torch optimizers skip them, state and weight decay included. Sharded tensors keep a
        (zero) gradient: FSDP2 needs their optimizer state to exist for distributed checkpoints."""
        if self.whole_grads != "drop":
            return
        for target in self._owned(optimizer):
            grad = target.parameter.grad
            if target.index is None and grad is not None and not is_sharded(grad):
                target.parameter.grad = None
                self._dropped.add(target.name)

    def _owned(self, optimizer: Optimizer | None) -> list[Target]:
        targets = self.targets()
        if optimizer is None:
            return targets
        names = self._names_of(optimizer)
        return [t for t in targets if t.name in names]

    @torch.no_grad()
    def mask_grads(self, optimizer: Optimizer | None = None) -> None:
        """Zero the gradients of active pinned elements of ``optimizer``'s parameters (default: all).

        Call after backward (and any gradient all-reduce) and before clipping and the step, so
        pinned gradients stay out of momentum, adaptive statistics and the clip norm.
        """
        self.drop_whole_grads(optimizer)
        for target in self._owned(optimizer):
            grad = target.parameter.grad
            if grad is not None:
                _zero_grad_of(target, grad)

    @torch.no_grad()
    def restore(self, optimizer: Optimizer | None = None) -> None:
        """Write the targets of active pins into ``optimizer``'s parameters (default: all), then
        call the restore hooks (with this restore's :class:`StepStats` when one asked for them)."""
        owned = self._owned(optimizer)
        skips = optimizer is not None and type(optimizer) in _SKIPS_NONE_GRADS
        # A wholly pinned tensor whose grad was dropped was skipped by such an optimizer: it
        # still holds its target, and copying it back would cost a full pass over it.
        untouched, todo = [], []
        for target in owned:
            skipped = (
                skips
                and target.index is None
                and target.name in self._dropped
                and self._written_version.get(target.name) == target.parameter._version
            )
            (untouched if skipped else todo).append(target)
        self._dropped.difference_update(t.name for t in owned)
        measure = any([wants() for _, wants in self._restore_hooks.values()])
        moved = [self._deviation(t) for t in todo] if measure else None
        self._write(todo)
        stats = None
        if moved is not None:
            stats = _step_stats(owned, untouched, moved, [self._deviation(t) for t in todo])
        self.last_step_active = self.active
        for hook, _ in list(self._restore_hooks.values()):
            hook(stats)

    def _deviation(self, target: Target) -> Tensor:
        """``|value - target|`` of the pinned elements of ``target``, flat, in float32 or wider."""
        view, positions, values = target.part(target.parameter.detach())
        actual = view.reshape(-1) if positions is None else view.index_select(0, positions)
        deviation = (actual - values.reshape(-1)).abs()
        return deviation if deviation.dtype in (torch.float32, torch.float64) else deviation.float()

    def _write(self, targets: Iterable[Target]) -> None:
        for target in targets:
            view, positions, values = target.part(target.parameter.data)
            if positions is None:
                view.copy_(values)
                self._written_version[target.name] = target.parameter._version
            else:
                copy_at(view, positions, values)

    @property
    def checked_ids(self) -> frozenset[int]:
        """The pins whose targets must hold now: those active at the last optimizer step, or
        before any step, those active now."""
        return self.last_step_active if self.last_step_active is not None else self.active

    @torch.no_grad()
    def write_into(self, parameters: Mapping[str, Tensor], pin_ids: Iterable[int] | None = None) -> None:
        """Write the merged targets of ``pin_ids`` (default: :attr:`checked_ids`) into a copy of the
        weights (an averaged model), by parameter name; names the copy lacks are skipped."""
        for target in self.targets(self.checked_ids if pin_ids is None else pin_ids):
            tensor = parameters.get(target.name)
            if tensor is None:
                continue
            view, positions, values = target.part(tensor.detach())
            values = values.to(device=view.device, dtype=view.dtype)
            if positions is None:
                view.copy_(values)
            else:
                copy_at(view, positions.to(view.device), values)

    def force(self) -> None:
        """Write the targets of every active pin now (e.g. after loading weights on resume)."""
        with torch.no_grad():
            self._write(self.targets())

    @torch.no_grad()
    def reset_optimizer_state(self, optimizer: Optimizer, pin_ids: Iterable[int]) -> None:
        """Zero the statistics in :data:`OPTIMIZER_STATE_KEYS` of the elements the pins select."""
        for pin_id in pin_ids:
            for selection in self.plan.pins[pin_id].selections.values():
                state = optimizer.state.get(selection.parameter)
                if not state:
                    continue
                where = Target(selection.name, selection.parameter, selection.index, None)
                for key in OPTIMIZER_STATE_KEYS:
                    buffer = state.get(key)
                    if isinstance(buffer, Tensor) and buffer.shape == selection.parameter.shape:
                        view, positions, _ = where.part(buffer)
                        if positions is None:
                            view.zero_()
                        else:
                            fill_at(view, positions, 0)

    # ----------------------------------------------------------------------------------------
    # Parked statistics: the fast path of torch's kernels for pinned elements

    @torch.no_grad()
    def park_statistics(self, optimizer: Optimizer) -> None:
        """Keep the second-moment statistics of pinned elements at :data:`PARKED_VALUE`.

        A pinned element's gradient is masked to zero and its first moment was zeroed when its
        pin started, so its update is exactly zero whatever its second moment holds, and the
        restore writes its target back anyway. Left alone, that second moment is an exact zero
        (or decays into subnormals), and torch's CPU kernels take the square root of those 3-10x
        slower than of normal floats: at 50% pinned the optimizer step took twice as long. So the
        engine writes :data:`PARKED_VALUE` there after the first step of a pin, and again before
        the value could decay below ``sqrt`` of the smallest normal float (``beta2 = 0.999``:
        every ~43,000 steps; ``alpha = 0.99``: every ~4,300).

        Free elements are never touched, and the engine writes the zeros the statistics would
        otherwise hold back wherever they can be seen: when a step-window pin stops (the
        released elements start from zero statistics, as they did before), and before every
        ``optimizer.state_dict()`` (checkpoints hold what they held before; the next step runs
        once with the zeros), and when the engine is detached. Parked are ``exp_avg_sq`` and
        ``max_exp_avg_sq`` of Adam, AdamW, NAdam and RAdam, ``square_avg`` of RMSprop and ``sum``
        of Adagrad (exact types, every variant), for the elements of step-window pins, in param
        groups where a masked gradient stays exactly zero inside the step: no weight decay, or
        decoupled decay (AdamW, ``decoupled_weight_decay=True``). Coupled L2 decay adds
        ``weight_decay * value`` to the gradient, so those statistics follow the value and are
        left as they are, as are the statistics of ``when`` pins, which are never reset.

        Called by :meth:`restore` after every step of ``optimizer``; cheap between refreshes.
        """
        if not self.park or type(optimizer) not in _PARKABLE:
            return
        key = frozenset(i for i in self.active if self.plan.pins[i].when is None)
        parked = self._parked.get(id(optimizer))
        if parked is None or parked.optimizer() is not optimizer or parked.key != key:
            if parked is not None and parked.optimizer() is optimizer:
                self._unpark(optimizer)  # elements the old set parked and the new one does not
            parked = self._parked[id(optimizer)] = self._parking_of(optimizer, key)
        if not parked.entries:
            return
        buffers = _parked_buffers(optimizer, parked.entries)
        parked.countdown -= 1
        unchanged = len(buffers) == len(parked.written) and all(
            ref() is buffer for ref, (_, buffer) in zip(parked.written, buffers)
        )
        # A state tensor that is not the one written last is new (the optimizer's first step,
        # load_state_dict): park it now.
        if parked.countdown > 0 and unchanged:
            return
        for target, buffer in buffers:
            view, positions, _ = target.part(buffer)
            if positions is None:
                view.fill_(PARKED_VALUE)
            else:
                fill_at(view, positions, PARKED_VALUE)
        parked.written = [weakref.ref(buffer) for _, buffer in buffers]
        parked.countdown = parked.interval

    def _parking_of(self, optimizer: Optimizer, key: frozenset[int]) -> _Parked:
        """Which statistics of ``optimizer`` the step-window pins ``key`` park, and how often to refresh them."""
        keys, decay_of = _PARKABLE[type(optimizer)]
        group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        entries: list[tuple[Target, tuple[str, ...]]] = []
        interval = _NEVER
        for pin_id in sorted(key):
            for name, selection in self.plan.pins[pin_id].selections.items():
                group = group_of.get(id(selection.parameter))
                if group is None or not _masked_grads_stay_zero(optimizer, group):
                    continue
                if selection.index is None and self.whole_grads == "drop" and not is_sharded(selection.parameter):
                    continue  # its gradient is dropped: the optimizer never touches its state
                steps = _refresh_interval(decay_of(group), selection.parameter.dtype)
                if steps <= 0:
                    continue  # decays to zero within a step: nothing to gain
                stat_key = (pin_id, name)
                if stat_key not in self._stat_targets:
                    self._stat_targets[stat_key] = Target(name, selection.parameter, selection.index, None)
                entries.append((self._stat_targets[stat_key], keys))
                interval = min(interval, steps)
        return _Parked(weakref.ref(optimizer), key, entries, interval)

    @torch.no_grad()
    def _unpark(self, optimizer: Optimizer) -> None:
        """Write back the zeros the parked statistics of ``optimizer`` would hold without parking."""
        parked = self._parked.pop(id(optimizer), None)
        if parked is None or parked.optimizer() is not optimizer:
            return
        for target, buffer in _parked_buffers(optimizer, parked.entries):
            view, positions, _ = target.part(buffer)
            if positions is None:
                view.zero_()
            else:
                fill_at(view, positions, 0)

    def _release_statistics(self, stopped: Iterable[int]) -> None:
        """When a step-window pin stops, its elements go on from fresh (zero) statistics: unpark,
        and zero what coupled L2 decay fed into the moments while the gradient was masked. Pins
        still active are parked again after the next step."""
        window_pins = [i for i in stopped if self.plan.pins[i].when is None]
        if window_pins:
            for optimizer in self._optimizers:
                self._unpark(optimizer)
                self.reset_optimizer_state(optimizer, window_pins)

    def _unpark_before_saving(self, optimizer: Optimizer) -> None:
        # An optimizer state_dict pre-hook: checkpoints hold the statistics parking replaced.
        self._unpark(optimizer)

    # ----------------------------------------------------------------------------------------
    # Checking

    @staticmethod
    def _read(selection: Selection) -> Tensor:
        data = selection.parameter.detach()
        if is_sharded(data):
            # Targets are kept in full-tensor coordinates (rank 0 saves them for everyone). A
            # collective: every rank activates the same pins at the same step.
            data = data.full_tensor()
        if selection.index is None:
            # Row-major, whatever the layout (channels_last): merging indexes it by flat position.
            return data.clone(memory_format=torch.contiguous_format)
        flat, index = flat_view(data, selection.index)
        return flat.index_select(0, index)

    @torch.no_grad()
    def violations(
        self, parameters: Mapping[str, Tensor] | None = None, pin_ids: Iterable[int] | None = None, examples: int = 5
    ) -> list[Violation]:
        """Pinned elements off target, per parameter (``torch.equal`` semantics, bit for bit).

        ``parameters`` maps names to tensors to check (default: the planned parameters);
        ``pin_ids`` defaults to the active pins.
        """
        found = []
        for target in self.targets(pin_ids):
            tensor = target.parameter if parameters is None else parameters.get(target.name)
            if tensor is None:
                raise PinError(f"verify: the module has no parameter {target.name!r}, which is pinned")
            if tuple(tensor.shape) != tuple(target.parameter.shape):
                # Pinned coordinates mean nothing in another shape: say so rather than index past
                # the end (or, worse, compare other elements that happen to fit).
                raise PinError(
                    f"verify: {target.name!r} has shape {tuple(tensor.shape)}, but its pins were resolved on "
                    f"shape {tuple(target.parameter.shape)}; verify the module that was trained, or resolve "
                    "the pins again on the new one"
                )
            tensor = tensor.detach()
            view, positions, values = target.part(tensor)
            actual = view.reshape(-1) if positions is None else view.index_select(0, positions)
            expected = values.reshape(-1).to(actual.device)
            off = actual != expected
            if bool(off.any()):
                where = off.nonzero().squeeze(1)[:examples]
                # Coordinates from the row-major full-tensor index, not from storage positions.
                flat_at = target.flat_index_of(tensor, where)
                coords = torch.stack(torch.unravel_index(flat_at, tuple(tensor.shape)), dim=1).tolist()
                shown = [
                    (tuple(c), actual[w].item(), expected[w].item()) for c, w in zip(coords, where.tolist())
                ]
                found.append(Violation(target.name, int(off.sum()), shown))
        return found

    # ----------------------------------------------------------------------------------------
    # Checkpointing

    def pin_state(self, step: int | None = None) -> PinState:
        """Selections, targets (explicit and captured) and activity, as a :class:`PinState`."""
        pins = []
        for pin_id, rp in enumerate(self.plan.pins):
            captured = self.captured.get(pin_id, {})
            pins.append(
                {
                    name: SavedSelection(
                        s.index, s.values if s.values is not None else captured.get(name), s.values is not None
                    )
                    for name, s in rp.selections.items()
                }
            )
        fingerprints = tuple(rp.pin.fingerprint() for rp in self.plan.pins)
        return PinState(fingerprints, tuple(pins), self.active, self.last_step_active, step)

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """:meth:`pin_state` in its saved form: tensors, lists, dicts and primitives only."""
        return self.pin_state(step).to_dict()

    def load_state_dict(
        self, state: Any, *, strict: bool = True, warn: Callable[[str], Any] | None = None
    ) -> PinState | None:
        """Take selections, captured targets and activity from :meth:`state_dict`; return what was read.

        Raises:
            PinError: with ``strict``, when the saved state is corrupt (:class:`CorruptPinState`) or
                does not match the plan. With ``strict=False`` both are reported through ``warn``
                and the affected pins (all of them for a corrupt state) start afresh.
        """
        warn = warn or (lambda message: warnings.warn(message, UserWarning, stacklevel=3))
        try:
            saved = PinState.from_dict(state, where="the checkpoint's pin state")
        except CorruptPinState as err:
            if strict:
                raise
            warn(f"strict=False: {err}; every pin starts afresh")
            return None
        problems: list[str] = []
        if len(saved.pins) != len(self.plan.pins):
            problems.append(f"the checkpoint holds {len(saved.pins)} pins, the callback has {len(self.plan.pins)}")
        usable: set[int] = set()
        for pin_id, rp in enumerate(self.plan.pins[: len(saved.pins)]):
            pin_problems = self._check_saved_pin(pin_id, saved.pins[pin_id])
            if saved.fingerprints[pin_id] != rp.pin.fingerprint():
                pin_problems.insert(0, "its spec changed")
            if pin_problems:
                problems.append(f"{rp.pin!r}: " + "; ".join(pin_problems))
            else:
                usable.add(pin_id)
        if problems and strict:
            raise PinError(
                "the checkpoint's pin state does not match these pins: "
                + " | ".join(problems)
                + ". Resume with the pins the checkpoint was trained with, or pass strict=False to start "
                "the mismatching pins afresh."
            )
        for problem in problems:
            warn(f"strict=False: ignoring saved pin state that does not match: {problem}")
        for pin_id in usable:
            captured = {
                name: saved.pins[pin_id][name].target.to(device=s.parameter.device, dtype=s.parameter.dtype)
                for name, s in self.plan.pins[pin_id].selections.items()
                if s.values is None and saved.pins[pin_id][name].target is not None
            }
            if captured:
                self.captured[pin_id] = captured
                self._forget(pin_id)
        self.active = frozenset(saved.active & usable)
        last = saved.last_step_active
        self.last_step_active = None if last is None else frozenset(last & usable)
        return saved

    def _check_saved_pin(self, pin_id: int, saved: Mapping[str, SavedSelection]) -> list[str]:
        rp = self.plan.pins[pin_id]
        problems = []
        if set(saved) != set(rp.selections):
            return [f"saved for parameters {sorted(saved)}, now matches {sorted(rp.selections)}"]
        for name, selection in rp.selections.items():
            index, target = saved[name].index, saved[name].target
            if (index is None) != (selection.index is None) or (
                index is not None and not torch.equal(index, selection.index.cpu())
            ):
                problems.append(f"the selected elements of {name!r} differ")
                continue
            if target is None:
                continue
            if tuple(target.shape) != (tuple(selection.parameter.shape) if index is None else (index.numel(),)):
                problems.append(f"the saved targets of {name!r} have shape {tuple(target.shape)}")
                continue
            stored = target.to(selection.parameter.dtype)
            if not torch.equal(stored.to(target.dtype), target):
                problems.append(f"the saved targets of {name!r} do not fit {selection.parameter.dtype}")
            elif selection.values is not None and not torch.equal(stored, selection.values.cpu()):
                problems.append(f"the explicit values for {name!r} differ from the saved ones")
        return problems


def _zero_grad_of(target: Target, grad: Tensor) -> None:
    """Zero the pinned elements of ``grad`` (all of it for a whole tensor)."""
    if target.index is None:
        local_tensor(grad).zero_()
    else:
        flat, positions, _ = target.part(grad)
        # index_fill_, not a multiply: 0 * inf is NaN.
        fill_at(flat, positions, 0)


#: A refresh interval for statistics that never decay.
_NEVER = 1 << 62


@dataclasses.dataclass
class _Parked:
    """The parked statistics of one optimizer (see :meth:`PinEngine.park_statistics`)."""

    optimizer: weakref.ref
    #: The step-window pins active when the entries were computed.
    key: frozenset[int]
    #: Where (a selection's positions) and which state keys are parked.
    entries: list[tuple[Target, tuple[str, ...]]]
    #: Restores between two writes of the parked value.
    interval: int
    #: Restores left until the next write (0 or less: at the next restore).
    countdown: int = 0
    #: Weak references to the state tensors written last.
    written: list[weakref.ref] = dataclasses.field(default_factory=list)


def _masked_grads_stay_zero(optimizer: Optimizer, group: Mapping[str, Any]) -> bool:
    """Whether a gradient masked to zero is still exactly zero where the optimizer accumulates it:
    no weight decay, or decay decoupled from the gradient. Coupled L2 decay adds ``wd * value``."""
    return (
        type(optimizer) is torch.optim.AdamW
        or bool(group.get("decoupled_weight_decay", False))
        or group.get("weight_decay", 0) == 0
    ) and group.get("initial_accumulator_value", 0) == 0  # Adagrad: fresh state must be zero too


def _refresh_interval(decay: float, dtype: torch.dtype) -> int:
    """Steps after which a statistic parked at :data:`PARKED_VALUE` and multiplied by ``decay`` at
    every step is still at least ``sqrt`` of ``dtype``'s smallest normal: it and its root normal."""
    if decay >= 1:
        return _NEVER
    if decay <= 0:
        return 0
    floor = math.sqrt(torch.finfo(dtype).tiny if dtype.is_floating_point else torch.finfo(torch.float32).tiny)
    return int(math.log(floor / PARKED_VALUE) / math.log(decay))


def _parked_buffers(
    optimizer: Optimizer, entries: Sequence[tuple[Target, tuple[str, ...]]]
) -> list[tuple[Target, Tensor]]:
    """The state tensors of ``entries`` that exist now, each with the positions to write."""
    found = []
    for target, keys in entries:
        state = optimizer.state.get(target.parameter)
        if not state:
            continue
        for key in keys:
            buffer = state.get(key)
            if isinstance(buffer, Tensor) and buffer.shape == target.parameter.shape:
                found.append((target, buffer))
    return found


@dataclasses.dataclass
class _Layout:
    """How the entries ``(index, values)`` of one parameter merge, later entries winning.

    It depends on the indices only: :meth:`of` works it out once (deduplicating indices syncs
    with the host), and :meth:`apply` merges any values into it without a sync.
    """

    #: The entries' indices (None: the whole tensor).
    indices: list[Tensor | None]
    #: The merged, sorted, unique index; None for a single entry or when a whole tensor is pinned.
    index: Tensor | None
    #: Positions in the concatenated values that supply each merged value (None: no gather).
    take: Tensor | None
    #: Storage positions of ``index`` per stride pattern, shared by the targets merged with it.
    by_strides: dict[Any, Tensor] = dataclasses.field(default_factory=dict)

    @staticmethod
    def of(indices: Sequence[Tensor | None]) -> _Layout:
        indices = list(indices)
        if len(indices) == 1 or any(index is None for index in indices):
            return _Layout(indices, None, None)
        index = torch.cat(indices)
        order = torch.argsort(index, stable=True)
        unique, counts = torch.unique_consecutive(index[order], return_counts=True)
        take = order[counts.cumsum(0) - 1]
        if take.numel() <= torch.iinfo(torch.int32).max:
            take = take.to(torch.int32)  # index_select takes int32: half the memory
        return _Layout(indices, unique, take)

    def apply(self, values: Sequence[Tensor]) -> tuple[Tensor | None, Tensor]:
        """``(index, values)`` of the merge of ``values`` (one per entry, in the entries' order)."""
        if len(values) == 1:
            return self.indices[0], values[0]
        if self.take is not None:
            return self.index, torch.cat(list(values)).index_select(0, self.take)
        first = max(i for i, index in enumerate(self.indices) if index is None)
        full = values[first].clone(memory_format=torch.contiguous_format)
        flat = full.view(-1)
        for index, entry_values in zip(self.indices[first + 1 :], values[first + 1 :]):
            copy_at(flat, index, entry_values)
        return None, full
