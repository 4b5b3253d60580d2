"""The rows and tables of a fault study against hand-computed ones: ``recovered`` / ``recovered_step`` (a job
recovered when it ends within the tolerance), the spread the tables print (the range under 3 seeds, a t interval
that says its n, clipped to [0, 1] and marked so), and the CSV and the table agreeing."""

from __future__ import annotations

import math

import pytest

from lightning_pin.reporting import faults as report


def summary(final, gap, recovered_step, settled_step, seed, diverged=False, rate=0.1):
    return {"fault": {"kind": "value", "rate": rate, "seed": seed, "params": None}, "baseline": 0.9,
            "forced": 0.5, "final": final, "gap": gap, "tolerance": 0.01, "recovered_step": recovered_step,
            "settled_step": settled_step, "diverged": diverged, "pins_exact": True, "metric": "accuracy"}


# (summary, recovered, recovered_step) by hand: the end decides.
CASES = [
    (summary(0.85, 0.05, 0, None, 0), False, None),  # within the tolerance when forced, ended outside it
    (summary(0.895, 0.005, 4, 4, 1), True, 4),  # came back at step 4 and stayed
    (summary(0.80, 0.10, 2, None, 2), False, None),  # came back at step 2, then left
    (summary(0.90, 0.0, 6, 6, 3, diverged=True), False, None),  # ended within it, but the loss blew up
    (summary(0.91, -0.01, 0, 0, 4), True, 0),  # never left it
]


@pytest.mark.parametrize("given,recovered,step", CASES)
def test_recovered_step_is_empty_unless_the_job_ends_within_the_tolerance(given, recovered, step):
    row = report.job_row(given)
    assert row["recovered"] is recovered and row["recovered_step"] == step


def test_a_forced_only_row_is_neither_recovered_nor_not():
    row = report.job_row({**summary(None, None, None, None, 0), "final": None})
    assert row["recovered"] is None and row["recovered_step"] is None


def test_the_csv_column_and_the_table_agree(tmp_path, capsys):
    rows = [report.job_row(s) for s, _, _ in CASES]
    path = report.write_csv(rows, tmp_path / "curve.csv")
    read = report.read_csv(path)
    assert [r["recovered"] for r in read] == ["false", "true", "false", "false", "true"]
    assert [r["recovered_step"] for r in read] == ["", "4", "", "", "0"]
    report.print_curve(read, "t")
    out = capsys.readouterr().out
    assert "2/5, 1 diverged" in out  # two "true" cells of five, from the CSV as from the rows
    assert report.aggregate(rows)[0]["recovered"] == 2


def test_an_older_csv_without_the_column_counts_as_before():
    old = [{"rate": 0.1, "seed": 0, "recovered_step": "3", "diverged": "false"},
           {"rate": 0.1, "seed": 1, "recovered_step": "", "diverged": "false"},
           {"rate": 0.1, "seed": 2, "recovered_step": "1", "diverged": "true"}]
    assert report.aggregate(old)[0]["recovered"] == 1


def point(values, column="forced"):
    return report.aggregate([{"rate": 0.1, column: v} for v in values])[0]


def test_two_seeds_print_their_range_not_a_t_interval():
    assert report.spread(point([0.82, 0.85]), "forced") == "0.835 (range 0.820 to 0.850)"
    assert "range" in report.spread_note([point([0.82, 0.85])])


def test_three_seeds_print_a_t_interval_and_its_n():
    # mean 0.6, sd 0.1, t(2) = 4.303: 4.303 * 0.1 / sqrt(3) = 0.2484
    assert report.spread(point([0.5, 0.6, 0.7]), "forced") == "0.600 ± 0.248"
    assert "n = 3 seeds (Student's t)" in report.spread_note([point([0.5, 0.6, 0.7])])
    note = report.spread_note([point([0.5, 0.6, 0.7]), point([0.5, 0.7])])
    assert "n = 2 to 3" in note and "range" in note


def test_an_accuracy_interval_never_leaves_0_1_unsaid():
    # mean 0.15, sd sqrt(0.0175) = 0.1323, half-width 4.303 * 0.1323 / sqrt(3) = 0.3287: [-0.179, 0.479]
    text = report.spread(point([0.05, 0.3, 0.1]), "forced")
    assert text == "0.150 (95% CI 0.000 to 0.479, clipped to [0, 1])"
    high = report.spread(point([0.99, 0.8, 0.97]), "forced")  # mean 0.92, +0.2601: above 1
    assert high.endswith("to 1.000, clipped to [0, 1])")
    # A gap is not an accuracy: its interval is printed as it is (sd 0.1756, 4.303 * 0.1756 / sqrt(3) = 0.436).
    assert report.spread(point([-0.05, 0.3, 0.1], "gap"), "gap", bounded=False) == "0.117 ± 0.436"


def test_the_terminal_table_prints_the_range_and_the_clipping(capsys):
    rows = [dict(kind="value", rate=0.2, seed=s, baseline=0.9, forced=f, final=0.9, gap=0.0, tolerance=0.01,
                 recovered_step=0, settled_step=0, pins_exact=True, diverged=False)
            for s, f in enumerate([0.05, 0.3, 0.1])]
    rows += [dict(rows[0], rate=0.5, seed=s, forced=f) for s, f in enumerate([0.4, 0.5])]
    report.print_curve(rows, "t")
    out = capsys.readouterr().out
    assert "0.150 (95% CI 0.000 to 0.479, clipped to [0, 1])" in out
    assert "0.450 (range 0.400 to 0.500)" in out
    assert "n = 2 to 3 (the seeds column)" in out and not math.isnan(report.aggregate(rows)[0]["forced_ci"])


def _saved_figures(monkeypatch):
    from matplotlib.figure import Figure

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda self, path, **kw: saved.append(self))
    return saved


def flip_rows(bimodal_at=None, seeds=20):
    rows = []
    for rate in (0.0, 1e-4, 1e-3, 1e-2):
        for s in range(seeds):
            forced = 0.9 - 30 * rate - 0.001 * (s % 3)
            if rate == bimodal_at:
                forced = 0.85 + 0.001 * s if s % 2 else 0.10 + 0.001 * s  # two groups, 0.75 apart
            rows.append(dict(kind="flip", rate=rate, seed=s, baseline=0.9, tolerance=0.01, forced=forced, final=None))
    return rows


def test_rates_over_decades_are_drawn_on_a_log_axis_with_rate_0_apart(monkeypatch, tmp_path):
    saved = _saved_figures(monkeypatch)
    report.plot_curve(flip_rows(), tmp_path / "c.png")
    ax = saved[-1].axes[0]
    assert ax.get_xscale() == "log" and "log scale" in ax.get_xlabel()
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["0", "0.01", "0.1", "1"]  # percent of the stored bits: 1e-4 is 0.01%
    zero, first = ax.get_xticks()[:2]
    assert 0 < zero < first / 10  # the control sits left of the smallest rate, a decade and more away
    assert any(t.get_text() == "//" for t in ax.texts)  # the break
    # The curve does not cross the break: the mean line starts at the smallest rate.
    curve = next(line for line in ax.get_lines() if str(line.get_label()).endswith(": mean"))
    assert list(curve.get_xdata()) == [0.01, 0.1, 1.0]
    # Rates within a decade or so stay on a linear axis.
    report.plot_curve([dict(r, rate=r["rate"] * 1000 + 0.05 * (r["rate"] > 0)) for r in flip_rows()],
                      tmp_path / "c.png")
    assert saved[-1].axes[0].get_xscale() == "linear"


def test_bimodal_draws_are_drawn_as_points_with_their_median(monkeypatch, tmp_path, capsys):
    from matplotlib.collections import PathCollection, PolyCollection

    saved = _saved_figures(monkeypatch)
    rows = flip_rows(bimodal_at=1e-2)
    report.plot_curve(rows, tmp_path / "c.png")
    ax = saved[-1].axes[0]
    assert not [c for c in ax.collections if isinstance(c, PolyCollection) and "CI" in str(c.get_label())]
    curve = next(line for line in ax.get_lines() if str(line.get_label()).endswith(": median"))
    draws = sorted(r["forced"] for r in rows if r["rate"] == 1e-2)
    assert curve.get_ydata()[-1] == (draws[9] + draws[10]) / 2  # the median of 20 draws, by hand
    points = sum(len(c.get_offsets()) for c in ax.collections if isinstance(c, PathCollection))
    assert points == len(rows)  # every draw
    assert "bimodal draws at 1%" in ax.get_title()
    report.print_curve(rows, "t")
    assert "rate 0.01: the forced draws are bimodal" in capsys.readouterr().out
    # One group of draws: the mean and its band, as before.
    report.plot_curve(flip_rows(), tmp_path / "c.png")
    ax = saved[-1].axes[0]
    assert any(str(line.get_label()).endswith(": mean") for line in ax.get_lines())
    assert [c for c in ax.collections if isinstance(c, PolyCollection) and "CI" in str(c.get_label())]
