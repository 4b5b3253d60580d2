"""The saved pin-state format (lightning_pin.core.state): round trips, version 1, and every kind of
corruption gives a CorruptPinState naming what is wrong; a hypothesis fuzz over mutated states
loaded through the engine: each either loads or raises PinError, nothing else escapes."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pin import Pin, PinError
from lightning_pin.core.engine import PinEngine
from lightning_pin.core.plan import resolve
from lightning_pin.core.state import STATE_VERSION, CorruptPinState, PinState, find_pin_states


def _engine() -> PinEngine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    pins = [Pin("0.weight", indices=[(0, 1), (2, 3)], value=[1.5, -2.0]), Pin("1.bias"), Pin("1.weight", fraction=0.5)]
    engine = PinEngine(resolve(pins, model))
    engine.set_active(engine.ids_at(0))
    return engine


def test_round_trip_through_torch_save_with_weights_only():
    engine = _engine()
    buffer = io.BytesIO()
    torch.save(engine.state_dict(step=7), buffer)
    buffer.seek(0)
    raw = torch.load(buffer, weights_only=True)
    assert raw["version"] == STATE_VERSION and raw["step"] == 7
    state = PinState.from_dict(raw)
    assert state.step == 7 and state.active == frozenset({0, 1, 2}) and state.last_step_active is None
    assert state.checked_pins == frozenset({0, 1, 2})
    saved = state.pins[0]["0.weight"]
    assert saved.explicit and torch.equal(saved.target, torch.tensor([1.5, -2.0]))
    assert torch.equal(saved.index.long(), torch.tensor([1, 11]))
    captured = state.pins[1]["1.bias"]
    assert not captured.explicit and captured.index is None
    assert torch.equal(captured.target, engine.plan.parameters["1.bias"].detach())
    again = PinState.from_dict(state.to_dict())
    assert (again.fingerprints, again.active, again.step) == (state.fingerprints, state.active, state.step)
    assert torch.equal(again.pins[1]["1.bias"].target, captured.target)


def test_version_1_states_still_load():
    raw = _engine().state_dict()
    raw = {k: v for k, v in raw.items() if k != "step"} | {"version": 1}
    state = PinState.from_dict(raw)
    assert state.step is None and len(state.pins) == 3


def test_find_pin_states_in_a_checkpoint_a_handle_file_and_a_bare_state():
    raw = _engine().state_dict()
    lightning = {"state_dict": {}, "callbacks": {"PinCallback{'pins': ['x']}": raw, "ModelCheckpoint": {"a": 1}}}
    assert list(find_pin_states(lightning)) == ["PinCallback{'pins': ['x']}"]
    assert list(find_pin_states({"model": {}, "pins": raw})) == ["pins"]
    assert list(find_pin_states(raw)) == ["(file)"]
    assert find_pin_states({"state_dict": {}}) == {} and find_pin_states("text") == {}


CORRUPT = {
    "a list": (lambda s: [s], "it is a list, not a dict"),
    "no version": (lambda s: {k: v for k, v in s.items() if k != "version"}, "'version' is None"),
    "bool version": (lambda s: {**s, "version": True}, "'version' is True"),
    "future version": (lambda s: {**s, "version": STATE_VERSION + 1}, "newer lightning-pin"),
    "no fingerprints": (lambda s: {k: v for k, v in s.items() if k != "fingerprints"}, "'fingerprints' is missing"),
    "pins as a string": (lambda s: {**s, "pins": "abc"}, "'pins' must be a list"),
    "pin as an int": (lambda s: {**s, "pins": [5, *s["pins"][1:]]}, "pin 0 must be a dict"),
    "fewer fingerprints": (lambda s: {**s, "fingerprints": s["fingerprints"][:1]}, "1 fingerprints for 3 pins"),
    "active NaN": (lambda s: {**s, "active": [float("nan")]}, "'active' must be a list of pin ids, got list [nan]"),
    "active out of range": (lambda s: {**s, "active": [0, 9]}, "'active' names pins [9]"),
    "negative step": (lambda s: {**s, "step": -1}, "'step' is -1"),
    "monitor as a list": (lambda s: {**s, "monitor": [1]}, "'monitor' must be a dict"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_states_name_what_is_wrong(case):
    mutate, message = CORRUPT[case]
    with pytest.raises(CorruptPinState, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        PinState.from_dict(mutate(_engine().state_dict()), where="the test's state")


def test_corrupt_entries_name_the_pin_and_parameter():
    raw = _engine().state_dict()
    entry = raw["pins"][0]["0.weight"]
    cases = {
        "'target' missing": {k: v for k, v in entry.items() if k != "target"},
        "'index' must be a 1-D int32/int64 tensor": {**entry, "index": entry["index"].float()},
        "'explicit' must be True or False": {**entry, "explicit": "yes"},
        "2 indices but targets of shape \\(3,\\)": {**entry, "target": torch.zeros(3)},
        "explicit targets hold NaN": {**entry, "target": torch.tensor([float("nan"), 1.0])},
        "'target' must be a tensor or None": {**entry, "target": [1.5, -2.0]},
        "'index' holds negative positions": {**entry, "index": torch.tensor([-1, 3])},
    }
    for message, bad in cases.items():
        pins = [{"0.weight": bad}, *raw["pins"][1:]]
        with pytest.raises(CorruptPinState, match=f"pin 0, parameter '0.weight': {message}"):
            PinState.from_dict({**raw, "pins": pins})


def test_engine_strict_false_warns_and_starts_afresh_on_a_corrupt_state():
    engine = _engine()
    seen = []
    assert engine.load_state_dict({"pins": 3}, strict=False, warn=seen.append) is None
    assert len(seen) == 1 and "corrupt" in seen[0] and "starts afresh" in seen[0]
    assert engine.active == frozenset({0, 1, 2})  # untouched


# ----------------------------------------------------------------------------------------------
# Fuzz: mutate one field of a valid state at random; loading either works or raises PinError.

LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 5),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.lists(st.integers(-2, 4), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.sampled_from(
        [torch.tensor([1, 11]), torch.tensor([1.5]), torch.zeros(2, 2), torch.tensor([float("nan"), 0.0]),
         torch.tensor([0, 99]), torch.tensor([], dtype=torch.int64), torch.tensor(True)]
    ),
)


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _paths(inner, prefix + (key,))
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            yield from _paths(inner, prefix + (i,))


def _replace(value, path, new):
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _replace(value[head], rest, new)}
    copy = list(value)
    copy[head] = _replace(copy[head], rest, new)
    return copy


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_every_mutated_state_loads_or_raises_pin_error(data):
    engine = _engine()
    raw = engine.state_dict(step=3)
    paths = list(_paths(raw))
    path = data.draw(st.sampled_from(paths))
    mutated = _replace(raw, path, data.draw(LEAVES))
    fresh = _engine()
    try:
        fresh.load_state_dict(mutated, strict=True)
    except PinError:
        return
    # Loaded: every pin it activated still has a target that fits its parameter.
    for target in fresh.targets():
        assert target.values.dtype == target.parameter.dtype
    fresh.force()
    assert fresh.violations() == []
