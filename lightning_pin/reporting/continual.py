"""Continual-learning reports: accuracy matrices, average accuracy and backward transfer of one or
more methods, as JSON and as a heat map (reads plain data; imports no engine and no Lightning).

The data per method is what :meth:`lightning_pin.tasks.AccuracyMatrix.to_dict` returns:
``matrix`` (row i = after training task i, column j = task j, None where not measured),
``average_accuracy``, ``bwt`` and ``fingerprints``.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

from lightning_pin.reporting.tables import Column, print_table

__all__ = [
    "PLOT_NAME", "REPORT_NAME", "comparison_rows", "plot_accuracy_matrices", "print_comparison",
    "write_continual_report",
]


REPORT_NAME = "continual_report.json"
PLOT_NAME = "continual_accuracy.png"


def write_continual_report(
    methods: Mapping[str, Mapping[str, Any]], directory: Union[str, Path], plot: bool = True, **extra: Any
) -> list[Path]:
    """Write ``continual_report.json`` (``{"methods": {name: data}, **extra}``) and, with ``plot``,
    ``continual_accuracy.png`` (one heat map per method) into ``directory``; returns the paths.

    Without matplotlib the PNG is skipped with a warning.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    report = {"methods": {name: dict(data) for name, data in methods.items()}, **extra}
    path = directory / REPORT_NAME
    path.write_text(json.dumps(report, indent=2, allow_nan=True) + "\n")
    written = [path]
    if plot:
        png = plot_accuracy_matrices(report, directory / PLOT_NAME)
        if png is not None:
            written.append(png)
    return written


def comparison_rows(report: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    """Per method: name, average accuracy, BWT and whether every fingerprint stayed unchanged."""
    rows = []
    for name, data in report["methods"].items():
        unchanged = data.get("fingerprints_unchanged")
        rows.append((name, _pct(data["average_accuracy"]), _signed(data["bwt"]),
                     "-" if unchanged is None else ("yes" if unchanged else "NO")))
    return rows


def print_comparison(report: Mapping[str, Any], title: str = "continual learning") -> None:
    """Print the comparison table of :func:`comparison_rows`."""
    columns = [Column("method"), Column("avg accuracy", justify="right"), Column("BWT", justify="right"),
               Column("fingerprints unchanged", justify="right")]
    print_table(columns, comparison_rows(report), title)


def plot_accuracy_matrices(report: Mapping[str, Any], path: Union[str, Path]) -> Optional[Path]:
    """Draw each method's accuracy matrix as an annotated heat map (same colour scale for all),
    titled with its average accuracy and BWT, into ``path``. Returns ``path``, or None (with a
    warning) without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn("lightning-pin: matplotlib is not installed, skipping the accuracy heat map "
                      "(pip install 'lightning-pin[app]')")
        return None
    methods = report["methods"]
    fig = Figure(figsize=(3.6 * len(methods) + 0.9, 3.9))
    axes = fig.subplots(1, len(methods), squeeze=False)[0]
    image = None
    for ax, (name, data) in zip(axes, methods.items()):
        matrix = data["matrix"]
        tasks = len(matrix)
        cells = [[math.nan if v is None else 100.0 * v for v in row] for row in matrix]
        image = ax.imshow(cells, vmin=0.0, vmax=100.0, cmap="viridis")
        for i in range(tasks):
            for j in range(tasks):
                value = cells[i][j]
                if not math.isnan(value):
                    ax.text(j, i, f"{value:.1f}", ha="center", va="center", fontsize=8,
                            color="black" if value > 60 else "white")
        labels = [str(t) for t in range(1, tasks + 1)]
        ax.set_xticks(range(tasks), labels)
        ax.set_yticks(range(tasks), labels)
        ax.set_xlabel("evaluated on task")
        ax.set_ylabel("after training task")
        ax.set_title(f"{name}\navg {_pct(data['average_accuracy'])}, BWT {_signed(data['bwt'])}", fontsize=9.5)
    fig.colorbar(image, ax=list(axes), fraction=0.025, pad=0.02, label="accuracy (%)")
    fig.suptitle("Accuracy matrix (row: after task i, column: task j)", fontsize=10.5)
    path = Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def _pct(value: Optional[float]) -> str:
    return "-" if value is None or math.isnan(value) else f"{100 * value:.1f}%"


def _signed(value: Optional[float]) -> str:
    if value is None or math.isnan(value):
        return "-"
    if value == 0.0:
        return "0.0 (exact)"
    return f"{100 * value:+.2f} pts"
