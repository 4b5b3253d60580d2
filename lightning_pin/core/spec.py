"""What to pin: :class:`Pin`, pure data.

A ``Pin`` only records what the user asked for. Nothing here looks at a model: resolving a pin
against the parameters of the module being trained, and every check that needs them, lives in
:mod:`lightning_pin.core.plan`, so a spec can be written (or composed by Hydra) long before a model
exists.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import torch

from lightning_pin.core.errors import PinError

#: Anything that selects or supplies values: tensors, nested lists of numbers, file paths.
PinValue = Union[None, float, int, Sequence[float], torch.Tensor, str, Mapping[str, Any]]

_FIELDS = ("params", "indices", "mask", "fraction", "seed", "value", "start_step", "stop_step", "when")


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Pin:
    """Pin chosen elements of chosen parameters to exact values.

    Args:
        params: An ``fnmatch`` glob, or a list of them, over the ``named_parameters()`` names of
            the module being trained (``trainer.lightning_module``). A pattern that starts with
            ``"re:"`` is a regular expression; both must match the whole name.
        indices: Element coordinates: a list of tuples (one entry per dimension), a list of ints
            for a 1-D parameter, or an integer tensor of shape ``(k, ndim)`` (or ``(k,)`` for 1-D).
        mask: A bool tensor of the parameter's shape, or a path to a ``.pt`` / ``.safetensors``
            file holding one (or a dict of them keyed by parameter name).
        fraction: Pin ``round(fraction * numel)`` elements (at least one), drawn by a permutation
            seeded with ``seed`` and the parameter's name: the same elements on every rank, run
            and resume.
        seed: Seed for ``fraction``.
        value: ``None`` keeps the values the elements have when the pin activates. Otherwise a
            number, a sequence (one value per selected element, in the order of ``indices``, or
            row-major for ``mask`` / ``fraction`` / the whole tensor), a tensor of the parameter's
            shape, a dict keyed by parameter name, or a ``.pt`` / ``.safetensors`` file holding
            any of those.
        start_step: First optimizer step (``trainer.global_step``) at which the pin is active.
        stop_step: The pin is active up to this step, exclusive; ``None`` means to the end.
        when: Optional ``callable(batch, batch_idx) -> bool`` (or the import path of one, such as
            ``"mypkg.schedules.task_b"``, which travels to spawned processes and into configs):
            the pin is active only for the batches where it returns ``True``.

    At most one of ``indices``, ``mask`` and ``fraction`` may be given; none of them pins the
    whole tensor. Building a ``Pin`` checks nothing, since most checks need the model:
    :func:`~lightning_pin.core.plan.resolve` (at fit start, or in :func:`~lightning_pin.pin`)
    raises :class:`~lightning_pin.PinError` naming the pin and what would be right.

    Example::

        >>> Pin("encoder.*")                              # freeze a whole module
        Pin(params='encoder.*')
        >>> Pin("conv1.weight", indices=[(0, 0, 1, 1)], value=25.0)
        Pin(params='conv1.weight', indices=[(0, 0, 1, 1)], value=25.0)
        >>> Pin(["fc1.weight", "fc2.weight"], fraction=0.05, seed=1, value=0.0)
        Pin(params=['fc1.weight', 'fc2.weight'], fraction=0.05, seed=1, value=0.0)
    """

    params: str | Sequence[str]
    indices: Any = None
    mask: Any = None
    fraction: float | None = None
    seed: int = 0
    value: PinValue = None
    start_step: int = 0
    stop_step: int | None = None
    when: Callable[[Any, int], bool] | str | None = None

    def __post_init__(self) -> None:
        # Hydra hands over DictConfig / ListConfig: turn them into plain containers once, so the
        # rest of the code (and pickling for ddp_spawn) only ever sees Python and torch objects.
        for name in _FIELDS:
            if name != "when":
                object.__setattr__(self, name, _plain(getattr(self, name)))

    @classmethod
    def from_config(cls, config: Pin | Mapping[str, Any]) -> Pin:
        """Build a ``Pin`` from a ``Pin`` or from a mapping with the same keys (Hydra / YAML).

        Raises:
            PinError: ``config`` is neither, has keys that are not fields of ``Pin``, or has no ``params``.
        """
        if isinstance(config, Pin):
            return config
        if not isinstance(config, Mapping):
            raise PinError(
                f"a pin must be a Pin or a mapping with the keys of Pin, got {type(config).__name__}: {config!r}"
            )
        keys = {str(k) for k in config.keys()} - {"_target_"}
        unknown = sorted(keys - set(_FIELDS))
        if unknown:
            raise PinError(f"pin {dict(config)!r} has unknown keys {unknown}; the keys of a Pin are {list(_FIELDS)}")
        if "params" not in keys:
            raise PinError(f"pin {dict(config)!r} has no 'params': name the parameters to pin, e.g. params: 'fc.weight'")
        return cls(**{k: config[k] for k in keys})

    @property
    def patterns(self) -> tuple[str, ...]:
        """The parameter patterns as a tuple (a single string becomes a 1-tuple)."""
        return (self.params,) if isinstance(self.params, str) else tuple(self.params)

    def fingerprint(self) -> str:
        """A digest of everything that determines this pin's selection and targets.

        Stable across processes and runs (no ``id`` or ``hash``), so checkpoints find their state.
        """
        digest = hashlib.sha256()
        for name in _FIELDS:
            digest.update(name.encode())
            _feed(digest, getattr(self, name))
        return digest.hexdigest()[:16]

    def __repr__(self) -> str:
        shown = [f"params={self.params!r}"]
        for field in dataclasses.fields(self)[1:]:
            value = getattr(self, field.name)
            if not _is_default(value, field.default):
                shown.append(f"{field.name}={_short(value)}")
        return f"Pin({', '.join(shown)})"


def _plain(value: Any) -> Any:
    """Turn mappings and sequences (e.g. OmegaConf containers) into dicts, lists and tuples."""
    if isinstance(value, (str, bytes, torch.Tensor)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, Sequence):
        return [_plain(v) for v in value]
    return value


def _is_default(value: Any, default: Any) -> bool:
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


def _feed_code(digest: Any, code: Any) -> None:
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            _feed_code(digest, const)
        else:
            digest.update(repr(const).encode())


def _feed(digest: Any, value: Any) -> None:
    """Feed ``value`` into ``digest`` by content, recursing through containers."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        digest.update(b"M")
        for key in sorted(value, key=str):
            digest.update(str(key).encode())
            _feed(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"L{len(value)}".encode())
        for item in value:
            _feed(digest, item)
    elif isinstance(value, functools.partial):
        digest.update(b"P")
        for part in (value.func, value.args, value.keywords):
            _feed(digest, part)
    elif callable(value):
        # Never a repr: it holds a memory address, different in every process.
        owner = value if hasattr(value, "__qualname__") else type(value)
        digest.update(f"F{owner.__module__}.{owner.__qualname__}".encode())
        code = getattr(value, "__code__", None) or getattr(getattr(type(value), "__call__", None), "__code__", None)
        if code is not None:
            # Two lambdas share a qualname: tell them apart by their code, which is the same in
            # every process running the same source.
            _feed_code(digest, code)
        if not hasattr(value, "__qualname__"):
            _feed(digest, {k: v for k, v in vars(value).items()} if hasattr(value, "__dict__") else {})
    else:
        text = repr(value)
        digest.update(f"{type(value).__name__}:{text if ' at 0x' not in text else ''}".encode())
