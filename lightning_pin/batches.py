"""Feeding a model a batch of any structure, the one way every tool does it.

A :class:`~lightning.pytorch.LightningModule` is measured through its own ``validation_step`` and what it
logs (:func:`run_validation`), so a model whose forward takes the batch dict, a Hugging Face model or a
regression head is measured exactly as its training validates it. A plain module is fed by
:func:`forward_batch`: ``(x, y)`` tuples, and mappings with input and target keys (the mapping's other keys
go to the forward by name when it takes them, as a tokenizer's ``attention_mask``); a Hugging Face output's
``.logits`` is the prediction. :func:`forward_arguments` gives the arguments the model's forward is called
with (what ``export --to model.onnx`` traces).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.fx import Proxy

from lightning_pin.core.errors import PinError

__all__ = [
    "INPUT_KEYS",
    "TARGET_KEYS",
    "LogCapture",
    "call_arguments",
    "default_predict",
    "forward_arguments",
    "forward_batch",
    "logits_of",
    "run_validation",
    "split_batch",
]

#: Keys of a mapping batch that hold the target (the first one present is used).
TARGET_KEYS = ("y", "target", "targets", "label", "labels")
#: Keys of a mapping batch that hold the input a forward takes first (the first one present is used).
INPUT_KEYS = ("x", "input", "inputs", "image", "images", "pixel_values", "input_ids")


def split_batch(batch: Any, who: str = "PinMonitor") -> tuple[Any, Any]:
    """``(inputs, target)`` of a batch: ``(x, y)`` for sequences, ``({non-target keys}, y)`` for mappings.

    Raises:
        PinError: the batch is neither, or a mapping without a known input or target key.

    Example::

        >>> import torch
        >>> inputs, target = split_batch({"input_ids": torch.ones(2, 3), "attention_mask": torch.ones(2, 3),
        ...                               "labels": torch.zeros(2)})
        >>> sorted(inputs), target.shape
        (['attention_mask', 'input_ids'], torch.Size([2]))
    """
    if isinstance(batch, Mapping):
        target_key = next((k for k in TARGET_KEYS if k in batch), None)
        if target_key is None or not any(k in batch for k in INPUT_KEYS):
            raise PinError(
                f"{who} cannot tell inputs from targets in a batch with keys {sorted(batch)} (inputs: one of "
                f"{', '.join(INPUT_KEYS)}; targets: one of {', '.join(TARGET_KEYS)}): pass "
                "predict=callable(module, batch) -> (preds, target)"
            )
        return {k: v for k, v in batch.items() if k != target_key}, batch[target_key]
    if isinstance(batch, Sequence) and not isinstance(batch, str) and len(batch) >= 2:
        return batch[0], batch[-1]
    raise PinError(
        f"{who} cannot split a batch of type {type(batch).__name__} into inputs and targets: "
        "pass predict=callable(module, batch) -> (preds, target)"
    )


def call_arguments(module: nn.Module, inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for ``module`` from the inputs of :func:`split_batch`.

    A mapping goes by name to a forward that takes its keys (or ``**kwargs``); to any other forward, its
    input key's value goes first and positionally.
    """
    if not isinstance(inputs, Mapping):
        return (inputs,), {}
    parameters = _parameters(module)
    # A wrapper whose forward passes everything on (the app's Classifier) takes what its backbone takes.
    while {p.kind for p in parameters} == {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} and \
            isinstance(getattr(module, "backbone", None), nn.Module):
        module = module.backbone
        parameters = _parameters(module)
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return (), dict(inputs)
    if any(k in named for k in inputs):
        return (), {k: v for k, v in inputs.items() if k in named}
    first = next(k for k in INPUT_KEYS if k in inputs)
    return (inputs[first],), {}


def _parameters(module: nn.Module) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return []


def logits_of(output: Any) -> Tensor:
    """The prediction in a model's output: a Hugging Face output's ``.logits``, a tuple's first item."""
    if isinstance(output, (Tensor, Proxy)):  # a traced tensor (torch.fx: remap) answers hasattr with yes
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)):
        return output[0]
    return output


def forward_batch(module: nn.Module, batch: Any, who: str = "PinMonitor") -> tuple[Tensor, Any]:
    """``(logits, target)``: the batch split by :func:`split_batch`, its inputs through ``module``.

    Raises:
        PinError: as :func:`split_batch`.

    Example::

        >>> import torch
        >>> logits, y = forward_batch(torch.nn.Linear(4, 3), (torch.zeros(2, 4), torch.tensor([0, 1])))
        >>> tuple(logits.shape), y.tolist()
        ((2, 3), [0, 1])
    """
    inputs, target = split_batch(batch, who)
    args, kwargs = call_arguments(module, inputs)
    return logits_of(module(*args, **kwargs)), target


def default_predict(module: nn.Module, batch: Any) -> tuple[Tensor, Tensor]:
    """:class:`~lightning_pin.PinMonitor`'s predictions: :func:`forward_batch`, one-output heads squeezed.

    Raises:
        PinError: as :func:`split_batch`.
    """
    out, y = forward_batch(module, batch)
    if isinstance(y, Tensor) and out.ndim == y.ndim + 1 and out.shape[-1] == 1:
        out = out.squeeze(-1)  # regression heads with one output
    return out, y


class LogCapture:
    """What ``self.log`` received during one measured validation epoch, reduced as Lightning would.

    A mean weighted by the batch size (or the ``reduce_fx`` given); a logged torchmetrics ``Metric`` is
    computed over the epoch.
    """

    def __init__(self) -> None:
        self.batch: Any = None
        self.values: dict[str, list[tuple[Tensor, float]]] = {}
        self.reduce: dict[str, Any] = {}
        self.metrics: dict[str, Any] = {}

    def log(self, name: str, value: Any, *args: Any, batch_size: Optional[int] = None, reduce_fx: Any = "mean",
            **kwargs: Any) -> None:
        from torchmetrics import Metric

        if isinstance(value, Metric):
            self.metrics[name] = value
            return
        if batch_size is None:
            batch_size = self._batch_size()
        tensor = torch.as_tensor(value).detach().float().reshape(-1).mean()
        self.values.setdefault(name, []).append((tensor, float(batch_size)))
        self.reduce[name] = reduce_fx

    def log_dict(self, dictionary: Any, *args: Any, **kwargs: Any) -> None:
        for name, value in dictionary.items():
            self.log(name, value, *args, **kwargs)

    def _batch_size(self) -> int:
        if self.batch is None:
            return 1
        from lightning.pytorch.utilities.data import extract_batch_size

        try:
            return extract_batch_size(self.batch)
        except Exception:
            return 1

    def names(self) -> list[str]:
        return [*self.values, *self.metrics]

    def value(self, name: str, reduce: Optional[Callable[[Tensor, str], Tensor]] = None) -> Optional[float]:
        """The epoch's value of ``name`` (None if it was not logged); ``reduce(value, op)`` across processes."""
        reduce = reduce or (lambda value, op: value)
        if name in self.metrics:
            result = self.metrics[name].compute()
            self.metrics[name].reset()
            return float(result)
        if name not in self.values:
            return None
        values = torch.stack([v for v, _ in self.values[name]])
        weights = torch.tensor([w for _, w in self.values[name]], device=values.device)
        how = self.reduce.get(name, "mean")
        how = getattr(how, "__name__", how)
        if how == "sum":
            return float(reduce(values.sum(), "sum"))
        if how == "max":
            return float(reduce(values.max(), "max"))
        if how == "min":
            return float(reduce(values.min(), "min"))
        return float(reduce((values * weights).sum(), "sum") / reduce(weights.sum(), "sum"))


def run_validation(module: Any, batches: Iterable[Any], prepare: Optional[Callable[[Any], Any]] = None) -> LogCapture:
    """One validation epoch of a LightningModule outside a Trainer: its ``validation_step`` on each batch.

    The module is in eval mode and under ``no_grad`` for the pass (each submodule's own mode is restored);
    ``self.log`` / ``self.log_dict`` go to the returned :class:`LogCapture`. ``prepare(batch)`` moves or
    casts a batch first (a Trainer's precision and device).

    Example::

        >>> import torch
        >>> from lightning_pin.app.models import Classifier
        >>> model = Classifier(torch.nn.Linear(4, 3))
        >>> _ = torch.nn.init.zeros_(model.backbone.bias)  # zero inputs: equal logits, argmax 0
        >>> capture = run_validation(model, [(torch.zeros(2, 4), torch.tensor([0, 0]))])
        >>> sorted(capture.names()), capture.value("val_acc")
        (['val_acc', 'val_loss'], 1.0)
    """
    capture = LogCapture()
    modes = {m: m.training for m in module.modules()}
    module.eval()
    # self.log / self.log_dict go to the capture for this pass only (instance attributes shadow the methods).
    module.log, module.log_dict = capture.log, capture.log_dict
    try:
        with torch.no_grad():
            module.on_validation_epoch_start()
            for batch_idx, batch in enumerate(batches):
                if prepare is not None:
                    batch = prepare(batch)
                capture.batch = batch
                module.validation_step(batch, batch_idx)
            capture.batch = None
            module.on_validation_epoch_end()
    finally:
        del module.log, module.log_dict
        for m, training in modes.items():
            m.training = training
    return capture


def forward_arguments(module: nn.Module, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of the forward, as the module's own ``validation_step`` calls it on ``batch``.

    A LightningModule's ``validation_step`` runs once (its logging captured, nothing kept) with a hook
    recording the arguments of its first forward call; a module whose ``validation_step`` does not call
    its forward, or a plain module, gets the arguments :func:`forward_batch` would pass. Each tensor
    keeps one sample (``[:1]``).

    Raises:
        PinError: the batch cannot be split (see :func:`split_batch`).
    """
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    if callable(getattr(module, "validation_step", None)) and hasattr(module, "on_validation_epoch_start"):

        def record(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not seen:
                seen.append((args, dict(kwargs)))

        handle = module.register_forward_pre_hook(record, with_kwargs=True)
        try:
            run_validation(module, [batch])
        except Exception:  # noqa: BLE001  (a step that needs a Trainer: fall back to the batch's structure)
            seen.clear()
        finally:
            handle.remove()
    if seen:
        args, kwargs = seen[0]
    else:
        inputs, _ = split_batch(batch, "export")
        args, kwargs = call_arguments(module, inputs)

    def one(value: Any) -> Any:
        if isinstance(value, Tensor):
            return value[:1] if value.ndim > 0 else value
        if isinstance(value, Mapping):
            return {k: one(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(one(v) for v in value)
        return value

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}
