"""From an app run to a deployable file: rebuild the model the run trained and export it.

    lightning-pin export outputs/<date>/<time> --to model.safetensors   # or model.onnx
    lightning-pin check outputs/<date>/<time>/pinned.ckpt model.safetensors

The run directory holds what it takes: Hydra's record of the composed config
(``.hydra/config.yaml``, whose ``model`` node builds the :class:`~lightning_pin.app.models.Classifier`)
and ``pinned.ckpt`` (the weights after the pinned retraining, with the pin state). The exported
parameters keep the checkpoint's names (``backbone.features.0.weight``), so ``check`` finds every pin.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_pin.core.errors import PinError
from lightning_pin.core.io import TensorFileError, load_checkpoint

__all__ = ["FORMATS", "check_destination", "example_arguments", "export_run", "load_run_model"]


#: What ``--to`` may name.
FORMATS = (".safetensors", ".onnx")


def load_run_model(run_dir: Union[str, Path], checkpoint: str = "pinned.ckpt") -> torch.nn.Module:
    """The model an app run trained, with the weights of its ``checkpoint``, in eval mode.

    Raises:
        PinError: ``run_dir`` is not an app run directory (no ``.hydra/config.yaml`` or no
            checkpoint), or the checkpoint does not fit the model the config describes.
    """
    run_dir = Path(run_dir)
    config, ckpt = run_dir / ".hydra" / "config.yaml", run_dir / checkpoint
    for path, what in ((config, "Hydra's record of the run's config"), (ckpt, "the pinned model")):
        if not path.is_file():
            raise PinError(
                f"{path} does not exist: {run_dir} is not the directory of a finished `lightning-pin train` run "
                f"(it needs {what}); pass outputs/<date>/<time>"
            )
    cfg = OmegaConf.load(config)
    model = _rebuild(cfg, run_dir)
    try:
        state = load_checkpoint(ckpt)["state_dict"]
    except TensorFileError as err:  # empty, truncated, not a checkpoint: the message names the file and says which
        raise PinError(str(err)) from err
    except KeyError as err:
        raise PinError(f"{ckpt} is not a Lightning checkpoint with a state_dict: {err}") from err
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise PinError(f"{ckpt} does not fit the model of {config}: {' '.join(str(err).split())}") from err
    return model.eval()


def _rebuild(cfg: Any, run_dir: Path) -> torch.nn.Module:
    """The run's model, built from its config as the app built it (your own class included).

    Your classes are imported from the directory the run was started in (``.hydra/hydra.yaml``), as
    the run imported them.

    Raises:
        PinError: the model's class is no longer importable, or no longer takes the run's keys.
    """
    from lightning_pin.app.custom import ConfigError, build_model, is_app_model

    if is_app_model(cfg.model):
        # The optimizer is a training concern: the app's models are built without it (Classifier's default).
        return instantiate(cfg.model, _convert_="all")
    work_dir = _run_work_dir(run_dir)
    try:
        # A model that takes an optimizer gets the run's (a partial: nothing is built from it here).
        optimizer = instantiate(cfg.optimizer, _convert_="all") if cfg.get("optimizer") is not None else None
        return build_model(cfg, optimizer, work_dir=work_dir, announce=False).model
    except ConfigError as err:
        raise PinError(f"cannot rebuild the model of {run_dir}: {err}") from None


def _run_work_dir(run_dir: Path) -> Optional[str]:
    """The directory the run was started from (Hydra's ``runtime.cwd``), if it recorded it."""
    hydra_yaml = Path(run_dir) / ".hydra" / "hydra.yaml"
    if not hydra_yaml.is_file():
        return None
    cwd = OmegaConf.select(OmegaConf.load(hydra_yaml), "hydra.runtime.cwd", default=None)
    return str(cwd) if cwd else None


def example_arguments(run_dir: Union[str, Path], model: torch.nn.Module) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of one forward of the run's model, in the structure its forward takes.

    The app's backbones: a zero image ``1 x in_channels x image_size x image_size``; any other model: the
    first sample of the run's validation data (its DataModule rebuilt from the config), given to the forward
    as the model's own ``validation_step`` gives it (a dict batch becomes keyword arguments, which the ONNX
    export names as its inputs; see :func:`~lightning_pin.batches.forward_arguments`).
    """
    from lightning_pin.batches import forward_arguments

    cfg = OmegaConf.load(Path(run_dir) / ".hydra" / "config.yaml")
    backbone = cfg.model.get("backbone")
    if backbone is not None and "image_size" in backbone:
        channels, size = backbone.get("in_channels", 1), backbone.get("image_size", 8)
        return (torch.zeros(1, channels, size, size),), {}
    from lightning_pin.app.custom import build_datamodule

    work_dir = _run_work_dir(Path(run_dir))
    cfg.paths.work_dir = work_dir or "."  # ${hydra:...} does not resolve outside the run
    data = build_datamodule(cfg, work_dir=work_dir)
    data.setup("validate")
    batch = next(iter(data.val_dataloader()))
    return forward_arguments(model, batch)


def _by_name(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
    """The forward's arguments by name where its signature allows: ``torch.onnx.export`` would take a dict
    passed last and positionally (a batch dict) for keyword arguments."""
    import inspect

    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    if any(p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY) for p in signature.parameters.values()):
        return args, kwargs
    named: dict[str, Any] = {}
    for key, value in bound.arguments.items():
        if signature.parameters[key].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[key] = value
    return (), named


def check_destination(to: Path, force: bool = False) -> None:
    """Refuse a destination ``--to`` cannot write, before the model is rebuilt.

    An existing file is replaced only when it is a model export of its suffix (a readable
    ``.safetensors`` file or ONNX model), or with ``force``: a file of the user's that merely
    carries the suffix is never lost to a typo.

    Raises:
        PinError: ``to`` is a directory, a file stands where one of its directories should be, or
            ``to`` exists and is not a model export (without ``force``).
    """
    if to.is_dir():
        raise PinError(f"--to {to} is a directory: name the file to write, e.g. --to {to / ('model' + FORMATS[0])}")
    for parent in to.parents:
        if parent.exists():
            if not parent.is_dir():
                raise PinError(f"--to {to}: {parent} is a file, not a directory: choose another place for the export")
            break
    if to.exists() and not force and not _is_model_export(to):
        raise PinError(f"--to {to} exists and is not a model export ({to.suffix} file): choose another file, or "
                       "pass --force to replace it")


def _is_model_export(path: Path) -> bool:
    """Does ``path`` hold a model of its suffix's format (so that replacing it loses nothing of the user's)?"""
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt"):
                return True
        import onnx

        # An empty or foreign file can parse as an empty ModelProto: a model export has a graph.
        model = onnx.load(str(path), load_external_data=False)
        return model.ir_version > 0 and len(model.graph.node) > 0
    except ImportError:
        return False
    except Exception:  # noqa: BLE001  (any reader error means: not a file of that format)
        return False


def export_run(run_dir: Union[str, Path], to: Union[str, Path], force: bool = False, int8: bool = False) -> Path:
    """Write the run's pinned model to ``to`` (``.safetensors``: its state dict; ``.onnx``: the graph).

    The ONNX export uses torch's dynamo exporter with ``optimize=False``: its graph optimizer may
    fold or transpose weights, and then the file would not hold the pinned values
    (``lightning-pin check`` says which). ``int8``: an ONNX file whose weights trained with a code
    (the run's code pins) are stored as their integer codes (:func:`lightning_pin.deploy.to_onnx`).

    Raises:
        PinError: ``to`` has another suffix, is a directory or a file that is not a model export
            (without ``force``, see :func:`check_destination`), or ``run_dir`` is not a finished run
            (see :func:`load_run_model`); ImportError: ``.onnx`` without onnx / onnxscript installed.
    """
    to = Path(to)
    check_destination(to, force)
    if to.suffix not in FORMATS:
        raise PinError(f"--to {to}: the export format is chosen by the suffix, one of {', '.join(FORMATS)}")
    if int8 and to.suffix != ".onnx":
        raise PinError(f"--int8 writes an int8 QDQ ONNX model: give --to FILE.onnx, not {to.name}")
    if int8:
        try:
            import onnx  # noqa: F401
            import onnxscript  # noqa: F401
        except ImportError:
            from lightning_pin.deploy.codes import DEPLOY_EXTRA

            raise PinError(f"--int8 needs onnx and onnxscript: {DEPLOY_EXTRA}") from None
    model = load_run_model(run_dir)
    if int8:
        from lightning_pin.deploy.codes import codes_from_checkpoint
        from lightning_pin.deploy.onnx_qdq import to_onnx

        codes = codes_from_checkpoint(Path(run_dir) / "pinned.ckpt")
        to.parent.mkdir(parents=True, exist_ok=True)
        args, kwargs = _by_name(model, *example_arguments(run_dir, model))
        return to_onnx(model, to, args, int8=True, codes=codes, **({"kwargs": kwargs} if kwargs else {}))
    to.parent.mkdir(parents=True, exist_ok=True)
    if to.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}, str(to))
    else:
        args, kwargs = _by_name(model, *example_arguments(run_dir, model))
        model.eval()
        torch.onnx.export(model, args, str(to), kwargs=kwargs, dynamo=True, optimize=False, verbose=False)
    return to
