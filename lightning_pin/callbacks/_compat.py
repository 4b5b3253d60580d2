"""Every private Lightning API lightning-pin relies on, in one place, with why it is needed.

Checked against lightning 2.6.6. If a Lightning release moves one of these, this module is the
only one to change, and the tests that exercise each function (``tests/test_trainer_paths.py``,
``tests/test_monitor.py``, ``tests/test_ddp.py``) say which.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher


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
