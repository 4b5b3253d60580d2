"""No host-device synchronisation added by pinning in a steady-state training step.

A GPU run stalls whenever the host waits for a device value: ``.item()``, ``bool(tensor)``,
``nonzero``, ``unique``, boolean-mask indexing and the like. A ``TorchDispatchMode`` counts the aten
ops that force such a wait, batch by batch (from the first callback's ``on_train_batch_start``
to the last one's ``on_train_batch_end``: forward, backward, the optimizer step and every hook),
in a real ``Trainer.fit`` on CPU, and the counts of a pinned run are compared with those of the
same run without pins. Torch and Lightning have syncs of their own (for-loop Adam reads its step
counter with ``.item()``): they are the same on both sides.

What is counted: every batch, except

- a batch whose set of active pins never occurred before: merging the targets of pins that
  overlap on one parameter deduplicates their indices once per combination (``unique``);
- with the default :class:`~lightning_pin.PinMonitor`, its logging steps (every
  ``log_every_n_steps``-th optimizer step), where it reads measurements to log them. With
  ``monitor=False`` no batch is excluded for that reason.

So windows that start and stop, ``when`` pins that toggle and re-capture their values
(``value=None``) at every activation, gradient accumulation and clipping are all counted, for
value pins and for the fault projections (stuck bits, bounds). The
plain-loop front door (``pin()``) is counted the same way, batch by batch.
"""

from __future__ import annotations

import collections

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import TinyNet, make_loader, trainer
from lightning_pin import Pin, PinCallback

aten = torch.ops.aten

# Ops whose result the host must wait for (their output size or value is data-dependent).
_ALWAYS_SYNC = {
    aten._local_scalar_dense.default,  # .item(), bool(t), int(t), float(t), .tolist()
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.nonzero_numpy.default,
    aten.argwhere.default,
    aten.masked_select.default,
    aten.unique_consecutive.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_dim_consecutive.default,
    aten.bincount.default,
    aten.repeat_interleave.Tensor,
}
# Ops that sync only when indexed by a boolean mask.
_SYNC_WITH_BOOL_INDEX = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}
_COPIES = {aten._to_copy.default, aten.copy_.default}


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _crosses_devices(func, args, kwargs) -> bool:
    """A copy between the host and another device (the host waits for device -> host ones)."""
    if func is aten.copy_.default:
        return args[0].device != args[1].device
    device = kwargs.get("device")
    return device is not None and torch.device(device) != args[0].device


class SyncCounter(TorchDispatchMode):
    """Counts sync-forcing aten ops per ``batch`` (None: not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.batch: int | None = None
        self.counts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.batch is not None and (
            func in _ALWAYS_SYNC
            or (func in _SYNC_WITH_BOOL_INDEX and _has_bool_index(args))
            or (func in _COPIES and _crosses_devices(func, args, kwargs))
        ):
            self.counts[self.batch][str(func)] += 1
        return func(*args, **kwargs)


class BatchStart(Callback):
    """First in the callback list: starts counting the batch; records what is active in it."""

    def __init__(self, counter: SyncCounter, pin_callback: PinCallback | None = None) -> None:
        self.counter, self.pin_callback = counter, pin_callback
        self.global_steps: dict[int, int] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        index = trainer.current_epoch * 10_000 + batch_idx
        self.global_steps[index] = trainer.global_step
        self.counter.batch = index


class BatchEnd(Callback):
    """Last in the callback list: stops counting; records the active pins of the batch."""

    def __init__(self, counter: SyncCounter, pin_callback: PinCallback | None = None) -> None:
        self.counter, self.pin_callback = counter, pin_callback
        self.active: dict[int, frozenset[int]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.pin_callback is not None:
            self.active[self.counter.batch] = self.pin_callback.engine.active
        self.counter.batch = None


def _toggling(batch, batch_idx) -> bool:
    # Decided from the batch index (host data): a `when` that reads device tensors is itself a sync.
    return batch_idx % 4 < 2


def _pins():
    return [
        # A step window on weights that a toggling `when` pin overlaps: their targets merge.
        Pin("encoder.weight", fraction=0.5, seed=1, start_step=2, stop_step=12),
        Pin("encoder.weight", fraction=0.3, seed=2, when=_toggling),  # re-captured at every activation
        Pin("head.weight", fraction=0.4, seed=3, value=0.0),  # explicit values, always
        Pin("head.bias", when=lambda batch, batch_idx: batch_idx % 3 == 0),  # a whole tensor, toggling
        Pin("encoder.bias", start_step=4, stop_step=9),  # a whole tensor in a window
    ]


def _fault_pins():
    return [
        # Stuck bits in a window, a whole tensor with stuck bits, toggling bounds, and a value pin.
        Pin("encoder.weight", fraction=0.3, seed=4, stuck_at_zero=0x80000000, stuck_at_one=0x00400000,
            start_step=2, stop_step=12),
        Pin("encoder.bias", stuck_at_one=0x00000001),
        Pin("head.weight", bounds=(-0.05, 0.05), when=_toggling),
        Pin("head.weight", fraction=0.2, seed=5, bounds=(-0.02, 0.02), start_step=4),  # intersects the above
        Pin("head.bias", value=0.0),
    ]


def _code_pins():
    from lightning_pin import QuantCode

    per_channel = QuantCode(bits=4, scale=torch.tensor([2.0**-3, 2.0**-4, 2.0**-3]), axis=0)
    return [
        # Stuck code bits: an int8 code in a window, a toggling per-channel int4 on a whole tensor, a value pin.
        Pin("encoder.weight", fraction=0.3, seed=4, stuck_at_zero=0x80, stuck_at_one=0x01,
            code=QuantCode(bits=8, scale=2.0**-6), start_step=2, stop_step=12),
        Pin("head.weight", stuck_at_one=0x2, code=per_channel, when=_toggling),
        Pin("head.bias", value=0.0),
    ]


OPTIMIZERS = {
    "adamw-forloop": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=False),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=True),
    "sgd_momentum-foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
}


def _count(
    optimizer, pins: bool, monitor: bool, tmp_path, make_pins=_pins
) -> tuple[SyncCounter, BatchStart, BatchEnd]:
    torch.manual_seed(0)
    model = TinyNet(OPTIMIZERS[optimizer])
    counter = SyncCounter()
    callback = PinCallback(make_pins(), verbose=False, monitor=monitor) if pins else None
    start, end = BatchStart(counter, callback), BatchEnd(counter, callback)
    callbacks = [start, *([callback] if callback else []), end]
    kwargs = dict(default_root_dir=tmp_path, log_every_n_steps=5)
    if monitor:
        from lightning.pytorch.loggers import CSVLogger

        kwargs["logger"] = CSVLogger(tmp_path)
    t = trainer(max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=0.1, callbacks=callbacks, **kwargs)
    with counter:
        t.fit(model, make_loader(n=96, batch_size=4))
    return counter, start, end


@pytest.mark.parametrize(
    ("optimizer", "make_pins"),
    [*((name, _pins) for name in OPTIMIZERS), ("adamw-forloop", _fault_pins), ("sgd_momentum-foreach", _fault_pins),
     ("adam-foreach", _code_pins)],
    ids=[*(f"{name}-values" for name in OPTIMIZERS), "adamw-forloop-faults", "sgd_momentum-foreach-faults",
         "adam-foreach-codes"],
)
@pytest.mark.parametrize("monitor", [False, True], ids=["no_monitor", "default_monitor"])
def test_pinning_adds_no_sync_in_steady_state_steps(optimizer, make_pins, monitor, tmp_path):
    """Value pins, and the fault projections (stuck bits, bounds) with their drift measurement."""
    plain, plain_start, _ = _count(optimizer, pins=False, monitor=False, tmp_path=tmp_path / "plain")
    pinned, start, end = _count(optimizer, True, monitor, tmp_path / "pinned", make_pins=make_pins)
    assert plain_start.global_steps == start.global_steps and len(start.global_steps) == 48
    seen: set[frozenset[int]] = set()
    counted, toggles, previous = 0, 0, None
    for batch, step in start.global_steps.items():
        active = end.active[batch]
        new_combination = active not in seen
        seen.add(active)
        logging_step = monitor and (step + 1) % 5 == 0
        if previous is not None and active != previous and not new_combination:
            toggles += 1
        previous = active
        if new_combination or logging_step:
            continue
        added = pinned.counts[batch] - plain.counts[batch]
        assert not added, f"batch {batch} (step {step}, active pins {sorted(active)}) adds syncs: {dict(added)}"
        counted += 1
    # The comparison covered most batches, including ones where pins started, stopped and toggled.
    assert counted >= 30 and toggles >= 10, (counted, toggles)


def test_the_counter_sees_the_syncs_it_looks_for():
    counter = SyncCounter()
    x = torch.tensor([0.0, 1.0, 2.0])
    with counter:
        counter.batch = 0
        x.sum().item()
        bool(x.any())
        x.nonzero()
        x[x > 0]
        torch.unique_consecutive(x)
        x[torch.tensor([0, 2])]  # integer indexing: no sync
        x.index_fill_(0, torch.tensor([1]), 0.0)  # no sync
        counter.batch = None
        x.sum().item()  # not counted
    assert dict(counter.counts[0]) == {
        "aten._local_scalar_dense.default": 2,
        "aten.nonzero.default": 1,
        "aten.index.Tensor": 1,
        "aten.unique_consecutive.default": 1,
    }


def test_toggling_when_pin_merges_recaptured_targets_without_a_sync():
    """Unit level: a `when` pin (value=None) overlapping a step-window pin (value=None) and an
    explicit one, toggled again and again while training moves the weights. Its targets are
    re-captured at every activation and merged with the others: right values, no sync."""
    from torch import nn

    from lightning_pin.core.engine import PinEngine
    from lightning_pin.core.plan import resolve

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(10, 10, generator=torch.Generator().manual_seed(0)))

    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randperm(100, generator=g)[:n] for n in (40, 30, 10))
    coords = lambda flat: [divmod(int(i), 10) for i in flat]  # noqa: E731
    explicit = torch.arange(10, dtype=torch.float32) + 100
    net = Net()
    pins = [
        Pin("w", indices=coords(a)),  # a window from step 0, captured at activation
        Pin("w", indices=coords(b), when=_toggling),  # re-captured at every activation
        Pin("w", indices=coords(c), value=explicit.tolist()),  # explicit beats captured
    ]
    engine = PinEngine(resolve(pins, net))
    flat = net.w.detach().view(-1)
    captured_a = captured_b = None
    counter = SyncCounter()
    for step in range(12):
        when_on = step % 3 != 2
        if step == 0:
            captured_a = flat[a].clone()
        if when_on and (step == 0 or step % 3 == 0):  # the `when` pin (re)activates here
            captured_b = flat[b].clone()
        with counter:
            counter.batch = step
            engine.set_active(engine.ids_at(step, {1} if when_on else ()))
            with torch.no_grad():
                net.w.add_(torch.randn(10, 10, generator=g))  # an optimizer step, pins included
            engine.restore()
            counter.batch = None
        want = {}
        for index, values in ((a, captured_a), (b, captured_b if when_on else None), (c, explicit)):
            if values is not None:
                want.update(zip(index.tolist(), values.tolist()))
        positions = torch.tensor(sorted(want))
        assert torch.equal(flat[positions], torch.tensor([want[i] for i in sorted(want)])), step
        if step >= 3:  # every combination of active pins has occurred
            assert not counter.counts[step], (step, dict(counter.counts[step]))
    # Without the cached layout the first toggles do sync: the test sees what it looks for.
    assert counter.counts[0]["aten.unique_consecutive.default"] == 1


def _steady_batches_add_no_sync(
    plain: SyncCounter, pinned: SyncCounter, active: dict[int, tuple[frozenset[int], frozenset[int]]]
) -> int:
    """Assert that every batch of a ``pin()`` loop whose active pins at its start and end were both
    seen before adds no sync over the plain loop; return how many batches were compared."""
    seen: set[frozenset[int]] = set()
    counted = 0
    for batch, (at_start, at_end) in active.items():
        if at_start in seen and at_end in seen:
            added = pinned.counts[batch] - plain.counts[batch]
            assert not added, f"batch {batch} (active pins {sorted(at_start)}) adds syncs: {dict(added)}"
            counted += 1
        seen.update((at_start, at_end))
    return counted


@pytest.mark.parametrize(
    ("optimizer", "make_pins", "compile_step"),
    [
        *((o, m, False) for o in ("adamw-forloop", "adam-foreach") for m in (_pins, _fault_pins)),
        ("adamw-forloop", _pins, True),
        ("adam-foreach", _fault_pins, True),
        ("adamw-forloop", _code_pins, False),
    ],
    ids=["adamw-forloop-values", "adamw-forloop-faults", "adam-foreach-values", "adam-foreach-faults",
         "adamw-forloop-values-compiled", "adam-foreach-faults-compiled", "adamw-forloop-codes"],
)
def test_front_door_adds_no_sync_in_steady_state_steps(optimizer, make_pins, compile_step):
    """The same count for a plain loop under ``pin()``: accumulation over 2 batches, clipping,
    windows that start and stop, and `when` pins that toggle and re-capture (``batch_start``).
    With ``compile_step`` the pinned run goes through the compiled step's driver (hooks, closure,
    the masks refreshed at toggles, the engine's bookkeeping) around the very function that is
    compiled, run as Python: torch.compile refuses to trace under a dispatch mode, and inside a
    compiled graph there is nothing to count. The graph itself cannot sync: it is compiled with
    ``fullgraph=True``, and ``.item()``, ``nonzero`` and every op with a data-dependent size is a
    graph break (an error) under torch.compile's default configuration."""
    from lightning_pin import pin

    def run(pinned: bool) -> tuple[SyncCounter, dict[int, frozenset[int]]]:
        torch.manual_seed(0)
        model = TinyNet(OPTIMIZERS[optimizer])
        opt = model.configure_optimizers()
        counter, active = SyncCounter(), {}  # batch -> active pins at its start and at its end
        handle = pin(model, opt, make_pins(), compile_step=compile_step) if pinned else None
        if compile_step and pinned:
            from lightning_pin.core import compiled_step

            driver = opt.__dict__["step"]
            driver._compiled = driver._first = compiled_step._held_step
            driver._compiled_measured = driver._first_measured = compiled_step._held_step_measured
            driver._mask = compiled_step._mask_dense
        with counter:
            for batch_idx, (x, y) in enumerate(make_loader(n=192, batch_size=4)):
                counter.batch = batch_idx
                if handle is not None:
                    handle.batch_start((x, y), batch_idx)
                    at_start = handle.engine.active
                (torch.nn.functional.cross_entropy(model(x), y) / 2).backward()
                if batch_idx % 2 == 1:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                    opt.step()  # pins whose window starts at the next step activate here
                    opt.zero_grad()
                if handle is not None:
                    active[batch_idx] = (at_start, handle.engine.active)
                counter.batch = None
        if handle is not None:
            handle.remove()
        return counter, active

    plain, _ = run(False)
    pinned, active = run(True)
    assert _steady_batches_add_no_sync(plain, pinned, active) >= 30


class _BNNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.BatchNorm1d(6))
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.relu(self.encoder(x)))


def test_held_buffers_and_parameter_checks_add_no_sync():
    """``pin()`` holding a frozen module's BatchNorm statistics (and checking, before each step,
    that the pinned parameters are still the module's): no sync in steady-state steps."""
    from lightning_pin import pin

    def run(pinned: bool) -> tuple[SyncCounter, dict[int, frozenset[int]]]:
        torch.manual_seed(0)
        model = _BNNet()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        counter, active = SyncCounter(), {}
        pins = [Pin("encoder.*"), Pin("head.bias", start_step=3, stop_step=6)]
        handle = pin(model, opt, pins) if pinned else None
        with counter:
            for batch_idx, (x, y) in enumerate(make_loader(n=64, batch_size=4)):
                counter.batch = batch_idx
                if handle is not None:
                    handle.batch_start((x, y), batch_idx)
                    at_start = handle.engine.active
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                if handle is not None:
                    active[batch_idx] = (at_start, handle.engine.active)
                counter.batch = None
        if handle is not None:
            assert handle.buffers.targets  # the statistics were held
            handle.remove()
        return counter, active

    plain, _ = run(False)
    pinned, active = run(True)
    assert _steady_batches_add_no_sync(plain, pinned, active) >= 10


def test_distillation_adds_no_sync_in_steady_state_steps(tmp_path):
    from lightning_pin.callbacks import DistillFromBaseline

    def count(distill: bool) -> SyncCounter:
        torch.manual_seed(0)
        model = TinyNet(OPTIMIZERS["adam-foreach"])
        counter = SyncCounter()
        pins = PinCallback([Pin("encoder.weight", fraction=0.5, seed=1, value=0.5)], verbose=False, monitor=False)
        extra = [DistillFromBaseline(weight=1.0, temperature=2.0)] if distill else []
        callbacks = [BatchStart(counter), pins, *extra, BatchEnd(counter)]
        t = trainer(max_epochs=1, callbacks=callbacks, default_root_dir=tmp_path, log_every_n_steps=5)
        with counter:
            t.fit(model, make_loader(n=64, batch_size=4))
        return counter

    plain, distilled = count(False), count(True)
    batches = sorted(plain.counts)
    assert len(batches) == 16 and sorted(distilled.counts) == batches
    # The first batch sets things up; every later one must add nothing (the teacher's forward and the KL included).
    added = {b: dict(distilled.counts[b] - plain.counts[b]) for b in batches[1:]}
    assert {b: a for b, a in added.items() if a} == {}
