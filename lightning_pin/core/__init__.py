"""The torch-only core: no Lightning, no Hydra (``tests/test_layers.py`` holds it to that).

spec (:class:`Pin`, pure data) -> plan (resolve against a module, every input check) -> engine
(mask, restore, optimizer statistics, checks) -> the front door :func:`pin` / :class:`PinHandle`;
state (the saved pin-state format) and io (tensor files) beside them.
"""

__all__ = []
