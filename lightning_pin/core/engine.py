"""Tensor mechanics on a :class:`~lightning_pin.core.plan.PinPlan`, with torch only (no Lightning).

:class:`PinEngine` masks the gradients of pinned elements before an optimizer step, restores
pinned values right after it (from a ``register_step_post_hook``), zeroes the optimizer
statistics of elements whose pin activates, and checks values against their targets. Right after
every step it applies the pins' projections (their kinds' kernels, :mod:`lightning_pin.core.kinds`): the
exact values, and the fault models (stuck bits, bounds), whose elements keep their gradients and
optimizer statistics. Sharding, statistics parking and merge layouts have modules of their own. It decides
nothing about *when*: its drivers do, :class:`~lightning_pin.PinCallback` from Lightning's hooks
and :func:`~lightning_pin.pin` from torch's own hooks. Observers (the monitor, step checks)
register with :meth:`PinEngine.register_restore_hook` and get a removable handle.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import warnings
import weakref
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_pin.core.errors import PinError
from lightning_pin.core.plan import PinPlan, Selection, call_when
from lightning_pin.core.parking import PARKED_VALUE, StatisticsParking
from lightning_pin.core import kinds
from lightning_pin.core.kinds import ExactValue, Interval, StuckBits
from lightning_pin.core.kinds import Kind as Projection
from lightning_pin.core.sharding import (
    LocalPart,
    Target,
    copy_at,
    fill_at,
    flat_view,
    is_sharded,
    local_part,
    local_tensor,
)
from lightning_pin.core.state import CorruptPinState, PinState, SavedSelection

__all__ = [
    "OPTIMIZER_STATE_KEYS", "PARKED_VALUE", "ExactValue", "Interval", "LocalPart", "PinEngine", "Projection",
    "StepStats", "StuckBits", "Target", "Violation",
    "copy_at", "fill_at", "flat_view", "is_sharded", "local_part", "local_tensor",
]


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
class Violation:
    """Pinned elements of one parameter found off target."""

    name: str
    count: int
    #: Up to a few ``(coordinates, actual, target)`` examples. For kinds other than values
    #: ``target`` is a description: the bits held and stuck, or the interval.
    examples: list[tuple[tuple[int, ...], float, float | str]]
    #: The name of the kind of pin broken (see :mod:`lightning_pin.core.kinds`).
    kind: str = kinds.DEFAULT.kind

    def __str__(self) -> str:
        kind = kinds.of(self.kind)
        shown = ", ".join(kind.show_example(c, a, t) for c, a, t in self.examples)
        what = kind.off_words
        more = ", ..." if self.count > len(self.examples) else ""
        return f"{self.name}: {self.count} element(s) {what} ({shown}{more})"


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


def _step_stats(elements: int, device: torch.device, moved: Sequence[Tensor], after: Sequence[Tensor]) -> StepStats:
    """``moved``: ``|x - P(x)|`` per projection before the restore; ``after``: the same (or off flags) after it."""
    zero = torch.zeros((), device=device)
    if not moved:
        return StepStats(zero, zero, elements, zero.long())
    return StepStats(
        drift_max=torch.stack([m.max() for m in moved]).max().to(device),
        drift_sum=torch.stack([m.sum() for m in moved]).sum().to(device),
        elements=elements,
        violations=torch.stack([(a != 0).sum() for a in after]).sum().to(device),
    )


# C-level pieces of the loop over many small gradients (_GradMasks.run; no Python frame per
# tensor): a parameter's .grad, "is None", a tensor's dtype, and a consumer
# that runs a map without keeping its results.
_GRAD = operator.attrgetter("grad")
_IS_NONE = functools.partial(operator.is_, None)
_DTYPE = operator.attrgetter("dtype")
_CONSUME = deque(maxlen=0).extend


#: One pinned parameter's gradient mask: (name, parameter, (positions, zeros) for a put_ or None, its mask).
_MaskRow = tuple[str, Tensor, Optional[tuple[Tensor, Tensor]], Callable[[Tensor], None]]


class _GradMasks:
    """What zeroes the active pinned gradients of a set of parameters: few elements in a dense
    tensor by one ``put_`` of zeros each, mapped from C over all of them (no Python frame per
    tensor: a deep model's step), every other tensor by its own mask."""

    def __init__(self, rows: Sequence[_MaskRow]) -> None:
        #: Every row ``(name, parameter, (positions, zeros) or None, mask)``, to take subsets of.
        self.rows = list(rows)
        puts = [(parameter, *put, put[1].dtype, mask) for _, parameter, put, mask in self.rows if put is not None]
        #: Column by column: the parameters, positions, zeros, their dtype, each one's general mask.
        self.puts: tuple[list[Any], ...] = tuple([*column] for column in zip(*puts)) if puts else ([], [], [], [], [])
        #: The parameters masked one at a time, with their masks.
        self.pairs = [(parameter, mask) for _, parameter, put, mask in self.rows if put is None]

    def subset(self, names: Iterable[str]) -> _GradMasks:
        """The masks of the parameters ``names`` only (one optimizer's)."""
        chosen = set(names)
        return _GradMasks([row for row in self.rows if row[0] in chosen])

    def run(self) -> None:
        """Zero the pinned elements of every present gradient."""
        parameters, positions, zeros, dtypes, masks = self.puts
        if parameters:
            grads = list(map(_GRAD, parameters))
            if not any(map(_IS_NONE, grads)) and list(map(_DTYPE, grads)) == dtypes:
                _CONSUME(map(Tensor.put_, grads, positions, zeros))
            else:  # a missing gradient, or one cast since (refused before the step): one at a time
                for grad, mask in zip(grads, masks):
                    if grad is not None:
                        mask(grad)
        for parameter, mask in self.pairs:
            grad = parameter.grad
            if grad is not None:
                mask(grad)


@dataclasses.dataclass
class _StepPlan:
    """What a steady-state step of one optimizer runs under the active pins (see PinEngine._step_plan)."""

    #: The engine's version it was built for (moves when the active pins or their targets change).
    version: int
    #: The optimizer's param-group sizes it was built for (fine-tuning adds groups mid-training).
    layout: tuple[int, ...]
    #: The merged targets of the frozen kind (values) and the kernels of the others on the
    #: optimizer's parameters.
    owned: list[Target]
    faults: list[Projection]
    #: Pinned elements they hold (from shapes: no sync).
    elements: int
    #: The whole-tensor value targets among ``owned`` (their gradients are dropped before the step).
    wholes: list[Target]
    #: The restore of every kernel, one call each with its constants bound (a step with whole
    #: tensors of the frozen kind takes the general path: see PinEngine.restore).
    kernels: list[Callable[[], None]]
    #: The parameters whose storage the kernels are bound to, and where it was (``data_ptr``).
    bound: tuple[Tensor, ...] = ()
    storage: tuple[int, ...] = ()


#: ``data_ptr`` of a tensor, as a C function ``map`` calls without a Python frame (the step plan's check).
_data_ptr = Tensor.data_ptr


def _apply_to_parameter(projection: Projection) -> None:
    """A projection's general restore on its parameter's data (the step plan's fallback kernel)."""
    projection.apply(projection.target.parameter.data)


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
        # The frozen kind's merged kernels (values) by set of pins, and their targets: rebuilt when a
        # pin captures new targets (see _forget); other kinds' kernels (_faults) are not.
        self._values: dict[frozenset[int], tuple[list[Projection], list[Target]]] = {}
        #: Keep the statistics of pinned elements on torch's fast path (see park_statistics);
        #: False keeps them at zero as engines before parking did.
        self.park = True
        self._parking = StatisticsParking()
        # (the active set, its step-window value pins), worked out when the active set changes
        self._park_key: tuple[Optional[frozenset[int]], frozenset[int]] = (None, frozenset())
        self._optimizer_names: dict[int, tuple[tuple[int, ...], frozenset[str]]] = {}
        self._optimizers: list[Optimizer] = []
        self._dropped: set[str] = set()
        # Version counters of whole pinned tensors right after the engine wrote them (writes
        # through .data do not count): another write since (model.load_state_dict, a user's
        # copy_) moves the counter, and the restore must not take the tensor as untouched.
        self._written_version: dict[str, int] = {}
        # Gradient masks of the active pins by parameter name (see _build_grad_masks); None: stale.
        self._grad_masks: Optional[dict[str, Callable[[Tensor], None]]] = None
        self._all_grad_masks = _GradMasks([])
        # Per optimizer (by id): (its step plan, the masks, its parameters' _GradMasks) for mask_grads.
        self._owned_grad_masks: dict[int, tuple[_StepPlan, dict[str, Callable[[Tensor], None]], _GradMasks]] = {}
        # The step plan of each optimizer (by id; None: all): what a steady-state step runs, built
        # when ``_version`` moves (the active pins or their captured targets change) or the
        # optimizer's param groups do. See _step_plan.
        self._step_plans: dict[int, _StepPlan] = {}
        self._version = 0
        # The pins active over a span of steps without `when` pins: (first step, end step, ids).
        # ids_at answers from it until a pin's start or stop falls due.
        self._span: tuple[int, int, frozenset[int]] = (0, 0, frozenset())
        self._has_when = any(rp.when is not None for rp in plan.pins)
        #: Whether any pin holds a whole tensor by value (their gradients are dropped before a step).
        self.has_whole_pins = any(
            s.index is None and _frozen(s) for rp in plan.pins for s in rp.selections.values()
        )
        self._faults: dict[frozenset[int], list[Projection]] = {}
        # Observers of each restore: id -> (hook, wants_stats). See register_restore_hook.
        self._restore_hooks: OrderedDict[int, tuple[Callable[[Optional[StepStats]], None], Callable[[], bool]]] = (
            OrderedDict()
        )
        # Optimizers whose compiled step (core/compiled_step.py) restored values itself, by id:
        # (names it restored, |value - target| before its restore when stats were wanted, else None).
        self._fused: dict[int, tuple[frozenset[str], Optional[list[Tensor]]]] = {}
        #: Whether anything reads the gradients between backward and the step (gradient clipping):
        #: pinned gradients must then be zero in memory before it. When False, tensors that a
        #: compiled step holds (compile_step=True) are not masked in memory: the step ignores their
        #: pinned gradients. pin() keeps True (its gradients are zero when backward returns);
        #: PinCallback sets False when the Trainer does not clip.
        self.grads_read_before_step = True
        # Compiled steps that mask gradients densely, by parameter name (mask_grad).
        self._dense_grad_masks: dict[str, Any] = {}

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
        """Pins active at optimizer step ``step``; ``when`` pins only if their id is in ``when_hits``.

        Without ``when`` pins the answer is kept for the span of steps until the next start or
        stop of a pin, and the same frozenset is returned over it (a steady step computes nothing).
        """
        first, end, ids = self._span
        if first <= step < end and not self._has_when:
            return ids
        hits = set(when_hits)
        ids = frozenset(
            i for i, rp in enumerate(self.plan.pins) if rp.in_window(step) and (rp.when is None or i in hits)
        )
        if not self._has_when:
            edges = [e for rp in self.plan.pins for e in (rp.pin.start_step, rp.pin.stop_step) if e is not None]
            first = max([e for e in edges if e <= step], default=-(1 << 62))
            end = min([e for e in edges if e > step], default=1 << 62)
            self._span = (first, end, ids)
        return ids

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
        if new == self.active:
            return []  # keep the same object: what was built for it (step plan, parking) stays valid
        started = sorted(new - self.active)
        stopped = self.active - new
        self._grad_masks = None
        self._version += 1
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
            to_capture = {name: s for name, s in rp.selections.items() if _frozen(s) and s.values is None}
            if to_capture:
                self.captured[pin_id] = {name: self._read(s) for name, s in to_capture.items()}
                self._forget(pin_id)
        touched = {name for pin_id in started for name in self.plan.pins[pin_id].selections}
        self._write([t for t in self.targets() if t.name in touched])
        # Faults hold from the first active step's forward on, as values do.
        for projection in self.fault_projections():
            if projection.name in touched:
                projection.apply(projection.target.parameter.data)
        # Only the frozen kind (values) resets optimizer state: the elements of others keep training.
        step_window_pins = [i for i in started if self.plan.pins[i].when is None and self._is_value_pin(i)]
        for optimizer in self._optimizers:
            self.reset_optimizer_state(optimizer, step_window_pins)

    def _is_value_pin(self, pin_id: int) -> bool:
        return kinds.for_pin(self.plan.pins[pin_id].pin).frozen

    def _forget(self, pin_id: int) -> None:
        for key in [k for k in self._values if pin_id in k]:
            del self._values[key]
        self._grad_masks = None
        self._version += 1

    # ----------------------------------------------------------------------------------------
    # Targets

    def targets(self, pin_ids: Iterable[int] | None = None) -> list[Target]:
        """Per parameter, the merged targets of the frozen kind's pins among ``pin_ids`` (default:
        the active pins): the :class:`~lightning_pin.core.sharding.Target` of each value kernel,
        whose elements' gradients are masked and whose optimizer statistics are parked."""
        return self._frozen_kernels(self.active if pin_ids is None else frozenset(pin_ids))[1]

    def _frozen_kernels(self, key: frozenset[int]) -> tuple[list[Projection], list[Target]]:
        found = self._values.get(key)
        if found is None:
            kernels = self._merged(key, frozen=True)
            found = self._values[key] = (kernels, [kernel.target for kernel in kernels])
        return found

    def _merged(self, key: frozenset[int], frozen: bool) -> list[Projection]:
        """One kernel per parameter and kind for the pins ``key`` of frozen kinds (or of the others):
        each kind merges its selections, in pin order, with what their pins captured."""
        groups: dict[tuple[str, str], tuple[list[Selection], list[Optional[Tensor]]]] = {}
        for pin_id in sorted(key):
            captured = self.captured.get(pin_id, {})
            for name, selection in self.plan.pins[pin_id].selections.items():
                if _frozen(selection) == frozen:
                    entries, held = groups.setdefault((name, selection.kind), ([], []))
                    entries.append(selection)
                    held.append(captured.get(name))
        merged = []
        for (name, kind), (entries, held) in groups.items():
            kernel = kinds.of(kind).merge(name, self.plan.parameters[name], entries, held)
            if kernel is not None:
                merged.append(kernel)
        return merged

    def fault_projections(self, pin_ids: Iterable[int] | None = None) -> list[Projection]:
        """Per parameter and kind, the merged kernels of the pins ``pin_ids`` (default: the active
        pins) whose elements train (stuck bits, bounds, codes). Built once per set of pins (it
        syncs), then reused."""
        key = self.active if pin_ids is None else frozenset(pin_ids)
        found = self._faults.get(key)
        if found is None:
            found = self._faults[key] = self._merged(key, frozen=False)
        return found

    def projections(self, pin_ids: Iterable[int] | None = None) -> list[Projection]:
        """Everything the pins ``pin_ids`` (default: the active ones) hold, one kernel per parameter
        and kind: :class:`ExactValue` for value pins, :class:`StuckBits`, :class:`Interval`, ..."""
        key = self.active if pin_ids is None else frozenset(pin_ids)
        return self._frozen_kernels(key)[0] + self.fault_projections(key)

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

    def register_grad_hooks(self, names: Optional[Iterable[str]] = None) -> list[RemovableHandle]:
        """Zero the gradients of active pinned elements as soon as backward accumulates them
        (of the pinned parameters ``names``, default: all that require grad).

        For drivers without an "after backward" moment (plain loops, Fabric): each pinned
        parameter gets a ``register_post_accumulate_grad_hook``, so pinned gradients are zero when
        ``loss.backward()`` returns, before any clipping or scaler sees them, on every micro-batch
        of an accumulation window, and before DDP's reducer reads them (it hooks the same
        accumulation, after these). Wholly pinned tensors get a zero gradient here (DDP expects
        one); :meth:`drop_whole_grads` drops it right before the step.
        """
        chosen = None if names is None else set(names)
        return [
            parameter.register_post_accumulate_grad_hook(self._grad_hook(name))
            for name, parameter in self.plan.parameters.items()
            if parameter.requires_grad and (chosen is None or name in chosen)
        ]

    def _grad_hook(self, name: str) -> Callable[[Tensor], None]:
        # The hook lives in C++ (on the parameter's autograd metadata), where Python's garbage
        # collector cannot see it: a strong reference to the engine from there would keep the
        # engine, its handle, the module and the optimizer alive forever once the user drops them
        # without remove(). A weak one lets the whole cycle go.
        engine_ref = weakref.ref(self)

        def hook(parameter: Tensor) -> None:
            # Runs once per pinned parameter and backward, hundreds of times a step in a deep
            # model: a dict lookup and one kernel (see _grad_masks).
            self = engine_ref()
            if self is None:
                return
            masks = self._grad_masks if self._grad_masks is not None else self._build_grad_masks()
            mask = masks.get(name)
            grad = parameter.grad
            if mask is not None and grad is not None:
                if torch.is_grad_enabled():  # backward with create_graph=True
                    with torch.no_grad():
                        mask(grad)
                else:
                    mask(grad)

        return hook

    def _build_grad_masks(self) -> dict[str, Callable[[Tensor], None]]:
        """Per pinned parameter, what zeroes its active pinned gradients: kept until the active
        pins, their targets or a compiled step's dense masks change (``_grad_masks = None``)."""
        masks: dict[str, Callable[[Tensor], None]] = {}
        rows = []
        for target in self.targets():
            if self._dense_grad_masks:
                masks[target.name] = functools.partial(self._zero_grad, target)
            else:
                masks[target.name] = target.mask_grad
            put = None if self._dense_grad_masks else target.grad_zeros()
            rows.append((target.name, target.parameter, put, masks[target.name]))
        self._grad_masks = masks
        self._all_grad_masks = _GradMasks(rows)
        return masks

    @torch.no_grad()
    def mask_all_grads(self) -> None:
        """Zero the active pinned gradients of every pinned parameter, in one call: what the hooks
        of :meth:`register_grad_hooks` do one parameter at a time, for drivers that know when a
        whole backward has finished (:func:`~lightning_pin.pin` on a deep model). Wholly pinned
        tensors get a zero gradient, as from the hooks."""
        if self._grad_masks is None:
            self._build_grad_masks()
        self._all_grad_masks.run()

    @torch.no_grad()
    def drop_whole_grads(self, optimizer: Optimizer | None = None) -> None:
        """Set the gradients of wholly pinned tensors ``optimizer`` updates (default: all) to None,
        so torch optimizers skip them, state and weight decay included. Sharded tensors keep a
        (zero) gradient: FSDP2 needs their optimizer state to exist for distributed checkpoints."""
        if self.whole_grads != "drop" or not self.has_whole_pins:
            return
        for target in self._step_plan(optimizer).wholes:
            grad = target.parameter.grad
            if grad is not None and not is_sharded(grad):
                target.parameter.grad = None
                self._dropped.add(target.name)

    def _step_plan(self, optimizer: Optimizer | None) -> _StepPlan:
        """What a step of ``optimizer`` (default: all) runs under the active pins, built once per set
        of active pins (and captured targets) and param-group layout, then reused step after step.

        The check is written out (no helper, no comprehension): it runs at every step.
        """
        plan = self._step_plans.get(id(optimizer))
        if plan is not None and plan.version == self._version:
            if optimizer is None:
                return plan
            groups = optimizer.param_groups
            layout = plan.layout
            if len(groups) == len(layout):
                same = True
                for group, size in zip(groups, layout):
                    if len(group["params"]) != size:
                        same = False
                        break
                if same:
                    return plan
        return self._build_step_plan(optimizer)

    def _build_step_plan(self, optimizer: Optimizer | None) -> _StepPlan:
        values, faults = self._frozen_kernels(self.active)[0], self.fault_projections()
        names = None if optimizer is None else self._names_of(optimizer)
        owned_values = values if names is None else [v for v in values if v.name in names]
        owned_faults = faults if names is None else [f for f in faults if f.name in names]
        owned = [v.target for v in owned_values]
        elements = sum(p.elements for p in owned_values) + sum(f.elements for f in owned_faults)
        wholes = [t for t in owned if t.index is None]
        # Each kernel is bound to its parameter's storage; a sharded one reads its shard at every call.
        kernels, bound = [], []
        for p in owned_values + owned_faults:
            parameter = p.target.parameter
            if is_sharded(parameter):
                kernels.append(functools.partial(_apply_to_parameter, p))
            else:
                kernels.append(p.kernel(parameter.data))
                bound.append(parameter)
        layout = () if optimizer is None else tuple(len(group["params"]) for group in optimizer.param_groups)
        plan = self._step_plans[id(optimizer)] = _StepPlan(
            self._version, layout, owned, owned_faults, elements, wholes, kernels, tuple(bound),
            tuple(map(_data_ptr, bound)),
        )
        return plan

    @torch.no_grad()
    def mask_grads(self, optimizer: Optimizer | None = None) -> None:
        """Zero the gradients of active pinned elements of ``optimizer``'s parameters (default: all).

        Call after backward (and any gradient all-reduce) and before clipping and the step, so
        pinned gradients stay out of momentum, adaptive statistics and the clip norm.
        """
        self.drop_whole_grads(optimizer)
        masks = self._grad_masks if self._grad_masks is not None else self._build_grad_masks()
        plan = self._step_plan(optimizer)
        # The masks of this optimizer's pinned parameters, kept while the plan and the masks are.
        kept = self._owned_grad_masks.get(id(optimizer))
        if kept is None or kept[0] is not plan or kept[1] is not masks:
            owned = self._all_grad_masks.subset(target.name for target in plan.owned)
            kept = self._owned_grad_masks[id(optimizer)] = (plan, masks, owned)
        kept[2].run()

    def _zero_grad(self, target: Target, grad: Tensor) -> None:
        # A compiled step (compile_step=True) may mask this tensor with a dense mask of its own.
        dense = self._dense_grad_masks.get(target.name) if self._dense_grad_masks else None
        if dense is None or not dense.mask_grad(target.name, grad):
            target.mask_grad(grad)

    @torch.no_grad()
    def restore(self, optimizer: Optimizer | None = None) -> None:
        """Write the targets of active pins into ``optimizer``'s parameters (default: all), then
        call the restore hooks (with this restore's :class:`StepStats` when one asked for them).

        A steady step runs the step plan's kernels, one call per pinned tensor with every constant
        bound (see :meth:`_step_plan`); whole tensors, a compiled step's restores and measured
        steps take the general path."""
        plan = self._step_plan(optimizer)
        hooks = self._restore_hooks
        measure = False
        if hooks:
            for _, wants in hooks.values():
                if wants():
                    measure = True
                    break
        if measure or plan.wholes or self._fused:
            self._restore_general(optimizer, plan, measure)
            return
        if tuple(map(_data_ptr, plan.bound)) != plan.storage:  # a .data swap since: bind the kernels again
            plan = self._build_step_plan(optimizer)
        for kernel in plan.kernels:
            kernel()
        self.last_step_active = self.active
        if hooks:
            for hook, _ in list(hooks.values()):
                hook(None)

    def _restore_general(self, optimizer: Optimizer | None, plan: _StepPlan, measure: bool) -> None:
        owned, faults, elements = plan.owned, plan.faults, plan.elements
        todo = owned
        if self._dropped:
            # A wholly pinned tensor whose grad was dropped was skipped by such an optimizer: it
            # still holds its target, and copying it back would cost a full pass over it.
            if optimizer is not None and type(optimizer) in _SKIPS_NONE_GRADS:
                todo = [
                    t for t in owned
                    if not (
                        t.index is None
                        and t.name in self._dropped
                        and self._written_version.get(t.name) == t.parameter._version
                    )
                ]
            self._dropped.difference_update(t.name for t in owned)
        # A compiled step (compile_step=True) already wrote the targets of what it updates.
        fused_names, fused_moved = self._fused.pop(id(optimizer), (frozenset(), None))
        fused = [t for t in todo if t.name in fused_names] if fused_names else []
        if fused:
            todo = [t for t in todo if t.name not in fused_names]
        moved = None
        if measure:
            moved = [self._deviation(t) for t in todo] + [f.drift(f.target.parameter.detach()) for f in faults]
            moved += fused_moved or []
        self._write(todo)
        for projection in faults:
            projection.apply(projection.target.parameter.data)
        stats = None
        if moved is not None:
            after = [self._deviation(t) for t in todo + fused] + [f.off(f.target.parameter.detach())[1] for f in faults]
            stats = _step_stats(elements, self.device, moved, after)
        self.last_step_active = self.active
        for hook, _ in list(self._restore_hooks.values()):
            hook(stats)

    def _wants_stats(self) -> bool:
        """Whether an observer wants this restore's :class:`StepStats` (see register_restore_hook)."""
        return any([wants() for _, wants in self._restore_hooks.values()])

    def _deviation(self, target: Target) -> Tensor:
        """``|value - target|`` of the pinned elements of ``target``, flat, in float32 or wider."""
        view, positions, values = target.part(target.parameter.detach())
        actual = view.reshape(-1) if positions is None else view.index_select(0, positions)
        deviation = (actual - values.reshape(-1)).abs()
        return deviation if deviation.dtype in (torch.float32, torch.float64) else deviation.float()

    def _write(self, targets: Iterable[Target]) -> None:
        wholes = []
        for target in targets:
            if target.index is None:
                wholes.append(target)
            elif not target.restore_dense():  # one index_copy_ for the common case
                view, positions, values = target.part(target.parameter.data)
                copy_at(view, positions, values)
        if wholes:
            dense = [t for t in wholes if not is_sharded(t.parameter)]
            if len(dense) > 1:
                # One call for many whole tensors: foreach kernels group them by dtype and device.
                torch._foreach_copy_([t.parameter.data for t in dense], [t.values for t in dense])
            else:
                dense = []
            for target in wholes:
                if not dense or is_sharded(target.parameter):
                    view, _, values = target.part(target.parameter.data)
                    view.copy_(values)
                self._written_version[target.name] = target.parameter._version

    @property
    def checked_ids(self) -> frozenset[int]:
        """The pins whose targets must hold now: those active at the last optimizer step, or
        before any step, those active now."""
        return self.last_step_active if self.last_step_active is not None else self.active

    @torch.no_grad()
    def write_into(self, parameters: Mapping[str, Tensor], pin_ids: Iterable[int] | None = None) -> None:
        """Write the merged targets of ``pin_ids`` (default: :attr:`checked_ids`) into a copy of the
        weights (an averaged model), by parameter name; names the copy lacks are skipped."""
        for projection in self.projections(self.checked_ids if pin_ids is None else pin_ids):
            tensor = parameters.get(projection.name)
            if tensor is not None:
                projection.apply(tensor.detach())

    def force(self) -> None:
        """Write the targets of every active pin now, and force their stuck bits and bounds (e.g.
        after loading weights on resume)."""
        with torch.no_grad():
            self._write(self.targets())
            for projection in self.fault_projections():
                projection.apply(projection.target.parameter.data)

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
    @torch.no_grad()
    def park_statistics(self, optimizer: Optimizer) -> None:
        """Keep the second-moment statistics of pinned elements at :data:`PARKED_VALUE` (see
        :meth:`StatisticsParking.park <lightning_pin.core.parking.StatisticsParking.park>`): torch's
        CPU kernels take square roots of exact zeros 3-10x slower than of normal floats.

        Called by :meth:`restore` after every step of ``optimizer``; cheap between refreshes.
        """
        if not self.park:
            return
        active = self.active
        if self._park_key[0] is not active:  # the active set is a new frozenset when it changes
            key = frozenset(i for i in active if self.plan.pins[i].when is None and self._is_value_pin(i))
            self._park_key = (active, key)
        self._parking.park(optimizer, self.plan, self._park_key[1], self.whole_grads)

    def _unpark(self, optimizer: Optimizer) -> None:
        self._parking.unpark(optimizer)

    def _release_statistics(self, stopped: Iterable[int]) -> None:
        """When a step-window pin stops, its elements go on from fresh (zero) statistics: unpark,
        and zero what coupled L2 decay fed into the moments while the gradient was masked. Pins
        still active are parked again after the next step."""
        window_pins = [i for i in stopped if self.plan.pins[i].when is None and self._is_value_pin(i)]
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
    def off_count(self, pin_ids: Iterable[int] | None = None) -> Optional[Tensor]:
        """How many pinned elements of the planned parameters are off target, as a 0-d device tensor
        (no sync: read it once, then ask :meth:`violations` which ones only if it is not zero);
        None for sharded parameters, whose check is :meth:`violations`' own."""
        if self.sharded:
            return None
        counts = [p.off(p.target.parameter.detach())[1].sum() for p in self.projections(pin_ids)]
        if not counts:
            return torch.zeros((), dtype=torch.long, device=self.device)
        return torch.stack(counts).sum()

    @torch.no_grad()
    def violations(
        self, parameters: Mapping[str, Tensor] | None = None, pin_ids: Iterable[int] | None = None, examples: int = 5
    ) -> list[Violation]:
        """Pinned elements off target, per parameter (``torch.equal`` semantics, bit for bit).

        ``parameters`` maps names to tensors to check (default: the planned parameters);
        ``pin_ids`` defaults to the active pins.
        """
        found = []
        for projection in self.projections(pin_ids):
            target = projection.target
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
            refused = projection.refuse_copy(tensor)
            if refused is not None:
                raise PinError(refused)
            tensor = tensor.detach()
            actual, off, expected = projection.off(tensor)
            if bool(off.any()):
                where = off.nonzero().squeeze(1)[:examples]
                # Coordinates from the row-major full-tensor index, not from storage positions.
                flat_at = target.flat_index_of(tensor, where)
                coords = torch.stack(torch.unravel_index(flat_at, tuple(tensor.shape)), dim=1).tolist()
                shown = [(tuple(c), actual[w].item(), expected(w)) for c, w in zip(coords, where.tolist())]
                found.append(Violation(target.name, int(off.sum()), shown, projection.kind))
        return found

    # ----------------------------------------------------------------------------------------
    # Checkpointing

    def pin_state(self, step: int | None = None) -> PinState:
        """Selections, targets (explicit and captured) and activity, as a :class:`PinState`."""
        pins = []
        for pin_id, rp in enumerate(self.plan.pins):
            captured = self.captured.get(pin_id, {})
            pins.append({name: _saved_selection(s, captured.get(name)) for name, s in rp.selections.items()})
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
                if _frozen(s) and s.values is None and saved.pins[pin_id][name].target is not None
            }
            if captured:
                self.captured[pin_id] = captured
                self._forget(pin_id)
        self.active = frozenset(saved.active & usable)
        self._grad_masks = None
        self._version += 1
        last = saved.last_step_active
        self.last_step_active = None if last is None else frozenset(last & usable)
        return saved

    def _check_saved_pin(self, pin_id: int, saved: Mapping[str, SavedSelection]) -> list[str]:
        rp = self.plan.pins[pin_id]
        problems = []
        if set(saved) != set(rp.selections):
            return [f"saved for parameters {sorted(saved)}, now matches {sorted(rp.selections)}"]
        for name, selection in rp.selections.items():
            index = saved[name].index
            if (index is None) != (selection.index is None) or (
                index is not None and not torch.equal(index, selection.index.cpu())
            ):
                problems.append(f"the selected elements of {name!r} differ")
                continue
            if saved[name].kind != selection.kind:
                problems.append(f"{name!r} was saved as a {saved[name].kind} pin, now is a {selection.kind} pin")
                continue
            problems.extend(kinds.of(selection.kind).saved_differs(selection, saved[name], name))
        return problems


def _saved_selection(selection: Selection, captured: Tensor | None) -> SavedSelection:
    """What the state saves of one selection: its kind's saved form (see :mod:`lightning_pin.core.state`)."""
    return kinds.of(selection.kind).saved(selection, captured)


def _frozen(selection: Selection) -> bool:
    """Whether the selection's elements are frozen (values: merged targets, masked gradients)."""
    return kinds.of(selection.kind).frozen
