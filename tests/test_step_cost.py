"""What pinning adds to a steady-state step, op by op: one kernel per pinned tensor, no index
conversion, no allocation.

A ``TorchDispatchMode`` records every aten op of each step of a plain loop (``pin()``) and of a
``Trainer`` fit (``PinCallback``), with and without pins, and compares the two. In steady state
(every pin's start and stop is behind, or the set of active pins occurred before) pinning may add
only in-place kernels on existing memory and views: no ``_to_copy`` of an integer index (the
int32 -> int64 widening the index kernels would otherwise need on every call), no op that
returns fresh memory. And the count of those kernels is fixed per pinned tensor: for a value pin
on some elements, one ``put_`` on its gradient and one ``put_`` of its targets (``index_fill_`` and
``index_copy_`` on a flat view past ``PUT_LIMIT`` elements), whatever the number of elements.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import benchmark, trainer
from lightning_pin import Pin, PinCallback, pin
from lightning_pin.core import sharding

aten = torch.ops.aten

LAYERS = 6


class OpRecorder(TorchDispatchMode):
    """Every aten op per ``step`` (None: not recorded), split into what a step may add and what not."""

    def __init__(self) -> None:
        super().__init__()
        self.step: int | None = None
        self.ops: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self.conversions: dict[int, int] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.step is not None:
            self.ops[self.step][func] += 1
            source = args[0] if args else None
            if (
                func is aten._to_copy.default
                and isinstance(source, torch.Tensor)
                and not source.dtype.is_floating_point
                and not source.dtype.is_complex
            ):
                self.conversions[self.step] += 1
        return func(*args, **kwargs)


def _allocates(func) -> bool:
    """Whether ``func`` returns memory of its own: neither in place (writes an argument) nor a view."""
    if func.is_view:
        return False
    return not any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(12, 12) for _ in range(LAYERS)])


OPTIMIZERS = {
    "adamw-forloop": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=False),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
}


def _value_pins() -> list[Pin]:
    # Every weight at 25% (element pins, one per tensor), the first bias whole.
    return [Pin([f"{i}.weight" for i in range(LAYERS)], fraction=0.25, seed=1), Pin("0.bias", value=0.0)]


def _fault_pins() -> list[Pin]:
    return [
        Pin("0.weight", fraction=0.25, seed=2, stuck_at_zero=0x80000000, stuck_at_one=0x00400000),
        Pin("1.weight", fraction=0.25, seed=3, bounds=(-0.05, 0.05)),
        Pin("2.weight", fraction=0.25, seed=4, value=0.5, start_step=2, stop_step=100),
    ]


def _plain_loop(optimizer: str, pins: list[Pin] | None, steps: int = 8) -> OpRecorder:
    model = _model()
    opt = OPTIMIZERS[optimizer](model.parameters())
    x = torch.randn(4, 12)
    recorder = OpRecorder()
    handle = pin(model, opt, pins) if pins else None
    with recorder:
        for step in range(steps):
            recorder.step = step
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            recorder.step = None
    if handle is not None:
        handle.remove()
    return recorder


def _added(plain: OpRecorder, pinned: OpRecorder, step: int) -> collections.Counter:
    added = pinned.ops[step].copy()
    added.subtract(plain.ops[step])
    return collections.Counter({func: n for func, n in added.items() if n > 0})


# Steps 0 and 1 make optimizer state (and pins activate); from step 3 on nothing is new.
STEADY = range(3, 8)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_steady_step_adds_one_kernel_per_pinned_tensor_and_no_allocation(optimizer):
    plain, pinned = _plain_loop(optimizer, None), _plain_loop(optimizer, _value_pins())
    for step in STEADY:
        assert pinned.conversions[step] == 0, f"step {step}: {pinned.conversions[step]} index conversion(s)"
        added = _added(plain, pinned, step)
        allocating = {str(f): n for f, n in added.items() if _allocates(f)}
        assert not allocating, f"step {step} allocates: {allocating}"
        # Per element-pinned weight: one put_ on its gradient, one put_ of its targets.
        assert added[aten.put_.default] == 2 * LAYERS, dict(added)
        assert added[aten.index_copy_.default] == 0, dict(added)
        # The whole bias: its gradient is dropped before the step (AdamW, SGD skip it), its
        # values still hold, so it costs nothing more than the zero_ of its gradient.
        assert added[aten.zero_.default] <= 1, dict(added)


def test_many_elements_per_tensor_take_the_flat_index_kernels(monkeypatch):
    """Past PUT_LIMIT elements a tensor is masked with index_fill_ and restored with index_copy_ on
    a flat view (fewer ns per element than put_): still one kernel each, no allocation."""
    monkeypatch.setattr(sharding, "PUT_LIMIT", 0)
    plain, pinned = _plain_loop("adamw-forloop", None), _plain_loop("adamw-forloop", _value_pins())
    for step in STEADY:
        assert pinned.conversions[step] == 0
        added = _added(plain, pinned, step)
        assert not {str(f): n for f, n in added.items() if _allocates(f)}
        assert added[aten.index_fill_.int_Scalar] == LAYERS, dict(added)
        assert added[aten.index_copy_.default] == LAYERS, dict(added)
        assert added[aten.put_.default] == 0, dict(added)


@pytest.mark.parametrize("optimizer", ["adamw-forloop", "sgd_momentum"])
def test_fault_projections_reuse_their_buffers(optimizer):
    plain, pinned = _plain_loop(optimizer, None), _plain_loop(optimizer, _fault_pins())
    for step in STEADY:
        assert pinned.conversions[step] == 0
        added = _added(plain, pinned, step)
        allocating = {str(f): n for f, n in added.items() if _allocates(f)}
        assert not allocating, f"step {step} allocates: {allocating}"
        # Stuck bits and bounds: gather into a kept buffer, project in place, scatter back.
        assert added[aten.index_select.out] == 2, dict(added)


def test_the_recorder_sees_conversions_and_allocations():
    recorder = OpRecorder()
    index = torch.arange(3, dtype=torch.int32)
    with recorder:
        recorder.step = 0
        torch.zeros(5).index_fill_(0, index.long(), 1.0)
    assert recorder.conversions[0] == 1
    assert _allocates(aten.zeros.default) and not _allocates(aten.index_fill_.int_Scalar)
    assert not _allocates(aten.view.default)


def test_the_callback_path_adds_no_conversion_and_no_allocation(tmp_path):
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01, foreach=False)

    class Record(L.Callback):
        def __init__(self, recorder: OpRecorder) -> None:
            self.recorder = recorder

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.recorder.step = trainer.global_step  # masking and restore: before and after the step

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.recorder.step = None

    def fit(pins: list[Pin] | None) -> OpRecorder:
        recorder = OpRecorder()
        callbacks = [PinCallback(pins, verbose=False, monitor=False)] if pins else []
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 12)), batch_size=4)
        with recorder:
            trainer(max_epochs=1, callbacks=[Record(recorder), *callbacks], default_root_dir=tmp_path).fit(
                Module(), data
            )
        return recorder

    plain = fit(None)
    pinned = fit([Pin([f"net.{i}.weight" for i in range(LAYERS)], fraction=0.25, seed=1)])
    for step in range(3, 8):
        assert pinned.conversions[step] == 0
        added = _added(plain, pinned, step)
        allocating = {str(f): n for f, n in added.items() if _allocates(f)}
        assert not allocating, f"step {step} allocates: {allocating}"
        assert added[aten.put_.default] == 2 * LAYERS, dict(added)


@pytest.mark.parametrize("change", ["submodule", "parameter", "cast"])
def test_the_per_step_module_check_still_sees_changes_after_steps(change):
    """The check before each step is two dict lookups per pinned parameter once it has passed:
    a submodule or a parameter replaced (or a cast) after some steps is still refused."""
    from lightning_pin import PinError

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 12)
    with pin(model, opt, [Pin("3.weight", fraction=0.5, seed=0)]):
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        if change == "submodule":
            model[3] = nn.Linear(12, 12)
        elif change == "parameter":
            model[3].weight = nn.Parameter(torch.randn(12, 12))
        else:
            model.double()
            x = x.double()
        model(x).sum().backward()
        with pytest.raises(PinError, match="'3.weight' (is no longer the tensor|was cast or moved)"):
            opt.step()


@pytest.mark.parametrize("keep_wide", [True, False])
def test_indices_above_the_wide_limit_are_widened_per_call_and_still_hold(monkeypatch, keep_wide):
    """Off the CPU, tensors with more pinned elements than ``WIDE_LIMIT`` keep no int64 copy (device
    memory): they convert on every call. On CPU (``KEEP_WIDE_ON_CPU``) the copy is made once and a
    steady step converts nothing. Both hold bit for bit (value pins and stuck bits)."""
    from lightning_pin.core import sharding

    monkeypatch.setattr(sharding, "WIDE_LIMIT", 4)
    monkeypatch.setattr(sharding, "KEEP_WIDE_ON_CPU", keep_wide)
    pins = [
        Pin("0.weight", fraction=0.25, seed=1, value=0.25),
        Pin("1.weight", fraction=0.25, seed=2, stuck_at_one=0x00400000),
    ]
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(4, 12)
    recorder = OpRecorder()
    with pin(model, opt, pins) as handle, recorder:
        for step in range(4):
            recorder.step = step
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        recorder.step = None
        handle.verify()  # raises on any element off its pin
    assert (recorder.conversions[3] > 0) is not keep_wide  # no copy kept: the other side of the trade
    selected = handle.engine.plan.pins[0].selections["0.weight"].index.long()
    assert torch.equal(model[0].weight.detach().view(-1)[selected], torch.full((selected.numel(),), 0.25))


# ------------------------------------------------------------------------------------------------
# Python calls per step: the step plan is built when the active pins change, not every step


def _step_calls():
    return benchmark("step_calls")


@pytest.mark.parametrize("kind", ["value", "stuck bits", "bounds", "quantized codes", "neurons"])
def test_a_steady_step_makes_at_most_20_calls_plus_2_per_pinned_tensor(kind):
    """Counted with sys.setprofile over lightning-pin's frames in a plain loop with AdamW (see
    benchmarks/step_calls.py). Before the step plan: 90 (values) to 307 (quantized codes)."""
    step_calls = _step_calls()
    counts = step_calls.count_calls(kind, steps=5)
    assert max(counts[2:]) <= step_calls.budget(), counts
    assert counts[0] > counts[-1]  # the counter sees the first step's building (it can fail)


def _leave_a_handle_behind(keep: list) -> None:
    """pin() on another model and optimizer, never removed; the handle sits in a reference cycle
    with its module (kept alive through ``keep`` when given)."""
    module = nn.Sequential(nn.Linear(3, 3))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    handle = pin(module, optimizer, [Pin("0.weight", indices=[(0, 0)], value=0.0)])
    module.cycle = [module, handle]
    keep.append(module)


def test_a_handle_dropped_without_remove_is_collected_and_costs_other_loops_nothing():
    """Its grad hooks live in C++, out of the garbage collector's sight: they must not keep the
    handle (and with it the model and the optimizer) alive, nor leave every other optimizer's step
    on the slow path of the check for optimizers not given to pin()."""
    import gc
    import weakref

    step_calls = _step_calls()
    alone = step_calls.count_calls("value", steps=3)[-1]
    kept: list = []
    gc.disable()  # the cycle stays until the count's own collection
    try:
        _leave_a_handle_behind(kept)
        module_ref = weakref.ref(kept.pop())
        assert module_ref() is not None
        after_a_dropped_one = step_calls.count_calls("value", steps=3)[-1]
    finally:
        gc.enable()
    gc.collect()
    assert module_ref() is None
    assert after_a_dropped_one == alone
    # A live one on another optimizer: this optimizer's steps are checked against its pins, in the
    # one call of the global hook that runs anyway (a cached answer, no Python frame more).
    _leave_a_handle_behind(kept)
    beside_a_live_one = step_calls.count_calls("value", steps=3)[-1]
    assert beside_a_live_one == alone
    kept.clear()
