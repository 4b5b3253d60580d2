"""``pin.remap=true`` (``lightning-pin faults --remap``): map a job's model onto its faults before the forced accuracy.

The faults are drawn on the pretrained model as always (same ``(kind, rate, seed)``, same cells);
:func:`lightning_pin.faults.remap` then permutes its hidden units so the faulty cells damage the
weights least, the function kept. A retrained job saves the mapping (``remap.pt``) and adds
``damage_before``, ``damage_after`` (the squared change the faults make) and ``remap_seconds`` to its summary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from lightning_pin.batches import INPUT_KEYS
from lightning_pin.core import kinds
from lightning_pin.core.errors import PinError

#: The mapping a ``pin.remap=true`` job saves (``FaultMapping.state_dict()``; ``torch.load(weights_only=True)``).
REMAP_FILE = "remap.pt"
#: Kinds the mapping refuses: a transient flip is not at fixed cells; stuck neurons are not weights.
UNMAPPABLE = ("flip", "neuron")


def batch_inputs(batch: Any) -> Any:
    """The model inputs of a ``(x, y)`` batch or of a mapping with an input key (as the monitor reads them).

    Raises:
        PinError: a batch of another form.
    """
    if isinstance(batch, Mapping):
        found = next((batch[k] for k in INPUT_KEYS if k in batch), None)
        if found is not None:
            return found
    elif isinstance(batch, Sequence) and not isinstance(batch, str) and len(batch) >= 2:
        return batch[0]
    raise PinError(f"pin.remap: cannot tell the inputs in a batch of type {type(batch).__name__}; the mapping "
                   "needs (inputs, targets) batches")


def example_from(datamodule: Any) -> Any:
    """A few validation inputs of ``datamodule`` (set up for fitting): the shapes the mapping traces with."""
    datamodule.prepare_data()
    datamodule.setup("fit")
    batch = next(iter(datamodule.val_dataloader()))
    return batch_inputs(batch)


def map_job(model: nn.Module, pins: Sequence[Any], example_input: Any,
            output_dir: Optional[Path] = None) -> tuple[list[Any], dict[str, Any], Any]:
    """Map ``model`` onto the weight faults among ``pins``, in place.

    Returns:
        ``(pins to train with, summary entries, the FaultMapping)``; with ``output_dir`` the mapping is saved
        there as :data:`REMAP_FILE`.
    """
    from lightning_pin.faults import remap

    weights, outputs = kinds.split(list(pins))
    if outputs:
        raise PinError("pin.remap maps weight faults onto cells; stuck neurons (kind=neuron) are not weights")
    if not weights:  # rate 0: the control, nothing to map
        return list(pins), {"damage_before": 0.0, "damage_after": 0.0, "remap_seconds": 0.0}, None
    was = model.training
    mapping = remap(model, weights, example_input, cost="l2")
    model.train(was)
    if output_dir is not None:
        torch.save(mapping.state_dict(), Path(output_dir) / REMAP_FILE)
    entries = {"damage_before": mapping.cost_before, "damage_after": mapping.cost_after,
               "remap_seconds": round(mapping.seconds, 4)}
    return list(mapping.faults), entries, mapping


__all__ = ["REMAP_FILE", "UNMAPPABLE", "batch_inputs", "example_from", "map_job"]
