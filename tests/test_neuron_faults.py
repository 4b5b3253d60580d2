"""neuron_faults (seeded, nested across rates, every kind), the monitor's baseline without the stuck
neurons, and the study: ``lightning-pin faults --kind neuron`` retrained and forced-only, and the
app's ``pin=neuron_faults``."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_pin import NeuronPin, PinCallback, PinError, PinMonitor, pin
from lightning_pin.faults import neuron_faults
from lightning_pin.faults.neurons import NeuronPatch


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 20, 3)
        self.fc = nn.Linear(20 * 4 * 4, 30)
        self.out = nn.Linear(30, 3)

    def forward(self, x):
        return self.out(torch.relu(self.fc(torch.relu(self.conv(x)).flatten(1))))


def test_channels_seeded_nested_across_rates_and_per_module():
    net = Net()
    low = neuron_faults(net, ["conv", "fc"], 0.1, seed=3)
    high = neuron_faults(net, ["conv", "fc"], 0.4, seed=3)
    assert [p.modules for p in low] == ["conv", "fc"]
    assert [len(p.channels) for p in low] == [2, 3] and [len(p.channels) for p in high] == [8, 12]
    for a, b in zip(low, high):
        assert set(a.channels) <= set(b.channels)
    assert neuron_faults(Net(), ["conv", "fc"], 0.1, seed=3) == low  # another model, the same faults
    assert neuron_faults(net, ["conv", "fc"], 0.1, seed=4) != low
    assert neuron_faults(net, "conv", 0.0) == []


def test_value_faults_keep_their_values_across_rates_and_lie_in_range():
    net = Net()
    low = neuron_faults(net, "fc", 0.2, kind="value", low=-1.0, high=3.0, seed=1)[0]
    high = neuron_faults(net, "fc", 0.5, kind="value", low=-1.0, high=3.0, seed=1)[0]
    by_channel = dict(zip(high.channels, high.value))
    assert all(by_channel[c] == v for c, v in zip(low.channels, low.value))
    assert all(-1.0 <= v < 3.0 for v in high.value) and len(set(high.value)) == len(high.value)


def test_sa1_at_high_or_at_the_largest_magnitude_on_a_batch():
    net = Net()
    x = torch.randn(8, 1, 6, 6)
    assert neuron_faults(net, "conv", 0.2, kind="sa1", high=5.0)[0].value == 5.0
    (measured,) = neuron_faults(net, "conv", 0.2, kind="sa1", batch=(x, None))
    assert measured.value == float(net.conv(x).detach().abs().max())
    assert neuron_faults(net, "conv", 0.2)[0].channels == measured.channels  # the same channels either way


def test_per_neuron_positions_with_and_without_a_batch():
    net = Net()
    x = torch.randn(2, 1, 6, 6)
    (drawn,) = neuron_faults(net, "conv", 0.05, per="neuron", batch=x, seed=2)
    assert len(drawn.indices) == round(0.05 * 20 * 4 * 4) and all(len(i) == 3 for i in drawn.indices)
    (wider,) = neuron_faults(net, "conv", 0.2, per="neuron", batch=x, seed=2)
    assert set(drawn.indices) <= set(wider.indices)
    (fraction,) = neuron_faults(net, "conv", 0.05, per="neuron", seed=2)
    assert fraction.fraction == 0.05 and fraction.seed == 2
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pin(net, opt, [drawn]):
        out = net.conv(x)
    for position in drawn.indices:
        assert torch.equal(out[(slice(None), *position)], torch.zeros(2))


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"rate": 1.5}, "rate must be a number in \\[0, 1\\]"),
        ({"kind": "sa2"}, "kind must be one of"),
        ({"per": "layer"}, "per must be one of"),
        ({"low": 2.0, "high": 1.0}, "low < high"),
        ({"modules": "nope"}, "matches no module"),
        ({"per": "neuron", "kind": "value"}, "give batch="),
        ({"modules": "out", "per": "channel", "batch": None, "rate": 0.5}, None),
    ],
)
def test_neuron_faults_refusals(kwargs, says):
    args = {"modules": "conv", "rate": 0.1, **kwargs}
    if says is None:
        assert len(neuron_faults(Net(), **args)[0].channels) == 2  # out_features: no batch needed
        return
    with pytest.raises(PinError, match=says):
        neuron_faults(Net(), **args)


def test_a_module_without_channel_attributes_needs_a_batch():
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU())
    with pytest.raises(PinError, match="give batch="):
        neuron_faults(net, "1", 0.5)
    assert neuron_faults(net, "1", 0.5, batch=torch.randn(3, 4))[0].channels is not None


def test_neuron_patch_puts_the_faults_in_for_the_block_only():
    net = Net()
    x = torch.randn(3, 1, 6, 6)
    before = net(x)
    with NeuronPatch(net, neuron_faults(net, "fc", 1.0)) as patch:
        inside = net(x)
    assert torch.equal(inside, net.out(torch.zeros(3, 30)))  # every unit of fc dead: the head sees zeros
    assert torch.equal(net(x), before) and patch.units == 30 and patch.changed_bits == 0


# ------------------------------------------------------------------------------------------------
# The monitor: baseline without the stuck neurons, forced with them


def test_monitor_baseline_is_the_unfaulted_model_and_forced_has_the_faults(tmp_path):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from helpers import trainer

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            pass

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 1, 6, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    found = {}
    for faulty in (False, True):
        torch.manual_seed(0)
        model = Lit()
        pins = [NeuronPin("net.fc", value=0.0)] if faulty else [NeuronPin("net.fc", channels=[0], value=0.0,
                                                                           start_step=10**6)]
        callback = PinCallback(pins, verbose=False, monitor=PinMonitor(accuracy=True, report=False))
        trainer(max_epochs=1, limit_train_batches=1, callbacks=[callback], default_root_dir=tmp_path).fit(
            model, DataLoader(data, batch_size=16), DataLoader(data, batch_size=16))
        preservation = callback.monitor.preservation
        found[faulty] = (preservation.baseline, preservation.forced)
        expected = (model.net.out(torch.zeros(64, 30)) if faulty else None)
    assert found[True][0] == found[False][0]  # the baseline: the same model, no neuron stuck
    assert found[False][1] == found[False][0]  # nothing active: forced = baseline
    # Every fc unit dead: the forced model predicts one class (the head's bias decides) for every sample.
    labels = data.tensors[1]
    constant = expected.argmax(1)[0]
    assert found[True][1] == pytest.approx(float((labels == constant).float().mean()), abs=0)


# ------------------------------------------------------------------------------------------------
# The study and the app

TINY = ["pretrain.max_epochs=1", "trainer.max_epochs=1", "trainer.limit_train_batches=6", "data.batch_size=128",
        "callbacks.pin_callback.verbose=false", "callbacks.pin_callback.monitor.report=false"]


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def test_study_kind_neuron_retrained_and_forced_only(tmp_path):
    from lightning_pin import cli

    out = tmp_path / "study"
    assert cli.main(["faults", "--kind", "neuron", "--rates", "0,0.25", "--seeds", "1", "--out", str(out), *TINY]) == 0
    retrained = _rows(out / "fault_curve.csv")
    assert [(r["kind"], float(r["rate"])) for r in retrained] == [("neuron", 0.0), ("neuron", 0.25)]
    control, faulty = retrained
    assert control["forced"] == control["baseline"] and faulty["forced"] != faulty["baseline"]
    assert all(r["pins_exact"] == "true" and r["final"] for r in retrained)
    # The job's fault map names the stuck channels of the CNN's convolutions.
    saved = torch.load(out / "jobs" / "neuron_rate0.25_seed0" / "fault_map.pt", weights_only=True)
    assert [p["modules"] for p in saved["neuron_pins"]] == ["backbone.features.0", "backbone.features.2"]
    # A forced-only campaign in this process on the same baseline: the same forced numbers.
    ckpt = out / "baseline" / "pretrained.ckpt"
    forced = tmp_path / "forced"
    assert cli.main(["faults", "--kind", "neuron", "--rates", "0,0.25", "--seeds", "1", "--no-retrain", "--out",
                     str(forced), f"ckpt_path={ckpt}", *TINY]) == 0
    assert [r["forced"] for r in _rows(forced / "fault_curve.csv")] == [r["forced"] for r in retrained]


def test_app_pin_neuron_faults(tmp_path, capsys):
    from lightning_pin.app.compose import compose_app
    from lightning_pin.app.train import run

    cfg = compose_app([*TINY, "pin=neuron_faults", "pin.rate=0.25", "pin.stuck=sa1", "pin.high=3.0"], tmp_path / "run")
    summary = run(cfg)
    assert summary["forced"] != summary["baseline"] and summary["final"] is not None
    # The summary says what holds (the neuron pins), not "nothing pinned".
    assert summary["pinned_elements"] == 0 and summary["output_pins"] > 0
    printed = capsys.readouterr().out
    assert f"outputs   {summary['output_pins']} pin(s) on module outputs (stuck neurons)" in printed
    assert "nothing pinned" not in printed

