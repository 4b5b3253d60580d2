"""verify() on what the user holds: compiled, Fabric and data-parallel wrappers, and a module
whose pinned parameter changed shape."""

import pytest
import torch
from torch import nn

from lightning_pin import Pin, PinError
from lightning_pin.core.engine import PinEngine
from lightning_pin.core.modules import unwrap
from lightning_pin.core.plan import resolve


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def test_unwrap_strips_compile_fabric_and_data_parallel_in_any_nesting():
    model = _model()
    assert unwrap(model) is model
    assert unwrap(torch.compile(model)) is model
    assert unwrap(nn.DataParallel(model)) is model
    assert unwrap(nn.DataParallel(torch.compile(model))) is model
    assert unwrap(torch.compile(nn.DataParallel(model))) is model


def test_unwrap_strips_fabric_module():
    from lightning.fabric import Fabric

    model = _model()
    fabric = Fabric(accelerator="cpu", devices=1)
    wrapped = fabric.setup_module(model)
    assert type(wrapped).__name__ == "_FabricModule"
    assert unwrap(wrapped) is model
    assert unwrap(fabric.setup_module(torch.compile(_model()))).__class__ is nn.Sequential


def test_unwrap_leaves_a_user_attribute_that_is_no_module_alone():
    model = _model()
    model._orig_mod = "not a module"  # a plain attribute of the same name is no wrapper
    assert unwrap(model) is model
