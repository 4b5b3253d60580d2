"""The one exception lightning-pin raises for bad input or a broken guarantee."""


class PinError(ValueError):
    """A pin spec that cannot be honoured, or pinned values found off target.

    Raised before training starts for every bad input (the message names the offending
    :class:`~lightning_pin.Pin` and what would be right), and by
    :meth:`~lightning_pin.PinCallback.verify` when a pinned element is off its target.
    """
