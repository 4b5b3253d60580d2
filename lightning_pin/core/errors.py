"""The exceptions lightning-pin raises: PinError for bad input or a broken guarantee, AccuracyGapError
when an accuracy guard trips."""

__all__ = ["AccuracyGapError", "PinError"]


class PinError(ValueError):
    """A pin spec that cannot be honoured, or pinned values found off target.

    Raised before training starts for every bad input (the message names the offending
    :class:`~lightning_pin.Pin` and what would be right), and by
    :meth:`~lightning_pin.PinCallback.verify` when a pinned element is off its target.
    """


class AccuracyGapError(RuntimeError):
    """Raised by :class:`~lightning_pin.PinMonitor` (``on_max_gap="raise"``) when the tracked metric
    stays further from its baseline than ``max_gap`` allows."""
