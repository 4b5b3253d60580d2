"""The files of ``lightning-pin tune``: ``trials.csv`` (every finished trial); with one objective the trials
as a table and ``trials.png`` (the objective by trial, and against each parameter), with several the Pareto
front as a table and ``pareto.png``. Reads plain dicts; imports neither Optuna nor Lightning.

A key that is both a searched parameter and an objective (``pin.rate``) is listed once, as the objective.

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

__all__ = [
    "PARETO_PNG", "PERCENT", "QUANTITIES", "TRIALS_CSV", "TRIALS_PNG", "front_sorted", "plot_front", "plot_trials",
    "print_front", "print_trials", "quantity", "write_trials",
]


TRIALS_CSV = "trials.csv"
PARETO_PNG = "pareto.png"
TRIALS_PNG = "trials.png"

#: What a key measures, for axis labels (a key not here is shown as it is); and the keys shown in percent.
QUANTITIES = {
    "final": "final validation accuracy",
    "baseline": "baseline validation accuracy (no pins)",
    "forced": "forced validation accuracy (pins set, no training)",
    "gap": "accuracy gap to the baseline",
    "pin_drift_max": "largest pin drift in a step",
    "weight_drift": "weight drift (L2 from fit start)",
    "weight_drift_relative": "weight drift (% of the weights' norm)",
    "train_loss": "final training loss",
    "seconds": "trial time (s)",
    "steps": "optimizer steps",
    "pin.rate": "fault rate (%)",
    "pin.fraction": "pinned fraction (%)",
    "optimizer.lr": "learning rate",
    "optimizer.weight_decay": "weight decay",
    "optimizer": "optimizer",
    "data.batch_size": "batch size",
    "trainer.max_epochs": "retraining epochs",
    "pretrain.max_epochs": "pretraining epochs",
}
PERCENT = ("pin.rate", "pin.fraction", "weight_drift_relative")


def quantity(key: str) -> str:
    """The axis label of a parameter or objective key (``objective (max)`` labels as its key).

    >>> quantity("pin.rate (max)"), quantity("final (max)"), quantity("model.width")
    ('fault rate (%)', 'final validation accuracy', 'model.width')
    """
    return QUANTITIES.get(_key(key), _key(key))


def _key(name: str) -> str:
    """``"final (max)"`` -> ``"final"``: the key an objective's column name is made of."""
    return name.rsplit(" (", 1)[0] if name.endswith(("(max)", "(min)")) else name


def _scale(key: str, value: Any) -> Any:
    return 100 * value if _key(key) in PERCENT and isinstance(value, (int, float)) else value


def _param_keys(trials: Sequence[Mapping[str, Any]], objectives: Sequence[str]) -> list[str]:
    """The searched keys, less those that are objectives too (listed once, as the objective)."""
    keys = sorted({k for t in trials for k in t["params"]})
    return [k for k in keys if k not in {_key(o) for o in objectives}]


def front_sorted(trials: Sequence[Mapping[str, Any]], front: Collection[int]) -> list[Mapping[str, Any]]:
    """The trials on the front, by their first objective's value, smallest first."""
    return sorted((t for t in trials if t["number"] in front), key=lambda t: t["values"][0])


def write_trials(trials: Sequence[Mapping[str, Any]], front: Collection[int], path: Path,
                 objectives: Sequence[str]) -> Path:
    keys = _param_keys(trials, objectives)
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["trial", *keys, *objectives, "pareto"])
        for t in sorted(trials, key=lambda t: t["number"]):
            writer.writerow([t["number"], *(t["params"].get(k, "") for k in keys), *t["values"],
                             str(t["number"] in front).lower()])
    return path


def print_trials(trials: Sequence[Mapping[str, Any]], best: int, objectives: Sequence[str], others: str = "") -> None:
    """Every complete trial in order, the best one marked (one objective); ``others`` says what else
    the study holds ("1 pruned")."""
    keys = _param_keys(trials, objectives)
    rows = [[str(t["number"]), *(_fmt(t["params"].get(k)) for k in keys), *(f"{v:.4g}" for v in t["values"]),
             "best" if t["number"] == best else ""] for t in sorted(trials, key=lambda t: t["number"])]
    columns = [tables.Column("trial", justify="right"), *keys, *(tables.Column(o, justify="right") for o in objectives),
               ""]
    tables.print_table(columns, rows, f"{len(rows)} complete trial(s)" + (f" ({others})" if others else ""))


def print_front(trials: Sequence[Mapping[str, Any]], front: Collection[int], objectives: Sequence[str]) -> None:
    keys = _param_keys(trials, objectives)
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
    x, y = objectives[1], objectives[0]
    ax.scatter([_scale(x, t["values"][1]) for t in others], [_scale(y, t["values"][0]) for t in others], color="0.6",
               label="dominated trials")
    best = sorted(front_sorted(trials, front), key=lambda t: t["values"][1])
    ax.plot([_scale(x, t["values"][1]) for t in best], [_scale(y, t["values"][0]) for t in best], "o-",
            color="tab:red", label="Pareto front")
    ax.set_xlabel(f"{quantity(objectives[1])}, {_direction(objectives[1])}")
    ax.set_ylabel(f"{quantity(objectives[0])}, {_direction(objectives[0])}")
    ax.set_title(f"Pareto front of {len(trials)} complete trials (NSGA-II)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_trials(trials: Sequence[Mapping[str, Any]], best: int, objectives: Sequence[str],
                searched: Mapping[str, tuple[str, Any, Any]], path: Path, others: str = "") -> Optional[Path]:
    """One objective: its value by trial (with the best so far), and against each searched parameter.

    ``searched`` maps a parameter to its ``--param`` kind and range (``("log", 1e-3, 1e-2)``: a log
    axis over the searched range; ``("choice", None, None)``: categories). ``others`` says which
    trials are not drawn ("1 pruned"). Returns ``path``, or None without matplotlib.
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator, NullFormatter
    except ImportError:
        return None
    kinds = {key: kind for key, (kind, _, _) in searched.items()}
    objective = objectives[0]
    maximize = objective.endswith("(max)")
    keys = [k for k in sorted({k for t in trials for k in t["params"]}) if k != _key(objective)]
    ordered = sorted(trials, key=lambda t: t["number"])
    # At most three panels a row: many parameters wrap onto more rows instead of a strip no page holds.
    panels = 1 + len(keys)
    columns, rows = min(3, panels), -(-panels // 3)
    fig = Figure(figsize=(4.4 * columns, 3.6 * rows + 0.4), dpi=120)
    grid = fig.subplots(rows, columns, squeeze=False)
    axes = [ax for row in grid for ax in row]
    for unused in axes[panels:]:
        unused.set_visible(False)
    axes = axes[:panels]
    numbers = [t["number"] for t in ordered]
    values = [_scale(objective, t["values"][0]) for t in ordered]
    so_far, running = [], None
    for v in values:
        running = v if running is None else (max(running, v) if maximize else min(running, v))
        so_far.append(running)
    ax = axes[0]
    ax.plot(numbers, values, "o", color="tab:blue", label="trial")
    ax.step(numbers, so_far, where="post", color="tab:red", label="best so far")
    ax.set_xlabel("trial")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(quantity(objective))
    ax.set_title(f"{quantity(objective)} by trial ({_direction(objective)})", fontsize=9)
    chosen = next(t for t in ordered if t["number"] == best)
    for ax, key in zip(axes[1:], keys):
        points = [(t["params"][key], _scale(objective, t["values"][0])) for t in ordered if key in t["params"]]
        if kinds.get(key) == "choice":
            labels = sorted({str(p) for p, _ in points})
            ax.scatter([labels.index(str(p)) for p, _ in points], [v for _, v in points], color="tab:blue")
            ax.set_xticks(range(len(labels)), labels)
            ax.set_xlim(-0.5, len(labels) - 0.5)
            ax.scatter([labels.index(str(chosen["params"][key]))], [_scale(objective, chosen["values"][0])],
                       s=120, facecolors="none", edgecolors="tab:red", label=f"best (trial {best})")
        else:
            ax.scatter([_scale(key, p) for p, _ in points], [v for _, v in points], color="tab:blue")
            ax.scatter([_scale(key, chosen["params"][key])], [_scale(objective, chosen["values"][0])], s=120,
                       facecolors="none", edgecolors="tab:red", label=f"best (trial {best})")
            kind, low, high = searched.get(key, ("float", None, None))
            if kind == "log":
                ax.set_xscale("log")
                ax.xaxis.set_minor_formatter(NullFormatter())  # a narrow range would crowd its minor labels
            if low is not None and high is not None:
                # The whole searched range: where the sampler did not look shows too.
                pad = (high - low) * 0.03 if kind != "log" else 0
                ax.set_xlim(_scale(key, low - pad) if kind != "log" else low * 0.9,
                            _scale(key, high + pad) if kind != "log" else high * 1.1)
                if kind == "int":
                    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(quantity(key))
        ax.set_ylabel(quantity(objective))
        ax.set_title(f"{quantity(objective)} against {quantity(key)}", fontsize=9)
    for ax in axes:
        ax.grid(alpha=0.3)
    left_out = f"; not drawn: {others}" if others else ""
    # The key in the title: legends inside small panels cover points wherever they go.
    fig.suptitle(f"lightning-pin tune: {len(trials)} complete trial(s), TPE sampler{left_out}\n"
                 f"dots: trials; red line: best so far; red ring: the best trial ({best})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _direction(objective: str) -> str:
    if objective.endswith("(max)"):
        return "higher is better"
    return "lower is better" if objective.endswith("(min)") else objective


def _fmt(value: Any) -> str:
    return "" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value))
