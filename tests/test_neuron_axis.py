"""Stuck neurons on the feature axis (transformers too), and the trust items around them.

- ``NeuronPin(axis=None)`` sticks a module's features: axis 1 for convolutions and norms over
  channels, the last axis for linear layers, embeddings, norms over features, attention and
  Hugging Face's ``Conv1D``, at every position whatever the sequence length; a 3-D output of an
  unknown module is refused; an explicit axis wins; saved states of version 1 keep axis 1.
- stuck bits that alone make a stuck unit inf / NaN are refused (the weight pins' check).
- a glob matching a module and its descendants is refused unless the names are given.
- averaged copies (``handle.hold``, Lightning's weight averaging) have the same stuck units.
- ``pin=neuron_faults`` defaults to the model's conv and linear layers; its errors come before pretraining.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, TensorDataset

from helpers import trainer
from lightning_pin import NeuronPin, PinCallback, PinError, pin
from lightning_pin.core.kinds.neuron import feature_axis, module_feature_axis
from lightning_pin.faults import neuron_faults


class Recorder:
    """A forward hook registered after the pins: what every later module sees."""

    def __init__(self, module: nn.Module) -> None:
        self.outputs: list[torch.Tensor] = []
        self.handle = module.register_forward_hook(self._record)

    def _record(self, module, args, output):
        first = output[0] if isinstance(output, tuple) else output
        self.outputs.append(first.detach().clone())


class SeqModel(nn.Module):
    """(batch, seq, 4) -> Linear -> (batch, seq, 6) -> mean over seq -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(torch.relu(self.fc(x)).mean(1))


def _features_stuck(out: torch.Tensor, channels, value: float) -> bool:
    """Every position of every other axis of ``channels`` (last axis) reads ``value``, no other does."""
    stuck = out[..., list(channels)]
    free = out[..., [c for c in range(out.shape[-1]) if c not in channels]]
    return torch.equal(stuck, torch.full_like(stuck, value)) and bool((free != value).all())


# ------------------------------------------------------------------------------------------------
# The feature axis


def test_linear_over_sequences_sticks_features_at_every_position_for_any_length():
    torch.manual_seed(0)
    model = SeqModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = Recorder(model.fc)
    with pin(model, optimizer, [NeuronPin("fc", channels=[1, 4], value=0.5)]) as handle:
        for length in (3, 5, 7, 3):
            x = torch.randn(2, length, 4)
            model(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        summary = handle.outputs["neuron"].summary()
        saved = handle.state_dict()["outputs"]["neuron"]["positions"]
    assert [o.shape[1] for o in recorder.outputs] == [3, 5, 7, 3]
    assert all(_features_stuck(o, [1, 4], 0.5) for o in recorder.outputs)
    assert summary == "fc  output channels [1, 4] (axis 2, the last)  stuck at 0.5"
    assert saved[0]["axis"] == 2 and saved[0]["shape"] == [1, 1, 6]


class LitSeq(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = SeqModel()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class _VaryingLength(torch.utils.data.Dataset):
    """Batches of sequence lengths 3, 5, 7 in turn (one batch per item)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.items = [(torch.randn(4, n, 4, generator=g), torch.randint(0, 2, (4,), generator=g)) for n in (3, 5, 7)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def test_callback_sticks_features_at_every_position_for_any_length():
    torch.manual_seed(0)
    model = LitSeq()
    recorder = Recorder(model.net.fc)
    loader = DataLoader(_VaryingLength(), batch_size=None)
    callback = PinCallback([NeuronPin("net.fc", channels=[0, 5], value=-1.0)])
    trainer(max_epochs=2, callbacks=[callback], limit_val_batches=3).fit(model, loader, loader)
    lengths = [o.shape[1] for o in recorder.outputs]
    assert {3, 5, 7} <= set(lengths) and len(lengths) == 14  # 2 sanity + 2 epochs x (3 training + 3 validation)
    assert all(_features_stuck(o, [0, 5], -1.0) for o in recorder.outputs)


class Unknown3D(nn.Module):
    def forward(self, x):
        return x * 2.0


def test_a_3d_output_of_an_unknown_module_is_refused_naming_it_and_the_axes():
    model = nn.Sequential(Unknown3D())
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    with pin(model, optimizer, [NeuronPin("0", channels=[1])]):
        with pytest.raises(PinError, match=r"'0' \(Unknown3D\).*shape \(2, 3, 4\).*axis=1.*axis=-1"):
            model(torch.ones(2, 3, 4))
    x = torch.ones(2, 3, 4)
    with pin(model, optimizer, [NeuronPin("0", channels=[1], axis=-1)]):  # an explicit axis wins
        out = model(x)
    assert torch.equal(out[..., 1], torch.zeros(2, 3)) and torch.equal(out[..., [0, 2, 3]], torch.full((2, 3, 3), 2.0))
    with pin(model, optimizer, [NeuronPin("0", channels=[1], axis=1)]):
        out = model(x)
    assert torch.equal(out[:, 1], torch.zeros(2, 4)) and torch.equal(out[:, [0, 2]], torch.full((2, 2, 4), 2.0))
    # 2-D, 4-D and 5-D outputs of an unknown module: axis 1.
    for shape in ((2, 3), (2, 3, 2, 2), (2, 3, 2, 2, 2)):
        with pin(model, optimizer, [NeuronPin("0", channels=[1])]):
            out = model(torch.ones(shape))
        assert torch.equal(out[:, 1], torch.zeros_like(out[:, 1])) and bool((out[:, 0] == 2.0).all())


def test_an_explicit_axis_wins_over_the_feature_axis():
    model = SeqModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pin(model, optimizer, [NeuronPin("fc", channels=[2], axis=1)]):
        out = model.fc(torch.randn(2, 5, 4))
    assert torch.equal(out[:, 2], torch.zeros(2, 6)) and bool((out[:, [0, 1, 3, 4]] != 0).all())


def _hf_conv1d_class():
    """A class named like Hugging Face's Conv1D, in a module named like it: told apart without transformers."""
    kind = type("Conv1D", (nn.Module,), {"forward": lambda self, x: x})
    kind.__module__ = "transformers.pytorch_utils"
    return kind


AXES = [
    (nn.Conv1d(2, 5, 1), (3, 5, 7), 1), (nn.Conv2d(2, 5, 1), (3, 5, 4, 4), 1), (nn.Conv3d(2, 5, 1), (3, 5, 2, 2, 2), 1),
    (nn.ConvTranspose1d(2, 5, 1), (3, 5, 7), 1), (nn.BatchNorm1d(5), (3, 5, 7), 1),
    (nn.InstanceNorm1d(5), (3, 5, 7), 1),
    (nn.GroupNorm(1, 5), (3, 5, 7), 1), (nn.Linear(2, 5), (3, 7, 5), 2), (nn.Bilinear(2, 2, 5), (3, 7, 5), 2),
    (nn.Embedding(9, 5), (3, 7, 5), 2), (nn.LayerNorm(5), (3, 7, 5), 2), (nn.RMSNorm(5), (3, 7, 5), 2),
    (nn.MultiheadAttention(4, 2, batch_first=True), (3, 7, 4), 2),
    (nn.TransformerEncoderLayer(4, 2, 8, batch_first=True), (3, 7, 4), 2),
    (nn.TransformerDecoderLayer(4, 2, 8, batch_first=True), (3, 7, 4), 2), (_hf_conv1d_class()(), (3, 7, 5), 2),
    (nn.Linear(2, 5), (3, 5), 1), (nn.Conv1d(2, 5, 1), (3, 5), 1), (nn.Linear(2, 5), (3, 7, 2, 5), 3),
]


@pytest.mark.parametrize(
    ("module", "shape", "axis"), AXES, ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else None
)
def test_feature_axis_of_each_module_type(module, shape, axis):
    assert feature_axis(module, "m", shape) == axis


def test_feature_axis_of_the_real_hf_conv1d():
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    assert module_feature_axis(Conv1D(5, 2)) == -1 and feature_axis(Conv1D(5, 2), "c", (3, 7, 5)) == 2


class Wrap(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.m = module

    def forward(self, x):
        return self.m(x)


@pytest.mark.parametrize("module", [
    nn.Conv2d(2, 5, 3), nn.ConvTranspose2d(2, 5, 3), nn.BatchNorm2d(5), nn.GroupNorm(1, 5), nn.Linear(3, 5),
    nn.Embedding(9, 5), nn.LayerNorm(5), nn.MultiheadAttention(5, 1, batch_first=True),
    nn.TransformerEncoderLayer(5, 1, 8, batch_first=True),
], ids=lambda m: type(m).__name__)
def test_neuron_faults_counts_channels_on_the_feature_axis_without_a_batch(module):
    inputs = {nn.Embedding: torch.randint(0, 9, (2, 7))}.get(type(module))
    if inputs is None:
        inputs = torch.randn(2, 2, 6, 6) if isinstance(module, nn.modules.conv._ConvNd) else torch.randn(2, 7, 5)
        inputs = torch.randn(2, 5, 6, 6) if isinstance(module, (nn.BatchNorm2d, nn.GroupNorm)) else inputs
        inputs = torch.randn(2, 7, 3) if isinstance(module, nn.Linear) else inputs
    holder = Wrap(module)
    drawn = neuron_faults(holder, "m", 1.0)  # every channel: as many as the module has features
    args = (inputs, inputs, inputs) if isinstance(module, nn.MultiheadAttention) else (inputs,)
    with torch.no_grad():
        out = module(*args)
    out = out[0] if isinstance(out, tuple) else out
    axis = feature_axis(module, "m", tuple(out.shape))
    assert list(drawn[0].channels) == list(range(out.shape[axis]))
    assert drawn[0].axis == module_feature_axis(module)
    if len(args) == 1:  # the same draw, with or without a forward
        assert neuron_faults(holder, "m", 0.4, batch=inputs) == neuron_faults(holder, "m", 0.4)


def test_repr_summary_and_config_name_the_axis():
    explicit = NeuronPin("fc", channels=[1], axis=-1)
    assert repr(explicit) == "NeuronPin(modules='fc', channels=(1,), axis=-1)"
    assert NeuronPin.from_config(explicit.to_config()) == explicit
    assert repr(NeuronPin("fc", channels=[1])) == "NeuronPin(modules='fc', channels=(1,))"
    model = nn.Sequential(nn.Conv1d(2, 3, 1), Unknown3D())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pin(model, optimizer, [NeuronPin("0", channels=[1]), NeuronPin("1", channels=[1], axis=1)]) as handle:
        before = handle.outputs["neuron"].summary()
        model(torch.randn(2, 2, 5))
        after = handle.outputs["neuron"].summary()
    assert before == "0  output channels [1] (axis 1)  stuck at 0.0\n1  output channels [1] (axis 1)  stuck at 0.0"
    assert after == before


# ------------------------------------------------------------------------------------------------
# Saved states from before the feature axis


def _v1_state(pins, positions):
    """A neuron-pin state as version 1 saved it: fingerprints hashing axis=None as 1, no axis per position."""
    return {"version": 1, "fingerprints": [p.fingerprint(legacy=True) for p in pins], "step": 0,
            "positions": positions}


@pytest.mark.parametrize("with_positions", [True, False])
def test_a_version_1_state_keeps_axis_1(with_positions):
    pins = [NeuronPin("fc", channels=[2])]
    positions = [{"pin": 0, "module": "fc", "shape": [1, 5, 1], "flat": torch.tensor([2])}] if with_positions else []
    model = SeqModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pin(model, optimizer, pins) as handle:
        handle.outputs["neuron"].load_state_dict(_v1_state(pins, positions))
        out = model.fc(torch.randn(2, 5, 4))
        resaved = handle.state_dict()["outputs"]["neuron"]
    assert torch.equal(out[:, 2], torch.zeros(2, 6)) and bool((out[:, [0, 1, 3, 4]] != 0).all())  # axis 1: seq
    assert resaved["version"] == 2 and resaved["positions"][0]["axis"] == 1 and resaved["default_axis"] == 1
    # Saved again and loaded in a new process: still axis 1.
    model2 = SeqModel()
    with pin(model2, torch.optim.SGD(model2.parameters(), lr=0.1), pins) as handle:
        handle.outputs["neuron"].load_state_dict(resaved)
        again = model2.fc(torch.randn(2, 5, 4))
    assert torch.equal(again[:, 2], torch.zeros(2, 6))


def test_a_version_1_state_of_other_pins_is_refused():
    model = SeqModel()
    with pin(model, torch.optim.SGD(model.parameters(), lr=0.1), [NeuronPin("fc", channels=[2])]) as handle:
        with pytest.raises(PinError, match="does not match these neuron pins"):
            handle.outputs["neuron"].load_state_dict(_v1_state([NeuronPin("fc", channels=[3])], []))


def test_callback_checkpoint_of_version_1_resumes_on_axis_1(tmp_path):
    """A Lightning checkpoint whose PinCallback state holds a version-1 neuron state (as saved before)."""
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(8, 5, 4), torch.randint(0, 2, (8,))), batch_size=4)
    pins = [NeuronPin("net.fc", channels=[1])]
    first = trainer(max_epochs=1, callbacks=[PinCallback(pins)], limit_val_batches=0)
    first.fit(LitSeq(), loader)
    path = tmp_path / "old.ckpt"
    first.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    keys = [k for k, s in checkpoint["callbacks"].items() if "outputs" in s]
    assert len(keys) == 1
    # What the checkpoint held before the feature axis: its key from the old fingerprints, a version-1 state.
    state = checkpoint["callbacks"].pop(keys[0])
    state["outputs"]["neuron"] = _v1_state(pins, [])
    old_key = "PinCallback" + repr({"pins": [p.fingerprint(legacy=True) for p in pins]})
    assert old_key != keys[0]
    checkpoint["callbacks"][old_key] = state
    torch.save(checkpoint, path)
    model = LitSeq()
    recorder = Recorder(model.net.fc)
    trainer(max_epochs=2, callbacks=[PinCallback(pins)], limit_val_batches=0).fit(model, loader, ckpt_path=path)
    assert recorder.outputs and all(torch.equal(o[:, 1], torch.zeros(4, 6)) for o in recorder.outputs)


# ------------------------------------------------------------------------------------------------
# Stuck bits that alone make inf / NaN (36.2)


@pytest.mark.parametrize(("mask", "dtype"), [(0x7F800000, torch.float32), (0xFF800000, torch.float32),
                                             (0x7C00, torch.float16), (0x7F80, torch.bfloat16)])
def test_stuck_bits_making_every_unit_inf_or_nan_are_refused_as_for_weights(mask, dtype):
    model = nn.Sequential(nn.Linear(3, 4)).to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model[0].weight.detach().clone()
    with pin(model, optimizer, [NeuronPin("0", channels=[1], stuck_at_one=mask)]):
        with pytest.raises(PinError, match="sets every exponent bit.*inf or NaN"):
            model(torch.ones(2, 3, dtype=dtype))
    assert torch.equal(model[0].weight, before)
    # One exponent bit left free: accepted, and the unit reads finite values.
    with pin(model, optimizer, [NeuronPin("0", channels=[1], stuck_at_one=mask & ~(mask & -mask))]):
        assert bool(model(torch.ones(2, 3, dtype=dtype)).isfinite().all())


def test_neuron_faults_draws_only_finite_units():
    """neuron_faults draws no stuck bits: its units read 0, ``high`` or values in [low, high)."""
    net = nn.Sequential(nn.Linear(3, 64))
    for kind in ("sa0", "sa1", "value"):
        for p in neuron_faults(net, "0", 0.5, kind=kind, high=3.0):
            assert not p.stuck_bits
            values = p.value if isinstance(p.value, tuple) else (p.value,)
            assert all(torch.isfinite(torch.tensor(values)))


# ------------------------------------------------------------------------------------------------
# A glob over several levels (36.6)


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Sequential(nn.Linear(3, 4)), nn.Linear(4, 4))

    def forward(self, x):
        return self.block(x)


def test_a_glob_matching_a_module_and_its_descendants_is_refused_before_any_forward():
    model = Nested()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for pattern in ("block.*", "re:block\\.\\d+(\\.\\d+)?"):
        with pytest.raises(PinError, match=r"match 'block.0' and modules inside it \(\['block.0.0'\]\)"):
            pin(model, optimizer, [NeuronPin(pattern, channels=[1])])
        with pytest.raises(PinError, match="inside it"):
            neuron_faults(model, pattern, 0.5)
    assert not any(m._forward_hooks for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_one_level_globs_and_named_levels_are_accepted_and_the_summary_names_the_modules():
    model = Nested()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pin(model, optimizer, [NeuronPin("re:block\\.\\d+", channels=[1], value=1.0)]) as handle:
        summary = handle.outputs["neuron"].summary()
    # block.0 is a Sequential: its axis is told by its output at the first forward.
    assert summary.splitlines() == [
        "block.0  output channels [1] (feature axis: 1 for a 2-D, 4-D or 5-D output)  stuck at 1.0  (matched by "
        "'re:block\\\\.\\\\d+')",
        "block.1  output channels [1] (axis -1, the last)  stuck at 1.0  (matched by 're:block\\\\.\\\\d+')",
    ]
    recorder = Recorder(model.block[0][0])
    with pin(model, optimizer, [NeuronPin(["block.0", "block.0.0"], channels=[1], value=1.0)]) as handle:
        out = model(torch.randn(2, 3))
    assert [line.split()[0] for line in handle.outputs["neuron"].summary().splitlines()] == ["block.0", "block.0.0"]
    assert torch.equal(recorder.outputs[0][:, 1], torch.ones(2))  # both named levels hold
    assert out.shape == (2, 4)


# ------------------------------------------------------------------------------------------------
# Averaged copies (36.7)


def test_hold_gives_the_averaged_model_the_same_stuck_units():
    torch.manual_seed(0)
    model = SeqModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))  # copied before pin(): no hooks of ours
    recorder = Recorder(ema.module.fc)
    with pin(model, optimizer, [NeuronPin("fc", channels=[3], value=0.25)]) as handle:
        handle.hold(ema)
        for length in (3, 5):
            model(torch.randn(4, length, 4)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            ema.update_parameters(model)
            ema(torch.randn(2, length, 4))
    assert len(recorder.outputs) == 2 and all(_features_stuck(o, [3], 0.25) for o in recorder.outputs)
    ema(torch.randn(2, 3, 4))  # the handle removed: the copy's forward is its own again
    assert bool((recorder.outputs[-1][..., 3] != 0.25).all())


def test_hold_on_a_copy_taken_after_pin_sticks_once_and_lets_go_with_the_handle():
    model = SeqModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pin(model, optimizer, [NeuronPin("fc", channels=[0], stuck_at_zero=0x80000000)]) as handle:
        ema = AveragedModel(model)  # a deep copy: it carries the pins' hook, which no handle would remove
        handle.hold(ema)
        assert len(ema.module.fc._forward_hooks) == 1
        out = ema.module.fc(-torch.ones(2, 4, 4).abs() - 5)
    assert bool((out[..., 0] >= 0).all())
    assert not ema.module.fc._forward_hooks


def test_hold_refuses_a_copy_without_the_pinned_module():
    model = SeqModel()
    with pin(model, torch.optim.SGD(model.parameters(), lr=0.1), [NeuronPin("fc", channels=[0])]) as handle:
        other = AveragedModel(nn.Sequential(nn.Linear(4, 6)))
        with pytest.raises(PinError, match="lacks the module 'fc'"):
            handle.hold(other)


class AveragedRecorder(L.Callback):
    """Runs the weight-averaging callback's copy on one batch at each training epoch end."""

    def __init__(self) -> None:
        self.outputs: list[torch.Tensor] = []

    def on_train_epoch_end(self, trainer, pl_module):
        averaged = next(c for c in trainer.callbacks if hasattr(c, "_average_model"))._average_model
        seen = Recorder(averaged.module.net.fc)
        with torch.no_grad():
            averaged(torch.randn(2, 5, 4))
        seen.handle.remove()
        self.outputs += seen.outputs


def test_callback_with_lightning_weight_averaging_sticks_the_units_in_the_averaged_copy():
    from lightning.pytorch.callbacks import EMAWeightAveraging

    torch.manual_seed(0)
    loader = DataLoader(_VaryingLength(), batch_size=None)
    recorder = AveragedRecorder()
    callbacks = [PinCallback([NeuronPin("net.fc", channels=[2], value=-0.5)]), EMAWeightAveraging(decay=0.9), recorder]
    trainer(max_epochs=2, callbacks=callbacks, limit_val_batches=0).fit(LitSeq(), loader)
    assert len(recorder.outputs) == 2 and all(_features_stuck(o, [2], -0.5) for o in recorder.outputs)


# ------------------------------------------------------------------------------------------------
# Transformers


def test_tiny_bert_and_gpt2_neuron_faults_hold_exactly():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=16, num_labels=2))
    gpt2 = transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
        vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16, num_labels=2, pad_token_id=0))
    for model, pattern in ((bert, "re:bert\\.encoder\\.layer\\.0\\..*(query|dense)"),
                           (gpt2, "re:transformer\\.h\\.0\\.(attn|mlp)\\.c_.*")):
        drawn = neuron_faults(model, pattern, 0.25, kind="sa1", high=3.0, seed=2)
        assert drawn and all(p.axis == -1 for p in drawn)
        modules = dict(model.named_modules())
        recorders = {p.modules: Recorder(modules[p.modules]) for p in drawn}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with pin(model, optimizer, drawn):
            for length in (3, 5, 7):
                ids = torch.randint(1, 50, (2, length))
                model(input_ids=ids, labels=torch.tensor([0, 1])).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        for p in drawn:
            outputs = recorders[p.modules].outputs
            assert [o.shape[1] for o in outputs] == [3, 5, 7]
            width = outputs[0].shape[-1]
            assert len(p.channels) == max(1, round(0.25 * width))  # counted on the features
            assert all(_features_stuck(o, p.channels, 3.0) for o in outputs), p.modules


# ------------------------------------------------------------------------------------------------
# The app (36.9, and --kind neuron on a transformer)

ROWNET = '''
import torch
from torch import nn


class Rows(nn.Module):
    """(batch, 1, 8, 8) -> (batch, 8, 8): one token per image row (a 3-D output of no known layer type)."""

    def forward(self, x):
        return x.flatten(1, 2)


class RowNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.rows = Rows()
        self.proj = nn.Linear(8, 12)
        self.head = nn.Linear(12, 10)

    def forward(self, x):
        return self.head(torch.relu(self.proj(self.rows(x))).mean(1))
'''
APP_TINY = ["pretrain.max_epochs=1", "trainer.max_epochs=1", "trainer.limit_train_batches=3", "data.batch_size=128",
            "callbacks.pin_callback.monitor.report=false"]


@pytest.fixture
def rownet(tmp_path, monkeypatch):
    (tmp_path / "rownet_h35.py").write_text(ROWNET)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return ["model=custom", "model._target_=rownet_h35.RowNet"]


@pytest.mark.parametrize("model", ["mlp", "custom"])
def test_app_neuron_faults_default_to_the_models_conv_and_linear_layers(tmp_path, rownet, model):
    from lightning_pin.app.compose import compose_app
    from lightning_pin.app.train import run

    chosen = rownet if model == "custom" else ["model=mlp"]
    cfg = compose_app([*chosen, *APP_TINY, "pin=neuron_faults", "pin.rate=0.25"], tmp_path / "run")
    summary = run(cfg)
    saved = torch.load(tmp_path / "run" / "fault_map.pt", weights_only=True)["neuron_pins"]
    expected = {"mlp": ["backbone.layers.0", "backbone.layers.2", "backbone.head"],
                "custom": ["backbone.proj", "backbone.head"]}[model]
    assert [p["modules"] for p in saved] == expected and all(p["axis"] == -1 for p in saved)
    assert summary["output_pins"] == len(expected) and summary["final"] is not None
    # The run summary names the modules and the axis each used (a token sequence: its last).
    axes = [line.split("(", 1)[1].split(")")[0] for line in summary["output_pin_modules"]]
    assert [line.split()[0] for line in summary["output_pin_modules"]] == expected
    assert axes == {"mlp": ["axis 1"] * 3, "custom": ["axis 2, the last", "axis 1"]}[model]


def test_app_neuron_pin_errors_come_before_pretraining(tmp_path, rownet):
    from lightning_pin.app.compose import compose_app
    from lightning_pin.app.train import run

    for modules, says in (("[backbone.rows]", r"'backbone.rows' \(Rows\) has without a forward"),
                          ("[backbone.nope]", "matches no module"),
                          ("['*']", r"match 'backbone' and modules inside it")):
        out = tmp_path / modules.strip("[]'").replace("*", "star")
        cfg = compose_app([*rownet, *APP_TINY, "pin=neuron_faults", f"pin.modules={modules}"], out)
        with pytest.raises(PinError, match=says):
            run(cfg)
        assert not (out / "pretrained.ckpt").exists()  # refused before any training


def test_the_apps_probe_raises_first_forward_errors_and_changes_nothing(tmp_path, rownet):
    """What needs a forward (the feature axis, stuck bits in the output's word) is checked on one batch
    before pretraining: the model, its modules' hooks and the random state are as before."""
    from lightning_pin.app.compose import compose_app
    from lightning_pin.app.custom import build_datamodule
    from lightning_pin.app.fault_pins import probe_output_pins
    from lightning_pin.app.custom import build_model

    cfg = compose_app([*rownet, *APP_TINY], tmp_path / "run")
    model = build_model(cfg, announce=False).model
    datamodule = build_datamodule(cfg)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.get_rng_state()
    for pins, says in (([NeuronPin("backbone.rows", channels=[1])], r"'backbone.rows' \(Rows\).*axis=1.*axis=-1"),
                       ([NeuronPin("backbone.proj", channels=[1], stuck_at_one=0x7F800000)], "every exponent bit"),
                       ([NeuronPin("backbone.proj", channels=[12])], r"channels \[12\] are outside")):
        with pytest.raises(PinError, match=says):
            probe_output_pins(model, pins, datamodule)
    assert torch.equal(torch.get_rng_state(), state)  # drawing the batch did not move the random state
    assert not any(m._forward_hooks for m in model.modules()) and model.training
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    probe_output_pins(model, [NeuronPin("backbone.rows", channels=[1], axis=-1)], datamodule)  # fine: no error


def test_faults_kind_neuron_on_the_apps_tiny_transformer(tmp_path):
    """The app's transformer (model=transformer): its feed-forward Linears over (batch, tokens, features)."""
    import csv

    from lightning_pin import cli

    out = tmp_path / "study"
    params = "pin.params=re:backbone\\.encoder\\.layers\\.\\d+\\.linear\\d\\.weight"
    assert cli.main(["faults", "--kind", "neuron", "--rates", "0,0.25", "--seeds", "1", "--out", str(out),
                     "model=transformer", params, *APP_TINY]) == 0
    with open(out / "fault_curve.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert [float(r["rate"]) for r in rows] == [0.0, 0.25] and all(r["pins_exact"] == "true" for r in rows)
    saved = torch.load(out / "jobs" / "neuron_rate0.25_seed0" / "fault_map.pt", weights_only=True)["neuron_pins"]
    # linear1: 64 features (16 stuck), linear2: 32 (8 stuck), on the last axis: not the 8 tokens.
    assert [(p["modules"].rsplit(".", 1)[1], len(p["channels"]), p["axis"]) for p in saved] == [
        ("linear1", 16, -1), ("linear2", 8, -1), ("linear1", 16, -1), ("linear2", 8, -1)]
