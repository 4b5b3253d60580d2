"""The accuracy matrix of a sequence of tasks, with average accuracy and backward transfer."""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional, Union

from lightning_pin.core.errors import PinError

if TYPE_CHECKING:
    from lightning_pin.tasks.ownership import TaskOwnership

__all__ = ["AccuracyMatrix"]


class AccuracyMatrix:
    """The accuracy matrix of a sequence of tasks: ``R[i][j]`` is the accuracy on task ``j``
    after training task ``i`` (1-based), with average accuracy and backward transfer.

    Call :meth:`measure` after each task; with ``own`` it evaluates each task inside
    ``own.view(j)`` and records the fingerprints of the committed tasks.

    Args:
        tasks: How many tasks (ids ``1..tasks``), or the task ids themselves in the order they
            are learned (``[1, 5, 9]``) when they are not ``1, 2, 3, ...``.

    Example::

        >>> log = AccuracyMatrix(3)
        >>> for i in (1, 2, 3):
        ...     _ = log.measure(i, lambda j: [0.9, 0.8, 0.7][j - 1] - 0.1 * (i - j))
        >>> round(log.bwt(), 6), round(log.average_accuracy(), 6)
        (-0.15, 0.7)
        >>> log = AccuracyMatrix(5)
        >>> log.measure(1, lambda j: 0.9)
        [0.9]
        >>> log.measure(5, lambda j: 0.9)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_pin.core.errors.PinError: AccuracyMatrix.measure(5): no row was measured for task(s) [2, 3, 4] ...
    """

    def __init__(self, tasks: Union[int, Sequence[int]]) -> None:
        if isinstance(tasks, Sequence) and not isinstance(tasks, (str, bytes)):
            ids = list(tasks)
            whole = all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 1 for t in ids)
            if not ids or not whole or any(b <= a for a, b in zip(ids, ids[1:])):
                raise PinError(f"AccuracyMatrix: task ids must be increasing positive integers, got {tasks!r}")
        elif isinstance(tasks, bool) or not isinstance(tasks, numbers.Integral) or tasks < 1:
            raise PinError(f"AccuracyMatrix: tasks must be a positive integer or a list of task ids, got {tasks!r}")
        else:
            ids = list(range(1, int(tasks) + 1))
        #: The task ids, in the order they are learned (rows and columns of :attr:`matrix`).
        self.task_ids: list[int] = [int(t) for t in ids]
        self.tasks = len(self.task_ids)
        #: ``matrix[i][j]``: accuracy on the j-th task after the i-th (0-based positions in
        #: :attr:`task_ids`); None where not measured.
        self.matrix: list[list[Optional[float]]] = [[None] * self.tasks for _ in range(self.tasks)]
        #: Per task trained so far: the fingerprint of every committed task right after it.
        self.fingerprints: dict[int, dict[int, str]] = {}

    def measure(
        self, after: int, evaluate: Callable[[int], float], own: Optional[TaskOwnership] = None
    ) -> list[float]:
        """Record ``evaluate(j)`` for every task ``j`` up to ``after`` (inside ``own.view(j)`` when given).

        Raises:
            PinError: ``after`` is not one of the task ids, a task before it has no row yet (ids
                that skip, 1 then 5, must be declared: ``AccuracyMatrix([1, 5])``), or
                ``evaluate`` returned something that is not a finite-or-infinite number (NaN, None).
                Nothing is recorded then.
        """
        if isinstance(after, bool) or after not in self.task_ids:
            raise PinError(f"AccuracyMatrix.measure: after must be one of the task ids {self.task_ids}, got {after!r}")
        position = self.task_ids.index(after)
        missing = [t for i, t in enumerate(self.task_ids[:position]) if self.matrix[i][i] is None]
        if missing:
            raise PinError(
                f"AccuracyMatrix.measure({after}): no row was measured for task(s) {missing} before it. Measure after "
                "every task in order, or, if the task ids skip, declare the ones learned: "
                f"AccuracyMatrix({[t for t in self.task_ids if t not in missing]})"
            )
        row = []
        for j in self.task_ids[: position + 1]:
            context = own.view(j) if own is not None else contextlib.nullcontext()
            with context:
                result = evaluate(j)
            try:
                value = float(result)
            except (TypeError, ValueError) as err:
                raise PinError(
                    f"AccuracyMatrix.measure({after}): evaluate({j}) returned {result!r}, not a number"
                ) from err
            if math.isnan(value):
                raise PinError(f"AccuracyMatrix.measure({after}): evaluate({j}) returned NaN; an accuracy must be a "
                               "number (a NaN loss or an empty test set?)")
            row.append(value)
        self.matrix[position][: position + 1] = row
        if own is not None:
            self.fingerprints[after] = {j: own.fingerprint(j) for j in own.committed}
        return row

    def _last(self) -> int:
        rows = [i for i, row in enumerate(self.matrix) if row[i] is not None]
        if not rows:
            raise PinError("AccuracyMatrix: nothing measured yet")
        last = rows[-1]
        # Rows before the last need their diagonal (R[j][j]); the last row needs every entry.
        needed = [(i, i) for i in range(last)] + [(last, j) for j in range(last + 1)]
        for i, j in needed:
            if self.matrix[i][j] is None:
                raise PinError(
                    f"AccuracyMatrix: the row after task {self.task_ids[i]} has no accuracy for task "
                    f"{self.task_ids[j]} (never measured); measure(after={self.task_ids[i]}, ...) fills it"
                )
        return last

    def average_accuracy(self) -> float:
        """Mean accuracy over the tasks up to the last measured task ``T``, after ``T``.

        Raises:
            PinError: nothing was measured, or a row it needs was never measured.
        """
        last = self._last()
        return sum(self.matrix[last][: last + 1]) / (last + 1)  # type: ignore[arg-type]

    def bwt(self) -> float:
        """Backward transfer ``1/(T-1) * sum_{j<T} (R[T][j] - R[j][j])`` (0.0 for one task):
        negative when learning later tasks made earlier ones worse.

        Raises:
            PinError: nothing was measured, or a row it needs was never measured (named).
        """
        last = self._last()
        if last == 0:
            return 0.0
        gaps = [self.matrix[last][j] - self.matrix[j][j] for j in range(last)]  # type: ignore[operator]
        return sum(gaps) / last

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data: ``matrix`` (None where not measured), ``average_accuracy``,
        ``bwt``, ``fingerprints`` and ``fingerprints_unchanged`` (each task's fingerprint stayed
        the same after every later task)."""
        first_seen: dict[int, str] = {}
        unchanged = True
        for after in sorted(self.fingerprints):
            for task, fingerprint in self.fingerprints[after].items():
                unchanged &= first_seen.setdefault(task, fingerprint) == fingerprint
        measured = any(self.matrix[i][i] is not None for i in range(self.tasks))
        return {
            "tasks": self.tasks,
            "task_ids": list(self.task_ids),
            "matrix": [list(row) for row in self.matrix],
            "average_accuracy": self.average_accuracy() if measured else math.nan,
            "bwt": self.bwt() if measured else math.nan,
            "fingerprints": {str(i): {str(j): fp for j, fp in f.items()} for i, f in self.fingerprints.items()},
            "fingerprints_unchanged": unchanged if self.fingerprints else None,
        }
