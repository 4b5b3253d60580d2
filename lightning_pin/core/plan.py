"""Resolve :class:`~lightning_pin.Pin` specs against a module: every check of user input lives here.

:func:`resolve` turns a list of pins into a :class:`PinPlan`: for each pin and each parameter it
matches, the selected elements as sorted, unique flat (row-major) indices, or ``None`` for the
whole tensor, and the explicit target values in the parameter's dtype and device. It reads
the module and never writes to it, so a rejected spec leaves every weight as it was.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import hashlib
import importlib
import inspect
import math
import numbers
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pin.core import kinds
from lightning_pin.core.kinds._common import name_seed  # noqa: F401  (also lightning_pin.core.plan.name_seed)
from lightning_pin.core.errors import PinError
from lightning_pin.core.io import TENSOR_FILE_SUFFIXES, TensorFileError, load_tensors
from lightning_pin.core.rules import fraction_count, in_window, seeded_generator, smallest_keys, windows_overlap
from lightning_pin.core.selection import Selection  # also lightning_pin.core.plan.Selection
from lightning_pin.core.spec import Pin, check_mask, coordinates, when_path

__all__ = [
    "PinPlan", "ResolvedPin", "Selection", "call_when", "check_conflicts", "check_targets_fit", "compact_index",
    "fraction_indices", "name_seed", "refuse_sparse_gradients", "resolve", "resolve_when", "tied_names",
]


@dataclasses.dataclass
class ResolvedPin:
    """A :class:`Pin` with its selections resolved on a module."""

    pin: Pin
    selections: dict[str, Selection]
    #: The resolved ``when`` callable, or None for a pin that is active on every batch of its window.
    when: Callable[[Any, int], bool] | None
    #: Whether ``when(batch, batch_idx)`` was checked against the signature of ``when`` at resolve
    #: time. Builtins and some C callables have none: then :func:`call_when` reports a
    #: ``TypeError`` raised by the call itself as a :class:`PinError`.
    when_signature_checked: bool = True

    def in_window(self, step: int) -> bool:
        """Whether optimizer step ``step`` falls in ``[start_step, stop_step)``."""
        return in_window(self.pin, step)


def call_when(rp: ResolvedPin, batch: Any, batch_idx: int) -> bool:
    """Whether ``rp``'s ``when`` holds for this batch: call it and check what it returned.

    ``when`` must return a ``bool`` (``numpy.bool_`` too) or a 0-d bool tensor. Anything else,
    such as ``"no"`` (truthy), ``None`` from a forgotten ``return``, ``1``, or a tensor of several
    elements, raises :class:`PinError` naming the pin and what it returned: a truthiness guess
    would pin (or free) elements the user did not mean to. Call it before the batch's optimizer
    step, so a bad ``when`` stops training before any weight moves on its word.

    A ``when`` decides on the host: a 0-d bool tensor on an accelerator is read back here (one
    device-to-host copy per ``when`` pin and batch, inherent to deciding per batch in Python).
    Exceptions raised inside ``when`` propagate unchanged, except a ``TypeError`` from calling a
    ``when`` whose signature could not be checked at resolve time (a builtin), which becomes a
    :class:`PinError` naming the expected ``(batch, batch_idx)``.
    """
    when = rp.when
    if when is None:
        return True
    if rp.when_signature_checked:
        result = when(batch, batch_idx)
    else:
        try:
            result = when(batch, batch_idx)
        except TypeError as err:
            raise PinError(
                f"{rp.pin!r}: when={_when_name(rp)} cannot be called as when(batch, batch_idx): {err}; give a "
                "callable of two arguments (batch, batch_idx) that returns a bool"
            ) from err
    if isinstance(result, bool):
        return result
    if isinstance(result, Tensor):
        if result.dtype == torch.bool and result.ndim == 0:
            return bool(result)  # a host read: `when` decides on the host
        got = f"a tensor of shape {tuple(result.shape)} and dtype {result.dtype}"
        hint = " (reduce it with .all() / .any())" if result.dtype == torch.bool else ""
    elif type(result).__module__ == "numpy" and type(result).__name__ in ("bool_", "bool"):
        return bool(result)
    else:
        got = f"{_clip(result)} ({type(result).__name__})"
        hint = " (a missing `return`?)" if result is None else ""
    raise PinError(
        f"{rp.pin!r}: when={_when_name(rp)} returned {got} for batch {batch_idx}{hint}; it must return a bool or "
        "a 0-d bool tensor (True: the pin holds for this batch)"
    )


def _when_name(rp: ResolvedPin) -> str:
    if isinstance(rp.pin.when, str):
        return repr(rp.pin.when)
    return getattr(rp.when, "__qualname__", None) or repr(rp.when)


@dataclasses.dataclass
class PinPlan:
    """Every pin resolved on one module: what :class:`~lightning_pin.core.engine.PinEngine` executes."""

    pins: list[ResolvedPin]
    #: The parameters any pin selects from, by name.
    parameters: dict[str, nn.Parameter]
    #: Elements of the module that require grad (the "trainable" total of the summary).
    trainable_elements: int
    #: Other names of tied parameters, by the name the plan uses (the first one
    #: ``named_parameters()`` yields): ``{"emb.weight": ["dec.weight"]}``. Pinning one pins all.
    aliases: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def pinned_counts(self) -> dict[str, int]:
        """Per parameter, how many distinct elements any pin selects (at any time)."""
        counts: dict[str, int] = {}
        for name, parameter in self.parameters.items():
            selections = [rp.selections[name] for rp in self.pins if name in rp.selections]
            if any(s.index is None for s in selections):
                counts[name] = parameter.numel()
            else:
                counts[name] = int(torch.cat([s.index for s in selections]).unique().numel())
        return counts

    def fingerprint(self) -> str:
        """A digest of the resolved selections and explicit targets, equal on ranks that agree."""
        digest = hashlib.sha256()
        for rp in self.pins:
            for name, selection in sorted(rp.selections.items()):
                digest.update(name.encode())
                for tensor in (selection.index, selection.values, *selection.payload.values()):
                    if tensor is None:
                        digest.update(b"-")
                    else:
                        # a fresh copy: a scalar target broadcast over one element has stride 0, and contiguous() keeps it
                        flat = tensor.detach().reshape(-1).cpu().clone(memory_format=torch.contiguous_format)
                        digest.update(flat.view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()[:16]

    def summary(self) -> str:
        """A table of what is pinned: per parameter, its size, how many elements and how."""
        counts = self.pinned_counts()
        rows = [("parameter", "shape", "elements", "pinned", "how")]
        for name, parameter in self.parameters.items():
            hows = []
            for rp in self.pins:
                if name in rp.selections:
                    hows.append(_describe(rp, rp.selections[name]))
            shape = "x".join(map(str, parameter.shape)) or "scalar"
            shown = name if name not in self.aliases else f"{name} (= {', '.join(self.aliases[name])})"
            rows.append((shown, shape, f"{parameter.numel():,}", f"{counts[name]:,}", "; ".join(hows)))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths)) + "  " + row[4] for row in rows]
        pinned = sum(counts.values())
        free = self.trainable_elements - sum(
            counts[name] for name, p in self.parameters.items() if p.requires_grad
        )
        lines.append(
            f"trainable elements: {self.trainable_elements:,}  pinned: {pinned:,}  free: {free:,}"
            f"  ({len(self.pins)} pin{'s' if len(self.pins) != 1 else ''} on {len(self.parameters)} "
            f"parameter{'s' if len(self.parameters) != 1 else ''})"
        )
        return "\n".join(lines)


def _describe(rp: ResolvedPin, selection: Selection) -> str:
    pin = rp.pin
    parts = [selection.how, kinds.of(selection.kind).describe(selection)]
    if pin.start_step or pin.stop_step is not None:
        # Active for steps [start_step, stop_step): the last step it holds is stop_step - 1.
        stop = "end" if pin.stop_step is None else pin.stop_step - 1
        parts.append(f"step {stop}" if stop == pin.start_step else f"steps {pin.start_step}..{stop}")
    if pin.when is not None:
        parts.append(f"when {getattr(rp.when, '__qualname__', pin.when)}")
    return ", ".join(parts)


def resolve(
    pins: Sequence[Pin], module: nn.Module, *, warn: Callable[[str], Any] | None = None
) -> PinPlan:
    """Resolve ``pins`` on the parameters of ``module`` into a :class:`PinPlan`.

    Values that the parameter's dtype can only approximate are pinned to the nearest
    representable value, and ``warn`` (default :func:`warnings.warn`) is told what will be stored.

    Raises:
        PinError: naming the offending pin, for every input that cannot be honoured: a pattern that
            matches no parameter (with the closest names), conflicting fields, indices or a mask
            that do not fit the parameter, values of the wrong count or shape or not representable
            in its dtype (NaN, infinities, overflow), a missing or unreadable ``mask`` / ``value``
            file, a ``when`` that cannot be imported, or two pins that give one element different
            values at steps that can overlap.
    """
    warn = warn or (lambda message: warnings.warn(message, UserWarning, stacklevel=3))
    named, aliases = tied_names(module)
    # Every name in the module (parameters, buffers, submodule paths): a one-entry file under one
    # of them is meant for that, never applied to another parameter because its shape fits.
    known = frozenset(
        [*named, *(n for _, others in aliases.items() for n in others)]
        + [n for n, _ in module.named_buffers(remove_duplicate=False)]
        + [n for n, _ in module.named_modules(remove_duplicate=False) if n]
    )
    files: dict[str, Any] = {}
    resolved: list[ResolvedPin] = []
    for pin in pins:
        if not isinstance(pin, Pin):
            raise PinError(f"expected a Pin, got {type(pin).__name__}: {pin!r}")
        when = resolve_when(pin)
        checked = _check_when_signature(pin, when)
        selections: dict[str, Selection] = {}
        matched = _match(pin, named, aliases, warn)
        kind = kinds.for_pin(pin)
        for name in matched:
            selection = _select(pin, name, named[name], files, matched, aliases, known)

            def read(field: str, source: Any, pin: Pin = pin, name: str = name) -> Any:
                """A field of ``pin`` for this parameter: a file it names loaded, a dict's entry picked."""
                return _by_name(pin, field, name, _load(pin, field, source, files), matched, aliases, known)

            # The kind sorts and dedupes the index and sets the elements' per-element payload.
            kind.resolve(pin, selection, read, warn, module)
            selection.kind = kind.kind
            if selection.index is not None:
                selection.index = compact_index(selection.index, named[name].numel()).to(named[name].device)
            selections[name] = selection
        resolved.append(ResolvedPin(pin, selections, when, checked))
    check_conflicts(resolved)
    parameters = {name: named[name] for name in named if any(name in rp.selections for rp in resolved)}
    trainable = sum(p.numel() for p in named.values() if p.requires_grad)
    return PinPlan(resolved, parameters, trainable, {n: aliases[n] for n in parameters if aliases.get(n)})


def tied_names(module: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, list[str]]]:
    """Parameters by name, one entry per tensor, and the other names of tied ones.

    A tensor registered under several names (tied weights: a language model's decoder is its
    word embedding) is kept under the first name ``named_parameters()`` yields, the name
    ``module.named_parameters()`` and ``state_dict`` loading use; its other names map to it in
    ``aliases``.
    """
    named: dict[str, nn.Parameter] = {}
    first: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(parameter), name)
        if canonical == name:
            named[name] = parameter
        else:
            aliases.setdefault(canonical, []).append(name)
    return named, aliases


def resolve_when(pin: Pin) -> Callable[[Any, int], bool] | None:
    """The pin's ``when`` as a callable: import a ``"module.attr"`` / ``"module:attr"`` path.

    Raises:
        PinError: the path cannot be imported, or leads to something that is not callable (a
            path that is no import path at all is refused when the Pin is built).
    """
    path = when_path(pin)  # checked at construction: None here means a callable or None
    if path is None:
        return pin.when
    module_name, attr = path
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as err:
        raise PinError(
            f"{pin!r}: cannot import when={pin.when!r}: {err}; give 'package.module.function' of a function "
            "importable in every process"
        ) from err
    if not callable(target):
        raise PinError(
            f"{pin!r}: when must be callable(batch, batch_idx) -> bool or its import path, got {pin.when!r}, "
            f"which is {type(target).__name__} {_clip(target)}"
        )
    return target


def _check_when_signature(pin: Pin, when: Callable[..., Any] | None) -> bool:
    """Whether ``when(batch, batch_idx)`` could be checked against ``when``'s signature (it can't
    for some builtins); raise :class:`PinError` if the signature does not take those two."""
    if when is None:
        return True
    try:
        signature = inspect.signature(when)
    except (TypeError, ValueError):
        return False
    try:
        signature.bind(None, 0)
    except TypeError as err:
        name = repr(pin.when) if isinstance(pin.when, str) else getattr(when, "__qualname__", repr(when))
        raise PinError(
            f"{pin!r}: when={name} has the signature {signature}, which cannot be called as "
            f"when(batch, batch_idx) ({err}); give a callable of two arguments (batch, batch_idx) that returns a bool"
        ) from err
    return True


# --------------------------------------------------------------------------------------------
# Matching parameters


def _strip_compile_prefix(name: str) -> str:
    # torch.compile wraps modules in `_orig_mod`; users write the names they see in their code.
    return name.replace("_orig_mod.", "")


def _match(
    pin: Pin, named: Mapping[str, nn.Parameter], aliases: Mapping[str, Sequence[str]], warn: Callable[[str], Any]
) -> list[str]:
    """The (first) names of the parameters ``pin``'s patterns match, by any of their names."""
    canonical = {alias: name for name, others in aliases.items() for alias in others}
    every_name = list(named) + list(canonical)
    stripped = [_strip_compile_prefix(n) for n in every_name]
    # A pattern without glob characters is a name: a dict lookup rather than a scan of every
    # name (a pin listing each of a deep model's 1,000 weights would otherwise be quadratic).
    literal: dict[str, list[int]] = {}
    for position, (n, bare) in enumerate(zip(every_name, stripped)):
        for key in {n, bare}:
            literal.setdefault(key, []).append(position)
    reached: dict[str, set[str]] = {}  # first name -> the names the patterns reached it by
    for pattern in pin.patterns:
        if pattern.startswith("re:"):
            regex = re.compile(pattern[3:])  # valid: checked when the Pin was built
            hits = [n for n, bare in zip(every_name, stripped) if regex.fullmatch(n) or regex.fullmatch(bare)]
        elif not any(c in pattern for c in "*?["):
            hits = [every_name[i] for i in literal.get(pattern, ())]
        else:
            hits = [
                n
                for n, bare in zip(every_name, stripped)
                if fnmatch.fnmatchcase(n, pattern) or fnmatch.fnmatchcase(bare, pattern)
            ]
        if not hits:
            close = difflib.get_close_matches(pattern.removeprefix("re:"), every_name, n=5, cutoff=0.3)
            hint = f"closest names: {close}" if close else f"parameter names start with: {every_name[:5]}"
            raise PinError(
                f"{pin!r}: pattern {pattern!r} matches no parameter of the module being trained "
                f"({len(named)} parameters); {hint}. "
                "Globs and 're:' patterns must match the whole name."
            )
        for hit in hits:
            reached.setdefault(canonical.get(hit, hit), set()).add(hit)
    for name, by in reached.items():
        others = [n for n in (name, *aliases.get(name, ())) if n not in by]
        if others:
            # Pinning a tied tensor pins it under every name: say so, or a pattern meant for a
            # head (`cls.*`) silently freezes the embedding it shares a tensor with.
            shown = " and ".join(repr(n) for n in sorted(by))
            warn(
                f"{pin!r}: {shown} is the same tensor as {', '.join(repr(n) for n in others)} (tied weights): "
                f"pinning it pins {'both' if len(by) + len(others) == 2 else 'all of them'}"
            )
    return list(reached)  # pattern by pattern, each in named_parameters() order


# --------------------------------------------------------------------------------------------
# Selecting elements


def _select(
    pin: Pin,
    name: str,
    parameter: nn.Parameter,
    files: dict[str, Any],
    matched: Sequence[str],
    aliases: Mapping[str, Sequence[str]],
    named_names: Iterable[str] = (),
) -> Selection:
    shape = tuple(parameter.shape)
    if pin.indices is not None:
        flat = _flat_from_indices(pin, name, shape)
        how = "indices"
    elif pin.mask is not None:
        mask = _by_name(pin, "mask", name, _load(pin, "mask", pin.mask, files), matched, aliases, named_names)
        # Type, dtype and emptiness: of a mask from a file or a dict entry, checked here once more.
        check_mask(pin, mask, f" for {name!r}")
        if tuple(mask.shape) != shape:
            raise PinError(f"{pin!r}: mask for {name!r} has shape {tuple(mask.shape)}; the parameter's shape is {shape}")
        flat = mask.detach().reshape(-1).cpu().nonzero().squeeze(1)
        how = "mask"
    elif pin.fraction is not None:
        # Seeded with the first name of a tied tensor: any of its names selects the same elements.
        flat = fraction_indices(name, parameter.numel(), float(pin.fraction), int(pin.seed))
        how = f"fraction {pin.fraction:g} (seed {pin.seed})"
    else:
        return Selection(name, parameter, None, None, "whole")
    # Keep the user's order (on the CPU) for now: value sequences follow it. _targets sorts and
    # dedupes, and resolve() moves the index to the parameter's device.
    return Selection(name, parameter, flat, None, how)


def compact_index(index: Tensor, numel: int) -> Tensor:
    """Flat indices as int32 where every index fits (4 bytes per pinned element), else int64."""
    return index.to(torch.int32) if numel <= 2**31 - 1 else index.to(torch.int64)


def fraction_indices(name: str, numel: int, fraction: float, seed: int) -> Tensor:
    """``round(fraction * numel)`` (at least 1) distinct flat indices, sorted.

    A uniform random subset drawn from a CPU generator seeded with ``seed`` and the parameter's
    name, so every rank, run and resume selects the same elements without communicating. Sparse
    selections cost O(k log k) for k elements, not O(numel): a large tensor is never permuted.
    """
    count = fraction_count(fraction, numel)
    generator = seeded_generator(name, seed)
    if count == numel:
        return torch.arange(numel)
    if count <= numel // 8:
        return _distinct_draws(numel, count, generator).sort().values
    return smallest_keys(numel, count, generator)  # the draw NeuronPin makes for every count (it nests)


def _distinct_draws(numel: int, count: int, generator: torch.Generator) -> Tensor:
    """The first ``count`` distinct values of a stream of uniform draws from ``[0, numel)``.

    Keeping the first occurrences of a uniform stream is sampling without replacement, so the
    result is a uniform random ``count``-subset. Draws are made in batches until enough are
    distinct (used for ``count <= numel / 8``, where one batch nearly always suffices).
    """
    draws = torch.empty(0, dtype=torch.int64)
    while True:
        distinct = int(torch.unique(draws).numel())
        if distinct >= count:
            break
        missing = count - distinct
        # Expected repeats grow with the share already taken: draw a little more than missing.
        extra = int(missing * numel / max(numel - count, 1)) + 64
        draws = torch.cat([draws, torch.randint(numel, (extra,), generator=generator)])
    unique, inverse = torch.unique(draws, return_inverse=True)
    first_seen = torch.full((unique.numel(),), draws.numel(), dtype=torch.int64)
    first_seen.scatter_reduce_(0, inverse, torch.arange(draws.numel()), reduce="amin")
    return unique[first_seen.argsort()[:count]]


def _flat_from_indices(pin: Pin, name: str, shape: tuple[int, ...]) -> Tensor:
    ndim = len(shape)
    coords = coordinates(pin)  # integers, rectangular, >= 0, not empty: checked when the Pin was built
    if coords.ndim == 1 and ndim == 1:
        coords = coords.unsqueeze(1)
    if coords.ndim != 2 or coords.shape[1] != ndim:
        raise PinError(
            f"{pin!r}: indices for {name!r} must be k rows of {ndim} coordinates (the parameter's shape is "
            f"{shape}), got shape {tuple(coords.shape)}"
        )
    sizes = torch.tensor(shape, dtype=torch.int64)
    bad = (coords >= sizes).any(dim=1)
    if bad.any():
        rows = coords[bad][:5].tolist()
        raise PinError(
            f"{pin!r}: indices {rows} are out of range for {name!r} of shape {shape}; "
            f"coordinate d must be in [0, shape[d])"
        )
    strides = torch.tensor([math.prod(shape[d + 1 :]) for d in range(ndim)], dtype=torch.int64)
    return (coords * strides).sum(dim=1)


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _clip(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def check_targets_fit(plan: PinPlan, dtype: torch.dtype) -> None:
    """Check that every explicit target, stuck-bit mask and bound of a floating parameter survives a
    cast to ``dtype``, for a trainer that is about to cast the parameters (``precision="16-true"``).

    Raises:
        PinError: a target overflows ``dtype`` (the same message as resolving on a cast module).
    """
    for rp in plan.pins:
        for name, selection in rp.selections.items():
            if selection.parameter.is_floating_point():
                kinds.of(selection.kind).check_fits(rp.pin, name, selection, dtype)


# --------------------------------------------------------------------------------------------
# Files and per-parameter dicts


def _load(pin: Pin, field: str, source: Any, files: dict[str, Any]) -> Any:
    """``source`` itself, or what the file it names holds (read once per resolve, shared by pins)."""
    if not isinstance(source, (str, Path)):
        return source
    key = str(Path(source).expanduser())
    if key not in files:
        try:
            files[key] = load_tensors(key)
        except TensorFileError as err:
            what = f"{pin!r}: {field} file {str(source)!r}"
            if err.reason == "suffix":
                raise PinError(f"{what} must end in one of {TENSOR_FILE_SUFFIXES}") from err
            if err.reason == "missing":
                raise PinError(
                    f"{what} does not exist (relative paths are taken from {Path.cwd()}); give the path of an "
                    "existing .pt or .safetensors file"
                ) from err
            raise PinError(f"{pin!r}: cannot read {field} file {str(source)!r}: {err}") from err
    return files[key]


def _by_name(
    pin: Pin,
    field: str,
    name: str,
    source: Any,
    matched: Sequence[str],
    aliases: Mapping[str, Sequence[str]],
    named_names: Iterable[str] = (),
) -> Any:
    """Pick ``name``'s entry from a dict keyed by parameter name (any name of a tied tensor).

    Keys are compared as pin patterns are matched, with torch.compile's ``_orig_mod.`` prefix
    stripped on both sides: a compiled module's ``state_dict`` serves the module inside it.
    A single-entry dict under a key that names nothing in the module (``named_names``: its
    parameters, buffers and submodule paths, or a tied alias) serves a pin that matches exactly
    one parameter (a one-tensor .safetensors file, say). A dict keyed by other names of the
    module, not this parameter's, is an error.
    """
    if not isinstance(source, Mapping):
        return source
    found: dict[str, Any] = {}
    for each in (name, *aliases.get(name, ())):
        bare = _strip_compile_prefix(each)
        # Dict lookups for the usual spellings; a scan only for a prefix deeper inside (a compiled submodule).
        keys = [k for k in (each, bare, "_orig_mod." + bare) if k in source]
        if not keys and any(isinstance(k, str) and "_orig_mod." in k for k in source):
            keys = [k for k in source if isinstance(k, str) and _strip_compile_prefix(k) == bare]
        for key in keys:
            found.setdefault(key, source[key])
    if found:
        first_key, first = next(iter(found.items()))
        for key, entry in list(found.items())[1:]:
            # A state_dict of a tied model holds the tensor under every name: fine if they agree.
            if not _same_entry(first, entry):
                raise PinError(
                    f"{pin!r}: {field} has different entries for {first_key!r} and {key!r}, which are the same "
                    "tensor (tied weights, or a name with and without torch.compile's '_orig_mod.'); give one"
                )
        return first
    every = {*named_names, *(a for others in aliases.values() for a in others)}
    every |= {_strip_compile_prefix(n) for n in every}
    others = sorted(k for k in source if isinstance(k, str) and (k in every or _strip_compile_prefix(k) in every))
    if others:
        # Keyed by names in the module (other parameters, buffers, submodules), not this one's:
        # applying an entry meant for something else (because its shape fits) would pin values
        # nobody chose.
        raise PinError(
            f"{pin!r}: {field} has no entry for parameter {name!r}; its keys are {sorted(map(str, source))[:10]}, and "
            f"{others[:10]} name other parameters, buffers or submodules of the module. Add an entry under "
            f"{name!r}, or give a bare tensor for one parameter"
        )
    if len(source) == 1 and len(matched) == 1:
        # One entry under a key that names nothing in the module (a one-tensor .safetensors file): by shape.
        return next(iter(source.values()))
    raise PinError(f"{pin!r}: {field} has no entry for parameter {name!r}; its keys are {sorted(source)[:10]}")


def _same_entry(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:  # exotic entries that cannot compare: treat as different
        return False


# --------------------------------------------------------------------------------------------
# Conflicts between pins


def check_conflicts(pins: Sequence[ResolvedPin]) -> None:
    """Two pins may not give one element different explicit values at times that can overlap, nor
    faults that cannot hold together: each kind says what its pins may share (see
    :func:`lightning_pin.core.kinds.check_conflict`)."""
    for i, first in enumerate(pins):
        for second in pins[i + 1 :]:
            if not windows_overlap(first.pin, second.pin):
                continue
            for name in first.selections.keys() & second.selections.keys():
                kinds.check_conflict(first.pin, first.selections[name], second.pin, second.selections[name], name)


def refuse_sparse_gradients(plan: PinPlan, module: nn.Module) -> None:
    """Element pins need dense gradients to mask; whole-tensor pins drop the gradient and need none.

    Raises:
        PinError: an element pin sits on the weight of an ``nn.Embedding`` / ``nn.EmbeddingBag``
            with ``sparse=True``, or a pin on a weight quantized by torchao (int8 codes, not trainable).
    """
    for name, parameter in plan.parameters.items():
        if isinstance(getattr(parameter, "qdata", None), Tensor):  # a runtime's quantized weight (torchao)
            raise PinError(f"{name!r} is stored as int8 codes by torchao and is not trainable: pin and train the float "
                           "model (with code pins / quantize()), then convert it with lightning_pin.deploy.to_torchao")
    element_pinned = {
        name for rp in plan.pins for name, selection in rp.selections.items() if selection.index is not None
    }
    for module_name, child in module.named_modules():
        if isinstance(child, (nn.Embedding, nn.EmbeddingBag)) and child.sparse:
            name = f"{module_name}.weight" if module_name else "weight"
            if name in element_pinned:
                raise PinError(
                    f"{name!r} gets sparse gradients ({type(child).__name__}(sparse=True)), which element pins "
                    "cannot mask; use sparse=False, or pin the whole tensor"
                )
