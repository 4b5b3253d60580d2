"""The step plan: what a steady step runs is built once per set of active pins, and its kernels
(one call per pinned tensor, constants bound) write the same bits as the kinds' general ``apply``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pin import Pin, QuantCode, pin

SPECS = {
    "stuck bits": dict(stuck_at_zero=0x80000000, stuck_at_one=0x00400000),
    "bounds": dict(bounds=(-0.05, 0.05)),
    "int8 code": dict(code=QuantCode(bits=8, scale=0.01), stuck_at_zero=0x40, stuck_at_one=0x01),
    "uint4 code per channel": dict(
        code=QuantCode(bits=4, scale=torch.linspace(0.01, 0.1, 6), axis=0, signed=False, zero_point=3),
        stuck_at_one=0x2,
    ),
    "value": dict(value=0.25),
}


def _engine(spec: dict, fraction: float | None, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    model = nn.Linear(5, 6).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = pin(model, opt, [Pin("weight", fraction=fraction, seed=3, **spec)])
    return model, opt, handle


@pytest.mark.parametrize("fraction", [0.5, None], ids=["elements", "whole"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("spec", list(SPECS))
def test_kernels_write_the_bits_apply_writes(spec, fraction, dtype):
    if "code" in spec and dtype == torch.bfloat16:
        dtype = torch.float16
    given = SPECS[spec]
    if spec == "stuck bits" and dtype.itemsize == 2:
        given = dict(stuck_at_zero=0x8000, stuck_at_one=0x0040)
    model, _, handle = _engine(given, fraction, dtype)
    engine = handle.engine
    with torch.no_grad():
        for trial in range(3):
            model.weight.copy_(torch.randn_like(model.weight) * 0.2)
            model.weight.view(-1)[0] = float("inf") if trial == 1 else model.weight.view(-1)[0]
            before = model.weight.detach().clone()
            expected = before.clone()
            for projection in engine.projections():
                projection.apply(expected)
            kernels = engine._step_plan(None).kernels
            assert len(kernels) == 1, "the plan has one kernel per pinned tensor"
            for kernel in kernels:
                kernel()
            got = model.weight.detach()
            assert torch.equal(got.view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8)), spec
    handle.remove()


def test_an_equal_active_set_keeps_the_step_plan_and_a_change_rebuilds_it():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    pins = [Pin("0.weight", fraction=0.5, seed=0), Pin("1.weight", fraction=0.5, seed=1, start_step=3)]
    with pin(model, opt, pins) as handle:
        engine = handle.engine
        plans, actives = [], []
        for _ in range(6):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            plans.append(engine._step_plan(opt))
            actives.append(engine.active)
        # Steps 1, 2 (pin 0) share one plan and one frozenset; step 3 activates pin 1: a new plan, kept after.
        assert plans[0] is plans[1] and actives[0] is actives[1]
        assert plans[2] is not plans[1] and plans[2] is plans[3] is plans[4] is plans[5]
        assert actives[2] is actives[5] and actives[2] == frozenset({0, 1})
        assert engine.set_active(frozenset({0, 1})) == [] and engine.active is actives[2]
        handle.verify()


@pytest.mark.parametrize("spec", ["stuck bits", "bounds", "int8 code", "value"])
def test_kernels_follow_a_parameter_whose_storage_moved(spec):
    """A ``.data`` swap after the plan was built: the kernel takes the general path and still holds."""
    model, opt, handle = _engine(SPECS[spec], 0.5)
    x = torch.randn(3, 5)
    for step in range(4):
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 1:
            model.weight.data = model.weight.data.clone()
    handle.verify()
    handle.remove()


def test_the_plan_is_rebuilt_when_the_optimizer_gains_a_param_group():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    x = torch.randn(2, 4)
    with pin(model, opt, [Pin("0.weight", fraction=0.5, seed=0), Pin("1.weight", value=0.5)]) as handle:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        assert [t.name for t in handle.engine._step_plan(opt).owned] == ["0.weight"]
        opt.add_param_group({"params": list(model[1].parameters())})
        model(x).sum().backward()
        opt.step()
        assert sorted(t.name for t in handle.engine._step_plan(opt).owned) == ["0.weight", "1.weight"]
        handle.verify()


def test_verify_step_costs_one_sync_per_step_whatever_the_number_of_pinned_tensors(tmp_path):
    """``verify="step"`` counts what is off on the device and reads that count once per step
    (it used to read one flag per pinned parameter); off elements are still named."""
    import lightning as L

    from helpers import trainer
    from lightning_pin import PinCallback, PinError
    from test_syncs import SyncCounter

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*[nn.Linear(6, 6) for _ in range(5)])

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    class Count(L.Callback):
        def __init__(self, counter: SyncCounter) -> None:
            self.counter = counter

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.counter.batch = batch_idx

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.counter.batch = None

    pins = [Pin(f"net.{i}.weight", fraction=0.5, seed=i) for i in range(5)]
    pins += [Pin(f"net.{i}.bias", bounds=(-0.1, 0.1)) for i in range(5)]
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(24, 6)), batch_size=4)

    def fit(verify: str) -> SyncCounter:
        torch.manual_seed(0)
        counter = SyncCounter()
        callback = PinCallback(pins, verbose=False, monitor=False, verify=verify)
        with counter:
            trainer(max_epochs=1, callbacks=[Count(counter), callback], default_root_dir=tmp_path).fit(Module(), data)
        return counter

    unchecked, checked = fit("never"), fit("step")
    for batch in range(2, 6):
        added = sum(checked.counts[batch].values()) - sum(unchecked.counts[batch].values())
        assert added == 1, (batch, dict(checked.counts[batch]), dict(unchecked.counts[batch]))

    # And an element off target is still named, by the same check.
    model = Module()
    callback = PinCallback([Pin("net.0.weight", fraction=0.5, seed=0)], verbose=False, monitor=False, verify="step")

    class Break(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            if trainer.global_step == 3:  # moved, and the step plan's restore emptied: off after this step
                pl_module.net[0].weight.data.add_(1.0)
                for plan in callback.engine._step_plans.values():
                    plan.kernels.clear()

    with pytest.raises(PinError, match=r"net\.0\.weight: \d+ element\(s\) off target"):
        trainer(max_epochs=1, callbacks=[callback, Break()], default_root_dir=tmp_path).fit(model, data)
