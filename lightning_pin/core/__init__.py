"""The torch-only core: no Lightning, no Hydra (``tests/test_layers.py`` holds it to that).

Layers, lowest first; a module imports only from its own layer or below, at its top, and the
imports form no circle (``tests/test_layers.py`` reads them):

1. errors, bitwords, io, backward_end: no other module of lightning_pin
2. sharding, layouts, modules, registry (what the spec asks about the kinds, filled by them)
3. selection (:class:`Selection`, :class:`SavedSelection`: plain data) and spec (:class:`Pin`, pure data)
4. kinds: one module per kind of pin, each building pins and selections of the layer below
5. plan (resolve pins against a module, every input check) and state (the saved pin-state format)
6. parking, buffers, engine (mask, restore, optimizer statistics, checks), compiled_step
7. handle: the front door :func:`pin` / :class:`PinHandle`

The kinds are imported here, so the registry is filled before any :class:`Pin` is built, whichever
module of lightning_pin is imported first.
"""

from lightning_pin.core import kinds as _kinds  # noqa: F401  (fills lightning_pin.core.registry)

__all__ = []
