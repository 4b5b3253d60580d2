"""benchmarks/study_cost.py runs end to end on tiny sizes (its numbers are measured by running it, not here)."""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_study_cost_benchmark_runs_on_tiny_sizes(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("study_cost", ROOT / "benchmarks" / "study_cost.py")
    study_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study_cost)
    before = logging.getLogger("lightning.pytorch").level, list(sys.path)
    assert study_cost.main(["--smoke", "--keep", str(tmp_path / "runs"), "--figure", str(tmp_path / "cost.png")]) == 0
    # It ran in this test process: Lightning's log level (the INFO lines later tests read) and the import path as
    # they were.
    assert (logging.getLogger("lightning.pytorch").level, sys.path) == before
    out = capsys.readouterr().out
    assert "time a job / a plain Trainer.fit of the same 4 steps: median" in out
    assert out.count("x the weights") == 4  # one line per job of the 4-job study
    assert (tmp_path / "cost.png").read_bytes()[:4] == b"\x89PNG"
    job = next((tmp_path / "runs" / "study0" / "jobs").iterdir())
    assert (job / "pinned.safetensors").is_file() and not (job / "pinned.ckpt").exists()
