"""Stuck-neuron faults: a seeded draw of dead or saturated channels / output positions.

:func:`neuron_faults` returns :class:`~lightning_pin.NeuronPin` lists, to give to
:func:`~lightning_pin.pin` or :class:`~lightning_pin.PinCallback` next to weight pins.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from lightning_pin.batches import TARGET_KEYS, call_arguments
from lightning_pin.core.errors import PinError
from lightning_pin.core.kinds.neuron import NeuronPin, check_levels, feature_axis, match_modules, module_feature_axis
from lightning_pin.core.rules import fraction_count, seeded_generator, smallest_keys

_KINDS = ("sa0", "sa1", "value")
_PER = ("channel", "neuron")
# The attributes that give the number of a module's features on its feature axis without a forward
# (Hugging Face's Conv1D: nf; a transformer layer: its attention's embed_dim).
_CHANNEL_ATTRIBUTES = (
    "out_channels", "out_features", "num_features", "num_channels", "embedding_dim", "embed_dim", "nf",
    "normalized_shape", "hidden_size",
)


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
    axis: Optional[int] = None,
) -> list[NeuronPin]:
    """A ``rate`` fraction of the channels (``per="channel"``) or of the per-sample output
    positions (``per="neuron"``) of each module of ``module`` that ``modules`` matches, stuck.

    Channels are counted on each module's feature axis, the one :class:`~lightning_pin.NeuronPin`
    sticks (axis 1 for a convolution's channels, the last axis for a linear layer's, an embedding's,
    a norm's or a transformer layer's features, also over ``(batch, seq, features)``), and every
    pin drawn names that axis (``axis=1`` / ``axis=-1``); ``axis=`` (an int) overrides it for every
    module.

    ``kind="sa0"``: stuck at 0 (a dead unit); ``"sa1"``: stuck at ``high`` (saturated), or, with
    ``batch`` given, at the module's largest output magnitude on that batch (the largest over
    ranks under torch.distributed); ``"value"``: each at a seeded value in ``[low, high)``.

    Every module draws ``round(rate * n)`` (at least one for ``rate > 0``) of its ``n`` units from
    a generator seeded with ``seed`` and the module's name: the same faults on every rank and run,
    and nested across rates (with one seed, a higher rate's faults hold a lower rate's, at the
    same values). The output shapes come from ``batch`` (one forward, in the module's current
    mode, without gradients), else from the module's attributes (``out_channels``,
    ``out_features``, ``num_features``, ``embedding_dim``, ``embed_dim``, ``nf``,
    ``normalized_shape``, ...) for ``per="channel"``; ``per="neuron"`` without ``batch`` gives a
    ``fraction`` pin (positions resolved at the first forward; not with ``kind="value"``).

    Raises:
        PinError: ``rate`` outside [0, 1], an unknown ``kind`` / ``per``, ``low >= high``, a pattern
            matching no module or matching a module and its descendants (see :class:`~lightning_pin.NeuronPin`),
            a shape that cannot be known without ``batch``, or an output without a known feature axis.

    Example::

        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
        >>> neuron_faults(net, "0", 0.25, seed=1)
        [NeuronPin(modules='0', channels=(1, 3), axis=1)]
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8))  # features: the last axis, (batch, seq, features) too
        >>> neuron_faults(mlp, "0", 0.25, seed=1)
        [NeuronPin(modules='0', channels=(1, 3), axis=-1)]
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
    if axis is not None and (isinstance(axis, bool) or not isinstance(axis, int) or axis == 0):
        raise PinError(f"neuron_faults: axis must be None (each module's feature axis) or a non-zero int, got {axis!r}")
    probe = NeuronPin(modules)
    names = match_modules(probe, [n for n, _ in module.named_modules() if n])
    check_levels(probe, names)
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
        pin_axis = axis
        if per == "channel":
            pin_axis, count = _channel_axis(name, submodules[name], out, axis)
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
        chosen, values = _draw(name, count, rate, seed, low, high)
        if per == "channel":
            where: dict[str, Any] = {"channels": chosen.tolist(), "axis": pin_axis}
        else:
            shape = tuple(out.shape[1:])
            where = {"indices": [tuple(int(c) for c in torch.unravel_index(i, shape)) for i in chosen]}
        if kind == "value":
            where["value"] = values[chosen].tolist()
        elif kind == "sa1":
            where["value"] = stuck
        pins.append(NeuronPin(name, **where))  # sa0: the default value, 0.0
    return pins


def _draw(name: str, count: int, rate: float, seed: int, low: float, high: float) -> tuple[Tensor, Tensor]:
    """The stuck units (sorted) and a value in [low, high) per unit, from one generator seeded with ``seed``
    and ``name``: the units are drawn as a ``fraction=rate`` (:func:`~lightning_pin.core.rules.smallest_keys`,
    a random key per unit), then the values, so a unit's key and value do not depend on the rate."""
    generator = seeded_generator(f"neuron:{name}", seed)
    chosen = smallest_keys(count, fraction_count(rate, count), generator)
    values = low + (high - low) * torch.rand(count, generator=generator, dtype=torch.float64)
    return chosen, values


def _channel_axis(
    name: str, module: nn.Module, out: Optional[Tensor], axis: Optional[int]
) -> tuple[Optional[int], int]:
    """``(axis the pin names, channels on it)``: from the output of a batch when there is one, else from
    the module's type (its feature axis) and attributes (how many features)."""
    if out is not None:
        ndim = out.dim()
        if axis is not None:
            if not -ndim < axis < ndim:
                raise PinError(
                    f"neuron_faults: axis {axis} is not an axis of {name!r}'s output of shape {tuple(out.shape)}"
                )
            return axis, out.shape[axis]
        resolved = feature_axis(module, name, tuple(out.shape))
        by_type = module_feature_axis(module)
        return (by_type if by_type is not None and ndim > 2 else resolved), out.shape[resolved]
    by_type = module_feature_axis(module)
    if axis is not None and axis != by_type:
        raise PinError(
            f"neuron_faults: channels of {name!r} ({type(module).__name__}) along axis {axis}: how many there are "
            "needs the output's shape; give batch= (one input batch)"
        )
    return (axis if axis is not None else by_type), _channels(name, module)


def _channels(name: str, module: nn.Module) -> int:
    for owner in (module, getattr(module, "self_attn", None)):  # a transformer layer: its attention's width
        for attribute in _CHANNEL_ATTRIBUTES:
            count = getattr(owner, attribute, None)
            if isinstance(count, (tuple, list)) and count:
                count = count[-1]  # normalized_shape: the last axis is the features
            if isinstance(count, int) and not isinstance(count, bool) and count > 0:
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
        if isinstance(batch, Mapping):
            # A tokenizer's dict: fed as every tool feeds it (its input keys to the forward by name).
            args, kwargs = call_arguments(module, {k: v for k, v in batch.items() if k not in TARGET_KEYS})
            module(*args, **kwargs)
        else:
            module(batch[0] if isinstance(batch, (tuple, list)) else batch)
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
