"""The kinds of pin, one module each, and the registry the rest of the library iterates over.

A kind (:class:`~lightning_pin.core.kinds.base.Kind`) owns everything a pin of it means: the
:class:`~lightning_pin.Pin` fields it reads and their checks, their resolution on a parameter,
the restore kernel, drift and ``off`` (for ``verify()``, the monitor and ``lightning-pin check`` /
``diff`` on stored tensors), its saved form in the pin state, its conflicts with other pins on
one element, and its words in summaries and errors. The engine, the plan, the state, the
fault maps and the reporting ask the kind of a selection (:func:`of`) and never test a kind's
name.

A new kind is one module (a subclass of ``Kind``) plus one registration: a line in :data:`KINDS`
for the library's own, :func:`register` for a kind defined elsewhere (its fields then travel in
``Pin(..., kind_args={...})``).

Kinds that act on module *outputs* in every forward rather than on weights after the step (stuck
neurons, :mod:`~lightning_pin.core.kinds.neuron`) are listed in :data:`OUTPUT_KINDS`: each names
its spec class and builds its runtime on a model; the doors split a pin list with :func:`split`
and never name an output kind.

Example::

    >>> from lightning_pin import Pin
    >>> for_pin(Pin("fc.weight", stuck_at_one=0x40000000)).words
    'stuck bits'
    >>> of("bounds").payload_fields
    ('low', 'high')
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_pin.core import registry
from lightning_pin.core.errors import PinError
# What a kind defined outside the library builds on (see docs/how-to/new-kind.md): the base class,
# the per-element helpers the library's kinds use, and the target a kernel writes.
from lightning_pin.core.kinds._common import (
    coords, first, merge_paired, per_element, shared_positions, sort_with_index,
)
from lightning_pin.core.kinds.base import Expected, Kind, Unreadable, pin_field
from lightning_pin.core.kinds.interval import Interval
from lightning_pin.core.kinds.neuron import NeuronKind
from lightning_pin.core.kinds.quant_code import QuantCode, QuantizedCode
from lightning_pin.core.kinds.stuck_bits import StuckBits
from lightning_pin.core.kinds.value import ExactValue
from lightning_pin.core.registry import check_spec, for_pin, payload_field
from lightning_pin.core.sharding import Target
from lightning_pin.core.spec import Pin

#: Every kind, in the order a pin's fields are checked and its kind is found; the first is the
#: default (a pin with none of the others' fields). A kind that reads another's fields and more
#: (stuck bits of a quantized code: the masks and ``code=``) comes before it, so it claims its pins.
KINDS: tuple[type[Kind], ...] = (
    ExactValue,
    QuantizedCode,  # before StuckBits: a pin with code= and stuck bits is a quantized code's
    StuckBits,
    Interval,
)
#: Kinds that act on module outputs in the forward: each has ``kind``, ``spec`` (its pin class),
#: ``config_key`` (the key a mapping of it carries instead of ``params``) and ``hold(pins, module)``
#: (its runtime: ``attach()``, ``set_step()``, ``state_dict()`` / ``load_state_dict()``, ``summary()``).
OUTPUT_KINDS: tuple[Any, ...] = (
    NeuronKind,
)
#: The kinds by name.
BY_NAME: dict[str, type[Kind]] = {kind.kind: kind for kind in KINDS}
#: The kind of a pin that gives none of the other kinds' fields.
DEFAULT = KINDS[0]
# What the spec and the selection types ask about the kinds (a pin's kind, its field checks, a
# payload field by name) they ask the registry, below them: filled here, on import.
#: Pin fields a kind turns from a mapping (Hydra / YAML) into its own type.
_FIELD_TYPES = {"code": QuantCode.from_config}
registry.fill(KINDS, field_types=_FIELD_TYPES)
#: Pin fields of the kinds added after the first release: fingerprinted only when given, so pins
#: that do not use them keep the fingerprints (and checkpoint state keys) of earlier releases.
LATER_FIELDS = registry.later_fields()


def output_kind(pin: Any) -> Any:
    """The output kind whose spec ``pin`` is (or whose ``config_key`` a mapping without ``params``
    carries), else None (a weight pin)."""
    for kind in OUTPUT_KINDS:
        if isinstance(pin, kind.spec):
            return kind
        if isinstance(pin, Mapping) and kind.config_key in pin and "params" not in pin:
            return kind
    return None


def split(pins: Any) -> tuple[list[Any], list[tuple[Any, list[Any]]]]:
    """``pins`` as the weight pins and, per output kind that has any, its pins (in order)."""
    weights: list[Any] = []
    outputs: dict[Any, list[Any]] = {}
    for pin in pins:
        kind = output_kind(pin)
        if kind is None:
            weights.append(pin)
        else:
            outputs.setdefault(kind, []).append(pin)
    return weights, [(kind, outputs[kind]) for kind in OUTPUT_KINDS if kind in outputs]


def of(name: str) -> type[Kind]:
    """The kind called ``name`` (a selection's, a saved selection's ``kind``)."""
    return BY_NAME[name]


def register(kind: type[Kind]) -> type[Kind]:
    """Add ``kind`` (a subclass of :class:`Kind` defined outside the library) to the registry: pins
    that give its :attr:`~Kind.pin_fields` in ``kind_args`` are of it from then on (it comes after
    the library's kinds). Returns ``kind``, so it can decorate the class.

    Raises:
        PinError: ``kind`` is not a Kind, or its name or a field is taken.
    """
    global KINDS, LATER_FIELDS
    if not (isinstance(kind, type) and issubclass(kind, Kind)):
        raise PinError(f"register: {kind!r} is not a subclass of lightning_pin.core.kinds.Kind")
    if BY_NAME.get(kind.kind, kind) is not kind:
        raise PinError(f"register: the kind name {kind.kind!r} is taken by {BY_NAME[kind.kind].__name__}")
    taken = {f for each in KINDS if each is not kind for f in each.pin_fields} | set(Pin.__dataclass_fields__)
    if not kind.pin_fields or taken & set(kind.pin_fields):
        raise PinError(f"register: {kind.__name__} needs pin fields of its own (given {kind.pin_fields}; taken: "
                       f"{sorted(taken & set(kind.pin_fields))})")
    if kind not in KINDS:
        KINDS = (*KINDS, kind)
        BY_NAME[kind.kind] = kind
        registry.fill(KINDS, field_types=_FIELD_TYPES)
        LATER_FIELDS = registry.later_fields()
    return kind


def check_conflict(first: Pin, a: Any, second: Pin, b: Any, name: str) -> None:
    """Two pins on one parameter at overlapping steps: the same kind decides what its pins may
    share; two kinds may share no element (each would undo the other).

    Raises:
        PinError: naming both pins, the parameter and an element.
    """
    kind_a, kind_b = of(a.kind), of(b.kind)
    if kind_a is kind_b:
        kind_a.check_overlap(first, a, second, b, name)
        return
    a_pos, _ = shared_positions(a.index, b.index, a.parameter.numel())
    if a_pos.numel() == 0:
        return
    flat = a_pos if a.index is None else a.index.cpu().long()[a_pos]
    coords = tuple(int(c) for c in torch.unravel_index(torch.tensor(int(flat[0])), tuple(a.parameter.shape)))
    reason = next((kind.mixed_reason for kind in KINDS if kind in (kind_a, kind_b) and kind.mixed_reason),
                  "each would undo the other; ")
    raise PinError(
        f"{first!r} and {second!r} put {kind_a.words} and {kind_b.words} on {a_pos.numel()} element(s) of {name!r} at "
        f"overlapping steps (e.g. {coords}): " + reason + "select disjoint elements or separate their step windows"
    )


__all__ = [
    "BY_NAME", "DEFAULT", "KINDS", "LATER_FIELDS", "OUTPUT_KINDS", "ExactValue", "Interval", "Kind",
    "NeuronKind", "QuantCode", "QuantizedCode", "StuckBits", "Unreadable",
    "check_conflict", "check_spec", "for_pin", "of", "output_kind", "payload_field", "register", "split",
    # for kinds defined outside the library
    "Expected", "Target", "coords", "first", "merge_paired", "per_element", "pin_field", "shared_positions",
    "sort_with_index",
]
