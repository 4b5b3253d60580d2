"""NeuronPin on Pin's spec rules (lightning_pin.core.rules): the same start_step default and step
window, the same refusals of fraction / seed / steps in the same words, the same seeded draw, and
what was saved before keeps its meaning (fingerprints, positions, pickles, version-2 states)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pin import NeuronPin, Pin, PinError, pin
from lightning_pin.core.kinds.neuron import fraction_positions
from lightning_pin.core.plan import fraction_indices
from lightning_pin.core.rules import fraction_count, in_window, seeded_generator, smallest_keys, windows_overlap
from lightning_pin.faults import neuron_faults


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(4, 256)
        self.fc2 = torch.nn.Linear(256, 3)

    def forward(self, x):
        return self.fc2(self.fc1(x))


# ------------------------------------------------------------------------------------------------
# The step window


def test_start_step_default_and_window_are_pins():
    assert NeuronPin("fc1").start_step == Pin("fc1.weight").start_step == 0
    assert NeuronPin("fc1", start_step=None).start_step == 0  # what older configs say: the default
    for start, stop in [(0, None), (2, None), (0, 3), (2, 5)]:
        weight = Pin("fc1.weight", start_step=start, stop_step=stop)
        neuron = NeuronPin("fc1", start_step=start, stop_step=stop)
        for step in range(8):
            expected = start <= step and (stop is None or step < stop)
            assert neuron.in_window(step) == in_window(weight, step) == expected
    early, late = NeuronPin("fc1", stop_step=3), NeuronPin("fc1", start_step=3)
    assert not windows_overlap(early, late) and windows_overlap(early, NeuronPin("fc1", start_step=2))


def _words(make, **fields) -> str:
    """The message of the PinError ``make(**fields)`` raises, without the spec's repr in front."""
    with pytest.raises(PinError) as caught:
        make(**fields)
    spec, sep, words = str(caught.value).partition("): ")
    assert sep and spec.startswith(("Pin(params='fc1.weight'", "NeuronPin(modules='fc1'"))
    return words


@pytest.mark.parametrize("fields", [
    dict(fraction=0.0), dict(fraction=1.5), dict(fraction=True), dict(fraction="0.5"), dict(fraction=float("nan")),
    dict(seed=1.5), dict(seed="1"), dict(seed=True),
    dict(start_step=-1), dict(start_step=1.0), dict(start_step="2"),
    dict(stop_step=0), dict(start_step=5, stop_step=2), dict(start_step=3, stop_step=3), dict(stop_step="10"),
], ids=repr)
def test_bad_fraction_seed_and_steps_are_refused_in_pins_words(fields):
    words = _words(lambda **f: Pin("fc1.weight", **f), **fields)
    assert _words(lambda **f: NeuronPin("fc1", **f), **fields) == words
    field = "stop_step" if "stop_step" in fields else next(iter(fields))
    assert words.startswith(f"{field} must be")


def test_bad_masks_and_values_are_refused_in_pins_words():
    for fields in (dict(stuck_at_zero=-4), dict(stuck_at_zero=3, stuck_at_one=1), dict(value=float("inf")),
                   dict(value=True), dict(value=complex(1, 1))):
        words = _words(lambda **f: Pin("fc1.weight", **f), **fields)
        assert _words(lambda **f: NeuronPin("fc1", **f), **fields) == words, fields
    # Forms only a Pin takes (a path, None) stay refused for a NeuronPin, in its own words.
    with pytest.raises(PinError, match="value must be a finite number or a non-empty list of them, got 'w.pt'"):
        NeuronPin("fc1", value="w.pt")
    with pytest.raises(PinError, match="stuck_at_one must be an int bit mask"):
        NeuronPin("fc1", stuck_at_one=[1, 2])


def test_from_config_shares_pins_reading():
    assert NeuronPin.from_config({"_target_": "x", "modules": "fc1", "start_step": 2}) == NeuronPin("fc1", start_step=2)
    with pytest.raises(PinError, match="a neuron pin must be a NeuronPin or a mapping with the keys of NeuronPin"):
        NeuronPin.from_config(5)  # an AttributeError before
    with pytest.raises(PinError, match=r"has unknown keys \['params'\]; the keys of a NeuronPin are"):
        NeuronPin.from_config({"modules": "fc1", "params": "x"})
    with pytest.raises(PinError, match="a pin must be a Pin or a mapping with the keys of Pin, got int"):
        Pin.from_config(5)


def test_numpy_numbers_are_taken_as_pins_are_and_hash_as_pythons():
    given_np = NeuronPin("fc1", channels=[np.int64(1)], seed=np.int64(2), start_step=np.int64(3), value=np.float32(0.5))
    plain = NeuronPin("fc1", channels=[1], seed=2, start_step=3, value=0.5)
    assert given_np == plain and given_np.fingerprint() == plain.fingerprint() and repr(given_np) == repr(plain)
    assert Pin("fc1.weight", seed=np.int64(2)).seed == 2  # Pin took them already


# ------------------------------------------------------------------------------------------------
# The seeded draw


@settings(max_examples=60, deadline=None)
@given(numel=st.integers(1, 3000), fraction=st.floats(0.001, 1.0), seed=st.integers(0, 2**40), name=st.sampled_from(
    ["fc1", "layer1.0.conv1", "0"]))
def test_fraction_is_pins_keyed_draw(numel, fraction, seed, name):
    positions = fraction_positions(name, numel, fraction, seed)
    count = fraction_count(fraction, numel)
    assert positions.numel() == count == max(1, round(fraction * numel))
    assert torch.equal(positions, smallest_keys(numel, count, seeded_generator(name, seed)))
    if count > numel // 8:  # where a Pin draws by keys too: the same elements for the same name, seed and count
        assert torch.equal(positions, fraction_indices(name, numel, fraction, seed))
    larger = fraction_positions(name, numel, min(1.0, fraction * 2), seed)
    assert bool(torch.isin(positions, larger).all())  # nested, at every count (a Pin's sparse draw is not)


def test_resolved_fraction_is_the_shared_draw():
    model = MLP()
    with pin(model, torch.optim.SGD(model.parameters(), lr=0.0), NeuronPin("fc1", fraction=0.5, seed=3)) as handle:
        out = model.fc1(torch.ones(2, 4))
        (saved,) = handle.state_dict()["outputs"]["neuron"]["positions"]
    expected = fraction_indices("fc1", 256, 0.5, 3)  # what a Pin with this name, seed and fraction selects
    assert torch.equal(saved["flat"], expected)
    assert torch.equal(out[:, expected], torch.zeros(2, 128)) and int((out == 0).sum()) == 256


# ------------------------------------------------------------------------------------------------
# What was saved before: written by the code before the shared rules (commit cffaaed)

#: Fingerprints before (and legacy=True, before the feature axis): checkpoint keys and pin states hold them.
_FINGERPRINTS = [
    (dict(), "4969036090fe5fbc", "8fa81ec6934d8d74"),
    (dict(start_step=0), "3acf4a15dc36de50", "76299afb0a01479b"),
    (dict(start_step=2, stop_step=5), "6f2993584bdecb24", "8949513ecc163944"),
    (dict(fraction=0.05, seed=3), "2b68fe77ed7167c6", "60a3f3c0920e2af3"),
    (dict(channels=[1, 2], value=0.5, stop_step=4), "00300675b86b9be0", "17d2d20885015327"),
]


@pytest.mark.parametrize(("fields", "digest", "legacy"), _FINGERPRINTS, ids=lambda v: repr(v) if isinstance(v, dict)
                         else None)
def test_fingerprints_are_what_they_were(fields, digest, legacy):
    neuron = NeuronPin("fc1", **fields)
    assert (neuron.fingerprint(), neuron.fingerprint(legacy=True)) == (digest, legacy)
    assert NeuronPin.from_config(neuron.to_config()).fingerprint() == digest


def test_fraction_positions_and_neuron_faults_are_what_they_were():
    expected = [1, 8, 20, 56, 62, 107, 119, 147, 191, 201, 206, 215, 229]
    assert fraction_positions("fc1", 256, 0.05, 3).tolist() == expected
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
    (drawn,) = neuron_faults(net, "2", 0.1, per="neuron", kind="value", batch=torch.zeros(1, 1, 6, 6), seed=4)
    assert drawn.indices == ((2, 0, 1), (2, 1, 0)) and drawn.value == (1.1154800213269347, 0.6953184044008265)
    (drawn,) = neuron_faults(net, "0", 0.5, kind="value", seed=4)
    assert drawn.channels == (0, 2, 4, 5)
    assert drawn.value == (-0.12528717406514733, 0.1825280446845996, -1.9373904150924588, 1.876083342829078)


@pytest.mark.parametrize("with_positions", [True, False])
def test_a_version_2_state_saved_before_loads_and_means_the_same(with_positions):
    pins = [NeuronPin("fc1", fraction=0.05, seed=3, start_step=0), NeuronPin("fc2", indices=[2], value=1.5)]
    flat = [1, 8, 20, 56, 62, 107, 119, 147, 191, 201, 206, 215, 229]
    positions = [{"pin": 0, "module": "fc1", "shape": [1, 256], "flat": torch.tensor(flat), "axis": None},
                 {"pin": 1, "module": "fc2", "shape": [1, 3], "flat": torch.tensor([2]), "axis": None}]
    state = {"version": 2, "fingerprints": ["4019a7d791eb8934", "5b567253fe89575f"], "default_axis": None, "step": 0,
             "positions": positions if with_positions else []}
    model = MLP()
    with pin(model, torch.optim.SGD(model.parameters(), lr=0.0), pins) as handle:
        handle.outputs["neuron"].load_state_dict(state)
        hidden, out = model.fc1(torch.ones(2, 4)), model(torch.ones(2, 4))
        resaved = handle.state_dict()["outputs"]["neuron"]
    assert torch.equal(hidden[:, flat], torch.zeros(2, 13)) and int((hidden == 0).sum()) == 26
    assert torch.equal(out[:, 2], torch.full((2,), 1.5))
    assert resaved["fingerprints"] == state["fingerprints"]
    assert [p["flat"].tolist() for p in resaved["positions"]] == [flat, [2]]


def test_a_neuron_pin_pickled_before_unpickles_with_the_default_start():
    # pickle.dumps(NeuronPin("fc1", channels=[1])) before: start_step=None in its state.
    old = (b'\x80\x04\x95\xe5\x00\x00\x00\x00\x00\x00\x00\x8c\x1flightning_pin.core.kinds.neuron\x94\x8c\tNeuronPin'
           b'\x94\x93\x94)\x81\x94}\x94(\x8c\x07modules\x94\x8c\x03fc1\x94\x8c\x08channels\x94K\x01\x85\x94\x8c\x07'
           b'indices\x94N\x8c\x08fraction\x94N\x8c\x04seed\x94K\x00\x8c\x04axis\x94N\x8c\x05value\x94h\x00\x8c\r'
           b'_DefaultValue\x94\x93\x94G\x00\x00\x00\x00\x00\x00\x00\x00\x85\x94\x81\x94\x8c\rstuck_at_zero\x94N\x8c'
           b'\x0cstuck_at_one\x94N\x8c\nstart_step\x94N\x8c\tstop_step\x94Nub.')
    loaded = pickle.loads(old)
    assert loaded.start_step == 0 and loaded.in_window(0) and loaded == NeuronPin("fc1", channels=[1])
    assert loaded.fingerprint() == NeuronPin("fc1", channels=[1]).fingerprint()
    assert pickle.loads(pickle.dumps(loaded)).fingerprint() == loaded.fingerprint()


def test_an_explicit_start_step_0_shows_in_repr_and_config_but_not_in_the_summary():
    explicit = NeuronPin("fc1", start_step=0)
    assert repr(explicit) == "NeuronPin(modules='fc1', start_step=0)"
    assert repr(NeuronPin("fc1")) == "NeuronPin(modules='fc1')"
    assert explicit.to_config() == {"modules": "fc1", "start_step": 0}
    assert NeuronPin("fc1").to_config() == {"modules": "fc1"}
    assert explicit.describe() == NeuronPin("fc1").describe() == "whole output  stuck at 0.0"  # as a Pin's summary
    assert NeuronPin("fc1", start_step=2).describe().endswith("steps [2, end)")
