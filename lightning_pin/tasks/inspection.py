"""What task ownership reports: each parameter's free capacity, a task's fingerprint, the summary line."""

from __future__ import annotations

import hashlib

from lightning_pin.tasks._common import _COMMITTED, _feed

__all__ = ["OwnershipInspection"]


class OwnershipInspection:
    """The inspection half of :class:`~lightning_pin.tasks.TaskOwnership` (read only)."""

    def capacity(self) -> dict[str, float]:
        """The free fraction of each shared parameter (what later tasks can still train)."""
        return {name: float((owner == 0).sum()) / max(owner.numel(), 1) for name, owner in self.owner.items()}

    def fingerprint(self, task: int) -> str:
        """SHA-256 (hex) over the values of the elements ``task`` owns, its heads and its
        normalization snapshot: unchanged for as long as later tasks respect ``task``.

        Raises:
            PinError: ``task`` is not committed.
        """
        task = self._check_task(task, "fingerprint")
        self._require_status(task, "fingerprint", (_COMMITTED,))
        self._follow_parameters("fingerprint")
        digest = hashlib.sha256()
        named = dict(self.module.named_parameters())
        for name in sorted(self.owner):
            values = self.parameters[name].detach()[self.owner[name] == task]
            _feed(digest, name, values)
        for name in self.heads.get(task, []):
            _feed(digest, name, named[name].detach())
        for key, value in sorted(self._norm_snapshots.get(task, {}).items()):
            _feed(digest, key, value)
        return digest.hexdigest()


    def __repr__(self) -> str:
        return (f"TaskOwnership({len(self.owner)} parameters, tasks: {self._describe()}, "
                f"free: {self.free_fraction():.3f})")

    def free_fraction(self) -> float:
        """The free fraction of all shared elements together."""
        total = sum(o.numel() for o in self.owner.values())
        return float(sum(int((o == 0).sum()) for o in self.owner.values())) / max(total, 1)
