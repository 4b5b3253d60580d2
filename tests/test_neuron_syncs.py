"""Stuck neurons add no host-device sync to a steady-state training step (both doors).

The counter of tests/test_syncs.py counts the sync-forcing aten ops of every batch (forward with the
pins' forward hooks, backward, the step and every hook) in a pinned and a plain run; a batch whose
set of active neuron pins occurred before must add none. The forwards of a new set of active pins
(and a module's first forward, which resolves the positions) build their tensors once and may sync.
"""

from __future__ import annotations

import torch
from helpers import TinyNet, make_loader, trainer
from test_syncs import BatchEnd, BatchStart, SyncCounter, _steady_batches_add_no_sync

from lightning_pin import NeuronPin, Pin, PinCallback, pin


def _pins():
    return [
        NeuronPin("encoder", indices=[1, 5, 9], value=0.5),
        NeuronPin("head", indices=[0], stuck_at_zero=0x80000000, stuck_at_one=0x00400000),
        NeuronPin("head", channels=[2], value=-1.0, start_step=3, stop_step=9),  # a window that starts and stops
        Pin("head.bias", value=0.0),
    ]


def test_front_door_neuron_pins_add_no_sync_in_steady_state_steps():
    def run(pinned: bool):
        torch.manual_seed(0)
        model = TinyNet(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, foreach=True))
        opt = model.configure_optimizers()
        counter, active = SyncCounter(), {}
        handle = pin(model, opt, _pins()) if pinned else None
        with counter:
            for batch_idx, (x, y) in enumerate(make_loader(n=96, batch_size=4)):
                counter.batch = batch_idx
                at_start = handle.outputs["neuron"].active if handle is not None else None
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()  # a window that starts or stops at the next step switches here
                opt.zero_grad()
                model.eval()
                with torch.no_grad():
                    model(x)  # an evaluation forward, under the pins active after the step
                model.train()
                if handle is not None:
                    active[batch_idx] = (at_start, handle.outputs["neuron"].active)
                counter.batch = None
        if handle is not None:
            handle.remove()
        return counter, active

    plain, _ = run(False)
    pinned, active = run(True)
    assert len({at_end for _, at_end in active.values()}) == 2  # the window started and stopped
    assert _steady_batches_add_no_sync(plain, pinned, active) >= 20
    # The counter does see the syncs of building a set's tensors: the first batch has some.
    assert sum((pinned.counts[0] - plain.counts[0]).values()) > 0


def test_callback_neuron_pins_add_no_sync_in_steady_state_steps(tmp_path):
    def run(pinned: bool):
        torch.manual_seed(0)
        model = TinyNet(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=True))
        counter = SyncCounter()
        callback = PinCallback(_pins(), verbose=False, monitor=False) if pinned else None
        start, end = BatchStart(counter), BatchEnd(counter)
        t = trainer(max_epochs=2, callbacks=[start, *([callback] if callback else []), end],
                    default_root_dir=tmp_path / str(pinned))
        with counter:
            t.fit(model, make_loader(n=64, batch_size=4))
        return counter, start, callback

    plain, plain_start, _ = run(False)
    pinned, start, callback = run(True)
    # The hooks ran: every neuron pin resolved its positions on its module's output.
    assert len(callback.state_dict()["outputs"]["neuron"]["positions"]) == 3
    assert plain_start.global_steps == start.global_steps
    counted = 0
    for batch, step in start.global_steps.items():
        # Active sets by step: {0,1} before step 3, {0,1,2} in [3, 9), {0,1} again from 9: the first
        # batch of each of the first two sets builds its tensors.
        if step not in (0, 3):
            added = pinned.counts[batch] - plain.counts[batch]
            assert not added, f"batch {batch} (step {step}) adds syncs: {dict(added)}"
            counted += 1
    assert counted >= 25


def test_feature_channels_over_varying_sequence_lengths_add_no_sync_after_the_first_forward():
    """Whole features of a Linear over (batch, seq, features): one set of tensors serves every length."""

    def run(pinned: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, foreach=True)
        counter = SyncCounter()
        handle = pin(model, opt, [NeuronPin("0", channels=[1, 4], value=0.5)]) if pinned else None
        with counter:
            for batch_idx, length in enumerate([3, 5, 7] * 4):
                counter.batch = batch_idx
                model(torch.randn(2, length, 4)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                counter.batch = None
        if handle is not None:
            handle.remove()
        return counter

    plain, pinned = run(False), run(True)
    assert sum((pinned.counts[0] - plain.counts[0]).values()) > 0  # the first forward resolves (and may sync)
    for batch in range(1, 12):
        assert not pinned.counts[batch] - plain.counts[batch], f"batch {batch} adds syncs"
