"""Unit tests for lightning_pin.core.spec: Pin construction, from_config, repr, fingerprint, pickling."""

from __future__ import annotations

import operator
import os
import pickle
import subprocess
import sys

import pytest
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn

from lightning_pin import Pin, PinCallback, PinError
from lightning_pin.core.plan import resolve, resolve_when


def module_when(batch, batch_idx):
    """A module-level `when` (picklable, importable as tests' `test_spec.module_when`)."""
    return batch_idx % 2 == 0


def other_when(batch, batch_idx):
    return batch_idx % 2 == 1


def small_module() -> nn.Module:
    m = nn.Module()
    m.fc = nn.Linear(4, 3)
    return m


# ----------------------------------------------------------------------------------------------
# Construction


def test_defaults():
    pin = Pin("fc.weight")
    assert pin.params == "fc.weight"
    assert pin.indices is None and pin.mask is None and pin.fraction is None
    assert pin.seed == 0
    assert pin.value is None
    assert pin.start_step == 0 and pin.stop_step is None
    assert pin.when is None
    assert pin.patterns == ("fc.weight",)


def test_all_fields_kept():
    mask = torch.eye(3, 4, dtype=torch.bool)
    pin = Pin(["a", "b"], mask=mask, seed=3, value=1.5, start_step=2, stop_step=9, when=module_when)
    assert pin.params == ["a", "b"]
    assert pin.patterns == ("a", "b")
    assert pin.mask is mask  # tensors are kept as they are
    assert (pin.seed, pin.value, pin.start_step, pin.stop_step) == (3, 1.5, 2, 9)
    assert pin.when is module_when


def test_pin_is_frozen():
    pin = Pin("fc.weight")
    with pytest.raises(AttributeError):
        pin.value = 3.0  # type: ignore[misc]


def test_tuple_params_and_indices_preserved():
    pin = Pin(("a", "b"), indices=[(0, 1), (2, 3)])
    assert pin.patterns == ("a", "b")
    assert pin.indices == [(0, 1), (2, 3)]
    assert isinstance(pin.indices[0], tuple)


def test_construction_does_not_validate_against_a_model():
    # What depends on a model (names, ranks, shapes) is only checked by resolve() (test_errors.py).
    pin = Pin("nothing.matches", indices=[(0, 9, 9, 9)], value=[1e39])
    assert pin.indices == [(0, 9, 9, 9)] and pin.value == [1e39]
    with pytest.raises(PinError, match="'nothing.matches' matches no parameter"):
        resolve([pin], small_module())


def test_construction_rejects_what_needs_no_model():
    # Bad combinations are rejected when the Pin is built (test_errors.py has every case).
    with pytest.raises(PinError, match=r"give at most one of indices / mask / fraction, got indices and fraction"):
        Pin("nothing.matches", indices=[(0,)], fraction=0.5)


# ----------------------------------------------------------------------------------------------
# from_config


def test_from_config_dict():
    pin = Pin.from_config({"params": "fc.weight", "indices": [[0, 1]], "value": 2.0, "start_step": 3})
    assert isinstance(pin, Pin)
    assert pin.params == "fc.weight"
    assert pin.indices == [[0, 1]]
    assert pin.value == 2.0
    assert pin.start_step == 3
    assert pin.stop_step is None


def test_from_config_returns_pin_unchanged():
    pin = Pin("fc.weight")
    assert Pin.from_config(pin) is pin


def test_from_config_ignores_hydra_target_key():
    pin = Pin.from_config({"_target_": "lightning_pin.Pin", "params": "fc.bias", "value": 0.0})
    assert pin.params == "fc.bias" and pin.value == 0.0


def test_from_config_dictconfig_with_nested_lists_becomes_plain():
    cfg = OmegaConf.create(
        {
            "params": ["fc.weight", "re:fc\\.b.*"],
            "indices": [[0, 1], [2, 3]],
            "value": [1.0, 2.0],
            "seed": 7,
            "start_step": 1,
            "stop_step": 5,
            "when": "operator.eq",
        }
    )
    assert isinstance(cfg, DictConfig) and isinstance(cfg.indices, ListConfig)
    pin = Pin.from_config(cfg)
    assert type(pin.params) is list and pin.params == ["fc.weight", "re:fc\\.b.*"]
    assert type(pin.indices) is list
    assert all(type(row) is list for row in pin.indices)
    assert pin.indices == [[0, 1], [2, 3]]
    assert type(pin.value) is list and pin.value == [1.0, 2.0]
    assert (pin.seed, pin.start_step, pin.stop_step, pin.when) == (7, 1, 5, "operator.eq")
    # Nothing of OmegaConf survives anywhere inside the pin.
    for name in ("params", "indices", "value"):
        assert "omegaconf" not in repr(type(getattr(pin, name)))


def test_from_config_dictconfig_resolves_like_the_dict():
    cfg = OmegaConf.create({"params": "fc.weight", "indices": [[0, 1], [2, 3]], "value": [1.0, 2.0]})
    from_cfg = Pin.from_config(cfg)
    from_dict = Pin.from_config({"params": "fc.weight", "indices": [[0, 1], [2, 3]], "value": [1.0, 2.0]})
    assert from_cfg.fingerprint() == from_dict.fingerprint()
    m = small_module()
    sel = resolve([from_cfg], m).pins[0].selections["fc.weight"]
    assert torch.equal(sel.index, torch.tensor([1, 11]))
    assert torch.equal(sel.values, torch.tensor([1.0, 2.0]))


def test_from_config_dictconfig_value_dict_by_name():
    cfg = OmegaConf.create({"params": "fc.*", "value": {"fc.weight": 1.0, "fc.bias": [4.0, 5.0, 6.0]}})
    pin = Pin.from_config(cfg)
    assert type(pin.value) is dict
    assert pin.value == {"fc.weight": 1.0, "fc.bias": [4.0, 5.0, 6.0]}
    assert type(pin.value["fc.bias"]) is list


def test_from_config_interpolation_is_resolved():
    cfg = OmegaConf.create({"v": 3.5, "pin": {"params": "fc.bias", "value": "${v}"}})
    pin = Pin.from_config(cfg.pin)
    assert pin.value == 3.5


def test_pin_constructed_directly_from_omegaconf_containers():
    params = OmegaConf.create(["fc.weight"])
    indices = OmegaConf.create([[0, 0], [1, 1]])
    pin = Pin(params, indices=indices)
    assert type(pin.params) is list and type(pin.indices) is list and pin.indices == [[0, 0], [1, 1]]


def test_pin_callback_accepts_listconfig_of_dictconfigs():
    cfg = OmegaConf.create([{"params": "fc.weight", "value": 0.0}, {"params": "fc.bias", "indices": [[1]]}])
    cb = PinCallback(cfg, verbose=False)
    assert [type(p) for p in cb.pins] == [Pin, Pin]
    assert cb.pins[0].value == 0.0
    assert cb.pins[1].indices == [[1]]


def test_pin_callback_accepts_single_mapping():
    cb = PinCallback({"params": "fc.weight"}, verbose=False)
    assert len(cb.pins) == 1 and cb.pins[0].params == "fc.weight"


@pytest.mark.parametrize(
    "config",
    [
        {"params": "fc.weight", "valeu": 1.0},
        OmegaConf.create({"params": "fc.weight", "start": 3}),
    ],
    ids=["dict", "dictconfig"],
)
def test_from_config_unknown_keys(config):
    bad = "valeu" if "valeu" in config else "start"
    with pytest.raises(PinError) as info:
        Pin.from_config(config)
    message = str(info.value)
    assert "unknown keys" in message
    assert repr(bad) in message
    assert "start_step" in message  # lists the keys a Pin has


@pytest.mark.parametrize(
    "config", [{"value": 1.0}, OmegaConf.create({"indices": [[0, 1]]}), {}], ids=["dict", "dictconfig", "empty"]
)
def test_from_config_missing_params(config):
    with pytest.raises(PinError, match="has no 'params'") as info:
        Pin.from_config(config)
    assert "fc.weight" in str(info.value)  # shows an example of what would be right


@pytest.mark.parametrize("config", [["fc.weight"], "fc.weight", 3])
def test_from_config_not_a_mapping(config):
    with pytest.raises(PinError, match="must be a Pin or a mapping"):
        Pin.from_config(config)


def test_pin_callback_rejects_bad_mapping_at_construction():
    with pytest.raises(PinError, match="unknown keys"):
        PinCallback([{"params": "fc.weight", "fractoin": 0.1}])


# ----------------------------------------------------------------------------------------------
# repr


def test_repr_shows_only_non_defaults():
    assert repr(Pin("encoder.*")) == "Pin(params='encoder.*')"
    assert (
        repr(Pin("conv1.weight", indices=[(0, 0, 1, 1)], value=25.0))
        == "Pin(params='conv1.weight', indices=[(0, 0, 1, 1)], value=25.0)"
    )
    assert (
        repr(Pin(["fc1.weight", "fc2.weight"], fraction=0.05, seed=1, value=0.0))
        == "Pin(params=['fc1.weight', 'fc2.weight'], fraction=0.05, seed=1, value=0.0)"
    )
    # Non-default step windows are shown.
    assert "start_step=4" in repr(Pin("x", start_step=4))
    assert "stop_step=9" in repr(Pin("x", stop_step=9))


def test_repr_short_for_big_tensors():
    pin = Pin("w", mask=torch.ones(1000, 1000, dtype=torch.bool), value=torch.zeros(1000, 1000))
    text = repr(pin)
    assert "mask=tensor(shape=(1000, 1000), dtype=torch.bool)" in text
    assert "value=tensor(shape=(1000, 1000), dtype=torch.float32)" in text
    assert len(text) < 200


def test_repr_small_tensor_shows_values():
    assert "indices=tensor([[0, 1], [2, 3]])" in repr(Pin("w", indices=torch.tensor([[0, 1], [2, 3]])))


def test_repr_clips_long_lists():
    pin = Pin("w", indices=[(i, i) for i in range(10_000)], value=list(range(10_000)))
    text = repr(pin)
    assert len(text) < 250
    assert "..." in text


def test_repr_names_when():
    assert "when=module_when" in repr(Pin("w", when=module_when))
    assert "when='operator.eq'" in repr(Pin("w", when="operator.eq"))


# ----------------------------------------------------------------------------------------------
# fingerprint


def _base_kwargs():
    return dict(
        params="fc.weight",
        indices=[(0, 1), (2, 3)],
        seed=0,
        value=torch.tensor([1.0, 2.0]),
        start_step=0,
        stop_step=None,
        when=None,
    )


def test_fingerprint_stable_across_constructions():
    a, b = Pin(**_base_kwargs()), Pin(**_base_kwargs())
    assert a is not b
    fp = a.fingerprint()
    assert isinstance(fp, str) and len(fp) == 16
    assert fp == b.fingerprint()
    assert fp == a.fingerprint()  # and across calls


def test_fingerprint_stable_for_tensor_fields_of_equal_content():
    a = Pin("w", mask=torch.tensor([[True, False], [False, True]]))
    b = Pin("w", mask=torch.tensor([[True, False], [False, True]]).t().contiguous().t())  # non-contiguous copy
    assert a.fingerprint() == b.fingerprint()


@pytest.mark.parametrize(
    "change",
    [
        dict(params="fc.bias"),
        dict(params=["fc.weight", "fc.bias"]),
        dict(indices=[(0, 1), (2, 2)]),
        dict(indices=[(2, 3), (0, 1)]),
        dict(indices=None, mask=torch.tensor([[True, False]])),
        dict(indices=None, fraction=0.5),
        dict(seed=1),
        dict(value=torch.tensor([1.0, 2.5])),  # tensor contents
        dict(value=torch.tensor([1.0, 2.0], dtype=torch.float64)),  # tensor dtype
        dict(value=torch.tensor([[1.0, 2.0]])),  # tensor shape
        dict(value=[1.0, 2.0]),
        dict(value=None),
        dict(value="values.pt"),
        dict(start_step=1),
        dict(stop_step=10),
        dict(when=module_when),
        dict(when="operator.eq"),
    ],
    ids=lambda change: ",".join(change),
)
def test_fingerprint_differs_when_a_field_changes(change):
    base = Pin(**_base_kwargs()).fingerprint()
    kwargs = _base_kwargs()
    kwargs.update(change)
    assert Pin(**kwargs).fingerprint() != base


def test_fingerprint_differs_for_mask_contents():
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[0, 1] = True
    other = mask.clone()
    other[3, 3] = True
    assert Pin("w", mask=mask).fingerprint() != Pin("w", mask=other).fingerprint()


def test_fingerprint_differs_for_value_contents_by_one_ulp():
    v = torch.zeros(100)
    w = v.clone()
    w[57] = torch.nextafter(torch.tensor(0.0), torch.tensor(1.0))
    assert Pin("w", value=v).fingerprint() != Pin("w", value=w).fingerprint()


def test_fingerprint_differs_for_fraction_and_value_scalars():
    assert Pin("w", fraction=0.1).fingerprint() != Pin("w", fraction=0.2).fingerprint()
    assert Pin("w", value=0.0).fingerprint() != Pin("w", value=-0.0).fingerprint()


def test_fingerprint_differs_between_named_when_functions():
    assert Pin("w", when=module_when).fingerprint() != Pin("w", when=other_when).fingerprint()


def test_fingerprint_differs_between_different_lambdas():
    first = lambda batch, i: i % 2 == 0  # noqa: E731
    second = lambda batch, i: i % 3 == 0  # noqa: E731
    assert Pin("w", when=first).fingerprint() != Pin("w", when=second).fingerprint()


def test_fingerprint_same_for_dictconfig_and_dict():
    cfg = OmegaConf.create({"params": ["a", "b"], "indices": [[0, 1]], "value": {"a": 1.0, "b": 2.0}})
    plain = {"params": ["a", "b"], "indices": [[0, 1]], "value": {"b": 2.0, "a": 1.0}}
    assert Pin.from_config(cfg).fingerprint() == Pin.from_config(plain).fingerprint()


_FP_SCRIPT = """
import torch
from lightning_pin import Pin
pin = Pin(["fc.weight", "re:enc.*"], mask=torch.arange(12).reshape(3, 4) % 3 == 0,
          value={"fc.weight": torch.linspace(-1, 1, 12).reshape(3, 4), "b": [1.5, 2]},
          start_step=2, stop_step=7, when="operator.eq")
print(pin.fingerprint())
"""


def _fp_in_process() -> str:
    pin = Pin(
        ["fc.weight", "re:enc.*"],
        mask=torch.arange(12).reshape(3, 4) % 3 == 0,
        value={"fc.weight": torch.linspace(-1, 1, 12).reshape(3, 4), "b": [1.5, 2]},
        start_step=2,
        stop_step=7,
        when="operator.eq",
    )
    return pin.fingerprint()


def test_fingerprint_stable_across_processes():
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", _FP_SCRIPT], capture_output=True, text=True, env=env, check=True, timeout=120
    )
    assert out.stdout.strip() == _fp_in_process()


# ----------------------------------------------------------------------------------------------
# pickling


@pytest.mark.parametrize(
    "pin",
    [
        Pin("fc.weight"),
        Pin(["fc.weight", "fc.bias"], fraction=0.25, seed=3, value=0.0, start_step=2, stop_step=8),
        Pin("fc.weight", indices=torch.tensor([[0, 1], [2, 3]]), value=torch.tensor([1.5, -2.0])),
        Pin("fc.weight", mask=torch.eye(3, 4, dtype=torch.bool), value={"fc.weight": 3.0}),
        Pin("fc.bias", when=module_when),
        Pin("fc.bias", when="operator.eq"),
        Pin("fc.bias", value="/some/where/values.safetensors"),
    ],
    ids=["whole", "fraction", "tensor-indices", "mask-dict", "when-fn", "when-path", "file"],
)
def test_pickle_round_trip(pin):
    copy = pickle.loads(pickle.dumps(pin))
    assert isinstance(copy, Pin)
    assert copy is not pin
    assert copy.fingerprint() == pin.fingerprint()
    assert repr(copy) == repr(pin)
    for name in ("indices", "mask", "value"):
        a, b = getattr(pin, name), getattr(copy, name)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b) and a.dtype == b.dtype
        else:
            assert a == b
    assert copy.when == pin.when


def test_pickled_pin_resolves_identically():
    pin = Pin("fc.weight", indices=[(0, 1), (2, 3)], value=[4.0, 5.0], when=module_when)
    copy = pickle.loads(pickle.dumps(pin))
    m = small_module()
    a = resolve([pin], m)
    b = resolve([copy], m)
    assert a.fingerprint() == b.fingerprint()
    assert b.pins[0].when is module_when


def test_lambda_when_works_in_a_single_process():
    fn = lambda batch, i: i == 3  # noqa: E731
    pin = Pin("fc.bias", when=fn)
    plan = resolve([pin], small_module())
    assert plan.pins[0].when is fn
    assert plan.pins[0].when(None, 3) is True and plan.pins[0].when(None, 2) is False


# ----------------------------------------------------------------------------------------------
# `when` as an import path


@pytest.mark.parametrize(
    "path, expected",
    [
        ("operator.eq", operator.eq),
        ("operator:eq", operator.eq),
        ("os.path.join", os.path.join),
        ("os.path:join", os.path.join),
        ("collections:OrderedDict.fromkeys", __import__("collections").OrderedDict.fromkeys),
    ],
)
def test_when_import_path(path, expected):
    pin = Pin("fc.bias", when=path)
    assert pin.when == path  # kept as the string (travels to spawned processes and configs)
    assert resolve_when(pin) == expected
    assert resolve([pin], small_module()).pins[0].when == expected


def test_when_import_path_to_test_module_function():
    pin = Pin("fc.bias", when=f"{__name__}.module_when")
    when = resolve([pin], small_module()).pins[0].when
    assert when(None, 4) is True and when(None, 5) is False


def test_when_none_and_callable():
    assert resolve_when(Pin("x")) is None
    assert resolve_when(Pin("x", when=module_when)) is module_when
