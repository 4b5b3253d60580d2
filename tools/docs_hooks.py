"""MkDocs hook: the reference pages generated from the code at build time (mkdocs.yml ``hooks:``).

Nothing here is committed as Markdown: every ``mkdocs build`` writes the pages from the code of the
checkout it builds, so they cannot go stale, and ``mkdocs build --strict`` (tests/test_docs_build.py)
fails on a broken reference. Three generators:

- one API page per public module of ``lightning_pin`` (mkdocstrings, ``filters: public``: what the
  module's ``__all__`` exports, or, without one, its names that neither start with ``_`` nor are imported);
- the Hydra config groups and their options, read from ``conf/``, and the fields of the structured schema
  (``lightning_pin.app.config``) they extend;
- the CLI, the ``--help`` of each ``lightning-pin`` command, from the command's own parser.

It also serves CONTRIBUTING.md (kept at the top of the repository, where contributors look) as the site's
``contributing.md``, its links into ``docs/`` made relative to the site.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import sys
import typing
from contextlib import redirect_stdout
from pathlib import Path

import yaml
from mkdocs.structure.files import File

__all__ = ["api_modules", "cli_page", "config_page", "on_config", "on_files", "on_page_content"]

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_pin"
CONF = ROOT / "conf"
API_DIR = "reference/api"
# The checkout being built documents itself, whatever lightning_pin the environment has installed.
sys.path.insert(0, str(ROOT))


def api_modules() -> list[str]:
    """Every public module of the package: no part of its dotted name starts with ``_`` (``__init__`` aside)."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if "conf" in parts or any(part.startswith("_") for part in parts):
            continue
        names.append(".".join(parts))
    return names


def api_page(module: str) -> str:
    return f"# `{module}`\n\n::: {module}\n    options:\n      show_root_heading: false\n      show_root_toc_entry: false\n"


def _yaml_block(text: str) -> str:
    return "```yaml\n" + text.rstrip() + "\n```\n"


def _type_name(hint: object) -> str:
    name = getattr(hint, "__name__", None) if not typing.get_args(hint) else None
    return name or str(hint).replace("typing.", "")


def _schema_tables() -> str:
    from lightning_pin.app import config

    out = []
    for name, cls in vars(config).items():
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == config.__name__):
            continue
        hints = typing.get_type_hints(cls)
        out.append(f"### `{name}`\n\n| field | type | default |\n| --- | --- | --- |")
        for field in dataclasses.fields(cls):
            if field.default is not dataclasses.MISSING:
                default = repr(field.default)
            elif field.default_factory is not dataclasses.MISSING:
                default = repr(field.default_factory())
            else:
                default = "(required)"
            cell = default.replace("|", "\\|")
            out.append(f"| `{field.name}` | `{_type_name(hints[field.name])}` | `{cell}` |")
        out.append("")
    return "\n".join(out)


def config_page() -> str:
    """The config groups of ``conf/`` with each option's YAML, the defaults list, and the schema's fields."""
    train = (CONF / "train.yaml").read_text()
    defaults = {k: v for e in yaml.safe_load(train)["defaults"] if isinstance(e, dict) for k, v in e.items()}
    lines = [
        "# Configuration (Hydra)",
        "",
        "Generated from `conf/` at build time. Choose an option of a group with `GROUP=OPTION`, change a key with "
        "`GROUP.KEY=VALUE` (see [the Hydra app](../how-to/hydra-app.md) for what each option is for). The top-level "
        "config, `conf/train.yaml`, lists the default of every group:",
        "",
        _yaml_block(train),
    ]
    for group in sorted(p for p in CONF.iterdir() if p.is_dir()):
        default = defaults.get(group.name)
        lines += [f"## `{group.name}`", "", f"Default: `{default}`." if default else "Default: none.", ""]
        for option in sorted(group.glob("*.yaml")):
            lines += [f"### `{group.name}={option.stem}`", "", f"`conf/{group.name}/{option.name}`:", "",
                      _yaml_block(option.read_text())]
    lines += ["## The structured schema", "",
              "Every option extends a dataclass of `lightning_pin.app.config`, so a mistyped key or a wrong type "
              "fails before anything runs:", "", _schema_tables()]
    return "\n".join(lines)


def cli_page() -> str:
    """``lightning-pin --help`` and the ``--help`` of each command, from the command's parser."""
    from lightning_pin.cli import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal; the page is the same on every machine
    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.choices and a.dest == "command"]  # noqa: SLF001
    lines = ["# Command line: `lightning-pin`", "", "Generated at build time from the command's own parser "
             "(`lightning-pin COMMAND --help`). `lightning-pin train` hands its arguments to the Hydra app "
             "(`python -m lightning_pin.train`): its overrides are the [config groups](config.md).", "",
             "## `lightning-pin`", "", "```text\n" + parser.format_help().rstrip() + "\n```", ""]
    for name, sub in commands.choices.items():
        lines += [f"## `lightning-pin {name}`", "", "```text\n" + sub.format_help().rstrip() + "\n```", ""]
    return "\n".join(lines)


#: A Sphinx role as the docstrings write it (``:class:`~lightning_pin.Pin```), as mkdocstrings renders it.
SPHINX_ROLE = re.compile(r":(?:func|class|meth|attr|data|mod|exc|obj):<code>(~?)([^<]+)</code>")


def _role(match: re.Match) -> str:
    # "~a.b.C" shows "C", as Sphinx does; the full path otherwise.
    return f"<code>{match.group(2).rsplit('.', 1)[-1] if match.group(1) else match.group(2)}</code>"


def on_page_content(html, page, config, files):
    """The docstrings' Sphinx roles read as code, on the API pages."""
    if page.file.src_uri.startswith(API_DIR + "/"):
        return SPHINX_ROLE.sub(_role, html)
    return html


def on_config(config):
    """Lists the generated API pages under Reference > API in the navigation."""
    api = [{module: f"{API_DIR}/{module}.md"} for module in api_modules()]
    for entry in config["nav"]:
        if isinstance(entry, dict) and "Reference" in entry:
            entry["Reference"].append({"API": api})
    return config


def on_files(files, config):
    pages = {f"{API_DIR}/{module}.md": api_page(module) for module in api_modules()}
    pages["reference/config.md"] = config_page()
    pages["contributing.md"] = (ROOT / "CONTRIBUTING.md").read_text().replace("](docs/", "](")
    with redirect_stdout(io.StringIO()):
        pages["reference/cli.md"] = cli_page()
    for uri, content in pages.items():
        files.append(File.generated(config, uri, content=content))
    return files
