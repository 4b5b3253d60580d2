"""`when` returns a bool or a 0-d bool tensor, and takes (batch, batch_idx); anything else is a
PinError naming the pin and what it returned, before that batch's optimizer step.

TinyNet parameters: encoder.weight (16, 8), encoder.bias (16,), head.weight (3, 16), head.bias (3,).
"""

from __future__ import annotations

import functools

import lightning as L
import numpy as np
import pytest
import torch
from helpers import TinyNet, make_loader, trainer
from torch import nn

from lightning_pin import Pin, PinCallback, PinError
from lightning_pin.core.plan import ResolvedPin, call_when, resolve


def _resolved(when) -> ResolvedPin:
    return resolve([Pin("weight", indices=[(0, 0)], value=1.0, when=when)], nn.Linear(2, 2)).pins[0]


def _returning(result):
    def when(batch, batch_idx):
        return result

    return when


# ----------------------------------------------------------------------------------------------
# What a `when` may return


@pytest.mark.parametrize(
    "result, expected",
    [
        (True, True),
        (False, False),
        (torch.tensor(True), True),
        (torch.tensor(False), False),
        (np.bool_(True), True),
        (np.bool_(False), False),
        (torch.tensor([3, 0]).eq(3).any(), True),  # the usual way to get a 0-d bool tensor
    ],
    ids=["true", "false", "tensor-true", "tensor-false", "numpy-true", "numpy-false", "reduced-tensor"],
)
def test_call_when_accepts_bools_and_0d_bool_tensors(result, expected):
    decided = call_when(_resolved(_returning(result)), None, 0)
    assert decided is expected


@pytest.mark.parametrize(
    "result, phrases",
    [
        ("no", ["returned 'no' (str)"]),
        ("", ["returned '' (str)"]),
        (None, ["returned None (NoneType)", "a missing `return`?"]),
        (1, ["returned 1 (int)"]),
        (0, ["returned 0 (int)"]),
        (1.0, ["returned 1.0 (float)"]),
        ([True], ["returned [True] (list)"]),
        (torch.tensor([True, False]), ["a tensor of shape (2,) and dtype torch.bool", "reduce it with .all() / .any()"]),
        (torch.tensor([True]), ["a tensor of shape (1,) and dtype torch.bool"]),
        (torch.tensor(1), ["a tensor of shape () and dtype torch.int64"]),
        (torch.tensor(1.0), ["a tensor of shape () and dtype torch.float32"]),
        (np.array([True, False]), ["(ndarray)"]),
        (np.int64(1), ["returned np.int64(1) (int64)"]),
    ],
    ids=["str-no", "str-empty", "none", "int-1", "int-0", "float", "list", "tensor-2", "tensor-1-elem", "tensor-int",
         "tensor-float", "ndarray", "numpy-int"],
)
def test_call_when_rejects_anything_else_naming_the_pin_and_the_result(result, phrases):
    rp = _resolved(_returning(result))
    with pytest.raises(PinError) as info:
        call_when(rp, None, 7)
    message = str(info.value)
    assert repr(rp.pin) in message
    assert "when=test_call_when_rejects_anything_else_naming_the_pin_and_the_result.<locals>" not in message
    assert "when=_returning.<locals>.when returned" in message
    assert "for batch 7" in message
    assert "it must return a bool or a 0-d bool tensor" in message
    for phrase in phrases:
        assert phrase in message, f"{phrase!r} not in {message}"


def test_exceptions_inside_when_propagate_unchanged():
    def broken(batch, batch_idx):
        raise KeyError("label")

    with pytest.raises(KeyError, match="label"):
        call_when(_resolved(broken), None, 0)


# ----------------------------------------------------------------------------------------------
# Signatures: checked when the pin is resolved


def _one_argument(batch):
    return True


def _three_arguments(batch, batch_idx, dataloader_idx):
    return True


def _keyword_only(batch, *, batch_idx):
    return True


@pytest.mark.parametrize(
    "when, name",
    [
        (lambda batch: True, "<lambda>"),
        (_one_argument, "_one_argument"),
        (_three_arguments, "_three_arguments"),
        (_keyword_only, "_keyword_only"),
        (functools.partial(_three_arguments, 1, 2), "functools.partial"),
        ("os.getcwd", "'os.getcwd'"),
    ],
    ids=["lambda", "one-argument", "three-arguments", "keyword-only", "partial-binding-too-much", "path-no-args"],
)
def test_wrong_signature_is_rejected_at_resolve(when, name):
    pin = Pin("weight", when=when)
    with pytest.raises(PinError) as info:
        resolve([pin], nn.Linear(2, 2))
    message = str(info.value)
    assert repr(pin) in message
    assert f"when={name}" in message
    assert "cannot be called as when(batch, batch_idx)" in message
    assert "two arguments (batch, batch_idx)" in message


@pytest.mark.parametrize(
    "when",
    [
        lambda batch, batch_idx: True,
        lambda *args: True,
        lambda batch, batch_idx, extra=None: True,
        functools.partial(_three_arguments, "fixed"),
        "operator.eq",
    ],
    ids=["two", "varargs", "default-third", "partial", "path"],
)
def test_right_signatures_resolve(when):
    rp = resolve([Pin("weight", when=when)], nn.Linear(2, 2)).pins[0]
    assert rp.when_signature_checked


def test_a_builtin_without_signature_is_checked_when_called():
    # vars() has no inspectable signature: the TypeError of the call itself becomes the PinError.
    rp = _resolved(vars)
    assert not rp.when_signature_checked
    with pytest.raises(PinError) as info:
        call_when(rp, {"x": 1}, 0)
    assert "when=vars cannot be called as when(batch, batch_idx)" in str(info.value)
    assert repr(rp.pin) in str(info.value)
    assert isinstance(info.value.__cause__, TypeError)


# ----------------------------------------------------------------------------------------------
# Through a real fit: rejected before that batch's step, and a good `when` pins exactly


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "when, phrase",
    [
        (_returning("no"), "returned 'no' (str)"),
        (_returning(None), "a missing `return`?"),
        (lambda batch, batch_idx: batch[1][:2] == 0, "a tensor of shape (2,) and dtype torch.bool"),
        (lambda batch, batch_idx: batch_idx, "returned 0 (int)"),
    ],
    ids=["str", "none", "tensor-2", "int"],
)
def test_fit_stops_on_a_bad_when_result_before_the_step(when, phrase):
    model = TinyNet()
    before = _snapshot(model)
    pin = Pin("head.bias", value=0.0, when=when)
    fit = trainer(max_steps=3, callbacks=[PinCallback([pin], verbose=False, monitor=False)])
    with pytest.raises(PinError, match="it must return a bool") as info:
        fit.fit(model, make_loader())
    assert phrase in str(info.value) and repr(pin) in str(info.value)
    assert fit.global_step == 0
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_fit_rejects_a_one_argument_when_before_any_step():
    model = TinyNet()
    before = _snapshot(model)
    fit = trainer(max_steps=3, callbacks=[PinCallback([Pin("head.bias", when=lambda batch: True)], verbose=False)])
    with pytest.raises(PinError, match=r"when=\S*<lambda> has the signature \(batch\)"):
        fit.fit(model, make_loader())
    assert fit.global_step == 0
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_0d_bool_tensor_when_pins_exactly_on_its_batches():
    # Even batches pin head.bias to 0.25 (a 0-d bool tensor decides); odd ones let it train.
    model = TinyNet()
    seen = []

    def even(batch, batch_idx):
        return torch.tensor(batch_idx % 2 == 0)

    class Check(L.Callback):  # after PinCallback: sees the weights after its restore
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((batch_idx, pl_module.head.bias.detach().clone()))

    pin = Pin("head.bias", value=0.25, when=even)
    trainer(max_steps=6, callbacks=[PinCallback([pin], verbose=False, monitor=False), Check()]).fit(
        model, make_loader()
    )
    target = torch.full((3,), 0.25)
    assert [i for i, _ in seen] == list(range(6))
    for batch_idx, bias in seen:
        if batch_idx % 2 == 0:
            assert torch.equal(bias, target), (batch_idx, bias)
        else:
            assert not torch.equal(bias, target), (batch_idx, bias)


def _engine_with(when):
    from lightning_pin.core.engine import PinEngine

    return PinEngine(resolve([Pin("0.bias", when=when), Pin("1.bias", when=lambda b, i: True)], nn.Sequential(
        nn.Linear(2, 2), nn.Linear(2, 2))))


def test_processes_agree_on_when_decisions_and_on_failures():
    # agree() stands for the all-reduce: flags are [this or another process failed, *hits].
    seen = []

    def other_rank_says(flags):
        def agree(local):
            seen.append(list(local))
            return [a or b for a, b in zip(local, flags)]

        return agree

    engine = _engine_with(lambda b, i: False)
    assert engine.when_hits(0, None, 0, agree=other_rank_says([False, True, False])) == frozenset({0, 1})
    assert seen[-1] == [False, False, True]
    # Another process's `when` failed: this one raises too, rather than wait in the next reduction.
    with pytest.raises(PinError, match="a `when` failed on another process at batch 3"):
        engine.when_hits(0, None, 3, agree=other_rank_says([True, False, False]))
    # This process's `when` fails: it still takes part in the reduction (so the others learn of
    # it), then raises its own error.
    failing = _engine_with(_returning("no"))
    with pytest.raises(PinError, match="returned"):
        failing.when_hits(0, None, 0, agree=other_rank_says([False, False, False]))
    assert seen[-1] == [True, False, False]
