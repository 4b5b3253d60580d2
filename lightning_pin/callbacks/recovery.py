"""Recovery around pinned faults: distillation from the unpinned model, and training until recovered.

- :func:`distillation_loss`: KL divergence between temperature-softened logits (Hinton et al.), for
  a ``training_step`` of your own;
- :class:`DistillFromBaseline`: adds that loss to any ``training_step`` that calls the module on its
  inputs, with the module as it was at fit start (before any pin is forced) as the teacher;
- :class:`StopWhenRecovered`: stops the fit once the tracked metric of
  :class:`~lightning_pin.PinMonitor` has stayed within its tolerance of the baseline for
  ``patience`` validations in a row (the budget, ``max_epochs`` / ``max_steps``, is the cap).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_pin.core.errors import PinError

__all__ = ["DistillFromBaseline", "StopWhenRecovered", "distillation_loss"]


def distillation_loss(student: Tensor, teacher: Tensor, temperature: float = 2.0) -> Tensor:
    """``T^2 * KL(softmax(teacher / T) || softmax(student / T))``, averaged over the batch.

    The ``T^2`` factor keeps the gradient's scale independent of the temperature.

    Example::

        >>> import torch
        >>> logits = torch.tensor([[2.0, 0.0, -1.0]])
        >>> float(distillation_loss(logits, logits))
        0.0
        >>> bool(distillation_loss(logits, -logits) > 0)
        True
    """
    t = float(temperature)
    log_student = torch.log_softmax(student.float() / t, dim=-1)
    log_teacher = torch.log_softmax(teacher.float() / t, dim=-1)
    return torch.nn.functional.kl_div(log_student, log_teacher, reduction="batchmean", log_target=True) * t * t


class DistillFromBaseline(Callback):
    """Retrain around pinned faults with the unpinned model as a teacher.

    At fit start (before :class:`~lightning_pin.PinCallback` forces any pin) the module is copied
    and frozen: that copy is the teacher. Every training step then adds
    ``weight * distillation_loss(student_logits, teacher_logits, temperature)`` to the loss the
    module's ``training_step`` returns. The student's logits are the output of the module's own
    call in ``training_step`` (``self(x)``), caught with a forward hook, so no extra forward runs;
    the teacher sees the same inputs. The teacher is saved in the callback's state, so a resumed
    fit keeps distilling from the unpinned model, not from the pinned weights of the checkpoint.

    Args:
        weight: Factor of the distillation term (the task loss keeps factor 1).
        temperature: Softens both distributions; 1 compares the plain softmax outputs.
        teacher: A teacher of your own (default: the module at fit start).

    Raises:
        PinError: When built, for a negative weight or a temperature that is not positive. During
            a training step, when ``training_step`` never calls the module (nothing to distill).

    Example::

        >>> import lightning.pytorch as pl
        >>> from lightning_pin import Pin, PinCallback
        >>> from lightning_pin.callbacks.recovery import DistillFromBaseline
        >>> callbacks = [PinCallback([Pin("backbone.head.weight", fraction=0.2, value=0.0)]),
        ...              DistillFromBaseline(weight=1.0, temperature=2.0)]
        >>> callbacks[1].weight, callbacks[1].temperature
        (1.0, 2.0)
    """

    def __init__(self, weight: float = 1.0, temperature: float = 2.0, teacher: Optional[nn.Module] = None) -> None:
        if not (weight >= 0 and math.isfinite(weight)):
            raise PinError(f"DistillFromBaseline: weight must be a finite number >= 0, got {weight!r}")
        if not (temperature > 0 and math.isfinite(temperature)):
            raise PinError(f"DistillFromBaseline: temperature must be a finite number > 0, got {temperature!r}")
        self.weight = float(weight)
        self.temperature = float(temperature)
        self.teacher = teacher
        self._given = teacher is not None
        self._saved: Optional[Mapping[str, Tensor]] = None
        self._restore: Optional[tuple[pl.LightningModule, Any]] = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(weight=self.weight, temperature=self.temperature)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._given:
            # Before on_train_start, where PinCallback forces the pins: the unpinned weights.
            self.teacher = copy.deepcopy(pl_module)
            if self._saved is not None:  # a resume: the weights of the saved teacher
                self.teacher.load_state_dict(self._saved)
                self._saved = None
        self.teacher.eval().requires_grad_(False)
        self._wrap(pl_module)

    def _wrap(self, pl_module: pl.LightningModule) -> None:
        original = pl_module.training_step
        teacher, weight, temperature = self.teacher, self.weight, self.temperature
        calls: list[tuple[tuple, Any]] = []

        def catch(module: nn.Module, args: tuple, output: Any) -> None:
            calls.append((args, output))

        def training_step(*args: Any, **kwargs: Any) -> Any:
            calls.clear()
            handle = pl_module.register_forward_hook(catch)
            try:
                out = original(*args, **kwargs)
            finally:
                handle.remove()
            if not calls:
                raise PinError(
                    f"DistillFromBaseline: {type(pl_module).__name__}.training_step never calls the module "
                    "(self(x)), so there are no logits to distill; add distillation_loss to your own step instead"
                )
            inputs, student = calls[0]
            with torch.no_grad():
                target = teacher(*inputs)
            extra = weight * distillation_loss(_logits(student), _logits(target), temperature)
            pl_module.log("distill_loss", extra.detach(), prog_bar=False)
            if isinstance(out, Mapping):
                return {**out, "loss": out["loss"] + extra}
            return out + extra

        pl_module.training_step = training_step  # type: ignore[method-assign]
        self._restore = (pl_module, original)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._restore is not None:
            module, _ = self._restore
            # Drop the instance attribute: the class's training_step shows through again.
            module.__dict__.pop("training_step", None)
            self._restore = None

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.teacher is None or self._given:
            return {}
        return {"teacher": {k: v.detach().cpu() for k, v in self.teacher.state_dict().items()}}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved = state_dict.get("teacher")


def _logits(output: Any) -> Tensor:
    return output.logits if hasattr(output, "logits") else output


class StopWhenRecovered(Callback):
    """Stop training once the pinned model is back within tolerance of its baseline, and stays there.

    After every validation it reads the :class:`~lightning_pin.PinMonitor` of the trainer's
    :class:`~lightning_pin.PinCallback` (its baseline, tolerance and the value just recorded); after
    ``patience`` validations in a row within tolerance it stops the fit. The budget
    (``max_epochs``, ``max_steps``) caps it as usual. :attr:`recovered_step` is the optimizer step
    of the first validation of that run of ``patience``.

    Args:
        patience: Validations in a row within tolerance before stopping.

    Raises:
        PinError: When built, for ``patience < 1``; at fit start, when no PinCallback with a
            PinMonitor that tracks accuracy is among the trainer's callbacks.

    Example::

        >>> from lightning_pin.callbacks.recovery import StopWhenRecovered
        >>> StopWhenRecovered(patience=2).patience
        2
    """

    def __init__(self, patience: int = 2) -> None:
        if not (isinstance(patience, int) and patience >= 1):
            raise PinError(f"StopWhenRecovered: patience must be an int >= 1, got {patience!r}")
        self.patience = patience
        self.recovered_step: Optional[int] = None
        self.stopped_step: Optional[int] = None
        self._monitor: Any = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        monitors = [getattr(cb, "monitor", None) for cb in trainer.callbacks if type(cb).__name__ == "PinCallback"]
        monitors = [m for m in monitors if m is not None and m.tracks_accuracy]
        if not monitors:
            raise PinError(
                "StopWhenRecovered needs a PinCallback whose PinMonitor tracks accuracy among the trainer's "
                "callbacks: PinCallback(pins, monitor=PinMonitor(accuracy=True))"
            )
        self._monitor = monitors[0]
        self.recovered_step = self.stopped_step = None

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # on_validation_end: after every callback's on_validation_epoch_end, so PinMonitor has recorded.
        p = self._monitor.preservation if self._monitor is not None else None
        if p is None or trainer.sanity_checking or not p.history or p.history[-1][0] != trainer.global_step:
            return
        streak = 0
        for step, value in reversed(p.history):
            if not p.within(value):
                break
            streak += 1
            first = int(step)
        if streak < self.patience:
            return
        self.recovered_step = first
        self.stopped_step = trainer.global_step
        trainer.should_stop = True
        rank_zero_info(
            f"StopWhenRecovered: {self._monitor.name} within {p.tolerance:g} of its baseline for {streak} "
            f"validations (since step {first}): stopping at step {trainer.global_step}"
        )
