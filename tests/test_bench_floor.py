"""The speed bars' floors (benchmarks/bench.py) pin what the engine pins: the same positions, the
same targets held exactly, the pinned gradients kept out of the optimizer. Otherwise "the engine
over its floor" would compare unlike work. No timing is asserted (the machines are noisy)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from helpers import benchmark
from lightning_pin import Pin, pin


@pytest.fixture(scope="module")
def bench():
    return benchmark("bench")


def test_raw_pins_take_the_engines_positions_and_hold_its_targets(bench):
    model, names = bench._deep_stack(6, 6_000)
    twin = bench.aliased(model)
    optimizer, twin_optimizer = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(twin.parameters())
    handle = pin(model, optimizer, [Pin(names, fraction=0.02, seed=0)])
    raw = bench.RawPins(twin, names, 0.02, twin_optimizer)
    owned = handle.engine._step_plan(optimizer).owned
    assert [t.name for t in owned] == names
    for target, (parameter, index, targets, _) in zip(owned, raw.entries):
        assert torch.equal(target.index.long().reshape(-1), index)
        assert torch.equal(target.values.reshape(-1), targets)
    x = torch.randn(5, model[0].in_features)
    for _ in range(3):
        twin(x).square().mean().backward()
        twin_optimizer.step()
        twin_optimizer.zero_grad()
    for parameter, index, targets, _ in raw.entries:
        assert torch.equal(parameter.detach().reshape(-1)[index], targets)
        assert torch.equal(twin_optimizer.state[parameter]["exp_avg"].reshape(-1)[index], torch.zeros_like(targets))
    handle.remove()


def test_depth_rounds_report_the_floor(bench):
    row = bench.depth_rounds(4, 0.05, "AdamW foreach", rounds=1, steps=2, warmup=1, parameters=4_000, floor=True)
    assert row["floor_ms"] > 0 and len(row["floor_rounds"]) == 1
    assert row["over_floor"] == pytest.approx(row["pinned_ms"] / row["floor_ms"])


def test_raw_index_pins_hold_the_targets_in_a_trainer_fit(bench):
    torch.manual_seed(0)
    model = bench.MLP(12, layers=2)
    floor = bench.RawIndexPins(model, 0.2)
    trainer = L.Trainer(max_steps=4, callbacks=[floor], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, bench.loader(12, 4, batch=8))
    state = trainer.optimizers[0].state
    assert floor.parked
    for parameter, index, targets in floor.entries:
        assert torch.equal(parameter.detach().reshape(-1)[index], targets)
        assert torch.equal(state[parameter]["exp_avg"].reshape(-1)[index], torch.zeros_like(targets))
        # Set to 1.0 after the first step, then decayed by beta2 (the gradient is zero there): never 0.
        assert bool((state[parameter]["exp_avg_sq"].reshape(-1)[index] > 0.99).all())
