"""A pin whose start_step is at or after the run's last step is never applied: warned about at the start of fit."""

from __future__ import annotations

import warnings

import pytest
import torch

from helpers import TinyNet, make_loader, trainer
from lightning_pin import Pin, PinCallback


def _fit(pins, **options) -> tuple[list[str], TinyNet]:
    torch.manual_seed(0)
    model = TinyNet()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(callbacks=[PinCallback(pins, verbose=False, monitor=False)], **options).fit(model, make_loader(n=24))
    return [str(w.message) for w in caught if "never applied" in str(w.message)], model


@pytest.mark.parametrize(
    ("options", "start", "words"),
    [
        ({"max_steps": 4, "max_epochs": 10}, 10, "the run ends after step 4 (trainer.max_steps=4)"),
        ({"max_epochs": 2}, 6, "the run ends after step 6 (max_epochs=2 x 3 steps per epoch)"),
        ({"max_epochs": 3, "max_steps": 5}, 5, "the run ends after step 5 (trainer.max_steps=5)"),
        ({"max_epochs": 2, "accumulate_grad_batches": 2}, 4, "(max_epochs=2 x 2 steps per epoch)"),
    ],
)
def test_a_pin_that_starts_after_the_last_step_is_warned_about(options, start, words):
    late = Pin("head.bias", value=0.0, start_step=start)
    messages, model = _fit([Pin("encoder.bias", value=1.0), late], **options)
    assert len(messages) == 1, messages
    assert repr(late) in messages[0] and f"starts at step {start}" in messages[0] and words in messages[0]
    assert bool((model.encoder.bias == 1.0).all()) and not bool((model.head.bias == 0.0).all())


def test_a_pin_that_starts_on_the_last_step_is_not_warned_about():
    # 3 batches x 2 epochs = 6 steps: start_step 5 is applied on the last step.
    messages, model = _fit([Pin("head.bias", value=0.0, start_step=5)], max_epochs=2)
    assert messages == [] and bool((model.head.bias == 0.0).all())
