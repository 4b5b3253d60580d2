"""Stuck-at cells (SA0 / SA1) as ordinary value pins: :func:`cell_faults`."""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
from torch import nn

from lightning_pin.core.errors import PinError
from lightning_pin.core.plan import name_seed
from lightning_pin.core.spec import Pin
from lightning_pin.faults.int8 import is_int8_weight, stored_code
from lightning_pin.faults._common import (
    FaultPins,
    Params,
    arrivals,
    check_fraction,
    check_seed,
    coordinates,
    exact_pattern,
    finish,
    floating_parameters,
    in_dtype,
)

__all__ = ["cell_faults"]


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

    The faulty cells are the first ``round(rate * numel)`` of a random order of the elements, and
    each gets its SA1 / SA0 draw with its place in that order, from generators seeded with
    ``seed`` (an integer >= 0) and the parameter's name, in full-parameter coordinates: the same
    faults on every rank and run, and nested across rates: with one seed, a higher rate keeps
    every faulty cell of a lower one, of the same kind, and adds more (common random numbers for
    a fault-rate sweep). Cost: about the number of faulty cells, not the parameter's size.

    A parameter whose elements are all zero has no magnitude for SA1 cells to read: with
    ``high=None`` and ``sa1_fraction > 0`` that is a ``PinError`` (give ``high=`` or
    ``sa1_fraction=0``), not SA1 cells silently stuck at ``±0.0``.

    Args:
        module: The module to be trained (``trainer.lightning_module``: names must match).
        params: ``fnmatch`` globs (or ``"re:"`` regular expressions) over parameter names.
        rate: Fraction of faulty cells per parameter, in ``[0, 1]``; 0 draws no fault.
        sa1_fraction: Probability that a faulty cell is SA1, in ``[0, 1]``.
        high: The magnitude SA1 cells read (a finite number > 0), stored in the parameter's dtype;
            ``None``: the parameter's largest magnitude. On a weight stored as int8 codes (torchao)
            the pins hold int8 codes: SA0 reads the zero point's code, SA1 ``high`` codes from it.
        seed: Seed of the draw.

    Returns:
        One value pin per parameter that drew a fault (a :class:`FaultPins` list, whose
        ``summary`` says what each parameter got).

    Raises:
        PinError: ``params`` matches no parameter (the closest names are listed), a matched
            parameter is not floating point, ``rate`` / ``sa1_fraction`` / ``high`` / ``seed``
            is out of range, or SA1 cells would read the largest magnitude of an all-zero parameter.

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
    pins, lines, faulty, shapes, dtypes = [], [], {}, {}, {}
    for name, parameter in floating_parameters(module, params, "cell_faults").items():
        if is_int8_weight(parameter):
            shapes[name], dtypes[name] = tuple(parameter.shape), torch.int8  # the stored codes
            _int8_cells(pins, lines, faulty, name, parameter, rate, sa1_fraction, high, int(seed))
            continue
        weights = parameter.detach()
        count = round(float(rate) * weights.numel())
        faulty[name] = count
        # save_fault_map records them, so the map is refused on a layer of another shape
        shapes[name], dtypes[name] = tuple(weights.shape), weights.dtype
        if count == 0:
            lines.append(f"{name}: no faulty cell ({rate:g} of {weights.numel():,} rounds to 0)")
            continue
        ids, uniforms = arrivals(
            weights.numel(), count, name_seed(f"{name}:cells", int(seed)), name_seed(f"{name}:sa1", int(seed))
        )
        order = ids.argsort()
        cells, sa1 = ids[order], (uniforms < sa1_fraction)[order]
        flat = weights.reshape(-1)[cells.to(weights.device)].cpu()
        # In the parameter's dtype from the start: every value drawn is pinned exactly as drawn.
        magnitude = weights.abs().max().cpu() if high is None else in_dtype(high, weights.dtype, name)
        if high is None and bool(sa1.any()) and float(magnitude) == 0.0:
            raise PinError(
                f"cell_faults: {name!r} is all zeros, so its SA1 cells would read ±0.0 (its largest magnitude), "
                "the same as SA0: give high=<the magnitude an SA1 cell reads>, or sa1_fraction=0"
            )
        values = torch.where(sa1, torch.copysign(magnitude.expand(count), flat), torch.zeros((), dtype=flat.dtype))
        pins.append(Pin(exact_pattern(name), indices=coordinates(cells, tuple(weights.shape)), value=values))
        ones = int(sa1.sum())
        lines.append(
            f"{name}: {count:,} of {weights.numel():,} cells stuck (SA0 {count - ones:,}, SA1 {ones:,} "
            f"at ±{magnitude.item():.6g})"
        )
    title = f"cell faults (rate {rate:g}, sa1_fraction {sa1_fraction:g}, seed {seed})"
    return finish(pins, title, lines, faulty, shapes=shapes, dtypes=dtypes)


def _int8_cells(pins: list, lines: list, faulty: dict, name: str, parameter: torch.Tensor, rate: float,
                sa1_fraction: float, high: Optional[float], seed: int) -> None:
    """Stuck cells of a weight stored as int8 codes (torchao): the pin's values are int8 codes.

    The same cells and SA1 draws as on a float weight of that name; an SA0 cell reads the code of
    0.0 (the zero point), an SA1 cell the zero point plus ``high`` codes with the sign of its weight
    (``high``: a whole number of codes, default the tensor's largest ``|q - zero_point|``), clamped to int8.
    """
    codes = parameter.qdata.detach().reshape(-1).to(torch.int64)
    zero_point = stored_code(parameter, name).zero_point
    count = round(float(rate) * codes.numel())
    faulty[name] = count
    if count == 0:
        lines.append(f"{name}: no faulty cell ({rate:g} of {codes.numel():,} rounds to 0)")
        return
    ids, uniforms = arrivals(codes.numel(), count, name_seed(f"{name}:cells", seed), name_seed(f"{name}:sa1", seed))
    order = ids.argsort()
    cells, sa1 = ids[order], (uniforms < sa1_fraction)[order]
    centred = codes.cpu() - zero_point
    if high is None:
        magnitude = int(centred.abs().max())
    elif float(high) != int(high):
        raise PinError(f"cell_faults: {name!r} is stored as int8 codes; high={high!r} must be a whole number of codes")
    else:
        magnitude = int(high)
    sign = torch.where(centred[cells] < 0, -1, 1)
    # an SA1 cell reads the extreme code on its weight's side, within int8 (-128 has no +128 partner)
    values = torch.where(sa1, zero_point + sign * magnitude, torch.full_like(sign, zero_point)).clamp(-128, 127)
    pins.append(Pin(exact_pattern(name), indices=coordinates(cells, tuple(parameter.shape)),
                    value=values.to(torch.int8)))
    ones = int(sa1.sum())
    lines.append(f"{name}: {count:,} of {codes.numel():,} int8 cells stuck (SA0 {count - ones:,} at code "
                 f"{zero_point}, SA1 {ones:,} at ±{magnitude} codes)")
