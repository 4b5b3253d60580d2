"""The wheel is complete: it ships conf/ as lightning_pin/conf, py.typed and an SPDX license, and
the Hydra app of an installed wheel finds its configs from any working directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Built from a copy: pip builds in the source tree, which would leave build/ and *.egg-info
    # in the checkout. The symlink lightning_pin/conf -> ../conf is copied as a symlink.
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "MANIFEST.in"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "conf", source / "conf")
    shutil.copytree(
        ROOT / "lightning_pin", source / "lightning_pin", symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
    )
    out = tmp_path_factory.mktemp("dist")
    # No build isolation: the dev extra installs setuptools>=77, and the tests need no network.
    command = [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "--no-index"]
    result = subprocess.run([*command, "-w", str(out), str(source)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # -v shows the backend's output: setuptools warns there about a deprecated license table.
    assert "deprecat" not in (result.stdout + result.stderr).lower()
    return next(out.glob("lightning_pin-*.whl"))


def test_wheel_ships_every_config_py_typed_and_an_spdx_license(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        for path in sorted((ROOT / "conf").rglob("*.yaml")):
            shipped = f"lightning_pin/conf/{path.relative_to(ROOT / 'conf').as_posix()}"
            assert shipped in names, shipped
            assert archive.read(shipped) == path.read_bytes()
        assert "lightning_pin/py.typed" in names
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()


def test_installed_wheel_runs_the_app_from_any_directory(wheel, tmp_path):
    # A pure-Python wheel unpacked onto sys.path is what `pip install` puts in site-packages.
    installed = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(installed)
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env = dict(os.environ, PYTHONPATH=str(installed), HYDRA_FULL_ERROR="1")
    # Hydra names the config directory it searched, then composes the whole config (every default
    # group and an experiment) from it.
    result = subprocess.run(
        [sys.executable, "-m", "lightning_pin.train", "--info", "all", "experiment=head_only"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    shipped = (installed / "lightning_pin" / "conf").resolve()
    assert f"| main     | file://{shipped} " in result.stdout, result.stdout
    assert "_target_: lightning_pin.app.models.TinyTransformer" in result.stdout  # experiment=head_only's model
