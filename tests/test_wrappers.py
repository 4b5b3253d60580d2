"""verify() on what the user holds: compiled, Fabric and data-parallel wrappers, and a module
whose pinned parameter changed shape."""

import re

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


def _fitted_callback(model, pins):
    from helpers import make_loader, trainer

    from lightning_pin import PinCallback

    cb = PinCallback(pins, verbose=False, monitor=False)
    trainer(max_steps=3, callbacks=[cb]).fit(model, make_loader())
    return cb


def test_verify_accepts_the_compiled_module_the_user_holds():
    from helpers import TinyNet

    model = TinyNet()
    cb = _fitted_callback(model, [Pin("head.weight", indices=[(1, 2)], value=0.5)])
    compiled = torch.compile(model)  # the user's handle on the model: names start with _orig_mod.
    cb.verify(compiled)
    with torch.no_grad():
        model.head.weight[1, 2] = 0.25
    with pytest.raises(PinError, match=r"head\.weight: 1 element\(s\) off target \(\(1, 2\): 0\.25 != 0\.5\)"):
        cb.verify(compiled)


def test_verify_accepts_a_fabric_wrapped_module():
    from helpers import TinyNet
    from lightning.fabric import Fabric

    model = TinyNet()
    cb = _fitted_callback(model, [Pin("encoder.bias", value=0.0)])
    wrapped = Fabric(accelerator="cpu", devices=1).setup_module(model)
    cb.verify(wrapped)
    with torch.no_grad():
        model.encoder.bias[3] = 1.0
    with pytest.raises(PinError, match=r"encoder\.bias: 1 element\(s\) off target \(\(3,\): 1\.0 != 0\.0\)"):
        cb.verify(wrapped)


@pytest.mark.parametrize("new_shape", [(4, 2), (2, 3), (4, 3, 1)])
def test_violations_on_a_parameter_that_changed_shape_say_so(new_shape):
    model = _model()
    engine = PinEngine(resolve([Pin("0.weight", indices=[(3, 2)], value=1.0)], model))
    engine.set_active(engine.ids_at(0))
    assert engine.violations() == []
    changed = {"0.weight": torch.zeros(new_shape)}
    with pytest.raises(PinError, match=rf"'0\.weight' has shape {re.escape(str(new_shape))}, but its pins were "
                       r"resolved on shape \(4, 3\)"):
        engine.violations(changed)


def test_verify_on_a_module_whose_pinned_parameter_shrank():
    from helpers import TinyNet

    model = TinyNet()
    cb = _fitted_callback(model, [Pin("head.weight", indices=[(2, 15)], value=0.5)])
    model.head = nn.Linear(16, 2)  # one class dropped: element (2, 15) no longer exists
    with pytest.raises(PinError, match=r"'head\.weight' has shape \(2, 16\), but its pins were resolved on shape "
                       r"\(3, 16\)"):
        cb.verify(model)
