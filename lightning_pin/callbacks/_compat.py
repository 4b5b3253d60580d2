"""Every private Lightning API lightning-pin relies on, in one place, with why it is needed.

Checked against lightning 2.6.6. If a Lightning release moves one of these, this module is the
only one to change, and the tests that exercise each function (``tests/test_trainer_paths.py``,
``tests/test_monitor.py``, ``tests/test_ddp.py``) say which.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch import nn

try:  # lightning >= 2.6: WeightAveraging and EMAWeightAveraging
    from lightning.pytorch.callbacks import WeightAveraging
except ImportError:
    WeightAveraging = None

__all__ = ["averaged_modules", "runs_in_spawned_workers", "setup_validation_data", "watch_weight_averaging"]


def runs_in_spawned_workers(trainer: pl.Trainer) -> bool:
    """Whether this fit runs in processes spawned from the user's (``ddp_spawn``, ``ddp_notebook``).

    Why private: Lightning exposes no public flag for it. The callback object in the user's
    process then never runs a hook, so rank 0 leaves the pin state behind for ``verify()``.
    """
    return isinstance(trainer.strategy.launcher, _MultiProcessingLauncher)


def setup_validation_data(trainer: pl.Trainer) -> None:
    """Make ``trainer.val_dataloaders`` available before the first validation, if it is not yet.

    Why private: Lightning sets validation data up lazily, in its fit loop, only when an epoch
    validates; the monitor measures the baseline accuracy in ``on_train_start``, before that. This
    does what the fit loop does: ``val_loop.setup_data()`` with the trainer in its validating
    state, then back to training. ``_data_source.is_defined()`` says whether the user gave any
    validation data at all.
    """
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    source = getattr(val_loop, "_data_source", None)
    if trainer.val_dataloaders is None and (source is None or source.is_defined()):
        trainer.validating = True
        try:
            val_loop.setup_data()
        finally:
            trainer.training = True


def watch_weight_averaging(trainer: pl.Trainer, after_update: Callable[[nn.Module], None]) -> list[Callable[[], None]]:
    """Call ``after_update(averaged_module)`` right after each update of the averaged copy that
    Lightning's weight-averaging callbacks keep; return functions that undo the watching.

    Why private: ``StochasticWeightAveraging`` and ``WeightAveraging`` (``EMAWeightAveraging`` and
    any subclass) keep their copy in ``_average_model`` and update it from their own hooks, in
    whatever order the callbacks are listed; no public hook runs after their update. The update
    rounds pinned values (EMA's ``decay * a + (1 - decay) * b`` moves a pinned value by one ulp even
    when ``a == b``), and the copy goes into checkpoints and back into the module at the end: so
    the pins are written into the copy right after every update, whatever the callback order.
    """
    undo: list[Callable[[], None]] = []
    for callback in trainer.callbacks:
        if isinstance(callback, StochasticWeightAveraging):
            update = callback.update_parameters  # a staticmethod: (average_model, model, n_averaged, avg_fn)

            def swa_update(average_model: Any, *args: Any, _update: Any = update, **kwargs: Any) -> None:
                _update(average_model, *args, **kwargs)
                after_update(average_model)

            callback.update_parameters = swa_update  # type: ignore[method-assign]
            undo.append(functools.partial(callback.__dict__.pop, "update_parameters", None))
        elif WeightAveraging is not None and isinstance(callback, WeightAveraging):
            averaged = callback._average_model
            if averaged is None:
                continue
            update = averaged.update_parameters

            def ema_update(*args: Any, _update: Any = update, _averaged: Any = averaged, **kwargs: Any) -> None:
                _update(*args, **kwargs)
                after_update(_averaged.module)

            averaged.update_parameters = ema_update  # an instance attribute: nn.Module keeps it in __dict__
            undo.append(functools.partial(averaged.__dict__.pop, "update_parameters", None))
    return undo


def averaged_modules(trainer: pl.Trainer) -> list[tuple[str, nn.Module]]:
    """``(callback name, averaged module)`` of each weight-averaging callback that holds a copy
    (see :func:`watch_weight_averaging` for why this reads ``_average_model``)."""
    found = []
    for callback in trainer.callbacks:
        averaged = getattr(callback, "_average_model", None) if _is_weight_averaging(callback) else None
        if isinstance(callback, StochasticWeightAveraging) and averaged is not None:
            found.append((type(callback).__name__, averaged))
        elif averaged is not None:
            found.append((type(callback).__name__, averaged.module))
    return found


def _is_weight_averaging(callback: Any) -> bool:
    return isinstance(callback, StochasticWeightAveraging) or (
        WeightAveraging is not None and isinstance(callback, WeightAveraging)
    )
