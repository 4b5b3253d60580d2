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
import math
import numbers
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pin.core.errors import PinError
from lightning_pin.core.io import TENSOR_FILE_SUFFIXES, TensorFileError, load_tensors
from lightning_pin.core.spec import Pin


@dataclasses.dataclass
class Selection:
    """The elements one pin selects in one parameter, and their explicit targets."""

    name: str
    parameter: nn.Parameter
    #: Sorted, unique flat (row-major) element indices on the parameter's device: int32 when the
    #: parameter has fewer than 2**31 elements, else int64.
    #: ``None`` selects the whole tensor.
    index: Tensor | None
    #: Explicit targets in the parameter's dtype and device: one per element of ``index``, or
    #: of the parameter's shape when ``index`` is None. ``None``: captured when the pin activates.
    values: Tensor | None
    #: How the elements were chosen, for the summary ("indices", "mask", "fraction 0.05", "whole").
    how: str

    @property
    def count(self) -> int:
        return self.parameter.numel() if self.index is None else int(self.index.numel())


@dataclasses.dataclass
class ResolvedPin:
    """A :class:`Pin` with its selections resolved on a module."""

    pin: Pin
    selections: dict[str, Selection]
    #: The resolved ``when`` callable, or None for a pin that is active on every batch of its window.
    when: Callable[[Any, int], bool] | None

    def in_window(self, step: int) -> bool:
        """Whether optimizer step ``step`` falls in ``[start_step, stop_step)``."""
        stop = self.pin.stop_step
        return self.pin.start_step <= step and (stop is None or step < stop)


@dataclasses.dataclass
class PinPlan:
    """Every pin resolved on one module: what :class:`~lightning_pin.core.engine.PinEngine` executes."""

    pins: list[ResolvedPin]
    #: The parameters any pin selects from, by name.
    parameters: dict[str, nn.Parameter]
    #: Elements of the module that require grad (the "trainable" total of the summary).
    trainable_elements: int

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
                for tensor in (selection.index, selection.values):
                    if tensor is None:
                        digest.update(b"-")
                    else:
                        flat = tensor.detach().reshape(-1).cpu()
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
            rows.append((name, shape, f"{parameter.numel():,}", f"{counts[name]:,}", "; ".join(hows)))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths)) + "  " + row[4] for row in rows]
        pinned = sum(counts.values())
        free = self.trainable_elements - sum(
            counts[name] for name, p in self.parameters.items() if p.requires_grad
        )
        lines.append(
            f"trainable elements: {self.trainable_elements:,}  pinned: {pinned:,}  free: {free:,}"
            f"  ({len(self.pins)} pin{'s' if len(self.pins) != 1 else ''} on {len(self.parameters)} parameters)"
        )
        return "\n".join(lines)


def _describe(rp: ResolvedPin, selection: Selection) -> str:
    pin = rp.pin
    target = "current values" if selection.values is None else "explicit values"
    parts = [selection.how, target]
    if pin.start_step or pin.stop_step is not None:
        stop = "end" if pin.stop_step is None else pin.stop_step
        parts.append(f"steps {pin.start_step}..{stop}")
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
    named = dict(module.named_parameters())
    files: dict[str, Any] = {}
    resolved: list[ResolvedPin] = []
    for pin in pins:
        if not isinstance(pin, Pin):
            raise PinError(f"expected a Pin, got {type(pin).__name__}: {pin!r}")
        when = _check_pin_fields(pin)
        selections: dict[str, Selection] = {}
        matched = _match(pin, named)
        for name in matched:
            selection = _select(pin, name, named[name], files, matched)
            selection.values = _targets(pin, selection, files, warn, matched)
            if selection.index is not None:
                selection.index = compact_index(selection.index, named[name].numel()).to(named[name].device)
            selections[name] = selection
        resolved.append(ResolvedPin(pin, selections, when))
    check_conflicts(resolved)
    parameters = {name: named[name] for name in named if any(name in rp.selections for rp in resolved)}
    trainable = sum(p.numel() for p in named.values() if p.requires_grad)
    return PinPlan(resolved, parameters, trainable)


# --------------------------------------------------------------------------------------------
# Fields that need no module


def _check_pin_fields(pin: Pin) -> Callable[[Any, int], bool] | None:
    patterns = pin.patterns
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise PinError(f"{pin!r}: params must be a non-empty string or list of strings, got {pin.params!r}")
    given = [k for k in ("indices", "mask", "fraction") if getattr(pin, k) is not None]
    if len(given) > 1:
        raise PinError(f"{pin!r}: give at most one of indices / mask / fraction, got {' and '.join(given)}")
    if pin.fraction is not None:
        f = pin.fraction
        if isinstance(f, bool) or not isinstance(f, numbers.Real) or not (0 < float(f) <= 1):
            raise PinError(f"{pin!r}: fraction must be a number in (0, 1], got {f!r}")
    if isinstance(pin.seed, bool) or not isinstance(pin.seed, numbers.Integral):
        raise PinError(f"{pin!r}: seed must be an integer, got {pin.seed!r}")
    start, stop = pin.start_step, pin.stop_step
    if isinstance(start, bool) or not isinstance(start, numbers.Integral) or start < 0:
        raise PinError(f"{pin!r}: start_step must be an integer >= 0, got {start!r}")
    if stop is not None and (isinstance(stop, bool) or not isinstance(stop, numbers.Integral) or stop <= start):
        raise PinError(f"{pin!r}: stop_step must be None or an integer > start_step ({start}), got {stop!r}")
    return resolve_when(pin)


def resolve_when(pin: Pin) -> Callable[[Any, int], bool] | None:
    """The pin's ``when`` as a callable: import a ``"module.attr"`` / ``"module:attr"`` path.

    Raises:
        PinError: ``when`` is not an import path, cannot be imported, or is not callable.
    """
    when = pin.when
    if when is None or callable(when):
        return when
    if isinstance(when, str):
        module_name, sep, attr = when.partition(":") if ":" in when else when.rpartition(".")
        if not sep or not module_name or not attr:
            raise PinError(f"{pin!r}: when={when!r} is not an import path; write 'package.module.function'")
        try:
            target: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                target = getattr(target, part)
        except (ImportError, AttributeError) as err:
            raise PinError(
                f"{pin!r}: cannot import when={when!r}: {err}; give 'package.module.function' of a function "
                "importable in every process"
            ) from err
        if callable(target):
            return target
    raise PinError(f"{pin!r}: when must be callable(batch, batch_idx) -> bool or its import path, got {when!r}")


# --------------------------------------------------------------------------------------------
# Matching parameters


def call_when(rp: ResolvedPin, batch: Any, batch_idx: int) -> bool:
    """Whether the ``when`` of ``rp`` selects this batch.

    A ``when`` decides on the host: a 0-d bool tensor on a device is read back (one sync per
    ``when`` pin and batch, inherent to deciding per batch).

    Raises:
        PinError: the ``when`` returned something other than a bool, a numpy bool or a 0-d bool
            tensor (``None``, a number or a string would be taken as "pinned" or not by accident).
    """
    answer = rp.when(batch, batch_idx)
    if isinstance(answer, bool):
        return answer
    if isinstance(answer, Tensor) and answer.dtype == torch.bool and answer.ndim == 0:
        return bool(answer)
    if type(answer).__module__ == "numpy" and type(answer).__name__ in ("bool", "bool_"):
        return bool(answer)
    if isinstance(answer, Tensor):
        shown = f"a tensor of dtype {answer.dtype} and shape {tuple(answer.shape)}"
    else:
        shown = repr(answer)
    raise PinError(
        f"{rp.pin!r}: when(batch, batch_idx) must return a bool (or a 0-d bool tensor), got {shown} "
        f"for batch {batch_idx}"
    )


def _strip_compile_prefix(name: str) -> str:
    # torch.compile wraps modules in `_orig_mod`; users write the names they see in their code.
    return name.replace("_orig_mod.", "")


def _match(pin: Pin, named: Mapping[str, nn.Parameter]) -> list[str]:
    matched: list[str] = []
    for pattern in pin.patterns:
        if pattern.startswith("re:"):
            try:
                regex = re.compile(pattern[3:])
            except re.error as err:
                raise PinError(f"{pin!r}: {pattern!r} is not a valid regular expression: {err}") from err
            hits = [n for n in named if regex.fullmatch(n) or regex.fullmatch(_strip_compile_prefix(n))]
        else:
            hits = [
                n
                for n in named
                if fnmatch.fnmatchcase(n, pattern) or fnmatch.fnmatchcase(_strip_compile_prefix(n), pattern)
            ]
        if not hits:
            close = difflib.get_close_matches(pattern.removeprefix("re:"), list(named), n=5, cutoff=0.3)
            hint = f"closest names: {close}" if close else f"parameter names start with: {list(named)[:5]}"
            raise PinError(
                f"{pin!r}: pattern {pattern!r} matches no parameter of the module being trained "
                f"({len(named)} parameters); {hint}. "
                "Globs and 're:' patterns must match the whole name."
            )
        matched.extend(h for h in hits if h not in matched)
    return matched


# --------------------------------------------------------------------------------------------
# Selecting elements


def _select(
    pin: Pin, name: str, parameter: nn.Parameter, files: dict[str, Any], matched: Sequence[str]
) -> Selection:
    shape = tuple(parameter.shape)
    if pin.indices is not None:
        flat = _flat_from_indices(pin, name, shape, pin.indices)
        how = "indices"
    elif pin.mask is not None:
        mask = _by_name(pin, "mask", name, _load(pin, "mask", pin.mask, files), matched)
        if not isinstance(mask, Tensor):
            raise PinError(f"{pin!r}: mask for {name!r} must be a bool tensor of shape {shape}, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            raise PinError(f"{pin!r}: mask for {name!r} has dtype {mask.dtype}; it must be torch.bool (mask.bool())")
        if tuple(mask.shape) != shape:
            raise PinError(f"{pin!r}: mask for {name!r} has shape {tuple(mask.shape)}; the parameter's shape is {shape}")
        flat = mask.detach().reshape(-1).cpu().nonzero().squeeze(1)
        how = "mask"
    elif pin.fraction is not None:
        flat = fraction_indices(name, parameter.numel(), float(pin.fraction), int(pin.seed))
        how = f"fraction {pin.fraction:g} (seed {pin.seed})"
    else:
        return Selection(name, parameter, None, None, "whole")
    if flat.numel() == 0:
        raise PinError(f"{pin!r}: selects no element of {name!r}; select at least one or drop the pin")
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
    count = max(1, round(fraction * numel))
    generator = torch.Generator().manual_seed(name_seed(name, seed))
    if count == numel:
        return torch.arange(numel)
    if count <= numel // 8:
        return _distinct_draws(numel, count, generator).sort().values
    return _smallest_keys(numel, count, generator)


def _smallest_keys(numel: int, count: int, generator: torch.Generator) -> Tensor:
    """The ``count`` elements with the smallest uniform random keys: O(numel), for dense picks."""
    keys = torch.rand(numel, generator=generator, dtype=torch.float64)
    threshold = keys.kthvalue(count).values
    below = keys < threshold
    # Ties at the threshold are all but impossible with 53-bit keys; break them by position.
    ties = (keys == threshold).nonzero().squeeze(1)[: count - int(below.sum())]
    below[ties] = True
    return below.nonzero().squeeze(1)


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


def name_seed(name: str, seed: int) -> int:
    """A 63-bit generator seed from ``seed`` and a parameter name, stable across processes."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def _flat_from_indices(pin: Pin, name: str, shape: tuple[int, ...], indices: Any) -> Tensor:
    ndim = len(shape)
    if isinstance(indices, Tensor):
        if indices.dtype == torch.bool:
            raise PinError(f"{pin!r}: indices is a bool tensor; pass it as mask= instead")
        if indices.is_floating_point() or indices.is_complex():
            raise PinError(f"{pin!r}: indices must hold integers, got dtype {indices.dtype}")
        coords = indices.detach().cpu().to(torch.int64)
    else:
        if isinstance(indices, (str, bytes)) or not isinstance(indices, Sequence):
            raise PinError(f"{pin!r}: indices must be a list of tuples or an integer tensor, got {indices!r}")
        rows = [tuple(row) if isinstance(row, Sequence) else row for row in indices]
        if not all(_is_int(x) for row in rows for x in (row if isinstance(row, tuple) else (row,))):
            raise PinError(f"{pin!r}: indices must hold integers, got {_clip(indices)}")
        try:
            coords = torch.tensor(rows, dtype=torch.int64)
        except (TypeError, ValueError) as err:
            raise PinError(f"{pin!r}: indices rows must all have {ndim} entries for {name!r} {shape}: {err}") from err
    if coords.ndim == 1 and ndim == 1:
        coords = coords.unsqueeze(1)
    if coords.ndim == 1 and coords.numel() == 0:
        coords = coords.reshape(0, ndim)
    if coords.ndim != 2 or coords.shape[1] != ndim:
        raise PinError(
            f"{pin!r}: indices for {name!r} must be k rows of {ndim} coordinates (the parameter's shape is "
            f"{shape}), got shape {tuple(coords.shape)}"
        )
    sizes = torch.tensor(shape, dtype=torch.int64)
    bad = ((coords < 0) | (coords >= sizes)).any(dim=1)
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


# --------------------------------------------------------------------------------------------
# Target values


def _targets(
    pin: Pin, selection: Selection, files: dict[str, Any], warn: Callable[[str], Any], matched: Sequence[str]
) -> Tensor | None:
    """Sort and dedupe ``selection.index`` in place, and return its explicit targets (or None)."""
    name, parameter = selection.name, selection.parameter
    raw = None if pin.value is None else _by_name(pin, "value", name, _load(pin, "value", pin.value, files), matched)
    values = None if raw is None else _value_tensor(pin, selection, raw, warn)
    if selection.index is not None:
        order = torch.argsort(selection.index, stable=True)
        index = selection.index[order]
        unique, counts = torch.unique_consecutive(index, return_counts=True)
        if values is not None:
            values = values[order]
            if unique.numel() != index.numel():
                # A repeated element is fine only if every repeat asks for the same value.
                first = values[counts.cumsum(0) - counts]
                if not torch.equal(values, first.repeat_interleave(counts)):
                    raise PinError(f"{pin!r}: indices repeat an element of {name!r} with different values")
                values = first
        selection.index = unique
    if values is None:
        return None
    return _to_dtype(pin, name, values, parameter, warn)


def _value_tensor(pin: Pin, selection: Selection, raw: Any, warn: Callable[[str], Any]) -> Tensor:
    """Explicit values as a tensor: one per selected element (in selection order), or full shape."""
    name, parameter = selection.name, selection.parameter
    shape = tuple(parameter.shape)
    count = parameter.numel() if selection.index is None else selection.index.numel()
    if isinstance(raw, bool) or (isinstance(raw, Tensor) and raw.dtype == torch.bool):
        raise PinError(f"{pin!r}: value must be numeric, got a bool")
    if isinstance(raw, Tensor):
        values = raw.detach().cpu()
    elif isinstance(raw, numbers.Real) or (isinstance(raw, Sequence) and not isinstance(raw, (str, bytes))):
        values = _numbers_tensor(pin, name, raw, warn)
    else:
        raise PinError(
            f"{pin!r}: value must be None, a number, a sequence, a tensor, a dict by parameter name or a "
            f".pt / .safetensors path; got {type(raw).__name__}"
        )
    if values.is_complex():
        raise PinError(f"{pin!r}: complex values are not supported")
    if values.ndim == 0:
        values = values.expand(shape) if selection.index is None else values.expand(count)
        return values.clone()
    per_element = values.ndim == 1 and values.numel() == count
    full_shape = tuple(values.shape) == shape
    if selection.index is None:
        if full_shape:
            return values.clone()
        if per_element:
            return values.reshape(shape).clone()
    elif per_element and (selection.how == "indices" or not full_shape):
        return values.clone()
    elif full_shape:
        return values.reshape(-1)[selection.index].clone()
    raise PinError(
        f"{pin!r}: value for {name!r} has shape {tuple(values.shape)}; expected a number, {count} values "
        f"(one per selected element) or a tensor of the parameter's shape {shape}"
    )


def _numbers_tensor(pin: Pin, name: str, raw: Any, warn: Callable[[str], Any]) -> Tensor:
    """Python numbers as a tensor without losing digits: int64 if all are ints, else float64."""
    leaves = list(_leaves(raw))
    if any(isinstance(x, bool) for x in leaves):
        raise PinError(f"{pin!r}: value for {name!r} holds bools; pin numbers (e.g. 1.0 / 0.0)")
    try:
        if all(_is_int(x) for x in leaves) and all(-(2**63) <= x < 2**63 for x in leaves):
            return torch.tensor(raw, dtype=torch.int64)
        rounded = [x for x in leaves if _is_int(x) and float(x) != x]
        if rounded:
            warn(
                f"{pin!r}: integers beyond int64 in the value for {name!r} are taken as their nearest float64 "
                f"(e.g. {_clip(rounded[0])} as {float(rounded[0])!r})"
            )
        return torch.tensor(raw, dtype=torch.float64)
    except OverflowError as err:
        raise PinError(f"{pin!r}: value for {name!r} holds numbers that overflow every float dtype: {err}") from err
    except (TypeError, ValueError, RuntimeError) as err:
        raise PinError(f"{pin!r}: value for {name!r} is not a number or a numeric sequence: {err}") from err


def _leaves(raw: Any) -> Iterable[Any]:
    if isinstance(raw, Sequence) and not isinstance(raw, (str, bytes)):
        for item in raw:
            yield from _leaves(item)
    else:
        yield raw


def check_targets_fit(plan: PinPlan, dtype: torch.dtype) -> None:
    """Check that every explicit target of a floating parameter survives a cast to ``dtype``, for a
    trainer that is about to cast the parameters (Lightning's ``precision="16-true"``).

    Raises:
        PinError: a target overflows ``dtype`` (the same message as resolving on a cast module).
    """
    for rp in plan.pins:
        for name, selection in rp.selections.items():
            if selection.values is not None and selection.parameter.is_floating_point():
                cast = torch.empty(0, dtype=dtype, device=selection.values.device)
                _to_dtype(rp.pin, name, selection.values, cast, lambda message: None)


def _to_dtype(pin: Pin, name: str, values: Tensor, parameter: Tensor, warn: Callable[[str], Any]) -> Tensor:
    """Cast targets to the parameter's dtype: reject NaN, inf and overflow; warn when rounded."""
    dtype = parameter.dtype
    if not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool:
        # Integer parameters (quantized weights): a cast would wrap out-of-range values around.
        info = torch.iinfo(dtype)
        wide = values.to(torch.float64) if values.is_floating_point() else values
        if values.is_floating_point() and not torch.isfinite(wide).all():
            raise PinError(f"{pin!r}: value for {name!r} holds non-finite numbers; pin finite values")
        outside = (wide < info.min) | (wide > info.max)
        if outside.any():
            bad = wide[outside][:3].tolist()
            raise PinError(f"{pin!r}: values {bad} overflow {dtype} of {name!r} (range {info.min}..{info.max})")
    if not values.is_floating_point() and not dtype.is_floating_point:
        stored = values.to(dtype)
    else:
        wide = values.to(torch.float64)
        if not torch.isfinite(wide).all():
            bad = wide[~torch.isfinite(wide)][:3].tolist()
            raise PinError(f"{pin!r}: value for {name!r} holds non-finite numbers {bad}; pin finite values")
        stored = values.to(dtype)
        if dtype.is_floating_point and not torch.isfinite(stored).all():
            big = wide[~torch.isfinite(stored)][:3].tolist()
            raise PinError(
                f"{pin!r}: values {big} overflow {dtype} of {name!r} (largest finite: {torch.finfo(dtype).max:g})"
            )
        inexact = stored.to(torch.float64) != wide
        if not values.is_floating_point():
            # Integers beyond 2**53 lose digits in float64 itself: compare them exactly, in Python.
            big = (values.abs() > 2**53).reshape(-1).nonzero().squeeze(1).tolist()
            flat_inexact = inexact.reshape(-1)
            for i in big:
                flat_inexact[i] = int(stored.reshape(-1)[i].to(torch.float64).item()) != int(values.reshape(-1)[i])
        if inexact.any():
            first = int(inexact.reshape(-1).nonzero()[0])
            asked = values.reshape(-1)[first].item()
            kept = stored.reshape(-1)[first].to(torch.float64).item()
            warn(
                f"{pin!r}: {int(inexact.sum())} value(s) for {name!r} are not representable in {dtype}; "
                f"pinning the nearest ones (e.g. {asked!r} is stored as {kept!r}). "
                "Exactness is guaranteed on the stored values."
            )
    return stored.to(parameter.device)


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


def _by_name(pin: Pin, field: str, name: str, source: Any, matched: Sequence[str]) -> Any:
    """Pick ``name``'s entry from a dict keyed by parameter name.

    A single-entry dict under another key (a one-tensor .safetensors file, say) serves a pin that
    matches exactly one parameter.
    """
    if not isinstance(source, Mapping):
        return source
    for key in (name, _strip_compile_prefix(name)):
        if key in source:
            return source[key]
    if len(source) == 1 and len(matched) == 1:
        return next(iter(source.values()))
    raise PinError(f"{pin!r}: {field} has no entry for parameter {name!r}; its keys are {sorted(source)[:10]}")


# --------------------------------------------------------------------------------------------
# Conflicts between pins


def _windows_overlap(a: Pin, b: Pin) -> bool:
    a_stop = math.inf if a.stop_step is None else a.stop_step
    b_stop = math.inf if b.stop_step is None else b.stop_step
    return max(a.start_step, b.start_step) < min(a_stop, b_stop)


def check_conflicts(pins: Sequence[ResolvedPin]) -> None:
    """Two pins may not give one element different explicit values at times that can overlap."""
    for i, first in enumerate(pins):
        for second in pins[i + 1 :]:
            if not _windows_overlap(first.pin, second.pin):
                continue
            for name in first.selections.keys() & second.selections.keys():
                a, b = first.selections[name], second.selections[name]
                if a.values is None or b.values is None:
                    continue  # an explicit value beats value=None: no conflict
                a_at, b_at = _common(a, b)
                differ = a_at != b_at
                if differ.any():
                    where = int(differ.nonzero()[0])
                    raise PinError(
                        f"{first.pin!r} and {second.pin!r} give {int(differ.sum())} element(s) of {name!r} "
                        f"different values at overlapping steps (e.g. {a_at[where].item()!r} vs "
                        f"{b_at[where].item()!r}); give each element one value or separate their step windows"
                    )


def _common(a: Selection, b: Selection) -> tuple[Tensor, Tensor]:
    """Targets of ``a`` and ``b`` on the elements both select, in the same order."""
    if a.index is None and b.index is None:
        return a.values.reshape(-1), b.values.reshape(-1)
    if a.index is None:
        return a.values.reshape(-1)[b.index], b.values
    if b.index is None:
        return a.values, b.values.reshape(-1)[a.index]
    in_b = torch.isin(a.index, b.index)
    shared = a.index[in_b]
    return a.values[in_b], b.values[torch.searchsorted(b.index, shared)]


def refuse_sparse_gradients(plan: PinPlan, module: nn.Module) -> None:
    """Element pins need dense gradients to mask; whole-tensor pins drop the gradient and need none.

    Raises:
        PinError: an element pin sits on the weight of an ``nn.Embedding`` / ``nn.EmbeddingBag``
            with ``sparse=True``.
    """
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
