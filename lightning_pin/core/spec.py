"""What to pin: :class:`Pin`, pure data, checked when built.

A ``Pin`` records what the user asked for and, like Lightning's callbacks in ``__init__``, rejects
at construction every mistake that needs no model: types, ranges, combinations of fields,
non-finite values. Nothing here looks at a model: resolving a pin against the parameters of the
module being trained, and every check that needs them (names, shapes, dtypes, files), lives in
:mod:`lightning_pin.core.plan`, so a spec can be written (or composed by Hydra) long before a model
exists. The checks of tensors and values that may also come from files (:func:`check_mask`,
:func:`check_value`, :func:`coordinates`) are here once and called again by the plan on what it
loads.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import torch

from lightning_pin.core import registry
from lightning_pin.core.errors import PinError
from lightning_pin.core.rules import check_fraction, check_patterns, check_seed, check_steps, from_mapping, spec_repr

__all__ = ["Pin", "PinValue", "check_mask", "check_value", "coordinates", "number_leaves", "when_path"]


#: Anything that selects or supplies values: tensors, nested lists of numbers, file paths.
PinValue = Union[None, float, int, Sequence[float], torch.Tensor, str, Mapping[str, Any]]

_FIELDS = (
    "params", "indices", "mask", "fraction", "seed", "value", "start_step", "stop_step", "when",
    "stuck_at_zero", "stuck_at_one", "bounds", "buffers", "code", "kind_args",
)


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
            the pin is active only for the batches where it returns ``True``. It must return a
            ``bool`` or a 0-d bool tensor (anything else, ``None`` from a forgotten ``return``
            included, raises :class:`~lightning_pin.PinError` before that batch's step). It is
            called once per batch on the host: a device tensor result costs one host read.
        stuck_at_zero: Stuck bits (a fault model of the stored word): bits of each selected
            element's bit pattern in the parameter's dtype that always read 0. An ``int`` read as
            an unsigned pattern (``0x80000000`` is float32's sign bit, ``0x8000`` bfloat16's), a
            sequence with one int per selected element (in the order of the selection), an
            integer tensor of the parameter's shape, a dict of those by parameter name, or a
            ``.pt`` / ``.safetensors`` file holding them. After every optimizer step
            ``bits = (bits & ~stuck_at_zero) | stuck_at_one`` on the element's own storage; the
            other bits keep what the optimizer wrote. Gradients and optimizer statistics of
            these elements are left alone: they keep training within what their free bits allow.
        stuck_at_one: Stuck bits that always read 1, in the same forms as ``stuck_at_zero``.
        bounds: ``(low, high)``: after every step the selected elements are clamped into
            ``[low, high]`` (a bounded cell). ``low`` and ``high`` are each a number, a sequence
            with one number per selected element, a tensor of the parameter's shape, or a dict
            of those by parameter name; ``(0.0, math.inf)`` keeps a weight's sign. The elements
            keep training inside the interval.
        buffers: For a pin that freezes whole modules (every parameter of a module, whole
            tensors, ``value=None``, no ``when``), also hold the buffers of those modules
            (BatchNorm's ``running_mean``, ``running_var``, ``num_batches_tracked``) at their
            values when the pin activates, as ``BaseFinetuning.freeze(train_bn=False)`` does.
            ``False`` lets them keep updating. Other pins hold no buffers.
        code: A :class:`~lightning_pin.QuantCode` (or a mapping of its fields): the selected
            elements are stored as integer codes and ``stuck_at_zero`` / ``stuck_at_one`` are masks
            over the code's bits. After every optimizer step each element is written
            ``(q' - zero_point) * scale`` with ``q' = (q & ~stuck_at_zero) | stuck_at_one`` on its code
            ``q``; the other code bits keep training.
        kind_args: The fields of a kind registered outside the library
            (:func:`lightning_pin.core.kinds.register`), by name: ``kind_args={"grid": 0.125}``.

    A pin is one of four kinds: a value pin (the default: the element equals its target bit for
    bit), a stuck-bit pin (``stuck_at_zero`` / ``stuck_at_one``), a quantized-code pin (``code``:
    the stuck bits are bits of the element's integer code) or a bounded pin (``bounds``).

    At most one of ``indices``, ``mask`` and ``fraction`` may be given; none of them pins the
    whole tensor. Building a ``Pin`` checks nothing, since most checks need the model:
    :func:`~lightning_pin.core.plan.resolve` (at fit start, or in :func:`~lightning_pin.pin`)
    raises :class:`~lightning_pin.PinError` naming the pin and what would be right.

    Raises:
        PinError: At construction, for every mistake that needs no model: ``params`` not a
            non-empty pattern or list of patterns (or an invalid ``"re:"`` expression), more than
            one of ``indices`` / ``mask`` / ``fraction``, ``indices`` that are not integers,
            negative or empty, a ``mask`` that is not bool or selects nothing, ``fraction``
            outside ``(0, 1]``, a ``seed`` or step that is not an integer, ``start_step < 0``,
            ``stop_step <= start_step``, a ``value`` that is a bool, complex, NaN or infinite,
            or a ``when`` that is neither callable nor an import path; stuck bits that are not
            non-negative integers, that overlap (a bit stuck at zero and at one), or given with
            ``value`` or ``bounds``; ``bounds`` that are not a ``(low, high)`` pair of numbers,
            hold NaN, have ``low > high`` or are given with ``value``. What depends on the model
            (names, shapes, dtypes, files) is checked when the pin is resolved, before any step.

    Example::

        >>> Pin("encoder.*")                              # freeze a whole module
        Pin(params='encoder.*')
        >>> Pin("conv1.weight", indices=[(0, 0, 1, 1)], value=25.0)
        Pin(params='conv1.weight', indices=[(0, 0, 1, 1)], value=25.0)
        >>> Pin(["fc1.weight", "fc2.weight"], fraction=0.05, seed=1, value=0.0)
        Pin(params=['fc1.weight', 'fc2.weight'], fraction=0.05, seed=1, value=0.0)
        >>> Pin("fc.weight", indices=[(0, 1), (2, 3)], stuck_at_one=0x40000000)   # exponent MSB stuck at 1
        Pin(params='fc.weight', indices=[(0, 1), (2, 3)], stuck_at_one=0x40000000)
        >>> Pin("fc.bias", bounds=(0.0, math.inf))                                 # keeps the sign
        Pin(params='fc.bias', bounds=(0.0, inf))
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
    stuck_at_zero: Any = None
    stuck_at_one: Any = None
    bounds: Any = None
    buffers: bool = True
    code: Any = None
    kind_args: Any = None

    @property
    def kind(self) -> str:
        """The name of the pin's kind (see :mod:`lightning_pin.core.kinds`): ``"value"``, ``"stuck_bits"``,
        ``"bounds"``: which projection holds the selected elements."""
        return registry.for_pin(self).kind

    def __post_init__(self) -> None:
        # Hydra hands over DictConfig / ListConfig: turn them into plain containers once, so the
        # rest of the code (and pickling for ddp_spawn) only ever sees Python and torch objects.
        for name in _FIELDS:
            if name != "when":
                object.__setattr__(self, name, _plain(getattr(self, name)))
        # Hydra / YAML: code={bits: 8, scale: 0.01} becomes a QuantCode (the kinds register which fields).
        for name, value in registry.convert_fields({name: getattr(self, name) for name in _FIELDS}).items():
            object.__setattr__(self, name, value)
        _check_fields(self)

    @classmethod
    def from_config(cls, config: Pin | Mapping[str, Any]) -> Pin:
        """Build a ``Pin`` from a ``Pin`` or from a mapping with the same keys (Hydra / YAML).

        Raises:
            PinError: ``config`` is neither, has keys that are not fields of ``Pin``, or has no ``params``.
        """
        return from_mapping(
            cls, config, _FIELDS, what="pin", required="params",
            hint="name the parameters to pin, e.g. params: 'fc.weight'",
        )

    @property
    def patterns(self) -> tuple[str, ...]:
        """The parameter patterns as a tuple (a single string becomes a 1-tuple)."""
        return (self.params,) if isinstance(self.params, str) else tuple(self.params)

    def fingerprint(self) -> str:
        """A digest of everything that determines this pin's selection and targets.

        Stable across processes and runs (no ``id`` or ``hash``), so checkpoints find their state.
        """
        later = registry.later_fields()
        digest = hashlib.sha256()
        for name in _FIELDS:
            if (name in later or name == "kind_args") and getattr(self, name) is None:
                continue
            if name == "buffers" and self.buffers is True:
                continue  # a default added later: the fingerprints (and state keys) of older pins stay
            digest.update(name.encode())
            _feed(digest, getattr(self, name))
        return digest.hexdigest()[:16]

    def __repr__(self) -> str:
        return spec_repr(self)


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
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):  # a QuantCode: by its fields
        digest.update(f"D{type(value).__name__}".encode())
        for field in dataclasses.fields(value):
            digest.update(field.name.encode())
            _feed(digest, getattr(value, field.name))
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


# --------------------------------------------------------------------------------------------
# Checks that need no module: run once at construction. check_mask, check_value and coordinates
# are called again by the plan on masks, values and indices it reads from files or dicts.

def _check_fields(pin: Pin) -> None:
    _check_params(pin)
    given = [k for k in ("indices", "mask", "fraction") if getattr(pin, k) is not None]
    if len(given) > 1:
        raise PinError(f"{pin!r}: give at most one of indices / mask / fraction, got {' and '.join(given)}")
    if pin.indices is not None:
        coordinates(pin)
    if pin.mask is not None:
        if isinstance(pin.mask, Mapping):
            # Entries for parameters the pin may never match: their emptiness is checked when
            # (and if) they are used.
            for key, entry in pin.mask.items():
                check_mask(pin, entry, f" for {key!r}", require_any=False)
        else:
            check_mask(pin, pin.mask)
    check_fraction(pin, pin.fraction)
    if not isinstance(pin.buffers, bool):
        raise PinError(f"{pin!r}: buffers must be True or False, got {pin.buffers!r}")
    check_seed(pin, pin.seed)
    check_steps(pin, pin.start_step, pin.stop_step)
    if isinstance(pin.value, Mapping):
        for key, entry in pin.value.items():
            check_value(pin, entry, f" for {key!r}")
    else:
        check_value(pin, pin.value)
    when_path(pin)
    registry.check_spec(pin)  # the fields of each kind (stuck bits, bounds, ...): checked by the kind


def _check_params(pin: Pin) -> None:
    check_patterns(pin, "params", pin.params, "globs over parameter names, e.g. 'encoder.*'")


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_bool(x: Any) -> bool:
    # numpy's bool is no subclass of bool (and no number): recognise it without importing numpy.
    return isinstance(x, bool) or (type(x).__module__ == "numpy" and type(x).__name__ in ("bool_", "bool"))


def _clip(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def coordinates(pin: Pin) -> torch.Tensor:
    """``pin.indices`` as an int64 CPU tensor of shape ``(k, n)`` or ``(k,)``, checked.

    Rejects what is wrong whatever the parameter: not integers, ragged rows, negative
    coordinates, no element at all. Ranks and upper bounds depend on the parameter's shape and
    are checked by the plan.
    """
    indices = pin.indices
    if isinstance(indices, torch.Tensor):
        if indices.dtype == torch.bool:
            raise PinError(f"{pin!r}: indices is a bool tensor; pass it as mask= instead")
        if indices.is_floating_point() or indices.is_complex():
            raise PinError(f"{pin!r}: indices must hold integers, got dtype {indices.dtype}")
        coords = indices.detach().cpu().to(torch.int64)
    else:
        if isinstance(indices, (str, bytes)) or not isinstance(indices, Sequence):
            raise PinError(f"{pin!r}: indices must be a list of tuples or an integer tensor, got {_clip(indices)}")
        rows = [tuple(row) if isinstance(row, Sequence) and not isinstance(row, (str, bytes)) else row for row in indices]
        if not all(_is_int(x) for row in rows for x in (row if isinstance(row, tuple) else (row,))):
            raise PinError(f"{pin!r}: indices must hold integers, got {_clip(indices)}")
        lengths = sorted({len(row) if isinstance(row, tuple) else -1 for row in rows})
        if len(lengths) > 1:
            shown = ", ".join("a bare int" if n < 0 else str(n) for n in lengths)
            raise PinError(
                f"{pin!r}: indices rows must all have the same number of coordinates (one per dimension of "
                f"the parameter), got rows of lengths {shown}"
            )
        if any(not -(2**63) <= x < 2**63 for row in rows for x in (row if isinstance(row, tuple) else (row,))):
            raise PinError(f"{pin!r}: indices {_clip(indices)} are out of range: coordinate d must be in [0, shape[d])")
        coords = torch.tensor(rows, dtype=torch.int64)
    if coords.shape[0] == 0:  # no row ([()] is one row: the element of a 0-d parameter)
        raise PinError(f"{pin!r}: indices select no element; select at least one or drop the pin")
    negative = coords < 0
    if negative.any():
        rows_at = negative if coords.ndim == 1 else negative.reshape(coords.shape[0], -1).any(dim=1)
        shown = coords[rows_at][:5]
        shown = shown.unsqueeze(1) if shown.ndim == 1 else shown
        raise PinError(
            f"{pin!r}: indices {shown.tolist()} are out of range: coordinate d must be in [0, shape[d]) "
            "(negative coordinates are not taken from the end)"
        )
    return coords


def check_mask(pin: Pin, mask: Any, where: str = "", *, require_any: bool = True) -> None:
    """A mask (or a file path to one) must be a bool tensor that selects at least one element."""
    if mask is None or isinstance(mask, (str, Path)):
        if isinstance(mask, (str, Path)) and where:
            # A path inside a dict or a file: the plan reads one level of files only.
            raise PinError(f"{pin!r}: mask{where} must be a bool tensor, got the path {str(mask)!r}")
        return
    if not isinstance(mask, torch.Tensor):
        raise PinError(
            f"{pin!r}: mask{where} must be a bool tensor of the parameter's shape, a dict of them by parameter "
            f"name, or a .pt / .safetensors path; got {type(mask).__name__}"
        )
    if mask.dtype != torch.bool:
        raise PinError(f"{pin!r}: mask{where} has dtype {mask.dtype}; it must be torch.bool (mask.bool())")
    if require_any and not bool(mask.any()):
        raise PinError(f"{pin!r}: mask{where} selects no element; select at least one or drop the pin")


def check_value(pin: Pin, raw: Any, where: str = "") -> None:
    """A value must be numbers (not bools, not complex, finite), a tensor of them, or a file path."""
    if raw is None or isinstance(raw, (str, Path)):
        if isinstance(raw, (str, Path)) and where:
            raise PinError(f"{pin!r}: value{where} must be numbers or a tensor, got the path {str(raw)!r}")
        return
    if callable(raw) and not isinstance(raw, torch.Tensor):
        # A generator of values per parameter (the app's UniformValues): it needs the model, and
        # becomes tensors (checked then) before the pin is resolved; see the plan.
        return
    if _is_bool(raw) or (isinstance(raw, torch.Tensor) and raw.dtype == torch.bool):
        raise PinError(f"{pin!r}: value{where} must be numeric, got a bool; pin numbers (e.g. 1.0 / 0.0)")
    if isinstance(raw, torch.Tensor):
        if raw.is_complex():
            raise PinError(f"{pin!r}: value{where}: complex values are not supported")
        if raw.is_floating_point():
            finite = torch.isfinite(raw)
            if not bool(finite.all()):
                bad = raw[~finite][:3].tolist()
                raise PinError(f"{pin!r}: value{where} holds non-finite numbers {bad}; pin finite values")
        return
    if isinstance(raw, numbers.Number):
        leaves: list[Any] = [raw]
    elif isinstance(raw, Sequence) and not isinstance(raw, bytes):
        leaves = list(number_leaves(raw))
    else:
        raise PinError(
            f"{pin!r}: value{where} must be None, a number, a sequence, a tensor, a dict by parameter name or a "
            f".pt / .safetensors path; got {type(raw).__name__}"
        )
    if any(_is_bool(x) for x in leaves):
        raise PinError(f"{pin!r}: value{where} holds bools; pin numbers (e.g. 1.0 / 0.0)")
    odd = [x for x in leaves if not isinstance(x, numbers.Real)]
    if odd:
        kind = "complex numbers" if isinstance(odd[0], numbers.Complex) else f"{type(odd[0]).__name__} {_clip(odd[0])}"
        raise PinError(f"{pin!r}: value{where} is not a number or a numeric sequence: it holds {kind}")
    bad = [x for x in leaves if not _is_int(x) and not math.isfinite(x)][:3]
    if bad:
        raise PinError(f"{pin!r}: value{where} holds non-finite numbers {bad}; pin finite values")


def number_leaves(raw: Any) -> Iterable[Any]:
    """The numbers of a nested sequence, depth first."""
    if isinstance(raw, Sequence) and not isinstance(raw, (str, bytes)):
        for item in raw:
            yield from number_leaves(item)
    else:
        yield raw


def when_path(pin: Pin) -> tuple[str, str] | None:
    """``(module, attribute)`` of a ``when`` given as an import path; None for a callable or None."""
    when = pin.when
    if when is None or callable(when):
        return None
    if isinstance(when, str):
        module_name, sep, attr = when.partition(":") if ":" in when else when.rpartition(".")
        if not sep or not module_name or not attr:
            raise PinError(f"{pin!r}: when={when!r} is not an import path; write 'package.module.function'")
        return module_name, attr
    raise PinError(
        f"{pin!r}: when must be callable(batch, batch_idx) -> bool or its import path, got {_clip(when)}"
    )
