"""The app's config for a job run in this process (``lightning-pin faults`` baselines, ``lightning-pin tune`` trials).

Hydra's compose API over the same ``conf/`` and overrides as ``lightning-pin train``; the run
directory, which ``@hydra.main`` would make, is given as ``paths.output_dir``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig


def compose_app(overrides: Sequence[str], output_dir: Path) -> DictConfig:
    """``conf/train.yaml`` with ``overrides``, writing into ``output_dir``.

    Raises:
        hydra.errors.HydraException: an override names no key or option of the configs.
    """
    from hydra import compose, initialize_config_dir

    from lightning_pin.app.config import register_configs
    from lightning_pin.app.train import CONFIG_DIR

    register_configs()
    paths = [f"paths.output_dir={output_dir}", f"paths.work_dir={Path.cwd()}"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("train", overrides=[*overrides, *paths])
