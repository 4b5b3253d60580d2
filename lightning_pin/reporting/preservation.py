"""Whether a quality metric came back after pinning: pure Python, shared by the monitor and the reports."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional

__all__ = ["Preservation"]


class Preservation:
    """Whether a quality metric came back: its baseline, forced and current values, the gap, the recovery.

    The *gap* is how much worse than the baseline a value is, in the metric's units: ``baseline -
    value`` when higher is better (accuracy, F1), ``value - baseline`` when lower is better (MSE).
    Positive is worse. The metric has *recovered* at the first recorded step (the forced one
    included) whose gap is within ``tolerance``.

    Args:
        higher_is_better: Direction of the metric.
        tolerance: The largest gap that counts as preserved (0.01 is one accuracy point).

    Example::

        >>> p = Preservation(higher_is_better=True, tolerance=0.01)
        >>> p.baseline = 0.96
        >>> p.record(0, 0.80, forced=True)
        >>> p.record(20, 0.94); p.record(40, 0.955)
        >>> p.forced, p.final, round(p.gap(p.final), 3), p.recovered_step
        (0.8, 0.955, 0.005, 40)

    Raises:
        ValueError: ``tolerance`` is negative or not finite.
    """

    def __init__(self, higher_is_better: bool = True, tolerance: float = 0.01) -> None:
        if not (tolerance >= 0 and math.isfinite(tolerance)):
            raise ValueError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
        self.higher_is_better = higher_is_better
        self.tolerance = float(tolerance)
        #: The value before any pin is forced.
        self.baseline: Optional[float] = None
        #: The value right after forcing the pinned values, before any training.
        self.forced: Optional[float] = None
        #: ``[step, value]`` pairs, the forced value first.
        self.history: list[list[float]] = []
        #: The first step whose gap was within the tolerance, None until then.
        self.recovered_step: Optional[int] = None

    def gap(self, value: float) -> Optional[float]:
        """How much worse than the baseline ``value`` is (positive: worse); None without a baseline."""
        if self.baseline is None:
            return None
        return self.baseline - value if self.higher_is_better else value - self.baseline

    def within(self, value: float) -> bool:
        """Whether ``value`` is within the tolerance of the baseline (gaps compared at 1e-9)."""
        gap = self.gap(value)
        return gap is not None and round(gap, 9) <= self.tolerance

    def record(self, step: int, value: float, forced: bool = False) -> None:
        """Record ``value`` measured after ``step`` optimizer steps (``forced``: the forced one)."""
        if forced:
            self.forced = value
        self.history.append([int(step), float(value)])
        if self.recovered_step is None and self.within(value):
            self.recovered_step = int(step)

    @property
    def final(self) -> Optional[float]:
        """The last recorded value."""
        return self.history[-1][1] if self.history else None

    @property
    def last_step(self) -> Optional[int]:
        """The step of the last recorded value."""
        return int(self.history[-1][0]) if self.history else None

    def state_dict(self) -> dict[str, Any]:
        return {
            "higher_is_better": self.higher_is_better,
            "tolerance": self.tolerance,
            "baseline": self.baseline,
            "forced": self.forced,
            "history": [list(row) for row in self.history],
            "recovered_step": self.recovered_step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.baseline = state.get("baseline")
        self.forced = state.get("forced")
        self.history = [list(row) for row in state.get("history", [])]
        self.recovered_step = state.get("recovered_step")
