"""benchmarks/campaign.py runs end to end (--smoke: a tiny study, a few draws), so it never rots. No timing is
asserted (tiny sizes, noisy machines): only that every section produced its figures, that the study's
--no-retrain loop and the hand-written one measured the same accuracies (the script checks it), and that the
study printed its progress."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "campaign.py"


def test_campaign_benchmark_reports_the_three_ratios(tmp_path, fork_runner):
    out = tmp_path / "campaign.json"
    done = fork_runner.run([sys.executable, str(BENCH), "--smoke", "--json", str(out)], cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    a, b, c = results["study_overhead"], results["no_retrain_per_draw"], results["drawing_over_evaluation"]
    assert a["jobs"] == 2 and a["workers"] == 2 and a["ratio"] > 0 and a["progress_lines"] >= 8
    assert b["draws"] == 4 and len(b["rounds"]) == 2 and b["ours_ms"] > 0 and b["hand_ms"] > 0
    assert set(c) == {f"{model}: {kind}" for model in ("fault_study MLP", "digits CNN")
                      for kind in ("bit_faults 1e-3", "cell_faults 0.1")}
    assert all(row["ratio"] > 0 and row["elements"] > 0 for row in c.values())
    assert results["load_average_before"] is not None
    for goal in ("(goal <= 1.3)", "(goal <= 1.15)", "(goal <= 0.2)"):
        assert goal in done.stdout
