"""README.md's fault-study tables are what benchmarks/readme_tables.py makes of the studies' CSVs kept in
docs/data/ (rerun them with ``python benchmarks/readme_tables.py --run DIR``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "benchmarks" / "readme_tables.py")
tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tables)


@pytest.mark.parametrize("name", sorted(tables.TABLES))
def test_the_readme_table_is_the_one_its_csv_makes(name):
    made = tables.render(name)
    assert tables.readme_table(tables.README.read_text(), name) == made
    assert "±" in made and "n = 3" in made  # 3 seeds: t intervals, and they say their n


def test_the_kept_csvs_are_real_studies():
    from lightning_pin.reporting import faults

    for name in [*tables.STUDIES, *(f"recovery_{n}" for n in tables.RECOVERY_STUDIES)]:
        rows = faults.read_csv(tables.DATA / f"{name}.csv")
        assert rows and list(rows[0]) == list(faults.COLUMNS), name
        assert all(r["job_dir"] or r["final"] == "" for r in rows), name
    for png in tables.FIGURES.values():
        assert (ROOT / "docs" / png).read_bytes()[:4] == b"\x89PNG"
