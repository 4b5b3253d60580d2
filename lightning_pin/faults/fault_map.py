"""Fault-map files: stuck values, stuck bits and bounds per parameter name (:func:`save_fault_map`,
:func:`load_fault_map`), so a chip's measured map can be pinned as it is."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from lightning_pin.core import kinds
from lightning_pin.core.errors import PinError
from lightning_pin.core.io import TensorFileError, load_tensors
from lightning_pin.core.plan import resolve
from lightning_pin.core.kinds.stuck_bits import unsigned
from lightning_pin.core.spec import Pin
from lightning_pin.faults._common import FaultPins, coordinates, exact_name, exact_pattern, finish

__all__ = ["FIELDS", "INDICES", "PathLike", "SHAPE", "SPEC_FIELDS", "load_fault_map", "save_fault_map"]


#: What a fault-map key after ``<parameter name>:`` may say, and what marks a healthy element there:
#: each kind's fields (see :attr:`lightning_pin.core.kinds.base.Kind.map_fields`).
FIELDS = {field: healthy for each in kinds.KINDS for field, healthy in each.map_fields.items()}

def _kind_of(field: str) -> type[kinds.Kind]:
    """The kind a map field belongs to, in the registry as it is now (a registered kind's too)."""
    return next(each for each in kinds.KINDS if field in each.map_fields)


def _fields() -> dict[str, float]:
    return {field: healthy for each in kinds.KINDS for field, healthy in each.map_fields.items()}


def _spec_fields() -> dict[str, type[kinds.Kind]]:
    return {field: each for each in kinds.KINDS for field in each.map_spec_fields}

#: Per-parameter entries (not one per element) and the kind they belong to: a quantized code's spec.
SPEC_FIELDS = {field: each for each in kinds.KINDS for field in each.map_spec_fields}
#: The field of a bare parameter-name key (older maps: it holds stuck values).
_BARE = next(iter(kinds.DEFAULT.map_fields))
#: The key suffix of the (optional) coordinates of the elements the other fields describe.
INDICES = "indices"
#: The key suffix of the (optional) shape of the parameter, as int64 sizes: a map is refused on a
#: parameter of another shape. Older files have none and load as before.
SHAPE = "shape"
#: The key suffix of the (optional) dtype of the parameter: an empty tensor of that dtype (a tensor file
#: holds tensors only). Read into :attr:`FaultPins.dtypes`.
DTYPE = "dtype"

PathLike = Union[str, Path]


def save_fault_map(
    pins: Iterable[Pin], path: PathLike, *, module: Optional[nn.Module] = None, overwrite: bool = False
) -> Path:
    """Write ``pins`` (stuck values, stuck bits, bounds) to a fault-map file that :func:`load_fault_map` reads.

    Without ``module`` the pins must name their elements by themselves: one parameter name each
    (as the generators of this module return them) and ``indices`` or a ``mask`` (or no selection
    with tensors of the parameter's shape), with explicit values. With ``module`` any pin is
    resolved on it first (globs, ``fraction``, whole tensors; ``value=None`` saves what the
    elements hold now). Either way a fault map holds faults present at every step: ``when`` and
    step windows cannot be saved in one. Pins on the
    same parameter are merged: stuck bits are OR-ed, bounds intersected; two different values for
    one element are an error. The file is a flat dict of tensors (``.pt`` / ``.pth`` via
    ``torch.save``, or ``.safetensors``), per parameter ``name:indices`` (``k x ndim`` integer
    coordinates: int16, int32 or int64, the smallest that holds the parameter's sizes when its shape
    is known) and one entry per element for each field present: ``name:value`` (NaN: no stuck
    value), ``name:stuck_at_zero`` / ``name:stuck_at_one`` (int64 bit patterns, 0: no stuck bit),
    ``name:low`` / ``name:high`` (float64, -inf / +inf: no bound), and ``name:shape`` (the
    parameter's shape, int64) where it is known: always with ``module``; without, from a ``mask``,
    a tensor of the parameter's shape, or the ``shapes`` of a :class:`FaultPins` (what
    :func:`cell_faults` and :func:`bit_faults` return; pins with bare ``indices`` do not tell it).
    ``name:dtype`` (an empty tensor of the parameter's dtype) likewise, from ``module`` or the
    ``dtypes`` of a :class:`FaultPins`. A map that records its shapes is refused on a parameter of
    another shape. An existing file is never replaced unless ``overwrite=True``.

    Example::

        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> from lightning_pin.faults import cell_faults, load_fault_map, save_fault_map
        >>> net = torch.nn.Linear(8, 4)
        >>> pins = cell_faults(net, "weight", rate=0.25)
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = save_fault_map(pins, Path(folder) / "chip.safetensors", module=net)
        ...     loaded = load_fault_map(path)
        >>> torch.equal(loaded[0].mask.nonzero(), pins[0].indices), torch.equal(loaded[0].value, pins[0].value)
        (True, True)
        >>> loaded.shapes
        {'weight': (4, 8)}

    Returns:
        The path written.

    Raises:
        PinError: a pin a fault map cannot hold (``when``, a step window; without ``module`` also a
            glob, ``fraction``, ``value=None``, values given as file paths, a scalar for a whole
            tensor of unknown shape), a pin ``module`` refuses, conflicting values, a bit stuck
            both ways, empty bounds, pins of one parameter that give it different shapes or
            coordinates outside its shape, an unknown suffix, or a ``path`` that exists (without
            ``overwrite=True``) or is a directory. Checked before anything is written.
    """
    path = Path(path).expanduser()
    if path.suffix not in (".pt", ".pth", ".safetensors"):
        raise PinError(f"save_fault_map: {path} must end in .pt, .pth or .safetensors")
    if path.is_dir():
        raise PinError(f"save_fault_map: {path} is a directory; give the path of the file to write")
    if path.exists() and not overwrite:
        raise PinError(
            f"save_fault_map: {path} already exists; it is left as it is. Give another path, or pass "
            "overwrite=True to replace it"
        )
    known_shapes = dict(getattr(pins, "shapes", None) or {})
    known_dtypes = dict(getattr(pins, "dtypes", None) or {})
    if module is not None:
        known_dtypes.update((name, p.dtype) for name, p in module.named_parameters(remove_duplicate=False))
    entries: dict[str, list[tuple[Tensor, dict[str, Tensor], Optional[tuple[int, ...]]]]] = {}
    specs: dict[str, dict[str, Tensor]] = {}
    found = _resolved_entries(list(pins), module) if module is not None else map(_fault_entry, pins)
    for name, coords, fields, shape, spec in found:
        entries.setdefault(name, []).append((coords, fields, shape if shape is not None else known_shapes.get(name)))
        if spec:
            before = specs.setdefault(name, spec)
            if before.keys() != spec.keys() or not all(torch.equal(before[k], spec[k]) for k in spec):
                raise PinError(f"save_fault_map: the pins on {name!r} store it in different codes; a parameter "
                               "is stored in one")
    if not entries:
        raise PinError("save_fault_map: no pins to save")
    tensors: dict[str, Tensor] = {}
    for name, parts in entries.items():
        shape = _one_shape(name, parts)
        tensors.update(_merge(name, [(coords, fields) for coords, fields, _ in parts], shape))
        if shape is not None:
            tensors[f"{name}:{SHAPE}"] = torch.tensor(shape, dtype=torch.int64).reshape(len(shape))
            # The smallest integers that hold the sizes: a conv weight's 4 coordinates in 8 bytes, not 32.
            tensors[f"{name}:{INDICES}"] = tensors[f"{name}:{INDICES}"].to(_index_dtype(shape))
        if name in known_dtypes:
            tensors[f"{name}:{DTYPE}"] = torch.empty(0, dtype=known_dtypes[name])
        tensors.update((f"{name}:{field}", tensor) for field, tensor in specs.get(name, {}).items())
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    else:
        torch.save(tensors, path)
    return path


def load_fault_map(path: PathLike) -> FaultPins:
    """Pins for every fault a fault-map file marks: stuck values, stuck bits and bounds, per parameter.

    The file (``.pt`` / ``.pth`` / ``.safetensors``) is a flat dict of tensors keyed by
    ``<parameter name>:<field>``, each field of the parameter's shape (a dense map, as a chip
    measurement gives) or, when ``<name>:indices`` holds ``k x ndim`` coordinates, with one entry
    per listed element (as :func:`save_fault_map` writes):

    - ``value``: the value the element is stuck at; NaN marks a healthy element. A key that is a
      bare parameter name means the same (the older NaN-means-healthy maps);
    - ``stuck_at_zero`` / ``stuck_at_one``: integer bit patterns of the element's word; 0 marks no
      stuck bit;
    - ``low`` / ``high``: the interval a bounded cell is clamped into; -inf / +inf mark no bound;
    - ``shape`` (optional): the parameter's shape. With it the pins select their elements by a
      ``mask`` of that shape, so resolving them on a parameter of another shape is a
      :class:`PinError`; older files without it give ``indices`` pins, as before.

    Each parameter gives up to three pins (one per kind present), checked like any pin when
    resolved on the module. The returned :class:`FaultPins` has a ``summary`` of what was read
    and the ``shapes`` and ``dtypes`` the file records.

    Raises:
        PinError: the file is missing or unreadable, holds anything but tensors keyed by name,
            uses an unknown field, has fields whose shapes disagree, records a shape its
            coordinates do not fit (or lists an element twice with one), or marks no fault.
    """
    path = Path(path).expanduser()
    try:
        raw = load_tensors(path)
    except TensorFileError as err:
        if err.reason == "missing":
            raise PinError(
                f"fault map {str(path)!r} does not exist (relative paths are taken from {Path.cwd()}); "
                "write one with lightning_pin.faults.save_fault_map (or lightning_pin.app.pins.random_fault_map and "
                "torch.save)"
            ) from err
        raise PinError(f"fault map: {err}") from err
    where = f"fault map {str(path)!r}"
    if not isinstance(raw, Mapping) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in raw.items()):
        raise PinError(f"{where} must hold a dict of tensors keyed by parameter name (and field)")
    grouped: dict[str, dict[str, Tensor]] = {}
    for key, tensor in raw.items():
        name, field = _split_key(key, where)
        if field in grouped.setdefault(name, {}):
            raise PinError(f"{where}: {name!r} has its stuck values twice (as {name!r} and {name + ':' + _BARE!r})")
        grouped[name][field] = tensor
    pins, lines, faulty, shapes, dtypes = [], [], {}, {}, {}
    for name, fields in grouped.items():
        shape = _recorded_shape(name, fields.pop(SHAPE, None), where)
        if shape is not None:
            shapes[name] = shape
        dtype = fields.pop(DTYPE, None)
        if dtype is not None:
            if dtype.numel():
                raise PinError(f"{where}: {name}:{DTYPE} must be an empty tensor of the parameter's dtype, got "
                               f"{_show(dtype)}")
            dtypes[name] = dtype.dtype
        made, line, count = _pins_from_fields(name, fields, where, shape)
        pins += made
        faulty[name] = count
        lines.append(line)
    if not pins:
        raise PinError(f"{where} marks no faulty cell (every value NaN, no stuck bit, no bound)")
    return finish(pins, f"fault map {path.name}", lines, faulty, shapes=shapes, dtypes=dtypes)


def _recorded_shape(name: str, tensor: Optional[Tensor], where: str) -> Optional[tuple[int, ...]]:
    if tensor is None:
        return None
    if tensor.is_floating_point() or tensor.dtype == torch.bool or tensor.ndim != 1 or bool((tensor < 0).any()):
        raise PinError(
            f"{where}: {name}:{SHAPE} must be the parameter's shape as non-negative integers (a 1-D int64 tensor), "
            f"got {_show(tensor)}"
        )
    return tuple(int(size) for size in tensor.tolist())


def _one_shape(
    name: str, parts: list[tuple[Tensor, dict[str, Tensor], Optional[tuple[int, ...]]]]
) -> Optional[tuple[int, ...]]:
    """The shape the pins on ``name`` give it (None if none tells); its coordinates must fit it."""
    shapes = sorted({tuple(shape) for _, _, shape in parts if shape is not None})
    if len(shapes) > 1:
        raise PinError(
            f"save_fault_map: the pins on {name!r} do not agree on its shape: {name!r} is given as "
            f"{' and as '.join(map(str, shapes))}"
        )
    if not shapes:
        return None
    shape = shapes[0]
    for coords, _, _ in parts:
        _check_inside(coords, shape, f"save_fault_map: element {{}} of {name!r} is outside its shape {shape}")
    return shape


def _check_inside(coords: Tensor, shape: tuple[int, ...], message: str) -> None:
    """Raise ``message`` (formatted with the first offending element) for coordinates outside ``shape``."""
    if coords.shape[1] != len(shape):
        raise PinError(message.format(f"with {coords.shape[1]} coordinates"))
    if coords.numel() == 0:
        return
    outside = ((coords < 0) | (coords >= torch.tensor(shape, dtype=coords.dtype))).any(dim=1)
    if bool(outside.any()):
        raise PinError(message.format(tuple(coords[outside.to(torch.int8).argmax()].tolist())))


def _split_key(key: str, where: str) -> tuple[str, str]:
    name, sep, field = key.rpartition(":")
    if not sep:
        return key, _BARE  # the older maps: the bare parameter name holds stuck values
    if field not in _fields() and field not in _spec_fields() and field not in (INDICES, SHAPE, DTYPE):
        raise PinError(
            f"{where}: key {key!r} ends in {field!r}; a key is a parameter name or 'name:field' with field one of "
            f"{[*_fields(), *_spec_fields(), INDICES, SHAPE, DTYPE]}"
        )
    return name, field


def _pins_from_fields(
    name: str, fields: dict[str, Tensor], where: str, recorded: Optional[tuple[int, ...]] = None
) -> tuple[list[Pin], str, int]:
    """One pin per kind of fault that ``fields`` marks for parameter ``name`` (of shape ``recorded``, when the file
    records it)."""
    coords = fields.pop(INDICES, None)
    spec = {field: fields.pop(field) for field in list(fields) if field in _spec_fields()}
    flat: Optional[Tensor] = None  # with a recorded shape: the listed elements, flat and sorted
    if coords is not None:
        if coords.dtype in (torch.bool,) or coords.is_floating_point() or coords.ndim not in (1, 2):
            raise PinError(f"{where}: {name}:indices must be (k x ndim) integer coordinates, got {_show(coords)}")
        coords = coords.to(torch.int64)
        expected: Optional[tuple[int, ...]] = (coords.shape[0],)
        if recorded is not None:
            flat, order = _flat_sorted(name, coords, recorded, where)
            for field in list(fields):  # row-major order: the order a mask pin reads its entries in
                if tuple(fields[field].shape) == expected:
                    fields[field] = fields[field][order]
    else:
        expected = recorded
    for field, tensor in fields.items():
        shape = tuple(tensor.shape)
        bits = _kind_of(field).map_bits
        if bits and (tensor.is_floating_point() or tensor.dtype == torch.bool):
            raise PinError(f"{where}: {name}:{field} must hold integer bit patterns, got {_show(tensor)}")
        if not bits and not tensor.is_floating_point():
            tensor = fields[field] = tensor.to(torch.float64)
        if expected is None:
            expected = shape
        elif shape != expected:
            per = "one entry per row of indices" if coords is not None else "the parameter's shape, like the others"
            raise PinError(f"{where}: {name}:{field} has shape {shape}; expected {expected} ({per})")

    def select(chosen: Tensor) -> dict[str, Any]:
        if flat is not None:  # a mask of the recorded shape: a parameter of another shape is refused
            mask = torch.zeros(recorded, dtype=torch.bool)
            mask.view(-1)[flat[chosen]] = True
            return {"mask": mask}
        if coords is not None:
            return {"indices": coords[chosen]}
        return {"mask": chosen}

    pins, parts, every = [], [], None
    pattern = exact_pattern(name)
    for each in kinds.KINDS:  # one pin per kind the map marks, in registry order
        marked = each.map_marked(fields)
        if marked is None:
            continue
        every = marked if every is None else every | marked
        if bool(marked.any()):
            own = {k: v for k, v in spec.items() if _spec_fields()[k] is each}
            pins.append(each.map_pin(pattern, fields, marked, select(marked), own, where))
            parts.append(each.map_summary(int(marked.sum())))
    count = 0 if every is None else int(every.sum())
    return pins, f"{name}: {', '.join(parts) if parts else 'no fault'}", count


def _flat_sorted(name: str, coords: Tensor, shape: tuple[int, ...], where: str) -> tuple[Tensor, Tensor]:
    """The listed elements as sorted flat indices into ``shape``, and the order that sorts the rows."""
    coords = coords.unsqueeze(1) if coords.ndim == 1 else coords
    if coords.shape[1] != len(shape):
        raise PinError(
            f"{where}: {name}:indices has coordinates of {coords.shape[1]} dimensions, the recorded shape has "
            f"{len(shape)} ({shape})"
        )
    _check_inside(coords, shape, f"{where}: element {{}} of {name!r} is outside the recorded shape {shape}")
    strides = torch.tensor([math.prod(shape[d + 1 :]) for d in range(len(shape))], dtype=torch.int64)
    flat = (coords * strides).sum(dim=1) if len(shape) else torch.zeros(coords.shape[0], dtype=torch.int64)
    flat, order = torch.sort(flat, stable=True)
    repeated = flat[1:] == flat[:-1]
    if bool(repeated.any()):
        twice = coords[order[1:][repeated][0]]
        raise PinError(f"{where}: {name}:indices lists element {tuple(twice.tolist())} of {name!r} twice")
    return flat, order


def _resolved_entries(
    pins: list[Pin], module: nn.Module
) -> list[tuple[str, Tensor, dict[str, Tensor], Optional[tuple[int, ...]], dict[str, Tensor]]]:
    """Per pin and parameter it selects on ``module``: the name, coordinates, per-element fields, shape and the
    kind's per-parameter entries."""
    for pin in pins:
        _static(pin)
    found = []
    for rp in resolve(pins, module).pins:
        for name, selection in rp.selections.items():
            parameter = selection.parameter.detach()
            flat = torch.arange(parameter.numel()) if selection.index is None else selection.index.cpu().long()
            coords = coordinates(flat, tuple(parameter.shape))

            fields = kinds.of(selection.kind).map_entries(rp.pin, selection)  # one per element of `flat`
            spec = {field: fields.pop(field) for field in list(fields) if field in _spec_fields()}
            found.append((name, coords, fields, tuple(parameter.shape), spec))
    return found


def _static(pin: Pin) -> None:
    if pin.when is not None or pin.start_step or pin.stop_step is not None:
        raise PinError(
            f"save_fault_map: {pin!r}: a fault map holds faults present at every step; when, start_step and "
            "stop_step cannot be saved in one"
        )


def _fault_entry(pin: Pin) -> tuple[str, Tensor, dict[str, Tensor], Optional[tuple[int, ...]], dict[str, Tensor]]:
    """The parameter a pin names, its elements' coordinates, its per-element fields and the
    parameter's shape where the pin tells it (a mask, tensors of the whole parameter)."""
    if not isinstance(pin, Pin):
        raise PinError(f"save_fault_map: expected Pins, got {type(pin).__name__}: {pin!r}")
    name = exact_name(pin.params) if isinstance(pin.params, str) else None
    if name is None:
        raise PinError(
            f"save_fault_map: {pin!r} must name one parameter exactly (a fault map is keyed by name); a glob, regex "
            "or list of names needs a module to resolve: save_fault_map(pins, path, module=model)"
        )
    _static(pin)
    if pin.fraction is not None:
        raise PinError(
            f"save_fault_map: {pin!r}: fraction needs a module to resolve: save_fault_map(pins, path, module=model)"
        )
    for field in ("indices", "mask", *(f for each in kinds.KINDS for f in each.pin_fields)):
        if isinstance(getattr(pin, field), (str, Path, Mapping)):
            raise PinError(f"save_fault_map: {pin!r}: {field} must be given in memory (tensors or numbers) to be saved")
    given = kinds.for_pin(pin).map_entries(pin, None)
    spec = {field: given.pop(field) for field in list(given) if field in _spec_fields()}
    if pin.indices is not None:
        coords = torch.as_tensor(pin.indices).to(torch.int64)
        coords = coords.unsqueeze(1) if coords.ndim == 1 else coords
        full = None
    elif pin.mask is not None:
        coords, full = pin.mask.nonzero(), tuple(pin.mask.shape)
    else:
        shapes = [tuple(t.shape) for t in given.values() if isinstance(t, Tensor) and t.ndim > 0]
        if not shapes:
            raise PinError(
                f"save_fault_map: {pin!r} selects a whole tensor whose shape it does not tell: give indices, a mask, "
                "or per-element tensors of the parameter's shape"
            )
        full = shapes[0]
        coords = torch.ones(full, dtype=torch.bool).nonzero()
    fields = {}
    for field, raw in given.items():
        if raw is None:
            continue
        fields[field] = _per_element(pin, field, raw, coords, full)
    return name, coords, fields, full, spec


def _per_element(pin: Pin, field: str, raw: Any, coords: Tensor, full: Optional[tuple[int, ...]]) -> Tensor:
    """A pin field as one entry per row of ``coords`` (int64 bit patterns for masks, else floats).

    Read as the plan reads it: a number for every element, one entry per selected element, or a
    tensor of the parameter's shape.
    """
    bits = _kind_of(field).map_bits
    try:
        tensor = raw.detach().cpu() if isinstance(raw, Tensor) else torch.tensor(raw, dtype=torch.float64)
        if bits and not isinstance(raw, Tensor):
            tensor = torch.tensor(raw, dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError, OverflowError) as err:
        raise PinError(f"save_fault_map: {pin!r}: {field} is not numbers: {err}") from err
    if bits:
        tensor = unsigned(tensor)
    elif not tensor.is_floating_point():
        tensor = tensor.to(torch.float64)
    count = coords.shape[0]
    if tensor.ndim == 0:
        return tensor.expand(count).clone()
    per_element = tensor.ndim == 1 and tensor.numel() == count
    if pin.indices is not None:
        if per_element:
            return tensor.clone()
        if tensor.ndim == coords.shape[1] and all(
            int(coords[:, d].max()) < tensor.shape[d] for d in range(tensor.ndim)
        ):
            return tensor[tuple(coords.T)].clone()
    else:
        if tuple(tensor.shape) == full:
            return tensor[tuple(coords.T)].clone()
        if per_element:
            return tensor.clone()
    raise PinError(
        f"save_fault_map: {pin!r}: {field} has shape {tuple(tensor.shape)}; expected a number, {count} entries "
        "(one per selected element) or a tensor of the parameter's shape"
    )


def _index_dtype(shape: tuple[int, ...]) -> torch.dtype:
    """int16, int32 or int64: the smallest that holds every coordinate of a parameter of ``shape``."""
    largest = max(shape, default=1)
    return torch.int16 if largest <= 2**15 else torch.int32 if largest <= 2**31 else torch.int64


def _merge(name: str, parts: list[tuple[Tensor, dict[str, Tensor]]],
           shape: Optional[tuple[int, ...]] = None) -> dict[str, Tensor]:
    """The fault-map entries of one parameter: the union of its pins' elements and their fields."""
    ndims = {coords.shape[1] for coords, _ in parts}
    if len(ndims) > 1:
        raise PinError(f"save_fault_map: the pins on {name!r} give coordinates of {sorted(ndims)} dimensions")
    coords = torch.cat([coords for coords, _ in parts])
    if shape is not None and len(shape) == coords.shape[1] and len(shape) > 1 and bool((coords >= 0).all()):
        # Row-major flat positions sort as the coordinates do: a 1-D unique, many times faster than unique(dim=0)
        # on k x ndim rows, with the same cells in the same order.
        strides = torch.tensor([math.prod(shape[i + 1:]) for i in range(len(shape))], dtype=torch.int64)
        flat, inverse = torch.unique(coords.long() @ strides, return_inverse=True)
        cells = torch.stack(torch.unravel_index(flat, shape), dim=1).to(coords.dtype)
    else:
        cells, inverse = torch.unique(coords, dim=0, return_inverse=True)
    given: dict[str, list[Tensor]] = {}
    for _, fields in parts:
        for field, tensor in fields.items():
            given.setdefault(field, []).append(tensor)
    dtypes = {field: _kind_of(field).map_dtype(field, tensors) for field, tensors in given.items()}

    def element(row: int) -> str:
        return f"element {tuple(cells[row].tolist())} of {name!r}"

    merged: dict[str, Tensor] = {}
    start = 0
    for coords, fields in parts:
        at = inverse[start : start + coords.shape[0]]
        start += coords.shape[0]
        for field, entries in fields.items():
            healthy = _kind_of(field).map_fields[field]
            target = merged.setdefault(field, torch.full((cells.shape[0],), healthy, dtype=dtypes[field]))
            _kind_of(field).map_merge(element, field, target, at, entries.to(dtypes[field]))
    for each in kinds.KINDS:
        each.map_check(merged, element)
    return {f"{name}:{INDICES}": cells, **{f"{name}:{field}": tensor for field, tensor in merged.items()}}


def _show(tensor: Tensor) -> str:
    return f"a {tensor.dtype} tensor of shape {tuple(tensor.shape)}"
