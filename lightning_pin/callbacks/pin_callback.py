"""PinCallback: the thin Lightning adapter. Its hooks decide *when*; the engine does the work."""

from __future__ import annotations

import contextlib
import multiprocessing.context
import os
import pickle
import tempfile
import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.optim import Optimizer
from torch.optim.swa_utils import AveragedModel
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_pin.callbacks._compat import averaged_modules, runs_in_spawned_workers, watch_weight_averaging
from lightning_pin.callbacks.late_pins import warn_late_pins
from lightning_pin.core.buffers import BufferHold
from lightning_pin.core.compiled_step import install
from lightning_pin.core.driver import LIVE, Collective, StepDriver, load_pin_state, pin_state, ranks_agree
from lightning_pin.core.engine import PinEngine
from lightning_pin.core.errors import PinError
from lightning_pin.core import kinds
from lightning_pin.core.handle import as_pins
from lightning_pin.core.modules import ParameterWatch, unwrap
from lightning_pin.callbacks.monitor import PinMonitor
from lightning_pin.core.plan import check_targets_fit, refuse_sparse_gradients, resolve
from lightning_pin.core.state import find_pin_states
from lightning_pin.core.kinds.neuron import NeuronPin
from lightning_pin.core.spec import Pin

__all__ = ["PinCallback"]


_VERIFY_CHOICES = ("step", "epoch", "end", "never")
# Lightning precisions that cast the parameters themselves, in strategy.setup.
_TRUE_PRECISION = {"16-true": torch.float16, "bf16-true": torch.bfloat16}
# Unfitted callbacks by their pins' fingerprints (see state_key). Fitting ones are in core's LIVE registry.
_UNFITTED: dict[tuple[str, ...], weakref.WeakSet] = {}


class PinCallback(Callback):
    r"""Pin chosen parameters, whole tensors or single elements, to exact values while training.

    After every optimizer step and at the end of training, each pinned element equals its target
    bit for bit, whatever the optimizer, precision, accumulation, clipping or strategy:

    - values of a pin are forced in ``on_train_batch_start`` of the first step where it is
      active, so that step's forward already sees them, and the optimizer statistics of its
      elements (momentum, Adam moments, ...) are zeroed;
    - gradients of pinned elements are zeroed in ``on_before_optimizer_step`` (after the DDP
      all-reduce and the AMP unscale, before clipping), keeping them out of momentum, adaptive
      statistics and the clip norm; wholly pinned tensors get ``grad = None`` so optimizers skip
      them entirely;
    - targets are written back by a step post-hook on every optimizer, right after each real
      step, which undoes weight decay and any leftover momentum;
    - a pin that freezes whole modules (``Pin("encoder.*")``) holds their buffers too (BatchNorm
      running statistics, as ``BaseFinetuning.freeze(train_bn=False)``), unless ``buffers=False``.

    Pins are resolved on ``trainer.lightning_module``, the object actually trained, at fit start,
    and every bad spec raises :class:`~lightning_pin.PinError` before any weight changes.

    Args:
        pins: :class:`~lightning_pin.Pin`\ s, or mappings with the same keys (Hydra / YAML).
        strict: Raise when a checkpoint holds pin state this callback cannot match (otherwise warn
            and start those pins afresh).
        verify: When to check that every active pinned element is on target, raising
            :class:`~lightning_pin.PinError` if not: after every ``"step"``, at the end of every
            training ``"epoch"``, at the ``"end"`` of training (default), or ``"never"``.
        verbose: Print the summary of what is pinned at fit start (rank zero).
        monitor: What to measure, log (under ``pin/...``) and report: a
            :class:`~lightning_pin.PinMonitor`, ``True`` for ``PinMonitor()`` (pin drift, violations
            and weight drift on logging steps; no accuracy tracking), or ``False`` for nothing.
        compile_step: Run each optimizer's step through ``torch.compile`` with the restore of pinned
            values fused into it (see :mod:`lightning_pin.core.compiled_step`): torch's own
            optimizers only; any other step stays eager, with one warning saying why.

    Raises:
        PinError: When built, for ``pins`` that are not pins or mappings of their keys, an unknown
            ``verify``, or a ``monitor`` that is neither a ``PinMonitor`` nor a bool. At fit start,
            before any weight changes, for a pin that cannot be honoured on the module being
            trained (see :func:`~lightning_pin.core.plan.resolve`), ranks whose pins differ, or a
            strategy whose shards hide element coordinates (FSDP1, DeepSpeed). On resume with
            ``strict=True``, for saved pin state these pins cannot match. With ``verify`` other
            than ``"never"``, for a pinned element found off target.

    Example::

        >>> import lightning as L
        >>> from lightning_pin import Pin, PinCallback, PinMonitor
        >>> cb = PinCallback([
        ...     Pin("encoder.*"),                                        # freeze the encoder
        ...     Pin("head.weight", indices=[(0, 1), (2, 3)], value=[25.0, 5.0]),
        ...     Pin("head.bias", value=0.0, start_step=100),             # zero it from step 100
        ... ])
        >>> # track accuracy too: baseline, forced, after every validation; report at the end
        >>> cb = PinCallback([Pin("head.bias", value=0.0)], monitor=PinMonitor(accuracy=True))
        >>> trainer = L.Trainer(callbacks=[cb])  # doctest: +SKIP
        >>> trainer.fit(model)  # doctest: +SKIP
        >>> cb.verify(model)  # doctest: +SKIP
    """

    def __init__(
        self,
        pins: Union[Pin, Mapping[str, Any], Sequence[Union[Pin, Mapping[str, Any]]]] = (),
        strict: bool = True,
        verify: Literal["step", "epoch", "end", "never"] = "end",
        verbose: bool = True,
        monitor: Union[PinMonitor, bool] = True,
        compile_step: bool = False,
    ) -> None:
        if verify not in _VERIFY_CHOICES:
            raise PinError(f"verify must be one of {_VERIFY_CHOICES}, got {verify!r}")
        if not isinstance(monitor, (PinMonitor, bool)):
            raise PinError(f"monitor must be a PinMonitor, True or False, got {type(monitor).__name__}")
        self.pins: list[Pin] = as_pins(pins)
        # Weight pins go to the engine; output kinds' pins (NeuronPin) to their runtimes' forward hooks.
        self._weight_pins, self._output_pins = kinds.split(self.pins)
        #: The runtimes of the output kinds' pins (stuck neurons), by kind name, from fit start.
        self.outputs: dict[str, Any] = {}
        self._fingerprints = [p.fingerprint() for p in self.pins]
        # Unfitted live callbacks with these pins (see state_key); a fit takes this one out.
        twins = _UNFITTED.setdefault(tuple(self._fingerprints), weakref.WeakSet())
        self._copy_index = len(twins)
        twins.add(self)
        self.strict = strict
        self.verify_at = verify
        self.verbose = verbose
        self.compile_step = compile_step
        #: What is measured, logged and reported (None: nothing).
        self.monitor: Optional[PinMonitor] = PinMonitor() if monitor is True else (monitor or None)
        self.engine: Optional[PinEngine] = None
        #: Buffers of the modules the pins freeze (BatchNorm running statistics), held with them.
        self.buffers: Optional[BufferHold] = None
        self._loaded_state: Optional[dict[str, Any]] = None
        self._handles: list[RemovableHandle] = []
        self._unwatch: list[Callable[[], None]] = []
        self._fitting = False
        #: global_step at the end of the last fit (None before): what "active" means without a step.
        self._end_step: Optional[int] = None
        # The step's order (core/driver.py), shared with pin(): Lightning's hooks call it. One per fit.
        self._driver: Optional[StepDriver] = None
        # Whether this fit forced the pins into the weights (on_train_start). Lightning skips
        # training entirely for max_steps=0, max_epochs=0, limit_train_batches=0 or an empty
        # loader: then a check must say that the pins were never applied, not just "off target".
        self._applied = False
        # The parameters the pins were resolved on, watched from train start (after Lightning's
        # precision plugins cast and the strategy moved the module) before every step.
        self._watch: Optional[ParameterWatch] = None
        # Under ddp_spawn this object is pickled into the workers and the copy in the main
        # process never runs a hook; rank 0 leaves its state in this file for verify().
        self._handoff = os.path.join(tempfile.gettempdir(), f"lightning_pin-{uuid.uuid4().hex}.pt")

    @property
    @override
    def state_key(self) -> str:
        # Derived from the specs, so a resume with the same pins finds its state and two
        # callbacks with different pins keep theirs apart. A second live callback with the same
        # pins gets a distinct key, so that Trainer(...) accepts it and on_fit_start can say
        # clearly what is wrong (Lightning itself refuses two stateful callbacks with one key).
        if self._copy_index:
            return self._generate_state_key(pins=self._fingerprints, copy=self._copy_index)
        return self._generate_state_key(pins=self._fingerprints)

    def _legacy_state_key(self) -> str:
        """The key these pins' state had before the neuron feature axis (``NeuronPin(axis=None)`` then
        meant axis 1 and hashed so): a checkpoint saved then still resumes, on axis 1."""
        fingerprints = [p.fingerprint(legacy=True) if isinstance(p, NeuronPin) else p.fingerprint() for p in self.pins]
        if self._copy_index:
            return self._generate_state_key(pins=fingerprints, copy=self._copy_index)
        return self._generate_state_key(pins=fingerprints)

    def __getstate__(self) -> dict[str, Any]:
        if multiprocessing.context.get_spawning_popen() is not None:
            # Pickled into a process being spawned (ddp_spawn, in the main process, before any
            # hook runs): a `when` that cannot travel would fail deep in pickle, naming no pin.
            _refuse_unpicklable_when(self._weight_pins)
        return self.__dict__.copy()

    # ------------------------------------------------------------------------------------------
    # Set-up and tear-down

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # True half precision casts the module right after this hook: check that explicit targets
        # survive the cast now, while a rejected spec still leaves the module as the user built it.
        cast = _TRUE_PRECISION.get(str(trainer.precision))
        if stage != "fit" or cast is None or is_overridden("configure_model", pl_module):
            return  # (configure_model builds layers later: on_fit_start checks those after the cast)
        check_targets_fit(resolve(self._weight_pins, pl_module, warn=lambda message: None), cast)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _refuse_unsupported_strategy(trainer)
        module = trainer.lightning_module
        try:
            plan, rejected = resolve(self._weight_pins, module, warn=rank_zero_warn), None
            refuse_sparse_gradients(plan, module)
            outputs = {kind.kind: kind.hold(specs, module) for kind, specs in self._output_pins}
        except PinError as err:
            plan, rejected = None, err
        # A spec can fail on one rank only (a file missing on one node): every rank must raise,
        # or the others would wait forever in the next collective; and every rank must hold the same pins.
        reduce_max = _collective(trainer)
        ranks_agree(plan, rejected, reduce_max, pl_module.device,
                    rank=trainer.global_rank, stops="every rank stops before training")
        _check_other_pin_callbacks(trainer, self)
        LIVE.refuse_conflicts(plan, module, "PinCallback")
        self.engine = PinEngine(plan)
        self.outputs = outputs
        self.buffers = BufferHold(plan, module)
        # A `when` decision of the last fit's last batch holds until this fit's first batch decides.
        hits = frozenset() if self._driver is None else self._driver.hits
        self._driver = StepDriver(self.engine, self.buffers, self.outputs, reduce_max, pl_module.device,
                                  optimizers=trainer.optimizers)
        self._driver.hits = hits
        self._fitting = True
        LIVE.add(module, self, "PinCallback")
        self._applied = False
        _UNFITTED.get(tuple(self._fingerprints), set()).discard(self)
        if self.monitor is not None:
            self.monitor.setup(trainer, module, self.engine)
        if self._loaded_state is not None:
            self._load(self._loaded_state)
            self._loaded_state = None
        if plan.pins:
            self._handles = self.engine.attach(trainer.optimizers)
            if self.buffers:  # before the step check, which checks the buffers too
                self._handles.append(self.buffers.attach(self.engine))
            if self.compile_step:
                # Without clipping nothing reads the gradients between backward and the step: the
                # compiled step ignores pinned gradients, and masking them in memory would cost a
                # pass over every gradient it holds.
                self.engine.grads_read_before_step = _clips_gradients(trainer, pl_module)
                self._handles += install(self.engine, trainer.optimizers, rank_zero_warn)
            if self.verify_at == "step":
                self._handles.append(self.engine.register_restore_hook(lambda stats: self._check()))
            self._unwatch = watch_weight_averaging(trainer, self._pin_averaged)
        for hold in self.outputs.values():
            self._handles += hold.attach()
        if self.verbose and (plan.pins or self.outputs):
            held = self.buffers.summary()
            summary = "\n".join(
                [plan.summary()] * bool(plan.pins) + [held] * bool(held) + [h.summary() for h in self.outputs.values()]
            )
            rank_zero_info(f"PinCallback: pins resolved on {type(module).__name__}\n{summary}")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Force the pins of the first step here, before any other callback's on_train_epoch_start
        # can sample the weights (weight averaging). On resume the active pins' targets come
        # from the callback state: the weights the first forward sees hold them, whatever the
        # checkpoint's weights were.
        if self.engine is None:
            return
        if self.monitor is not None:
            with contextlib.ExitStack() as unfaulted:  # the baseline: no pin forced yet, no neuron stuck
                for hold in self.outputs.values():
                    unfaulted.enter_context(hold.paused())
                self.monitor.before_force(trainer, pl_module)
        warn_late_pins(trainer, self.pins)  # the steps of an epoch are known from here on
        # On resume the module's buffers come from the checkpoint: they hold what the saved run held.
        self._driver.force(trainer.global_step)
        self._watch = ParameterWatch(pl_module, self.engine.plan.parameters)
        self._applied = True
        for _, averaged in averaged_modules(trainer):
            self._pin_averaged(averaged)  # copied at setup, before any pin was forced
            for hold in self.outputs.values():  # the same chip: the averaged copy's forward has the stuck neurons
                self._handles += hold.attach_to(averaged.module if isinstance(averaged, AveragedModel) else averaged)
        if self.monitor is not None:
            self.monitor.after_force(trainer, pl_module, self.engine)

    def _pin_averaged(self, averaged: nn.Module) -> None:
        """Write the pins into an averaged copy of the weights, right after each of its updates."""
        if self._driver is not None:
            self._driver.write_into(averaged)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After every callback's on_train_end (weight averaging copies its average into the
        # module there): a foreign write after the last restore is caught here, in any order.
        self._end_step = trainer.global_step
        if self.verify_at != "never":
            self._check(averaged_modules(trainer))
        if (
            runs_in_spawned_workers(trainer)
            and trainer.local_rank == 0
            and self.engine is not None
        ):
            torch.save(self.state_dict(), self._handoff)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for undo in self._unwatch:
            undo()
        self._unwatch = []
        self._fitting = False
        LIVE.discard(self)
        if self.engine is not None:
            self.engine.detach()
        if self.monitor is not None:
            self.monitor.teardown()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning runs no teardown after an exception: a later pin() or fit on this module must not
        # meet these pins as live.
        LIVE.discard(self)

    # ------------------------------------------------------------------------------------------
    # The step

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.engine is None:
            return
        self._driver.decide(trainer.global_step, batch, batch_idx)
        if self.monitor is not None:
            self.monitor.on_train_batch_start(trainer, self.engine)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        for hold in self.outputs.values():  # the forwards after this step (validation) see its window
            hold.set_step(trainer.global_step)
        if self.monitor is not None and self.engine is not None:
            self.monitor.on_train_batch_end(trainer, pl_module)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if self.engine is None or not self.engine.plan.pins:
            return
        if self._watch is not None and not self._watch.intact():
            self._refuse_changed_parameter()
        # Under manual optimization global_step moves inside a batch: re-check the windows.
        self._driver.advance(trainer.global_step, outputs=False)
        self._driver.before_step(optimizer)

    def _refuse_changed_parameter(self) -> None:
        name, change = self._watch.first_change() or ("?", "replaced")
        what = {
            "gone": "is gone from the module",
            "replaced": "is no longer the tensor the pins were resolved on",
        }.get(change, f"was {change}")
        raise PinError(
            f"PinCallback: before the optimizer step, the pinned parameter {name!r} {what} since training started "
            "(re-initialised, tied, replaced or cast by a callback or a hook during fit?): the pins hold the old "
            "tensor, not the one the module trains. Build, tie and cast the module before fit (in __init__, "
            "setup or configure_model)"
        )

    # ------------------------------------------------------------------------------------------
    # Checks

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.verify_at == "epoch":
            self._check()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is not None and self.engine is not None:
            self.monitor.on_train_end(trainer, pl_module, self.engine)

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.monitor is not None:
            self.monitor.on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is not None:
            self.monitor.on_validation_epoch_end(trainer, pl_module)

    def _checked_ids(self) -> frozenset[int]:
        engine = self.engine
        if engine.last_step_active is None and self._end_step is not None:
            # No optimizer step ran (max_steps=0, a manual loop that never steps): the pins of
            # that step must hold all the same; nothing passes for want of a step.
            return engine.active | engine.ids_at(self._end_step)
        return engine.checked_ids

    def _check(self, averaged: Sequence[tuple[str, nn.Module]] = ()) -> None:
        if self.engine is None:
            return
        pin_ids = self._checked_ids()
        if not averaged:
            # One sync for the whole check: count what is off on the device, name it only if any is.
            count = self.engine.off_count(pin_ids)
            if count is not None and self.buffers is not None and self.buffers.targets:
                held = self.buffers.off_count()
                count = None if held is None else count + held.to(count.device)
            if count is not None and not bool(count):
                return
        self._raise_if_off(self.engine.violations(pin_ids=pin_ids) + self._buffer_violations())
        for owner, module in averaged:
            parameters = dict(module.named_parameters(remove_duplicate=False))
            self._raise_if_off(self.engine.violations(parameters, pin_ids), where=f" in {owner}'s averaged model")

    def verify(self, module: Optional[nn.Module] = None) -> None:
        """Raise :class:`~lightning_pin.PinError` naming every pinned element that is off target.

        Checks every pin that was active at the last optimizer step (or, before any step, every
        pin active now) against ``module``'s parameters, by name; ``module`` defaults to the
        module the pins were resolved on.

        Raises:
            PinError: a pinned element is off target (the message names them), ``module`` lacks a
                pinned parameter, or the callback has not been fitted yet.
        """
        if self.engine is None and module is not None and os.path.exists(self._handoff):
            self._adopt_worker_state(module)
        if self.engine is None:
            raise PinError("verify() needs a PinCallback that has been fitted: call trainer.fit(...) first")
        pin_ids = self._checked_ids()
        parameters = None if module is None else dict(unwrap(module).named_parameters(remove_duplicate=False))
        held = self._buffer_violations(None if module is None else unwrap(module))
        self._raise_if_off(self.engine.violations(parameters, pin_ids) + held)

    def _buffer_violations(self, module: Optional[nn.Module] = None) -> list[Any]:
        return [] if self.buffers is None else self.buffers.violations(module)

    def _adopt_worker_state(self, module: nn.Module) -> None:
        """Take over the state a spawned rank 0 left behind (see ``on_fit_end``)."""
        state = self._worker_state()
        os.remove(self._handoff)
        engine = PinEngine(resolve(self._weight_pins, unwrap(module), warn=lambda message: None))
        engine.load_state_dict(state, strict=True)
        self.engine = engine

    def _worker_state(self) -> dict[str, Any]:
        return torch.load(self._handoff, map_location="cpu", weights_only=True)

    def _raise_if_off(self, violations: list, where: str = "") -> None:
        if self.engine is not None and self.engine.sharded and torch.distributed.is_initialized():
            # Each rank checked its own shards: the verdict is the sum, so that every rank raises
            # together (every rank must call verify).
            total = torch.tensor([sum(v.count for v in violations)], device=self.engine.device)
            torch.distributed.all_reduce(total)
            if int(total) and not violations:
                raise PinError(f"{int(total)} pinned element(s) off target on other ranks' shards")
        if violations:
            total = sum(v.count for v in violations)
            if not self._applied and self.engine is not None and self.engine.last_step_active is None:
                raise PinError(
                    "the fit ran no training step (max_steps=0, max_epochs=0, limit_train_batches=0 or an empty "
                    f"train dataloader?), so the pins were never applied: {total} pinned element(s) still hold "
                    f"the module's own values{where}. Train at least one step, or remove the PinCallback from a "
                    "run that does not train:\n" + "\n".join(f"  {v}" for v in violations)
                )
            raise PinError(
                f"{total} pinned element(s) off target{where}:\n" + "\n".join(f"  {v}" for v in violations)
            )

    # ------------------------------------------------------------------------------------------
    # Checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.engine is None:
            if os.path.exists(self._handoff):
                # After ddp_spawn: the state rank 0 left, so a checkpoint saved now keeps it.
                return self._worker_state()
            return dict(self._loaded_state) if isinstance(self._loaded_state, Mapping) else {}
        monitor = {} if self.monitor is None else {"monitor": self.monitor.state_dict()}
        return pin_state(self.engine, self.outputs, **monitor)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.engine is not None and self._handles:
            # Strategies that restore after setup (FSDP2, DeepSpeed) load after on_fit_start.
            self._load(state_dict)
        else:
            # Most strategies load before on_fit_start resolves the plan: keep it until then.
            self._loaded_state = state_dict

    def _load(self, state: Any) -> None:
        saved = load_pin_state(self.engine, self.outputs, state, self.strict, rank_zero_warn)
        if self.monitor is not None and saved is not None:
            self.monitor.load_state_dict(saved.monitor)

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning silently skips callback state whose key matches no callback. Pin state that
        # no PinCallback of this trainer claims means targets would be lost: refuse instead.
        states = checkpoint.get("callbacks", {})
        saved = [key for key in find_pin_states({"callbacks": states}) if states[key].get("pins")
                 or states[key].get("outputs")]
        owners = _owners(trainer, states, saved)
        mine = [key for key, cb in owners.items() if cb is self and key != self.state_key]
        if mine:
            # Saved under another key with these very pins (a copy index: another callback with
            # the same pins was alive when one of the two was built): this one owns it.
            self.load_state_dict(states[mine[0]])
        unmatched = [k for k in saved if k not in owners]
        ours = sorted(cb.state_key for cb in trainer.callbacks if isinstance(cb, PinCallback))
        if unmatched and self.strict and self is _first_pin_callback(trainer):
            raise PinError(
                f"the checkpoint holds pin state {unmatched} that no PinCallback of this trainer matches "
                f"(theirs: {ours}). Resume with the same pins, or pass strict=False to drop it."
            )
        if unmatched and not self.strict:
            rank_zero_warn(f"PinCallback(strict=False): dropping saved pin state {unmatched}")


def _owners(trainer: pl.Trainer, states: Mapping[str, Any], saved: Sequence[str]) -> dict[str, PinCallback]:
    """Which PinCallback of ``trainer`` owns each saved pin state: by exact key, else the one
    callback not yet served whose pins have the state's fingerprints."""
    callbacks = [cb for cb in trainer.callbacks if isinstance(cb, PinCallback)]
    owners = {cb.state_key: cb for cb in callbacks if cb.state_key in saved}
    for cb in callbacks:
        legacy = cb._legacy_state_key()
        if legacy != cb.state_key and legacy in saved and cb not in owners.values():
            owners[legacy] = cb
    for key in saved:
        if key not in owners:
            same = [
                cb
                for cb in callbacks
                if cb not in owners.values() and list(states[key].get("fingerprints", [])) == cb._fingerprints
            ]
            if len(same) == 1:
                owners[key] = same[0]
    return owners


def _collective(trainer: pl.Trainer) -> Optional[Collective]:
    """The strategy's all-reduce (max) for the driver's rank agreement (core/driver.py); None on one process."""
    if trainer.world_size <= 1:
        return None
    strategy = trainer.strategy

    def reduce_max(tensor: torch.Tensor) -> torch.Tensor:
        return strategy.reduce(tensor, reduce_op="max")

    return reduce_max


def _check_other_pin_callbacks(trainer: pl.Trainer, callback: PinCallback) -> None:
    """Several PinCallbacks on one trainer: identical pins twice are a mistake. (Explicit targets that
    disagree on one element are refused by the registry of live pins, ``LIVE`` in core/driver.py.)"""
    others = [cb for cb in trainer.callbacks if isinstance(cb, PinCallback) and cb is not callback]
    twins = [cb for cb in others if cb._fingerprints == callback._fingerprints]
    if twins:
        raise PinError(
            f"{1 + len(twins)} PinCallbacks on this trainer hold identical pins {callback.pins!r}: "
            "pass them once (one PinCallback can hold any number of pins)"
        )


def _refuse_unpicklable_when(pins: Sequence[Pin]) -> None:
    """Every callable ``when`` must pickle: spawned processes receive the callback by pickle.

    Raises:
        PinError: naming the pin whose ``when`` cannot be pickled and the fix.
    """
    for each in pins:
        if callable(each.when):
            try:
                pickle.dumps(each.when)
            except Exception as err:  # PicklingError, AttributeError, TypeError: depends on the object
                name = getattr(each.when, "__qualname__", type(each.when).__name__)
                raise PinError(
                    f"{each!r}: when={name} cannot be sent to the processes strategy='ddp_spawn' starts "
                    f"({type(err).__name__}: {err}). Give a function defined at module level of an importable "
                    "module, or its import path as a string (when='package.module.function'); lambdas and "
                    "local functions cannot be pickled. Or use strategy='ddp', which does not pickle callbacks"
                ) from err


def _first_pin_callback(trainer: pl.Trainer) -> Optional[PinCallback]:
    return next((cb for cb in trainer.callbacks if isinstance(cb, PinCallback)), None)


def _refuse_unsupported_strategy(trainer: pl.Trainer) -> None:
    """Strategies whose parameters pins cannot address exactly: refuse, never pin wrong elements."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    name = type(trainer.strategy).__name__
    if isinstance(trainer.strategy, (FSDPStrategy, DeepSpeedStrategy)) or name.startswith(("FSDP", "DeepSpeed")):
        raise PinError(
            f"PinCallback does not support {name}: its flattened parameter shards hide element coordinates. "
            "Use ModelParallelStrategy with torch.distributed.fsdp.fully_shard (FSDP2) for sharded training, "
            'or strategy="ddp".'
        )


def _clips_gradients(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether Lightning reads the gradients between backward and the optimizer step: the Trainer
    clips (``gradient_clip_val``) or the module overrides ``configure_gradient_clipping``."""
    return bool(trainer.gradient_clip_val) or is_overridden("configure_gradient_clipping", pl_module)
