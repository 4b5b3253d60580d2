"""The rules every pin spec shares: :class:`~lightning_pin.Pin` (weights) and
:class:`~lightning_pin.NeuronPin` (module outputs) check, show, build and draw with these.

One place for what the two specs mean alike: the step window (``start_step`` from 0, ``stop_step``
exclusive), ``fraction`` (``round(fraction * n)`` of ``n`` elements or positions, at least one)
and ``seed`` (a generator seeded with the seed and the parameter's or module's name: the same
draw on every rank, run and resume), the refusals of bad values of those fields (one wording,
naming the spec), the repr, the patterns and the reading of a mapping (Hydra / YAML). It depends
on nothing else of lightning-pin but :mod:`~lightning_pin.core.errors`, so the specs and the
kinds can all import it.

Example::

    >>> from lightning_pin import NeuronPin, Pin
    >>> in_window(Pin("fc.weight", start_step=2), 1), in_window(NeuronPin("fc"), 0)
    (False, True)
    >>> fraction_count(0.3, 10), fraction_count(0.01, 10)
    (3, 1)
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_pin.core.errors import PinError

__all__ = [
    "check_fraction", "check_patterns", "check_seed", "check_steps", "clip", "fraction_count", "from_mapping",
    "in_window", "is_int", "name_seed", "seeded_generator", "smallest_keys", "spec_repr", "windows_overlap",
]


def is_int(x: Any) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def clip(value: Any) -> str:
    """``repr(value)``, cut to 120 characters for a message."""
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


# --------------------------------------------------------------------------------------------
# Refusals at construction: ``owner`` is the spec, named (by its repr) in every message.


def check_patterns(owner: Any, field: str, value: Any, what: str) -> None:
    """``value`` must be a non-empty pattern or list (tuple) of them; a ``"re:"`` one must compile.

    ``what`` says what the patterns match, for the message (``"globs over parameter names, e.g. 'encoder.*'"``).
    """
    patterns = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise PinError(f"{owner!r}: {field} must be a non-empty string or list of strings ({what}), got {clip(value)}")
    for pattern in patterns:
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as err:
                raise PinError(f"{owner!r}: {pattern!r} is not a valid regular expression: {err}") from err


def check_fraction(owner: Any, fraction: Any) -> None:
    """``fraction`` must be None or a number in ``(0, 1]``."""
    if fraction is None:
        return
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not (0 < float(fraction) <= 1):
        raise PinError(f"{owner!r}: fraction must be a number in (0, 1], got {fraction!r}")


def check_seed(owner: Any, seed: Any) -> None:
    """``seed`` must be an integer."""
    if not is_int(seed):
        raise PinError(f"{owner!r}: seed must be an integer, got {seed!r}")


def check_steps(owner: Any, start: Any, stop: Any) -> None:
    """``start_step`` an integer >= 0; ``stop_step`` None or an integer > ``start_step``."""
    if not is_int(start) or start < 0:
        raise PinError(f"{owner!r}: start_step must be an integer >= 0, got {start!r}")
    if stop is not None and (not is_int(stop) or stop <= start):
        raise PinError(f"{owner!r}: stop_step must be None or an integer > start_step ({start}), got {stop!r}")


# --------------------------------------------------------------------------------------------
# Steps


def in_window(spec: Any, step: int) -> bool:
    """Whether optimizer step ``step`` falls in ``[spec.start_step, spec.stop_step)``."""
    stop = spec.stop_step
    return spec.start_step <= step and (stop is None or step < stop)


def windows_overlap(a: Any, b: Any) -> bool:
    """Whether two specs' step windows share a step."""
    a_stop = math.inf if a.stop_step is None else a.stop_step
    b_stop = math.inf if b.stop_step is None else b.stop_step
    return max(a.start_step, b.start_step) < min(a_stop, b_stop)


# --------------------------------------------------------------------------------------------
# fraction and seed


def name_seed(name: str, seed: int) -> int:
    """A 63-bit generator seed from ``seed`` and a parameter's (or module's) name, stable across processes: what
    makes a seeded selection the same on every rank, run and resume."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def seeded_generator(name: str, seed: int) -> torch.Generator:
    """The CPU generator a seeded draw over ``name`` (a parameter's or module's name) uses."""
    return torch.Generator().manual_seed(name_seed(name, seed))


def fraction_count(fraction: float, numel: int) -> int:
    """How many of ``numel`` elements (or positions) ``fraction`` selects: ``round(fraction * numel)``, at least 1."""
    return max(1, round(fraction * numel))


def smallest_keys(numel: int, count: int, generator: torch.Generator) -> Tensor:
    """The ``count`` of ``numel`` elements with the smallest uniform random keys drawn from ``generator``,
    sorted (int64). Nested: with one generator seed, a larger ``count`` holds every element of a smaller one."""
    keys = torch.rand(numel, generator=generator, dtype=torch.float64)
    threshold = keys.kthvalue(count).values
    below = keys < threshold
    # Ties at the threshold are all but impossible with 53-bit keys; break them by position.
    ties = (keys == threshold).nonzero().squeeze(1)[: count - int(below.sum())]
    below[ties] = True
    return below.nonzero().squeeze(1)


# --------------------------------------------------------------------------------------------
# repr and mappings


class _Hex(int):
    """An int shown in hex: bit masks read better as 0x80000000 than as 2147483648."""

    def __repr__(self) -> str:
        return hex(self)


def _hex(value: Any) -> Any:
    if is_int(value):
        return _Hex(value)
    if isinstance(value, list):
        return [_hex(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_hex(v) for v in value)
    return value


def _is_default(value: Any, default: Any) -> bool:
    # By type too: a default told apart from the same value given (NeuronPin's value=0.0) is shown when given.
    if isinstance(value, torch.Tensor) or type(value) is not type(default):
        return False
    return bool(value == default)


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        if value.numel() <= 6:
            return f"tensor({value.tolist()})"
        return f"tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    if callable(value):
        return getattr(value, "__qualname__", repr(value))
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def spec_repr(spec: Any) -> str:
    """``Type(first=..., field=...)``: a spec dataclass's first field, then every field not at its
    default (stuck-bit masks in hex, tensors by shape, long values cut)."""
    first, *rest = dataclasses.fields(spec)
    shown = [f"{first.name}={getattr(spec, first.name)!r}"]
    for field in rest:
        value = getattr(spec, field.name)
        if not _is_default(value, field.default):
            shown.append(f"{field.name}={_short(_hex(value) if field.name.startswith('stuck') else value)}")
    return f"{type(spec).__name__}({', '.join(shown)})"


def from_mapping(cls: type, config: Any, fields: tuple[str, ...], *, what: str, required: str, hint: str) -> Any:
    """A ``cls`` from one, or from a mapping with its keys (Hydra / YAML; ``_target_`` ignored).

    Raises:
        PinError: ``config`` is neither, has keys that are not ``fields``, or lacks ``required``
            (``what``: the spec in words; ``hint``: what to give for ``required``).
    """
    name = cls.__name__
    if isinstance(config, cls):
        return config
    if not isinstance(config, Mapping):
        raise PinError(
            f"a {what} must be a {name} or a mapping with the keys of {name}, got {type(config).__name__}: {config!r}"
        )
    keys = {str(k) for k in config.keys()} - {"_target_"}
    unknown = sorted(keys - set(fields))
    if unknown:
        raise PinError(f"{what} {dict(config)!r} has unknown keys {unknown}; the keys of a {name} are {list(fields)}")
    if required not in keys:
        raise PinError(f"{what} {dict(config)!r} has no {required!r}: {hint}")
    return cls(**{k: config[k] for k in keys})
