"""Pins that need the model to be built: seeded random target values and fault maps read from files.

A :class:`~lightning_pin.Pin` holds data only; these helpers make that data for a given module,
so configs can ask for "5% of the conv weights stuck at random values in [-1, 1]" or "the cells
this fault map marks" without listing numbers:

- :class:`UniformValues`, :class:`NormalValues`: value generators. :func:`realize` replaces a
  pin's generator by one tensor per matched parameter, drawn from a generator seeded with the
  seed and the parameter's name, so every run, rank and resume pins the same numbers;
- :func:`fault_map_pins` / :func:`random_fault_map`: a fault map is a ``.pt`` or ``.safetensors``
  file holding, per parameter name, a tensor of the parameter's shape that is NaN where the cell
  is healthy and holds the stuck-at value where it is faulty (the format of
  :mod:`lightning_pin.faults`, which also holds stuck bits and bounds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Optional, Union

import torch
from torch import Tensor, nn

from lightning_pin.core.errors import PinError
from lightning_pin.core.plan import fraction_indices, name_seed, resolve
from lightning_pin.core.spec import Pin
from lightning_pin.faults import load_fault_map

__all__ = ["NormalValues", "UniformValues", "ValueGenerator", "fault_map_pins", "random_fault_map", "realize"]


class ValueGenerator:
    """Makes the target values of one parameter: ``generator(name, parameter) -> Tensor`` of its shape."""

    seed: int

    def __call__(self, name: str, parameter: Tensor) -> Tensor:
        generator = torch.Generator().manual_seed(name_seed(name, self.seed))
        # Drawn in the parameter's own dtype, so every value is representable and pinned as drawn.
        return self.draw(tuple(parameter.shape), parameter.dtype, generator)

    def draw(self, shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> Tensor:
        raise NotImplementedError


class UniformValues(ValueGenerator):
    """Targets drawn uniformly from ``[low, high)``, reproducible from ``seed`` and the parameter's name.

    Raises:
        PinError: ``low`` is not below ``high``.

    Example::

        >>> import torch
        >>> values = UniformValues(low=-1.0, high=1.0, seed=1)
        >>> a = values("conv.weight", torch.zeros(4, 3))
        >>> torch.equal(a, values("conv.weight", torch.zeros(4, 3))), bool((a >= -1).all() and (a < 1).all())
        (True, True)
    """

    def __init__(self, low: float = -1.0, high: float = 1.0, seed: int = 0) -> None:
        if not low < high:
            raise PinError(f"UniformValues needs low < high, got low={low!r}, high={high!r}")
        self.low, self.high, self.seed = float(low), float(high), int(seed)

    def draw(self, shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> Tensor:
        return torch.rand(shape, generator=generator, dtype=dtype) * (self.high - self.low) + self.low

    def __repr__(self) -> str:
        return f"UniformValues(low={self.low:g}, high={self.high:g}, seed={self.seed})"


class NormalValues(ValueGenerator):
    """Targets drawn from a normal distribution, reproducible from ``seed`` and the parameter's name.

    Example::

        >>> import torch
        >>> values = NormalValues(mean=0.0, std=0.5, seed=3)
        >>> torch.equal(values("head.bias", torch.zeros(4)), values("head.bias", torch.zeros(4)))
        True

    Raises:
        PinError: ``std`` is not positive.
    """

    def __init__(self, mean: float = 0.0, std: float = 1.0, seed: int = 0) -> None:
        if not std > 0:
            raise PinError(f"NormalValues needs std > 0, got {std!r}")
        self.mean, self.std, self.seed = float(mean), float(std), int(seed)

    def draw(self, shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> Tensor:
        return torch.randn(shape, generator=generator, dtype=dtype) * self.std + self.mean

    def __repr__(self) -> str:
        return f"NormalValues(mean={self.mean:g}, std={self.std:g}, seed={self.seed})"


def realize(pin: Pin, module: nn.Module) -> Pin:
    """``pin`` with a :class:`ValueGenerator` value replaced by one tensor per parameter it matches.

    Other pins are returned as they are.

    Raises:
        PinError: the pin matches no parameter of ``module``, or fails another of
            :func:`~lightning_pin.core.plan.resolve`'s checks.
    """
    if not isinstance(pin.value, ValueGenerator):
        return pin
    matched = resolve([dataclasses.replace(pin, value=None)], module).pins[0].selections
    values = {name: pin.value(name, selection.parameter.detach()) for name, selection in matched.items()}
    return dataclasses.replace(pin, value=values)


# ----------------------------------------------------------------------------------------------
# Fault maps


def fault_map_pins(path: Union[str, Path]) -> list[Pin]:
    """The pins of a fault map file: its stuck values, stuck bits and bounds, per parameter.

    The file format (``.pt`` / ``.pth`` / ``.safetensors``) is :func:`lightning_pin.faults.load_fault_map`'s:
    the older maps, one tensor per parameter name that is NaN where the cell is healthy and holds
    the stuck-at value where it is faulty, read as they always did.

    Raises:
        PinError: the file does not exist or cannot be read, holds anything but a dict of tensors,
            or marks no faulty cell.
    """
    return load_fault_map(path)


def random_fault_map(
    module: nn.Module,
    params: Union[str, Sequence[str]],
    fraction: float,
    low: float = -1.0,
    high: float = 1.0,
    seed: int = 0,
    value_seed: Optional[int] = None,
) -> dict[str, Tensor]:
    """A fault map for ``module``: ``fraction`` of the cells of the matched parameters stuck in ``[low, high)``.

    ``seed`` chooses the cells; ``value_seed`` (default: ``seed``) draws their stuck values.

    Save it with ``torch.save(fault_map, "faults.pt")`` and run ``pin=fault_map pin.fault_map=faults.pt``.

    Example::

        >>> import torch
        >>> from lightning_pin.app.models import SmallCNN
        >>> faults = random_fault_map(SmallCNN(), "features.0.weight", fraction=0.05, seed=1)
        >>> int((~faults["features.0.weight"].isnan()).sum())  # 5% of 144 cells, rounded
        7

    Raises:
        PinError: ``params`` matches no parameter of ``module``, or ``fraction`` is not in (0, 1].
    """
    selections = resolve([Pin(params)], module).pins[0].selections
    values = UniformValues(low, high, seed if value_seed is None else value_seed)
    faults = {}
    for name, selection in selections.items():
        parameter = selection.parameter.detach()
        stuck = torch.full(parameter.shape, float("nan"), dtype=parameter.dtype)
        cells = fraction_indices(name, parameter.numel(), fraction, seed)
        stuck.view(-1)[cells] = values(name, parameter).view(-1)[cells]
        faults[name] = stuck
    return faults
