"""The kind registry: what the spec and the selection types ask about the kinds, without importing them.

The kinds (:mod:`lightning_pin.core.kinds`) build :class:`~lightning_pin.Pin` objects and saved
selections, so they sit above :mod:`~lightning_pin.core.spec` and :mod:`~lightning_pin.core.selection`;
those in turn need the kinds to check a pin's fields at construction, to name a pin's kind and to
read a selection's payload fields by name. They ask this module, which the kinds fill once when
:mod:`lightning_pin.core.kinds` is imported (``lightning_pin.core``'s ``__init__`` imports it, so
the registry is filled before any ``Pin`` can be built). Imports go one way: this module imports
no other module of lightning_pin but its errors.

Example::

    >>> from lightning_pin import Pin
    >>> for_pin(Pin("fc.weight", bounds=(0.0, 1.0))).kind
    'bounds'
    >>> DEFAULT_KIND in [kind.kind for kind in kinds()]
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_pin.core.errors import PinError

__all__ = ["DEFAULT_KIND", "check_spec", "convert_fields", "fill", "for_pin", "kinds", "later_fields", "payload_field"]

#: The name of the default kind (a pin with none of the other kinds' fields). A constant of the
#: saved format too: a version 1-2 pin state holds value pins only and reads as this kind.
DEFAULT_KIND = "value"

#: The weight kinds in registry order (the default first), and the Pin fields a kind turns from
#: a mapping (Hydra / YAML) into its own type: filled by :func:`fill`.
_KINDS: tuple[Any, ...] = ()
_FIELD_TYPES: dict[str, Callable[[Any], Any]] = {}


def fill(weight_kinds: Sequence[Any], field_types: Mapping[str, Callable[[Any], Any]]) -> None:
    """Register the weight kinds (in the order a pin's fields are checked and its kind found; the
    first, named :data:`DEFAULT_KIND`, is the default) and the Pin fields whose mapping form a kind
    turns into its own type (``code``: a :class:`~lightning_pin.QuantCode`). Called by
    :mod:`lightning_pin.core.kinds` when it is imported; a second call replaces the first."""
    global _KINDS
    if not weight_kinds or weight_kinds[0].kind != DEFAULT_KIND:
        raise ValueError(f"the first registered kind must be the default one, {DEFAULT_KIND!r}")
    _KINDS = tuple(weight_kinds)
    _FIELD_TYPES.clear()
    _FIELD_TYPES.update(field_types)


def kinds() -> tuple[Any, ...]:
    """The registered weight kinds, the default first.

    Raises:
        RuntimeError: none is registered yet (``lightning_pin.core.kinds`` was not imported: a
            Pin built while the kinds themselves are being imported), rather than skipping checks.
    """
    if not _KINDS:
        raise RuntimeError("no pin kind is registered: import lightning_pin.core.kinds before building a Pin")
    return _KINDS


def for_pin(pin: Any) -> Any:
    """The kind of ``pin``: the first kind (after the default) whose fields it gives."""
    registered = _KINDS or kinds()  # one call, not two: Pin.kind may be asked often
    return next((kind for kind in registered[1:] if kind.claims(pin)), registered[0])


def check_spec(pin: Any) -> None:
    """Every kind's checks of ``pin``'s fields, in registry order (at construction).

    Raises:
        PinError: ``kind_args`` that is not a dict of the fields of registered kinds, or what a kind refuses.
    """
    registered = _KINDS or kinds()
    if pin.kind_args is not None:
        own = sorted(f for kind in registered for f in kind.pin_fields if f not in type(pin).__dataclass_fields__)
        if not isinstance(pin.kind_args, Mapping) or any(key not in own for key in pin.kind_args):
            raise PinError(f"{pin!r}: kind_args must be a dict of the fields of registered kinds ({own or 'none is'}"
                           f" registered: lightning_pin.core.kinds.register), got {pin.kind_args!r}")
    for kind in registered:
        kind.check_spec(pin)


def later_fields() -> tuple[str, ...]:
    """Pin fields of the kinds added after the first release: fingerprinted only when given, so pins
    that do not use them keep the fingerprints (and checkpoint state keys) of earlier releases."""
    return tuple(field for kind in (_KINDS or kinds())[1:] for field in kind.pin_fields)


def convert_fields(values: Mapping[str, Any]) -> dict[str, Any]:
    """The Pin fields among ``values`` given as a mapping that a kind turns into its own type, converted
    (``{"code": {"bits": 8, "scale": 0.01}}`` -> ``{"code": QuantCode(bits=8, scale=0.01)}``)."""
    if not _KINDS:
        kinds()  # raises: the kinds are not registered yet
    return {name: build(values[name]) for name, build in _FIELD_TYPES.items() if isinstance(values.get(name), Mapping)}


def payload_field(holder: Any, field: str) -> Any:
    """``holder.payload[field]`` for a selection's attribute access (``selection.low``); None where its kind
    holds no such field but another kind does; AttributeError for a name no kind holds."""
    payload = holder.__dict__.get("payload")
    if payload is not None and field in payload:
        return payload[field]
    if payload is not None and any(field in each.payload_fields for each in _KINDS):
        return None
    raise AttributeError(field)
