"""The summary of a sweep: one row per job, as ``sweep_summary.csv`` in the sweep directory and a table.

:class:`SweepSummary` is a Hydra callback (``hydra.callbacks`` in ``conf/hydra/default.yaml``):
when a multirun ends, whichever sweeper ran it (the basic one, Optuna), it reads the
``run_summary.json`` that every job of :mod:`lightning_pin.train` leaves in its directory.
Reading files rather than collecting returns in memory keeps it right for launchers that run
jobs in other processes.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from lightning_pin.reporting import tables

__all__ = [
    "COLUMNS", "RUN_SUMMARY", "SWEEP_SUMMARY", "SweepSummary", "collect", "print_table", "shared_overrides",
    "table_rows", "write_csv",
]


RUN_SUMMARY = "run_summary.json"
SWEEP_SUMMARY = "sweep_summary.csv"

#: Columns of the CSV: keys of run_summary.json.
COLUMNS: tuple[str, ...] = (
    "job",
    "overrides",
    "baseline",
    "forced",
    "final",
    "gap",
    "pin_drift_max",
    "weight_drift",
    "weight_drift_relative",
    "pinned_elements",
    "violations",
    "pins_exact",
    "seconds",
)


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """The run summaries of the jobs under ``sweep_dir``, in job order."""
    runs = [json.loads(path.read_text()) for path in sweep_dir.rglob(RUN_SUMMARY)]
    return sorted(runs, key=lambda run: (run.get("job") is None, run.get("job") or 0, str(run.get("overrides"))))


def write_csv(runs: Sequence[Mapping[str, Any]], path: Path) -> Path:
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(COLUMNS)
        for run in runs:
            writer.writerow([_csv_cell(run.get(key)) for key in COLUMNS])
    return path


def shared_overrides(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The overrides every job has (printed once, above the table)."""
    if len(runs) < 2:
        return []
    first = list(runs[0].get("overrides") or [])
    return [o for o in first if all(o in (run.get("overrides") or []) for run in runs[1:])]


def table_rows(runs: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of the printed table: the CSV's main columns, rounded for reading.

    The overrides column shows what differs between the jobs; see :func:`shared_overrides`.
    """
    headers = ["job", "overrides", "baseline", "forced", "final", "gap", "pin drift", "weight drift", "exact"]
    shared = set(shared_overrides(runs))
    rows = []
    for run in runs:
        relative = run.get("weight_drift_relative")
        weight = _number(run.get("weight_drift")) + ("" if relative is None else f" ({100 * relative:.0f}%)")
        rows.append(
            [
                "" if run.get("job") is None else str(run["job"]),
                "\n".join(o for o in run.get("overrides") or [] if o not in shared) or "(defaults)",
                _number(run.get("baseline"), ".3f"),
                _number(run.get("forced"), ".3f"),
                _number(run.get("final"), ".3f"),
                _number(run.get("gap"), "+.3f"),
                _number(run.get("pin_drift_max")),
                weight,
                "yes" if run.get("pins_exact") else "NO",
            ]
        )
    return headers, rows


def print_table(runs: Sequence[Mapping[str, Any]], title: str) -> None:
    """Print the summary (rich when installed, plain text otherwise)."""
    headers, rows = table_rows(runs)
    # Numbers never fold; the overrides column (1) wraps, one override per line.
    columns = [tables.Column(h, justify="left" if i < 2 else "right", no_wrap=i != 1) for i, h in enumerate(headers)]
    tables.print_table(columns, rows, title)


def _number(value: Any, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def _csv_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


class SweepSummary(Callback):
    """Hydra callback: at the end of a multirun, write ``sweep_summary.csv`` and print it.

    Args:
        filename: Name of the CSV, written into the sweep directory (``hydra.sweep.dir``).
    """

    def __init__(self, filename: str = SWEEP_SUMMARY) -> None:
        self.filename = filename

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        runs = collect(sweep_dir)
        if not runs:
            print(f"lightning-pin: no job of the sweep in {sweep_dir} left a {RUN_SUMMARY}")
            return
        path = write_csv(runs, sweep_dir / self.filename)
        shared = shared_overrides(runs)
        title = f"lightning-pin sweep: {len(runs)} job(s), {path}"
        print_table(runs, title=title + (f"\nall jobs: {' '.join(shared)}" if shared else ""))
