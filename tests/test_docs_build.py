"""The docs site builds with ``mkdocs build --strict`` (no warning, no broken link or anchor), its reference is
generated from the code (a page per public module, every config group option, every command's --help), and
the README stays a front door."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="the docs extra (make install installs it)")
pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra (make install installs it)")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import docs_hooks  # noqa: E402

#: The pages the docs promise (issue 39): tutorials, how-to guides, explanation, reference.
PAGES = [
    "index.md", "getting-started.md",
    "tutorials/pin-elements.md", "tutorials/per-task-adam.md", "tutorials/freeze-encoder.md",
    "tutorials/fault-study-own-model.md", "tutorials/continual-learning.md", "tutorials/int8-stuck-bits.md",
    "how-to/fault-models.md", "how-to/stuck-neurons.md", "how-to/fault-maps.md", "how-to/fault-aware-mapping.md",
    "how-to/resume.md", "how-to/deploy-int8.md",
    "how-to/distributed.md", "how-to/slurm.md", "how-to/export-check.md", "how-to/recovery.md", "how-to/tune.md",
    "explanation/stuck-bits.md", "explanation/where-pins-hold.md", "explanation/performance.md",
    "explanation/architecture.md",
]  # fmt: skip


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    return out


def test_the_site_builds_strictly_with_every_promised_page(site):
    for page in PAGES:
        assert (ROOT / "docs" / page).is_file(), page
        built = site / "index.html" if page == "index.md" else site / page.removesuffix(".md") / "index.html"
        assert built.is_file(), page
    assert (site / "fault_curve.png").is_file()


def test_the_reference_has_a_page_per_public_module_with_its_public_names(site):
    modules = docs_hooks.api_modules()
    assert {"lightning_pin", "lightning_pin.core.handle", "lightning_pin.faults", "lightning_pin.tasks",
            "lightning_pin.callbacks", "lightning_pin.cli"} <= set(modules)
    assert not any(part.startswith("_") for m in modules for part in m.split("."))
    for module in modules:
        assert (site / "reference" / "api" / module / "index.html").is_file(), module
    top = (site / "reference" / "api" / "lightning_pin" / "index.html").read_text()
    import lightning_pin

    for name in lightning_pin.__all__:  # every name of __all__, with its docstring's example
        assert f'id="lightning_pin.{name}"' in top, name
    faults = (site / "reference" / "api" / "lightning_pin.faults.bits" / "index.html").read_text()
    assert 'id="lightning_pin.faults.bits.bit_faults"' in faults  # a module without __all__: its public names
    for module in modules:  # the docstrings' Sphinx roles (:class:`~lightning_pin.Pin`) read as code
        page = (site / "reference" / "api" / module / "index.html").read_text()
        assert not re.search(r":(func|class|meth|attr|data|mod|exc|obj):<code>", page), module


def test_the_config_and_cli_references_are_generated_from_conf_and_the_parser(site):
    config = docs_hooks.config_page()
    for path in sorted((ROOT / "conf").glob("*/*.yaml")):
        assert f"### `{path.parent.name}={path.stem}`" in config, path
        assert path.read_text().rstrip() in config, path
    assert "### `TrainerConfig`" in config and "| `max_epochs` |" in config
    cli = docs_hooks.cli_page()
    from lightning_pin.cli import SUMMARIES

    for command in SUMMARIES:
        assert f"## `lightning-pin {command}`" in cli and f"usage: lightning-pin {command}" in cli, command
    assert "--rates" in cli and "--trials" in cli
    assert (site / "reference" / "config" / "index.html").is_file() and (site / "reference" / "cli" / "index.html").is_file()


def test_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert "make demo" in readme and "make test" in readme and "make docs" in readme
    assert "](docs/fault_curve.png)" in readme
    assert "PinCallback(" in readme and "with pin(" in readme  # a quick start for each door
    for link in re.findall(r"\]\(((?:docs/|CONTRIBUTING)[^)#]*)", readme):
        assert (ROOT / link).exists(), link
    assert (ROOT / "CONTRIBUTING.md").is_file()
