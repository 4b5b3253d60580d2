"""Fault models as ordinary pins: stuck-at cells, stuck bits, and fault-map files.

A faulty accelerator holds some weights whatever training writes. These generators draw such
faults for a module and return plain :class:`~lightning_pin.Pin` lists, to give to
:class:`~lightning_pin.PinCallback` or :func:`~lightning_pin.pin`:

- :func:`cell_faults`: a ``rate`` fraction of the elements is stuck: SA0 cells read ``0.0``, SA1
  cells read ``sign(w) * high`` (a ReRAM device stuck at its extreme conductance);
- :func:`bit_faults`: each (element, bit) pair of the stored word is stuck with probability
  ``rate`` (a bit error rate of SRAM / DRAM weight memory); the other bits keep training;
- :func:`save_fault_map` / :func:`load_fault_map`: one file format for stuck values, stuck bits
  and bounds per parameter name, so a chip's measured fault map can be pinned as it is.

Every draw is seeded with ``seed`` and the parameter's name and made on the CPU in full-parameter
coordinates: the same faults on every rank, run and resume. Torch only (no Lightning).
"""

from __future__ import annotations

import logging
import math
import numbers
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from lightning_pin.core.errors import PinError
from lightning_pin.core.io import TensorFileError, load_tensors
from lightning_pin.core.plan import fraction_indices, name_seed, resolve
from lightning_pin.core.spec import Pin

__all__ = ["FaultPins", "bit_faults", "cell_faults", "load_fault_map", "save_fault_map"]

log = logging.getLogger(__name__)

Params = Union[str, Sequence[str]]


class FaultPins(list):
    """The pins a fault generator drew (a plain ``list`` of :class:`~lightning_pin.Pin`), and what it drew.

    Attributes:
        summary: One line per matched parameter: how many faults of which kind it got, and
            (for :func:`bit_faults`) how many refused patterns were re-drawn or skipped.
        faulty: Faulty elements per parameter name (0 for a parameter that drew none).
    """

    def __init__(self, pins: Iterable[Pin] = (), summary: str = "", faulty: Optional[Mapping[str, int]] = None):
        super().__init__(pins)
        self.summary = summary
        self.faulty = dict(faulty or {})

    def __reduce__(self) -> Any:
        # Travels to spawned processes (ddp_spawn pickles the callback and what it holds).
        return type(self), (list(self), self.summary, self.faulty)


# ----------------------------------------------------------------------------------------------
# Stuck-at cells


def cell_faults(
    module: nn.Module,
    params: Params,
    rate: float,
    *,
    sa1_fraction: float = 0.5,
    high: Optional[float] = None,
    seed: int = 0,
) -> FaultPins:
    """Stuck-at cells: a ``rate`` fraction of each matched parameter's elements, stuck at 0 or at ``±high``.

    Each matched parameter gets ``round(rate * numel)`` faulty cells (none when that rounds to
    0), exactly the elements ``Pin(name, fraction=rate, seed=seed)`` selects. Each faulty cell is
    SA1 with probability ``sa1_fraction`` (drawn per cell), else SA0. An SA0 cell reads ``0.0``;
    an SA1 cell reads ``high`` with the sign of its weight when drawn (``copysign``: ``-0.0``
    reads ``-high``), as a differential pair whose device is stuck at its extreme conductance.
    ``high`` defaults to the parameter's largest magnitude when the faults are drawn, so draw
    them on the trained model you retrain. Both draws are seeded with ``seed`` and the
    parameter's name: the same cells and kinds on every rank and run.

    Args:
        module: The module to be trained (``trainer.lightning_module``: names must match).
        params: ``fnmatch`` globs (or ``"re:"`` regular expressions) over parameter names.
        rate: Fraction of faulty cells per parameter, in ``[0, 1]``; 0 draws no fault.
        sa1_fraction: Probability that a faulty cell is SA1, in ``[0, 1]``.
        high: The magnitude SA1 cells read (a finite number > 0), stored in the parameter's dtype;
            ``None``: the parameter's largest magnitude.
        seed: Seed of the draw.

    Returns:
        One value pin per parameter that drew a fault (a :class:`FaultPins` list, whose
        ``summary`` says what each parameter got).

    Raises:
        PinError: ``params`` matches no parameter (the closest names are listed), a matched
            parameter is not floating point, or ``rate`` / ``sa1_fraction`` / ``high`` / ``seed``
            is out of range.

    Example::

        >>> import torch
        >>> from lightning_pin.faults import cell_faults
        >>> net = torch.nn.Linear(100, 10)
        >>> pins = cell_faults(net, "weight", rate=0.1, seed=0)
        >>> len(pins), pins.faulty
        (1, {'weight': 100})
        >>> values = pins[0].value
        >>> bool(((values == 0) | (values.abs() == net.weight.abs().max())).all())
        True
    """
    _check_fraction("rate", rate)
    _check_fraction("sa1_fraction", sa1_fraction)
    _check_seed(seed)
    if high is not None and (
        isinstance(high, bool) or not isinstance(high, numbers.Real) or not math.isfinite(high) or not high > 0
    ):
        raise PinError(f"cell_faults: high must be None or a finite number > 0, got {high!r}")
    pins, lines, faulty = [], [], {}
    for name, parameter in _floating_parameters(module, params, "cell_faults").items():
        weights = parameter.detach()
        count = round(float(rate) * weights.numel())
        faulty[name] = count
        if count == 0:
            lines.append(f"{name}: no faulty cell ({rate:g} of {weights.numel():,} rounds to 0)")
            continue
        cells = fraction_indices(name, weights.numel(), float(rate), int(seed))
        generator = torch.Generator().manual_seed(name_seed(f"{name}:sa1", int(seed)))
        sa1 = torch.rand(count, generator=generator, dtype=torch.float64) < sa1_fraction
        flat = weights.reshape(-1)[cells.to(weights.device)].cpu()
        # In the parameter's dtype from the start: every value drawn is pinned exactly as drawn.
        magnitude = weights.abs().max().cpu() if high is None else _in_dtype(high, weights.dtype, name)
        values = torch.where(sa1, torch.copysign(magnitude.expand(count), flat), torch.zeros((), dtype=flat.dtype))
        pins.append(Pin(_exact_pattern(name), indices=_coordinates(cells, tuple(weights.shape)), value=values))
        ones = int(sa1.sum())
        lines.append(
            f"{name}: {count:,} of {weights.numel():,} cells stuck (SA0 {count - ones:,}, SA1 {ones:,} "
            f"at ±{magnitude.item():.6g})"
        )
    return _finish(pins, f"cell faults (rate {rate:g}, sa1_fraction {sa1_fraction:g}, seed {seed})", lines, faulty)


# ----------------------------------------------------------------------------------------------
# Helpers shared by the generators


def _finish(pins: list[Pin], title: str, lines: list[str], faulty: dict[str, int]) -> FaultPins:
    summary = "\n".join([title, *(f"  {line}" for line in lines)])
    log.info(summary)
    return FaultPins(pins, summary, faulty)


def _floating_parameters(module: nn.Module, params: Params, who: str) -> dict[str, Tensor]:
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


def _check_fraction(what: str, x: Any) -> None:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not 0 <= float(x) <= 1:
        raise PinError(f"{what} must be a number in [0, 1], got {x!r}")


def _check_seed(seed: Any) -> None:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise PinError(f"seed must be an integer, got {seed!r}")


def _in_dtype(number: float, dtype: torch.dtype, name: str) -> Tensor:
    stored = torch.tensor(float(number), dtype=dtype)
    if not torch.isfinite(stored):
        raise PinError(f"{number!r} overflows {dtype} of {name!r} (largest finite: {torch.finfo(dtype).max:g})")
    return stored


def _coordinates(flat: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Flat row-major indices as ``(k, ndim)`` int64 coordinates (what ``Pin(indices=...)`` takes)."""
    if not shape:
        return torch.zeros(flat.numel(), 0, dtype=torch.int64)
    return torch.stack(torch.unravel_index(flat.to(torch.int64), shape), dim=1)


_GLOB = re.compile(r"([*?\[])")
_ESCAPED = re.compile(r"\[([*?\[])\]")


def _exact_pattern(name: str) -> str:
    """A glob that matches ``name`` only (``[`` ``*`` ``?`` escaped, as ``glob.escape`` does)."""
    return _GLOB.sub(r"[\1]", name)


def _exact_name(pattern: str) -> Optional[str]:
    """The one name an exact pattern (as :func:`_exact_pattern` writes) matches; None for a real glob or regex."""
    if pattern.startswith("re:"):
        return None
    plain = _ESCAPED.sub("", pattern)
    if _GLOB.search(plain):
        return None
    return _ESCAPED.sub(r"\1", pattern)
