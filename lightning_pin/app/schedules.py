"""``when`` schedules for per-task pinning, importable by path from configs and spawned processes.

A pin with ``when="lightning_pin.app.schedules.task_a"`` is active on the batches where the
function returns ``True``. Here the tasks alternate batch by batch, as in a tutorial on per-task
freezing (which shows that with Adam, ``requires_grad=False`` does not stop a layer from
moving): task A trains on even batches, task B on odd ones. A real multi-task setup would read
the task from the batch instead (``batch["task"] == 0``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["task_a", "task_b"]


def task_a(batch: Any, batch_idx: int) -> bool:
    """Task A's batches: the even ones."""
    return batch_idx % 2 == 0


def task_b(batch: Any, batch_idx: int) -> bool:
    """Task B's batches: the odd ones."""
    return batch_idx % 2 == 1
