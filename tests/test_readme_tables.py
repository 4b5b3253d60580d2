"""The docs' fault-study tables (docs/how-to/fault-study.md, docs/how-to/recovery.md: the README's tables before the
docs site) are what benchmarks/readme_tables.py makes of the studies' CSVs kept in docs/data/ (rerun them with
``python benchmarks/readme_tables.py --run DIR``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "benchmarks" / "readme_tables.py")
tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tables)


@pytest.mark.parametrize("name", sorted(tables.TABLES))
def test_the_page_table_is_the_one_its_csv_makes(name):
    made = tables.render(name)
    assert tables.readme_table(tables.PAGES[name].read_text(), name) == made
    assert "±" in made and "n = 3" in made  # 3 seeds: t intervals, and they say their n


REMAP_COLUMNS = ("damage_before", "damage_after", "remap_seconds")


def test_the_kept_csvs_are_real_studies():
    from lightning_pin.reporting import faults

    for name in [*tables.STUDIES, *(f"recovery_{n}" for n in tables.RECOVERY_STUDIES)]:
        rows = faults.read_csv(tables.DATA / f"{name}.csv")
        # The kept CSVs were written before --remap added its columns (empty in a study without --remap).
        assert rows and list(rows[0]) == [c for c in faults.COLUMNS if c not in REMAP_COLUMNS], name
        assert all(r["job_dir"] or r["final"] == "" for r in rows), name
    for png in tables.FIGURES.values():
        assert (ROOT / "docs" / png).read_bytes()[:4] == b"\x89PNG"


def test_every_table_has_one_page_and_the_check_reads_the_pages(tmp_path, monkeypatch, capsys):
    assert set(tables.PAGES) == set(tables.TABLES)
    for name, page in tables.PAGES.items():
        assert page.read_text().count(f"<!-- table:{name} -->") == 1, page
    assert tables.main(["--check"]) == 0
    # A page whose table went stale fails the check, naming the table and its page.
    stale = tmp_path / "recovery.md"
    stale.write_text(tables.PAGES["recovery"].read_text().replace("0.947 ± 0.022", "0.952 ± 0.022"))
    monkeypatch.setitem(tables.PAGES, "recovery", stale)
    assert tables.main(["--check"]) == 1
    assert "recovery (" in capsys.readouterr().out
