"""The docs' fault-study tables, made from real runs of ``lightning-pin faults``.

    python benchmarks/readme_tables.py --run DIR   # run the studies into DIR (about 5 minutes on 2 cores), keep
                                                   # their CSVs in docs/data/, write the tables into their pages
    python benchmarks/readme_tables.py             # only write the tables again from docs/data/*.csv
    python benchmarks/readme_tables.py --check     # exit 1 when a page's table differs from docs/data/

Each table sits in its docs page (:data:`PAGES`: the README's tables before the docs site) between
``<!-- table:NAME -->`` and ``<!-- /table -->``; tests/test_readme_tables.py checks that they are what
:func:`render` makes of the kept CSVs.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"

__all__ = ["FIGURES", "PAGES", "STUDIES", "TABLES", "plot_figures", "render", "replace_tables", "run_studies"]

#: name -> the ``lightning-pin faults`` arguments of one study (its CSV: docs/data/<name>.csv).
STUDIES: dict[str, list[str]] = {
    "fault_study": ["--kind", "cell", "--rates", "0,0.05,0.1,0.2,0.3", "--seeds", "3", "experiment=fault_study"],
    # A test-time campaign over decades of bit error rates: the log-axis figure (docs/flip_curve.png).
    "flip": ["--kind", "flip", "--rates", "0,1e-4,1e-3,1e-2", "--seeds", "100", "experiment=fault_study"],
}
#: docs/<png> drawn from docs/data/<name>.csv by the study's own plot (:func:`plot_figures`).
FIGURES = {"fault_study": "fault_curve.png", "flip": "flip_curve.png"}
#: The recovery table: (faults, recipe, study name, rate); every study of it shares one baseline of the CNN.
RECOVERY = [
    ("50% stuck at U[-2, 2)", "AdamW lr 3e-3 (default)", "value", 0.5),
    ("50% stuck at U[-2, 2)", "+ `recovery=distill`", "value_distill", 0.5),
    ("50% stuck at U[-2, 2)", "AdamW `optimizer.lr=1e-2`", "value_lr", 0.5),
    ("50% stuck at U[-2, 2)", "lr 1e-2 + `recovery=distill`", "value_lr_distill", 0.5),
    ("10% SA1 (`pin.sa1_fraction=1`)", "default", "sa1", 0.1),
    ("10% SA1", "+ `recovery=distill`", "sa1_distill", 0.1),
    ("20% SA1", "default", "sa1", 0.2),
    ("20% SA1", "+ `recovery=distill`", "sa1_distill", 0.2),
    ("20% stuck at U[-2, 2)", "`optimizer=sgd` (lr 0.1, momentum 0.9)", "value_sgd", 0.2),
    ("50% stuck at U[-2, 2)", "`optimizer=sgd`", "value_sgd", 0.5),
]
SEEDS = ["--seeds", "3"]
RECOVERY_STUDIES: dict[str, list[str]] = {
    "value": ["--kind", "value", "--rates", "0.5", *SEEDS],
    "value_distill": ["--kind", "value", "--rates", "0.5", *SEEDS, "recovery=distill"],
    "value_lr": ["--kind", "value", "--rates", "0.5", *SEEDS, "optimizer.lr=1e-2"],
    "value_lr_distill": ["--kind", "value", "--rates", "0.5", *SEEDS, "optimizer.lr=1e-2", "recovery=distill"],
    "sa1": ["--kind", "cell", "--rates", "0.1,0.2", *SEEDS, "pin.sa1_fraction=1"],
    "sa1_distill": ["--kind", "cell", "--rates", "0.1,0.2", *SEEDS, "pin.sa1_fraction=1", "recovery=distill"],
    "value_sgd": ["--kind", "value", "--rates", "0.2,0.5", *SEEDS, "optimizer=sgd"],
}


def _rows(name: str) -> list[dict[str, str]]:
    from lightning_pin.reporting import faults

    return faults.read_csv(DATA / f"{name}.csv")


def _points(rows: Sequence[dict[str, Any]]) -> dict[float, dict[str, Any]]:
    from lightning_pin.reporting import faults

    numeric = [{**r, "rate": float(r["rate"])} for r in rows]
    return {p["rate"]: p for p in faults.aggregate(numeric)}


def fault_study_table() -> str:
    from lightning_pin.reporting import faults

    points = _points(_rows("fault_study"))
    lines = ["| stuck cells | forced (no retraining) | final (retrained) |", "|---|---|---|"]
    for rate, p in sorted(points.items()):
        label = "0% (control)" if rate == 0 else f"{100 * rate:g}%"
        lines.append(f"| {label} | {faults.spread(p, 'forced')} | {faults.spread(p, 'final')} |")
    baseline = next(iter(points.values()))["baseline_mean"]
    lines.append("")
    lines.append(f"Baseline {baseline:.3f}; {faults.spread_note(list(points.values()))}.")
    return "\n".join(lines)


def recovery_table() -> str:
    from lightning_pin.reporting import faults

    lines = ["| faults | recipe | forced | final | gap to baseline |", "|---|---|---|---|---|"]
    studies = {name: _points(_rows(f"recovery_{name}")) for name in RECOVERY_STUDIES}
    used = []
    for what, recipe, name, rate in RECOVERY:
        p = studies[name][rate]
        used.append(p)
        final = faults.spread(p, "final")
        if p["diverged"]:
            final += f": diverged {p['diverged']}/{p['seeds']}"
        gap = f"{100 * p['gap_mean']:.1f} points"
        lines.append(f"| {what} | {recipe} | {faults.spread(p, 'forced')} | {final} | {gap} |")
    baseline = used[0]["baseline_mean"]
    lines.append("")
    lines.append(f"Baseline {baseline:.3f}; {faults.spread_note(used)}; the gap is the mean's, in accuracy points.")
    return "\n".join(lines)


#: name -> the function that makes its table from docs/data/.
TABLES: dict[str, Callable[[], str]] = {"fault_study": fault_study_table, "recovery": recovery_table}
#: name -> the docs page that holds the table between its markers.
PAGES: dict[str, Path] = {
    "fault_study": ROOT / "docs" / "how-to" / "fault-study.md",
    "recovery": ROOT / "docs" / "how-to" / "recovery.md",
}


def render(name: str) -> str:
    """The table ``name`` as its page (:data:`PAGES`) holds it (markdown), made from the kept CSVs."""
    return TABLES[name]()


def _marker(name: str) -> tuple[str, str]:
    return f"<!-- table:{name} -->", "<!-- /table -->"


def readme_table(text: str, name: str) -> str:
    """The text between the table's markers in ``text``."""
    start, end = _marker(name)
    head = text.index(start) + len(start)
    return text[head:text.index(end, head)].strip("\n")


def replace_tables(text: str, names: Sequence[str] = tuple(TABLES)) -> str:
    """``text`` with the tables ``names`` rewritten between their markers."""
    for name in names:
        start, end = _marker(name)
        head = text.index(start) + len(start)
        tail = text.index(end, head)
        text = text[:head] + "\n" + render(name) + "\n" + text[tail:]
    return text


def _faults(args: Sequence[str]) -> None:
    from lightning_pin import cli

    status = cli.main(["faults", *args])
    if status != 0:
        raise SystemExit(f"lightning-pin faults {' '.join(args)} exited {status}")


def run_studies(out: Path, jobs: int) -> None:
    """Run every study into ``out`` and keep its fault_curve.csv in docs/data/."""
    DATA.mkdir(parents=True, exist_ok=True)
    for name, args in STUDIES.items():
        _faults([*args, "--jobs", str(jobs), "--out", str(out / name)])
        shutil.copy(out / name / "fault_curve.csv", DATA / f"{name}.csv")
    first = None
    for name, args in RECOVERY_STUDIES.items():
        shared = [] if first is None else [f"ckpt_path={first / 'baseline' / 'pretrained.ckpt'}"]
        _faults([*args, "--jobs", str(jobs), "--out", str(out / f"recovery_{name}"), *shared])
        first = first or out / f"recovery_{name}"
        shutil.copy(out / f"recovery_{name}" / "fault_curve.csv", DATA / f"recovery_{name}.csv")


def plot_figures() -> list[Path]:
    """docs/fault_curve.png and docs/flip_curve.png, from the kept CSVs, as ``lightning-pin faults`` draws them."""
    from lightning_pin.reporting import faults

    written = []
    for name, png in FIGURES.items():
        rows = [{**r, "rate": float(r["rate"])} for r in _rows(name)]
        written.append(faults.plot_curve(rows, ROOT / "docs" / png))
    return written


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, metavar="DIR", help="run the studies into DIR first")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--check", action="store_true", help="exit 1 when a page's table is not up to date")
    args = parser.parse_args(list(argv))
    if args.run is not None:
        run_studies(args.run, args.jobs)
    if args.check:
        stale = [f"{name} ({PAGES[name].name})" for name in TABLES
                 if readme_table(PAGES[name].read_text(), name) != render(name)]
        if stale:
            print(f"the tables {', '.join(stale)} differ from docs/data: python benchmarks/readme_tables.py")
        return 1 if stale else 0
    for name, page in PAGES.items():
        page.write_text(replace_tables(page.read_text(), [name]))
    plot_figures()
    for name in TABLES:
        print(render(name), end="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
