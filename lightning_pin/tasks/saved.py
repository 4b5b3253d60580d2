"""The saved form of task ownership: ``state_dict`` / ``load_state_dict`` (versioned, ``weights_only``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_pin.core.errors import PinError
from lightning_pin.tasks._common import _FORMAT, _READS, _VERSION

__all__ = ["SavedOwnership"]


class SavedOwnership:
    """The saved-state half of :class:`~lightning_pin.tasks.TaskOwnership`."""

    def state_dict(self) -> dict[str, Any]:
        """The owner maps, task states and normalization snapshots: CPU tensors, strings and
        numbers only, so ``torch.load(path, weights_only=True)`` reads it back."""
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "max_tasks": self.max_tasks,
            "norm": self.norm,
            "seed": self.seed,
            "owner": {name: owner.cpu().clone() for name, owner in self.owner.items()},
            "status": {str(t): s for t, s in sorted(self._status.items())},
            "norm_snapshots": {str(t): {k: v.cpu().clone() for k, v in s.items()}
                               for t, s in sorted(self._norm_snapshots.items())},
            "heads": {str(t): list(names) for t, names in sorted(self.heads.items())},
            "released": {name: {"index": index.clone(), "values": values.clone()}
                         for name, (index, values) in self._released.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the ownership saved by :meth:`state_dict` (before or after the model's weights).

        Raises:
            PinError: the state is not this format, or its parameters, shapes, heads or settings
                differ from this ownership's. Nothing changes then.
        """
        if not isinstance(state, Mapping) or state.get("format") != _FORMAT:
            raise PinError("TaskOwnership.load_state_dict: not a TaskOwnership state (no format "
                           f"{_FORMAT!r}); pass what own.state_dict() returned")
        if state.get("version") not in _READS:
            raise PinError(f"TaskOwnership.load_state_dict: state version {state.get('version')!r}, "
                           f"this version reads {list(_READS)}")
        owner = state["owner"]
        if sorted(owner) != sorted(self.owner):
            raise PinError(f"TaskOwnership.load_state_dict: the state owns parameters {sorted(owner)}, this "
                           f"ownership {sorted(self.owner)}; build it with the same module and params")
        for name, saved in owner.items():
            if tuple(saved.shape) != tuple(self.owner[name].shape) or saved.dtype != self._dtype:
                raise PinError(f"TaskOwnership.load_state_dict: owner map of {name!r} is {saved.dtype} "
                               f"{tuple(saved.shape)}, expected {self._dtype} {tuple(self.owner[name].shape)}")
        for key in ("max_tasks", "norm"):
            if state[key] != getattr(self, key):
                raise PinError(f"TaskOwnership.load_state_dict: saved {key}={state[key]!r}, this ownership has "
                               f"{key}={getattr(self, key)!r}")
        saved_heads = {int(t): list(n) for t, n in state["heads"].items()}
        if saved_heads != self.heads:
            raise PinError(f"TaskOwnership.load_state_dict: saved heads {saved_heads}, this ownership has {self.heads}")
        live = self._norm_tensors()
        for snapshot in state["norm_snapshots"].values():
            if sorted(snapshot) != sorted(live):
                raise PinError("TaskOwnership.load_state_dict: the saved normalization snapshots cover "
                               f"{sorted(snapshot)}, this module has {sorted(live)}")
        status = {int(t): str(s) for t, s in state["status"].items()}
        for name, saved in owner.items():
            # An element owned by a task the state has no status for: the map and the task list disagree.
            unknown = sorted(set(saved.unique().tolist()) - {0} - set(status))
            if unknown:
                raise PinError(f"TaskOwnership.load_state_dict: the owner map of {name!r} names task(s) {unknown[:5]} "
                               f"that the state has no status for (it lists {sorted(status) or 'none'}); the state is "
                               "corrupt or edited: save it again with own.state_dict()")
        released = state.get("released", {})  # version 1 had none
        for name, entry in released.items():
            if name not in self.owner or tuple(entry["index"].shape) != tuple(entry["values"].shape):
                raise PinError(f"TaskOwnership.load_state_dict: the saved values released by prune for {name!r} do "
                               f"not fit this ownership (parameters {sorted(self.owner)})")
        self.seed = int(state["seed"])
        for name, saved in owner.items():
            self.owner[name].copy_(saved)
        self._status = status
        self._released = {name: (entry["index"].clone(), entry["values"].clone()) for name, entry in released.items()}
        self._norm_snapshots = {int(t): {k: v.to(live[k].device) for k, v in s.items()}
                                for t, s in state["norm_snapshots"].items()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch.multiprocessing (ddp_spawn) hands tensors to the workers in shared memory: every
        # process must own its copy, or the ranks prune one map in turn and derive different ones.
        self.__dict__.update(state)
        self.owner = {name: owner.clone() for name, owner in self.owner.items()}
        self._norm_snapshots = {t: {k: v.clone() for k, v in s.items()} for t, s in self._norm_snapshots.items()}
        self._released = {n: (i.clone(), v.clone()) for n, (i, v) in self.__dict__.get("_released", {}).items()}
