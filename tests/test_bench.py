"""The benchmark runs end to end, so it never rots: --smoke, which is --quick (every section and
case) on the smallest sizes. No timing is asserted here (the machines are noisy, the sizes tiny):
only that every section produced its figures, and the memory figure, which is deterministic."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"


def test_quick_benchmark_reports_every_section(tmp_path, fork_runner):
    out = tmp_path / "bench.json"
    # Forked from the process that imported torch and Lightning once (tests/fork_runner.py); the steady-malloc
    # variables already set, so that the script does not exec itself into a fresh interpreter (--smoke's timings
    # mean nothing: whether glibc reads them matters not here).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}
    done = fork_runner.run([sys.executable, str(BENCH), "--smoke", "--json", str(out)], cwd=tmp_path, env=env,
                           timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    ratios = results["step_time_ratio"]
    assert ratios["unpinned"] == 1.0
    assert {
        "pinned 1%", "pinned 20%", "pinned 50%", "pinned 80%", "pinned 50%, statistics at zero (before)",
        "frozen halves", "prune 1%", "prune 20%", "ours to zero 20%", "dense mask 1%",
        "stuck bits 1%", "stuck bits 20%", "bounds 1%", "bounds 20%",
    } <= set(ratios)
    assert all(r > 0 for r in ratios.values())
    # Every round's ratio is reported, not only the median.
    assert all(len(rounds) == 2 for rounds in results["step_time_rounds"].values())
    assert set(results["prune_overhead"]) == {"1%", "20%"}
    assert {"pinned 50%"} <= set(results["optimizers"]["adam"]) and {"pinned 50%"} <= set(results["optimizers"]["sgd"])
    assert {"step", "mask", "restore"} <= set(results["engine_ms"]["50%"])
    # The front door row runs when this build has lightning_pin.pin, and says it skipped otherwise.
    assert results["plain_loop"] or "skipped: this build has no lightning_pin.pin" in done.stdout
    # int32 indices + float32 targets: exactly 8 bytes per pinned element.
    assert results["bytes_per_pinned_0.01"] == 8.0 and results["bytes_per_pinned_0.5"] == 8.0
    assert results["bytes_per_pinned_0.8"] == 8.0
    assert results["naive_reset_worst_drift"] > 0  # the naive approach lets values drift
    assert results["setup_seconds"]["params"] > 0 and results["ddp_step_time_ratio"] > 0
    assert "step time / unpinned step time" in done.stdout and "prune / ours" in done.stdout
    assert set(results["peak_rss_mb"]) == {"unpinned", "pinned 1%"} and all(results["peak_rss_mb"].values())
    assert len(results["scaling"]) == 1 and set(results["depth"]) == {"AdamW for-loop 1% x4", "AdamW for-loop 1% x64"}
