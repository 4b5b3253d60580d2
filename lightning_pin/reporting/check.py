"""Check that exported models still hold the pins: ``lightning-pin check PINNED ARTIFACT [ARTIFACT ...]``.

Training holds every pin bit for bit, but the model that ships is an export: an ONNX file, a
``.safetensors`` file, a state dict. Exporters rewrite weights: torch's ONNX exporters fold a
BatchNorm into the convolution before it (the dynamo exporter's optimizer keeps the name
``conv1.weight``, the TorchScript exporter's constant folding gives it a new one), and a cast to
half precision rounds pinned values away. Nothing fails; the forced cells just read other values
in the deployed model. This module reads the pins a checkpoint saved (the targets the training
held) and compares every pinned element of every artifact with its target, bit for bit.

Use it from the command line (exit status 0: every pin holds; 1: a pinned element is off target
or a pinned parameter is missing; 2: the check could not run) or from Python::

    from lightning_pin.reporting.check import check_artifacts

    result = check_artifacts("pinned.ckpt", ["model.onnx", "model.safetensors"])
    result.verify()  # raises PinError naming every off-target element, for tests and deploy scripts

Names: a pinned ``net.conv1.weight`` matches an artifact tensor of the same name, or, when no
other parameter of the trained model could be meant, one that differs by leading module names
(``conv1.weight`` when ``lit_module.net`` was exported, ``model.net.conv1.weight`` when the
artifact wraps it).

Reading ONNX needs the ``onnx`` package (``pip install 'lightning-pin[export]'``). Nothing here
imports Lightning or the pinning engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from lightning_pin.core import kinds
from lightning_pin.core.errors import PinError
from lightning_pin.core.io import TENSOR_FILE_SUFFIXES, TensorFileError, load_tensors
from lightning_pin.core.state import PinState, SavedSelection, find_pin_states

__all__ = [
    "ARTIFACT_SUFFIXES", "ArtifactCheck", "Candidate", "CheckError", "CheckResult", "EXPORT_EXTRA",
    "MAX_CANDIDATES", "MAX_SHOWN", "OffTarget", "ParameterCheck", "PathLike", "SkippedPin", "check_artifacts",
    "format_check", "print_check",
]


#: Suffixes :func:`check_artifacts` reads as artifacts.
ARTIFACT_SUFFIXES = (".onnx",) + TENSOR_FILE_SUFFIXES
#: How to install ONNX support.
EXPORT_EXTRA = "pip install 'lightning-pin[export]'"
#: Off-target elements listed per parameter (all of them are counted).
MAX_SHOWN = 10
#: Unmatched tensors read as possible renamed copies of a missing parameter.
MAX_CANDIDATES = 8

PathLike = Union[str, Path]


class CheckError(PinError):
    """A check that cannot run: a missing or unreadable file, no pin state, an unknown artifact type."""


# ----------------------------------------------------------------------------------------------
# Results


@dataclasses.dataclass(frozen=True)
class OffTarget:
    """One pinned element whose value in the artifact is not its target."""

    #: Coordinates of the element in the artifact's tensor.
    position: tuple[int, ...]
    value: float
    #: The value it must equal (value pins); None for stuck bits and bounds, see ``expected``.
    target: Optional[float]
    #: Stuck bits and bounds: what the element must hold ("bits 0x3f800000, stuck at 1: ...", "bounds [0, 1]").
    expected: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Candidate:
    """An artifact tensor no name of the trained model matches, with a missing parameter's shape
    or its transpose: a renamed copy? (Exporters fold a BatchNorm into the conv before it under a
    new name, and store a Linear weight transposed for ``MatMul`` under a new name.)"""

    name: str
    #: Compared as the transpose of the parameter.
    transposed: bool
    #: Pinned elements that differ from their targets there.
    off_target: int
    #: The first :data:`MAX_SHOWN` of them, at their coordinates in the parameter.
    shown: tuple[OffTarget, ...] = ()


@dataclasses.dataclass(frozen=True)
class ParameterCheck:
    """The pinned elements of one parameter (merged over the pins of one saved state) in one artifact."""

    #: The parameter's name in the trained module (as the pins name it).
    name: str
    #: Where the pin state sits in the pinned file (``PinCallback{...}``, ``pins``, ``(file)``).
    state_key: str
    #: The pins that select elements of this parameter.
    pins: tuple[int, ...]
    #: Pinned elements (after merging overlapping pins).
    elements: int
    #: The artifact tensor it was matched to; None when missing or ambiguous.
    tensor: Optional[str]
    #: Pinned elements off target; None when the parameter could not be compared (see ``problem``).
    off_target: Optional[int]
    #: Why the parameter could not be compared: missing, ambiguous, reshaped, unreadable.
    problem: Optional[str] = None
    #: The first :data:`MAX_SHOWN` off-target elements.
    shown: tuple[OffTarget, ...] = ()
    #: When the parameter is missing: unmatched artifact tensors that could be a renamed copy.
    candidates: tuple[Candidate, ...] = ()
    #: dtype of the artifact's tensor and of the targets (``"float32"``...).
    dtype: Optional[str] = None
    target_dtype: Optional[str] = None
    #: ONNX rewrite rules the exporter recorded on the nodes that read this tensor.
    rewrites: tuple[str, ...] = ()

    @property
    def holds(self) -> bool:
        return self.off_target == 0


@dataclasses.dataclass(frozen=True)
class ArtifactCheck:
    """Every pinned parameter in one artifact."""

    path: str
    #: ``"onnx"``, ``"safetensors"``, ``"torch"`` (``.pt`` / ``.pth`` / ``.ckpt``) or ``"state dict"``.
    kind: str
    parameters: tuple[ParameterCheck, ...]
    #: ONNX only: ``"dynamo"`` or ``"torchscript"`` (which ``torch.onnx.export`` wrote it), else None.
    exporter: Optional[str] = None

    @property
    def holds(self) -> bool:
        return all(p.holds for p in self.parameters)

    @property
    def elements(self) -> int:
        return sum(p.elements for p in self.parameters)

    @property
    def advice(self) -> Optional[str]:
        """For an ONNX file whose pins do not hold: what the exporter did, and which option keeps the pins."""
        if self.kind != "onnx" or self.holds:
            return None
        return _onnx_advice(self.exporter)


@dataclasses.dataclass(frozen=True)
class SkippedPin:
    """A saved pin that is not checked, and why."""

    state_key: str
    pin: int
    reason: str


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """What :func:`check_artifacts` found: one :class:`ArtifactCheck` per artifact."""

    pinned: str
    #: Where the pin states sit in the pinned file.
    state_keys: tuple[str, ...]
    artifacts: tuple[ArtifactCheck, ...]
    skipped: tuple[SkippedPin, ...] = ()
    #: Pinned elements the checked pins select (over every saved state).
    elements: int = 0

    @property
    def holds(self) -> bool:
        """Every pinned element of every artifact equals its target bit for bit."""
        return all(a.holds for a in self.artifacts)

    def lines(self) -> list[str]:
        """The report, as printed by ``lightning-pin check``."""
        return format_check(self)

    def verify(self) -> None:
        """Raise :class:`PinError` with the report when a pin does not hold in an artifact."""
        if not self.holds:
            raise PinError("pins do not hold in an exported model:\n" + "\n".join(self.lines()))


# ----------------------------------------------------------------------------------------------
# The check


def check_artifacts(
    pinned: Union[PathLike, Mapping[str, Any]],
    artifacts: Union[PathLike, Mapping[str, Tensor], Iterable[Union[PathLike, Mapping[str, Tensor]]]],
) -> CheckResult:
    """Check that every pinned element holds its target, bit for bit, in each exported model.

    Args:
        pinned: A Lightning checkpoint saved by a fit with :class:`~lightning_pin.PinCallback`, a
            file holding a :class:`~lightning_pin.PinHandle` state dict (alone or under ``"pins"``,
            as ``{"model": ..., "pins": handle.state_dict()}``), or such a dict already loaded; or a
            list of code pins as :func:`~lightning_pin.faults.bit_faults` draws them (exact names,
            ``indices``, per-element masks, ``code=``), read against the first artifact's shapes.
        artifacts: One or more exported models: ``.onnx`` files (external data included),
            ``.safetensors`` files, torch state dicts in ``.pt`` / ``.pth`` / ``.ckpt`` (Lightning
            checkpoints too), or state dicts in memory (``model.state_dict()``).

    Returns:
        A :class:`CheckResult`; ``result.holds`` is the verdict, ``result.verify()`` raises on it.

    Raises:
        CheckError: a file is missing or unreadable, an artifact is of an unknown type, the
            pinned file holds no pin state, or ``onnx`` is not installed for an ``.onnx`` file.
        CorruptPinState: the saved pin state is damaged.
    """
    if isinstance(artifacts, (str, Path, Mapping)):
        artifacts = [artifacts]
    artifacts = list(artifacts)
    if not artifacts:
        raise CheckError("no artifact to check: pass one or more exported models")
    # Every usage error before any work: a typo in the last path should not cost a long read.
    for artifact in artifacts:
        if not isinstance(artifact, Mapping):
            _artifact_kind(Path(artifact).expanduser())
    if isinstance(pinned, (list, tuple)):
        label, states, weights = "the code pins", {"pins": _state_of_code_pins(pinned, artifacts[0])}, {}
    else:
        label, states, weights = _read_pinned(pinned)
    known = set(weights)
    for state in states.values():
        for selections in state.pins:
            known.update(selections)
    skipped = [
        SkippedPin(key, pin_id, reason)
        for key, state in states.items()
        for pin_id, reason in _unchecked(state).items()
    ]
    merged = {key: _parameters(state) for key, state in states.items()}
    elements = sum(
        _count_elements(selections, _shape_of(selections, weights.get(name)))
        for by_name in merged.values()
        for name, selections in by_name.items()
    )
    results = []
    for artifact in artifacts:
        reader = _open_artifact(artifact)
        checks: list[ParameterCheck] = []
        for key, by_name in merged.items():
            for name, selections in by_name.items():
                checks.append(_check_parameter(reader, key, name, selections, weights.get(name), known))
        results.append(ArtifactCheck(reader.label, reader.kind, tuple(checks), reader.exporter))
    return CheckResult(label, tuple(states), tuple(results), tuple(skipped), elements)


# ----------------------------------------------------------------------------------------------
# The pinned file


def _state_of_code_pins(pins: Iterable[Any], artifact: Union[PathLike, Mapping[str, Tensor]]) -> PinState:
    """The saved form of code pins drawn with indices (as bit_faults draws them), their shapes read in ``artifact``."""
    import re

    from lightning_pin.core.kinds.quant_code import QuantizedCode

    reader = _open_artifact(artifact)
    selections = []
    for pin in pins:
        code = getattr(pin, "code", None)
        indices = getattr(pin, "indices", None)
        name = re.sub(r"\[([*?\[])\]", r"\1", pin.params) if isinstance(getattr(pin, "params", None), str) else None
        if code is None or not isinstance(indices, Tensor) or indices.ndim != 2 or name is None:
            raise CheckError(f"check_artifacts reads Pin objects that are code pins with indices (as bit_faults "
                             f"draws them), not {pin!r}: pass the pin state (handle.state_dict() or a checkpoint)")
        if name not in reader.shapes:
            raise CheckError(f"{name!r} of {pin!r} is not a tensor of {reader.label}")
        shape = reader.shapes[name]
        if code.named or len(shape) != indices.shape[1]:
            raise CheckError(f"{pin!r}: a code pin of a {len(shape)}-D tensor with a fixed scale is read here; "
                             "pass the pin state (handle.state_dict() or a checkpoint) for others")
        strides = torch.tensor([_numel(shape[d + 1:]) for d in range(len(shape))], dtype=torch.int64)
        flat = (indices.to(torch.int64) * strides).sum(dim=1)
        order = torch.argsort(flat)
        axis = None if code.axis is None else code.axis % len(shape)
        channel = torch.zeros_like(flat) if axis is None else indices[:, axis].to(torch.int64)
        scale = torch.as_tensor(code.scale, dtype=torch.float32).reshape(-1)

        def mask(field: str) -> Tensor:
            raw = getattr(pin, field)
            values = torch.zeros(flat.numel(), dtype=torch.int32) if raw is None else torch.as_tensor(raw)
            return values.to(torch.int32).expand(flat.numel())[order].clone()

        payload = {"stuck_at_zero": mask("stuck_at_zero"), "stuck_at_one": mask("stuck_at_one"),
                   "channel": channel[order], "scale": scale,
                   "spec": torch.tensor([code.bits, code.zero_point, int(code.signed), -1 if axis is None else axis]),
                   "scale_name": torch.zeros(0, dtype=torch.uint8)}
        selections.append({name: SavedSelection(flat[order], None, True, QuantizedCode.kind, payload=payload)})
    ids = frozenset(range(len(selections)))
    return PinState(tuple(f"code pin {i}" for i in ids), tuple(selections), ids, ids)


def _read_pinned(pinned: Union[PathLike, Mapping[str, Any]]) -> tuple[str, dict[str, PinState], dict[str, Tensor]]:
    if isinstance(pinned, Mapping):
        label, loaded = "the pin state", pinned
    else:
        label = str(pinned)
        try:
            loaded = load_tensors(pinned)
        except TensorFileError as err:
            raise CheckError(str(err)) from err
    raw = find_pin_states(loaded)
    if not raw:
        raise CheckError(
            f"{label} holds no pin state: pass a checkpoint saved by a fit with PinCallback, or a file holding "
            "PinHandle.state_dict() (alone or under 'pins')"
        )
    states = {key: PinState.from_dict(value, where=f"the pin state {key!r} in {label}") for key, value in raw.items()}
    return label, states, _weights_of(loaded)


def _weights_of(loaded: Any) -> dict[str, Tensor]:
    """The tensors by name in a loaded file: a Lightning checkpoint's ``state_dict``, a bare state
    dict, or the state dicts inside a dict (``{"model": ..., "pins": ...}``; several are prefixed
    with their keys)."""
    if not isinstance(loaded, Mapping):
        return {}
    if isinstance(loaded.get("state_dict"), Mapping):
        return {k: v for k, v in loaded["state_dict"].items() if isinstance(k, str) and isinstance(v, Tensor)}
    if loaded and all(isinstance(v, Tensor) for v in loaded.values()):
        return {k: v for k, v in loaded.items() if isinstance(k, str)}
    nested = {
        key: value
        for key, value in loaded.items()
        if isinstance(key, str) and isinstance(value, Mapping) and value
        and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in value.items())
    }
    if len(nested) == 1:
        return dict(next(iter(nested.values())))
    return {f"{key}.{name}": tensor for key, sd in nested.items() for name, tensor in sd.items()}


def _unchecked(state: PinState) -> dict[int, str]:
    reasons = {}
    for pin_id, selections in enumerate(state.pins):
        if pin_id not in state.checked_pins:
            reasons[pin_id] = "not active at the last optimizer step"
        elif all(kinds.of(s.kind).frozen and s.target is None for s in selections.values()):
            reasons[pin_id] = "no saved target (a value=None pin that never activated)"
    return reasons


#: Per parameter: (pin id, saved selection) of each checked pin that holds something, in pin order.
_Selections = list[tuple[int, SavedSelection]]


def _parameters(state: PinState) -> dict[str, _Selections]:
    """Per pinned parameter (in the order the pins name them): the saved selections of the checked
    pins, each kind's to be read through the kind (see :func:`_compare`)."""
    by_name: dict[str, _Selections] = {}
    for pin_id in sorted(state.checked_pins):
        for name, selection in state.pins[pin_id].items():
            if kinds.of(selection.kind).frozen and selection.target is None:
                continue  # a value=None pin that never activated: nothing to hold yet
            by_name.setdefault(name, []).append((pin_id, selection))
    return by_name


# ----------------------------------------------------------------------------------------------
# Artifacts


@dataclasses.dataclass
class _Reader:
    label: str
    kind: str
    shapes: dict[str, tuple[int, ...]]
    load: Callable[[str], Tensor]
    exporter: Optional[str] = None
    rewrites: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


class _Unreadable(Exception):
    """One tensor of an artifact that cannot be compared (an ONNX dtype torch lacks; stuck bits
    of a word stored in another width)."""


def _artifact_kind(path: Path) -> str:
    if path.suffix not in ARTIFACT_SUFFIXES:
        raise CheckError(
            f"unknown artifact type: {path} must end in {', '.join(ARTIFACT_SUFFIXES)} (an ONNX model, a safetensors "
            "file or a torch state dict)"
        )
    if path.is_dir():
        raise CheckError(f"{path} is a directory, not an exported model")
    if not path.is_file():
        raise CheckError(f"{path} does not exist (relative paths are taken from {Path.cwd()})")
    if path.suffix == ".onnx":
        return "onnx"
    return "safetensors" if path.suffix == ".safetensors" else "torch"


def _open_artifact(artifact: Union[PathLike, Mapping[str, Tensor]]) -> _Reader:
    if isinstance(artifact, Mapping):
        tensors = {k: v for k, v in artifact.items() if isinstance(k, str) and isinstance(v, Tensor)}
        return _tensor_reader("<state dict>", "state dict", tensors)
    path = Path(artifact).expanduser()
    kind = _artifact_kind(path)
    if kind == "onnx":
        return _onnx_reader(path)
    try:
        loaded = load_tensors(path)
    except TensorFileError as err:
        raise CheckError(str(err)) from err
    tensors = _weights_of(loaded)
    if not tensors:
        raise CheckError(f"{path} holds no tensors by name: expected a state dict or a Lightning checkpoint")
    return _tensor_reader(str(path), kind, tensors)


def _tensor_reader(label: str, kind: str, tensors: dict[str, Tensor]) -> _Reader:
    # A torchao int8 weight is read as its stored codes (qdata): stuck code bits are checked in them.
    tensors = {name: t.qdata if isinstance(getattr(t, "qdata", None), Tensor) else t for name, t in tensors.items()}
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    return _Reader(label, kind, shapes, lambda name: tensors[name].detach().cpu())


def _onnx_reader(path: Path) -> _Reader:
    try:
        import onnx
    except ImportError as err:
        raise CheckError(f"reading {path} needs the onnx package: {EXPORT_EXTRA}") from err
    size = path.stat().st_size
    if size == 0:  # protobuf reads 0 bytes as an empty model: say what it is
        raise CheckError(f"{path} is empty (0 bytes): nothing was written to it (an interrupted export or copy?)")
    try:
        # External data is read per tensor below: only the pinned tensors are loaded.
        model = onnx.load(str(path), load_external_data=False)
    except Exception as err:  # protobuf decode errors come in several types
        raise CheckError(f"cannot read {path} as an ONNX model: truncated or damaged ({size:,} bytes; "
                         f"{type(err).__name__}: {' '.join(str(err).split())})") from err
    graph = model.graph
    if not graph.node and not graph.initializer:
        raise CheckError(f"{path} holds no ONNX graph")
    initializers = {init.name: init for init in graph.initializer}
    shapes = {name: tuple(int(d) for d in init.dims) for name, init in initializers.items()}

    def load(name: str) -> Tensor:
        return _onnx_tensor(initializers[name], path)

    return _Reader(str(path), "onnx", shapes, load, _onnx_exporter(model), _onnx_rewrites(graph, initializers))


def _onnx_tensor(initializer: Any, path: Path) -> Tensor:
    import numpy as np
    from onnx import TensorProto, numpy_helper

    try:
        array = numpy_helper.to_array(initializer, base_dir=str(path.parent))
    except Exception as err:  # a missing or short external data file
        raise CheckError(
            f"cannot read the data of {initializer.name!r} in {path} ({type(err).__name__}: {err}); external data "
            "files must sit where the model names them, relative to the .onnx file"
        ) from err
    # Types numpy lacks come as ml_dtypes arrays: reinterpret their bits as the torch dtype.
    bits = {
        TensorProto.BFLOAT16: (np.uint16, torch.bfloat16),
        TensorProto.FLOAT8E4M3FN: (np.uint8, getattr(torch, "float8_e4m3fn", None)),
        TensorProto.FLOAT8E4M3FNUZ: (np.uint8, getattr(torch, "float8_e4m3fnuz", None)),
        TensorProto.FLOAT8E5M2: (np.uint8, getattr(torch, "float8_e5m2", None)),
        TensorProto.FLOAT8E5M2FNUZ: (np.uint8, getattr(torch, "float8_e5m2fnuz", None)),
    }
    if initializer.data_type in (TensorProto.INT4, TensorProto.UINT4):  # ml_dtypes int4: widened, same codes
        return torch.from_numpy(np.asarray(array).astype(np.int8 if initializer.data_type == TensorProto.INT4
                                                         else np.uint8))
    if initializer.data_type in bits and bits[initializer.data_type][1] is not None:
        raw, dtype = bits[initializer.data_type]
        return torch.from_numpy(np.ascontiguousarray(array).view(raw).copy()).view(dtype)
    try:
        return torch.from_numpy(np.array(array, copy=True))
    except TypeError as err:
        name = TensorProto.DataType.Name(initializer.data_type)
        raise _Unreadable(f"its ONNX type {name} has no torch dtype to compare with") from err


def _onnx_exporter(model: Any) -> Optional[str]:
    """Which torch exporter wrote the model: the dynamo exporter records ``pkg.torch.onnx.*``
    metadata on its nodes, the TorchScript exporter none."""
    if model.producer_name != "pytorch":
        return None
    for node in model.graph.node:
        if any(prop.key.startswith("pkg.torch.onnx") for prop in node.metadata_props):
            return "dynamo"
    return "torchscript"


def _onnx_rewrites(graph: Any, initializers: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """Per initializer, the onnxscript rewrite rules (``FuseBatchNormIntoConv``...) recorded on
    the nodes that read it: the dynamo exporter's optimizer leaves that trace."""
    found: dict[str, list[str]] = {}
    for node in graph.node:
        rules = [p.value for p in node.metadata_props if p.key == "pkg.onnxscript.rewriter.rule_name"]
        for name in node.input if rules else ():
            if name in initializers:
                found.setdefault(name, [])
                found[name] += [r for r in rules if r not in found[name]]
    return {name: tuple(rules) for name, rules in found.items()}


def _onnx_advice(exporter: Optional[str]) -> str:
    fold = "may have folded or renamed pinned parameters (it folds a BatchNorm into the conv before it"
    transposed = "and stores a Linear weight that MatMul reads transposed, under a new name"
    if exporter == "dynamo":
        return (
            f"this file was written by torch.onnx.export(..., dynamo=True), whose graph optimizer {fold}, keeping "
            f"the conv's name, {transposed}): export with torch.onnx.export(..., dynamo=True, optimize=False) to "
            "keep them as trained"
        )
    if exporter == "torchscript":
        return (
            f"this file was written by the TorchScript exporter, torch.onnx.export(..., dynamo=False), whose "
            f"constant folding {fold} under a new name, {transposed}): export with do_constant_folding=False to keep "
            "them as trained"
        )
    return (
        f"the exporter {fold}, {transposed}): with torch.onnx.export(..., dynamo=True) export with optimize=False, "
        "with the TorchScript exporter (dynamo=False) with do_constant_folding=False"
    )


# ----------------------------------------------------------------------------------------------
# Matching names, comparing values


def _related(a: str, b: str) -> bool:
    """Equal, or equal after dropping leading module names from one of them."""
    return a == b or a.endswith("." + b) or b.endswith("." + a)


def _match(name: str, available: Collection[str], known: set[str]) -> tuple[Optional[str], tuple[str, ...]]:
    """The artifact tensor that is ``name``, or (None, the tensors it could be) when that is ambiguous.

    An artifact tensor whose name differs by leading module names matches only when no other name
    of the trained model (``known``: its state dict and every pinned name) is related to it the
    same way: ``conv1.weight`` is not ``enc.conv1.weight`` when the model also has ``dec.conv1.weight``.
    """
    if name in available:
        return name, ()
    candidates = [a for a in available if _related(a, name)]
    valid = [a for a in candidates if all(k == name for k in known if _related(a, k))]
    if len(valid) == 1:
        return valid[0], ()
    return None, tuple(sorted(candidates))


class _Beside(Mapping):
    """The artifact's tensors by the trained model's names, loaded when asked for (see ``Kind.stored_bind``)."""

    def __init__(self, reader: _Reader, known: set[str]) -> None:
        self._reader, self._known = reader, known

    def _name(self, name: str) -> Optional[str]:
        return _match(name, self._reader.shapes, self._known | {name})[0]

    def __getitem__(self, name: str) -> Tensor:
        found = self._name(name)
        if found is None:
            raise KeyError(name)
        return self._reader.load(found)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._name(name) is not None

    def __iter__(self) -> Any:
        return iter(self._reader.shapes)

    def __len__(self) -> int:
        return len(self._reader.shapes)


def _check_parameter(
    reader: _Reader,
    key: str,
    name: str,
    selections: _Selections,
    trained: Optional[Tensor],
    known: set[str],
) -> ParameterCheck:
    pins = tuple(sorted({pin_id for pin_id, _ in selections}))
    shape = _shape_of(selections, trained)
    target_dtype = _target_dtype(selections, trained)
    elements = _count_elements(selections, shape)

    def problem(text: str, **extra: Any) -> ParameterCheck:
        return ParameterCheck(name, key, pins, elements, extra.pop("tensor", None), None, text,
                              target_dtype=target_dtype, **extra)  # fmt: skip

    tensor_name, ambiguous = _match(name, reader.shapes, known)
    if tensor_name is None and ambiguous:
        return problem(f"ambiguous: the artifact's {', '.join(repr(a) for a in ambiguous)} could be other "
                       "parameters of the trained model")  # fmt: skip
    if tensor_name is None:
        return problem("missing", candidates=_candidates(reader, shape, selections, known))
    found_shape = reader.shapes[tensor_name]
    rewrites = reader.rewrites.get(tensor_name, ())
    if shape is not None and found_shape != shape:
        return problem(f"its shape is {found_shape} in the artifact, {shape} in the trained model",
                       tensor=tensor_name, rewrites=rewrites)  # fmt: skip
    try:
        tensor = reader.load(tensor_name)
    except _Unreadable as err:
        return problem(str(err), tensor=tensor_name, rewrites=rewrites)
    # What a kind reads beside its own tensor (a quantized code's learned scale), from the artifact.
    beside = _Beside(reader, known)
    try:
        selections = [(pin_id, kinds.of(s.kind).stored_bind(s, beside)) for pin_id, s in selections]
        off, shown, elements = _compare(tensor, selections)
    except _Unreadable as err:
        return problem(str(err), tensor=tensor_name, rewrites=rewrites)
    except IndexError:
        return problem(f"pinned elements lie outside its {tuple(tensor.shape)} elements", tensor=tensor_name,
                       rewrites=rewrites)  # fmt: skip
    return ParameterCheck(
        name, key, pins, elements, tensor_name, off, shown=shown, dtype=str(tensor.dtype).replace("torch.", ""),
        target_dtype=target_dtype, rewrites=rewrites,
    )  # fmt: skip


def _candidates(
    reader: _Reader, shape: Optional[tuple[int, ...]], selections: _Selections, known: set[str]
) -> tuple[Candidate, ...]:
    """Unmatched artifact tensors of the parameter's shape or its transpose, compared with the
    targets (the first :data:`MAX_CANDIDATES` of them: each is read)."""
    if shape is None:
        return ()
    flipped = shape[::-1] if len(shape) == 2 else None
    names = sorted(
        a for a, s in reader.shapes.items()
        if (s == shape or s == flipped) and not any(_related(a, k) for k in known)
    )  # fmt: skip
    found = []
    for name in names[:MAX_CANDIDATES]:
        try:
            tensor = reader.load(name)
        except _Unreadable:
            continue
        # A square matrix may be a copy either way: keep the closer reading.
        readings = [(False, tensor)] if tuple(tensor.shape) == shape else []
        if tuple(tensor.shape) == flipped:
            readings.append((True, tensor.t()))
        try:
            compared = [(_compare(t, selections)[:2], transposed) for transposed, t in readings]
        except (IndexError, _Unreadable):  # targets that do not fit this shape or dtype: not a copy
            continue
        (off, shown), transposed = min(compared, key=lambda c: c[0][0])
        found.append(Candidate(name, transposed, off, shown))
    return tuple(found)


def _shape_of(selections: _Selections, trained: Optional[Tensor]) -> Optional[tuple[int, ...]]:
    """The parameter's shape in the trained model: from the pinned file's weights, else from a
    whole-tensor selection's target or payload; None when only element pins name it and the file
    holds no weights."""
    if trained is not None:
        return tuple(trained.shape)
    for _, s in sorted(selections, key=lambda entry: not kinds.of(entry[1].kind).frozen):
        if s.index is None:
            return tuple((s.target if s.target is not None else next(iter(s.payload.values()))).shape)
    return None


def _target_dtype(selections: _Selections, trained: Optional[Tensor]) -> Optional[str]:
    told = [(kinds.of(s.kind).frozen, kinds.of(s.kind).stored_dtype(s)) for _, s in selections]
    frozen = [dtype for is_frozen, dtype in told if is_frozen and dtype is not None]
    if frozen:
        dtype = frozen[0]  # the targets'
    elif trained is not None:
        dtype = trained.dtype
    else:
        others = [dtype for _, dtype in told if dtype is not None]
        if not others:
            return None  # stuck bits alone: a word of known width, of unknown float type
        dtype = others[0]
    return str(dtype).replace("torch.", "")


def _count_elements(selections: _Selections, shape: Optional[tuple[int, ...]]) -> int:
    indices = [s.index for _, s in selections]
    if any(index is None for index in indices):
        return _numel(shape) if shape is not None else 0
    return int(torch.unique(torch.cat([index.long() for index in indices])).numel())


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _compare(tensor: Tensor, selections: _Selections) -> tuple[int, tuple[OffTarget, ...], int]:
    """Off-target count, the first off-target elements, and the pinned element count.

    Each kind reads the stored tensor through its saved form (``Kind.stored_off``): the selections
    of a frozen kind (values) merged as the engine merges them (an explicit value beats a captured
    one), those of the others one by one (each pin must hold).

    Raises:
        IndexError: an index lies outside ``tensor`` (or a whole-tensor selection has another size).
        _Unreadable: stuck bits of a word the artifact stores in another width.
    """
    flat = tensor.reshape(-1)
    numel = flat.numel()
    groups: dict[type, list[SavedSelection]] = {}
    for _, selection in selections:
        kind = kinds.of(selection.kind)
        if kind.frozen:
            groups.setdefault(kind, []).append(selection)
    groups_in_order = [(kind, group) for kind, group in groups.items()]
    groups_in_order += [(kinds.of(s.kind), [s]) for _, s in selections if not kinds.of(s.kind).frozen]
    checked: list[Tensor] = []  # positions of every pinned element
    off_at: list[Tensor] = []  # positions of the off-target ones
    found: list[tuple[int, float, Optional[float], Optional[str]]] = []  # the first few: position, value, ...
    for kind, group in groups_in_order:
        try:
            off, expected = kind.stored_off(flat, group)
        except kinds.Unreadable as err:
            raise _Unreadable(
                f"it is stored as {str(tensor.dtype).replace('torch.', '')} in the artifact: its {err.what} are bits "
                f"of {err.word}, which this artifact does not hold"
            ) from err
        checked += [torch.arange(numel) if s.index is None else s.index.long() for s in group]
        at = off.nonzero().reshape(-1)
        off_at.append(at)
        for w in at[:MAX_SHOWN].tolist():
            said = expected(w)
            found.append((w, flat[w].item(), None, said) if isinstance(said, str) else (w, flat[w].item(), said, None))
    elements = int(torch.unique(torch.cat(checked)).numel()) if checked else 0
    off_count = int(torch.unique(torch.cat(off_at)).numel()) if off_at else 0
    found.sort(key=lambda item: item[0])
    shown = tuple(
        OffTarget(_coordinates(at, tuple(tensor.shape)), value, target, expected)
        for at, value, target, expected in found[:MAX_SHOWN]
    )
    return off_count, shown, elements


def _coordinates(position: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    if not shape:
        return ()
    return tuple(int(c) for c in torch.unravel_index(torch.tensor(position), shape))


# ----------------------------------------------------------------------------------------------
# Printing


def format_check(result: CheckResult) -> list[str]:
    """The lines ``lightning-pin check`` prints."""
    pins = {(p.state_key, pin) for a in result.artifacts for p in a.parameters for pin in p.pins}
    names = {(p.state_key, p.name) for a in result.artifacts for p in a.parameters}
    elements = result.elements
    lines = [
        f"pins saved in {result.pinned}: {len(pins)} checked pin(s) on {len(names)} parameter(s), "
        f"{elements:,} pinned element(s)"
    ]
    several = len(result.state_keys) > 1
    for skip in result.skipped:
        lines.append(f"  pin {skip.pin}{_state(skip.state_key, several)}: not checked, {skip.reason}")
    for artifact in result.artifacts:
        kind = {"dynamo": "ONNX, dynamo exporter", "torchscript": "ONNX, TorchScript exporter"}.get(
            artifact.exporter or "", "ONNX" if artifact.kind == "onnx" else artifact.kind
        )
        if artifact.holds:
            lines.append(f"{artifact.path} ({kind}): all {artifact.elements:,} pinned element(s) hold, bit for bit")
            continue
        lines.append(f"{artifact.path} ({kind}): pins do NOT hold")
        for p in artifact.parameters:
            lines += [f"  {line}" for line in _parameter_lines(p, several)]
        if artifact.advice:
            lines.append(f"  note: {artifact.advice}")
    if not result.artifacts:
        return lines
    failed = sum(not a.holds for a in result.artifacts)
    if failed:
        lines.append(f"FAIL: pins do not hold in {failed} of {len(result.artifacts)} artifact(s)")
    elif elements == 0:
        lines.append("OK, but no pinned element was checked: no pin was active at the last optimizer step")
    else:
        lines.append(f"OK: every pin holds in {len(result.artifacts)} artifact(s)")
    return lines


def print_check(result: CheckResult) -> None:
    """Print :func:`format_check`."""
    for line in format_check(result):
        print(line)


def _state(key: str, several: bool) -> str:
    return f" of {key[:60]}{'...' if len(key) > 60 else ''}" if several else ""


def _parameter_lines(p: ParameterCheck, several: bool) -> list[str]:
    name = p.name if p.tensor in (None, p.name) else f"{p.name} (as {p.tensor!r})"
    pins = f"pin{'s' if len(p.pins) > 1 else ''} {', '.join(map(str, p.pins))}{_state(p.state_key, several)}"
    head = f"{name}, {p.elements:,} pinned element(s) ({pins})"
    rewrites = f"; rewritten by the exporter's {', '.join(p.rewrites)}" if p.rewrites else ""
    if p.holds:
        return [f"{head}: holds{rewrites}"]
    if p.problem == "missing":
        return [f"{head}: MISSING from the artifact"] + [f"  {line}" for line in _candidate_lines(p)]
    if p.problem is not None:
        return [f"{head}: {p.problem}{rewrites}"]
    lines = [f"{head}: {p.off_target:,} OFF TARGET{rewrites}"]
    lines += [f"  {_show(e, p)}" for e in p.shown]
    if p.off_target > len(p.shown):
        lines.append(f"  ... and {p.off_target - len(p.shown):,} more")
    return lines


def _candidate_lines(p: ParameterCheck) -> list[str]:
    def called(c: Candidate) -> str:
        return f"{c.name!r}{' (transposed)' if c.transposed else ''}"

    holding = [c for c in p.candidates if c.off_target == 0]
    if len(holding) == 1:
        return [f"{called(holding[0])} holds every pinned element: a renamed copy of it?"]
    if len(p.candidates) == 1:
        (c,) = p.candidates
        lines = [f"the only unmatched tensor of its shape, {called(c)}, differs at {c.off_target:,} of them:"]
        lines += [f"  {_show(e, p)}" for e in c.shown]
        if c.off_target > len(c.shown):
            lines.append(f"  ... and {c.off_target - len(c.shown):,} more")
        return lines
    if p.candidates:
        listed = ", ".join(f"{called(c)} differs at {c.off_target:,}" for c in p.candidates)
        return [f"unmatched tensors of its shape: {listed}"]
    return []


def _show(element: OffTarget, p: ParameterCheck) -> str:
    at = list(element.position)
    value = _shortest(element.value, p.dtype or p.target_dtype or "float64")
    if element.expected is not None:
        return f"{at} = {value}, {element.expected}"
    target = _shortest(element.target, p.target_dtype or "float64")
    return f"{at} = {value}, target {target}"


def _shortest(value: float, dtype_name: str) -> str:
    """The shortest decimal that reads back to the same ``dtype`` value: a one-ulp change shows."""
    dtype = getattr(torch, dtype_name, torch.float64)
    if not dtype.is_floating_point or value != value or value in (float("inf"), float("-inf")):
        return repr(value)
    exact = torch.tensor(value, dtype=dtype)
    for digits in range(1, 18):
        text = f"{value:.{digits}g}"
        if torch.equal(torch.tensor(float(text), dtype=dtype), exact):
            return text
    return repr(value)
