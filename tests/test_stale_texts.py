"""Texts that said something untrue of the run they describe: a summary verifying pins when none were pinned, a
study counting a diverged job as recovered, advice to switch to the optimizer the jobs already used, the README
refusing a fault kind the command has."""

from __future__ import annotations

from pathlib import Path

from lightning_pin.app.train import print_summary
from lightning_pin.reporting import faults as report

ROOT = Path(__file__).resolve().parents[1]
#: The README and every page of the docs site.
DOCS = {path: path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]}


def summary(**changes):
    base = {
        "choices": {"pin": "none"}, "pinned_elements": 0, "trainable_elements": 9930, "violations": 0, "files": [],
        "output_dir": "out", "seconds": 1.0, "settled_step": 0, "baseline": 0.97, "forced": 0.97, "final": 0.98,
        "gap": -0.01, "tolerance": 0.01, "recovered_step": 0,
    }  # fmt: skip
    return {**base, **changes}


def test_a_run_with_nothing_pinned_does_not_claim_to_have_verified_pinned_elements(capsys):
    print_summary(summary())
    out = capsys.readouterr().out
    assert "verified with torch.equal on every pinned element" not in out
    assert "nothing pinned" in out
    print_summary(summary(pinned_elements=7, choices={"pin": "fraction"}))
    assert "verified with torch.equal on every pinned element" in capsys.readouterr().out


def job(**changes):
    row = {"kind": "value", "rate": 0.2, "seed": 0, "baseline": 0.97, "forced": 0.5, "final": 0.09, "gap": 0.88,
           "recovered_step": 20, "pins_exact": True, "tolerance": 0.01, "diverged": True, "recipe": ""}
    return {**row, **changes}


def test_a_diverged_job_is_not_counted_as_recovered(capsys):
    # Within the tolerance at step 20, then diverged: it did not recover.
    report.print_curve([job()], "t")
    out = capsys.readouterr().out
    assert "0/1, 1 diverged" in out and "1/1" not in out
    report.print_curve([job(diverged=False, final=0.965, gap=0.005)], "t")
    assert "1/1" in capsys.readouterr().out


def test_the_divergence_advice_never_suggests_the_optimizer_the_jobs_used(capsys):
    # No optimizer override: the app's default, AdamW.
    for recipe in ("", "optimizer=adamw optimizer.lr=1e-2"):
        report.print_curve([job(recipe=recipe)], "t")
        out = capsys.readouterr().out
        assert "diverged" in out and "optimizer=adamw" not in out and "lower learning rate" in out
    report.print_curve([job(recipe="optimizer=sgd")], "t")
    assert "optimizer=adamw" in capsys.readouterr().out


def test_the_readme_offers_the_fault_kinds_the_command_has():
    from lightning_pin.app.fault_pins import KINDS, fault_generator

    for path, text in DOCS.items():
        assert "until your version has it" not in text, path
    for kind in KINDS:
        if kind != "value":
            fault_generator(kind)  # every kind the README lists has its generator
