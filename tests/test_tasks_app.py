"""The continual-learning report (JSON, heat map, table) and ``experiment=continual`` run by the app."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from lightning_pin.reporting.continual import comparison_rows, write_continual_report
from lightning_pin.tasks import AccuracyMatrix


def _matrix(drop: float) -> AccuracyMatrix:
    log = AccuracyMatrix(3)
    for i in (1, 2, 3):
        log.measure(i, lambda j: 0.9 - drop * (i - j))
    return log


def test_report_json_heat_map_and_rows(tmp_path):
    methods = {"naive": _matrix(0.25).to_dict(), "owned": _matrix(0.0).to_dict()}
    paths = write_continual_report(methods, tmp_path, tasks=3)
    assert [p.name for p in paths] == ["continual_report.json", "continual_accuracy.png"]
    report = json.loads(paths[0].read_text())
    assert report["tasks"] == 3
    assert report["methods"]["naive"]["matrix"][1] == [0.65, 0.9, None]
    assert report["methods"]["naive"]["bwt"] == pytest.approx(-0.375) and report["methods"]["owned"]["bwt"] == 0.0
    assert paths[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert comparison_rows(report) == [("naive", "65.0%", "-37.50 pts", "-"), ("owned", "90.0%", "0.0 (exact)", "-")]


def test_fingerprint_change_is_reported():
    log = AccuracyMatrix(2)
    log.fingerprints = {1: {1: "a"}, 2: {1: "b", 2: "c"}}
    log.matrix[0][0] = 1.0
    assert log.to_dict()["fingerprints_unchanged"] is False
    log.fingerprints[2][1] = "a"
    assert log.to_dict()["fingerprints_unchanged"] is True


def test_experiment_continual_runs_in_the_app(tmp_path, fork_runner):
    env = dict(os.environ, HYDRA_FULL_ERROR="0", OMP_NUM_THREADS="1")
    overrides = ["experiment=continual", "continual.tasks=3", "trainer.max_epochs=1", "continual.finetune_epochs=1",
                 "continual.methods=[task_ownership]",
                 f"hydra.run.dir={tmp_path}"]
    # python -m lightning_pin.train, forked from a process that imported the app (tests/fork_runner.py).
    command = [sys.executable, "-m", "lightning_pin.train", *overrides]
    result = fork_runner.run(command, cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "task ownership BWT 0.0 (exact)" in result.stdout
    report = json.loads((tmp_path / "continual_report.json").read_text())
    owned = report["methods"]["task_ownership"]
    assert owned["bwt"] == 0.0 and owned["fingerprints_unchanged"] is True
    assert all(v is not None for v in owned["matrix"][-1])
    assert (tmp_path / "continual_accuracy.png").stat().st_size > 0
    checkpoint = torch.load(tmp_path / "continual.ckpt", weights_only=True)
    status = checkpoint["task_ownership"]["status"]
    assert status == {"1": "committed", "2": "committed", "3": "committed"}
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    assert summary["bwt"] == 0.0 and summary["final"] == owned["average_accuracy"]
