"""Stuck-at cells (SA0 / SA1) as ordinary value pins: :func:`cell_faults`."""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_pin.core.errors import PinError
from lightning_pin.core.plan import name_seed
from lightning_pin.core.spec import Pin
from lightning_pin.faults._common import (
    FaultPins,
    Params,
    check_fraction,
    check_seed,
    coordinates,
    exact_pattern,
    finish,
    floating_parameters,
    in_dtype,
)


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
    0), a uniform random subset. Each faulty cell is SA1 with probability ``sa1_fraction``, else
    SA0. An SA0 cell reads ``0.0``; an SA1 cell reads ``high`` with the sign of its weight when
    drawn (``copysign``: ``-0.0`` reads ``-high``), as a differential pair whose device is stuck
    at its extreme conductance. ``high`` defaults to the parameter's largest magnitude when the
    faults are drawn, so draw them on the trained model you retrain.

    Every element gets one uniform key for "is it faulty" and one for "SA1 or SA0", from
    generators seeded with ``seed`` and the parameter's name, in full-parameter coordinates:
    the same faults on every rank and run, and nested across rates: with one seed, a higher
    rate keeps every faulty cell of a lower one, of the same kind, and adds more (common random
    numbers for a fault-rate sweep). Cost: two draws per element of the matched parameters.

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
    check_fraction("rate", rate)
    check_fraction("sa1_fraction", sa1_fraction)
    check_seed(seed)
    if high is not None and (
        isinstance(high, bool) or not isinstance(high, numbers.Real) or not math.isfinite(high) or not high > 0
    ):
        raise PinError(f"cell_faults: high must be None or a finite number > 0, got {high!r}")
    pins, lines, faulty = [], [], {}
    for name, parameter in floating_parameters(module, params, "cell_faults").items():
        weights = parameter.detach()
        count = round(float(rate) * weights.numel())
        faulty[name] = count
        if count == 0:
            lines.append(f"{name}: no faulty cell ({rate:g} of {weights.numel():,} rounds to 0)")
            continue
        cells = _smallest_keys(weights.numel(), count, name_seed(f"{name}:cells", int(seed)))
        kinds = torch.Generator().manual_seed(name_seed(f"{name}:sa1", int(seed)))
        sa1 = torch.rand(weights.numel(), generator=kinds, dtype=torch.float64)[cells] < sa1_fraction
        flat = weights.reshape(-1)[cells.to(weights.device)].cpu()
        # In the parameter's dtype from the start: every value drawn is pinned exactly as drawn.
        magnitude = weights.abs().max().cpu() if high is None else in_dtype(high, weights.dtype, name)
        values = torch.where(sa1, torch.copysign(magnitude.expand(count), flat), torch.zeros((), dtype=flat.dtype))
        pins.append(Pin(exact_pattern(name), indices=coordinates(cells, tuple(weights.shape)), value=values))
        ones = int(sa1.sum())
        lines.append(
            f"{name}: {count:,} of {weights.numel():,} cells stuck (SA0 {count - ones:,}, SA1 {ones:,} "
            f"at ±{magnitude.item():.6g})"
        )
    return finish(pins, f"cell faults (rate {rate:g}, sa1_fraction {sa1_fraction:g}, seed {seed})", lines, faulty)


def _smallest_keys(numel: int, count: int, seed: int) -> Tensor:
    """The sorted flat indices of the ``count`` elements with the smallest uniform keys.

    Keys are one float64 draw per element from a generator seeded with ``seed``, so the cells of
    a smaller ``count`` are always among those of a larger one.
    """
    keys = torch.rand(numel, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return keys.topk(count, largest=False, sorted=False).indices.sort().values
