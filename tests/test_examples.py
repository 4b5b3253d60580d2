"""Each example runs on its own, in seconds, and ends with its pins verified exact."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))

#: What each example prints once it has checked its claim (each also asserts it before printing).
CLAIMS = {
    "plain_trainer.py": "encoder unchanged, head.weight[0, 0] = 0.5, head.weight[0, 5] = -2.0",
    "force_elements.py": "2.58e+08",
    "per_task_freezing.py": "PinCallback with `when` pins:                0",
    "head_only_finetune.py": "froze everything but the classifier -> changed: ['model.classifier']",
    "sparse_training.py": "still exactly 0",
    "stuck_at_faults.py": "accuracy  baseline",
    "bit_faults.py": "stuck bits read exactly in",
    "int8_faults.py": "stuck code bits read exactly in",
    "export_onnx.py": "check caught the folding: exit 1; optimize=False / do_constant_folding=False: exit 0",
    "plain_loop.py": "pin() with `when` pins:                0 ",
    "fabric_loop.py": "resumed run identical to the uninterrupted one: True",
    "continual_packnet.py": "TaskOwnership: BWT 0.0 exactly, task-1 logits identical after task 5: True, "
    "fingerprints unchanged: True",
}


def test_every_example_is_checked():
    assert sorted(p.name for p in EXAMPLES) == sorted(CLAIMS)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(example, tmp_path, fork_runner):
    # `python example.py` in a process of its own, forked from one that imported torch and Lightning already.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = fork_runner.run([sys.executable, str(example)], cwd=tmp_path, env=env, timeout=180)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "pins exact: verified" in result.stdout
    assert CLAIMS[example.name] in result.stdout
