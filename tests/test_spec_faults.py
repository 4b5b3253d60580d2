"""Pin's fault-model fields (stuck_at_zero / stuck_at_one / bounds): construction checks, from_config,
fingerprint and repr. What needs a module (dtype widths, shapes, files) is in test_projections.py."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from lightning_pin import Pin, PinError


def test_kind():
    assert Pin("w").kind == "value"
    assert Pin("w", value=1.0).kind == "value"
    assert Pin("w", stuck_at_zero=1).kind == "stuck_bits"
    assert Pin("w", stuck_at_one=[1, 2]).kind == "stuck_bits"
    assert Pin("w", bounds=(0.0, 1.0)).kind == "bounds"


def test_repr_shows_masks_in_hex():
    pin = Pin("w", indices=[(0, 1)], stuck_at_zero=0x80000000, stuck_at_one=[0x40000000])
    assert repr(pin) == "Pin(params='w', indices=[(0, 1)], stuck_at_zero=0x80000000, stuck_at_one=[0x40000000])"
    assert repr(Pin("w", bounds=(0.0, math.inf))) == "Pin(params='w', bounds=(0.0, inf))"


def test_fingerprint_unchanged_without_fault_fields():
    # Values computed by the release before the fault models: saved states and state keys keep matching.
    assert Pin("a").fingerprint() == "8835acb28ee0daae"
    assert Pin("a", value=1.0, fraction=0.5).fingerprint() == "d569f47dad92a828"


def test_fingerprint_tells_fault_fields_apart():
    prints = {
        Pin("a").fingerprint(),
        Pin("a", stuck_at_zero=1).fingerprint(),
        Pin("a", stuck_at_one=1).fingerprint(),
        Pin("a", stuck_at_zero=2).fingerprint(),
        Pin("a", bounds=(0, 1)).fingerprint(),
        Pin("a", bounds=(0, 2)).fingerprint(),
        Pin("a", stuck_at_zero=torch.tensor([1, 2])).fingerprint(),
    }
    assert len(prints) == 7
    same = Pin("a", stuck_at_zero=torch.tensor([1, 2]))
    assert same.fingerprint() == Pin("a", stuck_at_zero=torch.tensor([1, 2])).fingerprint()


def test_from_config_and_pickle():
    cfg = OmegaConf.create({"params": "fc.weight", "indices": [[0, 1], [1, 0]], "stuck_at_one": [1, 2],
                            "stuck_at_zero": 0x80000000})
    pin = Pin.from_config(cfg)
    assert pin.stuck_at_one == [1, 2] and type(pin.stuck_at_one) is list
    assert pin.stuck_at_zero == 0x80000000
    bounded = Pin.from_config(OmegaConf.create({"params": "fc.bias", "bounds": [-0.5, 0.5]}))
    assert bounded.bounds == [-0.5, 0.5] and bounded.kind == "bounds"
    again = pickle.loads(pickle.dumps(pin))
    assert again.fingerprint() == pin.fingerprint()


def test_accepted_forms():
    Pin("w", stuck_at_zero=0, stuck_at_one=0)
    Pin("w", stuck_at_zero=torch.tensor([[1, 2]]), stuck_at_one=torch.tensor([[2, 1]]) * 4)
    Pin("w", stuck_at_one=torch.tensor([-(2**31)], dtype=torch.int32))  # the int32 view of float32's sign bit
    Pin("w", stuck_at_one={"fc.weight": 4, "fc.bias": [1, 2]})
    Pin("w", stuck_at_zero="faults.pt")
    Pin("w", bounds=(0.0, math.inf))
    Pin("w", bounds=(-math.inf, 0))
    Pin("w", bounds=([0.0, 1.0], torch.tensor([2.0, 1.0])))
    Pin("w", bounds=({"fc.weight": 0.0}, {"fc.weight": 1.0}))
    Pin("w", bounds=(1.5, 1.5))


REFUSED = [
    (dict(stuck_at_zero=3, stuck_at_one=1), "overlap"),
    (dict(stuck_at_zero=[1, 2], stuck_at_one=[2, 2]), "element 1"),
    (dict(stuck_at_zero=torch.tensor([3, 1]), stuck_at_one=torch.tensor([0, 1])), "element 1"),
    (dict(stuck_at_zero=-1), "unsigned"),
    (dict(stuck_at_zero=1.0), "int bit mask"),
    (dict(stuck_at_zero=True), "int bit mask"),
    (dict(stuck_at_one=[1, 2.5]), "must hold ints"),
    (dict(stuck_at_one=[]), "empty"),
    (dict(stuck_at_zero=torch.tensor([1.0])), "integer tensors"),
    (dict(stuck_at_zero=torch.tensor([True])), "integer tensors"),
    (dict(stuck_at_zero={"w": "x.pt"}), "path"),
    (dict(stuck_at_zero=1, value=2.0), "value and stuck bits"),
    (dict(stuck_at_one=1, bounds=(0, 1)), "stuck bits and bounds"),
    (dict(bounds=(1, 0)), "low > high"),
    (dict(bounds=([0, 2], [1, 1])), "low > high at element 1"),
    (dict(bounds=(torch.tensor([0.0, 3.0]), 2.0)), "low > high at element 1"),
    (dict(bounds=(float("nan"), 1)), "NaN"),
    (dict(bounds=(0, torch.tensor([1.0, float("nan")]))), "NaN"),
    (dict(bounds=(math.inf, math.inf)), "no finite weight"),
    (dict(bounds=(-1, -math.inf)), "no finite weight"),
    (dict(bounds=(0,)), "pair"),
    (dict(bounds=0.5), "pair"),
    (dict(bounds="0,1"), "pair"),
    (dict(bounds=(None, 1)), "no low bound"),
    (dict(bounds=(True, 1)), "bool"),
    (dict(bounds=(0, 1), value=0.5), "value and bounds"),
]


@pytest.mark.parametrize(("kwargs", "match"), REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_refused(kwargs, match):
    with pytest.raises(PinError, match=match):
        Pin("w", **kwargs)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1))
def test_overlap_iff_common_bit(zero, one):
    if zero & one:
        with pytest.raises(PinError, match="overlap"):
            Pin("w", stuck_at_zero=zero, stuck_at_one=one)
    else:
        assert Pin("w", stuck_at_zero=zero, stuck_at_one=one).kind == "stuck_bits"
