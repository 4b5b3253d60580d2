"""Strategies whose parameters pins cannot address exactly are refused at fit start, clearly."""

from __future__ import annotations

import types

import pytest
from lightning.pytorch.strategies import FSDPStrategy, SingleDeviceStrategy

from lightning_pin import PinError
from lightning_pin.callbacks.pin_callback import _refuse_unsupported_strategy


def fake_trainer(strategy):
    return types.SimpleNamespace(strategy=strategy)


def test_fsdp1_is_refused_with_what_to_use_instead():
    with pytest.raises(PinError, match=r"does not support FSDPStrategy.*ModelParallelStrategy.*fully_shard"):
        _refuse_unsupported_strategy(fake_trainer(FSDPStrategy()))


def test_deepspeed_is_refused():
    # DeepSpeed is not installed here: a stand-in of the same class name is what the check sees.
    DeepSpeedStrategy = type("DeepSpeedStrategy", (), {})
    with pytest.raises(PinError, match=r"does not support DeepSpeedStrategy"):
        _refuse_unsupported_strategy(fake_trainer(DeepSpeedStrategy()))


def test_single_device_is_accepted():
    assert _refuse_unsupported_strategy(fake_trainer(SingleDeviceStrategy("cpu"))) is None
