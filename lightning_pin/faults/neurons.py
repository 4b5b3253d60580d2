"""Stuck-neuron faults: a seeded draw of dead or saturated channels / output positions.

:func:`neuron_faults` returns :class:`~lightning_pin.NeuronPin` lists, to give to
:func:`~lightning_pin.pin` or :class:`~lightning_pin.PinCallback` next to weight pins.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from lightning_pin.core.errors import PinError
from lightning_pin.core.kinds.neuron import NeuronPin, match_modules, name_seed

_KINDS = ("sa0", "sa1", "value")
_PER = ("channel", "neuron")
# The attributes that give a module's output channels (axis 1) without a forward.
_CHANNEL_ATTRIBUTES = ("out_channels", "out_features", "num_features", "embedding_dim", "hidden_size")


def neuron_faults(
    module: nn.Module,
    modules: Union[str, Sequence[str]],
    rate: float,
    *,
    kind: str = "sa0",
    low: float = -2.0,
    high: float = 2.0,
    per: str = "channel",
    batch: Any = None,
    seed: int = 0,
) -> list[NeuronPin]:
    """A ``rate`` fraction of the channels (``per="channel"``, axis 1) or of the per-sample output
    positions (``per="neuron"``) of each module of ``module`` that ``modules`` matches, stuck.

    ``kind="sa0"``: stuck at 0 (a dead unit); ``"sa1"``: stuck at ``high`` (saturated), or, with
    ``batch`` given, at the module's largest output magnitude on that batch (the largest over
    ranks under torch.distributed); ``"value"``: each at a seeded value in ``[low, high)``.

    Every module draws ``round(rate * n)`` (at least one for ``rate > 0``) of its ``n`` units from
    a generator seeded with ``seed`` and the module's name: the same faults on every rank and run,
    and nested across rates (with one seed, a higher rate's faults hold a lower rate's, at the
    same values). The output shapes come from ``batch`` (one forward, in the module's current
    mode, without gradients), else from the module's attributes (``out_channels``, ...) for
    ``per="channel"``; ``per="neuron"`` without ``batch`` gives a ``fraction`` pin (positions
    resolved at the first forward; not with ``kind="value"``).

    Raises:
        PinError: ``rate`` outside [0, 1], an unknown ``kind`` / ``per``, ``low >= high``, a pattern
            matching no module, or a shape that cannot be known without ``batch``.

    Example::

        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
        >>> neuron_faults(net, "0", 0.25, seed=1)
        [NeuronPin(modules='0', channels=(1, 3))]
        >>> [p.channels for p in neuron_faults(net, "0", 0.5, seed=1)]  # nested: holds channels 1 and 3
        [(1, 2, 3, 4)]
    """
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
        raise PinError(f"neuron_faults: rate must be a number in [0, 1], got {rate!r}")
    if kind not in _KINDS:
        raise PinError(f"neuron_faults: kind must be one of {_KINDS}, got {kind!r}")
    if per not in _PER:
        raise PinError(f"neuron_faults: per must be one of {_PER}, got {per!r}")
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise PinError(f"neuron_faults: need finite low < high, got low={low!r}, high={high!r}")
    names = match_modules(NeuronPin(modules), [n for n, _ in module.named_modules() if n])
    if rate == 0:
        return []
    submodules = dict(module.named_modules())
    outputs = _outputs(module, submodules, names, batch) if batch is not None else {}
    pins: list[NeuronPin] = []
    for name in names:
        out = outputs.get(name)
        stuck = float(high)
        if kind == "sa0":
            stuck = 0.0
        elif kind == "sa1" and out is not None:
            stuck = _largest_magnitude(out)
        if per == "channel":
            count = out.shape[1] if out is not None else _channels(name, submodules[name])
        elif out is not None:
            count = math.prod(out.shape[1:])
        else:
            if kind == "value":
                raise PinError(
                    f"neuron_faults(per='neuron', kind='value') on {name!r}: give batch= (one input batch) so that "
                    "the output's positions, and one value each, are known"
                )
            extra = {"value": stuck} if kind == "sa1" else {}
            pins.append(NeuronPin(name, fraction=float(rate), seed=seed, **extra))
            continue
        keys, values = _draw(name, count, seed, low, high)
        chosen = keys.argsort(stable=True)[: max(1, round(rate * count))].sort().values
        if per == "channel":
            where: dict[str, Any] = {"channels": chosen.tolist()}
        else:
            shape = tuple(out.shape[1:])
            where = {"indices": [tuple(int(c) for c in torch.unravel_index(i, shape)) for i in chosen]}
        if kind == "value":
            where["value"] = values[chosen].tolist()
        elif kind == "sa1":
            where["value"] = stuck
        pins.append(NeuronPin(name, **where))  # sa0: the default value, 0.0
    return pins


def _draw(name: str, count: int, seed: int, low: float, high: float) -> tuple[Tensor, Tensor]:
    """Per unit a random key (which are stuck: the smallest) and a value in [low, high), from one
    generator seeded with ``seed`` and ``name``: a unit's key and value do not depend on the rate."""
    generator = torch.Generator().manual_seed(name_seed(f"neuron:{name}", seed))
    keys = torch.rand(count, generator=generator, dtype=torch.float64)
    values = low + (high - low) * torch.rand(count, generator=generator, dtype=torch.float64)
    return keys, values


def _channels(name: str, module: nn.Module) -> int:
    for attribute in _CHANNEL_ATTRIBUTES:
        count = getattr(module, attribute, None)
        if isinstance(count, int) and count > 0:
            return count
    raise PinError(
        f"neuron_faults: cannot tell how many output channels {name!r} ({type(module).__name__}) has without a "
        "forward: give batch= (one input batch)"
    )


@torch.no_grad()
def _outputs(
    module: nn.Module, submodules: dict[str, nn.Module], names: Sequence[str], batch: Any
) -> dict[str, Tensor]:
    """Each named module's (first) output on one forward of ``batch``."""
    seen: dict[str, Tensor] = {}
    hooks = []
    for name in names:
        def record(mod: nn.Module, args: Any, output: Any, name: str = name) -> None:
            first = output[0] if isinstance(output, tuple) else output
            if isinstance(first, Tensor) and name not in seen:
                seen[name] = first.detach()

        hooks.append(submodules[name].register_forward_hook(record))
    try:
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        module(inputs)
    finally:
        for hook in hooks:
            hook.remove()
    missing = [n for n in names if n not in seen]
    if missing:
        raise PinError(f"neuron_faults: {missing} gave no tensor output on the batch (not called by the forward?)")
    return seen


def _largest_magnitude(out: Tensor) -> float:
    largest = out.abs().max().to(torch.float64).reshape(1)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)  # the same stuck value on every rank
    return float(largest.item())




class NeuronPatch:
    """Stuck neurons put into a model for a ``with`` block (a test-time campaign's draw), taken out on exit.

    The forward hooks of :class:`~lightning_pin.core.kinds.neuron.NeuronHold` without a pin handle:
    no stored element or word changes (``elements`` and ``changed_bits`` are 0, as in a retrained
    study's rows); ``units`` counts the stuck units (channels, or output positions) the block's
    forwards resolved.

    Example::

        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 4))
        >>> with NeuronPatch(net, neuron_faults(net, "0", 0.5, kind="sa1", high=3.0)) as patch:
        ...     out = net(torch.zeros(1, 2))
        >>> sorted(out[0].tolist()).count(3.0), patch.units, patch.elements, patch.changed_bits
        (2, 2, 0, 0)
    """

    def __init__(self, module: nn.Module, pins: Sequence[NeuronPin]) -> None:
        from lightning_pin.core.kinds.neuron import NeuronHold

        self.hold = NeuronHold(pins, module)
        self.changed_bits = 0
        self.elements = 0
        self.units = 0
        self._hooks: list[Any] = []

    def __enter__(self) -> NeuronPatch:
        self._hooks = self.hold.attach()
        return self

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.units = sum(int(p["flat"].numel()) for p in self.hold.state_dict()["positions"])


__all__ = ["NeuronPatch", "neuron_faults"]
