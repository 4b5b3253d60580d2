"""From trained codes to a torchao int8 model: :func:`to_torchao`."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lightning_pin.core.errors import PinError
from lightning_pin.deploy._models import fold_live_codes, owner_of, plain_copy
from lightning_pin.deploy.codes import DEPLOY_EXTRA, Codes, CodedWeight, trained_codes

__all__ = ["DEPLOY_TARGETS", "quantize_torchao", "to_torchao"]

#: What ``lightning-pin faults --deploy`` runs a campaign on.
DEPLOY_TARGETS = ("torchao-int8",)


def to_torchao(model: nn.Module, codes: Optional[Codes] = None, *, inplace: bool = False) -> nn.Module:
    """The model with every coded weight as a torchao ``Int8Tensor`` whose codes are the trained codes, bit for bit.

    The codes are those the training held (:func:`~lightning_pin.deploy.codes.trained_codes`: the
    code pins' own rounding), the scales are the codes' scales (one per tensor, or one per output
    channel), so a stuck code bit the training held is in ``weight.qdata``. The model then runs on
    torchao's int8 kernels (``x @ q.T * s``: float results differ from the fake-quantized forward by
    rounding only) and takes test-time faults (:func:`~lightning_pin.faults.bit_faults` on its codes).

    Args:
        model: The trained model (float weights). quantize()'s hooks, if live, are dropped from the result:
            a weight they quantize that is not converted holds its dequantized code as a float.
        codes: Which weights carry which code (see :func:`~lightning_pin.deploy.codes.trained_codes`);
            None: those of the live :func:`~lightning_pin.faults.quantize` calls on ``model``.
        inplace: Convert ``model`` itself (default: a deep copy; ``model`` is left as it is).

    Raises:
        PinError: torchao is not installed, or a code torchao's int8 kernels cannot hold: not 8 signed
            bits (e.g. int4), a zero point other than 0 (its int8 kernels ignore a weight zero point),
            per-channel scales along another axis than 0, or a weight of another module than
            ``nn.Linear`` (torchao has no int8 convolution); every such weight is named.

    Example::

        >>> import torch
        >>> from lightning_pin import QuantCode
        >>> from lightning_pin.faults import quantize
        >>> net = torch.nn.Linear(4, 2)
        >>> handle = quantize(net, "weight", QuantCode(bits=8, scale=0.01))
        >>> int8 = to_torchao(net)
        >>> from lightning_pin.deploy import trained_codes
        >>> torch.equal(int8.weight.qdata.int(), trained_codes(net)["weight"].codes), int8.weight.qdata.dtype
        (True, torch.int8)
    """
    coded = trained_codes(model, codes)
    refused = [f"{name} ({why})" for name, weight in coded.items()
               for why in [_refusal(model, weight)] if why is not None]
    if refused:
        raise PinError(f"to_torchao: torchao's int8 weights cannot hold {'; '.join(refused)}; export these with "
                       "lightning_pin.deploy.to_onnx, which writes any code")
    try:
        from torchao.quantization import Int8Tensor
    except ImportError as err:
        raise PinError(f"to_torchao needs torchao: {DEPLOY_EXTRA}") from err
    target = plain_copy(model, inplace)
    fold_live_codes(model, target, coded)  # live codes it does not convert: float weights on their codes
    for name, weight in coded.items():
        owner, attr = owner_of(target, name)
        old = getattr(owner, attr)
        shape = tuple(weight.codes.shape)
        if weight.axis is None:
            scale, block = weight.scale.reshape([1] * len(shape)), list(shape)
        else:
            scale, block = weight.scale.reshape(-1, *([1] * (len(shape) - 1))), [1, *shape[1:]]
        int8 = Int8Tensor(weight.codes.to(torch.int8).to(old.device), scale.to(old.device),
                          block, old.dtype, zero_point=torch.zeros(scale.shape, dtype=torch.int8, device=old.device))
        setattr(owner, attr, nn.Parameter(int8, requires_grad=False))
    return target


def _refusal(model: nn.Module, weight: CodedWeight) -> Optional[str]:
    code = weight.code
    if code.bits != 8 or not code.signed:
        return f"{code.describe()}: torchao's Int8Tensor holds signed 8-bit codes"
    if code.zero_point != 0:
        return f"zero point {code.zero_point}: torchao's int8 kernels ignore a weight zero point"
    owner, _ = owner_of(model, weight.name)
    if not isinstance(owner, nn.Linear):
        return f"a weight of {type(owner).__name__}: torchao's Int8Tensor runs nn.Linear only"
    if weight.axis not in (None, 0):
        return f"scales along axis {weight.axis}: torchao's int8 linear scales output channels (axis 0)"
    return None


def quantize_torchao(model: nn.Module, dynamic: bool = False) -> list[str]:
    """Quantize ``model`` in place as torchao does for deployment (every ``nn.Linear`` weight an int8 ``Int8Tensor``,
    per-row scales); return the names of the int8 weights. ``dynamic``: int8 activations too
    (``Int8DynamicActivationInt8WeightConfig``); else weight-only (``Int8WeightOnlyConfig``).

    This is torchao's own rounding of the float weights (a model trained without codes); a model
    trained around stuck code bits goes through :func:`to_torchao`, which keeps its codes.

    Raises:
        PinError: torchao is not installed, or the model has no ``nn.Linear`` to quantize.
    """
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_
    except ImportError as err:
        raise PinError(f"an int8 torchao model needs torchao: {DEPLOY_EXTRA}") from err
    quantize_(model, Int8DynamicActivationInt8WeightConfig() if dynamic else Int8WeightOnlyConfig())
    from lightning_pin.faults.int8 import is_int8_weight

    names = [name for name, p in model.named_parameters() if is_int8_weight(p)]
    if not names:
        raise PinError("torchao quantized no weight of the model: its int8 weights are those of nn.Linear modules")
    return names
