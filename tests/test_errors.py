"""Every error of DESIGN.md "Errors": a PinError naming the offending spec and what would be right,
raised both by resolve() and by a real Trainer.fit with PinCallback, before any weight changes.

TinyNet parameters: encoder.weight (16, 8), encoder.bias (16,), head.weight (3, 16), head.bias (3,).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import TinyNet, make_loader, trainer
from safetensors.torch import save_file

from lightning_pin import Pin, PinCallback, PinError
from lightning_pin.core.plan import resolve

# A valid pin put before every bad spec: if pins were applied one by one as they resolve, it
# would move encoder.bias to 0.5, and the "no weight changed" checks would catch it.
GOOD = Pin("encoder.bias", value=0.5)


def _write(path: Path, obj) -> str:
    if path.suffix == ".safetensors":
        save_file(obj, str(path))
    else:
        torch.save(obj, path)
    return str(path)


def _files(make):
    """Case helper: ``make(tmp_path) -> list of bad pins``."""
    return make


def _plain(*pins):
    return lambda tmp: list(pins)


# (make bad pins, dtype of the model, phrases the message must contain), by id.
# Every message must also contain repr() of each bad pin (the offending spec).
CASES = [
    # -- a pattern that matches no parameter: the closest names are listed
    pytest.param(
        _plain(Pin("encoder.weights")),
        torch.float32,
        ["'encoder.weights' matches no parameter", "closest names", "'encoder.weight'", "whole name"],
        id="pattern-typo",
    ),
    pytest.param(
        _plain(Pin("weight")),
        torch.float32,
        ["'weight' matches no parameter", "closest names", "'head.weight'", "'encoder.weight'", "whole name"],
        id="pattern-glob-not-whole-name",
    ),
    pytest.param(
        _plain(Pin("re:head")),
        torch.float32,
        ["'re:head' matches no parameter", "closest names", "'head.bias'", "'head.weight'", "whole name"],
        id="pattern-regex-not-whole-name",
    ),
    pytest.param(
        _plain(Pin(["head.bias", "haed.weight"])),
        torch.float32,
        ["'haed.weight' matches no parameter", "closest names: ['head.weight'"],
        id="pattern-one-of-list",
    ),
    # -- indices out of range
    pytest.param(
        _plain(Pin("encoder.weight", indices=[(0, 0), (16, 0)], value=1.0)),
        torch.float32,
        ["out of range", "[[16, 0]]", "'encoder.weight'", "(16, 8)", "must be in [0, shape[d])"],
        id="indices-out-of-range",
    ),
    pytest.param(
        _plain(Pin("head.bias", indices=torch.tensor([1, 3]), value=0.0)),
        torch.float32,
        ["out of range", "[[3]]", "'head.bias'", "(3,)"],
        id="indices-tensor-out-of-range",
    ),
    # -- indices of the wrong rank
    pytest.param(
        _plain(Pin("encoder.weight", indices=[(0,), (1,)])),
        torch.float32,
        ["must be k rows of 2 coordinates", "(16, 8)", "got shape (2, 1)"],
        id="indices-rank-too-low",
    ),
    pytest.param(
        _plain(Pin("encoder.weight", indices=[(0, 0, 0)])),
        torch.float32,
        ["must be k rows of 2 coordinates", "got shape (1, 3)"],
        id="indices-rank-too-high",
    ),
    pytest.param(
        _plain(Pin("encoder.weight", indices=[0, 1])),
        torch.float32,
        ["must be k rows of 2 coordinates", "got shape (2,)"],
        id="indices-ints-for-2d",
    ),
    pytest.param(
        _plain(Pin("head.weight", indices=torch.tensor([[0, 1, 2]]))),
        torch.float32,
        ["must be k rows of 2 coordinates", "(3, 16)", "got shape (1, 3)"],
        id="indices-tensor-wrong-rank",
    ),
    # -- a mask of the wrong shape (its dtype: BUILD_CASES)
    pytest.param(
        _plain(Pin("encoder.weight", mask=torch.ones(8, 16, dtype=torch.bool))),
        torch.float32,
        ["mask for 'encoder.weight' has shape (8, 16)", "the parameter's shape is (16, 8)"],
        id="mask-shape",
    ),
    # -- a value that overflows the parameter's dtype
    pytest.param(
        _plain(Pin("head.bias", value=1e39)),
        torch.float32,
        ["overflow torch.float32", "'head.bias'", "1e+39", "largest finite: 3.40282e+38"],
        id="overflow-float32",
    ),
    pytest.param(
        _plain(Pin("head.bias", indices=[1], value=70000)),
        torch.float16,
        ["overflow torch.float16", "70000", "largest finite: 65504"],
        id="overflow-float16",
    ),
    pytest.param(
        _plain(Pin("head.weight", value=torch.full((3, 16), 1e39, dtype=torch.float64))),
        torch.bfloat16,
        ["overflow torch.bfloat16", "'head.weight'", "largest finite"],
        id="overflow-bfloat16-tensor",
    ),
    pytest.param(
        _plain(Pin("head.bias", value=[1.0, 1e40, 2.0])),
        torch.float32,
        ["overflow torch.float32", "1e+40"],
        id="overflow-in-sequence",
    ),
    pytest.param(
        _plain(Pin("head.bias", value=10**40)),
        torch.float32,
        ["overflow torch.float32"],
        id="overflow-python-int",
    ),
    # -- a value sequence whose length does not match the selection
    pytest.param(
        _plain(Pin("head.weight", indices=[(0, 0), (1, 1)], value=[1.0, 2.0, 3.0])),
        torch.float32,
        ["value for 'head.weight' has shape (3,)", "2 values (one per selected element)", "(3, 16)"],
        id="value-length-indices",
    ),
    pytest.param(
        _plain(Pin("head.bias", value=[1.0, 2.0])),
        torch.float32,
        ["value for 'head.bias' has shape (2,)", "3 values (one per selected element)"],
        id="value-length-whole",
    ),
    pytest.param(
        _plain(Pin("head.bias", mask=torch.tensor([True, False, True]), value=[1.0])),
        torch.float32,
        ["has shape (1,)", "2 values (one per selected element)"],
        id="value-length-mask",
    ),
    pytest.param(
        _plain(Pin("encoder.weight", fraction=0.25, value=[0.0] * 31)),
        torch.float32,
        ["has shape (31,)", "32 values (one per selected element)", "(16, 8)"],
        id="value-length-fraction",
    ),
    pytest.param(
        _plain(Pin("head.weight", indices=[(0, 0)], value=torch.zeros(16, 3))),
        torch.float32,
        ["has shape (16, 3)", "a tensor of the parameter's shape (3, 16)"],
        id="value-tensor-wrong-shape",
    ),
    # -- two pins giving one element different values (at overlapping times)
    pytest.param(
        _plain(Pin("head.bias", value=0.0), Pin("head.bias", indices=[1], value=1.0)),
        torch.float32,
        ["'head.bias' different values at overlapping steps", "0.0 vs 1.0", "separate their step windows"],
        id="conflict-whole-vs-index",
    ),
    pytest.param(
        _plain(Pin("head.*", value=1.0), Pin("re:head\\.weight", mask=torch.eye(3, 16, dtype=torch.bool), value=2.0)),
        torch.float32,
        ["3 element(s) of 'head.weight' different values", "give each element one value"],
        id="conflict-glob-vs-mask",
    ),
    pytest.param(
        _plain(
            Pin("head.weight", indices=[(0, 0), (2, 5)], value=[3.0, 4.0], stop_step=5),
            Pin("head.weight", indices=[(2, 5)], value=4.5, start_step=4),
        ),
        torch.float32,
        ["1 element(s) of 'head.weight'", "4.0 vs 4.5", "separate their step windows"],
        id="conflict-windows-overlap-by-one-step",
    ),
    pytest.param(
        _plain(Pin("head.bias", value=0.0, when="operator.eq"), Pin("head.bias", value=1.0, start_step=3)),
        torch.float32,
        ["different values at overlapping steps"],
        id="conflict-when-pin",
    ),
    pytest.param(
        _plain(Pin("head.weight", indices=[(1, 1), (0, 0), (1, 1)], value=[3.0, 4.0, 3.5])),
        torch.float32,
        ["indices repeat an element of 'head.weight' with different values"],
        id="conflict-duplicate-indices",
    ),
    # -- a file that is missing or holds the wrong shape
    pytest.param(
        _files(lambda tmp: [Pin("encoder.weight", mask=str(tmp / "missing_mask.pt"))]),
        torch.float32,
        ["mask file", "missing_mask.pt", "does not exist"],
        id="file-missing-mask",
    ),
    pytest.param(
        _files(lambda tmp: [Pin("head.bias", value=str(tmp / "missing_values.safetensors"))]),
        torch.float32,
        ["value file", "missing_values.safetensors", "does not exist"],
        id="file-missing-value",
    ),
    pytest.param(
        _files(lambda tmp: [Pin("encoder.weight", mask=_write(tmp / "m.pt", torch.ones(8, 16, dtype=torch.bool)))]),
        torch.float32,
        ["mask for 'encoder.weight' has shape (8, 16)", "the parameter's shape is (16, 8)"],
        id="file-mask-wrong-shape-pt",
    ),
    pytest.param(
        _files(
            lambda tmp: [
                Pin("encoder.weight", mask=_write(tmp / "m.safetensors", {"encoder.weight": torch.ones(16, dtype=torch.bool)}))
            ]
        ),
        torch.float32,
        ["mask for 'encoder.weight' has shape (16,)", "the parameter's shape is (16, 8)"],
        id="file-mask-wrong-shape-safetensors",
    ),
    pytest.param(
        _files(lambda tmp: [Pin("head.weight", value=_write(tmp / "v.safetensors", {"head.weight": torch.zeros(16, 3)}))]),
        torch.float32,
        ["value for 'head.weight' has shape (16, 3)", "a tensor of the parameter's shape (3, 16)"],
        id="file-value-wrong-shape-safetensors",
    ),
    pytest.param(
        _files(lambda tmp: [Pin("head.bias", indices=[0, 2], value=_write(tmp / "v.pt", torch.zeros(4)))]),
        torch.float32,
        ["value for 'head.bias' has shape (4,)", "2 values (one per selected element)"],
        id="file-value-wrong-shape-pt",
    ),
    pytest.param(
        _files(
            lambda tmp: [
                Pin("head.*", value=_write(tmp / "v.pt", {"head.weight": torch.zeros(3, 16), "encoder.bias": torch.zeros(16)}))
            ]
        ),
        torch.float32,
        ["value has no entry for parameter 'head.bias'", "its keys are ['encoder.bias', 'head.weight']"],
        id="file-value-dict-missing-name",
    ),
    pytest.param(
        _files(lambda tmp: [Pin("head.bias", value=str(tmp / "values.npy"))]),
        torch.float32,
        ["value file", "values.npy", "must end in one of", ".safetensors"],
        id="file-wrong-suffix",
    ),
    pytest.param(
        _files(lambda tmp: [Pin("head.bias", value=_garbage(tmp))]),
        torch.float32,
        ["cannot read value file", "garbage.pt"],
        id="file-unreadable",
    ),
    # -- a `when` whose import path leads nowhere or to something not callable
    pytest.param(
        _plain(Pin("head.bias", when="no_such_module_xyz.every_other")),
        torch.float32,
        ["cannot import when='no_such_module_xyz.every_other'", "No module named 'no_such_module_xyz'"],
        id="when-bad-module",
    ),
    pytest.param(
        _plain(Pin("head.bias", when="operator.no_such_function")),
        torch.float32,
        ["cannot import when='operator.no_such_function'", "no_such_function"],
        id="when-bad-attribute",
    ),
    pytest.param(
        _plain(Pin("head.bias", when="os.sep")),
        torch.float32,
        ["when must be callable", "got 'os.sep'"],
        id="when-path-to-non-callable",
    ),
    # -- a value generator (the app's UniformValues) that was never turned into numbers
    pytest.param(
        _plain(Pin("head.bias", value=lambda name, parameter: parameter)),
        torch.float32,
        ["value for 'head.bias' is a generator (function) that was never turned into numbers", "realize"],
        id="value-generator-not-realized",
    ),
    # -- a `when` that cannot be called as when(batch, batch_idx)
    pytest.param(
        _plain(Pin("head.bias", when=lambda batch: True)),
        torch.float32,
        ["when=<lambda> has the signature (batch)", "when(batch, batch_idx)", "two arguments (batch, batch_idx)"],
        id="when-one-argument",
    ),
    pytest.param(
        _plain(Pin("head.bias", when="os.getcwd")),
        torch.float32,
        ["when='os.getcwd' has the signature ()", "when(batch, batch_idx)"],
        id="when-path-to-no-argument-function",
    ),
    # -- a mask or value file holding what no mask or value may be (checked like in-memory ones)
    pytest.param(
        _files(lambda tmp: [Pin("head.bias", value=_write(tmp / "nan.pt", torch.tensor([0.0, float("nan"), 1.0])))]),
        torch.float32,
        ["value for 'head.bias' holds non-finite numbers [nan]", "pin finite values"],
        id="file-value-nan",
    ),
    pytest.param(
        _files(lambda tmp: [Pin("head.bias", value=_write(tmp / "flags.pt", torch.ones(3, dtype=torch.bool)))]),
        torch.float32,
        ["value for 'head.bias' must be numeric, got a bool"],
        id="file-value-bool",
    ),
    pytest.param(
        _files(lambda tmp: [Pin("head.bias", mask=_write(tmp / "m.safetensors", {"head.bias": torch.ones(3)}))]),
        torch.float32,
        ["mask for 'head.bias' has dtype torch.float32", "must be torch.bool"],
        id="file-mask-dtype",
    ),
    pytest.param(
        _files(lambda tmp: [Pin("head.bias", mask=_write(tmp / "m.pt", torch.zeros(3, dtype=torch.bool)))]),
        torch.float32,
        ["mask for 'head.bias' selects no element", "select at least one or drop the pin"],
        id="file-mask-all-false",
    ),
    pytest.param(
        _plain(Pin("head.*", mask={"head.bias": torch.zeros(3, dtype=torch.bool), "head.weight": torch.eye(3, 16, dtype=torch.bool)})),
        torch.float32,
        ["mask for 'head.bias' selects no element"],
        id="mask-dict-entry-all-false",
    ),
]

# Mistakes that need no model: Pin(...) itself raises, as Lightning's callbacks do in __init__.
# (keyword arguments of Pin, phrases the message must contain), by id. The message must also
# contain the repr of the offending spec.
BUILD_CASES = [
    # -- params
    pytest.param(dict(params=[]), ["params must be a non-empty string or list of strings"], id="params-empty"),
    pytest.param(dict(params=5), ["params must be a non-empty string or list of strings", "got 5"], id="params-int"),
    pytest.param(dict(params=""), ["params must be a non-empty string"], id="params-empty-string"),
    pytest.param(dict(params=["head.bias", None]), ["params must be a non-empty string or list of strings"],
                 id="params-list-with-none"),
    pytest.param(dict(params="re:head.(bias"), ["'re:head.(bias' is not a valid regular expression"],
                 id="params-bad-regex"),
    # -- indices: not integers, ragged, negative, empty
    pytest.param(
        dict(params="encoder.weight", indices=[(0, -1)]),
        ["out of range", "[[0, -1]]", "must be in [0, shape[d])"],
        id="indices-negative",
    ),
    pytest.param(
        dict(params="head.bias", indices=torch.tensor([1, -3])),
        ["out of range", "[[-3]]", "must be in [0, shape[d])"],
        id="indices-tensor-negative",
    ),
    pytest.param(
        dict(params="head.weight", indices=[(0, 1), (2,)]),
        ["rows must all have the same number of coordinates", "got rows of lengths 1, 2"],
        id="indices-ragged",
    ),
    pytest.param(dict(params="head.weight", indices=[(0, 1.5)]), ["indices must hold integers"],
                 id="indices-float"),
    pytest.param(dict(params="head.weight", indices=torch.tensor([[0.0, 1.0]])),
                 ["indices must hold integers, got dtype torch.float32"], id="indices-float-tensor"),
    pytest.param(dict(params="head.bias", indices=torch.tensor([True, False, True])),
                 ["indices is a bool tensor; pass it as mask= instead"], id="indices-bool-tensor"),
    pytest.param(dict(params="head.bias", indices="0"), ["indices must be a list of tuples or an integer tensor"],
                 id="indices-string"),
    pytest.param(
        dict(params="encoder.weight", indices=[]),
        ["indices select no element", "select at least one or drop the pin"],
        id="indices-empty",
    ),
    # -- a mask of the wrong dtype, or that selects nothing
    pytest.param(
        dict(params="encoder.weight", mask=torch.ones(16, 8)),
        ["has dtype torch.float32", "must be torch.bool"],
        id="mask-dtype-float",
    ),
    pytest.param(
        dict(params="head.bias", mask=torch.tensor([1, 0, 1], dtype=torch.uint8)),
        ["has dtype torch.uint8", "must be torch.bool"],
        id="mask-dtype-uint8",
    ),
    pytest.param(dict(params="head.bias", mask=[True, False, True]), ["mask must be a bool tensor", "got list"],
                 id="mask-list"),
    pytest.param(
        dict(params="head.bias", mask=torch.zeros(3, dtype=torch.bool), value=1.0),
        ["mask selects no element", "select at least one or drop the pin"],
        id="mask-all-false",
    ),
    # -- more than one of indices / mask / fraction
    pytest.param(
        dict(params="head.bias", indices=[0], mask=torch.ones(3, dtype=torch.bool)),
        ["give at most one of indices / mask / fraction", "got indices and mask"],
        id="indices-and-mask",
    ),
    pytest.param(
        dict(params="head.bias", mask=torch.ones(3, dtype=torch.bool), fraction=0.5),
        ["give at most one of indices / mask / fraction", "got mask and fraction"],
        id="mask-and-fraction",
    ),
    pytest.param(
        dict(params="head.bias", indices=[0], mask=torch.ones(3, dtype=torch.bool), fraction=0.5),
        ["give at most one of indices / mask / fraction", "got indices and mask and fraction"],
        id="all-three",
    ),
    # -- fraction outside (0, 1]
    *[
        pytest.param(
            dict(params="encoder.weight", fraction=f),
            ["fraction must be a number in (0, 1]", f"got {f!r}"],
            id=f"fraction-{f!r}",
        )
        for f in (0, 0.0, 1.5, -0.1, True, float("nan"), float("inf"), "0.5")
    ],
    pytest.param(dict(params="head.bias", fraction=0.5, seed=1.5), ["seed must be an integer, got 1.5"],
                 id="seed-float"),
    # -- step windows
    pytest.param(
        dict(params="head.bias", start_step=3, stop_step=3),
        ["stop_step must be None or an integer > start_step (3)", "got 3"],
        id="stop-equals-start",
    ),
    pytest.param(
        dict(params="head.bias", start_step=5, stop_step=2),
        ["stop_step must be None or an integer > start_step (5)", "got 2"],
        id="stop-before-start",
    ),
    pytest.param(
        dict(params="head.bias", stop_step=0),
        ["stop_step must be None or an integer > start_step (0)", "got 0"],
        id="stop-zero",
    ),
    pytest.param(dict(params="head.bias", start_step=-1), ["start_step must be an integer >= 0", "got -1"],
                 id="start-negative"),
    pytest.param(dict(params="head.bias", start_step=1.0), ["start_step must be an integer >= 0", "got 1.0"],
                 id="start-float"),
    pytest.param(dict(params="head.bias", stop_step="10"), ["stop_step must be None or an integer", "got '10'"],
                 id="stop-string"),
    # -- a value that is NaN or infinite, a bool, complex, or no number at all
    pytest.param(
        dict(params="head.bias", value=float("nan")),
        ["non-finite", "nan", "pin finite values"],
        id="value-nan",
    ),
    pytest.param(
        dict(params="head.weight", indices=[(0, 0), (1, 1)], value=[1.0, float("nan")]),
        ["non-finite numbers [nan]", "pin finite values"],
        id="value-nan-in-sequence",
    ),
    pytest.param(dict(params="head.bias", value=float("inf")), ["non-finite", "inf", "pin finite values"],
                 id="value-inf"),
    pytest.param(
        dict(params="head.bias", value=torch.tensor([1.0, float("-inf"), 2.0])),
        ["non-finite numbers [-inf]", "pin finite values"],
        id="value-neg-inf-tensor",
    ),
    pytest.param(
        dict(params="head.*", value={"head.bias": 0.0, "head.weight": float("nan")}),
        ["value for 'head.weight' holds non-finite numbers [nan]"],
        id="value-nan-in-dict",
    ),
    pytest.param(dict(params="head.bias", value=True), ["value must be numeric, got a bool"], id="value-bool"),
    pytest.param(dict(params="head.bias", value=[1.0, True, 0.0]), ["value holds bools"], id="value-bools-in-list"),
    pytest.param(dict(params="head.bias", value=1 + 2j), ["not a number or a numeric sequence", "complex"],
                 id="value-complex"),
    pytest.param(dict(params="head.bias", value=torch.zeros(3, dtype=torch.complex64)),
                 ["complex values are not supported"], id="value-complex-tensor"),
    pytest.param(dict(params="head.bias", value=["1.0", "2.0", "3.0"]),
                 ["not a number or a numeric sequence", "str '1.0'"], id="value-strings-in-list"),
    pytest.param(dict(params="head.bias", value=object()), ["value must be None, a number", "got object"],
                 id="value-object"),
    # -- a `when` that is neither callable nor an import path
    pytest.param(
        dict(params="head.bias", when=5),
        ["when must be callable(batch, batch_idx) -> bool or its import path", "got 5"],
        id="when-int",
    ),
    pytest.param(
        dict(params="head.bias", when="every_other"),
        ["is not an import path", "package.module.function"],
        id="when-not-a-path",
    ),
]


def _garbage(tmp: Path) -> str:
    path = tmp / "garbage.pt"
    path.write_bytes(b"this is not a torch file")
    return str(path)


def _model(dtype: torch.dtype) -> TinyNet:
    return TinyNet().to(dtype)


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_unchanged(before, model) -> None:
    after = model.state_dict()
    assert before.keys() == after.keys()
    changed = [k for k in before if not (before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]))]
    assert changed == []


def _assert_message(err: PinError, bad: list[Pin], phrases: list[str]) -> None:
    message = str(err)
    for pin in bad:
        assert repr(pin) in message, f"the offending spec {pin!r} is not named in: {message}"
    for phrase in phrases:
        assert phrase in message, f"{phrase!r} not in: {message}"


@pytest.mark.parametrize("make, dtype, phrases", CASES)
def test_resolve_rejects(make, dtype, phrases, tmp_path):
    bad = make(tmp_path)
    model = _model(dtype)
    before = _snapshot(model)
    with pytest.raises(PinError) as info:
        resolve([GOOD, *bad], model)
    _assert_message(info.value, bad, phrases)
    _assert_unchanged(before, model)


@pytest.mark.parametrize("make, dtype, phrases", CASES)
def test_fit_rejects_before_any_weight_changes(make, dtype, phrases, tmp_path):
    bad = make(tmp_path)
    model = _model(dtype)
    before = _snapshot(model)
    callback = PinCallback([GOOD, *bad], verbose=False)
    fit = trainer(max_steps=3, callbacks=[callback])
    with pytest.raises(PinError) as info:
        fit.fit(model, make_loader())
    _assert_message(info.value, bad, phrases)
    _assert_unchanged(before, model)
    assert fit.global_step == 0


def test_fit_rejects_dict_specs_too():
    # The Hydra / YAML route: dicts turned into Pins by the callback, rejected at fit.
    model = TinyNet()
    before = _snapshot(model)
    callback = PinCallback([{"params": "encoder.bias", "value": 0.5}, {"params": "head.bias", "value": 1e39}])
    with pytest.raises(PinError, match=r"values \[1e\+39, 1e\+39, 1e\+39\] overflow torch.float32 of 'head.bias'"):
        trainer(max_steps=3, callbacks=[callback]).fit(model, make_loader())
    _assert_unchanged(before, model)


# ----------------------------------------------------------------------------------------------
# Construction: Pin(...) rejects what needs no model, before any Trainer or model exists.


def _unchecked(**kwargs) -> Pin:
    """The Pin ``kwargs`` describe, built without its checks: only for the repr a message must show."""
    pin = object.__new__(Pin)
    for field in dataclasses.fields(Pin):
        object.__setattr__(pin, field.name, kwargs.get(field.name, field.default))
    return pin


@pytest.mark.parametrize("kwargs, phrases", BUILD_CASES)
def test_pin_rejects_at_construction(kwargs, phrases):
    with pytest.raises(PinError) as info:
        Pin(**kwargs)
    _assert_message(info.value, [_unchecked(**kwargs)], phrases)


@pytest.mark.parametrize("kwargs, phrases", BUILD_CASES)
def test_callback_rejects_dict_specs_at_construction(kwargs, phrases):
    # The Hydra / YAML route: the dict becomes a Pin inside PinCallback(...), which raises there.
    with pytest.raises(PinError) as info:
        PinCallback([{"params": "encoder.bias", "value": 0.5}, kwargs], verbose=False)
    _assert_message(info.value, [_unchecked(**kwargs)], phrases)


# ----------------------------------------------------------------------------------------------
# The snapshot check can fail: the good pin alone does change weights.


def test_good_pin_alone_changes_weights():
    model = TinyNet()
    before = _snapshot(model)
    fit = trainer(max_steps=2, callbacks=[PinCallback([GOOD], verbose=False)])
    fit.fit(model, make_loader())
    assert fit.global_step == 2
    assert torch.equal(model.encoder.bias.detach(), torch.full((16,), 0.5))
    assert not torch.equal(before["head.weight"], model.head.weight.detach())
    with pytest.raises(AssertionError):
        _assert_unchanged(before, model)


# ----------------------------------------------------------------------------------------------
# Not errors: different values on one element at times that cannot overlap, or equal values.


NOT_CONFLICTS = [
    pytest.param(
        [Pin("head.bias", value=0.0, stop_step=3), Pin("head.bias", indices=[1], value=1.0, start_step=3)],
        id="adjacent-windows",
    ),
    pytest.param(
        [
            Pin("head.bias", value=0.0, start_step=0, stop_step=2),
            Pin("head.bias", value=1.0, start_step=2, stop_step=4),
            Pin("head.bias", value=2.0, start_step=4),
        ],
        id="three-windows",
    ),
    pytest.param([Pin("head.bias", value=0.5), Pin("head.bias", indices=[2], value=0.5)], id="equal-values"),
    pytest.param([Pin("head.bias"), Pin("head.bias", indices=[2], value=7.0)], id="explicit-beats-none"),
]


@pytest.mark.parametrize("pins", NOT_CONFLICTS)
def test_resolve_accepts_non_conflicting(pins):
    plan = resolve(pins, TinyNet())
    assert len(plan.pins) == len(pins)


def test_fit_with_values_in_separate_windows_trains_and_pins():
    model = TinyNet()
    pins = [Pin("head.bias", value=0.0, stop_step=3), Pin("head.bias", indices=[1], value=1.0, start_step=3)]
    fit = trainer(max_steps=5, callbacks=[PinCallback(pins, verbose=False)])
    fit.fit(model, make_loader())
    assert fit.global_step == 5
    bias = model.head.bias.detach()
    # From step 3 only element 1 is pinned (to 1.0); elements 0 and 2 were released and trained.
    assert bias[1].item() == 1.0
    assert bias[0].item() != 0.0 and bias[2].item() != 0.0
