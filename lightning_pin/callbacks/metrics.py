"""torchmetrics Metrics for pinned training: pin drift, violations, weight drift, and accuracy bookkeeping.

Every value a :class:`~torchmetrics.Metric` here accumulates lives in ``add_state``, so
``compute()`` syncs it across processes (DDP) on its own. Updates take device tensors and never
read them on the host: call ``compute()`` only where you log.

- :class:`PinDrift`: how far the optimizer moved pinned elements in a step, before the restore
  wrote them back, i.e. how hard training pushes against the pins;
- :class:`PinViolations`: pinned elements found off target (must stay 0);
- :class:`WeightDrift`: L2 distance of the free weights from a reference (fit start), in total,
  per top-level module and relative to their norm; :class:`FreeWeights` measures it;

(:class:`~lightning_pin.reporting.preservation.Preservation`, the accuracy bookkeeping, is pure
Python and lives with the reports.)

Nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_pin.core.engine import StepStats, Target
from lightning_pin.core.kinds import ExactValue
from lightning_pin.core.kinds import Kind as Projection
from lightning_pin.core.plan import PinPlan

__all__ = [
    "FreeWeights", "PinDrift", "PinViolations", "WeightDrift", "count_off_target", "pinned_indices",
    "top_level_groups",
]


class PinDrift(Metric):
    r"""How far the optimizer moved pinned elements in a step, measured before the restore.

    Fed with the :class:`~lightning_pin.core.engine.StepStats` that a measured
    :meth:`PinEngine.restore <lightning_pin.core.engine.PinEngine.restore>` records. ``compute()`` returns
    ``{"max": ..., "mean": ...}``: the largest ``|value - target|`` of any pinned element right
    after the optimizer's update, and the mean over every pinned element of every update since the
    last reset. Large values mean training pushes hard against the pins; 0 means it does not.

    Example::

        >>> import torch
        >>> from lightning_pin.core.engine import StepStats
        >>> drift = PinDrift()
        >>> drift.update(StepStats(torch.tensor(0.5), torch.tensor(0.75), elements=3, violations=torch.tensor(0)))
        >>> {key: value.item() for key, value in drift.compute().items()}
        {'max': 0.5, 'mean': 0.25}
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("max_move", torch.tensor(0.0), dist_reduce_fx="max")
        self.add_state("sum_move", torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("elements", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, stats: StepStats) -> None:
        self.max_move = torch.maximum(self.max_move, stats.drift_max.to(self.max_move))
        self.sum_move = self.sum_move + stats.drift_sum.to(self.sum_move)
        self.elements = self.elements + stats.elements

    def compute(self) -> dict[str, Tensor]:
        return {"max": self.max_move, "mean": self.sum_move / self.elements.clamp_min(1)}


class PinViolations(Metric):
    r"""Pinned elements found off target, summed over the updates since the last reset.

    The guarantee of :class:`~lightning_pin.PinCallback` is that this stays 0. Feed it
    :attr:`StepStats.violations <lightning_pin.core.engine.StepStats.violations>` (off target right
    after a restore) or :func:`count_off_target` (off target now, e.g. after something else wrote
    to the weights between steps).

    Every process holds a full replica of the pins, so processes are reduced by ``max`` (the worst
    one), not by a sum that would count each replica of one bad element.

    Example::

        >>> import torch
        >>> violations = PinViolations()
        >>> violations.update(torch.tensor(0))
        >>> violations.update(torch.tensor(3))
        >>> violations.compute().item()
        3
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("off_target", torch.tensor(0), dist_reduce_fx="max")

    def update(self, count: Tensor | int) -> None:
        self.off_target = self.off_target + torch.as_tensor(count, device=self.off_target.device).long()

    def compute(self) -> Tensor:
        return self.off_target


@torch.no_grad()
def count_off_target(targets: Iterable[Target | Projection]) -> Tensor:
    """How many pinned elements break their pin now, as a 0-d device tensor.

    ``targets`` are projections (:meth:`PinEngine.projections
    <lightning_pin.core.engine.PinEngine.projections>`: values compared with ``!=``, bit exact as
    :meth:`PinCallback.verify <lightning_pin.PinCallback.verify>` does; stuck bits by bit pattern;
    bounds by value) or value targets. Never syncs with the host.
    """
    counts = []
    for target in targets:
        projection = target if isinstance(target, Projection) else ExactValue(target)
        # The pinned elements this process holds (all of them unless the parameter is sharded).
        counts.append(projection.off(projection.target.parameter.detach())[1].sum())
    if not counts:
        return torch.zeros((), dtype=torch.long)
    device = counts[0].device
    return torch.stack([c.to(device) for c in counts]).sum()


class WeightDrift(Metric):
    r"""L2 distance of the free weights from a reference, in total, per group and relative to their norm.

    ``update(squared_distance, squared_reference)`` takes one entry per group (e.g. per top-level
    module), as :meth:`FreeWeights.squared_distances` measures them. The distance is a snapshot, not
    an accumulation: each update replaces the previous one. ``compute()`` returns ``{"total":
    ||w - w0||, "relative": ||w - w0|| / ||w0||, "groups": one ||w - w0|| per group}``, with the
    group names in :attr:`groups` (torchmetrics squeezes a one-group result to a 0-d tensor).

    Args:
        groups: The group names, in the order of the update's entries.
        replicated: Every process holds the same full weights (DDP): processes are reduced by their
            mean, which is exact on identical values. ``False`` for sharded weights (FSDP), where each
            process measures its own shard and the squares are summed.

    Example::

        >>> import torch
        >>> drift = WeightDrift(["encoder", "head"])
        >>> drift.update(torch.tensor([9.0, 16.0]), torch.tensor([36.0, 64.0]))
        >>> result = drift.compute()
        >>> result["total"].item(), result["relative"].item(), result["groups"].tolist()
        (5.0, 0.5, [3.0, 4.0])
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, groups: Sequence[str], replicated: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.groups = list(groups)
        reduce = "mean" if replicated else "sum"
        self.add_state("squared_distance", torch.zeros(len(self.groups)), dist_reduce_fx=reduce)
        self.add_state("squared_reference", torch.zeros(len(self.groups)), dist_reduce_fx=reduce)

    def update(self, squared_distance: Tensor, squared_reference: Tensor) -> None:
        self.squared_distance = squared_distance.detach().to(self.squared_distance)
        self.squared_reference = squared_reference.detach().to(self.squared_reference)

    def compute(self) -> dict[str, Tensor]:
        total = self.squared_distance.sum().sqrt()
        norm = self.squared_reference.sum().sqrt()
        relative = torch.where(norm > 0, total / norm.clamp_min(torch.finfo(norm.dtype).tiny), torch.zeros_like(total))
        return {"total": total, "relative": relative, "groups": self.squared_distance.sqrt()}


def top_level_groups(names: Iterable[str]) -> dict[str, str]:
    """Map parameter names to their top-level module, looking through single-child wrappers.

    ``encoder.0.weight`` belongs to ``encoder``. When every name starts with the same modules (a
    ``LightningModule`` holding one ``backbone``), those are looked through, so the groups are the
    modules that differ: ``backbone.features`` and ``backbone.head``, not one ``backbone``.
    """
    names = list(names)
    parts = [name.split(".") for name in names]
    common = 0
    if len(parts) > 1:
        while all(len(p) > common + 1 for p in parts) and len({p[common] for p in parts}) == 1:
            common += 1
    return {name: ".".join(p[: common + 1]) for name, p in zip(names, parts)}


class FreeWeights:
    """The trainable elements no pin ever selects, and their values at a reference point.

    Keeps a copy of those parameters (on their devices) taken at construction, e.g. at fit start,
    and measures how far they moved from it, per group, as device tensors without host syncs. A
    parameter with some pinned elements counts its other elements; a wholly pinned or frozen one
    (``requires_grad=False``) counts nothing.

    Measuring works in chunks of at most ``chunk`` elements through one reused scratch buffer per
    dtype and device: fresh temporaries the size of a weight would cost more (page faults) than the
    arithmetic.

    Args:
        named_parameters: The module's ``named_parameters()``.
        pinned: Per parameter name, the sorted flat indices that some pin selects, or ``None`` for
            all of them (see :func:`pinned_indices`).
        groups: Per parameter name, its group (default: :func:`top_level_groups`).
        chunk: Largest number of elements measured at once.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 1, bias=False))
        >>> _ = nn.init.zeros_(model[0].weight)
        >>> free = FreeWeights(model.named_parameters(), pinned={})
        >>> with torch.no_grad():
        ...     _ = model[0].weight.add_(torch.tensor([[3.0, 4.0]]))
        >>> free.groups, free.squared_distances().tolist()
        (['0'], [25.0])
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, Tensor]],
        pinned: Mapping[str, Optional[Tensor]],
        groups: Optional[Mapping[str, str]] = None,
        chunk: int = 1 << 20,
    ) -> None:
        trainable = [(n, p) for n, p in named_parameters if p.requires_grad]
        free = [(n, p) for n, p in trainable if not (n in pinned and pinned[n] is None)]
        groups = dict(groups) if groups is not None else top_level_groups(n for n, _ in trainable)
        #: The group names, in the order of :meth:`squared_distances`' entries.
        self.groups: list[str] = list(dict.fromkeys(groups[n] for n, _ in trainable))
        self._device = free[0][1].device if free else torch.device("cpu")
        self._chunk = chunk
        self._scratch: dict[tuple[torch.dtype, torch.device], Tensor] = {}
        # (parameter, row-major reference, group, [(start, stop, pinned positions in the chunk)])
        self._entries: list[tuple[Tensor, Tensor, int, list[tuple[int, int, Optional[Tensor]]]]] = []
        with torch.no_grad():
            for name, parameter in free:
                reference = parameter.detach().clone(memory_format=torch.contiguous_format)
                chunks = _chunks(parameter.numel(), pinned.get(name), chunk)
                self._entries.append((parameter, reference, self.groups.index(groups[name]), chunks))
            #: Per group, the squared L2 norm of the free elements at the reference point.
            self.squared_reference = self._measure(subtract=False)
        #: How many elements are measured.
        self.elements = sum(
            stop - start - (0 if excluded is None else excluded.numel())
            for _, _, _, chunks in self._entries
            for start, stop, excluded in chunks
        )

    @torch.no_grad()
    def squared_distances(self) -> Tensor:
        """Per group, ``sum((w - w0) ** 2)`` over the free elements, as a device tensor."""
        return self._measure(subtract=True)

    def _measure(self, subtract: bool) -> Tensor:
        """Per group, the sum of squares of ``w - w0`` (``subtract``) or of ``w0``, free elements only."""
        sums: list[list[Tensor]] = [[] for _ in self.groups]
        for parameter, reference, group, chunks in self._entries:
            reference_flat = reference.view(-1)
            # A row-major flat view (a copy only for permuted layouts such as channels_last).
            values = parameter.detach().reshape(-1) if subtract else reference_flat
            for start, stop, excluded in chunks:
                buffer = self._buffer(parameter, stop - start)
                buffer.copy_(values[start:stop])
                if subtract:
                    buffer.sub_(reference_flat[start:stop])
                if excluded is not None:
                    buffer.index_fill_(0, excluded.long(), 0)
                sums[group].append(torch.dot(buffer, buffer).to(self._device))
        zero = torch.zeros((), device=self._device)
        return torch.stack([torch.stack(s).sum() if s else zero for s in sums]) if sums else zero.reshape(0)

    def _buffer(self, parameter: Tensor, size: int) -> Tensor:
        # float64 stays float64; every other dtype is measured in float32.
        dtype = torch.float64 if parameter.dtype == torch.float64 else torch.float32
        key = (dtype, parameter.device)
        buffer = self._scratch.get(key)
        if buffer is None or buffer.numel() < size:
            buffer = torch.empty(min(self._chunk, max(size, 1)), dtype=dtype, device=parameter.device)
            self._scratch[key] = buffer
        return buffer[:size]


def _chunks(numel: int, excluded: Optional[Tensor], chunk: int) -> list[tuple[int, int, Optional[Tensor]]]:
    """Split ``range(numel)`` into chunks, with the excluded (sorted) flat indices local to each."""
    out = []
    for start in range(0, numel, chunk):
        stop = min(start + chunk, numel)
        local = None
        if excluded is not None and excluded.numel():
            bounds = torch.tensor([start, stop], device=excluded.device)
            lo, hi = torch.searchsorted(excluded, bounds).tolist()
            if hi > lo:
                local = excluded[lo:hi] - start
        out.append((start, stop, local))
    return out


def pinned_indices(plan: PinPlan) -> dict[str, Optional[Tensor]]:
    """Per pinned parameter, the sorted flat indices any pin selects (at any time), ``None`` for all."""
    out: dict[str, Optional[Tensor]] = {}
    for name in plan.parameters:
        selections = [rp.selections[name] for rp in plan.pins if name in rp.selections]
        if any(s.index is None for s in selections):
            out[name] = None
        else:
            out[name] = torch.cat([s.index for s in selections]).unique()
    return out
