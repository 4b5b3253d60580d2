"""Fault-aware mapping: permute hidden units so the weights a chip's faulty cells would damage least sit on them.

A chip's stuck cells sit at fixed addresses; which weight goes where is the deployer's choice.
Permuting a layer's output channels, and its consumers' input channels alike, keeps the function
and moves weights to other cells. :func:`remap` chooses the permutations (one exact linear
assignment per group of units, round after round) and returns a :class:`FaultMapping` that can be
undone bit for bit, saved and applied again to a fresh copy of the model.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn

from lightning_pin.core import kinds
from lightning_pin.core.errors import PinError
from lightning_pin.core.plan import resolve
from lightning_pin.core.spec import Pin
from lightning_pin.faults._common import FaultPins, exact_name
from lightning_pin.faults.remap_spec import Member, Spec, check_spec, remap_spec

COSTS = ("l2", "l1", "count")


def _tensors(model: nn.Module) -> dict[str, Tensor]:
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return named


def _index(perm: Tensor, block: int) -> Tensor:
    """The indices along an axis that put unit ``perm[j]``'s block at slot ``j``."""
    return (perm.reshape(-1, 1) * block + torch.arange(block)).reshape(-1)


def _gather(tensor: Tensor, axis: int, perm: Tensor, block: int) -> Tensor:
    return tensor.index_select(axis, _index(perm, block).to(tensor.device))


class FaultMapping:
    """Permutations of hidden units chosen by :func:`remap`: what moved, what it cost, and how to redo or undo it.

    Attributes:
        perms: Group name -> int64 tensor: slot ``j`` holds unit ``perms[group][j]``.
        spec: Group name -> ``[(tensor name, axis, block)]``: what each permutation moves.
        faults: The pins to train with: the fault pins given, per-channel code scales moved with their channels.
        cost_before, cost_after: The damage summed over every faulty cell, unmapped and mapped (the cost's units).
        damaged_before, damaged_after: Per parameter name, how many weights its faults change.
        cost: ``"l2"``, ``"l1"`` or ``"count"``.
        rounds: Rounds of assignments run.
        seconds: Time spent choosing and applying the mapping.

    Example::

        >>> import torch
        >>> from lightning_pin.faults import FaultMapping
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
        >>> mapping = FaultMapping({"0": torch.tensor([2, 0, 1])}, {"0": [("0.weight", 0, 1), ("0.bias", 0, 1),
        ...                                                              ("2.weight", 1, 1)]})
        >>> before = [p.clone() for p in net.parameters()]
        >>> mapping.apply(net); mapping.undo(net)
        >>> all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
        True
    """

    def __init__(self, perms: Mapping[str, Tensor], spec: Mapping[str, Sequence[Member]], *,
                 faults: Sequence[Any] = (), cost: str = "l2", cost_before: float = 0.0, cost_after: float = 0.0,
                 damaged_before: Optional[Mapping[str, int]] = None, damaged_after: Optional[Mapping[str, int]] = None,
                 rounds: int = 0, seconds: float = 0.0) -> None:
        self.perms = {g: torch.as_tensor(p, dtype=torch.int64).cpu().clone() for g, p in perms.items()}
        self.spec: Spec = {g: [(str(n), int(a), int(b)) for n, a, b in m] for g, m in spec.items()}
        for group, perm in self.perms.items():
            if group not in self.spec:
                raise PinError(f"FaultMapping: permutation of group {group!r}, which the spec lacks")
            if perm.ndim != 1 or not torch.equal(perm.sort().values, torch.arange(perm.numel())):
                raise PinError(f"FaultMapping: {group!r} is not a permutation of 0..{perm.numel() - 1}")
        self.faults = list(faults)
        self.cost = cost
        self.cost_before, self.cost_after = float(cost_before), float(cost_after)
        self.damaged_before = dict(damaged_before or {})
        self.damaged_after = dict(damaged_after or {})
        self.rounds, self.seconds = int(rounds), float(seconds)

    @property
    def summary(self) -> str:
        """A few lines: groups moved, damage before and after, weights damaged per parameter."""
        moved = sum(int((p != torch.arange(p.numel())).sum()) for p in self.perms.values())
        ratio = self.cost_after / self.cost_before if self.cost_before > 0 else 1.0
        lines = [f"fault-aware mapping: {len(self.perms)} group(s), {moved} unit(s) moved, {self.rounds} round(s), "
                 f"{self.seconds:.2f} s",
                 f"  {self.cost} damage {self.cost_before:.6g} -> {self.cost_after:.6g} ({ratio:.3f} of unmapped)"]
        for name in sorted(set(self.damaged_before) | set(self.damaged_after)):
            lines.append(f"  {name}: {self.damaged_before.get(name, 0):,} -> {self.damaged_after.get(name, 0):,} "
                         "weights changed by faults")
        return "\n".join(lines)

    def _check(self, model: nn.Module, what: str) -> dict[str, Tensor]:
        tensors = _tensors(model)
        try:
            sizes = check_spec(self.spec, tensors)
        except PinError as err:
            raise PinError(f"FaultMapping.{what}: {err}") from err
        for group, perm in self.perms.items():
            if sizes[group] != perm.numel():
                raise PinError(f"FaultMapping.{what}: group {group!r} has {sizes[group]} units in this model, the "
                               f"mapping {perm.numel()}")
        return tensors

    def _move(self, model: nn.Module, inverse: bool, what: str) -> None:
        tensors = self._check(model, what)
        groups = list(self.perms.items())
        if inverse:
            groups = groups[::-1]
        done: set[tuple[int, int]] = set()  # tied weights: one tensor under two names moves once
        with torch.no_grad():
            for group, perm in groups:
                perm = perm.argsort() if inverse else perm
                for name, axis, block in self.spec[group]:
                    tensor = tensors[name]
                    key = (id(tensor), axis % tensor.ndim)
                    if key in done:
                        continue
                    done.add(key)
                    tensor.copy_(_gather(tensor, axis, perm, block))

    def apply(self, model: nn.Module) -> None:
        """Permute ``model``'s tensors as mapped (exact gathers).

        Raises:
            PinError: ``model`` lacks a tensor of the spec or has other sizes (nothing is changed then).
        """
        self._move(model, False, "apply")

    def undo(self, model: nn.Module) -> None:
        """Put ``model``'s tensors back in their unmapped order, bit for bit.

        Raises:
            PinError: ``model`` lacks a tensor of the spec or has other sizes (nothing is changed then).
        """
        self._move(model, True, "undo")

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors, lists and numbers (``torch.load(..., weights_only=True)`` reads them back)."""
        return {
            "perms": {g: p.clone() for g, p in self.perms.items()},
            "spec": {g: [list(m) for m in members] for g, members in self.spec.items()},
            "cost": self.cost, "cost_before": self.cost_before, "cost_after": self.cost_after,
            "damaged_before": dict(self.damaged_before), "damaged_after": dict(self.damaged_after),
            "rounds": self.rounds, "seconds": self.seconds,
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> FaultMapping:
        """The mapping :meth:`state_dict` saved (its ``faults`` are not saved: draw or load them again).

        Raises:
            PinError: ``state`` is not what :meth:`state_dict` writes.
        """
        if not isinstance(state, Mapping) or not {"perms", "spec"} <= set(state):
            raise PinError("FaultMapping.from_state_dict: expected the dict FaultMapping.state_dict() returns")
        return cls(state["perms"], state["spec"], cost=state.get("cost", "l2"),
                   cost_before=state.get("cost_before", 0.0), cost_after=state.get("cost_after", 0.0),
                   damaged_before=state.get("damaged_before"), damaged_after=state.get("damaged_after"),
                   rounds=state.get("rounds", 0), seconds=state.get("seconds", 0.0))

    def __repr__(self) -> str:
        return f"FaultMapping({len(self.perms)} groups, {self.cost} {self.cost_before:.4g} -> {self.cost_after:.4g})"


# ------------------------------------------------------------------------------------------------
# The faults: what each faulty cell makes of the weight it holds (the kinds' own restore math)


@dataclasses.dataclass
class _Cells:
    """The faulty cells of one parameter under one fault pin."""

    name: str
    coords: Tensor  # (K, ndim) int64, physical addresses
    force: Callable[[Tensor, Optional[Tensor]], Tensor]  # (m, K) weights, code scale or None -> (m, K) held
    scale_axis: Optional[int] = None  # a per-channel code scale's axis (the scale moves with its channel)
    scale: Optional[Tensor] = None


def _cells(faults: Sequence[Any], model: nn.Module) -> list[_Cells]:
    pins = list(faults)
    for pin in pins:
        if not isinstance(pin, Pin):
            raise PinError(f"remap: faults must be Pins with a target per element, got {type(pin).__name__}")
        if kinds.for_pin(pin) is kinds.DEFAULT and pin.value is None:
            raise PinError(f"remap: {pin!r} has no target (value=None captures whatever the weight holds); a fault "
                           "pin gives the value, stuck bits or bounds each faulty cell forces")
        if pin.when is not None or pin.start_step != 0 or pin.stop_step is not None:
            raise PinError(f"remap: {pin!r} is not present at every step; map permanent faults only")
    cells: list[_Cells] = []
    for resolved in resolve(pins, model, warn=lambda message: None).pins:
        for name, selection in resolved.selections.items():
            parameter = selection.parameter
            index = (torch.arange(parameter.numel()) if selection.index is None
                     else selection.index.detach().cpu().long())
            coords = torch.stack(torch.unravel_index(index, tuple(parameter.shape)), dim=1)
            kind = kinds.of(selection.kind)
            cells.append(_force(resolved.pin, kind, selection, name, coords))
    return cells


def _force(pin: Pin, kind: type, selection: Any, name: str, coords: Tensor) -> _Cells:
    parameter = selection.parameter
    dtype = parameter.dtype
    from lightning_pin.core.state import BITS_DTYPES

    if kind is kinds.QuantizedCode:
        kernel = kind.merge(name, parameter, [selection])
        learned = "scale" in selection.context  # the module's own tensor: read where it is
        channels = kernel.scale.numel() > 1
        axis = pin.code.axis % parameter.ndim if channels and pin.code.axis is not None else None

        def force_code(values: Tensor, scale_now: Optional[Tensor]) -> Tensor:
            if scale_now is not None:
                kernel.scale = scale_now
            return torch.stack([kernel._held(row.clone(), row.device) for row in values])

        scale = kernel.scale.detach().clone() if channels and not learned else None
        return _Cells(name, coords, force_code, axis, scale)
    word = BITS_DTYPES.get(dtype)
    rewrite = kind.word_rewrite(selection, word, coords.shape[0]) if word is not None else None
    if rewrite is not None:
        def force_words(values: Tensor, _: Optional[Tensor]) -> Tensor:
            return torch.stack([rewrite(row.contiguous().view(word)).view(dtype) for row in values])

        return _Cells(name, coords, force_words)
    # A kind that fixes no word (bounds) projects: its restore kernel on a scratch copy.
    kernel = kind.merge(name, parameter, [selection])
    flat_index = selection.index

    def force_kernel(values: Tensor, _: Optional[Tensor]) -> Tensor:
        rows = []
        for row in values:
            scratch = parameter.detach().clone()
            flat = scratch.view(-1)
            if flat_index is None:
                flat.copy_(row)
            else:
                flat[flat_index.long()] = row
            kernel.apply(scratch)
            rows.append(flat.clone() if flat_index is None else flat[flat_index.long()].clone())
        return torch.stack(rows)

    return _Cells(name, coords, force_kernel)


def _damage(values: Tensor, held: Tensor, cost: str) -> Tensor:
    """Per cell, float64: what the fault does to the weight it holds."""
    if cost == "count":
        from lightning_pin.core.state import BITS_DTYPES

        word = BITS_DTYPES.get(values.dtype)
        if word is None:
            return (held != values).double()
        return (held.contiguous().view(word) != values.contiguous().view(word)).double()
    change = held.double() - values.double()
    big = torch.finfo(values.dtype).max if values.is_floating_point() else 2.0 ** 63
    change = torch.where(torch.isfinite(change), change, torch.full_like(change, big))
    return change.abs() if cost == "l1" else change.square()


# ------------------------------------------------------------------------------------------------
# The search


class _Search:
    def __init__(self, cells: list[_Cells], tensors: dict[str, Tensor], spec: Spec, cost: str,
                 importance: Mapping[str, float]) -> None:
        self.cells, self.spec, self.cost = cells, spec, cost
        self.importance = importance
        self.work = {name: tensors[name].detach().cpu().clone() for _, ms in spec.items() for name, _, _ in ms}
        for cell in cells:
            self.work.setdefault(cell.name, tensors[cell.name].detach().cpu().clone())
        self.perms = {g: torch.arange(check_spec({g: ms}, tensors)[g]) for g, ms in spec.items()}
        self.scales = {id(c): c.scale for c in cells}
        #: Where each per-channel code scale's entries now come from (the scale moves with its channel).
        self.scale_perms = {id(c): torch.arange(c.scale.numel()) for c in cells if c.scale is not None}
        for cell in cells:
            if cell.scale_axis is not None and cell.scale is None:
                for group, members in spec.items():
                    if (cell.name, cell.scale_axis) in {(n, a % self.work[n].ndim) for n, a, _ in members}:
                        raise PinError(f"remap: {cell.name!r} is stored in codes with a learned per-channel scale "
                                       f"along axis {cell.scale_axis}, which group {group!r} permutes; exclude "
                                       f"{group!r} or map before adding the learned scale")

    def _flat(self, name: str, coords: Tensor) -> Tensor:
        strides = torch.tensor(self.work[name].stride(), dtype=torch.int64)
        return (coords * strides).sum(dim=1)

    def damage(self, cell: _Cells, cost: Optional[str] = None) -> Tensor:
        values = self.work[cell.name].reshape(-1)[self._flat(cell.name, cell.coords)].unsqueeze(0)
        held = cell.force(values, self.scales[id(cell)])
        return _damage(values, held, cost or self.cost)[0]

    def total(self) -> float:
        return float(sum(float(self.damage(c).sum()) * self.importance.get(c.name, 1.0) for c in self.cells))

    def matrix(self, group: str) -> Tensor:
        n = self.perms[group].numel()
        costs = torch.zeros(n, n, dtype=torch.float64)
        for name, axis, block in self.spec[group]:
            axis %= self.work[name].ndim
            for cell in self.cells:
                if cell.name != name:
                    continue
                slot, offset = cell.coords[:, axis] // block, cell.coords[:, axis] % block
                rows = []
                for unit in range(n):
                    moved = cell.coords.clone()
                    moved[:, axis] = unit * block + offset
                    rows.append(self.work[name].reshape(-1)[self._flat(name, moved)])
                values = torch.stack(rows)
                scale = self.scales[id(cell)]
                if scale is not None and cell.scale_axis == axis:
                    held = torch.cat([cell.force(values[u:u + 1], scale[u:u + 1].expand_as(scale))
                                      for u in range(n)])
                else:
                    held = cell.force(values, scale)
                damage = _damage(values, held, self.cost) * self.importance.get(name, 1.0)
                costs.index_add_(1, slot, damage)
        return costs

    def move(self, group: str, rel: Tensor) -> None:
        for name, axis, block in self.spec[group]:
            self.work[name] = _gather(self.work[name], axis, rel, block)
            for cell in self.cells:
                if cell.name == name and cell.scale_axis == axis % self.work[name].ndim \
                        and self.scales[id(cell)] is not None:
                    self.scales[id(cell)] = self.scales[id(cell)][rel]
                    self.scale_perms[id(cell)] = self.scale_perms[id(cell)][rel]
        self.perms[group] = self.perms[group][rel]


def remap(
    model: nn.Module,
    faults: Sequence[Any],
    example_input: Any,
    *,
    cost: str = "l2",
    importance: Optional[Mapping[str, float]] = None,
    exclude: Union[str, Sequence[str]] = (),
    spec: Optional[Mapping[str, Sequence[Member]]] = None,
    max_rounds: int = 50,
    seed: int = 0,
) -> FaultMapping:
    """Permute ``model``'s hidden units in place so its ``faults`` damage its weights least; keep the function.

    ``faults`` are pins with a target per element (values, stuck bits, ``QuantCode`` stuck bits, bounds) whose
    coordinates are *physical addresses*: they never change. After the mapping, the weight at each address is
    the one mapped there, and the same pins hit the same cells (``mapping.faults``: the pins to train with; a
    per-channel code scale moves with its channel). Unit ``i`` at slot ``j`` costs the damage the faulty cells
    of slot ``j`` do to unit ``i``'s weights: ``"l2"`` (squared change), ``"l1"`` or ``"count"`` (weights
    changed), times ``importance[name]``. One exact ``scipy.optimize.linear_sum_assignment`` per group, the
    others fixed, in a seeded order, round after round until a round gains nothing or ``max_rounds``. It starts
    at the identity and keeps only what lowers the total, so the cost never exceeds the unmapped one.

    The groups come from :func:`remap_spec` (``torch.fx``, shapes from ``example_input``) unless ``spec`` is
    given. Outputs are compared in eval mode before and after within ``torch.testing.assert_close``'s
    defaults (a consumer sums its channels in another order); on a mismatch the model is restored and a
    ``PinError`` raised. Map before the optimizer and the pins exist.

    Example::

        >>> import torch
        >>> from lightning_pin.faults import cell_faults, remap
        >>> _ = torch.manual_seed(0)
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        >>> faults = cell_faults(net, "0.weight", rate=0.3, sa1_fraction=0.0)
        >>> mapping = remap(net, faults, torch.randn(2, 4))
        >>> mapping.cost_after <= mapping.cost_before
        True

    Raises:
        PinError: a fault without a target, a model pins already hold, an untraceable model without
            ``spec=``, an op that would see permuted channels out of order (naming the fx node), a bad
            ``cost`` / ``importance`` / ``max_rounds``, or outputs that change. Nothing is changed then.
    """
    started = time.perf_counter()
    if cost not in COSTS:
        raise PinError(f"remap: cost must be one of {', '.join(map(repr, COSTS))}, got {cost!r}")
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 0:
        raise PinError(f"remap: max_rounds must be an integer >= 0, got {max_rounds!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise PinError(f"remap: seed must be an integer >= 0, got {seed!r}")
    _refuse_held(model)
    tensors = _tensors(model)
    importance = dict(importance or {})
    for name, weight in importance.items():
        if name not in tensors:
            raise PinError(f"remap: importance names {name!r}, which the model lacks")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
            raise PinError(f"remap: importance[{name!r}] must be a number >= 0, got {weight!r}")
    if spec is None:
        spec = remap_spec(model, example_input, exclude=exclude)
    else:
        patterns = [exclude] if isinstance(exclude, str) else list(exclude)
        spec = {g: [tuple(m) for m in ms] for g, ms in spec.items()
                if not any(fnmatch.fnmatchcase(g, p) for p in patterns)}
        check_spec(spec, tensors)
    cells = _cells(faults, model)
    search = _Search(cells, tensors, dict(spec), cost, importance)

    def damaged() -> dict[str, int]:
        counts: dict[str, int] = {}
        for cell in cells:
            counts[cell.name] = counts.get(cell.name, 0) + int(search.damage(cell, "count").sum())
        return counts

    before, damaged_before = search.total(), damaged()
    current = before
    order = list(search.perms)
    generator = torch.Generator().manual_seed(seed)
    rounds = 0
    if order and cells:
        from scipy.optimize import linear_sum_assignment  # only here: scipy is an app extra

        for rounds in range(1, max_rounds + 1):
            gained = False
            for at in torch.randperm(len(order), generator=generator).tolist():
                group = order[at]
                matrix = search.matrix(group)
                rows, cols = linear_sum_assignment(matrix.numpy())
                if float(matrix[torch.as_tensor(rows), torch.as_tensor(cols)].sum()) >= float(matrix.trace()):
                    continue
                rel = torch.empty(len(rows), dtype=torch.int64)
                rel[torch.as_tensor(cols)] = torch.as_tensor(rows, dtype=torch.int64)  # slot col holds unit row
                saved = (dict(search.work), dict(search.scales), search.perms[group], dict(search.scale_perms))
                search.move(group, rel)
                total = search.total()
                if total < current:
                    current, gained = total, True
                else:  # the assignment's optimum did not lower the total (a group met twice): keep the old
                    search.work, search.scales = saved[0], saved[1]
                    search.perms[group], search.scale_perms = saved[2], saved[3]
            if not gained:
                break
    perms = {g: p for g, p in search.perms.items() if not torch.equal(p, torch.arange(p.numel()))}
    mapping = FaultMapping(perms, {g: spec[g] for g in perms}, faults=_moved_faults(faults, cells, search),
                           cost=cost, cost_before=before, cost_after=current, damaged_before=damaged_before,
                           damaged_after=damaged(), rounds=rounds)
    _apply_checked(model, mapping, example_input)
    mapping.seconds = time.perf_counter() - started
    return mapping


def _refuse_held(model: nn.Module) -> None:
    from lightning_pin.core.driver import LIVE
    from lightning_pin.core.handle import PinHandle

    mine = {id(p) for p in model.parameters()}
    for module, holders in LIVE.items():
        if any(isinstance(h, PinHandle) for h in holders) and mine & {id(p) for p in module.parameters()}:
            raise PinError("remap: pins already hold this model (a live pin() handle): map before pinning and "
                           "before the optimizer exists, then pin mapping.faults")
    # A PinCallback of the model's trainer holds it while its engine is set up (read without importing Lightning).
    trainer = getattr(model, "_trainer", None)
    for callback in getattr(trainer, "callbacks", None) or ():
        plan = getattr(getattr(callback, "engine", None), "plan", None)
        held = getattr(plan, "parameters", None)
        if isinstance(held, Mapping) and mine & {id(p) for p in held.values()}:
            raise PinError("remap: a PinCallback of this model's trainer holds it: map before fitting, then give "
                           "the callback mapping.faults")


def _moved_faults(faults: Sequence[Any], cells: list[_Cells], search: _Search) -> list[Any]:
    """The fault pins, a per-channel code scale permuted with its channel."""
    moved: list[Any] = []
    scaled = {c.name: search.scale_perms[id(c)] for c in cells if c.scale is not None}
    for pin in faults:
        code = getattr(pin, "code", None)
        name = exact_name(pin.params) if isinstance(pin.params, str) else None
        if code is not None and isinstance(code.scale, Tensor) and name is not None:
            order = scaled.get(name)
            if order is not None and code.scale.numel() == order.numel():
                pin = dataclasses.replace(pin, code=dataclasses.replace(code, scale=code.scale[order]))
        moved.append(pin)
    if isinstance(faults, FaultPins):
        return FaultPins(moved, faults.summary, faults.faulty, faults.redrawn, faults.skipped, faults.shapes)
    return moved


def _outputs(model: nn.Module, example_input: Any) -> Any:
    args = example_input if isinstance(example_input, tuple) else (example_input,)
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            return model(*args)
    finally:
        model.train(was)


def _apply_checked(model: nn.Module, mapping: FaultMapping, example_input: Any) -> None:
    if not mapping.perms:
        return
    expected = _outputs(model, example_input)
    mapping.apply(model)
    try:
        torch.testing.assert_close(_outputs(model, example_input), expected)
    except AssertionError as err:
        mapping.undo(model)
        raise PinError(f"remap: the mapped model's outputs differ from the unmapped ones, so the spec misses "
                       f"something the permutation moves (the model is restored): {err}") from None
    except BaseException:
        mapping.undo(model)  # the mapped model's forward raised: nothing is left changed
        raise


__all__ = ["COSTS", "FaultMapping", "remap"]
