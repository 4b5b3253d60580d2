"""The value kind: the selected elements equal a target bit for bit, and are frozen.

A pin with none of the other kinds' fields is a value pin (``Pin("enc.*")`` freezes, ``value=``
forces). It is ``frozen``: its elements' gradients are masked and their optimizer statistics
zeroed, and ``value=None`` targets are captured when the pin activates. Targets of several value
pins on one parameter merge in :meth:`ExactValue.merge` (an explicit value beats a captured one),
into a kernel like any other kind's.
"""

from __future__ import annotations

import math

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import torch
import torch.utils.weak
from torch import Tensor

from lightning_pin.core.errors import PinError
from lightning_pin.core.kinds._common import clip as _clip
from lightning_pin.core.kinds._common import is_int as _is_int
from lightning_pin.core.kinds._common import sort_with_index
from lightning_pin.core.kinds.base import Expected, Kind, Reader
from lightning_pin.core.layouts import _Layout
from lightning_pin.core.selection import Selection
from lightning_pin.core.sharding import Target, copy_at, is_sharded
from lightning_pin.core.spec import Pin, check_value, number_leaves

__all__ = ["ExactValue", "differs"]


_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


class ExactValue(Kind):
    """Write the target: the element equals it bit for bit (``torch.equal``).

    Example::

        >>> import torch
        >>> from lightning_pin.core.sharding import Target
        >>> weight = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
        >>> ExactValue(Target("w", weight, torch.tensor([1]), torch.tensor([25.0]))).apply(weight.data)
        >>> weight.data
        tensor([ 1., 25.,  3.])
    """

    kind = "value"
    words = "a value"
    off_words = "off target"
    pin_fields = ("value",)
    frozen = True
    example = "{coords}: {actual!r} != {expected!r}"
    map_fields = {"value": math.nan}
    map_keeps_dtype = True  # stuck values keep the pins' dtype (float32 values stay float32)
    map_fold = {"value": "same"}
    map_words = ("stuck value", "stuck values")
    mixed_reason = "a value fixes every bit, so nothing is left to fault; "

    @classmethod
    def resolve(
        cls, pin: Pin, selection: Selection, read: Reader, warn: Callable[[str], Any], module: torch.nn.Module
    ) -> None:
        raw = None
        if pin.value is not None:
            raw = read("value", pin.value)
            if isinstance(pin.value, (str, Path)):
                # Values given in memory were checked when the Pin was built; a file's only now.
                check_value(pin, raw, f" for {selection.name!r}")
        values = None if raw is None else _value_tensor(pin, selection, raw, warn)
        if values is None:
            sort_with_index(pin, selection, (), "values")
            selection.values = None
            return
        (values,) = sort_with_index(pin, selection, (values,), "values")
        selection.values = _to_dtype(pin, selection.name, values, selection.parameter, warn)

    @classmethod
    def describe(cls, selection: Selection) -> str:
        return "current values" if selection.values is None else "explicit values"

    @classmethod
    def check_fits(cls, pin: Pin, name: str, selection: Selection, dtype: torch.dtype) -> None:
        if selection.values is not None:
            cast = torch.empty(0, dtype=dtype, device=selection.values.device)
            _to_dtype(pin, name, selection.values, cast, lambda message: None)

    @classmethod
    def check_overlap(cls, first: Pin, a: Selection, second: Pin, b: Selection, name: str) -> None:
        """Two value pins may not give one element different explicit values (an explicit value
        beats ``value=None``: no conflict)."""
        if a.values is None or b.values is None:
            return
        a_at, b_at = _common(a, b)
        differ = a_at != b_at
        if differ.any():
            where = int(differ.nonzero()[0])
            raise PinError(
                f"{first!r} and {second!r} give {int(differ.sum())} element(s) of {name!r} "
                f"different values at overlapping steps (e.g. {a_at[where].item()!r} vs "
                f"{b_at[where].item()!r}); give each element one value or separate their step windows"
            )

    @classmethod
    def merge(
        cls, name: str, parameter: torch.nn.Parameter, entries: Sequence[Selection],
        captured: Sequence[Optional[Tensor]] = (),
    ) -> Optional[ExactValue]:
        """The targets of several value pins on one parameter, captured ones first and explicit ones
        after, later entries winning: an explicit value beats a captured one (the plan has refused two
        different explicit values that can be active together). None while no entry holds a target
        (``value=None`` pins not captured yet).

        Where each merged value comes from depends only on the selections, never on the values: it is
        worked out once per combination of selections (it syncs with the host) and kept, so that a
        ``when`` pin re-capturing at every activation merges its targets without a sync.
        """
        captured = list(captured) or [None] * len(entries)
        parts = [(e, c) for e, c in zip(entries, captured) if e.values is None and c is not None]
        parts += [(e, e.values) for e in entries if e.values is not None]
        if not parts:
            return None
        layout = _layout(entries[0], [(e, e.values is not None) for e, _ in parts])
        index, values = layout.apply([values for _, values in parts])
        return cls(Target(name, parameter, index, values, _by_strides=layout.by_strides))

    @classmethod
    def map_entries(cls, pin: Pin, selection: Optional[Selection]) -> dict[str, Any]:
        if selection is None:
            if pin.value is None:
                raise PinError(
                    f"save_fault_map: {pin!r} has no value (value=None keeps what the weights hold when it activates): "
                    "save_fault_map(pins, path, module=model) saves what they hold now"
                )
            return {"value": pin.value}
        values, parameter = selection.values, selection.parameter.detach()
        if values is None:  # value=None: the elements are stuck at what they hold now
            flat = parameter.reshape(-1)
            values = flat if selection.index is None else flat[selection.index.to(parameter.device).long()]
        return {"value": values.detach().cpu().reshape(-1)}

    def kernel(self, tensor: Tensor) -> Callable[[], None]:
        target = self.target
        if target.index is not None and _is_data_of(tensor, target.parameter):
            fast = target.kernel()  # put_ / index_copy_ of the targets, shared with the engine's writes
            if fast is not None:
                return fast
        view, positions, values = target.part(tensor)
        if values.device != view.device or values.dtype != view.dtype:
            values = values.to(device=view.device, dtype=view.dtype)  # a copy elsewhere (an averaged model)
        if positions is None:

            def write_whole() -> None:
                view.copy_(values)

            return write_whole
        positions = positions.to(view.device)

        def write() -> None:
            copy_at(view, positions, values)

        return write

    def drift(self, tensor: Tensor) -> Tensor:
        _, _, values, actual = self.elements_of(tensor)
        deviation = (actual - values.reshape(-1).to(actual.device)).abs()
        return deviation if deviation.dtype in (torch.float32, torch.float64) else deviation.float()

    def off(self, tensor: Tensor) -> tuple[Tensor, Tensor, Expected]:
        """Bit for bit (:func:`differs`: NaN equals NaN, -0.0 differs from 0.0); a tensor of another
        dtype (a copy, a stored tensor) by value in float64."""
        _, _, values, actual = self.elements_of(tensor)
        expected = values.reshape(-1).to(actual.device)
        return actual, differs(actual, expected), lambda position: expected[position].item()


def _is_data_of(tensor: Tensor, parameter: torch.nn.Parameter) -> bool:
    """Whether ``tensor`` is ``parameter``'s own dense data (the same elements of the same storage)."""
    return (
        not is_sharded(tensor) and not is_sharded(parameter) and tensor.dtype == parameter.dtype
        and tensor.shape == parameter.shape and tensor.stride() == parameter.stride()
        and tensor.data_ptr() == parameter.data_ptr()
    )


# Merge layouts of value targets, kept with the first selection of the merge (so as long as the plan
# lives) by the selections merged and whether each gives explicit values (see ExactValue.merge).
_LAYOUTS: torch.utils.weak.WeakIdKeyDictionary = torch.utils.weak.WeakIdKeyDictionary()


def _layout(owner: Selection, parts: list[tuple[Selection, bool]]) -> _Layout:
    key = tuple((id(selection), explicit) for selection, explicit in parts)
    cache = _LAYOUTS.get(owner)
    if cache is None:
        cache = _LAYOUTS[owner] = {}
    found = cache.get(key)
    if found is None or any(a is not b for a, b in zip(found.indices, [s.index for s, _ in parts])):
        found = cache[key] = _Layout.of([selection.index for selection, _ in parts])
    return found


def differs(ta: Tensor, tb: Tensor) -> Tensor:
    """Elements that differ bit for bit (so NaN equals NaN and -0.0 differs from 0.0).

    Tensors of different dtypes are compared by value in float64: a pinned 25.0 stored as
    float16 still equals 25.0, a 2.58e-8 that float16 flushes to zero does not.
    """
    if ta.dtype != tb.dtype:
        return ta.to(torch.float64) != tb.to(torch.float64)
    if ta.is_floating_point() and ta.element_size() in _SAME_WIDTH_INT:
        as_int = _SAME_WIDTH_INT[ta.element_size()]
        return ta.contiguous().view(as_int) != tb.contiguous().view(as_int)
    return ta != tb


def _value_tensor(pin: Pin, selection: Selection, raw: Any, warn: Callable[[str], Any]) -> Tensor:
    """Explicit values as a tensor: one per selected element (in selection order), or full shape."""
    name, parameter = selection.name, selection.parameter
    shape = tuple(parameter.shape)
    count = parameter.numel() if selection.index is None else selection.index.numel()
    if callable(raw) and not isinstance(raw, Tensor):
        raise PinError(
            f"{pin!r}: value for {name!r} is a generator ({type(raw).__name__}) that was never turned into "
            "numbers; lightning_pin.app.pins.realize(pin, model) draws them, or give numbers or a tensor"
        )
    # Numbers (no bools, no complex, finite) or a tensor of them: see spec.check_value.
    values = raw.detach().cpu() if isinstance(raw, Tensor) else _numbers_tensor(pin, name, raw, warn)
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
    leaves = list(number_leaves(raw))
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


def _to_dtype(pin: Pin, name: str, values: Tensor, parameter: Tensor, warn: Callable[[str], Any]) -> Tensor:
    """Cast targets to the parameter's dtype: reject overflow; warn when rounded.

    ``values`` are finite (NaN and inf are rejected by :func:`~lightning_pin.core.spec.check_value`).
    """
    dtype = parameter.dtype
    if not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool:
        # Integer parameters (quantized weights): a cast would wrap out-of-range values around.
        info = torch.iinfo(dtype)
        wide = values.to(torch.float64) if values.is_floating_point() else values
        outside = (wide < info.min) | (wide > info.max)
        if outside.any():
            bad = wide[outside][:3].tolist()
            raise PinError(f"{pin!r}: values {bad} overflow {dtype} of {name!r} (range {info.min}..{info.max})")
    if not values.is_floating_point() and not dtype.is_floating_point:
        stored = values.to(dtype)
    else:
        wide = values.to(torch.float64)
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
