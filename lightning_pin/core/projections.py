"""The restore kernels by their older names: each lives with its kind in :mod:`lightning_pin.core.kinds`.

``Projection`` is the kind interface (:class:`~lightning_pin.core.kinds.base.Kind`): an instance
maps one parameter's elements onto the set its active pins allow (:meth:`~Kind.apply`, sync-free),
and measures how far they are from it (:meth:`~Kind.drift`, :meth:`~Kind.off`).
"""

from __future__ import annotations

from lightning_pin.core.kinds import BY_NAME as KINDS
from lightning_pin.core.kinds import ExactValue, Interval, StuckBits
from lightning_pin.core.kinds import Kind as Projection

__all__ = ["KINDS", "ExactValue", "Interval", "Projection", "StuckBits"]
