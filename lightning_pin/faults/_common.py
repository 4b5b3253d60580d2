"""What the fault generators share: the :class:`FaultPins` list they return, input checks, exact names."""

from __future__ import annotations

import numbers
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from lightning_pin.core.errors import PinError
from lightning_pin.core.plan import resolve
from lightning_pin.core.spec import Pin

Params = Union[str, Sequence[str]]


class FaultPins(list):
    """The pins a fault generator drew (a plain ``list`` of :class:`~lightning_pin.Pin`), and what it drew.

    Attributes:
        summary: One line per matched parameter: how many faults of which kind it got, and
            (for :func:`bit_faults`) how many refused patterns were re-drawn or skipped.
        faulty: Faulty elements per parameter name (0 for a parameter that drew none).
        redrawn: :func:`bit_faults`: elements whose stuck bits would have read inf / NaN whatever
            training writes (every exponent bit stuck at one), whose polarities were drawn again.
        skipped: :func:`bit_faults`: such elements still refused after :data:`REDRAWS` draws
            (every exponent bit stuck and ``one_fraction`` near 1), left without faults.
        shapes: The shape of each parameter the pins were drawn for or read with, by name, where
            known (:func:`~lightning_pin.faults.load_fault_map` of a file that records them):
            :func:`~lightning_pin.faults.save_fault_map` records them in the file.
    """

    def __init__(
        self,
        pins: Iterable[Pin] = (),
        summary: str = "",
        faulty: Optional[Mapping[str, int]] = None,
        redrawn: int = 0,
        skipped: int = 0,
        shapes: Optional[Mapping[str, tuple[int, ...]]] = None,
    ) -> None:
        super().__init__(pins)
        self.summary = summary
        self.faulty = dict(faulty or {})
        self.redrawn = redrawn
        self.skipped = skipped
        self.shapes = {name: tuple(shape) for name, shape in (shapes or {}).items()}


def finish(
    pins: list[Pin],
    title: str,
    lines: list[str],
    faulty: dict[str, int],
    redrawn: int = 0,
    skipped: int = 0,
    shapes: Optional[Mapping[str, tuple[int, ...]]] = None,
) -> FaultPins:
    summary = "\n".join([title, *(f"  {line}" for line in lines)])
    return FaultPins(pins, summary, faulty, redrawn, skipped, shapes)


def floating_parameters(module: nn.Module, params: Params, who: str) -> dict[str, Tensor]:
    """The parameters ``params`` matches, by (first) name; PinError for a pattern without match."""
    if not isinstance(module, nn.Module):
        raise PinError(f"{who}: module must be a torch.nn.Module, got {type(module).__name__}")
    selections = resolve([Pin(params)], module).pins[0].selections
    named = {name: selection.parameter for name, selection in selections.items()}
    odd = [f"{name} ({p.dtype})" for name, p in named.items() if not p.is_floating_point()]
    if odd:
        raise PinError(
            f"{who}: {', '.join(odd)} {'is' if len(odd) == 1 else 'are'} not floating point: fault models act on "
            "the stored words of float weights; narrow params to float parameters"
        )
    return named


def check_fraction(what: str, x: Any) -> None:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not 0 <= float(x) <= 1:
        raise PinError(f"{what} must be a number in [0, 1], got {x!r}")


def check_seed(seed: Any) -> None:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise PinError(f"seed must be an integer, got {seed!r}")


def in_dtype(number: float, dtype: torch.dtype, name: str) -> Tensor:
    stored = torch.tensor(float(number), dtype=dtype)
    if not torch.isfinite(stored):
        raise PinError(f"{number!r} overflows {dtype} of {name!r} (largest finite: {torch.finfo(dtype).max:g})")
    return stored


def coordinates(flat: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Flat row-major indices as ``(k, ndim)`` int64 coordinates (what ``Pin(indices=...)`` takes)."""
    if not shape:
        return torch.zeros(flat.numel(), 0, dtype=torch.int64)
    return torch.stack(torch.unravel_index(flat.to(torch.int64), shape), dim=1)


_GLOB = re.compile(r"([*?\[])")
_ESCAPED = re.compile(r"\[([*?\[])\]")


def exact_pattern(name: str) -> str:
    """A glob that matches ``name`` only (``[`` ``*`` ``?`` escaped, as ``glob.escape`` does)."""
    return _GLOB.sub(r"[\1]", name)


def exact_name(pattern: str) -> Optional[str]:
    """The one name an exact pattern (as :func:`exact_pattern` writes) matches; None for a real glob or regex."""
    if pattern.startswith("re:"):
        return None
    plain = _ESCAPED.sub("", pattern)
    if _GLOB.search(plain):
        return None
    return _ESCAPED.sub(r"\1", pattern)
