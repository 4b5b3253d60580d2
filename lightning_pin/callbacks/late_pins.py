"""A pin that starts after the run's last step is never applied: :func:`warn_late_pins` says so at the start of fit."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

__all__ = ["last_step", "warn_late_pins"]


def last_step(trainer: pl.Trainer) -> tuple[Optional[int], str]:
    """The number of optimizer steps the fit will run, and what says so; None when it is not known (no limit, or an
    iterable dataset of unknown length). The smaller of ``max_steps`` and ``max_epochs`` x the steps of an epoch."""
    bounds: list[tuple[int, str]] = []
    if trainer.max_steps is not None and trainer.max_steps >= 0:
        bounds.append((int(trainer.max_steps), f"trainer.max_steps={trainer.max_steps}"))
    batches = trainer.num_training_batches
    epochs = trainer.max_epochs
    if epochs is not None and epochs >= 0 and isinstance(batches, int) and not math.isinf(batches):
        accumulate = max(int(trainer.accumulate_grad_batches or 1), 1)
        per_epoch = math.ceil(batches / accumulate)
        bounds.append((epochs * per_epoch, f"max_epochs={epochs} x {per_epoch} steps per epoch"))
    return min(bounds) if bounds else (None, "")


def warn_late_pins(trainer: pl.Trainer, pins: Iterable[Any]) -> list[Any]:
    """Warn (rank 0) about every pin whose ``start_step`` is at or after the fit's last step: it would never be
    applied, which reads as "the model recovered" when nothing was forced. Returns the pins warned about."""
    total, why = last_step(trainer)
    if total is None:
        return []
    late = [pin for pin in pins if int(getattr(pin, "start_step", 0) or 0) >= total]
    for pin in late:
        rank_zero_warn(
            f"PinCallback: {pin!r} starts at step {pin.start_step}, but the run ends after step {total} ({why}): "
            "it is never applied. Lower its start_step or train longer."
        )
    return late
