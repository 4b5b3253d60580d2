"""The saved pin-state format: the one module that writes and reads it.

:class:`~lightning_pin.PinCallback` saves it in a Lightning checkpoint under its ``state_key``,
:class:`~lightning_pin.PinHandle` returns it from ``state_dict()``, and ``lightning-pin diff`` /
``check`` read it back from files. Everything in it is a tensor, a list, a dict or a primitive,
so ``torch.load(weights_only=True)`` reads it. Reading validates every field and raises
:class:`CorruptPinState` naming what is wrong, never a bare ``KeyError``.

Versions: 1 (lightning-pin 0.1) had no ``step``; 2 adds ``step``, the optimizer steps the
torch-native front door counted (``None`` under Lightning, whose ``global_step`` is saved by
the trainer); 3 adds the fault models: each selection has a ``kind`` (``"value"``,
``"stuck_bits"``, ``"bounds"``), stuck-bit masks (``stuck_at_zero`` / ``stuck_at_one``, in the
signed integer type of the parameter's width: int32 for float32, int16 for bfloat16 / float16,
int64 for float64, so ``0x80000000`` is saved as ``-2**31``) and bounds (``low`` / ``high``, in the
parameter's dtype). A version 1-2 state holds value pins only and reads as ``kind="value"``.

What a selection of each kind saves beyond ``index`` / ``target`` / ``explicit`` (its
``payload_fields``), and how it is checked when read, belongs to the kind
(:mod:`lightning_pin.core.kinds`): this module writes and reads the envelope.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_pin.core import kinds
from lightning_pin.core.errors import PinError
from lightning_pin.core.kinds.base import show as _show
from lightning_pin.core.kinds.stuck_bits import BITS_DTYPES
from lightning_pin.core.selection import SavedSelection  # also lightning_pin.core.state.SavedSelection

#: The version :meth:`PinState.to_dict` writes.
STATE_VERSION = 3
#: The kinds of selection a state holds (see :mod:`lightning_pin.core.kinds`).
KINDS = tuple(kinds.BY_NAME)
__all__ = [
    "BITS_DTYPES", "CALLBACK_KEY_PREFIX", "KINDS", "STATE_VERSION", "CorruptPinState", "PinState", "SavedSelection",
    "find_pin_states",
]
#: Prefix of the callback-state keys of :class:`~lightning_pin.PinCallback` in a Lightning checkpoint.
CALLBACK_KEY_PREFIX = "PinCallback"


class CorruptPinState(PinError):
    """Saved pin state that cannot be read: not a dict, missing or mistyped entries, bad values."""


@dataclasses.dataclass(frozen=True)
class PinState:
    """Saved pins, by position in the pin list: fingerprints, selections, targets and activity."""

    #: Each pin's :meth:`~lightning_pin.Pin.fingerprint`.
    fingerprints: tuple[str, ...]
    #: Per pin, parameter name -> :class:`SavedSelection`.
    pins: tuple[dict[str, SavedSelection], ...]
    #: Ids of the pins active when saved.
    active: frozenset[int]
    #: Ids of the pins active at the last optimizer step; None before any step.
    last_step_active: Optional[frozenset[int]]
    #: Optimizer steps counted by the torch-native front door (None under Lightning).
    step: Optional[int] = None
    #: The monitor's own state (PinCallback only), passed through untouched.
    monitor: Optional[Mapping[str, Any]] = None

    @property
    def checked_pins(self) -> frozenset[int]:
        """The pins whose targets must hold in saved weights: active at the last step, else now."""
        return self.last_step_active if self.last_step_active is not None else self.active

    def to_dict(self) -> dict[str, Any]:
        """The saved form: tensors, lists, dicts and primitives only (``weights_only=True`` loads it)."""
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "fingerprints": list(self.fingerprints),
            "active": sorted(self.active),
            "last_step_active": None if self.last_step_active is None else sorted(self.last_step_active),
            "step": self.step,
            "pins": [{name: _saved_form(s) for name, s in selections.items()} for selections in self.pins],
        }
        if self.monitor is not None:
            state["monitor"] = dict(self.monitor)
        return state

    @classmethod
    def from_dict(cls, raw: Any, where: str = "the pin state") -> PinState:
        """Read and validate a saved state (any version up to :data:`STATE_VERSION`).

        Raises:
            CorruptPinState: naming ``where`` and the first thing that is wrong.
        """

        def corrupt(problem: str) -> CorruptPinState:
            return CorruptPinState(f"{where} is corrupt: {problem}")

        if isinstance(raw, PinState):
            return raw
        if not isinstance(raw, Mapping):
            raise corrupt(f"it is a {type(raw).__name__}, not a dict")
        version = raw.get("version")
        if not _is_int(version) or version < 1:
            raise corrupt(f"'version' is {version!r}, not a positive integer")
        if version > STATE_VERSION:
            raise CorruptPinState(
                f"{where} was written by a newer lightning-pin (format version {version}; this one reads up to "
                f"{STATE_VERSION}): upgrade lightning-pin to resume from it"
            )
        for key in ("fingerprints", "pins", "active"):
            if key not in raw:
                raise corrupt(f"'{key}' is missing")
        fingerprints, saved_pins = raw["fingerprints"], raw["pins"]
        if not _is_list(fingerprints) or not all(isinstance(f, str) for f in fingerprints):
            raise corrupt(f"'fingerprints' must be a list of strings, got {_show(fingerprints)}")
        if not _is_list(saved_pins):
            raise corrupt(f"'pins' must be a list with one dict per pin, got {_show(saved_pins)}")
        if len(fingerprints) != len(saved_pins):
            raise corrupt(f"{len(fingerprints)} fingerprints for {len(saved_pins)} pins")
        pins = tuple(_read_pin(pin_id, entry, corrupt, version) for pin_id, entry in enumerate(saved_pins))
        active = _read_ids(raw["active"], "active", len(pins), corrupt)
        last = raw.get("last_step_active")
        last_step_active = None if last is None else _read_ids(last, "last_step_active", len(pins), corrupt)
        step = raw.get("step") if version >= 2 else None
        if step is not None and not (_is_int(step) and step >= 0):
            raise corrupt(f"'step' is {step!r}, not a count of optimizer steps")
        monitor = raw.get("monitor")
        if monitor is not None and not isinstance(monitor, Mapping):
            raise corrupt(f"'monitor' must be a dict, got {_show(monitor)}")
        return cls(tuple(fingerprints), pins, active, last_step_active, step, monitor)


def _saved_form(s: SavedSelection) -> dict[str, Any]:
    def cpu(tensor: Optional[Tensor]) -> Optional[Tensor]:
        return None if tensor is None else tensor.detach().cpu().clone()

    form: dict[str, Any] = {"index": cpu(s.index), "target": cpu(s.target), "explicit": s.explicit, "kind": s.kind}
    form.update((field, cpu(s.payload.get(field))) for field in kinds.of(s.kind).payload_fields)
    return form


def _read_pin(pin_id: int, entry: Any, corrupt: Any, version: int) -> dict[str, SavedSelection]:
    if not isinstance(entry, Mapping):
        raise corrupt(f"pin {pin_id} must be a dict by parameter name, got {_show(entry)}")
    selections = {}
    for name, saved in entry.items():
        at = f"pin {pin_id}, parameter {name!r}"
        if not isinstance(name, str):
            raise corrupt(f"pin {pin_id} has a parameter name {name!r} that is not a string")
        if not isinstance(saved, Mapping):
            raise corrupt(f"{at}: expected a dict with 'index', 'target' and 'explicit', got {_show(saved)}")
        missing = [k for k in ("index", "target", "explicit") if k not in saved]
        if missing:
            raise corrupt(f"{at}: {', '.join(repr(k) for k in missing)} missing")
        index, target, explicit = saved["index"], saved["target"], saved["explicit"]
        if index is not None:
            if not isinstance(index, Tensor) or index.dtype not in (torch.int32, torch.int64) or index.dim() != 1:
                raise corrupt(f"{at}: 'index' must be a 1-D int32/int64 tensor or None, got {_show(index)}")
            if index.numel() and int(index.min()) < 0:
                raise corrupt(f"{at}: 'index' holds negative positions")
        if not isinstance(explicit, bool):
            raise corrupt(f"{at}: 'explicit' must be True or False, got {explicit!r}")
        if target is not None:
            if not isinstance(target, Tensor):
                raise corrupt(f"{at}: 'target' must be a tensor or None, got {_show(target)}")
            if index is not None and tuple(target.shape) != (index.numel(),):
                raise corrupt(f"{at}: {index.numel()} indices but targets of shape {tuple(target.shape)}")
            if target.is_floating_point() and not bool(torch.isfinite(target).all()):
                # Neither a spec (checked when built) nor a capture (of trained weights) gives
                # NaN or infinity: pinning them would poison the weights for good.
                which = "explicit" if explicit else "captured"
                raise corrupt(f"{at}: {which} targets hold NaN or infinity, which no pin can give")
        name_of_kind = saved.get("kind", kinds.DEFAULT.kind) if version >= 3 else kinds.DEFAULT.kind
        if not isinstance(name_of_kind, str) or name_of_kind not in kinds.BY_NAME:
            raise corrupt(f"{at}: 'kind' is {name_of_kind!r}, not one of {list(KINDS)}")
        selections[name] = kinds.of(name_of_kind).read_saved(index, target, explicit, saved, at, corrupt)
    return selections


def _read_ids(raw: Any, key: str, count: int, corrupt: Any) -> frozenset[int]:
    if not _is_list(raw) or not all(_is_int(i) for i in raw):
        raise corrupt(f"'{key}' must be a list of pin ids, got {_show(raw)}")
    outside = [i for i in raw if not 0 <= i < count]
    if outside:
        raise corrupt(f"'{key}' names pins {outside}, but the state holds {count}")
    return frozenset(raw)


def find_pin_states(saved: Any) -> dict[str, Any]:
    """Raw pin states in a loaded file, by where they sit: the ``PinCallback...`` entries of a
    Lightning checkpoint's ``callbacks``, a ``"pins"`` entry holding a :class:`PinHandle` state
    (the plain-loop recipe saves ``{"model": ..., "pins": handle.state_dict()}``), or the file
    itself when it is one. Read each with :meth:`PinState.from_dict`."""
    if not isinstance(saved, Mapping):
        return {}
    found: dict[str, Any] = {}
    callbacks = saved.get("callbacks")
    if isinstance(callbacks, Mapping):
        found.update(
            (key, state)
            for key, state in callbacks.items()
            if isinstance(key, str) and key.startswith(CALLBACK_KEY_PREFIX) and _looks_like_state(state)
        )
    for key, state in saved.items():
        if isinstance(key, str) and key != "callbacks" and _looks_like_state(state):
            found[key] = state
    if _looks_like_state(saved):
        found["(file)"] = saved
    return found


def _looks_like_state(value: Any) -> bool:
    return isinstance(value, Mapping) and "pins" in value and "fingerprints" in value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))
