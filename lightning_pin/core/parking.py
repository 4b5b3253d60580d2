"""Parked statistics: keep the optimizer state of pinned elements on torch's fast path.

See :meth:`StatisticsParking.park`. The engine owns one :class:`StatisticsParking` and calls it
after every step; nothing else writes the optimizer state of pinned elements except
:meth:`~lightning_pin.core.engine.PinEngine.reset_optimizer_state`.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_pin.core.plan import PinPlan
from lightning_pin.core.sharding import Target, fill_at, is_sharded

__all__ = ["PARKED_VALUE", "StatisticsParking"]


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


class StatisticsParking:
    """The parked statistics of every optimizer an engine is attached to."""

    def __init__(self) -> None:
        self._parked: dict[int, _Parked] = {}
        self._stat_targets: dict[tuple[int, str], Target] = {}

    @torch.no_grad()
    def park(self, optimizer: Optimizer, plan: PinPlan, key: frozenset[int], whole_grads: str) -> None:
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

        ``key`` holds the active step-window value pins. Called by :meth:`PinEngine.restore` after
        every step of ``optimizer``; cheap between refreshes.
        """
        if type(optimizer) not in _PARKABLE:
            return
        parked = self._parked.get(id(optimizer))
        if parked is None or parked.optimizer() is not optimizer or parked.key != key:
            if parked is not None and parked.optimizer() is optimizer:
                self.unpark(optimizer)  # elements the old set parked and the new one does not
            parked = self._parked[id(optimizer)] = self._parking_of(optimizer, plan, key, whole_grads)
        if not parked.entries:
            return
        parked.countdown -= 1
        state = optimizer.state
        # Optimizers make state tensors at a parameter's first step, and load_state_dict swaps in
        # a new state dict: the same dict with the same entries holds the tensors written last,
        # and between refreshes the check costs nothing per tensor.
        if parked.countdown > 0 and parked.state is state and parked.state_len == len(state):
            return
        buffers = _parked_buffers(optimizer, parked.entries)
        unchanged = len(buffers) == len(parked.written) and all(
            ref() is buffer for ref, (_, buffer) in zip(parked.written, buffers)
        )
        parked.state, parked.state_len = state, len(state)
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

    def _parking_of(self, optimizer: Optimizer, plan: PinPlan, key: frozenset[int], whole_grads: str) -> _Parked:
        """Which statistics of ``optimizer`` the step-window pins ``key`` park, and how often to refresh them."""
        keys, decay_of = _PARKABLE[type(optimizer)]
        group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        entries: list[tuple[Target, tuple[str, ...]]] = []
        interval = _NEVER
        for pin_id in sorted(key):
            for name, selection in plan.pins[pin_id].selections.items():
                group = group_of.get(id(selection.parameter))
                if group is None or not _masked_grads_stay_zero(optimizer, group):
                    continue
                if selection.index is None and whole_grads == "drop" and not is_sharded(selection.parameter):
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
    def unpark(self, optimizer: Optimizer) -> None:
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
    #: The optimizer's state dict when they were written, and its number of entries.
    state: Any = None
    state_len: int = -1


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
