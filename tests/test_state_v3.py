"""Pin state version 3: stuck-bit masks and bounds per selection; version 2 states still load."""

from __future__ import annotations

import io

import pytest
import torch

from lightning_pin.core.state import STATE_VERSION, CorruptPinState, PinState, SavedSelection


def _state() -> PinState:
    bits = SavedSelection(
        torch.tensor([1, 4]), None, True, "stuck_bits",
        stuck_at_zero=torch.tensor([-(2**31), 0], dtype=torch.int32),
        stuck_at_one=torch.tensor([0x40000000, 1], dtype=torch.int32),
    )
    bounds = SavedSelection(None, None, True, "bounds", low=torch.zeros(2, 3), high=torch.full((2, 3), 0.5))
    value = SavedSelection(torch.tensor([0]), torch.tensor([2.5]), True)
    return PinState(("a", "b", "c"), ({"w": bits}, {"w": bounds}, {"b": value}), frozenset({0, 1}), None, 3)


def _round_trip(raw):
    buffer = io.BytesIO()
    torch.save(raw, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_round_trip_keeps_masks_and_bounds():
    raw = _state().to_dict()
    assert raw["version"] == STATE_VERSION == 3
    again = PinState.from_dict(_round_trip(raw))
    bits, bounds, value = again.pins[0]["w"], again.pins[1]["w"], again.pins[2]["b"]
    assert bits.kind == "stuck_bits" and bits.target is None and bits.explicit
    assert torch.equal(bits.stuck_at_zero, torch.tensor([-(2**31), 0], dtype=torch.int32))
    assert torch.equal(bits.stuck_at_one, torch.tensor([0x40000000, 1], dtype=torch.int32))
    assert bounds.kind == "bounds" and torch.equal(bounds.low, torch.zeros(2, 3))
    assert torch.equal(bounds.high, torch.full((2, 3), 0.5))
    assert value.kind == "value" and torch.equal(value.target, torch.tensor([2.5]))


def test_version_2_state_reads_as_value_pins():
    raw = _state().to_dict()
    old = {**raw, "version": 2, "pins": [raw["pins"][2]]}
    old["fingerprints"], old["active"] = ["c"], [0]
    for selection in old["pins"][0].values():
        del selection["kind"]
    again = PinState.from_dict(old)
    assert again.pins[0]["b"].kind == "value" and torch.equal(again.pins[0]["b"].target, torch.tensor([2.5]))


def _edit(path, change):
    raw = _state().to_dict()
    pin, name, key = path
    change(raw["pins"][pin][name], key)
    return raw


CORRUPT = {
    "unknown kind": ((0, "w", "kind"), lambda s, k: s.__setitem__(k, "melted"), "'kind' is 'melted'"),
    "mask missing": ((0, "w", "stuck_at_one"), lambda s, k: s.pop(k), "'stuck_at_one' must be a tensor"),
    "float mask": ((0, "w", "stuck_at_one"), lambda s, k: s.__setitem__(k, torch.ones(2)), "int16/int32/int64"),
    "mask length": ((0, "w", "stuck_at_zero"), lambda s, k: s.__setitem__(k, torch.zeros(3, dtype=torch.int32)),
                    "2 indices"),
    "overlap": ((0, "w", "stuck_at_zero"), lambda s, k: s.__setitem__(k, torch.tensor([1, 1], dtype=torch.int32)),
                "stuck at zero and at one"),
    "target on bits": ((0, "w", "target"), lambda s, k: s.__setitem__(k, torch.ones(2)), "holds no target"),
    "low > high": ((1, "w", "low"), lambda s, k: s.__setitem__(k, torch.ones(2, 3)), "low > high"),
    "nan bound": ((1, "w", "high"), lambda s, k: s.__setitem__(k, torch.full((2, 3), float("nan"))), "NaN"),
    "bound dtypes": ((1, "w", "high"), lambda s, k: s.__setitem__(k, torch.ones(2, 3, dtype=torch.float64)),
                     "one dtype"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_v3_entries(case):
    path, change, match = CORRUPT[case]
    with pytest.raises(CorruptPinState, match=match):
        PinState.from_dict(_edit(path, change))
