"""The files of a fault study: ``fault_curve.csv`` / ``.png``, ``layer_sensitivity.csv`` / ``.png``, a table.

Reads the ``run_summary.json`` of each job (written by the app) and nothing else: no engine, no
Lightning. One row per job; the curve is the mean over seeds at each rate, with a 95% confidence
interval from Student's t (seeds are few, so the normal 1.96 would be too narrow).

Example::

    >>> rows = [{"rate": 0.1, "seed": s, "forced": f, "final": 0.9} for s, f in enumerate([0.5, 0.7])]
    >>> point = aggregate(rows, "rate")[0]
    >>> point["rate"], round(point["forced_mean"], 3), round(point["forced_ci"], 3), point["final_ci"]
    (0.1, 0.6, 1.271, 0.0)
"""

from __future__ import annotations

import csv
import math
import statistics
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from lightning_pin.reporting import tables

__all__ = [
    "COLUMNS", "DEFAULT_OPTIMIZER", "FAULT_CURVE_CSV", "FAULT_CURVE_PNG", "LAYER_COLUMNS", "LAYER_CSV", "LAYER_PNG",
    "MIN_SEEDS_FOR_CI", "aggregate", "job_row", "mean_ci", "plot_curve", "plot_layers", "preload", "print_curve",
    "read_csv", "retrained", "short_names", "sort_rows", "t975", "write_csv",
]


FAULT_CURVE_CSV = "fault_curve.csv"
FAULT_CURVE_PNG = "fault_curve.png"
LAYER_CSV = "layer_sensitivity.csv"
LAYER_PNG = "layer_sensitivity.png"

#: Columns of fault_curve.csv (one row per job); layer_sensitivity.csv adds ``param`` after ``seed``.
COLUMNS: tuple[str, ...] = (
    "kind",
    "rate",
    "seed",
    "baseline",
    "forced",
    "final",
    "gap",
    "recovered_step",
    "recovered",
    "pinned_elements",
    "changed_bits",
    "pins_exact",
    "seconds",
    "steps",
    "tolerance",
    "train_loss",
    "diverged",
    # lightning-pin faults --remap: the faults' squared change to the weights, unmapped and mapped, and its cost
    "damage_before",
    "damage_after",
    "remap_seconds",
    "recipe",
    "job_dir",
)
LAYER_COLUMNS: tuple[str, ...] = COLUMNS[:3] + ("param", "elements") + COLUMNS[3:]

# Two-sided 97.5% quantiles of Student's t, by degrees of freedom (scipy-free).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t975(dof: int) -> float:
    """Student's t quantile for a two-sided 95% interval (the nearest tabulated dof at or below)."""
    if dof < 1:
        return math.nan
    return _T975[max(d for d in _T975 if d <= dof)] if dof <= 120 else 1.960


def mean_ci(values: Iterable[Optional[float]]) -> tuple[float, float, int]:
    """Mean, 95% CI half-width and count of the finite values (CI 0 for one value, NaN for none)."""
    finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not finite:
        return math.nan, math.nan, 0
    if len(finite) == 1:
        return finite[0], 0.0, 1
    return statistics.fmean(finite), t975(len(finite) - 1) * statistics.stdev(finite) / math.sqrt(len(finite)), len(
        finite
    )


def job_row(summary: Mapping[str, Any], job_dir: str = "") -> dict[str, Any]:
    """The CSV row of one job from its ``run_summary.json``."""
    fault = summary.get("fault") or {}
    row = {key: summary.get(key) for key in COLUMNS}
    row.update(kind=fault.get("kind"), rate=fault.get("rate"), seed=fault.get("seed"), param=fault.get("params"))
    row["recipe"] = " ".join(summary.get("recipe") or [])
    row["job_dir"] = job_dir or summary.get("output_dir", "")
    row["metric"] = summary.get("metric")  # not a CSV column: which tables clip their intervals to [0, 1]
    row["recovered"] = ended_recovered(summary)
    # The first step within the tolerance says when a job recovered, for a job that did: one that came back
    # (or was within it when forced) and ended outside it has none.
    row["recovered_step"] = summary.get("recovered_step") if row["recovered"] else None
    return row


def ended_recovered(summary: Mapping[str, Any]) -> Optional[bool]:
    """Whether a retrained job recovered: it ended within the tolerance of the baseline and did not diverge
    (None: not retrained). The end decides: a job within the tolerance when forced, or at some step, and
    outside it at the end, did not recover.

    Example::

        >>> ended_recovered({"final": 0.90, "gap": 0.05, "tolerance": 0.01, "recovered_step": 0, "settled_step": None})
        False
        >>> ended_recovered({"final": 0.95, "gap": 0.0, "tolerance": 0.01, "recovered_step": 4, "settled_step": 4})
        True
    """
    if summary.get("final") in (None, ""):
        return None
    if _true(summary.get("diverged")):
        return False
    if "settled_step" in summary:  # the monitor's history: within the tolerance from some step to the end
        return summary["settled_step"] not in (None, "")
    gap, tolerance = summary.get("gap"), summary.get("tolerance")
    if not _finite(gap) or not _finite(tolerance):
        return False
    return float(gap) <= float(tolerance)


def row_recovered(row: Mapping[str, Any]) -> bool:
    """A row's ``recovered`` cell (True, or "true" read back), or, in a CSV written before that column, a
    ``recovered_step`` and no divergence."""
    if "recovered" in row:
        return _true(row.get("recovered"))
    return row.get("recovered_step") not in (None, "") and not _true(row.get("diverged"))


def sort_rows(rows: Iterable[Mapping[str, Any]], by: str = "rate") -> list[dict[str, Any]]:
    return sorted((dict(r) for r in rows), key=lambda r: (str(r.get(by)) if by == "param" else r.get(by), r["seed"]))


def aggregate(rows: Sequence[Mapping[str, Any]], by: str = "rate") -> list[dict[str, Any]]:
    """Per value of ``by`` (rate, or param): mean and 95% CI of forced, final and gap over seeds."""
    groups: dict[Any, list[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row[by], []).append(row)
    points = []
    for key, group in groups.items():
        point: dict[str, Any] = {by: key, "seeds": len(group)}
        for column in ("forced", "final", "gap", "baseline", "changed_bits", "pinned_elements"):
            values = [float(r[column]) for r in group if _finite(r.get(column))]
            point[f"{column}_mean"], point[f"{column}_ci"], point[f"{column}_n"] = mean_ci(values)
            point[f"{column}_min"] = min(values) if values else math.nan
            point[f"{column}_max"] = max(values) if values else math.nan
        # Ended within the tolerance, not diverged: a job that came back and then left it did not recover.
        point["recovered"] = sum(row_recovered(r) for r in group)
        point["diverged"] = sum(_true(r.get("diverged")) for r in group)
        point["pins_exact"] = all(r.get("pins_exact") for r in group)
        points.append(point)
    return sorted(points, key=lambda p: str(p[by]) if by == "param" else p[by])


def write_csv(rows: Sequence[Mapping[str, Any]], path: Path, columns: Sequence[str] = COLUMNS) -> Path:
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(columns)
        for row in rows:
            writer.writerow([_cell(row.get(c)) for c in columns])
    return path


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


#: The app's optimizer when a recipe does not choose one (conf/train.yaml).
DEFAULT_OPTIMIZER = "adamw"


def _optimizer(recipe: Any) -> str:
    """The optimizer a job's recipe (its overrides, space separated) chose: the last ``optimizer=``, or the default."""
    chosen = [o.split("=", 1)[1] for o in str(recipe or "").split() if o.split("=", 1)[0] == "optimizer"]
    return chosen[-1] if chosen else DEFAULT_OPTIMIZER


def _true(value: Any) -> bool:
    """A boolean cell of a row: True, or "true" as read back from fault_curve.csv."""
    return value is True or str(value).lower() == "true"


def spread(point: Mapping[str, Any], column: str, bounded: bool = True, digits: int = 3) -> str:
    """A column of an :func:`aggregate` point as the tables print it: the mean, then, from
    :data:`MIN_SEEDS_FOR_CI` seeds on, ``± half-width`` of the 95% interval (Student's t) or, when that interval
    leaves [0, 1] (``bounded``: an accuracy), the interval clipped to [0, 1] and marked so; with 2 seeds the range
    over them (a t interval from 2 values is +-12.7 standard errors: no interval a reviewer would read).

    Example::

        >>> rows = [{"rate": 0.1, "forced": f} for f in (0.82, 0.85)]
        >>> spread(aggregate(rows)[0], "forced")
        '0.835 (range 0.820 to 0.850)'
        >>> rows = [{"rate": 0.1, "forced": f} for f in (0.05, 0.3, 0.1)]
        >>> spread(aggregate(rows)[0], "forced")
        '0.150 (95% CI 0.000 to 0.479, clipped to [0, 1])'
    """
    mean, ci, n = point[f"{column}_mean"], point[f"{column}_ci"], point.get(f"{column}_n", point.get("seeds", 0))
    if n == 0 or math.isnan(mean):
        return "-"
    if n == 1:
        return f"{mean:.{digits}f}"
    if n < MIN_SEEDS_FOR_CI:
        return f"{mean:.{digits}f} (range {point[f'{column}_min']:.{digits}f} to {point[f'{column}_max']:.{digits}f})"
    if bounded and (mean - ci < 0.0 or mean + ci > 1.0):
        low, high, _ = _band(mean, ci)
        return f"{mean:.{digits}f} (95% CI {low:.{digits}f} to {high:.{digits}f}, clipped to [0, 1])"
    return f"{mean:.{digits}f} ± {ci:.{digits}f}"


def spread_note(points: Sequence[Mapping[str, Any]]) -> str:
    """What the tables' spreads are, with their n: one line under a table of :func:`spread` cells."""
    counts = sorted({int(p["seeds"]) for p in points})
    if not counts:
        return ""
    n = f"n = {counts[0]}" if len(counts) == 1 else f"n = {counts[0]} to {counts[-1]} (the seeds column)"
    if counts[-1] < 2:
        return f"one seed per row ({n}): no spread"
    if counts[-1] < MIN_SEEDS_FOR_CI:
        return (f"mean over {n} seeds, and the range (min to max) over them: fewer than {MIN_SEEDS_FOR_CI} seeds "
                "give no confidence interval worth printing")
    note = f"± is the 95% confidence interval of the mean over {n} seeds (Student's t)"
    if counts[0] < MIN_SEEDS_FOR_CI:
        note += f"; rows with fewer than {MIN_SEEDS_FOR_CI} seeds give their range (min to max) instead"
    return note


def accuracy_rows(rows: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the rows measure an accuracy (a fraction in [0, 1], whose intervals are clipped there): every
    baseline, forced and final value lies in [0, 1] and no row names another metric."""
    if any(r.get("metric") not in (None, "", "accuracy") for r in rows):
        return False
    values = [float(r[c]) for r in rows for c in ("baseline", "forced", "final") if _finite(r.get(c))]
    return all(0.0 <= v <= 1.0 for v in values)


def retrained(rows: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any row was retrained (a ``--no-retrain`` study has no final accuracy at all)."""
    return any(r.get("final") not in (None, "") for r in rows)


def print_curve(rows: Sequence[Mapping[str, Any]], title: str, by: str = "rate") -> None:
    """One line per rate (or parameter): forced and final, mean ± 95% CI over seeds (forced only, not retrained)."""
    points = aggregate(rows, by)
    full = retrained(rows)
    bounded = accuracy_rows(rows)
    columns = [
        tables.Column(by, justify="left" if by == "param" else "right"),
        tables.Column("seeds", justify="right"),
        tables.Column("forced (no retraining)", justify="right", no_wrap=True),
    ]
    if full:
        columns += [
            tables.Column("final (retrained)", justify="right", no_wrap=True),
            tables.Column("gap to baseline", justify="right", no_wrap=True),
            tables.Column("recovered", justify="right"),
            tables.Column("exact", justify="right"),
        ]
    else:
        columns.append(tables.Column("changed bits", justify="right", no_wrap=True))
    body = []
    for p in points:
        line = [str(p[by]) if by == "param" else f"{float(p[by]):g}", str(p["seeds"]), spread(p, "forced", bounded)]
        if full:
            diverged = f", {p['diverged']} diverged" if p["diverged"] else ""
            line += [
                spread(p, "final", bounded),
                spread(p, "gap", False),
                f"{p['recovered']}/{p['seeds']}{diverged}",
                "yes" if p["pins_exact"] else "NO",
            ]
        else:
            line.append("-" if math.isnan(p["changed_bits_mean"]) else f"{p['changed_bits_mean']:,.0f}")
        body.append(line)
    # Numbers, from the rows in memory or as read back from fault_curve.csv.
    baseline = [float(r["baseline"]) for r in rows if _finite(r.get("baseline"))]
    tolerance = next((float(r["tolerance"]) for r in rows if _finite(r.get("tolerance"))), None)
    footer = []
    if baseline:
        footer.append((f"baseline {baseline[0]:.3f}" + ("" if tolerance is None else f", tolerance {tolerance:g}")
                       + f"; {spread_note(points)}", None))
    if not full:
        footer.append(("forced only (no retraining): final, gap and recovered_step are empty in the CSV", None))
    for p in points:
        for column in ("forced", "final") if full else ("forced",):
            draws = [float(r[column]) for r in rows if r[by] == p[by] and _finite(r.get(column))]
            if bimodal(draws):
                where = p[by] if by == "param" else f"rate {float(p[by]):g}"
                footer.append((f"{where}: the {column} draws are bimodal (median {statistics.median(draws):.3f}, "
                               f"from {min(draws):.3f} to {max(draws):.3f}): the mean sits between the modes; the "
                               "figure shows every draw and the median", "yellow"))
    diverged = [r for r in rows if _true(r.get("diverged"))]
    if diverged:
        used = {_optimizer(r.get("recipe")) for r in diverged}
        other = "another optimizer (optimizer=adamw)" if DEFAULT_OPTIMIZER not in used else "another optimizer"
        footer.append((f"{len(diverged)} job(s) diverged (a loss that is not finite, or retraining that ended at "
                       f"chance or below the forced accuracy) under {', '.join(sorted(used))}: try a lower "
                       f"learning rate (optimizer.lr=...) or {other}", "red"))
    tables.print_table(columns, body, title, footer=footer)


#: Fewer seeds than this draw no confidence band (a t interval over 2 seeds is +-12.7 standard errors).
MIN_SEEDS_FOR_CI = 3


def _rate_label(kind: str) -> str:
    if kind in ("bit", "flip"):
        return f"bit error rate (% of the stored bits, kind={kind})"
    if kind == "neuron":
        return f"fault rate (% of the units: channels or output positions, kind={kind})"
    return f"fault rate (% of the cells, kind={kind})"


def _band(mean: float, ci: float) -> tuple[float, float, bool]:
    """The CI band of an accuracy, clipped to [0, 1], and whether it was clipped."""
    low, high = mean - ci, mean + ci
    return max(0.0, low), min(1.0, high), low < 0.0 or high > 1.0


def log_rates(rates: Iterable[float]) -> bool:
    """Whether fault rates spread over decades (the largest at least 100 times the smallest above 0): a log axis.

    Example::

        >>> log_rates([0, 1e-4, 1e-3, 1e-2]), log_rates([0, 0.05, 0.1, 0.2])
        (True, False)
    """
    positive = [float(r) for r in rates if float(r) > 0]
    return len(positive) >= 2 and max(positive) >= 100 * min(positive)


def bimodal(values: Iterable[Any], min_gap: float = 0.05) -> bool:
    """Whether a set of draws falls into two separate groups: the widest gap between the sorted values is at least
    ``min_gap`` (in the metric's units: 5 accuracy points), half their range, and three times the spread within
    either group, and each group holds at least 2 draws and a tenth of them. Such a set is shown as its points and
    its median: its mean sits between the modes, where no draw is.

    Example::

        >>> bimodal([0.1, 0.12, 0.11, 0.9, 0.92, 0.91]), bimodal([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
        (True, False)
        >>> bimodal([0.898, 0.899, 0.9] * 3)  # a few accuracy levels a batch apart: one group
        False
    """
    v = sorted(float(x) for x in values if _finite(x))
    if len(v) < 6 or v[-1] - v[0] <= 0:
        return False
    gap, at = max((v[i + 1] - v[i], i) for i in range(len(v) - 1))
    low, high = v[: at + 1], v[at + 1:]
    within = max(low[-1] - low[0], high[-1] - high[0])
    return (gap >= min_gap and gap >= 0.5 * (v[-1] - v[0]) and gap >= 3 * within
            and min(len(low), len(high)) >= max(2, 0.1 * len(v)))


def plot_curve(rows: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Optional[Path]:
    """Forced (and final) accuracy against the fault rate: every seed's point, the mean over seeds, a 95% CI band
    from 3 seeds on (clipped to [0, 1], and the legend says so), the baseline and its tolerance.

    Rates that spread over decades (:func:`log_rates`: ``--rates 0,1e-4,1e-3,1e-2``) are drawn on a log axis, rate
    0 apart at its own tick left of a break. A series whose draws are :func:`bimodal` at some rate is drawn as its
    points and their median, with no mean or t band."""
    import random
    import statistics as stats

    Figure = _figure()
    if Figure is None:
        return None
    points = aggregate(rows, "rate")
    fig = Figure(figsize=(6.4, 5.0), dpi=120)
    ax = fig.subplots()
    baseline = next((float(r["baseline"]) for r in rows if _finite(r.get("baseline"))), None)
    tolerance = next((float(r["tolerance"]) for r in rows if _finite(r.get("tolerance"))), None)
    if baseline is not None:
        if tolerance:
            ax.axhspan(baseline - tolerance, baseline, color="tab:green", alpha=0.12, lw=0,
                       label=f"within tolerance ({tolerance:g})")
        ax.axhline(baseline, color="tab:green", lw=1.2, ls="--", label=f"baseline {baseline:.3f}")
    series = [("forced", "tab:red", "forced (faults in, no retraining)")]
    if retrained(rows):
        series.append(("final", "tab:blue", "final (retrained around the faults)"))
    logx = log_rates(p["rate"] for p in points)
    positive = [100 * float(p["rate"]) for p in points if float(p["rate"]) > 0]
    # On a log axis rate 0 has no place: it is drawn a decade and a half left of the smallest rate, apart.
    zero_x = min(positive) / 10 ** 1.5 if logx else 0.0

    def x_of(rate: Any) -> float:
        return 100 * float(rate) if not logx or float(rate) > 0 else zero_x

    jitter = random.Random(0)
    clipped_any, bimodal_rates = False, set()
    for column, color, label in series:
        ok = [p for p in points if not math.isnan(p[f"{column}_mean"])]
        draws = {p["rate"]: [float(r[column]) for r in rows if r["rate"] == p["rate"] and _finite(r.get(column))]
                 for p in ok}
        split = {rate for rate, values in draws.items() if bimodal(values)}
        bimodal_rates |= split
        centre = (lambda p: stats.median(draws[p["rate"]])) if split else (lambda p: p[f"{column}_mean"])
        what = "median" if split else "mean"
        apart = [p for p in ok if logx and float(p["rate"]) == 0]
        joined = [p for p in ok if p not in apart]
        ax.plot([x_of(p["rate"]) for p in joined], [centre(p) for p in joined], marker="D" if split else "o",
                color=color, label=f"{label}: {what}")
        if apart:  # the control, not joined to the curve across the break
            ax.plot([zero_x], [centre(apart[0])], marker="D" if split else "o", color=color, ls="none")
        many = max((len(v) for v in draws.values()), default=0) > 10
        xs, ys = [], []
        for rate, values in draws.items():
            for value in values:
                spread_x = (10 ** jitter.uniform(-0.05, 0.05)) if logx else 1.0
                xs.append(x_of(rate) * spread_x if many else x_of(rate))
                ys.append(value)
        ax.scatter(xs, ys, s=10 if many else 14, facecolors="none", edgecolors=color, alpha=0.45 if many else 0.8,
                   lw=0.8, zorder=3, label=f"{label.split(' (')[0]}: each " + ("draw" if many else "seed"))
        banded = [p for p in joined if not split and p["seeds"] >= MIN_SEEDS_FOR_CI
                  and not math.isnan(p[f"{column}_ci"])]
        if banded:
            bands = [_band(p[f"{column}_mean"], p[f"{column}_ci"]) for p in banded]
            clipped = any(c for _, _, c in bands)
            clipped_any |= clipped
            ax.fill_between([x_of(p["rate"]) for p in banded], [b[0] for b in bands], [b[1] for b in bands],
                            color=color, alpha=0.15, lw=0,
                            label=f"95% CI of the mean (Student's t, n = {_counts(banded)})"
                            + (", clipped to [0, 1]" if clipped else ""))
    kind = next((r.get("kind") for r in rows if r.get("kind")), "")
    seeds = sorted({p["seeds"] for p in points})
    ax.set_xlabel(_rate_label(kind) + (", log scale" if logx else ""))
    ax.set_ylabel("validation accuracy")
    ax.set_ylim(0.0, 1.02)
    if logx:
        _log_axis(ax, zero_x, min(positive), max(positive), any(float(p["rate"]) == 0 for p in points))
    count = f"{seeds[0]}" if len(seeds) == 1 else f"{seeds[0]}-{seeds[-1]}"
    note = (f"no confidence band with fewer than {MIN_SEEDS_FOR_CI} seeds" if seeds and seeds[0] < MIN_SEEDS_FOR_CI
            else "band: 95% CI of the mean" + (", clipped to [0, 1]" if clipped_any else ""))
    if bimodal_rates:
        where = ", ".join(f"{100 * float(r):g}%" for r in sorted(bimodal_rates, key=float))
        note = f"bimodal draws at {where}: median and every draw, no mean ± CI"
    what = "Accuracy against fault rate" if retrained(rows) else "Forced accuracy (no retraining) against fault rate"
    ax.set_title(title or f"{what}: {count} seed(s) per rate\n({note})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=7.5, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _counts(points: Sequence[Mapping[str, Any]]) -> str:
    counts = sorted({int(p["seeds"]) for p in points})
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"


def _log_axis(ax: Any, zero_x: float, low: float, high: float, has_zero: bool) -> None:
    """A log x axis (in %) with one tick per decade, and rate 0 at ``zero_x``, its own tick left of a break."""
    from matplotlib.ticker import NullFormatter, NullLocator
    from matplotlib.transforms import blended_transform_factory

    ax.set_xscale("log")
    first, last = math.floor(math.log10(low) + 1e-9), math.ceil(math.log10(high) - 1e-9)
    decades = [10.0 ** e for e in range(first, last + 1)]
    ticks = ([zero_x] if has_zero else []) + decades
    ax.set_xticks(ticks, (["0"] if has_zero else []) + [f"{d:g}" for d in decades])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim((zero_x if has_zero else low) / 10 ** 0.4, high * 10 ** 0.4)
    if has_zero:
        cut = math.sqrt(zero_x * low)  # halfway between the control and the first rate, in log space
        ax.axvline(cut, color="0.5", lw=0.8, ls=":")
        ax.text(cut, 0.0, "//", transform=blended_transform_factory(ax.transData, ax.transAxes), ha="center",
                va="center", fontsize=11, color="0.3", bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5},
                clip_on=False, zorder=5)


def _finite(value: Any) -> bool:
    try:
        return value not in (None, "") and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def short_names(names: Sequence[str]) -> list[str]:
    """Parameter names without the dotted prefix they all share, keeping its last part as context.

    Example::

        >>> short_names(["backbone.layers.0.weight", "backbone.head.weight"])
        ['layers.0.weight', 'head.weight']
        >>> short_names(["backbone.layers.0.weight", "backbone.layers.1.weight"])
        ['layers.0.weight', 'layers.1.weight']
    """
    parts = [n.split(".") for n in names]
    common = 0
    while parts and all(len(p) > common + 1 for p in parts) and len({p[common] for p in parts}) == 1:
        common += 1
    strip = common - 1 if common >= 2 else common
    return [".".join(p[strip:]) for p in parts]


def plot_layers(rows: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Optional[Path]:
    """Bars per parameter: forced (and final) accuracy with the faults in that parameter only, every seed's point,
    95% CI error bars from 3 seeds on (clipped to [0, 1], said so), and each parameter's size and faulty count."""
    Figure = _figure()
    if Figure is None:
        return None
    points = aggregate(rows, "param")
    elements = {r.get("param"): r.get("elements") for r in rows}
    labels = []
    for short, p in zip(short_names([str(p["param"]) for p in points]), points):
        size = elements.get(p["param"])
        faulty = p["pinned_elements_mean"]
        counts = [] if size in (None, "") else [f"{int(size):,} elements"]
        if not math.isnan(faulty):
            counts.append(f"{faulty:,.0f} faulty")
        labels.append(short + ("\n" + ", ".join(counts) if counts else ""))
    fig = Figure(figsize=(max(5.5, 1.6 * len(labels) + 2.5), 4.8), dpi=120)
    ax = fig.subplots()
    series = [("forced", "tab:red", "forced (no retraining)")]
    if retrained(rows):
        series.append(("final", "tab:blue", "final (retrained)"))
    width = 0.8 / len(series)
    xs = list(range(len(labels)))
    clipped_any, seeds = False, min((p["seeds"] for p in points), default=0)
    for i, (column, color, label) in enumerate(series):
        shift = (i - (len(series) - 1) / 2) * width
        means = [p[f"{column}_mean"] for p in points]
        ax.bar([x + shift for x in xs], means, width, color=color, alpha=0.75, label=label)
        if seeds >= MIN_SEEDS_FOR_CI:
            bands = [_band(m, p[f"{column}_ci"]) for m, p in zip(means, points)]
            clipped_any |= any(c for _, _, c in bands)
            ax.errorbar([x + shift for x in xs], means, yerr=[[m - b[0] for m, b in zip(means, bands)],
                                                              [b[1] - m for m, b in zip(means, bands)]],
                        fmt="none", ecolor="black", capsize=3, lw=1)
        index = {p["param"]: x for x, p in zip(xs, points)}
        dots = [(index[r["param"]] + shift, float(r[column])) for r in rows if _finite(r.get(column))]
        ax.scatter([d[0] for d in dots], [d[1] for d in dots], s=12, color="black", alpha=0.6, zorder=3,
                   label="each seed" if i == 0 else None)
    baseline = next((r["baseline"] for r in rows if r.get("baseline") is not None), None)
    if baseline is not None:
        ax.axhline(baseline, color="tab:green", ls="--", lw=1.2, label=f"baseline {baseline:.3f}")
    ax.set_xticks(xs, labels, fontsize=8)
    rate = next((r.get("rate") for r in rows if r.get("rate") is not None), None)
    kind = next((r.get("kind") for r in rows if r.get("kind")), "")
    ax.set_ylabel("validation accuracy")
    ax.set_ylim(0, 1.02)
    note = (f"no error bars with fewer than {MIN_SEEDS_FOR_CI} seeds" if seeds < MIN_SEEDS_FOR_CI else
            "error bars: 95% CI over seeds" + (", clipped to [0, 1]" if clipped_any else ""))
    units = {"bit": "of the stored bits", "flip": "of the stored bits", "neuron": "of the units"}
    unit = units.get(kind, "of the cells")
    ax.set_title(title or f"Faults in one parameter at a time ({kind}, rate {float(rate):g} {unit}, {seeds} seed(s));"
                 f"\nthe same rate is more faults in a larger layer ({note})", fontsize=9)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    return path


def preload() -> None:
    """Import what the plots need (about a second), e.g. while the last jobs of a study run."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import matplotlib.backends.backend_agg  # noqa: F401
            import matplotlib.figure  # noqa: F401
        except ImportError:
            pass


def _figure() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn(
            "lightning-pin: matplotlib is not installed, skipping the plot (pip install 'lightning-pin[app]')"
        )
        return None
    return Figure
