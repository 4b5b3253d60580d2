"""The faults of one study job: ``(kind, rate, seed)`` -> pins, and the fault map they stand for.

A fault study (``lightning-pin faults``) compares jobs that differ in the fault rate, the seed or
the recipe. Every job draws its faults here from ``(kind, rate, seed)`` and each parameter's name
only, never from the weights' training history or the job's number, so two recipes run on the same
(rate, seed) meet identical faults (common random numbers).

- ``value``: a ``rate`` fraction of the cells stuck at values drawn uniformly from ``[low, high)``
  (the app's ``pin=fraction``);
- ``cell``: :func:`lightning_pin.faults.cell_faults` (stuck-at-0 / stuck-at-1 cells);
- ``bit``: :func:`lightning_pin.faults.bit_faults` (stuck bits of the stored words);
- ``neuron``: :func:`lightning_pin.faults.neuron_faults` (stuck neurons: channels of the modules
  whose weights ``params`` matches, stuck in every forward; ``neuron_kind`` sa0 / sa1 / value).

``rate=0`` draws nothing: the unfaulted control.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from lightning_pin.batches import call_arguments, split_batch
from lightning_pin.core.errors import PinError
from lightning_pin.core.plan import resolve
from lightning_pin.core.spec import Pin
from lightning_pin.app.pins import random_fault_map

__all__ = [
    "KINDS", "VALUE_SEED_OFFSET", "check_kind", "draw_faults", "fault_generator", "modules_of", "save_faults",
    "value_fault_map",
]


KINDS = ("value", "cell", "bit", "neuron")
#: Offsets the value draw's seed from the cell draw's, so which cells fail and what they hold are independent.
VALUE_SEED_OFFSET = 1_000_003


def fault_generator(kind: str) -> Any:
    """``lightning_pin.faults.cell_faults`` / ``bit_faults``, or a PinError saying why it is not there.

    Raises:
        PinError: ``kind`` is unknown, or this install has no generator for it yet.
    """
    if kind == "flip":
        raise PinError(
            "fault kind 'flip' is a transient fault, measured at test time and never retrained around: run "
            "lightning-pin faults --kind flip (or lightning_pin.faults.flip_bits), or use pin.kind=bit for stuck bits"
        )
    if kind not in KINDS:
        raise PinError(f"unknown fault kind {kind!r}: use one of {', '.join(KINDS)}")
    name = f"{kind}_faults"
    try:
        return getattr(importlib.import_module("lightning_pin.faults"), name)
    except (ImportError, AttributeError):
        raise PinError(
            f"fault kind {kind!r} needs lightning_pin.faults.{name}, which this version of lightning-pin does "
            "not have yet: use --kind value"
        ) from None


def check_kind(kind: str) -> None:
    """Raise PinError unless faults of ``kind`` can be drawn here."""
    if kind != "value":
        fault_generator(kind)


def value_fault_map(
    module: nn.Module, params: Union[str, Sequence[str]], rate: float, low: float, high: float, seed: int
) -> dict[str, Tensor]:
    """Per matched parameter: NaN for a healthy cell, the stuck-at value for a faulty one (``rate`` of them).

    Example::

        >>> from lightning_pin.app.models import SmallCNN
        >>> a = value_fault_map(SmallCNN(), "features.*.weight", 0.1, -2.0, 2.0, seed=3)
        >>> b = value_fault_map(SmallCNN(), "features.*.weight", 0.1, -2.0, 2.0, seed=3)  # another model
        >>> w = "features.0.weight"
        >>> int((~a[w].isnan()).sum()), torch.equal(a[w].nan_to_num(9.0), b[w].nan_to_num(9.0))  # 10% of 144
        (14, True)
    """
    return random_fault_map(module, params, rate, low, high, seed, value_seed=seed + VALUE_SEED_OFFSET)


def draw_faults(
    module: nn.Module,
    kind: str,
    rate: float,
    seed: int,
    params: Union[str, Sequence[str]],
    low: float = -2.0,
    high: float = 2.0,
    sa1_fraction: float = 0.5,
    cell_high: Optional[float] = None,
    bits: Any = None,
    one_fraction: float = 0.5,
    code_bits: Optional[int] = None,
    neuron_kind: str = "sa0",
    per: str = "channel",
    modules: Any = None,
) -> list[Any]:
    """The pins of ``kind`` faults at ``rate`` on the parameters ``params`` of ``module``, from ``seed``.

    Raises:
        PinError: an unknown or unavailable kind, a rate outside [0, 1], or ``params`` matching no
            parameter of ``module``.
    """
    if not 0.0 <= rate <= 1.0:
        raise PinError(f"fault rate must be in [0, 1], got {rate!r}")
    check_kind(kind)
    if rate == 0:
        resolve([Pin(params)], module)  # a typo in params still fails in the control job
        return []
    if kind == "value":
        fault_map = value_fault_map(module, params, rate, low, high, seed)
        # Values in row-major order of the mask: the order a mask pin reads a value sequence in.
        return [Pin(name, mask=~stuck.isnan(), value=stuck[~stuck.isnan()]) for name, stuck in fault_map.items()]
    if kind == "cell":
        return list(fault_generator("cell")(module, params, rate, sa1_fraction=sa1_fraction, high=cell_high, seed=seed))
    if kind == "neuron":  # stuck outputs of the modules that own the matched weights (or of ``modules``)
        where = modules if modules is not None else modules_of(module, params)
        return fault_generator("neuron")(module, where, rate, kind=neuron_kind, low=low, high=high, per=per, seed=seed)
    return list(fault_generator("bit")(module, params, rate, bits=bits, one_fraction=one_fraction, seed=seed,
                                       code=code_bits))


def modules_of(module: nn.Module, params: Union[str, Sequence[str]]) -> list[str]:
    """The names of the modules that own the parameters ``params`` matches (``backbone.layers.0``
    for ``backbone.layers.0.weight``), in module order: whose outputs stuck neurons sit in.

    Raises:
        PinError: ``params`` matches no parameter of ``module``.
    """
    owners = {name.rpartition(".")[0] for rp in resolve([Pin(params)], module).pins for name in rp.selections}
    return [name for name, _ in module.named_modules() if name and name in owners]


def default_neuron_modules(model: nn.Module) -> list[str]:
    """The modules ``pin=neuron_faults`` sticks units in unless ``pin.modules`` names them: those that own
    the default pins' weights. The app's CNN: its two convolutions (``backbone.features.*``); any other
    model (the app's MLP and transformer, a model of your own): every module with a ``*.weight`` of two
    or more dimensions (every conv and linear layer), as the default weight pins.

    Example::

        >>> from lightning_pin.app.models import MLP, Classifier
        >>> default_neuron_modules(Classifier(MLP(in_features=4, hidden=(8,), num_classes=2)))
        ['backbone.layers.0', 'backbone.head']

    Raises:
        PinError: the model has no such module.
    """
    from lightning_pin.app.custom import WEIGHTS_2D, expand_params
    from lightning_pin.app.models import Classifier, SmallCNN

    if isinstance(model, Classifier) and isinstance(getattr(model, "backbone", None), SmallCNN):
        return modules_of(model, "backbone.features.*.weight")
    try:
        return modules_of(model, expand_params(WEIGHTS_2D, model))
    except ValueError as err:  # ConfigError: no *.weight of 2+ dims
        message = f"pin=neuron_faults: {err}".replace("pin.params=...", "pin.modules=[...] (module names)")
        raise PinError(message) from None


def probe_output_pins(model: nn.Module, pins: Sequence[Any], datamodule: Any) -> None:
    """The first-forward checks of output pins (stuck neurons: the feature axis, channels inside the
    output, its dtype, stuck bits that would read inf / NaN) on one training batch, in eval mode and
    without gradients, so that every pin error ends the run before pretraining. The random state is
    left as it was; a forward that fails for another reason is left for the fit to report.

    Raises:
        PinError: an output pin that cannot be honoured on the model.
    """
    from lightning_pin.core import kinds

    _, outputs = kinds.split(list(pins))
    if not outputs:
        return
    with torch.random.fork_rng(devices=[]):  # drawing the batch (a shuffled sampler) moves the global generator
        try:
            datamodule.setup("fit")
            batch = next(iter(datamodule.train_dataloader()))
        except Exception:  # noqa: BLE001 - the fit says what is wrong with the data
            return
        holds = [kind.hold(specs, model) for kind, specs in outputs]
        hooks = [hook for hold in holds for hook in hold.attach()]
        training = model.training
        try:
            model.eval()
            with torch.no_grad():
                _forward(model, batch)
        except PinError:
            raise
        except Exception:  # noqa: BLE001 - not the pins' business: the fit reports it
            pass
        finally:
            for hook in hooks:
                hook.remove()
            model.train(training)


def _forward(model: nn.Module, batch: Any) -> Any:
    """One forward of ``batch`` as every tool feeds it (:mod:`lightning_pin.batches`)."""
    if isinstance(batch, Tensor):
        return model(batch)
    try:
        inputs, _ = split_batch(batch, "pin=neuron_faults")
    except PinError:  # a structure the tools cannot split: the fit reports what it makes of it
        return None
    args, kwargs = call_arguments(model, inputs)
    return model(*args, **kwargs)


def save_faults(pins: Sequence[Any], module: nn.Module, path: Union[str, Path]) -> None:
    """Save what the pins force, so two invocations can be checked for identical faults.

    Stuck neurons (:class:`~lightning_pin.NeuronPin`) hold no weight: their specs are saved, as
    plain fields (``{"neuron_pins": [...]}``), next to the weight faults.

    With ``lightning_pin.faults.save_fault_map`` (stuck bits, bounds and values alike) its format;
    otherwise the app's value fault map (per parameter: NaN where healthy, the stuck-at value
    elsewhere), which ``pin=fault_map pin.fault_map=<path>`` reads back.
    """
    try:
        save = importlib.import_module("lightning_pin.faults").save_fault_map
    except (ImportError, AttributeError):
        save = None
    from lightning_pin.core import kinds

    pins, outputs = kinds.split(pins)
    if outputs:
        specs = [p.to_config() for _, held in outputs for p in held]
        weights = {}
        if pins and save is not None:
            save(list(pins), str(path), module=module, overwrite=True)
            weights = {"weight_faults": torch.load(path, weights_only=False)}
        torch.save({"neuron_pins": specs, **weights}, path)
        return
    if save is not None:
        save(list(pins), str(path), module=module, overwrite=True)  # a rerun of the job writes it again
        return
    faults: dict[str, Tensor] = {}
    for resolved in resolve(list(pins), module).pins:
        for name, selection in resolved.selections.items():
            parameter = selection.parameter.detach()
            stuck = faults.setdefault(name, torch.full(parameter.shape, float("nan"), dtype=parameter.dtype))
            if selection.values is None:
                raise PinError(f"cannot save the faults of {resolved.pin!r}: it has no explicit values")
            if selection.index is None:
                stuck.copy_(selection.values)
            else:
                stuck.view(-1)[selection.index.long()] = selection.values.reshape(-1).to(stuck.dtype)
    torch.save(faults, path)
