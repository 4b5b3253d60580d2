"""Every ```python block of README.md, CONTRIBUTING.md and the docs site's pages (docs/**/*.md) runs as
written: each in a process of its own (forked from one that imported torch, Lightning and Hydra:
tests/fork_runner.py, the suite's one such process per worker), in an empty directory, with a
timeout. A page whose blocks use names that stand for the user's own objects says so (its "stand for your
own" sentence); only those come from tests/readme_user.py, and only into a block that uses them without
defining them. Blocks and pages added
later are picked up by the same extraction: this is the one mechanism that runs the docs' examples."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: Every Markdown file whose examples run: the front door, the contributor notes and the docs site's pages.
DOC_FILES = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: The names the README calls the user's (tests/readme_user.py defines each).
USER_NAMES = ("model", "datamodule", "loader", "optimizer", "loss_fn")
TIMEOUT = 120  # seconds, per block: each should take a few (a loaded 2-core machine is slower)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, code) of every ```python fence, indented ones (in lists) included."""
    blocks = []
    for match in re.finditer(r"^([ \t]*)```python[ \t]*\n(.*?)^\1```[ \t]*$", text, re.M | re.S):
        line = text.count("\n", 0, match.start()) + 1
        blocks.append((line, textwrap.dedent(match.group(2))))
    return blocks


def user_names_used(code: str) -> list[str]:
    """The user's names that ``code`` reads without creating them (assignment, import, def, for)."""
    used = []
    code = re.sub(r"#.*", "", code)  # a comment that mentions "the model" reads nothing
    for name in USER_NAMES:
        if not re.search(rf"(?<![.\w]){name}(?!\w)", code):
            continue
        defines = (
            rf"(^\s*{name}\s*(:[^=]*)?=[^=])|(\bas\s+{name}\b)|(^\s*(def|class)\s+{name}\b)|(\bimport\b.*\b{name}\b)"
            rf"|(^\s*[\w\s,]*\b{name}\b[\w\s,]*=[^=])"  # a tuple assignment: model, optimizer = build()
            rf"|(\bdef\s+\w+\([^)]*\b{name}\b)"  # a function's parameter (def __init__(self, optimizer))
        )
        if not re.search(defines, code, re.M):
            used.append(name)
    return used


def doc_blocks() -> list[tuple[str, int, str]]:
    """(file relative to the checkout, line, code) of every ```python block of every file of DOC_FILES."""
    return [(path.relative_to(ROOT).as_posix(), line, code)
            for path in DOC_FILES for line, code in python_blocks(path.read_text())]


BLOCKS = doc_blocks()


def stand_in_sentence(text: str) -> str | None:
    sentence = re.search(r"[^.]*stand for your own[^.]*\.", text.replace("\n", " "))
    return sentence.group(0) if sentence else None


def test_the_docs_have_python_blocks_and_each_page_says_whose_names_its_blocks_use():
    assert len([b for b in BLOCKS if b[0] == "README.md"]) >= 2  # the quick start of each door
    assert len(BLOCKS) >= 20 and len({b[0] for b in BLOCKS}) >= 10
    for path in DOC_FILES:
        used = {name for _, code in python_blocks(path.read_text()) for name in user_names_used(code)}
        if not used and path != README:
            continue
        sentence = stand_in_sentence(path.read_text())
        assert sentence, f"{path.relative_to(ROOT)} must say which names in its snippets are the user's"
        for name in USER_NAMES:
            assert f"`{name}`" in sentence, f"{path.relative_to(ROOT)}'s stand-in sentence does not name `{name}`"


def test_the_extraction_finds_indented_blocks_and_spots_the_user_names():
    text = (
        "intro\n\n```python\nimport torch\nx = model(1)\n```\n\n"
        "- item\n\n  ```python\n  model = 1\n  print(model)\n  ```\n"
    )
    assert python_blocks(text) == [(3, "import torch\nx = model(1)\n"), (10, "model = 1\nprint(model)\n")]
    assert user_names_used("x = model(1)\nfor b in loader: pass") == ["model", "loader"]
    assert user_names_used("model = 1\nprint(model, my_model, self.optimizer)") == []
    assert user_names_used("model, optimizer = build()\nprint(model, optimizer)") == []
    assert user_names_used("def train(model, optimizer):\n    return 1\nx = 1  # the model's output") == []
    assert user_names_used("def train(net):\n    return net\ntrain(model)") == ["model"]


#: The blocks' environment: the checkout under test and tests/ (readme_user.py) on the path, one thread.
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
    "OMP_NUM_THREADS": "1",
}


def run_block(fork_runner, script: Path, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """``python block.py`` in the block's directory, forked from the process that imported torch, Lightning and
    Hydra once (tests/fork_runner.py: ``sys.path[0]`` is the block's directory, tests/ is on the path)."""
    return fork_runner.run([sys.executable, str(script)], cwd=script.parent, env=ENV, timeout=timeout)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the runner forks a process per block")
@pytest.mark.parametrize("path,line,code", BLOCKS, ids=[f"{path}:{line}" for path, line, _ in BLOCKS])
def test_doc_block_runs_as_written(tmp_path, fork_runner, path, line, code):
    stand_ins = user_names_used(code)
    preamble = f"from readme_user import {', '.join(stand_ins)}\n" if stand_ins else ""
    script = tmp_path / f"block_line_{line}.py"
    script.write_text(preamble + code)
    done = run_block(fork_runner, script)
    why = "timed out" if done.returncode == -14 else f"exit status {done.returncode}"
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{path} line {line} failed ({why}):\n{code}\n--- output ---\n{output}"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the runner forks a process per block")
def test_the_runner_reports_a_failing_block_and_a_timeout(tmp_path, fork_runner):
    cases = (
        ("import sys\nprint(undefined_name)\n", 1, TIMEOUT, "NameError: name 'undefined_name' is not defined"),
        ("import torch\nprint(lightning.__version__)\n", 1, TIMEOUT, "name 'lightning' is not defined"),
        ("from readme_user import model\nprint(type(model).__name__)\n", 0, TIMEOUT, ""),
        ("while True: pass\n", -14, 1, ""),
    )
    for code, expected, timeout, message in cases:
        (tmp_path / "block.py").write_text(code)
        done = run_block(fork_runner, tmp_path / "block.py", timeout)
        assert done.returncode == expected, done.stderr
        assert message in done.stderr
