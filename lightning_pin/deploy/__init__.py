"""Deployed int8 models: trained codes written into torchao int8 tensors and int8 QDQ ONNX files.

Needs the ``[deploy]`` extra (``pip install 'lightning-pin[deploy]'``: torchao, onnx, onnxruntime);
nothing here imports them before a function that needs them is called.

- :func:`to_torchao`: the model with each coded weight as a torchao ``Int8Tensor`` holding the
  trained codes bit for bit (then :func:`~lightning_pin.faults.bit_faults` and friends act on them);
- :func:`to_onnx`: an ONNX file whose coded weights are integer initializers and ``DequantizeLinear``
  nodes (``lightning-pin check`` reads the stored codes);
- :func:`trained_codes`: the codes themselves, computed by the code pins' own rounding.
"""

from lightning_pin.deploy.codes import DEPLOY_EXTRA, CodedWeight, trained_codes
from lightning_pin.deploy.int8_torchao import DEPLOY_TARGETS, quantize_torchao, to_torchao
from lightning_pin.deploy.onnx_qdq import to_onnx

__all__ = [
    "DEPLOY_EXTRA",
    "DEPLOY_TARGETS",
    "CodedWeight",
    "quantize_torchao",
    "to_onnx",
    "to_torchao",
    "trained_codes",
]
