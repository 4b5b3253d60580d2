"""The stepping driver on its own (core/driver.py): rank agreement through a fake collective, the order
of a step in a plain loop, and the registry of live pins. No Lightning, no process group."""

from __future__ import annotations

import gc
import threading
from typing import Any, Callable

import pytest
import torch
from torch import nn

from lightning_pin import Pin, PinError, pin
from lightning_pin.core.buffers import BufferHold
from lightning_pin.core.driver import (
    LIVE,
    LivePins,
    StepDriver,
    any_rank,
    load_pin_state,
    pin_state,
    ranks_agree,
    torch_collective,
)
from lightning_pin.core.engine import PinEngine
from lightning_pin.core.plan import resolve


def _fake_world(size: int) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """``size`` collectives that meet like the ranks of a process group: each returns the element-wise
    max of what every rank gave. Run one rank per thread."""
    given: dict[int, torch.Tensor] = {}
    barrier = threading.Barrier(size)

    def collective(rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def reduce_max(tensor: torch.Tensor) -> torch.Tensor:
            given[rank] = tensor.clone()
            barrier.wait()
            result = torch.stack([given[r] for r in range(size)]).amax(dim=0)
            barrier.wait()  # every rank has read before the next reduction overwrites
            return result

        return reduce_max

    return [collective(rank) for rank in range(size)]


def _on_ranks(size: int, work: Callable[[int, Callable], Any]) -> list[Any]:
    """``work(rank, collective)`` on each rank, in threads; each rank's result or the exception it raised."""
    world = _fake_world(size)
    results: list[Any] = [None] * size

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank, world[rank])
        except Exception as err:  # the outcome under test
            results[rank] = err

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "a rank waits forever in the collective"
    return results


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


CPU = torch.device("cpu")


class _Plan:
    """Stands for a PinPlan where only its fingerprint matters."""

    def __init__(self, fingerprint: str) -> None:
        self._fingerprint = fingerprint

    def fingerprint(self) -> str:
        return self._fingerprint


# ------------------------------------------------------------------------------------------------
# Rank agreement


def test_ranks_with_the_same_pins_agree():
    plan = resolve([Pin("0.bias", value=[0.0] * 4)], _net())
    results = _on_ranks(3, lambda rank, c: ranks_agree(plan, None, c, CPU, rank=rank, stops="all stop"))
    assert results == [None, None, None]


def test_ranks_with_different_pins_all_raise():
    plans = [resolve([Pin("0.bias", value=[float(v)] * 4)], _net()) for v in (0, 0, 1)]
    prints = [plan.fingerprint() for plan in plans]
    assert prints[0] == prints[1] != prints[2]
    results = _on_ranks(3, lambda rank, c: ranks_agree(plans[rank], None, c, CPU, rank=rank, stops="all stop"))
    for rank, outcome in enumerate(results):
        assert isinstance(outcome, PinError)
        assert str(outcome).startswith(f"the ranks resolved different pins (rank {rank}: plan {prints[rank]})")


def test_digests_that_differ_only_in_one_half_are_told_apart():
    # The digest travels as two 31-bit halves: a difference in the low half alone must show too.
    low_only = [_Plan("0" * 15 + "1"), _Plan("0" * 16)]
    results = _on_ranks(2, lambda rank, c: ranks_agree(low_only[rank], None, c, CPU, rank=rank, stops="x"))
    assert all(isinstance(r, PinError) and "resolved different pins" in str(r) for r in results)
    high_only = [_Plan(format(1 << 40, "016x")), _Plan("0" * 16)]
    results = _on_ranks(2, lambda rank, c: ranks_agree(high_only[rank], None, c, CPU, rank=rank, stops="x"))
    assert all(isinstance(r, PinError) and "resolved different pins" in str(r) for r in results)


def test_a_rank_that_rejected_its_pins_stops_every_rank():
    plan = _Plan("ab" * 8)
    own = PinError("no parameter matches 'typo'")

    def work(rank: int, collective: Callable) -> None:
        rejected = own if rank == 1 else None
        ranks_agree(None if rejected else plan, rejected, collective, CPU, rank=rank, stops="all stop")

    results = _on_ranks(3, work)
    assert results[1] is own
    for rank in (0, 2):
        assert isinstance(results[rank], PinError)
        assert str(results[rank]) == "another rank rejected its pins (see its error); all stop"


def test_without_a_collective_only_the_own_rejection_counts():
    ranks_agree(_Plan("not even hex: never read"), None, None, CPU, rank=0, stops="x")
    own = PinError("bad")
    with pytest.raises(PinError) as raised:
        ranks_agree(None, own, None, CPU, rank=0, stops="x")
    assert raised.value is own


def test_any_rank_is_an_element_wise_or():
    hits = [[True, False, False], [False, False, True]]
    results = _on_ranks(2, lambda rank, c: any_rank(hits[rank], c, CPU))
    assert results == [[True, False, True], [True, False, True]]


def test_torch_collective_is_none_without_a_process_group():
    assert not torch.distributed.is_initialized()
    assert torch_collective() is None


def test_when_pins_are_decided_by_any_rank_and_fail_together():
    def decide(rank: int, collective: Callable, when: Callable) -> frozenset[int]:
        model = _net()
        engine = PinEngine(resolve([Pin("0.bias", value=0.0, when=when)], model))
        driver = StepDriver(engine, BufferHold(engine.plan, model), reduce_max=collective)
        driver.decide(0, batch=rank, batch_idx=0)
        assert torch.equal(model[0].bias.detach(), torch.zeros(4)) == bool(engine.active)
        return engine.active

    # Only rank 1's batch asks for the pin: it holds on both ranks.
    assert _on_ranks(2, lambda rank, c: decide(rank, c, lambda batch, i: batch == 1)) == [frozenset({0})] * 2

    def bad(batch: int, batch_idx: int) -> Any:
        return "yes" if batch == 0 else False  # rank 0's `when` answers with a string

    results = _on_ranks(2, lambda rank, c: decide(rank, c, bad))
    assert isinstance(results[0], PinError) and "when" in str(results[0])
    assert isinstance(results[1], PinError) and "a `when` failed on another process" in str(results[1])


# ------------------------------------------------------------------------------------------------
# The order of a step, in a plain loop


def _pins() -> list[Pin]:
    return [
        Pin("0.weight", indices=[(0, 0), (1, 2)], value=[0.5, -1.0]),
        Pin("2.bias", value=None, start_step=2, stop_step=4),  # captured at step 2, held until step 4
        Pin("0.bias", value=0.0, when=lambda batch, i: i % 2 == 1),
    ]


def _batches(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(8, 4, generator=generator) for _ in range(steps)]


def test_the_driver_by_hand_steps_a_loop_exactly_as_pin_does():
    steps = 6
    # The driver, driven by hand as Lightning's hooks drive it: decide before the forward, mask before
    # the step (pin() masks as backward accumulates), the engine restores after it, advance.
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    engine = PinEngine(resolve(_pins(), model))
    driver = StepDriver(engine, BufferHold(engine.plan, model), optimizers=[optimizer])
    driver.pending_reset = [i for i in driver.advance(0) if engine.plan.pins[i].when is None]
    hooks = engine.attach([optimizer])
    for step, x in enumerate(_batches(steps)):
        driver.decide(step, x, step)
        model(x).square().sum().backward()
        driver.before_step(optimizer)
        assert driver.pending_reset == []
        optimizer.step()
        optimizer.zero_grad()
        driver.advance(step + 1)
    for hook in hooks:
        hook.remove()
    engine.detach()

    # The same loop through pin().
    other = _net()
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=0.1)
    with pin(other, other_optimizer, _pins()) as handle:
        for step, x in enumerate(_batches(steps)):
            handle.batch_start(x, step)
            other(x).square().sum().backward()
            other_optimizer.step()
            other_optimizer.zero_grad()
        handle.verify()
    assert handle.step == steps
    for (name, a), (_, b) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(a, b), name
    assert engine.active == handle.engine.active == frozenset({0, 2})  # the window closed; batch 5 asks for `when`


def test_advance_forces_a_pin_at_the_step_its_window_opens():
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = PinEngine(resolve([Pin("2.bias", value=[3.0, 4.0], start_step=1, stop_step=2)], model))
    driver = StepDriver(engine, BufferHold(engine.plan, model))
    assert driver.advance(0) == [] and engine.active == frozenset()
    assert driver.advance(1) == [0]
    assert torch.equal(model[2].bias.detach(), torch.tensor([3.0, 4.0]))  # before step 1's forward
    assert driver.advance(1) == []
    assert driver.advance(2) == [] and engine.active == frozenset()
    del optimizer


def test_a_steady_advance_touches_neither_the_active_set_nor_the_buffers(monkeypatch):
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    engine = PinEngine(resolve([Pin("1.*")], model))
    buffers = BufferHold(engine.plan, model)
    driver = StepDriver(engine, buffers)
    driver.advance(0)
    assert buffers.targets  # the frozen BatchNorm's running statistics are held
    calls: list[str] = []
    monkeypatch.setattr(engine, "set_active", lambda ids: calls.append("set_active") or [])
    monkeypatch.setattr(buffers, "update", lambda *a, **k: calls.append("update"))
    for step in range(1, 5):
        assert driver.advance(step) == []
    assert calls == []


def test_before_step_masks_or_only_drops_whole_gradients_as_the_door_says():
    for masked_at_backward in (False, True):
        model = _net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = PinEngine(resolve([Pin("0.weight", indices=[(1, 1)], value=0.0), Pin("2.bias")], model))
        driver = StepDriver(engine, BufferHold(engine.plan, model), optimizers=[optimizer],
                            masked_at_backward=masked_at_backward)
        driver.advance(0)
        model(torch.randn(8, 4)).square().sum().backward()
        driver.before_step(optimizer)
        assert model[2].bias.grad is None  # a wholly pinned tensor: dropped either way
        # An element: masked here, or left to the door that masks at backward (no hooks in this test).
        assert (model[0].weight.grad[1, 1] == 0).item() != masked_at_backward


def test_reset_statistics_zeroes_the_pending_pins_once():
    model = _net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()  # statistics exist before the pins
    engine = PinEngine(resolve([Pin("0.weight", indices=[(1, 1)], value=0.0)], model))
    driver = StepDriver(engine, BufferHold(engine.plan, model))
    driver.pending_reset = driver.advance(0)
    state = optimizer.state[model[0].weight]
    assert state["exp_avg"][1, 1] != 0
    other = state["exp_avg"][0, 0].clone()
    driver.reset_statistics([optimizer])
    assert torch.equal(state["exp_avg"][1, 1], torch.tensor(0.0))
    assert torch.equal(state["exp_avg_sq"][1, 1], torch.tensor(0.0))
    assert torch.equal(state["exp_avg"][0, 0], other)
    assert driver.pending_reset == []


def test_force_writes_the_targets_over_loaded_weights_and_takes_the_buffers_afresh():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    engine = PinEngine(resolve([Pin("0.bias", value=1.5), Pin("1.*")], model))
    driver = StepDriver(engine, BufferHold(engine.plan, model))
    driver.advance(0)
    with torch.no_grad():  # a resume loads other weights and statistics
        model[0].bias.fill_(-2.0)
        model[1].running_mean.fill_(7.0)
    driver.force(0)
    assert torch.equal(model[0].bias.detach(), torch.full((4,), 1.5))
    assert torch.equal(driver.buffers.targets["1.running_mean"], torch.full((4,), 7.0))


def test_outputs_are_told_the_step():
    seen: list[int] = []

    class Output:
        def set_step(self, step: int) -> None:
            seen.append(step)

    model = _net()
    engine = PinEngine(resolve([Pin("0.bias", value=0.0)], model))
    driver = StepDriver(engine, BufferHold(engine.plan, model), {"neuron": Output()})
    driver.decide(3, None, 0)
    driver.advance(4)
    driver.advance(4, outputs=False)
    driver.force(5)
    assert seen == [3, 4, 5]


# ------------------------------------------------------------------------------------------------
# The saved pin state


class _Output:
    """An output kind's runtime, as far as the pin state sees it."""

    def __init__(self, saved: Any = None) -> None:
        self.saved, self.step = saved, None

    def state_dict(self) -> dict:
        return {"stuck": [1, 5]}

    def load_state_dict(self, state: Any, *, strict: bool, warn: Callable) -> None:
        self.saved = state

    def set_step(self, step: int) -> None:
        self.step = step


def test_the_pin_state_round_trips_with_extras_before_the_outputs():
    model = _net()
    engine = PinEngine(resolve([Pin("0.bias", value=None)], model))
    engine.set_active({0})
    state = pin_state(engine, {"neuron": _Output()}, step=7, monitor={"baseline": 0.5})
    assert list(state)[-2:] == ["monitor", "outputs"] and state["step"] == 7
    assert state["outputs"] == {"neuron": {"stuck": [1, 5]}}
    other_model = _net(seed=1)
    other = PinEngine(resolve([Pin("0.bias", value=None)], other_model))
    output = _Output()
    saved = load_pin_state(other, {"neuron": output}, state, strict=True)
    assert saved.step == 7 and output.saved == {"stuck": [1, 5]} and output.step is None  # nothing forced yet
    assert other.active == frozenset({0}) and torch.equal(other.captured[0]["0.bias"], model[0].bias.detach())
    assert not torch.equal(other_model[0].bias.detach(), model[0].bias.detach())


def test_saved_state_without_the_outputs_is_refused_when_strict_and_warned_otherwise():
    model = _net()
    engine = PinEngine(resolve([Pin("0.bias", value=0.0)], model))
    state = pin_state(engine, {})
    with pytest.raises(PinError, match=r"holds no state of \['neuron'\] pins"):
        load_pin_state(engine, {"neuron": _Output()}, state, strict=True)
    seen: list[str] = []
    output = _Output(saved="untouched")
    assert load_pin_state(engine, {"neuron": output}, state, strict=False, warn=seen.append) is not None
    assert output.saved == "untouched" and seen == []


# ------------------------------------------------------------------------------------------------
# The registry of live pins


class _Holder:
    def __init__(self, model: nn.Module, pins: list[Pin]) -> None:
        self.engine = PinEngine(resolve(pins, model))


def test_the_registry_keeps_holders_in_order_and_weakly():
    registry = LivePins()
    model = _net()
    first, second = _Holder(model, [Pin("0.bias")]), _Holder(model, [Pin("2.bias")])
    registry.add(model, first, "pin()")
    registry.add(model, second, "PinCallback")
    assert registry.on(model) == [first, second]
    assert registry.items() == [(model, [first, second])]
    registry.discard(first)
    registry.discard(first)  # twice is harmless
    assert registry.on(model) == [second]
    del second
    gc.collect()
    assert registry.on(model) == [] and registry.items() == []


@pytest.mark.parametrize(
    ("live_door", "new_door", "hint"),
    [
        ("pin()", "pin()", r"another pin\(\) on this module is still active"),
        ("PinCallback", "pin()", "a PinCallback is fitting this module"),
        ("pin()", "PinCallback", r"another pin\(\) on this module is still active"),
        ("PinCallback", "PinCallback", None),
    ],
)
def test_conflicts_with_live_pins_are_refused_naming_the_door(live_door, new_door, hint):
    registry = LivePins()
    model = _net()
    holder = _Holder(model, [Pin("0.weight", indices=[(0, 0)], value=1.0)])
    registry.add(model, holder, live_door)
    registry.refuse_conflicts(resolve([Pin("0.weight", indices=[(0, 0)], value=1.0)], model), model, new_door)
    registry.refuse_conflicts(resolve([Pin("0.weight", indices=[(1, 1)], value=2.0)], model), model, new_door)
    registry.refuse_conflicts(resolve([Pin("0.weight", indices=[(0, 0)], value=2.0)], _net()), _net(), new_door)
    with pytest.raises(PinError, match="different values") as raised:
        registry.refuse_conflicts(resolve([Pin("0.weight", indices=[(0, 0)], value=2.0)], model), model, new_door)
    if hint is None:
        assert "(another" not in str(raised.value)
        assert "fitting" not in str(raised.value)
    else:
        assert raised.match(hint)


def test_pin_registers_its_handle_until_removed():
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pin(model, optimizer, Pin("0.bias", value=0.0)) as handle:
        assert LIVE.on(model) == [handle]
    assert LIVE.on(model) == []
    with pytest.raises(PinError):
        pin(model, optimizer, Pin("typo", value=0.0))
    assert LIVE.on(model) == []  # a refused pin() registers nothing
