"""A classifier LightningModule around any backbone, small backbones for ``1 x 8 x 8`` images, and the
torchvision and Hugging Face recipes."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional

import lightning as L
import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_pin.batches import call_arguments, logits_of, split_batch

__all__ = [
    "Classifier", "MLP", "OptimizerFactory", "SchedulerFactory", "SmallCNN", "TinyTransformer",
    "hf_classifier", "hf_model", "torchvision_classifier", "torchvision_model",
]


OptimizerFactory = Callable[[Iterable[nn.Parameter]], Optimizer]
SchedulerFactory = Callable[[Optimizer], Any]


class Classifier(L.LightningModule):
    """Cross-entropy classification with any backbone that maps inputs to class logits.

    The optimizer and scheduler are factories, so configs can choose them without a model at hand:
    ``functools.partial(torch.optim.SGD, lr=0.1)``, or in Hydra ``{_target_: torch.optim.SGD,
    _partial_: true, lr: 0.1}``.

    ``validation_step`` logs ``val_loss`` and ``val_acc`` and returns ``{"loss", "preds",
    "target"}``, which :class:`~lightning_pin.PinMonitor` reuses instead of running the model again.

    Args:
        backbone: The network; its parameters are named ``backbone.<name>``.
        optimizer: ``callable(parameters) -> Optimizer`` (default: AdamW, lr 3e-3, weight decay 1e-2).
        scheduler: Optional ``callable(optimizer) -> LRScheduler``.
        scheduler_interval: Step the scheduler every ``"epoch"`` or every ``"step"``.

    Raises:
        ValueError: ``scheduler_interval`` is neither ``"epoch"`` nor ``"step"``.

    Example::

        >>> import functools, torch
        >>> model = Classifier(SmallCNN(), optimizer=functools.partial(torch.optim.SGD, lr=0.1))
        >>> model(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self,
        backbone: nn.Module,
        optimizer: Optional[OptimizerFactory] = None,
        scheduler: Optional[SchedulerFactory] = None,
        scheduler_interval: str = "epoch",
    ) -> None:
        super().__init__()
        if scheduler_interval not in ("epoch", "step"):
            raise ValueError(f"scheduler_interval must be 'epoch' or 'step', got {scheduler_interval!r}")
        self.backbone = backbone
        self.optimizer_factory = optimizer or functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=1e-2)
        self.scheduler_factory = scheduler
        self.scheduler_interval = scheduler_interval

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        # A Hugging Face backbone returns an output object: its logits are the prediction.
        return logits_of(self.backbone(*args, **kwargs))

    def _logits(self, batch: Any) -> tuple[Tensor, Tensor]:
        """``(logits, target)``: an ``(x, y)`` batch, or a mapping whose input keys go to the backbone's forward."""
        inputs, target = split_batch(batch, "the app's Classifier")
        args, kwargs = call_arguments(self.backbone, inputs)
        return self(*args, **kwargs), target

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        logits, y = self._logits(batch)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss, batch_size=len(y))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        logits, y = self._logits(batch)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("val_loss", loss, batch_size=len(y), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), batch_size=len(y), sync_dist=True)
        return {"loss": loss, "preds": logits, "target": y}

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": self.scheduler_interval}}


class SmallCNN(nn.Module):
    """Two 3x3 convolutions, a 2x2 max-pool and a linear head: about 10k weights for 8x8 digits.

    Parameters: ``features.0`` and ``features.2`` (the convolutions), ``head`` (the classifier).

    Example::

        >>> import torch
        >>> SmallCNN()(torch.zeros(4, 1, 8, 8)).shape
        torch.Size([4, 10])
    """

    def __init__(
        self, num_classes: int = 10, channels: Sequence[int] = (16, 32), in_channels: int = 1, image_size: int = 8
    ) -> None:
        super().__init__()
        first, second = channels
        self.num_classes = num_classes
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, first, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(first, second, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(second * (image_size // 2) ** 2, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x).flatten(1))


class MLP(nn.Module):
    """Flatten, then fully connected layers with ReLU.

    Parameters: ``layers.0``, ``layers.2``, ... (hidden layers) and ``head``.

    Example::

        >>> import torch
        >>> MLP(hidden=(32,))(torch.zeros(4, 1, 8, 8)).shape
        torch.Size([4, 10])
    """

    def __init__(
        self, in_features: int = 64, hidden: Sequence[int] = (128, 64), num_classes: int = 10, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.num_classes = num_classes
        layers: list[nn.Module] = []
        width = in_features
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = size
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layers(x.flatten(1)))


class TinyTransformer(nn.Module):
    """A small transformer encoder that reads an image row by row (each row is one token).

    Rows are embedded linearly, a learned position embedding is added, a few pre-norm encoder layers
    mix them, and the mean token goes to a linear head. Parameters: ``embed``, ``position``,
    ``encoder.layers.<i>.*`` (attention, feed-forward, norms), ``norm`` and ``head``.

    Example::

        >>> import torch
        >>> TinyTransformer()(torch.zeros(4, 1, 8, 8)).shape
        torch.Size([4, 10])
    """

    def __init__(
        self,
        num_classes: int = 10,
        image_size: int = 8,
        in_channels: int = 1,
        dim: int = 32,
        heads: int = 4,
        layers: int = 2,
        mlp_ratio: int = 2,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.embed = nn.Linear(in_channels * image_size, dim)
        self.position = nn.Parameter(torch.zeros(1, image_size, dim))
        nn.init.normal_(self.position, std=0.02)
        layer = nn.TransformerEncoderLayer(
            dim, heads, dim_feedforward=mlp_ratio * dim, dropout=dropout, batch_first=True, norm_first=True
        )
        # enable_nested_tensor only helps with padding masks, and warns with norm_first.
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        # (batch, channels, rows, cols) -> (batch, rows, channels * cols): one token per row.
        tokens = x.permute(0, 2, 1, 3).flatten(2)
        hidden = self.encoder(self.embed(tokens) + self.position)
        return self.head(self.norm(hidden.mean(1)))


def torchvision_model(name: str = "resnet18", num_classes: int = 10, weights: Optional[str] = None,
                      **kwargs: Any) -> nn.Module:
    """Any torchvision classification model by name (``resnet18``, ``mobilenet_v3_small``, ``vit_b_16``).

    ``num_classes`` sets the head (with ``weights``, torchvision's pretrained head must match it).
    The returned module records ``num_classes``, which the app checks against the data's.

    Raises:
        ImportError: torchvision is not installed, or does not load beside this torch (a build for
            another torch or CUDA version), with the fix.
        ValueError: torchvision has no classification model ``name``.
    """
    try:
        import torchvision
    except Exception as err:  # a torchvision built for another torch fails at import with a RuntimeError
        raise ImportError(
            f"model=torchvision needs torchvision built for torch {torch.__version__} "
            f"({type(err).__name__}: {' '.join(str(err).split())}): pip install 'lightning-pin[vision]' "
            "from the index your torch came from"
        ) from None
    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        raise ValueError(f"model.backbone.name={name!r} is not a torchvision classification model: one of "
                         f"{', '.join(sorted(available)[:12])}, ...")
    model = torchvision.models.get_model(name, weights=weights, num_classes=num_classes, **kwargs)
    model.num_classes = num_classes
    return model


def torchvision_classifier(
    name: str = "resnet18",
    num_classes: int = 10,
    weights: Optional[str] = None,
    optimizer: Optional[OptimizerFactory] = None,
    scheduler: Optional[SchedulerFactory] = None,
    scheduler_interval: str = "epoch",
) -> Classifier:
    """A :class:`Classifier` around :func:`torchvision_model` (``model=torchvision model.name=resnet18``).

    Raises:
        ImportError, ValueError: as :func:`torchvision_model`.
    """
    backbone = torchvision_model(name, num_classes=num_classes, weights=weights)
    return Classifier(backbone, optimizer=optimizer, scheduler=scheduler, scheduler_interval=scheduler_interval)


#: The Auto classes of ``model=hf``, by the kind of data.
HF_TASKS = {"text": "AutoModelForSequenceClassification", "image": "AutoModelForImageClassification"}


def hf_model(
    name: Optional[str] = None,
    config: Optional[dict[str, Any]] = None,
    num_labels: int = 2,
    task: str = "text",
    vocab_size: Optional[int] = None,
    image_shape: Optional[Sequence[int]] = None,
) -> nn.Module:
    """A Hugging Face ``transformers`` classifier: ``name`` (``from_pretrained``) or ``config`` (built, no download).

    ``config`` is ``AutoConfig.for_model(**config)`` (``{"model_type": "bert", "num_hidden_layers": 2,
    ...}``) and the model ``from_config`` with random weights; ``name`` is a hub name in the local cache or
    a directory written by ``save_pretrained``. ``task`` chooses the Auto class: ``"text"`` (sequence
    classification, for token ids) or ``"image"`` (image classification, for pixels). Unless the config
    says otherwise, ``vocab_size`` and ``image_shape`` (``[channels, height, width]``) of the data set the
    config's vocabulary, channels and image size; a config without a padding token (GPT-2) gets token 0,
    so that batches of several sequences classify. The module records ``num_classes``.

    Raises:
        ImportError: transformers is not installed (``pip install -e '.[hf]'``).
        ValueError: neither or both of ``name`` and ``config``, an unknown ``task``, or a config without
            ``model_type``.

    Example::

        >>> model = hf_model(config={"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2,
        ...                          "num_attention_heads": 2, "intermediate_size": 64}, num_labels=3, vocab_size=100)
        >>> import torch
        >>> model(input_ids=torch.zeros(2, 5, dtype=torch.long)).logits.shape
        torch.Size([2, 3])
    """
    if (name is None) == (config is None):
        raise ValueError("model=hf needs model.name=NAME_OR_DIRECTORY (from_pretrained) or model.config={model_type: "
                         "..., ...} (built from a config, no download), not " + ("both" if name else "neither"))
    if task not in HF_TASKS:
        raise ValueError(f"model.task={task!r}: one of {', '.join(HF_TASKS)} (token ids or images)")
    try:
        import transformers
    except ImportError:
        raise ImportError("model=hf needs transformers: pip install -e '.[hf]'") from None
    auto = getattr(transformers, HF_TASKS[task])
    if name is not None:
        model = auto.from_pretrained(name, num_labels=num_labels, ignore_mismatched_sizes=True)
    else:
        options = dict(config)
        if "model_type" not in options:
            raise ValueError("model.config needs model_type (bert, gpt2, vit, resnet, ...): "
                             "model.config={model_type: bert, ...}")
        built = transformers.AutoConfig.for_model(options.pop("model_type"), num_labels=num_labels)
        defaults: dict[str, Any] = {}
        if vocab_size is not None and hasattr(built, "vocab_size"):
            defaults["vocab_size"] = vocab_size
        if image_shape is not None:
            if hasattr(built, "num_channels"):
                defaults["num_channels"] = int(image_shape[0])
            if hasattr(built, "image_size"):
                defaults["image_size"] = int(image_shape[-1])
        for key, value in {**defaults, **options}.items():
            setattr(built, key, value)
        if task == "text" and getattr(built, "pad_token_id", None) is None:
            built.pad_token_id = 0
        model = auto.from_config(built)
    model.num_classes = num_labels
    return model


def hf_classifier(
    name: Optional[str] = None,
    config: Optional[dict[str, Any]] = None,
    num_labels: int = 2,
    task: str = "text",
    vocab_size: Optional[int] = None,
    image_shape: Optional[Sequence[int]] = None,
    optimizer: Optional[OptimizerFactory] = None,
    scheduler: Optional[SchedulerFactory] = None,
    scheduler_interval: str = "epoch",
) -> Classifier:
    """A :class:`Classifier` around :func:`hf_model` (``model=hf``): its parameters are ``backbone.<name>``.

    Raises:
        ImportError, ValueError: as :func:`hf_model`.
    """
    backbone = hf_model(name, config, num_labels, task, vocab_size, image_shape)
    return Classifier(backbone, optimizer=optimizer, scheduler=scheduler, scheduler_interval=scheduler_interval)
