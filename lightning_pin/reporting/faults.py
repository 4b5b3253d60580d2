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
    "pinned_elements",
    "changed_bits",
    "pins_exact",
    "seconds",
    "steps",
    "tolerance",
    "train_loss",
    "diverged",
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
    return row


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
            point[f"{column}_mean"], point[f"{column}_ci"], _ = mean_ci(r.get(column) for r in group)
        # Back within the tolerance at some step, and not diverged after it: a job that came back and
        # then collapsed did not recover.
        point["recovered"] = sum(r.get("recovered_step") not in (None, "") and not _true(r.get("diverged"))
                                 for r in group)
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


def _pm(mean: float, ci: float) -> str:
    if math.isnan(mean):
        return "-"
    return f"{mean:.3f} ± {ci:.3f}" if ci > 0 else f"{mean:.3f}"


def retrained(rows: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any row was retrained (a ``--no-retrain`` study has no final accuracy at all)."""
    return any(r.get("final") not in (None, "") for r in rows)


def print_curve(rows: Sequence[Mapping[str, Any]], title: str, by: str = "rate") -> None:
    """One line per rate (or parameter): forced and final, mean ± 95% CI over seeds (forced only, not retrained)."""
    points = aggregate(rows, by)
    full = retrained(rows)
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
        line = [str(p[by]) if by == "param" else f"{p[by]:g}", str(p["seeds"]), _pm(p["forced_mean"], p["forced_ci"])]
        if full:
            diverged = f", {p['diverged']} diverged" if p["diverged"] else ""
            line += [
                _pm(p["final_mean"], p["final_ci"]),
                _pm(p["gap_mean"], p["gap_ci"]),
                f"{p['recovered']}/{p['seeds']}{diverged}",
                "yes" if p["pins_exact"] else "NO",
            ]
        else:
            line.append("-" if math.isnan(p["changed_bits_mean"]) else f"{p['changed_bits_mean']:,.0f}")
        body.append(line)
    baseline = [r.get("baseline") for r in rows if r.get("baseline") is not None]
    tolerance = next((r.get("tolerance") for r in rows if r.get("tolerance") is not None), None)
    footer = []
    if baseline:
        footer.append((f"baseline {baseline[0]:.3f}" + ("" if tolerance is None else f", tolerance {tolerance:g}")
                       + "; ± is the 95% confidence interval over seeds (Student's t)", None))
    if not full:
        footer.append(("forced only (no retraining): final, gap and recovered_step are empty in the CSV", None))
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


def plot_curve(rows: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Optional[Path]:
    """Forced (and final) accuracy against the fault rate: every seed's point, the mean over seeds, a 95% CI band
    from 3 seeds on (clipped to [0, 1], and the legend says so), the baseline and its tolerance."""
    Figure = _figure()
    if Figure is None:
        return None
    points = aggregate(rows, "rate")
    fig = Figure(figsize=(6.4, 5.0), dpi=120)
    ax = fig.subplots()
    baseline = next((r["baseline"] for r in rows if r.get("baseline") is not None), None)
    tolerance = next((r["tolerance"] for r in rows if r.get("tolerance") is not None), None)
    if baseline is not None:
        if tolerance:
            ax.axhspan(baseline - tolerance, baseline, color="tab:green", alpha=0.12, lw=0,
                       label=f"within tolerance ({tolerance:g})")
        ax.axhline(baseline, color="tab:green", lw=1.2, ls="--", label=f"baseline {baseline:.3f}")
    series = [("forced", "tab:red", "forced (faults in, no retraining)")]
    if retrained(rows):
        series.append(("final", "tab:blue", "final (retrained around the faults)"))
    clipped_any = False
    for column, color, label in series:
        ok = [p for p in points if not math.isnan(p[f"{column}_mean"])]
        rates = [100 * p["rate"] for p in ok]
        ax.plot(rates, [p[f"{column}_mean"] for p in ok], marker="o", color=color, label=f"{label}: mean")
        seeds_x = [100 * float(r["rate"]) for r in rows if _finite(r.get(column))]
        seeds_y = [float(r[column]) for r in rows if _finite(r.get(column))]
        ax.scatter(seeds_x, seeds_y, s=14, facecolors="none", edgecolors=color, alpha=0.8, lw=0.8, zorder=3,
                   label=f"{label.split(' (')[0]}: each seed")
        banded = [p for p in ok if p["seeds"] >= MIN_SEEDS_FOR_CI and not math.isnan(p[f"{column}_ci"])]
        if banded:
            bands = [_band(p[f"{column}_mean"], p[f"{column}_ci"]) for p in banded]
            clipped = any(c for _, _, c in bands)
            clipped_any |= clipped
            ax.fill_between([100 * p["rate"] for p in banded], [b[0] for b in bands], [b[1] for b in bands],
                            color=color, alpha=0.15, lw=0,
                            label="95% CI (Student's t)" + (", clipped to [0, 1]" if clipped else ""))
    kind = next((r.get("kind") for r in rows if r.get("kind")), "")
    seeds = sorted({p["seeds"] for p in points})
    ax.set_xlabel(_rate_label(kind))
    ax.set_ylabel("validation accuracy")
    ax.set_ylim(0.0, 1.02)
    count = f"{seeds[0]}" if len(seeds) == 1 else f"{seeds[0]}-{seeds[-1]}"
    note = (f"no confidence band with fewer than {MIN_SEEDS_FOR_CI} seeds" if seeds and seeds[0] < MIN_SEEDS_FOR_CI
            else "band: 95% CI of the mean" + (", clipped to [0, 1]" if clipped_any else ""))
    what = "Accuracy against fault rate" if retrained(rows) else "Forced accuracy (no retraining) against fault rate"
    ax.set_title(title or f"{what}: {count} seed(s) per rate\n({note})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=7.5, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    return path


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
