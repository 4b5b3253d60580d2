"""Building blocks for the lightning-pin app and examples: small data sets and models (``pip install 'lightning-pin[app]'``).

- :mod:`lightning_pin.app.data`: :class:`~lightning_pin.app.data.DigitsDataModule` (scikit-learn's
  8x8 digits, shipped with scikit-learn, no download) and
  :class:`~lightning_pin.app.data.SyntheticDataModule`;
- :mod:`lightning_pin.app.models`: :class:`~lightning_pin.app.models.Classifier` and the backbones
  :class:`~lightning_pin.app.models.SmallCNN`, :class:`~lightning_pin.app.models.MLP` and
  :class:`~lightning_pin.app.models.TinyTransformer`;
- :mod:`lightning_pin.app.pins`: seeded random target values (:class:`~lightning_pin.app.pins.UniformValues`)
  and fault maps read from files, for pins that need the model to be built;
- :mod:`lightning_pin.app.schedules`: ``when`` schedules for per-task pinning;
- :mod:`lightning_pin.app.fault_pins`: the faults of one study job from (kind, rate, seed) (``pin=faults``);
- :mod:`lightning_pin.app.custom` and :mod:`lightning_pin.app.metric`: your own model and data in the app
  (``model=custom model._target_=PKG.CLASS``), and the metric it logs as the tracked one (``metric=``);
- :mod:`lightning_pin.app.study` (``lightning-pin faults``) and :mod:`lightning_pin.app.tune`
  (``lightning-pin tune``): studies and searches over the app's jobs.
"""

__all__ = []
