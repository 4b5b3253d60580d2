"""The app's config for a job run in this process (``lightning-pin faults`` baselines, ``lightning-pin tune`` trials).

Hydra's compose API over the same ``conf/`` and overrides as ``lightning-pin train``; the run
directory, which ``@hydra.main`` would make, is given as ``paths.output_dir``. A config directory of
your own (``--config-dir DIR``: ``DIR/model/NAME.yaml``, ...) joins Hydra's search path, as
``hydra.searchpath=[file://DIR]`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Optional, Union

from omegaconf import DictConfig

__all__ = ["SEARCHPATH", "compose_app", "with_config_dir"]


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
