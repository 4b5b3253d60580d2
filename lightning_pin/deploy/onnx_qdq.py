"""From trained codes to an int8 QDQ ONNX model: :func:`to_onnx`."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from lightning_pin.core.errors import PinError
from lightning_pin.deploy._models import fold_live_codes, owner_of, plain_copy
from lightning_pin.deploy.codes import DEPLOY_EXTRA, Codes, CodedWeight, trained_codes

__all__ = ["QDQ_SUFFIX", "onnx_code_type", "to_onnx"]

#: The name of a weight's DequantizeLinear output (the int8 initializer keeps the weight's name).
QDQ_SUFFIX = "_dequantized"


def onnx_code_type(bits: int, signed: bool) -> str:
    """The ONNX integer type that stores a ``bits``-bit code: ``INT4`` / ``UINT4`` up to 4 bits, 8-bit and
    16-bit types above.

    Example::

        >>> onnx_code_type(4, True), onnx_code_type(8, False), onnx_code_type(6, True)
        ('INT4', 'UINT8', 'INT8')
    """
    width = 4 if bits <= 4 else 8 if bits <= 8 else 16
    return f"{'' if signed else 'U'}INT{width}"


def to_onnx(
    model: nn.Module,
    path: Union[str, Path],
    example_input: Any,
    int8: bool = True,
    *,
    codes: Optional[Codes] = None,
    opset: int = 21,
    **export_kwargs: Any,
) -> Path:
    """Write ``model`` as ONNX; with ``int8``, every coded weight as integer codes and a ``DequantizeLinear``.

    The graph is the fake-quantized model's (each coded weight read as ``(q - zero_point) * s``),
    exported by torch's dynamo exporter without its optimizer; then each coded weight's initializer
    becomes its codes (``INT8`` / ``UINT8`` / ``INT4`` / ``UINT4`` / 16-bit, by the code's bits and
    sign; it keeps the weight's name, so ``lightning-pin check`` reads the stored integers), a
    ``<name>_scale`` initializer (one entry, or one per channel with the ``axis`` of the code) and a
    ``<name>_zero_point``, feeding one ``DequantizeLinear`` node. The codes are the trained ones bit
    for bit (:func:`~lightning_pin.deploy.codes.trained_codes`). A weight (2-D or more) without a code
    stays float and is named in one warning line.

    Args:
        model: The trained model (float32 weights; quantize()'s hooks, if live, are dropped from the export).
        path: The ``.onnx`` file to write.
        example_input: One input (a tensor or a tuple of the forward's arguments).
        int8: Write the coded weights as integer codes (False: a float export of the fake-quantized model).
        codes: Which weights carry which code (:func:`~lightning_pin.deploy.codes.trained_codes`); None:
            those of the live :func:`~lightning_pin.faults.quantize` calls on ``model``.
        opset: The ONNX opset (21 or later: ``DequantizeLinear`` of INT4 and 16-bit codes).
        export_kwargs: Passed to ``torch.onnx.export`` (``dynamic_shapes=...``, ``input_names=...``).

    Returns:
        The path written.

    Raises:
        PinError: onnx / onnxscript are not installed, a coded weight is not float32, or the
            exported graph has no initializer of a coded weight's name (the exporter folded it).

    Example::

        >>> import torch
        >>> from lightning_pin import QuantCode
        >>> net = torch.nn.Linear(4, 2)
        >>> to_onnx(net, "net.onnx", torch.zeros(1, 4), codes={"weight": QuantCode(8, 0.01)})  # doctest: +SKIP
        PosixPath('net.onnx')
    """
    path = Path(path)
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as err:
        raise PinError(f"to_onnx needs onnx and onnxscript: {DEPLOY_EXTRA}") from err
    if opset < 21:
        raise PinError(f"to_onnx: opset {opset}: DequantizeLinear of every code type needs opset 21 or later")
    coded = trained_codes(model, codes) if int8 or codes is not None or _live(model) else {}
    for name, weight in coded.items():
        dtype = dict(model.named_parameters())[name].dtype
        if dtype != torch.float32:
            raise PinError(f"to_onnx: {name!r} is {dtype}; an int8 QDQ export dequantizes to float32 weights")
    target = plain_copy(model).eval()
    folded = fold_live_codes(model, target, coded)  # live codes not written as integers: float, on their codes
    with torch.no_grad():
        for name, weight in coded.items():
            owner, attr = owner_of(target, name)
            getattr(owner, attr).copy_(weight.dequantized(torch.float32))
    args = tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's own deprecation chatter
        torch.onnx.export(target, args, str(path), dynamo=True, optimize=False, verbose=False, opset_version=opset,
                          **export_kwargs)
    if not int8:
        return path
    import onnx

    graph_model = onnx.load(str(path))
    _to_qdq(graph_model, coded, path)
    onnx.save(graph_model, str(path))
    floats = [n + (" (as its dequantized code)" if n in folded else "")
              for n, p in target.named_parameters() if n not in coded and p.ndim >= 2]
    if floats:
        warnings.warn(f"to_onnx: {len(floats)} weight(s) without a code stay float: {', '.join(floats)}",
                      UserWarning, stacklevel=2)
    return path


def _live(model: nn.Module) -> bool:
    from lightning_pin.faults.quantize import quantized_codes

    return bool(quantized_codes(model))


def _to_qdq(graph_model: Any, coded: dict[str, CodedWeight], path: Path) -> None:
    """Each coded weight's float initializer replaced by its codes, scale, zero point and a DequantizeLinear."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    graph = graph_model.graph
    initializers = {init.name: init for init in graph.initializer}
    missing = [name for name in coded if name not in initializers]
    if missing:
        raise PinError(f"to_onnx: the exported graph of {path} has no initializer {', '.join(map(repr, missing))} "
                       "(the exporter folded or renamed it), so its codes cannot be written")
    nodes = []
    for name, weight in coded.items():
        code = weight.code
        kind = getattr(TensorProto, onnx_code_type(code.bits, code.signed))
        dims = list(weight.codes.shape)
        values = weight.codes.reshape(-1).tolist()
        quantized = helper.make_tensor(name, kind, dims, values)
        scale = weight.scale.to(torch.float32).numpy()
        zero = [code.zero_point] * scale.size
        scale_name, zero_name = f"{name}_scale", f"{name}_zero_point"
        scalar = weight.axis is None
        scale_tensor = numpy_helper.from_array(np.asarray(scale[0] if scalar else scale, dtype=np.float32), scale_name)
        zero_tensor = helper.make_tensor(zero_name, kind, [] if scalar else [len(zero)], zero[:1] if scalar else zero)
        graph.initializer.remove(initializers[name])
        graph.initializer.extend([quantized, scale_tensor, zero_tensor])
        output = name + QDQ_SUFFIX
        attrs = {} if scalar else {"axis": int(weight.axis)}
        nodes.append(helper.make_node("DequantizeLinear", [name, scale_name, zero_name], [output],
                                      name=f"{name}_DequantizeLinear", **attrs))
        for node in graph.node:
            for i, given in enumerate(node.input):
                if given == name:
                    node.input[i] = output
        for info in list(graph.value_info):
            if info.name == name:
                graph.value_info.remove(info)
    # DequantizeLinear nodes first: the graph stays topologically sorted.
    existing = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes + existing)
