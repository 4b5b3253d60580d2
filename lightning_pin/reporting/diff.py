"""Compare two checkpoints: which tensors changed and by how many elements, and whether saved pins hold.

This answers "what did training actually change?". Freezing the wrong object shows up as a
"frozen" module whose elements all changed: a BERT fine-tuning user froze ``model.encoder``, but
the object being trained was a different wrapper, so nothing was frozen. The pins a
:class:`~lightning_pin.PinCallback` saved in a checkpoint are checked against the weights of the
other one, bit for bit. Nothing here imports Lightning: checkpoints are read with
``torch.load(weights_only=True)`` (:mod:`lightning_pin.core.io`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

from torch import Tensor

from lightning_pin.core import kinds

# The one tensor-file reader (weights_only=True), also offered here: `lightning-pin diff` reads with it.
from lightning_pin.core.io import TensorFileError, load_checkpoint, load_tensors
from lightning_pin.core.state import PinState, SavedSelection, find_pin_states
from lightning_pin.reporting import check as _check
from lightning_pin.core.kinds.value import differs as _differs
from lightning_pin.reporting.tables import Column, print_table

__all__ = [
    "CheckpointDiff",
    "PinCheck",
    "TensorDiff",
    "diff_checkpoints",
    "format_diff",
    "load_checkpoint",
    "print_diff",
    "read_checkpoint",
]


def _select(tensor: Tensor, index: Optional[Tensor]) -> Tensor:
    """The elements at flat row-major ``index`` (every element when ``index`` is None)."""
    flat = tensor.reshape(-1)
    return flat if index is None else flat.index_select(0, index.long())


@dataclasses.dataclass
class TensorDiff:
    """How one tensor differs between checkpoint A and checkpoint B."""

    name: str
    shape: tuple[int, ...]
    elements: int
    #: Elements whose value differs (bit for bit; NaN == NaN); None when the shapes differ.
    changed: Optional[int]
    #: Largest ``|b - a|`` over the elements (0 when nothing changed); None when the shapes differ.
    max_change: Optional[float]
    #: ``"both"``, ``"only A"`` or ``"only B"``.
    presence: str = "both"


@dataclasses.dataclass
class PinCheck:
    """Whether the elements one saved pin selects in one parameter hold their targets in checkpoint B."""

    state_key: str
    pin: int
    name: str
    elements: int
    #: Elements off target in B (bit for bit; stuck bits on the stored words, bounds by value);
    #: None when they cannot be compared (see ``problem``).
    off_target: Optional[int]
    #: Pinned elements whose value differs between A and B (None without A's tensor).
    changed: Optional[int]
    active: bool
    #: The name of what the pin holds (``"value"``, ``"stuck_bits"``, ``"bounds"``: its kind, see
    #: :mod:`lightning_pin.core.kinds`).
    kind: str = kinds.DEFAULT.kind
    #: Why ``off_target`` is None for an active pin.
    problem: Optional[str] = None
    #: The first off-target elements, at their coordinates in B's tensor, as ``lightning-pin check`` names them.
    shown: tuple[_check.OffTarget, ...] = ()
    #: dtype of B's tensor and of the targets (``"float32"``...), to print values to their last digit.
    dtype: Optional[str] = None
    target_dtype: Optional[str] = None

    @property
    def holds(self) -> bool:
        return self.off_target == 0


@dataclasses.dataclass
class CheckpointDiff:
    tensors: list[TensorDiff]
    pins: list[PinCheck]
    #: Where the pin state came from ("B", "A" or None when neither holds any).
    pins_from: Optional[str]

    @property
    def shared_tensors(self) -> list[TensorDiff]:
        """Tensors both checkpoints hold with the same shape: the ones that can be compared."""
        return [t for t in self.tensors if t.presence == "both" and t.changed is not None]

    def unrelated(self) -> Optional[str]:
        """Why A and B cannot be compared (they share no tensor), or None when they share one."""
        if self.shared_tensors:
            return None
        only_a = [t.name for t in self.tensors if t.presence == "only A"]
        only_b = [t.name for t in self.tensors if t.presence == "only B"]
        if not only_a and not only_b and not self.tensors:
            return "neither holds a tensor"
        if not any(t.presence == "both" for t in self.tensors):
            return (
                f"they share no tensor name (A: {len(only_a)} tensors, e.g. {only_a[:2]}; B: {len(only_b)}, "
                f"e.g. {only_b[:2]}): checkpoints of different models?"
            )
        return "every tensor name they share has a different shape in each: checkpoints of different models?"

    @property
    def changed_tensors(self) -> list[TensorDiff]:
        return [t for t in self.tensors if t.presence != "both" or t.changed != 0]

    @property
    def pins_hold(self) -> bool:
        """Every active saved pin is on target in B."""
        return all(c.holds for c in self.pins if c.active)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensors": [dataclasses.asdict(t) for t in self.tensors],
            "pins": [dict(dataclasses.asdict(c), holds=c.holds) for c in self.pins],
            "pins_from": self.pins_from,
            "pins_hold": self.pins_hold,
            "changed_elements": sum(t.changed or 0 for t in self.tensors),
            "elements": sum(t.elements for t in self.tensors),
        }


def read_checkpoint(path: Union[str, Path]) -> dict[str, Any]:
    """A file ``lightning-pin diff`` compares, read in every layout ``lightning-pin check`` reads, as a
    checkpoint dict with a ``"state_dict"``: a Lightning checkpoint, a bare state dict, or the
    plain-loop save ``{"model": model.state_dict(), "pins": handle.state_dict()}`` (its pin state kept).

    Raises:
        TensorFileError: as :func:`~lightning_pin.core.io.load_tensors`, or the file holds neither
            weights nor a pin state.
    """
    loaded = load_tensors(path)
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        return dict(loaded)
    weights = _check._weights_of(loaded)
    if not weights and not (isinstance(loaded, Mapping) and find_pin_states(loaded)):
        raise TensorFileError(
            f"{path} holds neither a Lightning checkpoint nor a state dict of tensors (nor "
            "{'model': model.state_dict(), 'pins': handle.state_dict()})", Path(path), "contents"
        )
    if loaded and all(isinstance(v, Tensor) for v in loaded.values()):
        return {"state_dict": weights}
    return {**loaded, "state_dict": weights}


def diff_checkpoints(
    a: Mapping[str, Any], b: Mapping[str, Any], names: tuple[str, str] = ("A", "B")
) -> CheckpointDiff:
    """Compare the ``state_dict`` of checkpoints ``a`` and ``b``, and check saved pins against ``b``.

    The pin state comes from ``b``'s callbacks (the state at the end of the compared interval),
    or from ``a``'s when ``b`` has none. ``names`` (e.g. the file paths) name the checkpoints in
    errors.

    Raises:
        KeyError: ``a`` or ``b`` has no ``"state_dict"`` (:func:`load_checkpoint` always gives one).
        CorruptPinState: a saved pin state is malformed; the message names it and its checkpoint.
    """
    weights_a, weights_b = a["state_dict"], b["state_dict"]
    tensors = []
    for name in list(weights_a) + [n for n in weights_b if n not in weights_a]:
        ta, tb = weights_a.get(name), weights_b.get(name)
        if not isinstance(ta if ta is not None else tb, Tensor):
            continue
        if ta is None or tb is None:
            present = ta if ta is not None else tb
            presence = "only A" if tb is None else "only B"
            tensors.append(TensorDiff(name, tuple(present.shape), present.numel(), None, None, presence))
            continue
        if ta.shape != tb.shape:
            tensors.append(TensorDiff(name, tuple(tb.shape), tb.numel(), None, None))
            continue
        differs = _differs(ta, tb)
        changed = int(differs.sum())
        max_change = 0.0
        if changed and ta.is_floating_point():
            max_change = float((tb.double() - ta.double()).abs()[differs].max())
        elif changed:
            max_change = float((tb.long() - ta.long()).abs()[differs].max())
        tensors.append(TensorDiff(name, tuple(ta.shape), ta.numel(), changed, max_change))
    states, source = _pin_states(b, names[1]), "B"
    if not states:
        states, source = _pin_states(a, names[0]), "A"
    checks = []
    for key, state in states.items():
        checks += _check_pins(key, state, weights_a, weights_b)
    return CheckpointDiff(tensors, checks, source if states else None)


def _pin_states(checkpoint: Mapping[str, Any], where: str) -> dict[str, PinState]:
    """The pin states saved in ``checkpoint``, read and validated by the one reader of the format."""
    return {
        key: PinState.from_dict(raw, where=f"the pin state {key!r} in {where}")
        for key, raw in find_pin_states(checkpoint).items()
    }


def _check_pins(
    key: str, state: PinState, weights_a: Mapping[str, Tensor], weights_b: Mapping[str, Tensor]
) -> list[PinCheck]:
    # Pins that were active at the last optimizer step must hold; others are reported, not judged.
    active = state.checked_pins
    checks = []
    for pin_id, selections in enumerate(state.pins):
        for name, entry in selections.items():
            index = entry.index
            tb, ta = weights_b.get(name), weights_a.get(name)
            reference = tb if tb is not None else ta
            elements = int(index.numel()) if index is not None else (reference.numel() if reference is not None else 0)
            changed = None
            if ta is not None and tb is not None and ta.shape == tb.shape:
                changed = int(_differs(_select(ta, index), _select(tb, index)).sum())
            kind = kinds.of(entry.kind)
            if kind.frozen and entry.target is None:
                # A pin with value=None that never activated has no target yet.
                checks.append(PinCheck(key, pin_id, name, elements, None, None, False))
                continue
            # The kind reads the stored tensor through its saved form (a learned scale beside it).
            entry = kind.stored_bind(entry, weights_b)
            off, problem = _stored_off(tb, entry)
            shown = _shown(tb, pin_id, entry) if off else ()
            told = kind.stored_dtype(entry)
            checks.append(PinCheck(key, pin_id, name, elements, off, changed, pin_id in active, entry.kind, problem,
                                   shown, _dtype(tb), None if told is None else _name(told)))
    return checks


def _shown(tensor: Optional[Tensor], pin_id: int, entry: SavedSelection) -> tuple[_check.OffTarget, ...]:
    """The first off-target elements of one saved selection in ``tensor``, found as ``check`` finds them."""
    if tensor is None:
        return ()
    try:
        return _check._compare(tensor, [(pin_id, entry)])[1]
    except (IndexError, RuntimeError, _check._Unreadable):
        return ()


def _dtype(tensor: Optional[Tensor]) -> Optional[str]:
    return None if tensor is None else _name(tensor.dtype)


def _name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _stored_off(tensor: Optional[Tensor], entry: SavedSelection) -> tuple[Optional[int], Optional[str]]:
    """Elements of one saved selection off target in ``tensor``, or None and why not comparable:
    the kind compares (see ``Kind.stored_off``)."""
    if tensor is None:
        return None, "parameter missing in B"
    whole = entry.target if entry.target is not None else next(iter(entry.payload.values()))
    if entry.index is None and tuple(whole.shape) != tuple(tensor.shape):
        return None, "parameter reshaped in B"
    try:
        off, _ = kinds.of(entry.kind).stored_off(tensor, [entry])
    except IndexError:
        return None, "parameter reshaped in B"
    except kinds.Unreadable as err:
        return None, f"stored as {tensor.dtype} in B: {err.what} of {err.word} cannot be read there"
    return int(off.sum()), None


# ----------------------------------------------------------------------------------------------
# Printing


def format_diff(diff: CheckpointDiff, changed_only: bool = False) -> list[tuple[str, ...]]:
    """Rows for the tensor table: name, shape, elements, changed, max |change|."""
    rows = []
    for t in diff.changed_tensors if changed_only else diff.tensors:
        shape = "x".join(map(str, t.shape)) or "scalar"
        if t.presence != "both":
            rows.append((t.name, shape, f"{t.elements:,}", t.presence, "-"))
        elif t.changed is None:
            rows.append((t.name, shape, f"{t.elements:,}", "shape differs", "-"))
        else:
            rows.append((t.name, shape, f"{t.elements:,}", f"{t.changed:,}", f"{t.max_change:.3g}"))
    return rows


def print_diff(diff: CheckpointDiff, a_name: str = "A", b_name: str = "B", changed_only: bool = False) -> None:
    """Print the tensor table and the pin checks (rich when installed, plain text otherwise)."""
    total = sum(t.elements for t in diff.tensors)
    changed = sum(t.changed or 0 for t in diff.tensors)
    summary = (
        f"{changed:,} of {total:,} elements changed, in {len(diff.changed_tensors)} of {len(diff.tensors)} tensors "
        f"({a_name} -> {b_name})"
    )
    rows = format_diff(diff, changed_only)
    styles = {True: "green", False: "red", None: None}
    numbers = [Column(header, justify="right") for header in ("elements", "changed", "max |B - A|")]
    print_table(
        [Column("tensor"), Column("shape"), *numbers],
        rows,
        f"{Path(a_name).name} -> {Path(b_name).name}",
        # Tensors that did not change fade, so the ones that did stand out.
        row_styles=["dim" if row[3] == "0" else None for row in rows],
        footer=[(summary, None)] + [(line, styles[ok]) for line, ok in _pin_lines(diff)],
    )


def _pin_lines(diff: CheckpointDiff) -> list[tuple[str, Optional[bool]]]:
    if diff.pins_from is None:
        return [("no PinCallback state in either checkpoint: no pins to check", None)]
    verdict = "all active pins hold in B" if diff.pins_hold else "some pins do NOT hold in B"
    lines: list[tuple[str, Optional[bool]]] = [(f"pins saved in {diff.pins_from}: {verdict}", diff.pins_hold)]
    state_key = None
    for c in diff.pins:
        if c.state_key != state_key:
            state_key = c.state_key
            lines.append((f"  {state_key}", None))
        kind = "" if kinds.of(c.kind).frozen else f", {kinds.of(c.kind).words}"
        where = f"    pin {c.pin} on {c.name} ({c.elements:,} elements{kind})"
        if not c.active:
            lines.append((f"{where}: not active at the last step, not checked", None))
        elif c.off_target is None:
            lines.append((f"{where}: {c.problem or 'parameter missing or reshaped in B'}", False))
        else:
            moved = "" if c.changed is None else f", {c.changed:,} changed since A"
            state = "holds" if c.holds else f"{c.off_target:,} element(s) OFF TARGET"
            lines.append((f"{where}: {state}{moved}", c.holds))
            lines += [(f"      {_show(e, c)}", False) for e in c.shown]
            if c.off_target and c.off_target > len(c.shown) and c.shown:
                lines.append((f"      ... and {c.off_target - len(c.shown):,} more", False))
    return lines


def _show(element: _check.OffTarget, c: PinCheck) -> str:
    """``[1, 2] = 0.25, target 0.5``: the shortest decimals that read back to the stored values (as ``check``)."""
    value = _check._shortest(element.value, c.dtype or c.target_dtype or "float64")
    if element.expected is not None:
        return f"{list(element.position)} = {value}, {element.expected}"
    return f"{list(element.position)} = {value}, target {_check._shortest(element.target, c.target_dtype or 'float64')}"
