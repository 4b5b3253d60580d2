"""Your own model and data in the app: ``model=custom model._target_=PKG.CLASS``, ``data=custom data._target_=...``.

The app builds three kinds of model from the ``model`` node:

- ``"own_optimizer"``: a :class:`~lightning.pytorch.LightningModule` with its own ``configure_optimizers``,
  trained as it is (the ``optimizer`` group is not used, and the app says so in one line);
- ``"optimizer_argument"``: a LightningModule whose ``__init__`` takes ``optimizer``: it gets the
  ``optimizer`` group as a partial (``optimizer(params) -> Optimizer``), as the app's own
  :class:`~lightning_pin.app.models.Classifier` does;
- ``"module"``: a plain :class:`torch.nn.Module` from inputs to logits, wrapped in the app's
  ``Classifier`` (cross-entropy, ``val_acc``, the ``optimizer`` group); its parameters are then
  named ``backbone.<name>``.

A target gets exactly the keys given for it (``+model.width=64``), nothing a schema adds. The current
directory (``paths.work_dir``) is importable, as it is for ``python -m``. A target that cannot be
imported, that refuses a key or misses a required one is a :class:`ConfigError` with one line naming
the target, the key and where it looked.

Default pins: for a model the app did not build from its own backbones, the pin groups select the
weights of every conv and linear layer (a transformer's attention and MLP projections; not its
embeddings, norms or biases, see :func:`default_pin_names`): their
``params`` default is ``${default_pins:<the app models' pattern>}``, which resolves to
:data:`WEIGHTS_2D` for any other model, and :func:`expand_params` turns that into the names.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import os
import sys
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

__all__ = [
    "APP_BACKBONES", "BuiltModel", "CLASSIFIER", "ConfigError", "OWN_OPTIMIZER", "TORCHVISION", "WEIGHTS_2D",
    "build_datamodule", "build_model", "check_keys", "data_target", "default_pin_names", "default_pins",
    "expand_params", "importable", "is_app_data", "is_app_model", "locate", "log", "model_name",
    "register_resolver", "takes", "work_dir_of",
]


log = logging.getLogger("lightning_pin.train")

#: The app's own classifier, and the backbones it ships: their pins keep the app's patterns.
CLASSIFIER = "lightning_pin.app.models.Classifier"
APP_BACKBONES = (
    "lightning_pin.app.models.SmallCNN",
    "lightning_pin.app.models.MLP",
    "lightning_pin.app.models.TinyTransformer",
)
#: The torchvision recipe (``model=torchvision``): a Classifier around a torchvision model.
TORCHVISION = "lightning_pin.app.models.torchvision_classifier"
#: The Hugging Face recipe (``model=hf``): a Classifier around a transformers model.
HF = "lightning_pin.app.models.hf_classifier"
#: The app's data sets of images (``model=hf`` picks image classification on them).
IMAGE_DATA = ("lightning_pin.app.data.DigitsDataModule", "lightning_pin.app.data.SyntheticDataModule",
              "lightning_pin.app.data.FakeImagesDataModule", "lightning_pin.app.data.CIFAR10DataModule")
#: ``pin.params`` of a model the app did not build: every ``*.weight`` with two or more dimensions.
WEIGHTS_2D = "*.weight:ndim>=2"
#: What the summary says for the optimizer of a model with its own ``configure_optimizers``.
OWN_OPTIMIZER = "(the model's own)"
#: Hydra's reserved keys of an instantiated node (not arguments of the target).
_RESERVED = ("_target_", "_partial_", "_convert_", "_recursive_", "_args_")


class ConfigError(ValueError):
    """A target that cannot be imported or built from its keys, or a metric the model does not log."""


# ----------------------------------------------------------------------------------------------
# Default pins


def is_app_model(model_cfg: Any) -> bool:
    """Whether the ``model`` node is the app's Classifier around one of its own backbones."""
    if not isinstance(model_cfg, (DictConfig, dict)) or model_cfg.get("_target_") != CLASSIFIER:
        return False
    backbone = model_cfg.get("backbone")
    return isinstance(backbone, (DictConfig, dict)) and backbone.get("_target_") in APP_BACKBONES


def default_pins(app_pattern: str, *, _root_: DictConfig) -> str:
    """The resolver ``${default_pins:PATTERN}``: ``PATTERN`` for the app's own models, else :data:`WEIGHTS_2D`."""
    model = _root_.get("model") if isinstance(_root_, DictConfig) else None
    return app_pattern if is_app_model(model) else WEIGHTS_2D


def register_resolver() -> None:
    """Register ``default_pins`` with OmegaConf (replacing an earlier registration: harmless twice)."""
    OmegaConf.register_new_resolver("default_pins", default_pins, replace=True)


#: Layers whose weights are the default pins of a model of your own: the multiply-accumulate layers (a
#: transformer's attention and MLP projections included; Hugging Face's GPT-2 ``Conv1D`` is a linear layer).
PINNED_LAYERS = ("Linear", "Bilinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
                 "ConvTranspose3d", "Conv1D", "MultiheadAttention")


def default_pin_names(tensors: Any, module: Any = None) -> list[str]:
    """The names :data:`WEIGHTS_2D` stands for: the weights of every conv and linear layer.

    With ``module``: the weights of its linear, bilinear and convolution layers (Hugging Face's ``Conv1D``
    and the projections of ``nn.MultiheadAttention`` too), never embeddings, norms or biases; a module
    without such layers falls back to the rule without one. Without ``module`` (a state dict only): every
    ``*.weight`` with two or more dimensions.

    Example::

        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> default_pin_names(net.named_parameters(), net), default_pin_names(net.named_parameters())
        (['1.weight'], ['0.weight', '1.weight'])
    """
    tensors = list(tensors)
    if module is not None:
        chosen: set[str] = set()
        for prefix, layer in module.named_modules():
            if type(layer).__name__ not in PINNED_LAYERS and not any(
                    isinstance(layer, base) for base in _pinned_bases()):
                continue
            for name, parameter in layer.named_parameters(recurse=False):
                if parameter.ndim >= 2 and (name == "weight" or name.endswith("proj_weight")):
                    chosen.add(f"{prefix}.{name}" if prefix else name)
        names = [n for n, _ in tensors if n in chosen]
        if names:
            return names
    return [n for n, t in tensors if n.endswith(".weight") and getattr(t, "ndim", 0) >= 2]


def _pinned_bases() -> tuple[type, ...]:
    """Subclasses of these count as linear / convolution layers (``NonDynamicallyQuantizableLinear``)."""
    import torch

    return (torch.nn.Linear, torch.nn.modules.conv._ConvNd, torch.nn.MultiheadAttention)


def expand_params(params: Any, module: Any) -> Any:
    """``params`` with :data:`WEIGHTS_2D` replaced by the names of ``module``'s ``*.weight`` of 2+ dims.

    Anything else is returned as it is (globs and ``re:`` patterns are the pins' own business).

    Raises:
        ConfigError: the module has no such parameter (then ``pin.params`` must say what to pin).

    Example::

        >>> import torch
        >>> expand_params("*.weight:ndim>=2", torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.LayerNorm(3)))
        ['0.weight']
    """
    if isinstance(params, str):
        if params != WEIGHTS_2D:
            return params
        names = default_pin_names(module.named_parameters(), module)
        if not names:
            found = ", ".join(n for n, _ in list(module.named_parameters())[:8]) or "none"
            raise ConfigError(
                f"pin.params: the model has no parameter named *.weight with two or more dimensions (the default "
                f"pins of a model of your own); its parameters: {found}: set pin.params=... (a glob or re:pattern)"
            )
        return names
    if isinstance(params, (list, tuple)) and WEIGHTS_2D in params:
        expanded: list[str] = []
        for entry in params:
            extra = expand_params(entry, module)
            expanded += extra if isinstance(extra, list) else [extra]
        return expanded
    return params


# ----------------------------------------------------------------------------------------------
# Targets


def importable(work_dir: Optional[str] = None) -> None:
    """Make ``work_dir`` (default: the current directory) importable, as ``python -m`` does for the cwd."""
    directory = os.path.abspath(work_dir or os.getcwd())
    if directory not in (os.path.abspath(p or os.curdir) for p in sys.path):
        sys.path.insert(0, directory)


def locate(target: Any, key: str, work_dir: Optional[str] = None) -> Any:
    """The object ``target`` names (``pkg.module.Class``), importing its module.

    Raises:
        ConfigError: one line naming the key, the target and where it looked.
    """
    if not isinstance(target, str) or not target or "." not in target.strip("."):
        raise ConfigError(
            f"{key}._target_={target!r}: give the import path of a class, e.g. {key}._target_=mymodels.MyNet"
        )
    importable(work_dir)
    where = os.path.abspath(work_dir or os.getcwd())
    parts = target.split(".")
    try:
        found: Any = importlib.import_module(parts[0])
    except Exception as err:
        if isinstance(err, ModuleNotFoundError) and err.name == parts[0]:
            raise ConfigError(
                f"{key}._target_={target}: no module {parts[0]!r} in {where} (the current directory) nor on the "
                f"Python path: run from the directory that holds {parts[0]}.py, or install it"
            ) from None
        raise ConfigError(f"{key}._target_={target}: importing {parts[0]} failed: {_one_line(err)}") from None
    for depth in range(1, len(parts)):
        name = parts[depth]
        if hasattr(found, name):
            found = getattr(found, name)
            continue
        module = ".".join(parts[: depth + 1])
        try:
            found = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise ConfigError(f"{key}._target_={target}: importing {module} failed: {err}") from None
            holder = ".".join(parts[:depth])
            source = getattr(found, "__file__", None) or where
            raise ConfigError(f"{key}._target_={target}: {holder} ({source}) has no {name!r}") from None
        except Exception as err:
            raise ConfigError(f"{key}._target_={target}: importing {module} failed: {_one_line(err)}") from None
    return found


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def _signature(obj: Any) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):
        return None


def takes(obj: Any, name: str) -> bool:
    """Whether ``obj(...)`` accepts an argument ``name`` (by name, or through ``**kwargs``)."""
    signature = _signature(obj)
    if signature is None:
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in signature.parameters.values())


def check_keys(obj: Any, node: Any, key: str, target: str, supplied: tuple[str, ...] = ()) -> None:
    """Refuse, before anything is built, a key the target does not take or a required one that is missing.

    ``supplied`` are arguments the app passes itself (``optimizer``).

    Raises:
        ConfigError: naming the target, the key and where the target is defined.
    """
    signature = _signature(obj)
    if signature is None:
        return
    parameters = signature.parameters
    given = [k for k in node.keys() if k not in _RESERVED]
    where = _source(obj)
    if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        named = [n for n, p in parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        for name in given:
            if name not in named:
                takes_text = ", ".join(named) or "no arguments"
                raise ConfigError(
                    f"{key}._target_={target} takes no argument {name!r} ({key}.{name}; it takes: {takes_text}; "
                    f"defined in {where})"
                )
    missing = [
        n
        for n, p in parameters.items()
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and n not in given and n not in supplied
    ]
    if missing:
        raise ConfigError(
            f"{key}._target_={target} needs {missing[0]!r}: add +{key}.{missing[0]}=VALUE (defined in {where})"
        )


def _source(obj: Any) -> str:
    try:
        return inspect.getsourcefile(obj) or getattr(obj, "__module__", "?")
    except TypeError:
        return getattr(obj, "__module__", "?")


# ----------------------------------------------------------------------------------------------
# Building


@dataclasses.dataclass
class BuiltModel:
    """The model the app trains, and what it is made of (for the log line and the summary)."""

    model: Any
    #: "app" (the app's own config), "own_optimizer", "optimizer_argument" or "module".
    kind: str
    #: The ``model._target_`` (for the app's Classifier: its backbone's target).
    target: str
    #: The optimizer's target, or :data:`OWN_OPTIMIZER`.
    optimizer: str

    @property
    def custom(self) -> bool:
        return self.kind != "app"


def work_dir_of(cfg: DictConfig) -> Optional[str]:
    """``paths.work_dir`` when it resolves (a config loaded outside Hydra cannot read ``${hydra:...}``)."""
    try:
        value = OmegaConf.select(cfg, "paths.work_dir", throw_on_missing=False)
    except Exception:
        return None
    return str(value) if value else None


def build_model(
    cfg: DictConfig, optimizer: Any = None, work_dir: Optional[str] = None, announce: bool = True
) -> BuiltModel:
    """The model of ``cfg.model``, given ``optimizer`` (a partial) when it takes one.

    ``announce``: say in one line (a warning) that a model with its own ``configure_optimizers``
    does not use the ``optimizer`` group.

    Raises:
        ConfigError: ``model._target_`` is missing, cannot be imported, refuses a key, misses a required
            one, or builds something that is neither a LightningModule nor an nn.Module.
    """
    from hydra.utils import instantiate
    import lightning.pytorch as pl
    import torch

    from lightning_pin.app.models import Classifier

    node = cfg.model
    work_dir = work_dir or work_dir_of(cfg)
    optimizer_name = str(cfg.optimizer.get("_target_", "?")) if cfg.get("optimizer") is not None else "?"
    if OmegaConf.is_missing(node, "_target_"):
        raise ConfigError("model=custom needs model._target_=PKG.CLASS: your LightningModule or nn.Module class")
    target = node._target_
    if target == CLASSIFIER:
        # The app's classifier (its own backbones, the torchvision recipe, or yours under model.backbone).
        backbone = node.get("backbone")
        backbone_target = backbone.get("_target_") if isinstance(backbone, DictConfig) else None
        if isinstance(backbone_target, str) and backbone_target not in APP_BACKBONES:
            backbone_cls = locate(backbone_target, "model.backbone", work_dir)
            check_keys(backbone_cls, backbone, "model.backbone", backbone_target)
        model = instantiate(node, _partial_=True, _convert_="all")(optimizer=optimizer)
        kind = "app" if is_app_model(node) else "module"
        return BuiltModel(model, kind, str(backbone_target or target), optimizer_name)
    if target == HF:
        node = hf_node(cfg)
    built = locate(target, "model", work_dir)
    shown = f"torchvision.models.{node.get('name')}" if target == TORCHVISION else target
    lightning = isinstance(built, type) and issubclass(built, pl.LightningModule)
    # A LightningModule class, or a factory (a function), that takes `optimizer`: it gets the group's partial.
    if takes(built, "optimizer") and (lightning or not isinstance(built, type)):
        check_keys(built, node, "model", target, supplied=("optimizer",))
        model = _build(lambda: instantiate(node, _partial_=True, _convert_="all")(optimizer=optimizer), target)
        if not isinstance(model, pl.LightningModule):
            raise ConfigError(f"model._target_={target} takes an optimizer but built a {type(model).__name__}, "
                              "not a LightningModule")
        if target == HF:  # name the transformers class that does the work (BertForSequenceClassification)
            shown = f"transformers.{type(model.backbone).__name__}"
        return BuiltModel(model, "optimizer_argument", shown, optimizer_name)
    check_keys(built, node, "model", target)
    model = _build(lambda: instantiate(node, _convert_="all"), target)
    if isinstance(model, pl.LightningModule):
        if announce:
            log.warning(
                f"model={target} has its own configure_optimizers: the optimizer group and any optimizer.* "
                "override are not used"
            )
        return BuiltModel(model, "own_optimizer", target, OWN_OPTIMIZER)
    if isinstance(model, torch.nn.Module):
        return BuiltModel(Classifier(model, optimizer=optimizer), "module", target, optimizer_name)
    raise ConfigError(
        f"model._target_={target} built a {type(model).__name__}, neither a LightningModule nor an nn.Module "
        "(a network from inputs to logits)"
    )


def hf_node(cfg: DictConfig) -> DictConfig:
    """``cfg.model`` of ``model=hf`` with ``task`` chosen by the data when it is null: ``image`` for image data
    (the app's image sets, or data with a ``shape``), else ``text`` (sequence classification)."""
    node = cfg.model.copy()
    if node.get("task") is None:
        image = node.get("image_shape") is not None or str(cfg.data.get("_target_")) in IMAGE_DATA
        with open_dict(node):
            node.task = "image" if image else "text"
    return node


def _build(make: Any, target: str) -> Any:
    """``make()``, with the error of a target's own ``__init__`` in one line naming the target."""
    from hydra.errors import InstantiationException

    try:
        return make()
    except InstantiationException as err:
        cause = err.__cause__ or err
        raise ConfigError(f"model._target_={target} failed to build: {type(cause).__name__}: "
                          f"{' '.join(str(cause).split())}") from err


def build_datamodule(cfg: DictConfig, work_dir: Optional[str] = None) -> Any:
    """The LightningDataModule of ``cfg.data``, with the one-line errors of :func:`build_model`.

    Raises:
        ConfigError: ``data._target_`` is missing, cannot be imported, refuses a key or misses one.
    """
    from hydra.utils import instantiate

    node = cfg.data
    if OmegaConf.is_missing(node, "_target_"):
        raise ConfigError("data=custom needs data._target_=PKG.CLASS: your LightningDataModule class")
    target = node._target_
    if not str(target).startswith("lightning_pin."):
        built = locate(target, "data", work_dir or work_dir_of(cfg))
        check_keys(built, node, "data", target)
    return instantiate(node, _convert_="all")


def data_target(cfg: DictConfig) -> str:
    return str(cfg.data.get("_target_", "?"))


def is_app_data(cfg: DictConfig) -> bool:
    return data_target(cfg).startswith("lightning_pin.app.")


def model_name(model: Any) -> str:
    """The class that does the work: a Classifier's backbone, else the model itself."""
    from lightning_pin.app.models import Classifier

    return type(model.backbone if isinstance(model, Classifier) else model).__name__
