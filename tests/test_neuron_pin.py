"""Stuck neurons (NeuronPin): positions of module outputs held in every forward, through both doors.

What every test checks is exact (``torch.equal``): the stuck positions read their value (or their
stuck bits) in every training and evaluation forward, as seen by a forward hook registered after
the pins; gradients into them are zero and the rest of the network trains.
"""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers import trainer
from lightning_pin import NeuronPin, Pin, PinCallback, PinError, pin
from lightning_pin.core.kinds.neuron import fraction_positions

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
}


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1)
        self.head = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.head(torch.relu(self.conv2(torch.relu(self.conv1(x)))).flatten(1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.fc2 = nn.Linear(10, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class Recorder:
    """A forward hook registered after the pins: what every later hook and module sees."""

    def __init__(self, module: nn.Module) -> None:
        self.outputs: list[tuple[bool, torch.Tensor]] = []
        self.handle = module.register_forward_hook(self._record)

    def _record(self, module, args, output):
        self.outputs.append((module.training, output.detach().clone()))


def _cnn_batches(n: int = 6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 1, 6, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def _train(model, optimizer, batches, *, record=None):
    for x, y in batches:
        model.train()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if record is not None:
            record(model)
        optimizer.step()
        optimizer.zero_grad()
        model.eval()
        with torch.no_grad():
            model(x)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("value", [0.0, 0.75])
def test_cnn_whole_channels_stuck_in_every_forward_and_the_rest_trains(optimizer, value):
    torch.manual_seed(0)
    model = SmallCNN()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = OPTIMIZERS[optimizer](model.parameters())
    grads = []
    with pin(model, opt, [NeuronPin("conv1", channels=[3, 7], value=value)]) as handle:
        seen = Recorder(model.conv1)
        _train(model, opt, _cnn_batches(), record=lambda m: grads.append(
            (m.conv1.weight.grad.clone(), m.conv1.bias.grad.clone())))
        assert handle.step == 6
    assert [training for training, _ in seen.outputs] == [True, False] * 6  # every train and eval forward
    for _, out in seen.outputs:
        assert torch.equal(out[:, [3, 7]], torch.full_like(out[:, [3, 7]], value))
        assert not torch.equal(out[:, 0], torch.full_like(out[:, 0], value))
    # No gradient into the stuck channels: their filters get exactly zero gradient.
    for weight_grad, bias_grad in grads:
        assert torch.equal(weight_grad[[3, 7]], torch.zeros_like(weight_grad[[3, 7]]))
        assert torch.equal(bias_grad[[3, 7]], torch.zeros(2))
        assert bool((weight_grad[[0, 1, 2, 4, 5, 6]].abs().sum((1, 2, 3)) > 0).all())
    # The rest trains (every other parameter moved).
    for name, p in model.named_parameters():
        assert not torch.equal(p, start[name]), name
    if optimizer == "sgd_momentum":  # no weight decay: the stuck channels' filters never moved
        assert torch.equal(model.conv1.weight[[3, 7]], start["conv1.weight"][[3, 7]])
    # remove() took the hook off: the module computes its own outputs again.
    x = torch.randn(2, 1, 6, 6)
    assert torch.equal(model.conv1(x), nn.functional.conv2d(x, model.conv1.weight, model.conv1.bias, padding=1))
    assert not model.conv1._forward_hooks or list(model.conv1._forward_hooks.values()) == [seen._record]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_mlp_single_neurons_stuck_gradients_zero_there(optimizer):
    torch.manual_seed(0)
    model = MLP()
    opt = OPTIMIZERS[optimizer](model.parameters())
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(5)]
    rows = []
    pins = [NeuronPin("fc1", indices=[2, 9], value=[1.0, -0.5]), NeuronPin("fc2", indices=[(0,)], value=0.25)]
    with pin(model, opt, pins):
        seen1, seen2 = Recorder(model.fc1), Recorder(model.fc2)
        _train(model, opt, batches, record=lambda m: rows.append(m.fc1.weight.grad[[2, 9]].clone()))
    assert len(seen1.outputs) == 10
    for (_, h), (_, out) in zip(seen1.outputs, seen2.outputs):
        assert torch.equal(h[:, 2], torch.ones(5)) and torch.equal(h[:, 9], torch.full((5,), -0.5))
        assert torch.equal(out[:, 0], torch.full((5,), 0.25))
    for row in rows:
        assert torch.equal(row, torch.zeros_like(row))


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


@pytest.mark.parametrize(("zero", "one"), [(0x80000000, None), (None, 0x40000000), (0x00800000, 0x80000000)],
                         ids=["sign_at_0", "top_exponent_bit_at_1", "exponent_bit_at_0_sign_at_1"])
def test_stuck_bits_of_activations(zero, one):
    torch.manual_seed(0)
    model = MLP()
    reference = MLP()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: both models keep the same weights
    x = torch.randn(7, 6)
    with pin(model, opt, [NeuronPin("fc1", indices=[1, 4], stuck_at_zero=zero, stuck_at_one=one)]):
        seen = Recorder(model.fc1)
        out = model(x)
        model.eval()
        model(x)
    raw = reference.fc1(x).detach()
    word = _bits(raw.clone())
    keep = ~((zero or 0) - (1 << 32) if (zero or 0) >= 1 << 31 else (zero or 0))
    set_ = (one or 0) - (1 << 32) if (one or 0) >= 1 << 31 else (one or 0)
    stuck = ((word & keep) | set_).view(torch.float32)
    for _, h in seen.outputs:
        assert torch.equal(_bits(h[:, [1, 4]]), _bits(stuck[:, [1, 4]]))  # bit for bit (a stuck exponent may give NaN)
        others = [0, 2, 3, 5, 6, 7, 8, 9]
        assert torch.equal(h[:, others], raw[:, others])
    # The gradient does not flow through a stuck position: the output's grad there reaches no weight.
    out.sum().backward()
    assert torch.equal(model.fc1.weight.grad[[1, 4]], torch.zeros(2, 6))
    assert bool((model.fc1.weight.grad[0].abs() > 0).any())


def test_fraction_is_seeded_nested_and_the_same_as_its_resolution():
    small = fraction_positions("fc1", 100, 0.1, 3)
    large = fraction_positions("fc1", 100, 0.3, 3)
    assert small.numel() == 10 and large.numel() == 30
    assert set(small.tolist()) <= set(large.tolist())
    assert not torch.equal(small, fraction_positions("fc1", 100, 0.1, 4))
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pin(model, opt, NeuronPin("fc1", fraction=0.3, seed=3, value=2.0)) as handle:
        h = model.fc1(torch.randn(2, 6))
        saved = handle.state_dict()["outputs"]["neuron"]["positions"][0]
    expected = fraction_positions("fc1", 10, 0.3, 3)
    assert torch.equal(saved["flat"], expected)
    assert torch.equal(h[:, expected], torch.full((2, 3), 2.0))


def test_step_window_and_tuple_output():
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 4)

        def forward(self, x):
            y = self.fc(x)
            return y, y.sum()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pair = Pair()

        def forward(self, x):
            return self.pair(x)[0]

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 3)
    with pin(model, opt, [NeuronPin("pair", channels=1, value=9.0, start_step=1, stop_step=3)]) as handle:
        stuck = []
        for _ in range(4):
            out = model(x)
            stuck.append(bool((out[:, 1] == 9.0).all()))
            out.sum().backward()
            opt.step()
            opt.zero_grad()
        assert handle.step == 4
    assert stuck == [False, True, True, False]


def test_weight_pins_and_neuron_pins_together():
    torch.manual_seed(0)
    model = SmallCNN()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    pins = [Pin("head.bias", value=0.0), Pin("conv2.weight", indices=[(0, 0, 0, 0)], value=0.5),
            NeuronPin("conv2", channels=[2], value=-1.0)]
    with pin(model, opt, pins) as handle:
        seen = Recorder(model.conv2)
        _train(model, opt, _cnn_batches(3))
        handle.verify()
    assert torch.equal(model.head.bias, torch.zeros(3)) and model.conv2.weight[0, 0, 0, 0].item() == 0.5
    assert all(torch.equal(o[:, 2], torch.full_like(o[:, 2], -1.0)) for _, o in seen.outputs)


# ------------------------------------------------------------------------------------------------
# Resume


def _resume_run(split: int | None, steps: int = 6):
    torch.manual_seed(0)
    model = SmallCNN()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    pins = [NeuronPin("conv1", fraction=0.2, seed=5, value=0.5),
            NeuronPin("conv2", channels=[1], stuck_at_zero=0x80000000), Pin("head.weight", fraction=0.1, seed=1)]
    batches = _cnn_batches(steps)
    handle = pin(model, opt, pins)
    if split is None:
        _train(model, opt, batches)
        handle.remove()
        return model
    _train(model, opt, batches[:split])
    saved = {"model": model.state_dict(), "opt": opt.state_dict(), "pins": handle.state_dict()}
    handle.remove()
    saved = _roundtrip(saved)
    torch.manual_seed(123)
    resumed = SmallCNN()
    resumed.load_state_dict(saved["model"])
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=0.01, weight_decay=0.1)
    opt2.load_state_dict(saved["opt"])
    with pin(resumed, opt2, pins) as handle2:
        handle2.load_state_dict(saved["pins"])
        assert handle2.step == split
        _train(resumed, opt2, batches[split:])
    return resumed


def _roundtrip(obj):
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_handle_state_resume_is_bit_identical():
    whole, resumed = _resume_run(None), _resume_run(3)
    for (name, a), (_, b) in zip(whole.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), name


def test_saved_positions_are_used_and_mismatching_state_refused():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pin(model, opt, NeuronPin("fc1", fraction=0.3, seed=3)) as handle:
        model(torch.randn(2, 6))
        state = handle.state_dict()
    state["outputs"]["neuron"]["positions"][0]["flat"] = torch.tensor([0, 1, 2])
    with pin(model, opt, NeuronPin("fc1", fraction=0.3, seed=3)) as handle:
        handle.load_state_dict(state)
        h = model.fc1(torch.randn(2, 6))
        assert torch.equal(h[:, :3], torch.zeros(2, 3))  # the saved positions, not a fresh draw
    with pin(model, opt, NeuronPin("fc1", fraction=0.3, seed=4)) as handle:
        with pytest.raises(PinError, match="neuron-pin state does not match"):
            handle.load_state_dict(state)
    with pin(model, opt, NeuronPin("fc1", fraction=0.3, seed=3)) as handle:
        with pytest.raises(PinError, match="no state of \\['neuron'\\]"):
            handle.load_state_dict({k: v for k, v in state.items() if k != "outputs"})


# ------------------------------------------------------------------------------------------------
# Refusals


def test_refusals_at_construction():
    with pytest.raises(PinError, match="not both"):
        NeuronPin("fc1", value=1.0, stuck_at_zero=1)
    with pytest.raises(PinError, match="not both"):
        NeuronPin("fc1", value=0.0, stuck_at_one=1)  # an explicit 0.0 is a value too
    with pytest.raises(PinError, match="at most one of"):
        NeuronPin("fc1", channels=[1], fraction=0.5)
    with pytest.raises(PinError, match="fraction must be"):
        NeuronPin("fc1", fraction=1.5)
    with pytest.raises(PinError, match="axis 0 is the batch"):
        NeuronPin("fc1", channels=[1], axis=0)
    with pytest.raises(PinError, match="finite number"):
        NeuronPin("fc1", value=float("nan"))
    with pytest.raises(PinError, match="overlap"):
        NeuronPin("fc1", stuck_at_zero=3, stuck_at_one=1)
    with pytest.raises(PinError, match="2 values for 1"):
        NeuronPin("fc1", channels=[1], value=[1.0, 2.0])


def test_pattern_matching_no_module_is_refused_before_any_forward():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(PinError, match="matches no module.*closest names: \\['fc2', 'fc1'\\]"):
        pin(model, opt, [NeuronPin("fc")])
    assert not model.fc1._forward_hooks  # nothing left behind


def _refused_at_first_forward(model, pins, x, match):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    after = []
    with pin(model, opt, pins):
        for module in model.modules():
            module.register_forward_hook(lambda m, a, o: after.append(m))
        with pytest.raises(PinError, match=match):
            model(x)
    assert model not in after  # that forward never returned


def test_positions_outside_the_output_refused_at_the_first_forward():
    x = torch.randn(2, 1, 6, 6)
    _refused_at_first_forward(SmallCNN(), [NeuronPin("conv1", channels=[8])], x, "channels \\[8\\] are outside")
    _refused_at_first_forward(SmallCNN(), [NeuronPin("conv1", indices=[(0, 6, 0)])], x, "outside its per-sample")
    _refused_at_first_forward(SmallCNN(), [NeuronPin("conv1", indices=[(0, 1)])], x, "indices have 2 coordinates")
    _refused_at_first_forward(SmallCNN(), [NeuronPin("head", channels=[0], axis=2)], x, "not a channel axis")


def test_non_floating_output_and_wide_masks_refused():
    class Classes(nn.Module):
        def forward(self, x):
            return x.argmax(1)

    class Half(nn.Module):
        def forward(self, x):
            return x.to(torch.bfloat16)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.classes, self.narrow = Classes(), Half()

        def forward(self, x):
            return self.classes(self.fc(x)), self.narrow(self.fc(x))

    x = torch.randn(2, 4)
    _refused_at_first_forward(Net(), [NeuronPin("classes")], x, "not a floating-point tensor")
    _refused_at_first_forward(Net(), [NeuronPin("narrow", stuck_at_one=0x10000)], x, "wider than its output's")


def test_two_neuron_pins_disagreeing_on_a_position_refused():
    x = torch.randn(2, 1, 6, 6)
    pins = [NeuronPin("conv1", channels=[1, 2], value=0.0), NeuronPin("conv1", channels=[2, 5], value=1.0)]
    _refused_at_first_forward(SmallCNN(), pins, x, "disagree on output position")
    pins = [NeuronPin("conv1", channels=[1], value=0.0), NeuronPin("conv1", indices=[(1, 0, 0)], stuck_at_one=1)]
    _refused_at_first_forward(SmallCNN(), pins, x, "disagree")
    # A later window overlapping an endless one disagrees too.
    pins = [NeuronPin("conv1", channels=[1, 2], value=0.0), NeuronPin("conv1", channels=[1], value=3.0, start_step=5)]
    _refused_at_first_forward(SmallCNN(), pins, x, "disagree")
    # The same value on a shared channel, or disjoint step windows, are fine.
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pin(model, opt, [NeuronPin("conv1", channels=[1, 2], value=0.0), NeuronPin("conv1", channels=[2, 5])]):
        assert torch.equal(model.conv1(x)[:, [1, 2, 5]], torch.zeros(2, 3, 6, 6))
    apart = [NeuronPin("conv1", channels=[1], value=0.0, stop_step=5), NeuronPin("conv1", channels=[1], value=3.0,
                                                                               start_step=5)]
    with pin(model, opt, apart):
        assert torch.equal(model.conv1(x)[:, 1], torch.zeros(2, 6, 6))


# ------------------------------------------------------------------------------------------------
# The Lightning door


class LitCNN(L.LightningModule):
    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        self.net = SmallCNN()
        self.optimizer = optimizer

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", nn.functional.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return OPTIMIZERS[self.optimizer](self.parameters())


class HookAfterPins(L.Callback):
    """Registers a forward hook on net.conv1 at train start (after PinCallback's fit start)."""

    def __init__(self) -> None:
        self.outputs: list[tuple[bool, torch.Tensor]] = []

    def on_train_start(self, trainer, pl_module):
        self.handle = pl_module.net.conv1.register_forward_hook(
            lambda m, a, o: self.outputs.append((m.training, o.detach().clone())))

    def on_fit_end(self, trainer, pl_module):
        self.handle.remove()


def _cnn_loader():
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 1, 6, 6, generator=g), torch.randint(0, 3, (16,), generator=g))
    return DataLoader(data, batch_size=4)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_callback_holds_neuron_pins_in_training_and_validation(optimizer, caplog):
    torch.manual_seed(0)
    model = LitCNN(optimizer)
    recorder = HookAfterPins()
    callback = PinCallback([Pin("net.head.bias", value=0.0), NeuronPin("net.conv1", channels=[3, 7], value=0.0)])
    with caplog.at_level(logging.INFO):
        trainer(max_epochs=2, callbacks=[callback, recorder], limit_val_batches=2).fit(
            model, _cnn_loader(), _cnn_loader())
    assert "net.conv1  output channels [3, 7] (axis 1)  stuck at 0.0" in caplog.text
    assert {training for training, _ in recorder.outputs} == {True, False}
    assert len([t for t, _ in recorder.outputs if t]) == 8
    for _, out in recorder.outputs:
        assert torch.equal(out[:, [3, 7]], torch.zeros_like(out[:, [3, 7]]))
    assert not model.net.conv1._forward_hooks  # the end of fit removed the pins' hook
    assert torch.equal(model.net.head.bias, torch.zeros(3))


def test_callback_step_window_in_training_and_validation_forwards():
    torch.manual_seed(0)
    model = LitCNN()
    recorder = HookAfterPins()
    # 4 batches an epoch: stuck in the forwards of steps 1..3 (after the first step, before the fourth),
    # so the validation after the first epoch (4 steps done) no longer sees it; the second epoch neither.
    callback = PinCallback([NeuronPin("net.conv1", channels=[0], value=5.0, start_step=1, stop_step=4)], verbose=False)
    trainer(max_epochs=2, callbacks=[callback, recorder], limit_val_batches=1).fit(model, _cnn_loader(), _cnn_loader())
    stuck = [(training, bool((out[:, 0] == 5.0).all())) for training, out in recorder.outputs]
    assert stuck == [(True, False), (True, True), (True, True), (True, True), (False, False),
                     (True, False), (True, False), (True, False), (True, False), (False, False)]


def test_callback_checkpoint_resume_is_bit_identical(tmp_path):
    def pins():
        return [NeuronPin("net.conv1", fraction=0.25, seed=2, value=0.5),
                NeuronPin("net.conv2", channels=[0], stuck_at_one=0x40000000), Pin("net.head.weight", fraction=0.2)]

    torch.manual_seed(0)
    whole = LitCNN()
    trainer(max_epochs=2, callbacks=[PinCallback(pins(), verbose=False)]).fit(whole, _cnn_loader())
    torch.manual_seed(0)
    first = LitCNN()
    t = trainer(max_epochs=1, callbacks=[PinCallback(pins(), verbose=False)], enable_checkpointing=True,
                default_root_dir=tmp_path)
    t.fit(first, _cnn_loader())
    path = tmp_path / "one.ckpt"
    t.save_checkpoint(path)
    state = torch.load(path, weights_only=True)["callbacks"]
    (saved,) = [s for k, s in state.items() if k.startswith("PinCallback")]
    assert saved["outputs"]["neuron"]["fingerprints"] == [p.fingerprint() for p in pins()[:2]]
    torch.manual_seed(99)
    resumed = LitCNN()
    trainer(max_epochs=2, callbacks=[PinCallback(pins(), verbose=False)]).fit(resumed, _cnn_loader(), ckpt_path=path)
    for (name, a), (_, b) in zip(whole.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), name


def test_callback_refuses_a_pattern_matching_no_module():
    with pytest.raises(PinError, match="matches no module"):
        trainer(max_epochs=1, callbacks=[PinCallback([NeuronPin("net.conv9")])]).fit(LitCNN(), _cnn_loader())


def test_neuron_pins_from_mappings():
    callback = PinCallback([{"modules": "net.conv1", "channels": [1]}, {"params": "net.head.bias"}])
    assert [type(p).__name__ for p in callback.pins] == ["NeuronPin", "Pin"]
    with pytest.raises(PinError, match="unknown keys"):
        PinCallback([{"modules": "net.conv1", "chanels": [1]}])


# ------------------------------------------------------------------------------------------------
# torch.compile


#: The pins and batch shape of both tests below: the forward and backward graphs that inductor compiles for the
#: one serve the other (its cache), seconds of C++ compile each.
COMPILED_PINS = [NeuronPin("fc1", channels=[3], value=0.5), NeuronPin("fc2", indices=[1], stuck_at_zero=0x80000000)]
COMPILED_BATCH = 5


# With test_compiled_step.py on one xdist worker: inductor's first compile in a process (its imports, the C++
# toolchain's probing and, in a fresh clone, the vector ISA checks) is paid by one worker, not both.
@pytest.mark.xdist_group("inductor")
def test_compiled_model_keeps_the_stuck_neurons():
    torch.manual_seed(0)
    model = MLP()
    reference = MLP()
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    pins = COMPILED_PINS
    g = torch.Generator().manual_seed(3)
    with pin(compiled, opt, pins), pin(reference, ref_opt, pins):
        for _ in range(4):
            x = torch.randn(COMPILED_BATCH, 6, generator=g)
            out, ref = compiled(x), reference(x)
            assert torch.equal(out[:, 1], out[:, 1].abs())
            assert torch.allclose(out, ref, atol=1e-5)  # compiled kernels may round differently...
            assert torch.equal(torch.tanh(model.fc1(x))[:, 3], torch.full((5,), float(torch.tanh(torch.tensor(0.5)))))
            (out.sum() + ref.sum()).backward()
            assert torch.equal(model.fc1.weight.grad[3], torch.zeros(6))  # ...but no gradient reaches fc1's row 3
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()


@pytest.mark.xdist_group("inductor")
def test_compiled_after_pin_and_refusals_under_compile():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pin(model, opt, COMPILED_PINS):  # pinned first, compiled after
        compiled = torch.compile(model)
        seen = Recorder(model.fc2)
        for _ in range(3):
            compiled(torch.randn(COMPILED_BATCH, 6)).sum().backward()
            assert torch.equal(model.fc1.weight.grad[3], torch.zeros(6))
            opt.step()
            opt.zero_grad()
    assert len(seen.outputs) == 3
    bad = MLP()
    compiled = torch.compile(bad)
    with pin(compiled, torch.optim.SGD(bad.parameters(), lr=0.1), [NeuronPin("fc1", channels=[10])]):
        with pytest.raises(PinError, match="channels \\[10\\] are outside its output's 10 channels"):
            compiled(torch.randn(COMPILED_BATCH, 6))
