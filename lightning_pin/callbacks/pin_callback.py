"""PinCallback: the thin Lightning adapter. Its hooks decide *when*; the engine does the work."""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pin.callbacks._compat import runs_in_spawned_workers
from lightning_pin.core.engine import PinEngine
from lightning_pin.core.errors import PinError
from lightning_pin.callbacks.monitor import PinMonitor
from lightning_pin.core.plan import resolve
from lightning_pin.core.spec import Pin

_VERIFY_CHOICES = ("step", "epoch", "end", "never")


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
      step, which undoes weight decay and any leftover momentum.

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
    ) -> None:
        if isinstance(pins, (Pin, Mapping)):
            pins = [pins]
        if isinstance(pins, (str, bytes)) or not isinstance(pins, Sequence):
            raise PinError(f"pins must be a Pin, a mapping or a list of them, got {type(pins).__name__}")
        if verify not in _VERIFY_CHOICES:
            raise PinError(f"verify must be one of {_VERIFY_CHOICES}, got {verify!r}")
        if not isinstance(monitor, (PinMonitor, bool)):
            raise PinError(f"monitor must be a PinMonitor, True or False, got {type(monitor).__name__}")
        self.pins: list[Pin] = [Pin.from_config(p) for p in pins]
        self.strict = strict
        self.verify_at = verify
        self.verbose = verbose
        #: What is measured, logged and reported (None: nothing).
        self.monitor: Optional[PinMonitor] = PinMonitor() if monitor is True else (monitor or None)
        self.engine: Optional[PinEngine] = None
        self._loaded_state: Optional[dict[str, Any]] = None
        self._handles: list[Any] = []
        self._when_hits: frozenset[int] = frozenset()
        # Under ddp_spawn this object is pickled into the workers and the copy in the main
        # process never runs a hook; rank 0 leaves its state in this file for verify().
        self._handoff = os.path.join(tempfile.gettempdir(), f"lightning_pin-{uuid.uuid4().hex}.pt")

    @property
    @override
    def state_key(self) -> str:
        # Derived from the specs, so a resume with the same pins finds its state and two
        # callbacks with different pins keep theirs apart.
        return self._generate_state_key(pins=[p.fingerprint() for p in self.pins])

    # ------------------------------------------------------------------------------------------
    # Set-up and tear-down

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _refuse_unsupported_strategy(trainer)
        module = trainer.lightning_module
        try:
            plan, rejected = resolve(self.pins, module, warn=rank_zero_warn), None
            _refuse_sparse_gradients(plan, module)
        except PinError as err:
            plan, rejected = None, err
        # A spec can fail on one rank only (a file missing on one node): every rank must raise,
        # or the others would wait forever in the next collective.
        _raise_if_any_rank_rejected(trainer, pl_module, rejected)
        _check_plans_agree(trainer, pl_module, plan)
        self.engine = PinEngine(plan)
        if self.monitor is not None:
            self.monitor.setup(trainer, module, self.engine)
        if self._loaded_state is not None:
            self.engine.load_state_dict(self._loaded_state, strict=self.strict, warn=rank_zero_warn)
            if self.monitor is not None:
                self.monitor.load_state_dict(self._loaded_state.get("monitor"))
            self._loaded_state = None
        if plan.pins:
            self._handles = self.engine.attach(trainer.optimizers)
            if self.verify_at == "step":
                self.engine._after_restore.append(self._check)
            if self.monitor is not None:
                self.engine._after_restore.append(self.monitor.after_restore)
        if self.verbose and plan.pins:
            rank_zero_info(f"PinCallback: pins resolved on {type(module).__name__}\n{plan.summary()}")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # On resume the active pins' targets come from the callback state: make the weights the
        # first forward sees hold them, whatever the checkpoint's weights were.
        if self.engine is not None:
            if self.monitor is not None:
                # Before force(): the baseline is measured before any pin is forced.
                self.monitor.on_train_start(trainer, pl_module, self.engine)
            self.engine.force()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
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
        if self.engine is not None:
            self.engine.detach()
            self.engine._after_restore.clear()
        if self.monitor is not None:
            self.monitor.teardown()

    # ------------------------------------------------------------------------------------------
    # The step

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.engine is None:
            return
        if self.engine.plan.pins:
            self._when_hits = self._evaluate_when(trainer, pl_module, batch, batch_idx)
            self.engine.set_active(self.engine.ids_at(trainer.global_step, self._when_hits))
        if self.monitor is not None:
            self.monitor.on_train_batch_start(trainer, self.engine)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.monitor is not None and self.engine is not None:
            self.monitor.on_train_batch_end(trainer, pl_module)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if self.engine is None or not self.engine.plan.pins:
            return
        # Under manual optimization global_step moves inside a batch: re-check the windows.
        self.engine.set_active(self.engine.ids_at(trainer.global_step, self._when_hits))
        self.engine.mask_grads(optimizer)

    def _evaluate_when(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> frozenset[int]:
        step = trainer.global_step
        candidates = [i for i, rp in enumerate(self.engine.plan.pins) if rp.when is not None and rp.in_window(step)]
        if not candidates:
            return frozenset()
        hits = [bool(self.engine.plan.pins[i].when(batch, batch_idx)) for i in candidates]
        if trainer.world_size > 1:
            # Each rank sees its own batch. A pin must hold on every rank or on none, or the
            # replicas diverge: it is active if any rank's batch asks for it.
            flags = torch.tensor(hits, dtype=torch.int32, device=pl_module.device)
            hits = [bool(x) for x in trainer.strategy.reduce(flags, reduce_op="max").tolist()]
        return frozenset(i for i, hit in zip(candidates, hits) if hit)

    # ------------------------------------------------------------------------------------------
    # Checks

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.verify_at == "epoch":
            self._check()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.verify_at in ("epoch", "end"):
            self._check()
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

    def _check(self) -> None:
        if self.engine is not None and self.engine.last_step_active is not None:
            self._raise_if_off(self.engine.violations(pin_ids=self.engine.last_step_active))

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
        pin_ids = self.engine.last_step_active
        if pin_ids is None:
            pin_ids = self.engine.active
        parameters = None if module is None else dict(module.named_parameters())
        self._raise_if_off(self.engine.violations(parameters, pin_ids))

    def _adopt_worker_state(self, module: nn.Module) -> None:
        """Take over the state a spawned rank 0 left behind (see ``on_fit_end``)."""
        state = self._worker_state()
        os.remove(self._handoff)
        engine = PinEngine(resolve(self.pins, module, warn=lambda message: None))
        engine.load_state_dict(state, strict=True)
        self.engine = engine

    def _worker_state(self) -> dict[str, Any]:
        return torch.load(self._handoff, map_location="cpu", weights_only=True)

    def _raise_if_off(self, violations: list) -> None:
        if self.engine is not None and self.engine.sharded and torch.distributed.is_initialized():
            # Each rank checked its own shards: the verdict is the sum, so that every rank raises
            # together (every rank must call verify).
            total = torch.tensor([sum(v.count for v in violations)], device=self.engine.device)
            torch.distributed.all_reduce(total)
            if int(total) and not violations:
                raise PinError(f"{int(total)} pinned element(s) off target on other ranks' shards")
        if violations:
            total = sum(v.count for v in violations)
            raise PinError(f"{total} pinned element(s) off target:\n" + "\n".join(f"  {v}" for v in violations))

    # ------------------------------------------------------------------------------------------
    # Checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.engine is None:
            if os.path.exists(self._handoff):
                # After ddp_spawn: the state rank 0 left, so a checkpoint saved now keeps it.
                return self._worker_state()
            return dict(self._loaded_state or {})
        state = self.engine.state_dict()
        if self.monitor is not None:
            state["monitor"] = self.monitor.state_dict()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.engine is not None and self._handles:
            # Strategies that restore after setup (FSDP2, DeepSpeed) load after on_fit_start.
            self.engine.load_state_dict(state_dict, strict=self.strict, warn=rank_zero_warn)
            if self.monitor is not None:
                self.monitor.load_state_dict(state_dict.get("monitor"))
        else:
            # Most strategies load before on_fit_start resolves the plan: keep it until then.
            self._loaded_state = state_dict

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning silently skips callback state whose key matches no callback. Pin state that
        # no PinCallback of this trainer claims means targets would be lost: refuse instead.
        saved = [
            key
            for key, state in checkpoint.get("callbacks", {}).items()
            if isinstance(key, str) and key.startswith("PinCallback") and state and state.get("pins")
        ]
        ours = {cb.state_key for cb in trainer.callbacks if isinstance(cb, PinCallback)}
        unmatched = [k for k in saved if k not in ours]
        if unmatched and self.strict and self is _first_pin_callback(trainer):
            raise PinError(
                f"the checkpoint holds pin state {unmatched} that no PinCallback of this trainer matches "
                f"(theirs: {sorted(ours)}). Resume with the same pins, or pass strict=False to drop it."
            )
        if unmatched and not self.strict:
            rank_zero_warn(f"PinCallback(strict=False): dropping saved pin state {unmatched}")


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


def _check_plans_agree(trainer: pl.Trainer, pl_module: pl.LightningModule, plan: Any) -> None:
    """Once at fit start: every rank must hold the same pins, or the replicas silently diverge."""
    if trainer.world_size <= 1:
        return
    digest = int(plan.fingerprint(), 16) & (2**62 - 1)
    # Two 31-bit halves, so the reduction is exact on any backend and dtype.
    halves = torch.tensor([digest >> 31, digest & (2**31 - 1)], dtype=torch.int64, device=pl_module.device)
    low = trainer.strategy.reduce(halves.clone(), reduce_op="min")
    high = trainer.strategy.reduce(halves.clone(), reduce_op="max")
    if not torch.equal(low, high):
        raise PinError(
            f"the ranks resolved different pins (rank {trainer.global_rank} plan {plan.fingerprint()}): a pin "
            "that holds on one rank only makes the replicas diverge. Build the same Pins on every rank "
            "(fraction + seed and files give identical selections everywhere)."
        )


def _raise_if_any_rank_rejected(trainer: pl.Trainer, pl_module: pl.LightningModule, rejected: Any) -> None:
    if trainer.world_size > 1:
        flag = torch.tensor([int(rejected is not None)], device=pl_module.device)
        if int(trainer.strategy.reduce(flag, reduce_op="max")) and rejected is None:
            raise PinError("another rank rejected its pins (see its error); every rank stops before training")
    if rejected is not None:
        raise rejected


def _refuse_sparse_gradients(plan: Any, module: nn.Module) -> None:
    """Element pins need dense gradients; whole-tensor pins drop the gradient and need none."""
    element_pinned = {
        name for rp in plan.pins for name, selection in rp.selections.items() if selection.index is not None
    }
    for module_name, child in module.named_modules():
        if isinstance(child, (nn.Embedding, nn.EmbeddingBag)) and child.sparse:
            name = f"{module_name}.weight" if module_name else "weight"
            if name in element_pinned:
                raise PinError(
                    f"{name!r} gets sparse gradients ({type(child).__name__}(sparse=True)), which element pins "
                    "cannot mask; use sparse=False, or pin the whole tensor"
                )
