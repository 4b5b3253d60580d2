"""Stuck neurons: the output kind. Positions of a module's output held in every forward.

A permanent fault in an accelerator's processing element or output register does not sit in a
stored weight: every value that unit computes reads a stuck value. A :class:`NeuronPin` selects
positions of each matched module's output (whole channels, positions of the per-sample output,
or a seeded fraction of them) and, in **every** forward (training and evaluation, every sample
of the batch), makes them read ``value``, or the computed value with ``stuck_at_zero`` /
``stuck_at_one`` bits stuck in its word (``bits = (bits & ~M0) | M1`` in the output's dtype).
No gradient flows into a stuck position; the rest of the network trains around it.

Weight kinds (:mod:`lightning_pin.core.kinds.base`) act on parameters after each optimizer
step; this kind acts on module outputs in the forward, so it has its own runtime,
:class:`NeuronHold`: patterns matched at :func:`~lightning_pin.pin` / fit start, positions
resolved on the module's first output (refusals raised before that forward returns), a forward
hook per matched module, a saved form (under ``"outputs"`` of the pin state) and summary words.
The registry (:data:`lightning_pin.core.kinds.OUTPUT_KINDS`) lists it as :class:`NeuronKind`.

Example::

    >>> import torch
    >>> from lightning_pin import NeuronPin, pin
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with pin(model, optimizer, [NeuronPin("0", channels=[1, 3], value=0.5)]):
    ...     hidden = model[0](torch.randn(5, 3))
    >>> hidden[:, [1, 3]].unique().tolist()
    [0.5]
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import fnmatch
import functools
import hashlib
import math
import numbers
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable, ClassVar, Optional, Union

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_pin.core.bitwords import hex_word
from lightning_pin.core.errors import PinError
from lightning_pin.core.kinds.stuck_bits import (
    BITS_DTYPES, EXPONENT_BITS, check_bits, check_masks_hold, overlapping_bits,
)
from lightning_pin.core.rules import (
    check_fraction, check_patterns, check_seed, check_steps, fraction_count, from_mapping, in_window, is_int,
    seeded_generator, smallest_keys, spec_repr, windows_overlap,
)
from lightning_pin.core.spec import _is_bool, check_value

_FIELDS = (
    "modules", "channels", "indices", "fraction", "seed", "axis", "value", "stuck_at_zero", "stuck_at_one",
    "start_step", "stop_step",
)
#: Version of the saved form (:meth:`NeuronHold.state_dict`). Version 1 (before the feature axis) saved no
#: axis: its pins without ``axis=`` meant axis 1, and still do when such a state is loaded.
NEURON_STATE_VERSION = 2
#: The axis ``axis=None`` meant before the feature axis (saved states of version 1).
LEGACY_AXIS = 1


class _DefaultValue(float):
    """The default ``value=0.0``: told apart from an explicit ``0.0``, so that ``value`` given with
    stuck bits is refused while stuck bits alone are not."""

    def __repr__(self) -> str:
        return "0.0"


_ZERO = _DefaultValue(0.0)


class _FromStart(int):
    """The default ``start_step=0``, Pin's: told apart from an explicit ``0`` by the fingerprint only, which
    hashes it as the ``None`` this default was before NeuronPin took Pin's step rules, so the fingerprints
    of saved states and checkpoint keys stay what they were (an explicit ``0`` hashed as ``0`` then too)."""

    def __repr__(self) -> str:
        return "0"


_FROM_START = _FromStart(0)


def _plain(value: Any) -> Any:
    """Containers (OmegaConf's too) as tuples and dicts, numpy's numbers as Python's: what the fingerprint hashes."""
    if isinstance(value, (str, bytes, Tensor)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence):
        return tuple(_plain(v) for v in value)
    if isinstance(value, numbers.Integral) and not isinstance(value, (int, bool)):
        return int(value)  # numpy's int64: refused before the shared rules, so no saved fingerprint holds one
    if isinstance(value, numbers.Real) and not isinstance(value, (int, float)) and not _is_bool(value):
        return float(value)  # numpy's float32 (float64 is a float: kept as it was)
    return value


@dataclasses.dataclass(frozen=True, repr=False)
class NeuronPin:
    """Positions of each matched module's output, stuck in every forward.

    Args:
        modules: A name of ``named_modules()``, a glob (``"layer*.conv1"``), a ``re:`` pattern (the
            whole name must match), or a list of them.
        channels: Whole channels along ``axis``, held at every position of every other axis (every
            pixel, every token, whatever the sequence length of each forward).
        indices: Positions in the per-sample output shape (tuples, or ints for a 1-d per-sample shape).
        fraction: A seeded ``round(fraction * n)`` (at least 1) of the ``n`` per-sample positions,
            drawn from ``seed`` and the module's name as :class:`~lightning_pin.Pin` draws a fraction
            of elements (the smallest of seeded random keys): the same on every rank, run and resume,
            and nested (a larger fraction with the same seed holds every position of a smaller one).
        seed: The seed of ``fraction``.
        axis: The axis of ``channels``, counted with the batch as axis 0 (``-1``: the last). ``None``
            (default): the module's feature axis, decided at its first forward (see
            :func:`feature_axis`): axis 1 for convolutions, transposed convolutions and batch /
            instance / group norms; the last axis for ``Linear``, ``Bilinear``, ``Embedding``,
            ``LayerNorm``, ``RMSNorm``, ``MultiheadAttention``, ``TransformerEncoderLayer`` /
            ``DecoderLayer`` and Hugging Face's ``Conv1D`` (a linear layer's features, also over
            ``(batch, seq, features)``); axis 1 for any 2-D output and for a 4-D / 5-D output of
            another module; a 3-D output of another module is refused (give ``axis=1`` or ``-1``).
        value: What the selected positions read: a number, or one number per channel / index.
        stuck_at_zero: Bits stuck at 0 in the output word (an int; ``0x80000000`` is float32's sign bit).
        stuck_at_one: Bits stuck at 1. With either, the computed value keeps its other bits; ``value``
            may not be given with them.
        start_step: First optimizer step (``trainer.global_step``) at which the pin is active (default 0,
            as for :class:`~lightning_pin.Pin`; ``None``, what older configs say, means 0 too).
        stop_step: The pin is active up to this step, exclusive; ``None`` means to the end.

    At most one of ``channels``, ``indices`` and ``fraction``; none means the whole output. A
    module returning a tuple has its first output stuck. ``fraction``, ``seed``, ``start_step`` and
    ``stop_step`` follow :class:`~lightning_pin.Pin`'s rules (:mod:`lightning_pin.core.rules`): the
    same defaults, the same draw and the same refusals.

    A dead unit is in one layer: a glob or ``re:`` pattern that matches a module and one of its
    descendants (``block.*`` matching ``block.0`` and ``block.0.0``) is refused when the pin is
    placed, naming both; list the names (``["block.0", "block.0.0"]``) to pin both levels on purpose.
    The pins' summary names every matched module (and the pattern that matched it). Bad fields raise
    :class:`~lightning_pin.PinError` here; what needs the output (its shape and dtype) is checked
    on the module's first forward, before it returns.

    Example::

        >>> NeuronPin("layer1.0.conv1", channels=[3, 7])
        NeuronPin(modules='layer1.0.conv1', channels=(3, 7))
        >>> NeuronPin("fc1", indices=[5], stuck_at_one=0x40000000).describe()
        'output positions [(5,)]  stuck bits at 1 0x40000000'
        >>> NeuronPin("fc1", value=1.0, stuck_at_zero=1)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_pin.core.errors.PinError: NeuronPin(modules='fc1', value=1.0, stuck_at_zero=0x1): value= ... not both
    """

    modules: Union[str, Sequence[str]]
    channels: Optional[Union[int, Sequence[int]]] = None
    indices: Optional[Sequence[Any]] = None
    fraction: Optional[float] = None
    seed: int = 0
    axis: Optional[int] = None
    value: Union[float, Sequence[float]] = _ZERO
    stuck_at_zero: Optional[int] = None
    stuck_at_one: Optional[int] = None
    start_step: int = _FROM_START
    stop_step: Optional[int] = None

    #: What a NeuronPin is in the pin state and the registry.
    kind: ClassVar[str] = "neuron"

    def __post_init__(self) -> None:
        for name in _FIELDS:
            object.__setattr__(self, name, _plain(getattr(self, name)))
        if self.start_step is None:  # NeuronPin's default before it took Pin's: it meant 0 and hashed so
            object.__setattr__(self, "start_step", _FROM_START)
        if is_int(self.channels):
            object.__setattr__(self, "channels", (self.channels,))
        if self.indices is not None and isinstance(self.indices, Sequence):
            object.__setattr__(
                self, "indices", tuple(tuple(i) if isinstance(i, Sequence) else (i,) for i in self.indices)
            )
        if isinstance(self.value, Tensor):
            object.__setattr__(self, "value", tuple(float(v) for v in self.value.reshape(-1).tolist()))
        _check(self)

    @classmethod
    def from_config(cls, config: NeuronPin | Mapping[str, Any]) -> NeuronPin:
        """A ``NeuronPin`` from one or from a mapping with its keys (Hydra / YAML; ``modules`` required).

        Raises:
            PinError: neither a ``NeuronPin`` nor a mapping, unknown keys, or no ``modules``.
        """
        return from_mapping(
            cls, config, _FIELDS, what="neuron pin", required="modules",
            hint="name the modules whose outputs to pin, e.g. modules: 'layer1.0.conv1'",
        )

    @property
    def patterns(self) -> tuple[str, ...]:
        """The module patterns as a tuple."""
        return (self.modules,) if isinstance(self.modules, str) else tuple(self.modules)

    @property
    def stuck_bits(self) -> bool:
        """Whether the pin sticks bits (else it writes ``value``)."""
        return self.stuck_at_zero is not None or self.stuck_at_one is not None

    def in_window(self, step: int) -> bool:
        """Whether the pin is active at optimizer step ``step`` (in ``[start_step, stop_step)``, as a ``Pin``)."""
        return in_window(self, step)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A NeuronPin pickled before it took Pin's step rules may hold start_step=None (then the default).
        if state.get("start_step", 0) is None:
            state = {**state, "start_step": _FROM_START}
        self.__dict__.update(state)

    def fingerprint(self, *, legacy: bool = False) -> str:
        """A digest of every field: stable across processes, so a resume finds its state.

        ``legacy``: the digest a pin with these fields had before the feature axis (``axis=None``
        was then ``axis=1``), which a version-1 saved state holds. The default ``start_step`` is hashed
        as ``None``, what it was before NeuronPin took Pin's (``0``): every digest stays what it was.
        """
        digest = hashlib.sha256(b"NeuronPin")
        for name in _FIELDS:
            value = getattr(self, name)
            if legacy and name == "axis" and value is None:
                value = LEGACY_AXIS
            if name == "start_step" and type(value) is _FromStart:
                value = None
            digest.update(f"{name}={value!r};".encode())
        return digest.hexdigest()[:16]

    def to_config(self) -> dict[str, Any]:
        """The fields as plain Python (lists, numbers, strings): a mapping :meth:`from_config` reads back.

        Example::

            >>> pin = NeuronPin("fc1", channels=[3], value=0.5)
            >>> NeuronPin.from_config(pin.to_config()) == pin
            True
        """

        def plain(value: Any) -> Any:
            if isinstance(value, tuple):
                return [plain(v) for v in value]
            return float(value) if isinstance(value, float) else value

        config = {"modules": plain(self.modules)}
        for field in dataclasses.fields(self)[1:]:
            value = getattr(self, field.name)
            if type(value) is type(field.default) and value == field.default:
                continue  # a default (the default value=0.0 too, told apart from an explicit 0.0)
            config[field.name] = plain(value)
        return config

    def describe(self, axis: Optional[str] = None) -> str:
        """The summary's words: where in the output and what it reads (``axis``: the words for the axis
        in use, when the pin is on a module; else its ``axis`` field)."""
        if self.channels is not None:
            if axis is None:
                axis = "the feature axis" if self.axis is None else f"axis {self.axis}"
            where = f"output channels {list(self.channels)} ({axis})"
        elif self.indices is not None:
            shown = list(self.indices[:6])
            where = f"output positions {shown}{' ...' if len(self.indices) > 6 else ''}"
        elif self.fraction is not None:
            where = f"output fraction {self.fraction:g} (seed {self.seed})"
        else:
            where = "whole output"
        if self.stuck_bits:
            parts = []
            if self.stuck_at_zero:
                parts.append(f"at 0 {hex(self.stuck_at_zero)}")
            if self.stuck_at_one:
                parts.append(f"at 1 {hex(self.stuck_at_one)}")
            what = "stuck bits " + ", ".join(parts or ["(none)"])
        elif isinstance(self.value, tuple):
            what = f"stuck at {len(self.value)} values in [{min(self.value):g}, {max(self.value):g}]"
        else:
            what = f"stuck at {float(self.value)!r}"
        window = ""
        if self.start_step or self.stop_step is not None:
            window = f"  steps [{self.start_step}, {'end' if self.stop_step is None else self.stop_step})"
        return f"{where}  {what}{window}"

    def __repr__(self) -> str:
        return spec_repr(self)


def _check(pin: NeuronPin) -> None:
    """Every refusal that needs no module (at construction). The fields a ``Pin`` has too (``fraction``,
    ``seed``, ``start_step`` / ``stop_step``, the numbers of ``value``, the stuck-bit masks) are refused by
    the same checks, in the same words."""
    check_patterns(pin, "modules", pin.modules, "module names, globs or 're:' patterns, e.g. 'layer*.conv1'")
    given = [name for name in ("channels", "indices", "fraction") if getattr(pin, name) is not None]
    if len(given) > 1:
        raise PinError(f"{pin!r}: give at most one of channels / indices / fraction, got {' and '.join(given)}")
    if pin.channels is not None:
        if not isinstance(pin.channels, tuple) or not pin.channels or not all(
            is_int(c) and c >= 0 for c in pin.channels
        ):
            raise PinError(f"{pin!r}: channels must be a non-empty list of integers >= 0")
    if pin.indices is not None:
        ok = isinstance(pin.indices, tuple) and pin.indices and all(
            isinstance(i, tuple) and i and all(is_int(c) and c >= 0 for c in i) for i in pin.indices
        )
        if not ok or len({len(i) for i in pin.indices}) != 1:
            raise PinError(
                f"{pin!r}: indices must be a non-empty list of positions in the per-sample output shape, each a tuple "
                "of integers >= 0 of one length (or ints, for a 1-d per-sample output)"
            )
    check_fraction(pin, pin.fraction)
    check_seed(pin, pin.seed)
    if pin.axis is not None and (not is_int(pin.axis) or pin.axis == 0):
        raise PinError(
            f"{pin!r}: axis must be None (the module's feature axis) or a non-zero integer (axis 0 is the batch), "
            f"got {pin.axis!r}"
        )
    _check_value(pin)
    for name in ("stuck_at_zero", "stuck_at_one"):
        mask = getattr(pin, name)
        if mask is not None and not is_int(mask):
            raise PinError(f"{pin!r}: {name} must be an int bit mask (one for every position), got {mask!r}")
        check_bits(pin, name, mask)  # Pin's refusal of a negative mask
    if pin.stuck_bits and type(pin.value) is not _DefaultValue:
        raise PinError(
            f"{pin!r}: value= (the whole output) or stuck_at_zero= / stuck_at_one= (some bits of its word), not both"
        )
    both = overlapping_bits(pin.stuck_at_zero, pin.stuck_at_one)
    if both is not None:
        raise PinError(
            f"{pin!r}: stuck_at_zero and stuck_at_one overlap ({both}): a bit cannot be stuck at 0 and at 1"
        )
    if isinstance(pin.value, tuple) and pin.channels is None and pin.indices is None:
        raise PinError(f"{pin!r}: a list of values needs channels= or indices= (one value each)")
    if isinstance(pin.value, tuple):
        count = len(pin.channels if pin.channels is not None else pin.indices)
        if len(pin.value) != count:
            raise PinError(f"{pin!r}: {len(pin.value)} values for {count} selected positions")
    check_steps(pin, pin.start_step, pin.stop_step)


def _check_value(pin: NeuronPin) -> None:
    """A number or a non-empty list of numbers; the numbers themselves (no bool, complex, NaN or inf) by
    :func:`~lightning_pin.core.spec.check_value`, Pin's check."""
    value = pin.value
    flat = isinstance(value, tuple) and value and not any(isinstance(v, (tuple, str, bytes)) for v in value)
    if not (flat or isinstance(value, numbers.Number) or _is_bool(value)):
        raise PinError(f"{pin!r}: value must be a finite number or a non-empty list of them, got {value!r}")
    check_value(pin, list(value) if isinstance(value, tuple) else value)


def match_modules(pin: NeuronPin, names: Sequence[str]) -> list[str]:
    """The names of ``named_modules()`` that ``pin``'s patterns match, in module order.

    Raises:
        PinError: a pattern matches no module (with the closest names).
    """
    stripped = [n.replace("_orig_mod.", "") for n in names]
    hits: set[str] = set()
    for pattern in pin.patterns:
        if pattern.startswith("re:"):
            regex = re.compile(pattern[3:])
            found = [n for n, bare in zip(names, stripped) if regex.fullmatch(n) or regex.fullmatch(bare)]
        else:
            found = [n for n, bare in zip(names, stripped)
                     if fnmatch.fnmatchcase(n, pattern) or fnmatch.fnmatchcase(bare, pattern)]
        if not found:
            close = difflib.get_close_matches(pattern.removeprefix("re:"), stripped, n=5, cutoff=0.3)
            hint = f"closest names: {close}" if close else f"module names start with: {stripped[:5]}"
            raise PinError(
                f"{pin!r}: pattern {pattern!r} matches no module of the model ({len(names)} modules); {hint}. "
                "Globs and 're:' patterns must match the whole name of named_modules()."
            )
        hits.update(found)
    return [n for n in names if n in hits]


def _is_exact(pattern: str) -> bool:
    """Whether ``pattern`` names one module (no glob character, not ``re:``)."""
    return not pattern.startswith("re:") and not any(c in pattern for c in "*?[")


def check_levels(pin: NeuronPin, matched: Sequence[str]) -> None:
    """Refuse a pin whose glob / ``re:`` patterns match a module and one of its descendants.

    A dead unit is in one layer: ``block.*`` matching ``block.0`` and ``block.0.0`` would stick the
    channel twice, in the block's output and in its inner layer's. Both levels may be pinned when
    each of them is named exactly (``["block.0", "block.0.0"]``).

    Raises:
        PinError: naming the first module matched at two levels, the patterns and what to give instead.
    """
    exact = {p for p in pin.patterns if _is_exact(p)}
    named = {n for n in matched if n in exact or n.replace("_orig_mod.", "") in exact}
    for outer in matched:
        inner = [n for n in matched if n.startswith(outer + ".") and not (outer in named and n in named)]
        if inner:
            parent = re.escape(outer.rpartition(".")[0] or outer)
            raise PinError(
                f"{pin!r}: its patterns match {outer!r} and modules inside it ({inner[:4]}"
                f"{' ...' if len(inner) > 4 else ''}): a stuck unit is in one layer, and the channel would be stuck at "
                f"every level. Give patterns that match one level only (e.g. 're:{parent}\\.\\d+' "
                "or a list of names), or name each module exactly to pin several levels on purpose"
            )


#: Modules whose feature axis is 1 (channels first): convolutions, transposed convolutions, norms over channels.
_CHANNELS_FIRST: tuple[type, ...] = (
    nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm, nn.GroupNorm,
)
#: Modules whose feature axis is the last (a linear layer's features, also over ``(batch, seq, features)``).
_FEATURES_LAST: tuple[type, ...] = (
    nn.Linear, nn.Bilinear, nn.Embedding, nn.LayerNorm, nn.MultiheadAttention, nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer, *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)


def _is_hf_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2's linear layers, weight ``(in, out)``), told by class and module
    name: ``transformers`` is not imported for it."""
    kind = type(module)
    return kind.__name__ == "Conv1D" and kind.__module__.split(".")[0] == "transformers"


def module_feature_axis(module: nn.Module) -> Optional[int]:
    """The feature axis the module's type tells: ``1`` (channels first), ``-1`` (features last) or ``None``."""
    if isinstance(module, _CHANNELS_FIRST):
        return 1
    if isinstance(module, _FEATURES_LAST) or _is_hf_conv1d(module):
        return -1
    return None


def feature_axis(module: nn.Module, name: str, shape: Sequence[int]) -> int:
    """The axis (1 .. ndim-1) of ``module``'s output of ``shape`` that holds its features: what
    ``NeuronPin(axis=None)`` sticks channels along (see :class:`NeuronPin`'s ``axis``).

    Example::

        >>> feature_axis(nn.Linear(4, 8), "fc", (2, 5, 8)), feature_axis(nn.Conv1d(3, 8, 1), "conv", (2, 8, 5))
        (2, 1)

    Raises:
        PinError: a 3-D (or 6-D and more) output of a module whose type does not tell its feature axis.
    """
    ndim = len(shape)
    if ndim == 2:
        return 1
    axis = module_feature_axis(module)
    if axis is not None:
        return axis % ndim
    if ndim in (4, 5):
        return 1
    raise PinError(
        f"neuron pin on {name!r} ({type(module).__name__}): its output of shape {tuple(shape)} has no known feature "
        f"axis (channels first or last?): give axis=1 (channels first, like a convolution's) or axis=-1 (features "
        "last, like a linear layer's over (batch, seq, features))"
    )


def axis_words(axis: int, ndim: int) -> str:
    """``axis 1`` / ``axis 2, the last``: the summary's name of the axis in use."""
    return f"axis {axis}" + (", the last" if axis == ndim - 1 and ndim > 2 else "")


def fraction_positions(name: str, numel: int, fraction: float, seed: int) -> Tensor:
    """``round(fraction * numel)`` (at least 1) flat per-sample positions, sorted: those with the
    smallest seeded random keys, so a larger fraction with the same seed holds a smaller one's.

    The draw :func:`~lightning_pin.core.plan.fraction_indices` makes for a ``Pin`` (the same count, the
    same generator from ``seed`` and the name, the same keys), at every count: a ``Pin`` switches to a
    sparse draw, which does not nest, at ``count <= numel // 8`` to spare permuting a huge weight.

    Example::

        >>> from lightning_pin.core.plan import fraction_indices
        >>> torch.equal(fraction_positions("fc1", 64, 0.5, 3), fraction_indices("fc1", 64, 0.5, 3))
        True
        >>> small, large = fraction_positions("fc1", 64, 0.05, 3), fraction_positions("fc1", 64, 0.5, 3)
        >>> bool(torch.isin(small, large).all())  # nested
        True
    """
    return smallest_keys(numel, fraction_count(fraction, numel), seeded_generator(name, seed))


# ------------------------------------------------------------------------------------------------
# Resolution on a module's first output


@dataclasses.dataclass
class _Entry:
    """One pin on one module, resolved: the flat positions in ``shape`` (a broadcastable per-sample
    shape: size 1 on every axis but ``axis`` for channels), and what they read."""

    pin_id: int
    pin: NeuronPin
    shape: tuple[int, ...]  # with the batch axis (size 1)
    flat: Tensor  # int64, sorted, into prod(shape)
    values: Optional[Tensor] = None  # float64, one per flat position (value pins)
    axis: Optional[int] = None  # channels: the axis in use (1 .. ndim-1)

    def dense(self, full: tuple[int, ...]) -> tuple[Tensor, Optional[Tensor]]:
        """The mask (and values) in ``full``'s broadcast shape, on the CPU."""
        mask = torch.zeros(math.prod(self.shape), dtype=torch.bool)
        mask[self.flat] = True
        mask = mask.reshape(self.shape).expand(full)
        if self.values is None:
            return mask.clone(), None
        values = torch.zeros(math.prod(self.shape), dtype=torch.float64)
        values[self.flat] = self.values
        return mask.clone(), values.reshape(self.shape).expand(full).clone()


def _resolve_entry(
    pin_id: int, pin: NeuronPin, name: str, module: nn.Module, out: Tensor, saved: Optional[Mapping[str, Any]],
    default_axis: Optional[int],
) -> _Entry:
    where = f"{pin!r} on {name!r}"
    sample = tuple(out.shape[1:])
    ndim = out.dim()
    axis: Optional[int] = None
    if pin.channels is not None:
        if saved is not None and saved.get("axis") is not None:
            axis = int(saved["axis"])  # the axis the state was saved with: it means the same thing
        elif pin.axis is not None:
            axis = pin.axis if pin.axis > 0 else pin.axis + ndim
        elif default_axis is not None:  # a version-1 state: axis=None meant axis 1 then
            axis = default_axis
        else:
            axis = feature_axis(module, name, tuple(out.shape))
        if not 1 <= axis < ndim:
            raise PinError(
                f"{where}: axis {pin.axis} is not a channel axis of its output of shape {tuple(out.shape)} (axis 0 is "
                f"the batch; give 1..{ndim - 1})"
            )
        size = out.shape[axis]
        bad = [c for c in pin.channels if c >= size]
        if bad:
            raise PinError(
                f"{where}: channels {bad} are outside its output's {size} channels along axis {axis} (output shape "
                f"{tuple(out.shape)}); give channels in 0..{size - 1}"
            )
        shape = tuple(size if i == axis else 1 for i in range(ndim))
        flat = torch.tensor(sorted(set(pin.channels)), dtype=torch.int64)
        order = list(pin.channels)
    elif pin.indices is not None:
        if len(pin.indices[0]) != len(sample):
            raise PinError(
                f"{where}: indices have {len(pin.indices[0])} coordinates, its per-sample output shape {sample} has "
                f"{len(sample)} (positions are per sample, without the batch axis)"
            )
        bad = [i for i in pin.indices if any(c >= s for c, s in zip(i, sample))]
        if bad:
            raise PinError(
                f"{where}: indices {bad[:5]} are outside its per-sample output shape {sample} (output shape "
                f"{tuple(out.shape)})"
            )
        shape = (1, *sample)
        coords = torch.tensor(pin.indices, dtype=torch.int64)
        strides = torch.tensor([math.prod(sample[i + 1:]) for i in range(len(sample))], dtype=torch.int64)
        positions = (coords * strides).sum(1)
        flat = positions.unique()
        order = positions.tolist()
    else:
        shape = (1, *sample)
        numel = math.prod(sample)
        if pin.fraction is not None:
            flat = fraction_positions(name, numel, float(pin.fraction), int(pin.seed))
        else:  # the whole output: one position broadcast over any shape
            shape, flat = (1,) * ndim, torch.zeros(1, dtype=torch.int64)
        order = None
    if saved is not None:
        saved_shape, saved_flat = tuple(saved["shape"]), saved["flat"]
        if saved_shape != shape:
            raise PinError(
                f"{where}: the saved pin state holds its positions in an output of shape {saved_shape[1:]}, the "
                f"module's output now has {shape[1:]}: resume with the model the state was saved with"
            )
        flat = saved_flat.to(torch.int64)
    values = None
    if not pin.stuck_bits:
        if isinstance(pin.value, tuple):
            by_position = dict(zip(order, pin.value))
            values = torch.tensor([by_position[int(p)] for p in flat.tolist()], dtype=torch.float64)
        else:
            values = torch.full((flat.numel(),), float(pin.value), dtype=torch.float64)
        cast = values.to(out.dtype)
        if not torch.isfinite(cast).all():
            raise PinError(f"{where}: value {pin.value!r} overflows its output's dtype {out.dtype}")
    return _Entry(pin_id, pin, shape, flat, values, axis)


def _check_masks(pin: NeuronPin, name: str, dtype: torch.dtype, width: int) -> None:
    """The weight pins' check (:func:`~lightning_pin.core.kinds.stuck_bits.check_masks_hold`) on a neuron
    pin's masks in its output's word: stuck bits that alone make every value inf or NaN are refused."""
    int_dtype = BITS_DTYPES[dtype]
    zero = torch.tensor([_signed(pin.stuck_at_zero or 0, width)], dtype=int_dtype)
    one = torch.tensor([_signed(pin.stuck_at_one or 0, width)], dtype=int_dtype)
    check_masks_hold(
        zero, one, dtype,
        overlap=lambda at, bits: f"{pin!r} on {name!r}: bits {bits} stuck at 0 and at 1",
        every_exponent=lambda at, ones: (
            f"{pin!r} on {name!r}: stuck_at_one={ones} sets every exponent bit of its output's {dtype} word "
            f"({hex_word(EXPONENT_BITS[dtype], width)}): the stuck units would read inf or NaN whatever the layer "
            "computes; leave at least one exponent bit free"
        ),
    )


def _signed(mask: int, width: int) -> int:
    """``mask`` as the signed integer of ``width`` bits with the same bits (``0x80000000`` -> ``-2**31``)."""
    return mask - (1 << width) if mask >= 1 << (width - 1) else mask


class _Composed:
    """The tensors one forward uses for one set of active pins, on the output's device and dtype."""

    def __init__(self, entries: Sequence[_Entry], out: Tensor, shapes: Sequence[tuple[int, ...]]) -> None:
        # ``shapes``: of every entry on the module, active or not (none active: nothing to write).
        full = tuple(torch.broadcast_shapes(*shapes))
        self.shape = full
        self.dtype, self.device = out.dtype, out.device
        value_mask = torch.zeros(full, dtype=torch.bool)
        values = torch.zeros(full, dtype=torch.float64)
        bits_mask = torch.zeros(full, dtype=torch.bool)
        int_dtype = BITS_DTYPES.get(out.dtype)
        width = torch.iinfo(int_dtype).bits if int_dtype is not None else 0
        keep = torch.full(full, -1, dtype=torch.int64)
        set_ = torch.zeros(full, dtype=torch.int64)
        for e in entries:
            mask, v = e.dense(full)
            if v is not None:
                value_mask |= mask
                values = torch.where(mask, v, values)
            else:
                bits_mask |= mask
                keep = torch.where(mask, torch.tensor(~_signed(e.pin.stuck_at_zero or 0, width)), keep)
                set_ = torch.where(mask, torch.tensor(_signed(e.pin.stuck_at_one or 0, width)), set_)
        device = out.device
        self.value_mask = value_mask.to(device) if bool(value_mask.any()) else None
        self.values = values.to(out.dtype).to(device) if self.value_mask is not None else None
        self.bits_mask = bits_mask.to(device) if bool(bits_mask.any()) else None
        #: Whether any position is written (else the hook leaves the output alone).
        self.writes = self.value_mask is not None or self.bits_mask is not None
        if self.bits_mask is not None:
            self.int_dtype = int_dtype
            self.keep = keep.to(int_dtype).to(device)
            self.set = set_.to(int_dtype).to(device)
        #: What the forward hook calls: :meth:`apply`, or for stuck values alone (the common case)
        #: its one ``where`` bound from C, without a Python frame per module and forward.
        self.write: Callable[[Tensor], Tensor] = (
            functools.partial(torch.where, self.value_mask, self.values) if self.bits_mask is None else self.apply
        )

    def apply(self, out: Tensor) -> Tensor:
        """``out`` with the stuck positions written; no gradient flows into them (sync-free)."""
        stuck = out
        if self.bits_mask is not None:
            bits = out.detach().view(self.int_dtype)
            word = ((bits & self.keep) | self.set).view(out.dtype)
            stuck = torch.where(self.bits_mask, word, stuck)
        if self.value_mask is not None:
            stuck = torch.where(self.value_mask, self.values, stuck)
        return stuck


class NeuronHold:
    """The neuron pins of one model at work: forward hooks on the matched modules.

    Built by :func:`~lightning_pin.pin` and :class:`~lightning_pin.PinCallback` (patterns matched
    then: a pattern matching no module is a :class:`~lightning_pin.PinError` before any forward).
    Positions resolve on each module's first output; :meth:`set_step` (called by the doors when
    the optimizer step count moves) decides which pins are active, host-side only.

    Example::

        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 3))
        >>> hold = NeuronHold([NeuronPin("0", indices=[2], value=-1.0)], model)
        >>> hooks = hold.attach()
        >>> model(torch.ones(4, 2))[:, 2].tolist()
        [-1.0, -1.0, -1.0, -1.0]
        >>> print(hold.summary())
        0  output positions [(2,)]  stuck at -1.0
        >>> for h in hooks: h.remove()
    """

    #: The output kind's name (the key of its saved form under ``"outputs"`` of the pin state).
    kind: ClassVar[str] = "neuron"

    def __init__(self, pins: Sequence[NeuronPin], module: nn.Module) -> None:
        self.pins = list(pins)
        names = [n for n, _ in module.named_modules() if n]  # the root ("") is the model, not a unit
        modules = dict(module.named_modules())
        #: Module name -> the ids of the pins on it.
        self.matched: dict[str, list[int]] = {}
        for pin_id, p in enumerate(self.pins):
            found = match_modules(p, names)
            check_levels(p, found)
            for name in found:
                self.matched.setdefault(name, []).append(pin_id)
        self.matched = {n: self.matched[n] for n in names if n in self.matched}
        self._modules = {n: modules[n] for n in self.matched}
        self._entries: dict[str, list[_Entry]] = {}
        self._saved: dict[tuple[int, str], Mapping[str, Any]] = {}
        self.step = 0
        self._active = frozenset(i for i, p in enumerate(self.pins) if p.in_window(0))
        self._composed: dict[tuple[str, frozenset[int]], _Composed] = {}
        self._seen: dict[str, tuple[int, ...]] = {}
        # The steps [first, end) over which set_step has nothing to change (no start or stop).
        self._span: tuple[int, int] = (0, 0)
        self._paused = False
        self._hooks: dict[str, Callable[..., Any]] = {}  # one hook function per module: copies share it
        # Set by a version-1 saved state: its pins without axis= meant axis 1.
        self._default_axis: Optional[int] = None

    # --------------------------------------------------------------------------------------
    # Steps

    def set_step(self, step: int) -> None:
        """Make the pins in their window at optimizer step ``step`` active (host-side only)."""
        self.step = step
        first, end = self._span
        if first <= step < end:  # no pin starts or stops in between: nothing to decide
            return
        active = frozenset(i for i, p in enumerate(self.pins) if p.in_window(step))
        edges = [e for p in self.pins for e in (p.start_step, p.stop_step) if e is not None]
        self._span = (max([e for e in edges if e <= step], default=-(1 << 62)),
                      min([e for e in edges if e > step], default=1 << 62))
        if active != self._active:
            self._active = active

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Within the block, the hooks leave every output alone: what the model computes without
        the faults (the monitor's baseline accuracy, measured after the hooks are placed)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    @property
    def active(self) -> frozenset[int]:
        """Ids of the active pins."""
        return self._active

    # --------------------------------------------------------------------------------------
    # Hooks

    def attach(self) -> list[RemovableHandle]:
        """One forward hook per matched module, ahead of any other forward hook (``prepend``):
        every hook and module after it sees the stuck values."""
        if "torch._dynamo" in sys.modules:  # torch.compile is in use: have the eager path ready before tracing
            _out_of_graph()
        return [module.register_forward_hook(self._hook(name), prepend=True) for name, module in self._modules.items()]

    def attach_to(self, copy: nn.Module) -> list[RemovableHandle]:
        """The same hooks on a copy of the model (an averaged copy of its weights: the same chip, so the
        same stuck units), on its modules of the same names; they share this runtime's steps and positions.

        Raises:
            PinError: the copy lacks a pinned module or holds another type there.
        """
        modules = dict(copy.named_modules())
        for name, module in self._modules.items():
            held = modules.get(name)
            if held is None or type(held) is not type(module):
                what = "lacks the module" if held is None else f"holds a {type(held).__name__} as"
                raise PinError(
                    f"the copy ({type(copy).__name__}) {what} {name!r} ({type(module).__name__}) that neuron pins "
                    "stick: average a copy of the pinned module (AveragedModel(model))"
                )
        handles = []
        for name in self._modules:
            hooks = modules[name]._forward_hooks
            for key in [k for k, h in hooks.items() if h is self._hooks.get(name)]:
                del hooks[key]  # a deep copy taken after attach() holds our hook already, but no handle removes it
            handles.append(modules[name].register_forward_hook(self._hook(name), prepend=True))
        return handles

    def _hook(self, name: str) -> Callable[..., Any]:
        hook = self._hooks.get(name)
        if hook is None:
            hook = self._hooks[name] = self._hook_for(name)
        return hook

    def _hook_for(self, name: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self._paused:
                return None
            first = output[0] if isinstance(output, tuple) else output
            # The lookup of _composed_for, written out: it runs at every forward of every module.
            composed = None
            if isinstance(first, Tensor):
                composed = self._composed.get((name, self._active, first.dtype, first.device))
                if composed is not None and (
                    first.dim() != len(composed.shape) or self._seen.get(name) != tuple(first.shape[1:])
                ):
                    composed = None
            if composed is None:
                composed = self._composed_for(name, first)
            if not composed.writes:
                return None
            stuck = composed.write(first)
            return (stuck, *output[1:]) if isinstance(output, tuple) else stuck

        return hook

    def _composed_for(self, name: str, out: Any) -> _Composed:
        active = self._active
        if isinstance(out, Tensor):
            # Per dtype and device too: a mixed-precision training forward and a float32 evaluation
            # alternate without rebuilding anything.
            composed = self._composed.get((name, active, out.dtype, out.device))
            # Whole channels broadcast over every other axis: a forward of another sequence length
            # (or image size) reuses them as they are.
            if composed is not None and out.dim() == len(composed.shape) and all(
                c == 1 or c == o for c, o in zip(composed.shape[1:], out.shape[1:])
            ):
                return composed
        if torch.compiler.is_compiling():
            return _out_of_graph()(self, name, out, active)
        return self._compose(name, out, active)

    def _compose(self, name: str, out: Any, active: frozenset[int]) -> _Composed:
        """Resolve (first forward), check the output, and build the tensors for ``active``: may sync."""
        if not isinstance(out, Tensor) or not out.is_floating_point():
            what = type(out).__name__ if not isinstance(out, Tensor) else f"a {out.dtype} tensor"
            raise PinError(
                f"neuron pins {[self.pins[i] for i in self.matched[name]]} on {name!r}: its output is {what}, not a "
                "floating-point tensor; pin a module whose (first) output is floating point"
            )
        if out.dtype not in BITS_DTYPES:
            raise PinError(f"neuron pins on {name!r}: its output dtype {out.dtype} is not supported")
        if out.dim() < 1:
            raise PinError(f"neuron pins on {name!r}: its output is a scalar; a batch axis is needed")
        if name not in self._entries:
            entries = [
                _resolve_entry(i, self.pins[i], name, self._modules[name], out, self._saved.get((i, name)),
                               self._default_axis)
                for i in self.matched[name]
            ]
            width = torch.iinfo(BITS_DTYPES[out.dtype]).bits
            for e in entries:
                for field in ("stuck_at_zero", "stuck_at_one"):
                    mask = getattr(e.pin, field)
                    if mask is not None and mask >> width:
                        raise PinError(
                            f"{e.pin!r} on {name!r}: {field}={hex(mask)} is wider than its output's {out.dtype} word "
                            f"({width} bits); give a mask below {hex(1 << width)}"
                        )
                if e.pin.stuck_bits:
                    _check_masks(e.pin, name, out.dtype, width)
            _check_agree(name, entries, tuple(out.shape))
            self._entries[name] = entries
        entries = self._entries[name]
        sample = tuple(out.shape[1:])
        for e in entries:
            if len(e.shape) != out.dim() or any(s != 1 and s != o for s, o in zip(e.shape[1:], sample)):
                raise PinError(
                    f"{e.pin!r} on {name!r}: its positions were resolved on a per-sample output of shape "
                    f"{e.shape[1:]}, "
                    f"this forward's output has {sample}; positions other than whole channels need one output shape"
                )
        live = [e for e in entries if e.pin_id in active]
        composed = _Composed(live, out, [e.shape for e in entries])
        if self._seen.get(name) != sample:
            self._composed = {k: v for k, v in self._composed.items() if k[0] != name}  # another output shape
        self._seen[name] = sample
        self._composed[(name, active, out.dtype, out.device)] = composed
        return composed

    # --------------------------------------------------------------------------------------
    # Words and the saved form

    def summary(self) -> str:
        """One line per (module, pin): ``layer1.0.conv1  output channels [3, 7] (axis 1)  stuck at 0.0``,
        with the axis in use (resolved, or what the module's type tells before its first forward) and,
        for a glob or ``re:`` pattern, the pattern that matched the module."""
        lines = []
        for name, ids in self.matched.items():
            for i in ids:
                pin = self.pins[i]
                via = "" if name in pin.patterns else f"  (matched by {pin.modules!r})"
                lines.append(f"{name}  {pin.describe(self.axis_words(name, i))}{via}")
        return "\n".join(lines)

    def axis_words(self, name: str, pin_id: int) -> Optional[str]:
        """The channel axis a pin uses on a module, in words (``None`` for a pin without channels)."""
        pin = self.pins[pin_id]
        if pin.channels is None:
            return None
        entry = next((e for e in self._entries.get(name, ()) if e.pin_id == pin_id), None)
        if entry is not None and entry.axis is not None:
            return axis_words(entry.axis, len(entry.shape))
        if pin.axis is not None:
            return f"axis {pin.axis}"
        if self._default_axis is not None:
            return f"axis {self._default_axis}"
        by_type = module_feature_axis(self._modules[name])
        if by_type == 1:
            return "axis 1"
        if by_type == -1:
            return "axis -1, the last"
        return "feature axis: 1 for a 2-D, 4-D or 5-D output"

    def state_dict(self) -> dict[str, Any]:
        """The pins' fingerprints and the positions resolved so far (tensors, lists, primitives)."""
        return {
            "version": NEURON_STATE_VERSION,
            "fingerprints": [p.fingerprint() for p in self.pins],
            # What axis=None means for the modules not resolved yet (None: the feature axis; 1: loaded from a
            # version-1 state, where it meant axis 1).
            "default_axis": self._default_axis,
            "step": self.step,
            "positions": [
                {"pin": e.pin_id, "module": name, "shape": list(e.shape), "flat": e.flat.clone(), "axis": e.axis}
                for name, entries in self._entries.items()
                for e in entries
            ],
        }

    def load_state_dict(self, state: Any, *, strict: bool = True, warn: Callable[[str], Any] = print) -> None:
        """Take the saved positions: a module resolves on them at its next forward.

        Raises:
            PinError: with ``strict``, a state that is not this form or whose pins differ from these.
        """
        problem = _state_problem(state, self)
        if problem:
            if strict:
                raise PinError(
                    f"the checkpoint's neuron-pin state does not match these neuron pins: {problem}. Resume with the "
                    "neuron pins the checkpoint was trained with, or pass strict=False to start them afresh"
                )
            warn(f"strict=False: ignoring saved neuron-pin state: {problem}")
            return
        legacy = state["version"] == 1
        self._default_axis = LEGACY_AXIS if legacy else state.get("default_axis")
        self._saved = {
            (int(p["pin"]), str(p["module"])): {
                "shape": tuple(int(s) for s in p["shape"]),
                "flat": p["flat"],
                # Version 1 saved no axis: its channels were along axis 1 unless the pin said otherwise.
                "axis": p.get("axis") if not legacy else _legacy_axis(self.pins[int(p["pin"])], len(p["shape"])),
            }
            for p in state["positions"]
        }
        self._entries.clear()  # resolved again, on the saved positions, at the next forward
        self._composed.clear()
        self._seen.clear()


def _legacy_axis(pin: NeuronPin, ndim: int) -> Optional[int]:
    if pin.channels is None:
        return None
    axis = LEGACY_AXIS if pin.axis is None else pin.axis
    return axis if axis > 0 else axis + ndim


def _state_problem(state: Any, hold: NeuronHold) -> str:
    if not isinstance(state, Mapping) or state.get("version") not in (1, NEURON_STATE_VERSION):
        return f"it is not a version-1 or -{NEURON_STATE_VERSION} neuron-pin state"
    # A version-1 state was saved before the feature axis: its fingerprints hashed axis=None as axis=1.
    mine = [p.fingerprint(legacy=state["version"] == 1) for p in hold.pins]
    if list(state.get("fingerprints", ())) != mine:
        return f"it holds pins {list(state.get('fingerprints', ()))}, these are {mine}"
    for p in state.get("positions", ()):
        if not (isinstance(p, Mapping) and isinstance(p.get("flat"), Tensor) and p.get("module") in hold.matched
                and p.get("pin") in hold.matched[p["module"]]):
            return f"a saved position entry names no matched module and pin ({_brief(p)})"
    return ""


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."


def _check_agree(name: str, entries: Sequence[_Entry], out_shape: tuple[int, ...]) -> None:
    """Two neuron pins at overlapping steps may share a position only if they read the same there."""
    for i, a in enumerate(entries):
        for b in entries[i + 1:]:
            if not windows_overlap(a.pin, b.pin):
                continue
            full = tuple(torch.broadcast_shapes(a.shape, b.shape))
            mask_a, values_a = a.dense(full)
            mask_b, values_b = b.dense(full)
            both = mask_a & mask_b
            if not bool(both.any()):
                continue
            if values_a is not None and values_b is not None:
                differ = both & (values_a != values_b)
            elif values_a is None and values_b is None:
                masks_a = (a.pin.stuck_at_zero or 0, a.pin.stuck_at_one or 0)
                same = masks_a == (b.pin.stuck_at_zero or 0, b.pin.stuck_at_one or 0)
                differ = both & (not same)
            else:
                differ = both
            if bool(differ.any()):
                where = tuple(int(c) for c in differ.nonzero()[0][1:])
                raise PinError(
                    f"{a.pin!r} and {b.pin!r} disagree on output position {where} of {name!r} at overlapping steps "
                    f"({a.pin.describe()} / {b.pin.describe()}): select disjoint positions or separate their step "
                    "windows"
                )


# The first forward of a module (and any forward whose output differs in dtype, device or shape
# from the last one) resolves and checks on the host, which a compiled graph cannot hold: under
# torch.compile it runs eagerly (a graph break), and the steady-state path is compiled. Made on
# first need: torch.compiler.disable imports dynamo (seconds), which an eager model never needs.
_OUT_OF_GRAPH: list[Callable[..., _Composed]] = []


def _out_of_graph() -> Callable[..., _Composed]:
    if not _OUT_OF_GRAPH:
        _OUT_OF_GRAPH.append(torch.compiler.disable(NeuronHold._compose))
    return _OUT_OF_GRAPH[0]


class NeuronKind:
    """The registry's entry for neuron pins (an output kind: it acts on module outputs in the forward).

    An output kind names its spec class (what a pin of it is), the config key a mapping of it
    carries, and builds its runtime on a model (``hold(pins, module)``: ``attach()``,
    ``set_step(step)``, ``state_dict()`` / ``load_state_dict()``, ``summary()``).
    """

    kind: ClassVar[str] = "neuron"
    words: ClassVar[str] = "stuck neurons"
    spec: ClassVar[type] = NeuronPin
    #: A mapping with this key (and no ``params``) is a pin of this kind (Hydra / YAML).
    config_key: ClassVar[str] = "modules"

    @classmethod
    def hold(cls, pins: Sequence[NeuronPin], module: nn.Module) -> NeuronHold:
        """The pins' runtime on ``module`` (patterns matched now)."""
        return NeuronHold(pins, module)


__all__ = [
    "NeuronHold", "NeuronKind", "NeuronPin", "check_levels", "feature_axis", "fraction_positions", "match_modules",
    "module_feature_axis",
]
