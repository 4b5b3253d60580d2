"""The report (JSON, PNG, table), its reconstruction from a CSVLogger run, and the checkpoint diff."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from helpers import TinyNet, make_loader, trainer

from lightning_pin import Pin, PinCallback
from lightning_pin.cli import main
from lightning_pin.reporting.diff import diff_checkpoints, format_diff, load_checkpoint
from lightning_pin.reporting.report import make_report, read_metrics_csv, report_from_csv, write_report

REQUIRED = (
    "metric", "baseline", "forced", "final", "gap", "recovered_step",
    "pinned_elements", "violations", "pin_drift_max", "weight_drift",
)  # fmt: skip


def sample_report() -> dict:
    return make_report(
        metric="accuracy",
        tolerance=0.0625,
        baseline=0.875,
        forced=0.5,
        accuracy=[[0, 0.5], [10, 0.75], [20, 0.8125], [25, 0.875]],
        pin_drift=[[5, 0.25, 0.125, 0], [10, 0.5, 0.25, 2], [15, 0.125, 0.0625, 0]],
        weight_drift=[[0, 0.0, 0.0, 0.0, 0.0], [10, 3.0, 0.25, 3.0, 0.0], [20, 5.0, 0.5, 3.0, 4.0]],
        modules=["encoder", "head"],
        pinned_elements=7,
        trainable_elements=100,
    )


def test_make_report_summarises_the_histories():
    report = sample_report()
    assert all(key in report for key in REQUIRED)
    assert (report["baseline"], report["forced"], report["final"], report["gap"]) == (0.875, 0.5, 0.875, 0.0)
    assert report["recovered_step"] == 20  # 0.875 - 0.8125 = 0.0625, within the tolerance
    assert report["violations"] == 2
    assert report["pin_drift_max"] == 0.5
    assert report["pin_drift_mean"] == (0.125 + 0.25 + 0.0625) / 3
    assert (report["weight_drift"], report["weight_drift_relative"]) == (5.0, 0.5)
    assert report["weight_drift_by_module"] == {"encoder": 3.0, "head": 4.0}
    assert report["history"]["weight_drift"]["by_module"]["head"] == [0.0, 0.0, 4.0]
    assert report["steps"] == 25


def test_lower_is_better_gap_and_an_untracked_metric():
    report = make_report(metric="mse", higher_is_better=False, tolerance=0.5, baseline=1.0, forced=4.0,
                         accuracy=[[0, 4.0], [8, 1.25]])  # fmt: skip
    assert report["gap"] == 0.25 and report["recovered_step"] == 8
    empty = make_report()
    assert all(key in empty for key in REQUIRED)
    assert empty["metric"] is None and empty["final"] is None and empty["pin_drift_max"] is None


def test_write_report_writes_json_and_a_png(tmp_path, capsys):
    report = sample_report()
    paths = write_report(report, tmp_path / "out")
    assert [p.name for p in paths] == ["pin_report.json", "pin_report.png"]
    assert json.loads(paths[0].read_text()) == report
    png = paths[1].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000  # a real figure, not an empty canvas


def _write_csv(path, rows):
    keys = sorted({k for row in rows for k in row})
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def csv_run(tmp_path):
    """A metrics.csv laid out as CSVLogger writes it: one row per log call, empty cells elsewhere."""
    run = tmp_path / "lightning_logs" / "version_0"
    run.mkdir(parents=True)
    _write_csv(
        run / "metrics.csv",
        [
            {"step": 0, "pin/f1_baseline": 0.875, "pin/f1_forced": 0.5, "pin/f1": 0.5, "pin/pinned_elements": 7,
             "pin/trainable_elements": 100, "pin/weight_drift": 0.0, "pin/weight_drift_relative": 0.0,
             "pin/weight_drift/encoder": 0.0},
            {"step": 3, "train_loss": 1.5},
            {"step": 5, "pin/drift_max": 0.25, "pin/drift_mean": 0.125, "pin/violations": 0,
             "pin/weight_drift": 2.0, "pin/weight_drift_relative": 0.25, "pin/weight_drift/encoder": 2.0},
            {"step": 10, "pin/f1": 0.8125, "pin/f1_gap": 0.0625, "epoch": 0, "val_loss": 0.5},
            {"step": 10, "pin/drift_max": 0.5, "pin/drift_mean": 0.25, "pin/violations": 1,
             "pin/weight_drift": 3.0, "pin/weight_drift_relative": 0.375, "pin/weight_drift/encoder": 3.0},
        ],
    )  # fmt: skip
    return run


def test_report_from_csv_rebuilds_every_number(tmp_path):
    run = csv_run(tmp_path)
    report = report_from_csv(tmp_path)  # finds lightning_logs/version_0/metrics.csv
    assert report["metric"] == "f1"  # discovered from pin/f1_baseline
    assert (report["baseline"], report["forced"], report["final"]) == (0.875, 0.5, 0.8125)
    assert report["gap"] == 0.0625 and report["recovered_step"] is None  # default tolerance 0.01
    assert (report["pinned_elements"], report["trainable_elements"]) == (7, 100)
    assert (report["violations"], report["pin_drift_max"], report["weight_drift"]) == (1, 0.5, 3.0)
    assert report["history"]["accuracy"]["step"] == [0, 10]
    assert report["history"]["pin_drift"]["step"] == [5, 10]
    assert report["history"]["weight_drift"]["by_module"] == {"encoder": [0.0, 2.0, 3.0]}
    # The tolerance and direction come from the pin_report.json written when training started.
    (run / "pin_report.json").write_text(json.dumps(make_report(metric="f1", tolerance=0.0625, higher_is_better=True)))
    assert report_from_csv(run)["recovered_step"] == 10
    assert report_from_csv(run, tolerance=0.01)["recovered_step"] is None


def test_cli_report_writes_the_files_and_prints_a_table(tmp_path, capsys):
    run = csv_run(tmp_path)
    assert main(["report", str(run), "--tolerance", "0.0625"]) == 0
    report = json.loads((run / "pin_report.json").read_text())
    assert (report["final"], report["recovered_step"]) == (0.8125, 10)
    assert (run / "pin_report.png").exists()
    out = capsys.readouterr().out
    assert "baseline (no pins)" in out and "0.8750" in out and "violations" in out
    assert main(["report", str(run), "--lower-is-better", "--no-plot", "--out", str(tmp_path / "o")]) == 0
    lower = json.loads((tmp_path / "o" / "pin_report.json").read_text())
    assert lower["higher_is_better"] is False and lower["gap"] == 0.8125 - 0.875


def test_report_from_csv_without_a_csv_says_where_it_looked(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.csv"):
        report_from_csv(tmp_path)


def test_read_metrics_csv_drops_empty_cells(tmp_path):
    run = csv_run(tmp_path)
    rows = read_metrics_csv(run / "metrics.csv")
    assert rows[1] == {"step": 3.0, "train_loss": 1.5}


# ----------------------------------------------------------------------------------------------
# lightning-pin diff

HEAD_COORDS = [(0, 1), (2, 3)]


def diff_pins() -> list[Pin]:
    return [Pin("encoder.*"), Pin("head.weight", indices=HEAD_COORDS, value=[0.5, -0.25])]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A after 2 pinned steps, B after 4; and the model's state before training."""
    out = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    model = TinyNet()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    first = trainer(max_epochs=5, max_steps=2, callbacks=[PinCallback(diff_pins(), verbose=False)])
    first.fit(model, make_loader())
    first.save_checkpoint(out / "a.ckpt")
    second = trainer(max_epochs=5, max_steps=4, callbacks=[PinCallback(diff_pins(), verbose=False)])
    second.fit(model, make_loader(), ckpt_path=str(out / "a.ckpt"))
    second.save_checkpoint(out / "b.ckpt")
    torch.save(initial, out / "initial.pt")
    return out


def test_diff_counts_changed_elements_and_checks_pins(checkpoints):
    diff = diff_checkpoints(load_checkpoint(checkpoints / "a.ckpt"), load_checkpoint(checkpoints / "b.ckpt"))
    by_name = {t.name: t for t in diff.tensors}
    assert (by_name["encoder.weight"].changed, by_name["encoder.bias"].changed) == (0, 0)  # frozen
    assert by_name["head.weight"].changed == 48 - len(HEAD_COORDS)  # everything but the two pins
    assert by_name["head.bias"].changed == 3
    assert [t.name for t in diff.changed_tensors] == ["head.weight", "head.bias"]
    assert diff.pins_from == "B" and diff.pins_hold
    assert sorted((c.name, c.elements, c.off_target, c.changed) for c in diff.pins) == [
        ("encoder.bias", 16, 0, 0),
        ("encoder.weight", 128, 0, 0),
        ("head.weight", 2, 0, 0),
    ]


def test_diff_finds_pins_that_do_not_hold(checkpoints, tmp_path, capsys):
    tampered = torch.load(checkpoints / "b.ckpt", weights_only=True)
    tampered["state_dict"]["head.weight"][2, 3] += 1.0  # a pinned element
    tampered["state_dict"]["encoder.weight"][0, 0] += 1.0  # an element of a frozen tensor
    torch.save(tampered, tmp_path / "bad.ckpt")
    diff = diff_checkpoints(load_checkpoint(checkpoints / "a.ckpt"), load_checkpoint(tmp_path / "bad.ckpt"))
    assert not diff.pins_hold
    off = {c.name: c.off_target for c in diff.pins}
    assert off == {"encoder.weight": 1, "encoder.bias": 0, "head.weight": 1}
    # The command exits 1 so that scripts can gate on it, and says what is off.
    assert main(["diff", str(checkpoints / "a.ckpt"), str(tmp_path / "bad.ckpt")]) == 1
    out = capsys.readouterr().out
    assert "OFF TARGET" in out and "do NOT hold" in out
    assert main(["diff", str(checkpoints / "a.ckpt"), str(checkpoints / "b.ckpt"), "--json"]) == 0
    parsed = json.loads(capsys.readouterr().out)
    assert parsed["pins_hold"] is True and parsed["changed_elements"] == 48 - 2 + 3


def test_diff_of_a_bare_state_dict_shows_what_training_changed(checkpoints, capsys):
    # The BERT user's question: did my "frozen" encoder move? Here nothing froze it before A.
    diff = diff_checkpoints(load_checkpoint(checkpoints / "initial.pt"), load_checkpoint(checkpoints / "a.ckpt"))
    by_name = {t.name: t for t in diff.tensors}
    assert by_name["encoder.weight"].changed == 0  # pinned from the first step on
    assert by_name["head.weight"].changed == 48  # including the two elements forced to new values
    assert diff.pins_from == "B"
    assert [c.changed for c in diff.pins if c.name == "head.weight"] == [2]
    assert [row[0] for row in format_diff(diff, changed_only=True)] == ["head.weight", "head.bias"]
    assert main(["diff", str(checkpoints / "initial.pt"), str(checkpoints / "a.ckpt"), "--changed-only"]) == 0
    out = capsys.readouterr().out
    assert "51 of 195 elements changed, in 2 of 4 tensors" in out  # head 48 + 3 of 128 + 16 + 48 + 3


def test_diff_refuses_a_file_that_is_not_a_checkpoint(tmp_path):
    torch.save({"state_dict": {"w": torch.zeros(1)}, "hook": print}, tmp_path / "odd.ckpt")
    with pytest.raises(ValueError, match="weights_only"):
        load_checkpoint(tmp_path / "odd.ckpt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="neither"):
        load_checkpoint(tmp_path / "list.pt")
