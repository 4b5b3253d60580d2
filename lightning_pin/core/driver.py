"""The stepping driver both doors share: what happens to the pins at each moment of a training step,
the agreement of the ranks, and the registry of live pins.

:class:`~lightning_pin.PinCallback` and :func:`~lightning_pin.pin` differ only in where their
moments come from (Lightning's hooks; an optimizer's and autograd's hooks) and in how processes
talk (the Lightning strategy's ``reduce``; ``torch.distributed``). Everything else is here, once:

- :class:`StepDriver`: the order of a step. The start of training or a resume forces the targets
  (:meth:`~StepDriver.force`); before a batch's forward its ``when`` pins are decided (agreed over
  ranks) and the pins that start are forced (:meth:`~StepDriver.decide`); right before the update the
  optimizer statistics still to zero are zeroed and the pinned gradients kept out of it
  (:meth:`~StepDriver.before_step`: masked there, or as backward accumulated them where the door
  masks at backward); the engine's step post-hook restores the targets after the update; then the
  next step's pins become active (:meth:`~StepDriver.advance`). Averaged copies of the weights hold
  the pins through :meth:`~StepDriver.write_into`.
- :func:`pin_state` and :func:`load_pin_state`: the pin state both doors save and load (the engine's,
  the output kinds', and what a door adds, such as the callback's monitor).
- :func:`ranks_agree` and :func:`any_rank`: every rank holds the same pins, and a ``when`` pin holds on
  every rank or none, through one *collective*: a callable that returns the element-wise maximum of
  a tensor over all processes (:func:`torch_collective` for ``torch.distributed``).
- :data:`LIVE`: the pins alive on each module, whichever door holds them. A new holder is checked
  against them: one element given two values by two live holders is refused before any step.

Example::

    >>> import torch
    >>> from lightning_pin import Pin
    >>> from lightning_pin.core.buffers import BufferHold
    >>> from lightning_pin.core.engine import PinEngine
    >>> from lightning_pin.core.plan import resolve
    >>> model = torch.nn.Linear(3, 1)
    >>> engine = PinEngine(resolve([Pin("bias", value=0.5, start_step=2)], model))
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> driver = StepDriver(engine, BufferHold(engine.plan, model), optimizers=[optimizer])
    >>> handles = engine.attach([optimizer])              # restores after each step
    >>> for step in range(4):
    ...     driver.decide(step, batch=None, batch_idx=step)  # before the forward: step 2 forces the bias
    ...     model(torch.randn(4, 3)).sum().backward()
    ...     driver.before_step(optimizer)                 # after backward: the pinned gradients masked
    ...     optimizer.step()
    ...     optimizer.zero_grad()
    >>> model.bias.item(), sorted(engine.active)
    (0.5, [0])
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_pin.core.buffers import BufferHold
from lightning_pin.core.engine import PinEngine
from lightning_pin.core.errors import PinError
from lightning_pin.core.plan import PinPlan, check_conflicts
from lightning_pin.core.state import PinState

__all__ = [
    "LIVE",
    "Collective",
    "LivePins",
    "StepDriver",
    "any_rank",
    "load_outputs",
    "load_pin_state",
    "pin_state",
    "ranks_agree",
    "torch_collective",
]

#: The element-wise maximum of a tensor over every process, returned (in place or not).
Collective = Callable[[Tensor], Tensor]


def torch_collective() -> Optional[Collective]:
    """``torch.distributed``'s all-reduce (max) over the default group; None in a single process."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return None

    def reduce_max(tensor: Tensor) -> Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    return reduce_max


def ranks_agree(
    plan: Optional[PinPlan],
    rejected: Optional[PinError],
    reduce_max: Optional[Collective],
    device: torch.device,
    *,
    rank: int,
    stops: str,
) -> None:
    """Once, before the first step: every rank must hold the same pins.

    A pin that holds on one rank only makes the replicas diverge silently, and a rank that rejected
    its pins would leave the others waiting in their first collective. One reduction of a
    rejection flag and the plan's digest (as two 31-bit halves, max and negated min, so that it is
    exact on any backend and dtype).

    Args:
        plan: The resolved pins (their fingerprint is compared); None where they were rejected.
        rejected: This rank's error while resolving its pins, if any.
        reduce_max: The processes' collective (see :data:`Collective`); None in a single process.
        device: Where the flags go (the backend's device).
        rank: This process's rank, named in the message.
        stops: What every rank does, for the message ("pin() fails on every rank").

    Raises:
        PinError: this rank's own rejection, another rank's, or ranks that resolved different pins.
    """
    if reduce_max is not None:
        fingerprint = None if plan is None else plan.fingerprint()
        digest = 0 if fingerprint is None else int(fingerprint, 16) & (2**62 - 1)
        halves = [digest >> 31, digest & (2**31 - 1)]
        flags = torch.tensor([int(rejected is not None)] + halves + [-h for h in halves], dtype=torch.int64,
                             device=device)
        flags = reduce_max(flags)
        any_rejected, high, low = int(flags[0]), flags[1:3], -flags[3:5]
        if rejected is None and any_rejected:
            raise PinError(f"another rank rejected its pins (see its error); {stops}")
        if rejected is None and not torch.equal(high, low):
            raise PinError(
                f"the ranks resolved different pins (rank {rank}: plan {fingerprint}): a pin that holds on one "
                "rank only makes the replicas diverge. Build the same Pins on every rank (fraction + seed and "
                "files give identical selections everywhere)."
            )
    if rejected is not None:
        raise rejected


def any_rank(hits: Sequence[bool], reduce_max: Collective, device: torch.device) -> list[bool]:
    """Per flag, whether it is set on any process (one small reduction): each rank sees its own batch,
    and a ``when`` pin must hold on every rank or on none, or the replicas diverge."""
    flags = torch.tensor(list(hits), dtype=torch.int32, device=device)
    return [bool(x) for x in reduce_max(flags).tolist()]


class StepDriver:
    """What happens to the pins at each moment of a step, for both doors.

    The doors call it from their own hooks: :class:`~lightning_pin.PinCallback` from Lightning's
    (``on_train_start``, ``on_train_batch_start``, ``on_before_optimizer_step``), :class:`PinHandle`
    from an optimizer's step pre- and post-hooks and its ``batch_start`` / ``load_state_dict``. The
    engine's step post-hook restores the pinned values after each update (``engine.attach``). Where the
    door masks pinned gradients as backward accumulates them (pin(): autograd's hooks, so that they are
    zero when ``backward()`` returns), :meth:`before_step` only drops whole tensors' gradients.

    Args:
        engine: The engine of the resolved pins.
        buffers: The buffers the pins hold (BatchNorm statistics of frozen modules).
        outputs: The output kinds' runtimes (stuck neurons), by kind name: told the step.
        reduce_max: The processes' collective for ``when`` decisions; None in a single process.
        device: Where the flags of that collective go (default: the pinned parameters' device).
        optimizers: The optimizers the pins are attached to (their statistics are zeroed).
        masked_at_backward: Whether the door zeroes pinned gradients as backward accumulates them
            (pin(): autograd's hooks); else :meth:`before_step` masks them (Lightning's
            ``on_before_optimizer_step``: after the all-reduce and the unscale, before clipping).

    Example: see the module's docstring.
    """

    def __init__(
        self,
        engine: PinEngine,
        buffers: BufferHold,
        outputs: Optional[Mapping[str, Any]] = None,
        reduce_max: Optional[Collective] = None,
        device: Optional[torch.device] = None,
        optimizers: Sequence[Optimizer] = (),
        masked_at_backward: bool = False,
    ) -> None:
        self.engine = engine
        self.buffers = buffers
        self.outputs: Mapping[str, Any] = {} if outputs is None else outputs
        #: The optimizer step the pins' windows refer to, as last given (pin(): the first optimizer's
        #: completed steps; PinCallback: Lightning's ``global_step``).
        self.step = 0
        #: Ids of the ``when`` pins the last decided batch asked for (kept until the next batch).
        self.hits: frozenset[int] = frozenset()
        #: Pins activated before the optimizers were attached: their statistics are zeroed right before
        #: the first step (a resume may load the optimizer's state in between; see reset_statistics).
        self.pending_reset: list[int] = []
        #: The processes' collective for ``when`` decisions (None: a single process).
        self.reduce_max = reduce_max
        self._device = device
        self.optimizers = optimizers
        self.masked_at_backward = masked_at_backward
        # The active set the buffers were last updated for (updated again only when it changes).
        self._buffers_active: Optional[frozenset[int]] = None

    def decide(self, step: int, batch: Any, batch_idx: int) -> None:
        """Before a batch's forward: decide its ``when`` pins (agreed over ranks), make the pins of
        ``step`` active (forcing those that start, so this forward sees them) and tell the outputs.

        Raises:
            PinError: a ``when`` answered badly, here or on another rank.
        """
        engine = self.engine
        self.step = step
        if engine.plan.pins:
            reduce_max, agree = self.reduce_max, None
            if reduce_max is not None:
                device = engine.device if self._device is None else self._device

                def agree(hits: list[bool]) -> list[bool]:
                    return any_rank(hits, reduce_max, device)

            self.hits = engine.when_hits(step, batch, batch_idx, agree)
            engine.set_active(engine.ids_at(step, self.hits))
            self.buffers.update(engine.active)
            self._buffers_active = engine.active
        for hold in self.outputs.values():
            hold.set_step(step)

    def advance(self, step: int, outputs: bool = True) -> list[int]:
        """Make the pins of ``step`` active, keeping the last batch's ``when`` decisions: after an
        optimizer step (the next forward sees the pins that start), or before one whose step count
        moved inside the batch (manual optimization). ``outputs`` tells the output kinds too.

        Returns the ids of the pins that started. Runs on every step: a steady step computes nothing.
        """
        engine = self.engine
        self.step = step
        ids = engine.ids_at(step, self.hits)
        # set_active would find them equal and change nothing: a steady step does not call it.
        started = [] if ids is engine.active or ids == engine.active else engine.set_active(ids)
        if self._buffers_active is not engine.active:
            self.buffers.update(engine.active)
            self._buffers_active = engine.active
        if outputs:
            for hold in self.outputs.values():
                hold.set_step(step)
        return started

    def force(self, step: int) -> None:
        """Write the targets of the pins active at ``step`` into the weights now (start of training,
        resume): the first forward sees them, whatever the loaded weights held. The buffers the pins
        hold are taken afresh from the module (loaded weights hold what the saved run held)."""
        engine = self.engine
        self.step = step
        engine.set_active(engine.ids_at(step, self.hits))
        engine.force()
        for hold in self.outputs.values():
            hold.set_step(step)
        self.buffers.update(engine.active, recapture=True)
        self._buffers_active = engine.active

    def before_step(self, optimizer: Optimizer) -> None:
        """Right before ``optimizer``'s update: zero the statistics :attr:`pending_reset` names, and keep
        the pinned gradients out of the update (masked now, or where the door masked them at backward,
        the gradients of wholly pinned tensors dropped: every torch optimizer then skips them).

        Runs on every step: a steady step of the pin() door makes no call from here.
        """
        if self.pending_reset:
            self.reset_statistics(self.optimizers)
        engine = self.engine
        if not self.masked_at_backward:
            engine.mask_grads(optimizer)  # drops the whole tensors' gradients too
        elif engine.has_whole_pins:
            engine.drop_whole_grads(optimizer)

    @torch.no_grad()
    def write_into(self, copy: nn.Module, parameters: Optional[Mapping[str, Tensor]] = None) -> None:
        """Make another copy of the weights (an averaged model) hold the pins: the targets of the pins
        active at the last step into its parameters (``parameters``: its named parameters, if known),
        the held buffers into its buffers. Names the copy lacks are skipped."""
        if parameters is None:
            parameters = dict(copy.named_parameters(remove_duplicate=False))
        self.engine.write_into(parameters)
        if self.buffers:
            self.buffers.write_into(copy)

    def reset_statistics(self, optimizers: Iterable[Optimizer]) -> None:
        """Zero the optimizer statistics of the pins in :attr:`pending_reset`, once: they started before
        the optimizers were attached (pin() activates the pins of step 0 first, and a resume may load the
        optimizers' state in between: it then empties :attr:`pending_reset`)."""
        pending, self.pending_reset = self.pending_reset, []
        for optimizer in optimizers:
            self.engine.reset_optimizer_state(optimizer, pending)


# ------------------------------------------------------------------------------------------------
# The saved pin state, as both doors write and read it


def pin_state(
    engine: PinEngine, outputs: Mapping[str, Any], step: Optional[int] = None, **extra: Any
) -> dict[str, Any]:
    """The pin state to save: the engine's (selections, targets, activity, ``step``), then ``extra`` (the
    callback's ``monitor``), then the output kinds' under ``"outputs"``. Tensors, lists, dicts and
    primitives only, so that ``torch.load(weights_only=True)`` reads it back."""
    state = engine.state_dict(step=step)
    state.update(extra)
    if outputs:
        state["outputs"] = {kind: hold.state_dict() for kind, hold in outputs.items()}
    return state


def load_pin_state(engine: PinEngine, outputs: Mapping[str, Any], state: Any, strict: bool,
                   warn: Optional[Callable[[str], Any]] = None) -> Optional[PinState]:
    """Take saved pin state: the engine's targets and activity, and the output kinds' saved forms.
    Nothing is forced into the weights here (the door does, when its moment comes).

    Returns what the engine read (None: a corrupt state skipped with ``strict=False``).

    Raises:
        PinError: with ``strict``, the state is corrupt or does not match these pins.
    """
    # Without ``warn``, the warnings name the line that called the door's load_state_dict.
    engine_warn = warn or (lambda message: warnings.warn(message, UserWarning, stacklevel=4))
    saved = engine.load_state_dict(state, strict=strict, warn=engine_warn)
    load_outputs(outputs, state, strict, None, warn)
    return saved


def load_outputs(outputs: Mapping[str, Any], state: Mapping[str, Any], strict: bool, step: Optional[int],
                 warn: Any = None) -> None:
    """Give each output kind's runtime its saved form (under ``"outputs"`` of the pin state).

    Raises:
        PinError: with ``strict``, the state lacks one of them or holds one these pins do not have.
    """
    saved = state.get("outputs") or {} if isinstance(state, Mapping) else {}
    # The warning names the line that called the door's load_state_dict: PinHandle.load_state_dict ->
    # load_pin_state -> here -> the output kind's load_state_dict -> warn.
    warn = warn or (lambda message: warnings.warn(message, UserWarning, stacklevel=5))
    missing, extra = sorted(set(outputs) - set(saved)), sorted(set(saved) - set(outputs))
    if (missing or extra) and strict:
        raise PinError(
            f"the checkpoint's pin state does not match these pins: it holds no state of {missing} pins"
            if missing else f"the checkpoint's pin state holds {extra} pins these pins do not have"
        ) from None
    for kind, hold in outputs.items():
        if kind in saved:
            hold.load_state_dict(saved[kind], strict=strict, warn=warn)
        if step is not None:
            hold.set_step(step)



# ------------------------------------------------------------------------------------------------
# The registry of live pins


class LivePins:
    """The holders of live pins (:class:`PinHandle`, a fitting :class:`~lightning_pin.PinCallback`) by
    the module they pin. Holders are held weakly, in the order they came; each has an ``engine``.

    Example::

        >>> import torch
        >>> from lightning_pin import Pin, pin
        >>> model = torch.nn.Linear(2, 1)
        >>> with pin(model, torch.optim.SGD(model.parameters(), lr=0.1), Pin("bias", value=0.0)) as handle:
        ...     LIVE.on(model) == [handle]
        True
        >>> LIVE.on(model)
        []
    """

    def __init__(self) -> None:
        self._by_module: weakref.WeakKeyDictionary[nn.Module, dict[int, tuple[weakref.ref, str]]] = (
            weakref.WeakKeyDictionary()
        )

    def add(self, module: nn.Module, holder: Any, door: str) -> None:
        """Register ``holder`` (with an ``engine``) as pinning ``module``; ``door`` is ``"pin()"`` or
        ``"PinCallback"`` (named in conflict messages)."""
        entries = self._by_module.setdefault(module, {})
        for key in [k for k, (ref, _) in entries.items() if ref() is None]:  # holders dropped without removal
            del entries[key]
        entries[id(holder)] = (weakref.ref(holder), door)

    def discard(self, holder: Any) -> None:
        """Take ``holder`` out, wherever it is (a no-op if it is not registered)."""
        for entries in list(self._by_module.values()):
            entry = entries.get(id(holder))
            if entry is not None and entry[0]() is holder:
                del entries[id(holder)]

    def _entries(self, module: nn.Module) -> list[tuple[Any, str]]:
        entries = self._by_module.get(module, {})
        return [(h, door) for h, door in ((ref(), door) for ref, door in list(entries.values())) if h is not None]

    def on(self, module: nn.Module) -> list[Any]:
        """The live holders of pins on ``module``, oldest first."""
        return [h for h, _ in self._entries(module)]

    def items(self) -> list[tuple[nn.Module, list[Any]]]:
        """Every module with live holders, and those holders."""
        found = [(m, self.on(m)) for m in list(self._by_module.keys())]
        return [(m, holders) for m, holders in found if holders]

    def refuse_conflicts(self, plan: PinPlan, module: nn.Module, door: str) -> None:
        """A new holder's pins may not give an element another value than the live pins on ``module``.

        Raises:
            PinError: as for two pins of one call (see :func:`~lightning_pin.core.plan.check_conflicts`),
                naming both pins and, across holders of the pin() door, what to do.
        """
        live = self._entries(module)
        if not live:
            return
        try:
            check_conflicts([rp for h, _ in live for rp in h.engine.plan.pins] + list(plan.pins))
        except PinError as err:
            doors = {d for _, d in live}
            if "pin()" in doors:
                hint = ("another pin() on this module is still active: remove its handle first, or pin both in "
                        "one call")
            elif door != "PinCallback":
                hint = "a PinCallback is fitting this module: give it these pins too, or call pin() after the fit"
            else:
                raise  # PinCallbacks of one trainer: the conflict speaks for itself
            raise PinError(f"{err} ({hint})") from err


#: The one registry of live pins, for both doors.
LIVE = LivePins()
