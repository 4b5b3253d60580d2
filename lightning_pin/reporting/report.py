"""The end-of-run report: ``pin_report.json``, ``pin_report.png`` and a table on the console.

A report is a plain dict (see :func:`make_report`), built either by
:class:`~lightning_pin.PinMonitor` at the end of ``fit`` or afterwards from the ``metrics.csv``
of a ``CSVLogger`` run (:func:`report_from_csv`, the ``lightning-pin report RUN_DIR`` command).
Both go through :func:`make_report`, so they agree on every number.

The plot needs matplotlib and the table looks best with rich (both in the ``app`` extra); without
them the PNG is skipped with a warning and the table is plain text. Nothing here imports Lightning.
"""

from __future__ import annotations

import csv
import json
import math
import textwrap
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

from lightning_pin.reporting import tensorboard
from lightning_pin.reporting.preservation import Preservation
from lightning_pin.reporting.tables import Column, print_table

__all__ = [
    "METRICS_CSV", "PREFIX", "REPORT_JSON", "REPORT_PNG", "ReportError", "build_figure", "check_destination",
    "find_metrics_csv", "make_report", "plot_report", "print_report", "read_metrics_csv", "read_report",
    "read_run_metrics", "recovery_text", "refuse_less_data", "report_from_csv", "report_rows", "report_size",
    "settled_step", "write_report",
]


REPORT_JSON = "pin_report.json"
REPORT_PNG = "pin_report.png"
METRICS_CSV = "metrics.csv"
#: Prefix of every name lightning-pin logs.
PREFIX = "pin/"


class ReportError(ValueError):
    """An input of a report that is missing, empty or unreadable, or a report that would replace
    one holding more data; the message names the file (and the row)."""


def make_report(
    *,
    metric: Optional[str] = None,
    higher_is_better: bool = True,
    tolerance: float = 0.01,
    baseline: Optional[float] = None,
    forced: Optional[float] = None,
    accuracy: Sequence[Sequence[float]] = (),
    pin_drift: Sequence[Sequence[float]] = (),
    weight_drift: Sequence[Sequence[float]] = (),
    modules: Sequence[str] = (),
    pinned_elements: int = 0,
    trainable_elements: Optional[int] = None,
    steps: Optional[int] = None,
) -> dict[str, Any]:
    """Summarise a run's histories into the report dict that is written as ``pin_report.json``.

    Args:
        metric: Name of the quality metric whose preservation is tracked (None: not tracked).
        higher_is_better: Direction of the metric.
        tolerance: Largest gap to the baseline that counts as recovered.
        baseline: The metric before any pin was forced.
        forced: The metric right after forcing the pins, before training.
        accuracy: ``[step, value]`` rows: the forced value, then one per validation, the last one
            at the end of training.
        pin_drift: ``[step, drift_max, drift_mean, violations]`` rows, one per logged step.
        weight_drift: ``[step, total, relative, *per_module]`` rows, one per logged step.
        modules: Names of the top-level modules of the ``per_module`` columns.
        pinned_elements: Distinct elements any pin selects.
        trainable_elements: Elements of the trained module that require grad.
        steps: Optimizer steps taken (default: the last step of any history).

    The top-level keys ``metric``, ``baseline``, ``forced``, ``final``, ``gap``,
    ``recovered_step``, ``pinned_elements``, ``violations``, ``pin_drift_max`` and ``weight_drift``
    are always present (None where nothing was measured). ``gap`` is how much worse than the
    baseline the final value is (positive: worse), in the metric's units.

    Raises:
        ValueError: ``tolerance`` is negative or not finite.
    """
    preservation = Preservation(higher_is_better=higher_is_better, tolerance=tolerance)
    preservation.baseline = baseline
    for step, value in accuracy:
        preservation.record(int(step), float(value))
    final = preservation.final
    last_steps = [int(rows[-1][0]) for rows in (accuracy, pin_drift, weight_drift) if rows]
    return {
        "metric": metric,
        "higher_is_better": higher_is_better,
        "tolerance": tolerance,
        "baseline": baseline,
        "forced": forced,
        "final": final,
        "gap": None if final is None else preservation.gap(final),
        "recovered_step": preservation.recovered_step,
        "pinned_elements": int(pinned_elements),
        "trainable_elements": None if trainable_elements is None else int(trainable_elements),
        "violations": int(sum(row[3] for row in pin_drift)),
        "pin_drift_max": max((row[1] for row in pin_drift), default=None),
        "pin_drift_mean": _mean([row[2] for row in pin_drift]),
        "weight_drift": weight_drift[-1][1] if weight_drift else None,
        "weight_drift_relative": weight_drift[-1][2] if weight_drift else None,
        "weight_drift_by_module": dict(zip(modules, weight_drift[-1][3:])) if weight_drift else {},
        "steps": steps if steps is not None else max(last_steps, default=0),
        "history": {
            "accuracy": {"step": [int(r[0]) for r in accuracy], "value": [float(r[1]) for r in accuracy]},
            "pin_drift": {
                "step": [int(r[0]) for r in pin_drift],
                "max": [float(r[1]) for r in pin_drift],
                "mean": [float(r[2]) for r in pin_drift],
                "violations": [int(r[3]) for r in pin_drift],
            },
            "weight_drift": {
                "step": [int(r[0]) for r in weight_drift],
                "total": [float(r[1]) for r in weight_drift],
                "relative": [float(r[2]) for r in weight_drift],
                "by_module": {m: [float(r[3 + i]) for r in weight_drift] for i, m in enumerate(modules)},
            },
        },
    }


def _mean(values: Sequence[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


# ----------------------------------------------------------------------------------------------
# Writing


def write_report(report: Mapping[str, Any], directory: Union[str, Path], plot: bool = True) -> list[Path]:
    """Write ``pin_report.json`` (and ``pin_report.png`` when ``plot``) into ``directory``.

    Returns the paths written; without matplotlib the PNG is skipped with a warning.

    Raises:
        OSError: ``directory`` cannot be created or written to.
        KeyError: ``report`` lacks the ``history`` that :func:`make_report` writes (with ``plot``).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    json_path, png_path = directory / REPORT_JSON, directory / REPORT_PNG
    # Both files or neither: each is written beside its place first, and renamed into it only when
    # both are complete (a reader never sees half a file either).
    parts = {json_path: json_path.with_name(REPORT_JSON + ".part")}
    try:
        parts[json_path].write_text(json.dumps(report, indent=2, allow_nan=True) + "\n")
        if plot:
            parts[png_path] = png_path.with_name(REPORT_PNG + ".part")
            if plot_report(report, parts[png_path]) is None:
                del parts[png_path]
        for final, part in parts.items():
            part.replace(final)
    finally:
        for part in parts.values():
            part.unlink(missing_ok=True)
    return list(parts)


def plot_report(report: Mapping[str, Any], path: Union[str, Path]) -> Optional[Path]:
    """Plot the metric, the pin drift and the weight drift against the optimizer step into ``path``.

    Returns ``path``, or None (with a warning) when matplotlib is not installed.

    Raises:
        KeyError: ``report`` lacks the ``history`` that :func:`make_report` writes.
        OSError: ``path`` cannot be written.
    """
    try:
        # A Figure of its own, not pyplot: no global backend or figure state is touched.
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn(
            "lightning-pin: matplotlib is not installed, skipping pin_report.png (pip install 'lightning-pin[app]')"
        )
        return None
    path = Path(path)
    build_figure(report, Figure).savefig(path, dpi=110, format="png")
    return path


def build_figure(report: Mapping[str, Any], figure_class: Any = None) -> Any:
    """The report's matplotlib ``Figure``: one panel per measured history, legends beside the panels
    (never over the data), zero drifts on a linear axis that starts at 0.

    Raises:
        ImportError: matplotlib is not installed.
    """
    if figure_class is None:
        from matplotlib.figure import Figure as figure_class
    from matplotlib.ticker import MaxNLocator

    history = report["history"]
    panels = []
    if report.get("metric") and history["accuracy"]["step"]:
        panels.append(_plot_metric)
    # A drift that is the same at every logged step says one thing: a caption says it, not a panel of flat lines.
    if history["pin_drift"]["step"] and not (_flat_drift(report) and not report["violations"]):
        panels.append(_plot_pin_drift)
    if history["weight_drift"]["step"]:
        panels.append(_plot_weight_drift)
    if not panels:
        panels.append(_plot_nothing)
    # The captions, wrapped to the figure's width (about 165 characters of 8.5 pt at 11.5 inches).
    notes = [line for note in _captions(report) for line in textwrap.wrap(note, 165)]
    fig = figure_class(figsize=(11.5, 3.1 * len(panels) + 0.6 + 0.22 * len(notes)))
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)
    for panel, ax in zip(panels, axes[:, 0]):
        panel(ax, report)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            # Beside the panel: inside it, a legend covers the data of runs that go anywhere.
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8, framealpha=0.9)
    axes[-1, 0].set_xlabel("optimizer step")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    fig.suptitle(_headline(report), fontsize=10.5)
    height = fig.get_size_inches()[1]
    for i, note in enumerate(notes):
        fig.text(0.01, (0.08 + 0.22 * (len(notes) - 1 - i)) / height, note, fontsize=8.5, color="0.25", ha="left")
    fig.tight_layout(rect=(0, (0.22 * len(notes) + 0.05) / height if notes else 0, 1, 1))
    return fig


def _flat_drift(report: Mapping[str, Any]) -> bool:
    """Is the pin drift the same at every logged step (two or more), and not zero?"""
    drift = report["history"]["pin_drift"]
    return (len(drift["step"]) >= 2 and len(set(drift["max"])) == 1 and len(set(drift["mean"])) == 1
            and drift["max"][0] > 0)


def _captions(report: Mapping[str, Any]) -> list[str]:
    """What the panels do not show, and why: a flat pin drift folded away, a drift never logged."""
    drift = report["history"]["pin_drift"]
    notes = []
    if _flat_drift(report) and not report["violations"]:
        notes.append(
            f"pin drift (not drawn): the same at each of the {len(drift['step'])} logged steps, max "
            f"{_fmt(drift['max'][0])}, mean {_fmt(drift['mean'][0])} per step before the restore. The pinned values "
            "are the same every step, so a move that depends only on them is too, such as decoupled weight decay "
            "(AdamW moves each by lr x weight_decay x |value|); the restore undoes it (0 violations)."
        )
    elif _drift_missing(report) == "short":
        notes.append(
            f"pin drift was not logged: the run took {report['steps']} optimizer steps, fewer than the trainer's "
            "log_every_n_steps (Lightning's default 50; the app's 5). Lower it to see the drift."
        )
    elif _drift_missing(report) == "off":
        notes.append("pin drift was not measured (PinMonitor(drift=False)); the weight drift was.")
    return notes


def _drift_missing(report: Mapping[str, Any]) -> Optional[str]:
    """Why a run of some steps has no pin drift: ``"short"`` (no logging step: the weight drift has only
    the fit's start and end, which are measured whatever the interval), ``"off"`` (the weight drift was
    logged in between, so the pin drift was switched off), or None (it has one)."""
    if report["history"]["pin_drift"]["step"] or not report.get("steps"):
        return None
    return "off" if len(report["history"]["weight_drift"]["step"]) > 2 else "short"


def _headline(report: Mapping[str, Any]) -> str:
    parts = []
    if report.get("metric"):
        parts.append(
            f"{report['metric']}: baseline {_fmt(report['baseline'])}, forced {_fmt(report['forced'])}, "
            f"final {_fmt(report['final'])}"
        )
    parts.append(f"{report['pinned_elements']:,} pinned elements, violations {report['violations']}")
    if report.get("truncated"):
        parts.append("truncated event file: read up to step "
                     + ", ".join(str(c.get("last_step", "-")) for c in report["truncated"]))
    return "   |   ".join(parts)


def _plot_metric(ax: Any, report: Mapping[str, Any]) -> None:
    steps, values = report["history"]["accuracy"]["step"], report["history"]["accuracy"]["value"]
    baseline, forced, tolerance = report["baseline"], report["forced"], report["tolerance"]
    label = f"{report['metric']} (final {_fmt(report['final'])})"
    if len(steps) > 2:
        ax.plot(steps, values, "o-", color="tab:blue", lw=2, ms=4, label=label)
    else:
        # Two measurements (forced, final): a solid line would read as measured in between.
        ax.plot(steps, values, "o:", color="tab:blue", lw=1.2, ms=6, label=label)
    if baseline is not None:
        worst = baseline - tolerance if report["higher_is_better"] else baseline + tolerance
        ax.axhspan(min(baseline, worst), max(baseline, worst), color="tab:green", alpha=0.12, lw=0,
                   label=f"within tolerance ({tolerance:g})")
        ax.axhline(baseline, color="tab:green", ls="--", lw=1.5, label=f"baseline (no pins) {_fmt(baseline)}")
    if forced is not None:
        ax.axhline(forced, color="tab:red", ls=":", lw=1.8, label=f"forced (pins set, no training) {_fmt(forced)}")
    if report.get("chance") is not None:  # what guessing scores (lightning-pin train knows the classes)
        ax.axhline(report["chance"], color="0.25", ls=(0, (1, 3)), lw=1.5, label=f"chance {_fmt(report['chance'])}")
    if report.get("recovered_step") is not None:
        ax.axvline(report["recovered_step"], color="0.4", ls="-.", lw=1,
                   label=f"first within tolerance at step {report['recovered_step']}")
    ax.set_ylabel(report["metric"])
    ax.set_title(f"{report['metric']} on the validation data{_only(steps)}", fontsize=10)


def _plot_pin_drift(ax: Any, report: Mapping[str, Any]) -> None:
    drift = report["history"]["pin_drift"]
    ax.plot(drift["step"], drift["max"], ".-", color="tab:orange", label="max |move| of a pinned element")
    ax.plot(drift["step"], drift["mean"], ".-", color="tab:purple", label="mean |move|")
    if all(v > 0 for v in drift["max"] + drift["mean"]):
        ax.set_yscale("log")
    else:
        # A drift of 0 has no logarithm, and a |move| is never negative: a linear axis from 0.
        top = max(drift["max"] + drift["mean"], default=0.0)
        ax.set_ylim(0.0, top * 1.1 if top > 0 else 1.0)
        if top == 0:
            ax.text(0.5, 0.5, "0 at every logged step: the optimizer never moved a pinned element",
                    ha="center", va="center", transform=ax.transAxes, fontsize=9, color="0.3")
    bad = [s for s, v in zip(drift["step"], drift["violations"]) if v]
    if bad:
        ax.scatter(bad, [max(drift["max"]) or 1.0] * len(bad), marker="x", color="red", zorder=5,
                   label=f"violations ({report['violations']} elements off target)")
    ax.set_ylabel("|move| in a step")
    ax.set_title("pin drift: how far the optimizer moved the pins in a step (before the restore)", fontsize=10)


def _plot_weight_drift(ax: Any, report: Mapping[str, Any]) -> None:
    drift = report["history"]["weight_drift"]
    ax.plot(drift["step"], drift["total"], ".-" if len(drift["step"]) > 2 else "o:", color="tab:brown", lw=2,
            label=f"L2 distance from fit start (final {_fmt(report['weight_drift'])}, "
                  f"{100 * (report['weight_drift_relative'] or 0):.1f}% of their norm)")
    for i, (module, values) in enumerate(drift.get("by_module", {}).items()):
        if len(drift["by_module"]) > 1 and i < 8:
            ax.plot(drift["step"], values, "-" if len(drift["step"]) > 2 else ":", lw=1, alpha=0.8, label=module)
    ax.set_ylabel("||w - w0||")
    ax.set_title(f"weight drift: how far the free weights moved to compensate{_only(drift['step'])}", fontsize=10)


def _only(steps: Sequence[int]) -> str:
    """A panel title's note when it has two points or fewer: a line between them was never measured."""
    if len(steps) > 2 or not steps:
        return ""
    return f", measured at step{'s' if len(steps) > 1 else ''} {' and '.join(str(s) for s in steps)} only"


def _plot_nothing(ax: Any, report: Mapping[str, Any]) -> None:
    ax.text(0.5, 0.5, "nothing was measured", ha="center", va="center", transform=ax.transAxes)


def _fmt(value: Optional[float]) -> str:
    if value is None:
        return "-"
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.3e}"
    return f"{value:.4f}"


# ----------------------------------------------------------------------------------------------
# The table


def settled_step(report: Mapping[str, Any]) -> Optional[int]:
    """The first step from which every recorded value of the metric stayed within the tolerance
    (None when the last one is outside it, or nothing was recorded)."""
    history = report.get("history", {}).get("accuracy", {})
    baseline, tolerance = report.get("baseline"), report.get("tolerance", 0.01)
    if baseline is None:
        return None
    preservation = Preservation(higher_is_better=report.get("higher_is_better", True), tolerance=tolerance)
    preservation.baseline = baseline
    settled = None
    for step, value in zip(history.get("step", []), history.get("value", [])):
        if not preservation.within(value):
            settled = None
        elif settled is None:
            settled = int(step)
    return settled


def recovery_text(report: Mapping[str, Any]) -> str:
    """When the metric came back, true to the whole history: "22", "22, left it again and ended
    outside", or "not recovered"."""
    recovered = report.get("recovered_step")
    if recovered is None:
        return "not recovered"
    settled = settled_step(report)
    if settled is None:
        return f"{recovered}, then left it and ended outside"
    return str(recovered) if settled == recovered else f"{recovered} (left it, back for good from step {settled})"


def report_rows(report: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The report as ``(quantity, value)`` rows, for the console table."""
    rows = []
    if report.get("metric"):
        gap = report["gap"]
        rows += [
            ("metric", f"{report['metric']} ({'higher' if report['higher_is_better'] else 'lower'} is better)"),
            ("baseline (no pins)", _fmt(report["baseline"])),
            ("forced (pins set, no training)", _fmt(report["forced"])),
            ("final", _fmt(report["final"])),
            ("gap to baseline (positive: worse)", "-" if gap is None else f"{gap:+.4f}"),
            (f"recovered within {report['tolerance']:g} at step", recovery_text(report)),
        ]
    trainable = report.get("trainable_elements")
    rows.append(
        ("pinned elements", f"{report['pinned_elements']:,}" + (f" of {trainable:,} trainable" if trainable else ""))
    )
    rows.append(("violations (must be 0)", str(report["violations"])))
    drift = f"{_fmt(report['pin_drift_max'])} / {_fmt(report['pin_drift_mean'])}"
    history = report.get("history", {}).get("pin_drift", {})
    missing = _drift_missing(report) if history else None
    if missing == "short":
        drift = f"not logged ({report['steps']} steps, fewer than log_every_n_steps)"
    elif missing == "off":
        drift = "not measured (PinMonitor(drift=False))"
    elif history and _flat_drift(report):
        drift += " (the same at every logged step)"
    rows.append(("pin drift max / mean", drift))
    relative = report.get("weight_drift_relative")
    rows.append(
        (
            "weight drift (L2 from fit start)",
            _fmt(report["weight_drift"]) + ("" if relative is None else f"  ({100 * relative:.2f}% of their norm)"),
        )
    )
    for module, value in (report.get("weight_drift_by_module") or {}).items():
        rows.append((f"  {module}", _fmt(value)))
    rows.append(("optimizer steps", str(report.get("steps", "-"))))
    for cut in report.get("truncated") or ():
        last = "nothing" if cut.get("last_step") is None else f"up to step {cut['last_step']}"
        rows.append(("truncated event file (read " + last + ")", Path(str(cut.get("file"))).name))
    return rows


def print_report(report: Mapping[str, Any], title: str = "lightning-pin report", note: Optional[str] = None) -> None:
    """Print the report as a table (rich when installed, plain text otherwise), then ``note``.

    Raises:
        KeyError: ``report`` lacks a key :func:`make_report` writes.
    """
    rows = report_rows(report)
    print_table(
        [Column("quantity", style="bold"), Column("value", justify="right")],
        rows,
        title,
        show_header=False,
        # A pin off target is the one line that must not be missed.
        row_styles=["red" if key.startswith("violations") and value != "0" else None for key, value in rows],
        footer=[(note, None)] if note else (),
    )


# ----------------------------------------------------------------------------------------------
# From a CSVLogger run


def find_metrics_csv(run_dir: Union[str, Path]) -> Path:
    """Where a run's metrics are: ``RUN_DIR/metrics.csv``, ``RUN_DIR`` itself when it holds TensorBoard
    event files, or else the newest of either below ``RUN_DIR`` (e.g. ``lightning_logs``).

    Raises:
        FileNotFoundError: there is no ``metrics.csv`` or TensorBoard event file in or below ``run_dir``.
    """
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise FileNotFoundError(
            f"{run_dir} does not exist: point at the log directory of a CSVLogger or TensorBoard run"
        )
    if run_dir.is_file():
        return run_dir
    direct = run_dir / METRICS_CSV
    if direct.exists():
        return direct
    if tensorboard.has_events(run_dir):
        return run_dir
    found = [(p.stat().st_mtime, p) for p in run_dir.rglob(METRICS_CSV)]
    found += [(p.stat().st_mtime, p.parent) for p in run_dir.rglob(tensorboard.EVENTS_GLOB)]
    if not found:
        raise FileNotFoundError(
            f"no {METRICS_CSV} or TensorBoard event file in {run_dir}: point at the log directory of a "
            "CSVLogger or TensorBoard run"
        )
    return max(found, key=lambda item: item[0])[1]


def read_run_metrics(path: Union[str, Path], allow_truncated: bool = False) -> list[dict[str, float]]:
    """The logged rows of a run: a ``metrics.csv``, or a directory of TensorBoard event files.

    Raises:
        OSError: the file cannot be opened.
        ReportError: the CSV is unreadable (see :func:`read_metrics_csv`), the event files hold no
            scalar, an event file ends inside a record (unless ``allow_truncated``: then the rows
            are those read up to the cut), or tensorboard is needed and not installed.
    """
    path = Path(path)
    if not path.is_dir():
        return read_metrics_csv(path)
    try:
        cut = tensorboard.find_truncated(path)
        if cut and not allow_truncated:
            # TensorBoard's reader stops at the cut without a word: a report from it would look complete.
            raise ReportError(f"{cut[0].describe()}; pass --allow-truncated to report what was read up to there")
        rows = tensorboard.read_scalars(path)
    except tensorboard.TensorBoardMissing as err:
        raise ReportError(str(err)) from None
    if not rows:
        raise ReportError(f"the TensorBoard event files in {path} hold no scalars: the run logged nothing yet")
    return rows


def read_metrics_csv(path: Union[str, Path]) -> list[dict[str, float]]:
    """The rows of a ``metrics.csv``, with empty cells dropped and values as floats.

    Raises:
        OSError: the file cannot be opened.
        ReportError: the file has no header, no row, or a cell that is not a number (named with
            its row and column).
    """
    rows = []
    try:
        with open(path, newline="") as file:
            reader = csv.DictReader(file)
            if not reader.fieldnames:
                raise ReportError(f"{path} is empty: no header, no rows")
            for number, row in enumerate(reader, start=1):
                parsed = {}
                for key, value in row.items():
                    if key is None:
                        raise ReportError(
                            f"{path}, row {number} (line {reader.line_num}): more cells than the header has columns"
                        )
                    if value in ("", None):
                        continue
                    try:
                        parsed[key] = float(value)
                    except ValueError:
                        raise ReportError(
                            f"{path}, row {number} (line {reader.line_num}), column {key!r}: {value!r} is not a number"
                        ) from None
                rows.append(parsed)
    except UnicodeDecodeError as err:
        raise ReportError(f"{path} is not a text CSV file ({err})") from err
    except csv.Error as err:
        raise ReportError(f"{path} is not a valid CSV file: {err}") from err
    if not rows:
        raise ReportError(f"{path} has a header and no rows: the run logged nothing yet")
    return rows


def read_report(path: Union[str, Path]) -> dict[str, Any]:
    """A ``pin_report.json`` as a dict.

    Raises:
        ReportError: the file is not JSON, not a JSON object, or holds a field of the wrong type.
    """
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ReportError(f"{path} is not a valid pin report ({err}): fix or delete it to rebuild the report") from err
    if not isinstance(report, dict):
        raise ReportError(f"{path} is not a valid pin report: it holds a {type(report).__name__}, not an object")
    for key, kinds in (("metric", (str,)), ("tolerance", (int, float)), ("higher_is_better", (bool,)),
                       ("steps", (int,)), ("history", (dict,)), ("pinned_elements", (int,))):
        value = report.get(key)
        if value is not None and (not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool))):
            raise ReportError(
                f"{path} is not a valid pin report: {key!r} is {value!r}; fix or delete it to rebuild the report"
            )
    missing = [key for key in _REPORT_KEYS if key not in report]
    if missing:
        # Someone else's JSON under our name: never ours to overwrite.
        raise ReportError(
            f"{path} is not a pin report (it has no {', '.join(repr(k) for k in missing)}): not overwriting it; "
            "move it away, or write the report elsewhere with --out"
        )
    return report


#: Keys every report :func:`make_report` builds holds: a JSON object without them is not ours.
_REPORT_KEYS = ("pinned_elements", "violations", "history")


def check_destination(directory: Union[str, Path], plot: bool = True) -> None:
    """Raise :class:`ReportError` unless the report files can be written into ``directory`` without
    replacing anything that is not a report: ``directory`` is a directory (or does not exist yet),
    an existing ``pin_report.json`` is a pin report, an existing ``pin_report.png`` is a PNG file.
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ReportError(f"{directory} is a file: the report is written into a directory (pass one with --out)")
    json_path, png_path = directory / REPORT_JSON, directory / REPORT_PNG
    if json_path.exists():
        if not json_path.is_file():
            raise ReportError(f"{json_path} is not a file: not replacing it; move it away, or use --out")
        read_report(json_path)
    if plot and png_path.exists():
        if not png_path.is_file():
            raise ReportError(f"{png_path} is not a file: not replacing it; move it away, use --out, or --no-plot")
        with open(png_path, "rb") as file:
            if file.read(8) != _PNG_MAGIC:
                raise ReportError(
                    f"{png_path} is not a PNG image: not overwriting it; move it away, use --out, or --no-plot"
                )


_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def report_size(report: Mapping[str, Any]) -> tuple[int, int]:
    """How much a report holds: ``(optimizer steps, history rows)``, 0 for what it lacks."""
    history = report.get("history") if isinstance(report.get("history"), Mapping) else {}
    rows = 0
    for series in history.values():
        steps = series.get("step") if isinstance(series, Mapping) else None
        rows += len(steps) if isinstance(steps, list) else 0
    steps = report.get("steps")
    return (steps if isinstance(steps, int) and not isinstance(steps, bool) else 0), rows


def refuse_less_data(report: Mapping[str, Any], directory: Union[str, Path]) -> None:
    """Raise :class:`ReportError` if ``directory`` holds a ``pin_report.json`` with more data.

    "More" means more optimizer steps or more history rows (metric values, pin drift and weight
    drift measurements) than ``report`` holds: replacing it would lose what only it has (after a
    resume, say, the new run directory's ``metrics.csv`` holds only the resumed part).
    """
    path = Path(directory) / REPORT_JSON
    if not path.exists():
        return
    old_steps, old_rows = report_size(read_report(path))
    new_steps, new_rows = report_size(report)
    if new_steps < old_steps or new_rows < old_rows:
        raise ReportError(
            f"{path} holds more data ({old_steps} steps, {old_rows} history rows) than the report rebuilt from the "
            f"CSV ({new_steps} steps, {new_rows} rows): not overwriting it; write elsewhere with --out, or pass "
            "--force to replace it"
        )


def report_from_csv(
    run_dir: Union[str, Path],
    metric: Optional[str] = None,
    tolerance: Optional[float] = None,
    higher_is_better: Optional[bool] = None,
    allow_truncated: bool = False,
) -> dict[str, Any]:
    """Rebuild the report of a run from the ``pin/...`` metrics it logged: the columns of its
    ``metrics.csv`` (``CSVLogger``), or the scalars of its TensorBoard event files (Lightning's
    default logger when tensorboard is installed).

    What the CSV cannot hold (the metric's direction and tolerance) comes from the arguments, or
    from the ``pin_report.json`` that :class:`~lightning_pin.PinMonitor` writes next to it when
    training starts, or defaults to "higher is better" and 0.01.

    A TensorBoard event file that ends inside a record is refused, or with ``allow_truncated``
    read up to the cut, and the report's ``truncated`` lists each such file and its last step.

    Raises:
        FileNotFoundError: there is no ``metrics.csv`` in or below ``run_dir``.
        ValueError: the run logged several tracked metrics and ``metric`` does not choose one.
    """
    csv_path = find_metrics_csv(run_dir)
    rows = read_run_metrics(csv_path, allow_truncated=allow_truncated)
    cut = tensorboard.find_truncated(csv_path) if csv_path.is_dir() else []
    if not any(key.startswith(PREFIX) for row in rows for key in row):
        raise ReportError(
            f"{csv_path} holds no {PREFIX}... columns: it is not the log of a run trained with PinCallback "
            "(with its monitor on)"
        )
    # Counts: a NaN or infinite one (a hand-edited or damaged file) cannot be reported.
    for number, row in enumerate(rows, start=1):
        if "step" not in row:
            raise ReportError(f"{csv_path}, row {number}: no 'step' value; CSVLogger writes one in every row")
        for key in ("step", *_COUNT_COLUMNS):
            if key in row and not math.isfinite(row[key]):
                raise ReportError(f"{csv_path}, row {number}, column {key!r}: {row[key]!r} is not a count")
    existing: dict[str, Any] = {}
    log_dir = csv_path if csv_path.is_dir() else csv_path.parent
    if (log_dir / REPORT_JSON).is_file():
        existing = read_report(log_dir / REPORT_JSON)
    metric = metric or existing.get("metric") or _discover_metric(rows)
    if tolerance is None:
        tolerance = existing.get("tolerance", 0.01)
    if higher_is_better is None:
        higher_is_better = existing.get("higher_is_better", True)

    def series(key: str, *others: str) -> list[list[float]]:
        return [[row["step"], row[key], *(row.get(o, 0.0) for o in others)] for row in rows if key in row]

    def last(key: str) -> Optional[float]:
        values = [row[key] for row in rows if key in row]
        return values[-1] if values else None

    accuracy = series(f"{PREFIX}{metric}") if metric else []
    groups_prefix = f"{PREFIX}weight_drift/"
    modules = list(dict.fromkeys(k[len(groups_prefix) :] for row in rows for k in row if k.startswith(groups_prefix)))
    pinned = last(f"{PREFIX}pinned_elements")
    trainable = last(f"{PREFIX}trainable_elements")
    report = make_report(
        metric=metric,
        higher_is_better=bool(higher_is_better),
        tolerance=float(tolerance),
        baseline=last(f"{PREFIX}{metric}_baseline") if metric else None,
        forced=last(f"{PREFIX}{metric}_forced") if metric else None,
        accuracy=accuracy,
        pin_drift=series(f"{PREFIX}drift_max", f"{PREFIX}drift_mean", f"{PREFIX}violations"),
        weight_drift=series(
            f"{PREFIX}weight_drift", f"{PREFIX}weight_drift_relative", *(groups_prefix + m for m in modules)
        ),
        modules=modules,
        pinned_elements=int(pinned if pinned is not None else existing.get("pinned_elements", 0)),
        trainable_elements=int(trainable) if trainable is not None else existing.get("trainable_elements"),
    )
    if cut:
        report["truncated"] = [{"file": str(c.path), "last_step": c.last_step} for c in cut]
    return report


#: Columns that hold counts (besides ``step``).
_COUNT_COLUMNS = (f"{PREFIX}violations", f"{PREFIX}pinned_elements", f"{PREFIX}trainable_elements")


def _discover_metric(rows: Sequence[Mapping[str, float]]) -> Optional[str]:
    suffix = "_baseline"
    names = {k[len(PREFIX) : -len(suffix)] for row in rows for k in row if k.startswith(PREFIX) and k.endswith(suffix)}
    if len(names) > 1:
        raise ReportError(f"the run logged several tracked metrics {sorted(names)}: choose one with --metric")
    return names.pop() if names else None
