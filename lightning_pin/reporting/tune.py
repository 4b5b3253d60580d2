"""The files of ``lightning-pin tune``: ``trials.csv`` (every finished trial) and, with several objectives,
the Pareto front as a table and ``pareto.png``. Reads plain dicts; imports neither Optuna nor Lightning.

Example::

    >>> trials = [{"number": 0, "params": {"pin.rate": 0.1}, "values": [0.9, 0.1]},
    ...           {"number": 1, "params": {"pin.rate": 0.3}, "values": [0.8, 0.3]}]
    >>> [t["number"] for t in front_sorted(trials, {0, 1})]
    [1, 0]
"""

from __future__ import annotations

import csv
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from lightning_pin.reporting import tables

TRIALS_CSV = "trials.csv"
PARETO_PNG = "pareto.png"


def front_sorted(trials: Sequence[Mapping[str, Any]], front: Collection[int]) -> list[Mapping[str, Any]]:
    """The trials on the front, by their first objective's value, smallest first."""
    return sorted((t for t in trials if t["number"] in front), key=lambda t: t["values"][0])


def write_trials(trials: Sequence[Mapping[str, Any]], front: Collection[int], path: Path,
                 objectives: Sequence[str]) -> Path:
    keys = sorted({k for t in trials for k in t["params"]})
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["trial", *keys, *objectives, "pareto"])
        for t in sorted(trials, key=lambda t: t["number"]):
            writer.writerow([t["number"], *(t["params"].get(k, "") for k in keys), *t["values"],
                             str(t["number"] in front).lower()])
    return path


def print_front(trials: Sequence[Mapping[str, Any]], front: Collection[int], objectives: Sequence[str]) -> None:
    keys = sorted({k for t in trials for k in t["params"]})
    rows = [[str(t["number"]), *(_fmt(t["params"].get(k)) for k in keys), *(f"{v:.4g}" for v in t["values"])]
            for t in front_sorted(trials, front)]
    columns = [tables.Column("trial", justify="right"), *keys, *(tables.Column(o, justify="right") for o in objectives)]
    tables.print_table(columns, rows, f"Pareto front: {len(rows)} of {len(trials)} finished trial(s)")


def plot_front(trials: Sequence[Mapping[str, Any]], front: Collection[int], objectives: Sequence[str],
               path: Path) -> Optional[Path]:
    """The first two objectives of every trial, the front joined by a line."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(5.6, 4.2), dpi=120)
    ax = fig.subplots()
    others = [t for t in trials if t["number"] not in front]
    ax.scatter([t["values"][1] for t in others], [t["values"][0] for t in others], color="0.6", label="trials")
    best = sorted(front_sorted(trials, front), key=lambda t: t["values"][1])
    ax.plot([t["values"][1] for t in best], [t["values"][0] for t in best], "o-", color="tab:red", label="Pareto front")
    ax.set_xlabel(objectives[1])
    ax.set_ylabel(objectives[0])
    ax.set_title("lightning-pin tune: NSGA-II")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _fmt(value: Any) -> str:
    return "" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value))
