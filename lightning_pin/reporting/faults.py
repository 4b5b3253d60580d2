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
        for column in ("forced", "final", "gap", "baseline"):
            point[f"{column}_mean"], point[f"{column}_ci"], _ = mean_ci(r.get(column) for r in group)
        recovered = [r.get("recovered_step") for r in group]
        point["recovered"] = sum(step is not None and step != "" for step in recovered)
        point["diverged"] = sum(bool(r.get("diverged")) for r in group)
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


def _pm(mean: float, ci: float) -> str:
    if math.isnan(mean):
        return "-"
    return f"{mean:.3f} ± {ci:.3f}" if ci > 0 else f"{mean:.3f}"


def print_curve(rows: Sequence[Mapping[str, Any]], title: str, by: str = "rate") -> None:
    """One line per rate (or parameter): forced and final, mean ± 95% CI over seeds."""
    points = aggregate(rows, by)
    columns = [
        tables.Column(by, justify="left" if by == "param" else "right"),
        tables.Column("seeds", justify="right"),
        tables.Column("forced (no retraining)", justify="right", no_wrap=True),
        tables.Column("final (retrained)", justify="right", no_wrap=True),
        tables.Column("gap to baseline", justify="right", no_wrap=True),
        tables.Column("recovered", justify="right"),
        tables.Column("exact", justify="right"),
    ]
    body = []
    for p in points:
        diverged = f", {p['diverged']} diverged" if p["diverged"] else ""
        body.append(
            [
                str(p[by]) if by == "param" else f"{p[by]:g}",
                str(p["seeds"]),
                _pm(p["forced_mean"], p["forced_ci"]),
                _pm(p["final_mean"], p["final_ci"]),
                _pm(p["gap_mean"], p["gap_ci"]),
                f"{p['recovered']}/{p['seeds']}{diverged}",
                "yes" if p["pins_exact"] else "NO",
            ]
        )
    baseline = [r.get("baseline") for r in rows if r.get("baseline") is not None]
    tolerance = next((r.get("tolerance") for r in rows if r.get("tolerance") is not None), None)
    footer = []
    if baseline:
        footer.append((f"baseline {baseline[0]:.3f}" + ("" if tolerance is None else f", tolerance {tolerance:g}")
                       + "; ± is the 95% confidence interval over seeds (Student's t)", None))
    diverged = sum(bool(r.get("diverged")) for r in rows)
    if diverged:
        footer.append((f"{diverged} job(s) diverged (a loss that is not finite, or retraining that ended at chance or "
                       "below the forced accuracy): try another optimizer (optimizer=adamw) or a lower learning rate",
                       "red"))
    tables.print_table(columns, body, title, footer=footer)


def plot_curve(rows: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Optional[Path]:
    """Forced and final accuracy against the fault rate: mean over seeds, 95% CI bands, baseline, tolerance."""
    Figure = _figure()
    if Figure is None:
        return None
    points = aggregate(rows, "rate")
    rates = [100 * p["rate"] for p in points]
    fig = Figure(figsize=(6.4, 4.8), dpi=120)
    ax = fig.subplots()
    baseline = next((r["baseline"] for r in rows if r.get("baseline") is not None), None)
    tolerance = next((r["tolerance"] for r in rows if r.get("tolerance") is not None), None)
    if baseline is not None:
        if tolerance:
            ax.axhspan(baseline - tolerance, baseline, color="tab:green", alpha=0.12, lw=0,
                       label=f"within tolerance ({tolerance:g})")
        ax.axhline(baseline, color="tab:green", lw=1.2, ls="--", label=f"baseline {baseline:.3f}")
    for column, color, label in (("forced", "tab:red", "forced (faults in, no retraining)"),
                                 ("final", "tab:blue", "final (retrained around the faults)")):
        mean = [p[f"{column}_mean"] for p in points]
        ci = [p[f"{column}_ci"] if not math.isnan(p[f"{column}_ci"]) else 0.0 for p in points]
        ax.plot(rates, mean, marker="o", color=color, label=label)
        # An accuracy lies in [0, 1]: a t interval over few seeds can reach past it, the band does not.
        ax.fill_between(rates, [max(0.0, m - c) for m, c in zip(mean, ci)], [min(1.0, m + c) for m, c in zip(mean, ci)],
                        color=color, alpha=0.18, lw=0)
    kind = next((r.get("kind") for r in rows if r.get("kind")), "")
    seeds = max((p["seeds"] for p in points), default=0)
    ax.set_xlabel(f"fault rate (% of cells, kind={kind})")
    ax.set_ylabel("validation accuracy")
    ax.set_ylim(0.0, 1.02)
    ax.set_title(title or f"Accuracy against fault rate: mean of {seeds} seed(s), 95% CI")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_layers(rows: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Optional[Path]:
    """Bars per parameter: forced and final accuracy with the faults in that parameter only (95% CI)."""
    Figure = _figure()
    if Figure is None:
        return None
    points = aggregate(rows, "param")
    names = [str(p["param"]) for p in points]
    fig = Figure(figsize=(max(5.0, 1.2 * len(names) + 2.5), 4.2), dpi=120)
    ax = fig.subplots()
    width = 0.38
    xs = range(len(names))
    for shift, column, color, label in ((-width / 2, "forced", "tab:red", "forced"),
                                        (width / 2, "final", "tab:blue", "final (retrained)")):
        ax.bar([x + shift for x in xs], [p[f"{column}_mean"] for p in points], width,
               yerr=[0.0 if math.isnan(p[f"{column}_ci"]) else p[f"{column}_ci"] for p in points],
               color=color, alpha=0.8, capsize=3, label=label)
    baseline = next((r["baseline"] for r in rows if r.get("baseline") is not None), None)
    if baseline is not None:
        ax.axhline(baseline, color="tab:green", ls="--", lw=1.2, label=f"baseline {baseline:.3f}")
    ax.set_xticks(list(xs), names, rotation=20, ha="right", fontsize=8)
    rate = next((r.get("rate") for r in rows if r.get("rate") is not None), None)
    ax.set_ylabel("validation accuracy")
    ax.set_ylim(0, 1.02)
    ax.set_title(title or f"Faults in one parameter at a time (rate {rate:g}):\nwhich layers need protecting?",
                 fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    return path


def _figure() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn(
            "lightning-pin: matplotlib is not installed, skipping the plot (pip install 'lightning-pin[app]')"
        )
        return None
    return Figure
