"""The app's config for a job run in this process (``lightning-pin faults`` baselines, ``lightning-pin tune`` trials).

Hydra's compose API over the same ``conf/`` and overrides as ``lightning-pin train``; the run
directory, which ``@hydra.main`` would make, is given as ``paths.output_dir``. A config directory of
your own (``--config-dir DIR``: ``DIR/model/NAME.yaml``, ...) joins Hydra's search path, as
``hydra.searchpath=[file://DIR]`` does.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Optional, Union

from omegaconf import DictConfig

__all__ = ["SEARCHPATH", "compose_app", "composition_message", "unknown_key", "with_config_dir"]


SEARCHPATH = "hydra.searchpath"


def with_config_dir(overrides: Sequence[str], config_dir: Optional[Union[str, Path]]) -> list[str]:
    """``overrides`` with ``config_dir`` added to ``hydra.searchpath`` (merged into one given there).

    Example::

        >>> with_config_dir(["model=own"], "/my/conf")
        ['model=own', 'hydra.searchpath=[file:///my/conf]']
        >>> with_config_dir(["hydra.searchpath=[file:///a]"], "/b")
        ['hydra.searchpath=[file:///a,file:///b]']
    """
    overrides = list(overrides)
    if not config_dir:
        return overrides
    entry = f"file://{Path(config_dir).expanduser().resolve()}"
    for i, override in enumerate(overrides):
        key, _, value = override.partition("=")
        if key.lstrip("+") == SEARCHPATH and value.startswith("[") and value.endswith("]"):
            inner = value[1:-1].strip()
            overrides[i] = f"{key}=[{inner + ',' if inner else ''}{entry}]"
            return overrides
    return [*overrides, f"{SEARCHPATH}=[{entry}]"]


def compose_app(
    overrides: Sequence[str], output_dir: Path, config_dir: Optional[Union[str, Path]] = None
) -> DictConfig:
    """``conf/train.yaml`` with ``overrides``, writing into ``output_dir``; ``config_dir`` joins the search path.

    Raises:
        hydra.errors.HydraException: an override names no key or option of the configs.
    """
    from hydra import compose, initialize_config_dir

    from lightning_pin.app.config import register_configs
    from lightning_pin.app.train import CONFIG_DIR

    register_configs()
    paths = [f"paths.output_dir={output_dir}", f"paths.work_dir={Path.cwd()}"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("train", overrides=[*with_config_dir(overrides, config_dir), *paths])


def unknown_key(err: BaseException) -> Optional[str]:
    """One line for an override that names no key of its config node (``trainer.max_epoch=1``): the key and the
    closest valid ones (``trainer.max_epochs``); None for any other error.

    Hydra's own message runs over seven lines (the key, "reference_type=...", "object_type=...") and names
    no valid key; the schema of the node (a dataclass of :mod:`lightning_pin.app.config`) knows them all.
    """
    cause = err.__cause__ if err.__cause__ is not None else err
    key, schema = getattr(cause, "key", None), getattr(cause, "object_type", None)
    if not isinstance(key, str) or not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        return None
    full = getattr(cause, "full_key", None) or key
    prefix = full[: -len(key)] if full.endswith(key) else ""
    valid = [field.name for field in dataclasses.fields(schema) if not field.name.startswith("_")]
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.6)
    where = f"{prefix.rstrip('.')} ({schema.__name__})" if prefix else f"the top level ({schema.__name__})"
    if close:
        hint = f"did you mean {' or '.join(prefix + name for name in close)}?"
    else:
        hint = f"the keys of {where} are {', '.join(valid)}"
    return f"unknown config key {full!r}: {hint}"


def composition_message(err: BaseException) -> str:
    """Why a config did not compose, in one line: :func:`unknown_key`'s, else Hydra's message without line breaks."""
    return unknown_key(err) or " ".join(str(err).split()) or type(err).__name__
