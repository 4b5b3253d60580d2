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


def _texts(fig) -> str:
    return " ".join(t.get_text() for t in fig.texts) + " ".join(ax.get_title() for ax in fig.axes)


def test_a_pin_drift_that_is_the_same_at_every_step_is_folded_into_a_caption_that_says_what_it_is():
    # AdamW: the pinned values are the same every step, so its decoupled weight decay moves them by the same amount.
    flat = diverging(pin_drift=[[5, 5.96e-05, 3.08e-05, 0], [10, 5.96e-05, 3.08e-05, 0], [15, 5.96e-05, 3.08e-05, 0]])
    fig = build_figure(flat)
    assert len(fig.axes) == 2 and not any(ax.get_title().startswith("pin drift") for ax in fig.axes)
    caption = _texts(fig)
    assert "the same at each of the 3 logged steps" in caption and "weight decay" in caption
    assert "5.960e-05" in caption and "3.080e-05" in caption
    rows = dict(report_rows(flat))
    assert "the same at every logged step" in rows["pin drift max / mean"]
    # A drift that changes keeps its panel.
    assert len(build_figure(diverging(pin_drift=[[5, 1e-5, 5e-6, 0], [10, 6e-5, 3e-5, 0]])).axes) == 3


def test_a_run_shorter_than_the_logging_interval_says_why_the_drift_is_missing_and_draws_no_fake_line():
    short = make_report(
        metric="accuracy", tolerance=0.01, baseline=0.1, forced=0.1, accuracy=[[0, 0.1], [4, 0.36]],
        pin_drift=[], weight_drift=[[0, 0.0, 0.0], [4, 0.69, 0.157]], pinned_elements=237,
    )  # fmt: skip
    assert short["steps"] == 4
    fig = build_figure(short)
    caption = _texts(fig)
    assert "pin drift was not logged" in caption and "4 optimizer steps" in caption and "log_every_n_steps" in caption
    metric = fig.axes[0]
    assert "measured at steps 0 and 4 only" in metric.get_title()
    assert metric.lines[0].get_linestyle() == ":"  # two measurements: no line drawn as if measured in between
    assert all(float(t).is_integer() for t in metric.get_xticks())  # steps are whole numbers
    rows = dict(report_rows(short))
    assert rows["pin drift max / mean"].startswith("not logged") and "log_every_n_steps" in rows["pin drift max / mean"]
    # A long run whose monitor had the pin drift off: the weight drift was logged in between, so it is not the interval.
    off = make_report(metric="accuracy", baseline=0.9, forced=0.5, accuracy=[[0, 0.5], [40, 0.9]], pin_drift=[],
                      weight_drift=[[0, 0.0, 0.0], [20, 0.5, 0.1], [40, 0.7, 0.15]], pinned_elements=7)
    assert "PinMonitor(drift=False)" in _texts(build_figure(off)) and "log_every_n_steps" not in _texts(build_figure(off))
    assert dict(report_rows(off))["pin drift max / mean"] == "not measured (PinMonitor(drift=False))"


def test_the_chance_line_is_drawn_when_the_report_knows_it():
    def chance_lines(report):
        return [line for line in build_figure(report).axes[0].get_lines() if line.get_label().startswith("chance")]

    assert chance_lines(diverging()) == []
    (line,) = chance_lines({**diverging(), "chance": 0.1})
    assert list(line.get_ydata()) == [0.1, 0.1] and line.get_label() == "chance 0.1000"
