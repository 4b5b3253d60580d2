"""Every ```python block of README.md runs as written: each in a process of its own (forked from
one that imported torch and Lightning: tests/readme_runner.py), in an empty directory, with a
timeout. The README says which names stand for the user's own objects (its
"stand for your own" sentence); only those come from tests/readme_user.py, and only into a block
that uses them without defining them. Blocks added to the README later are picked up by the same
extraction."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
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
    for name in USER_NAMES:
        if not re.search(rf"(?<![.\w]){name}(?!\w)", code):
            continue
        defines = (
            rf"(^\s*{name}\s*(:[^=]*)?=[^=])|(\bas\s+{name}\b)|(^\s*(def|class)\s+{name}\b)|(\bimport\b.*\b{name}\b)"
        )
        if not re.search(defines, code, re.M):
            used.append(name)
    return used


BLOCKS = python_blocks(README.read_text())


def test_the_readme_has_python_blocks_and_says_whose_names_they_use():
    assert len(BLOCKS) >= 5
    sentence = re.search(r"[^.]*stand for your own[^.]*\.", README.read_text().replace("\n", " "))
    assert sentence, "README must say which names in its snippets are the user's"
    for name in USER_NAMES:
        assert f"`{name}`" in sentence.group(0), f"README's stand-in sentence does not name `{name}`"


def test_the_extraction_finds_indented_blocks_and_spots_the_user_names():
    text = (
        "intro\n\n```python\nimport torch\nx = model(1)\n```\n\n"
        "- item\n\n  ```python\n  model = 1\n  print(model)\n  ```\n"
    )
    assert python_blocks(text) == [(3, "import torch\nx = model(1)\n"), (10, "model = 1\nprint(model)\n")]
    assert user_names_used("x = model(1)\nfor b in loader: pass") == ["model", "loader"]
    assert user_names_used("model = 1\nprint(model, my_model, self.optimizer)") == []


@pytest.fixture(scope="module")
def runner():
    """tests/readme_runner.py: forks a process per block from one that imported torch and Lightning."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "readme_runner.py")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
    )
    yield process
    process.stdin.close()
    process.wait(timeout=60)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the runner forks a process per block")
@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_block_runs_as_written(tmp_path, runner, line, code):
    stand_ins = user_names_used(code)
    preamble = f"from readme_user import {', '.join(stand_ins)}\n" if stand_ins else ""
    script = tmp_path / f"readme_line_{line}.py"
    script.write_text(preamble + code)
    runner.stdin.write(json.dumps({"script": script.name, "cwd": str(tmp_path), "timeout": TIMEOUT}) + "\n")
    runner.stdin.flush()
    reply = runner.stdout.readline()
    assert reply, "the README runner died"
    status = json.loads(reply)["status"]
    output = (tmp_path / "stdout.txt").read_text() + (tmp_path / "stderr.txt").read_text()
    why = "timed out" if status == -14 else f"exit status {status}"
    assert status == 0, f"README.md line {line} failed ({why}):\n{code}\n--- output ---\n{output}"


def test_the_runner_reports_a_failing_block_and_a_timeout(tmp_path, runner):
    cases = (
        ("import sys\nprint(undefined_name)\n", 1, TIMEOUT, "NameError: name 'undefined_name' is not defined"),
        ("import torch\nprint(lightning.__version__)\n", 1, TIMEOUT, "name 'lightning' is not defined"),
        ("while True: pass\n", -14, 1, ""),
    )
    for code, expected, timeout, message in cases:
        (tmp_path / "block.py").write_text(code)
        runner.stdin.write(json.dumps({"script": "block.py", "cwd": str(tmp_path), "timeout": timeout}) + "\n")
        runner.stdin.flush()
        assert json.loads(runner.stdout.readline())["status"] == expected
        assert message in (tmp_path / "stderr.txt").read_text()
