"""The report's PNG and recovery wording: legends beside the data, a zero drift on a linear axis from 0,
and "within the tolerance from step N" only when the metric stayed there."""

from __future__ import annotations

import pytest

from lightning_pin.app.train import _recovery, print_summary
from lightning_pin.reporting.report import build_figure, make_report, recovery_text, report_rows, settled_step

pytest.importorskip("matplotlib")


def diverging(**kwargs) -> dict:
    """20% of the conv weights stuck under SGD: back within 0.01 at step 20, then diverging."""
    values = dict(
        metric="accuracy", tolerance=0.01, baseline=0.967, forced=0.537,
        accuracy=[[0, 0.537], [20, 0.96], [40, 0.5], [60, 0.2], [80, 0.087]],
        pin_drift=[[5, 0.0, 0.0, 0], [10, 0.0, 0.0, 0]],
        weight_drift=[[0, 0.0, 0.0, 0.0, 0.0], [40, 20.0, 1.0, 15.0, 5.0], [80, 49.7, 2.49, 40.0, 9.0]],
        modules=["backbone.features", "backbone.head"], pinned_elements=947,
    )  # fmt: skip
    return make_report(**{**values, **kwargs})


def test_legends_sit_beside_the_data_and_a_zero_drift_axis_starts_at_zero():
    fig = build_figure(diverging())
    fig.canvas.draw()
    axes = fig.axes
    assert len(axes) == 3
    for ax in axes:
        legend = ax.get_legend()
        assert legend is not None
        assert not legend.get_window_extent().overlaps(ax.get_window_extent()), ax.get_title()
    drift = axes[1]
    assert drift.get_yscale() == "linear" and drift.get_ylim()[0] == 0.0
    # A drift that is never zero is drawn on a log axis.
    positive = build_figure(diverging(pin_drift=[[5, 1e-5, 5e-6, 0], [10, 6e-5, 3e-5, 0]]))
    assert positive.axes[1].get_yscale() == "log"


def test_recovery_says_when_the_metric_left_the_band_again():
    report = diverging()
    assert report["recovered_step"] == 20 and settled_step(report) is None
    assert recovery_text(report) == "20, then left it and ended outside"
    assert ("recovered within 0.01 at step", "20, then left it and ended outside") in report_rows(report)
    back = diverging(accuracy=[[0, 0.5], [20, 0.96], [40, 0.5], [60, 0.962], [80, 0.97]])
    assert settled_step(back) == 60 and recovery_text(back) == "20 (left it, back for good from step 60)"
    steady = diverging(accuracy=[[0, 0.5], [20, 0.96], [40, 0.965]])
    assert settled_step(steady) == 20 and recovery_text(steady) == "20"
    never = diverging(accuracy=[[0, 0.5], [20, 0.6]])
    assert never["recovered_step"] is None and recovery_text(never) == "not recovered"


def test_the_app_summary_says_within_only_when_it_stayed_within(capsys):
    base = {"tolerance": 0.01, "recovered_step": 20}
    assert _recovery({**base, "settled_step": None}) == "within 0.01 at step 20, then left it: ended outside"
    assert _recovery({**base, "settled_step": 60}) == "within 0.01 from step 60"
    assert _recovery({**base, "recovered_step": None, "settled_step": None}) == "never within 0.01"
    report = diverging()
    summary = {
        "choices": {"pin": "fraction"}, "pinned_elements": 947, "trainable_elements": 9930, "violations": 0,
        "files": [], "output_dir": "out", "seconds": 1.0, "settled_step": settled_step(report),
        **{k: report[k] for k in ("baseline", "forced", "final", "gap", "tolerance", "recovered_step")},
    }  # fmt: skip
    print_summary(summary)
    out = capsys.readouterr().out
    assert "then left it: ended outside" in out and "within 0.01 from step" not in out
