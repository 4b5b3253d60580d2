"""``lightning-pin report``: reads a plain Trainer run logged by TensorBoard (Lightning's default logger
when tensorboard is installed), never overwrites a file that is not a report, exits 2 with one line
for usage problems, and writes both files or neither."""

from __future__ import annotations

import json

import pytest
import torch
from test_commands import _one_error_line
from test_report import csv_run

from helpers import TinyNet, make_loader, trainer
from lightning_pin import Pin, PinCallback, PinMonitor
from lightning_pin.cli import main

pytest.importorskip("tensorboard")


class ValidatedNet(TinyNet):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y))


def as_float32(value):
    """What a float becomes in a TensorBoard event file (float32); None and ints unchanged."""
    return value if not isinstance(value, float) else torch.tensor(value, dtype=torch.float32).item()


def test_report_reads_a_plain_trainer_run_logged_by_tensorboard(tmp_path, monkeypatch, capsys):
    from lightning.pytorch.loggers import TensorBoardLogger

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = ValidatedNet()
    cb = PinCallback([Pin("head.weight", indices=[(0, 1), (2, 3)], value=[0.5, -2.0])], verbose=False,
                     monitor=PinMonitor(accuracy=True))
    # logger=True: Lightning's default, TensorBoard when it is installed (the app extra installs it).
    tr = trainer(max_epochs=2, logger=True, log_every_n_steps=2, callbacks=[cb], default_root_dir=tmp_path)
    assert isinstance(tr.logger, TensorBoardLogger)
    tr.fit(model, make_loader(), make_loader(seed=1))
    run = tmp_path / "lightning_logs" / "version_0"
    assert not (run / "metrics.csv").exists() and list(run.glob("events.out.tfevents.*"))
    expected = cb.monitor.results()
    for name in ("pin_report.json", "pin_report.png"):  # what the monitor wrote: rebuild it from the events
        (run / name).unlink(missing_ok=True)

    assert main(["report", "lightning_logs/version_0"]) == 0
    rebuilt = json.loads((run / "pin_report.json").read_text())
    assert (run / "pin_report.png").stat().st_size > 0
    for key in ("metric", "baseline", "forced", "final", "recovered_step", "pinned_elements", "violations",
                "pin_drift_max", "weight_drift", "steps"):
        assert rebuilt[key] == as_float32(expected[key]), key
    assert rebuilt["gap"] == rebuilt["baseline"] - rebuilt["final"]
    assert rebuilt["metric"] == "accuracy" and rebuilt["final"] is not None and rebuilt["pin_drift_max"] is not None
    assert rebuilt["history"]["pin_drift"]["step"] == expected["history"]["pin_drift"]["step"]
    assert rebuilt["history"]["accuracy"]["step"] == expected["history"]["accuracy"]["step"]
    # The parent directory finds the newest run below it, as for CSVLogger runs.
    capsys.readouterr()
    assert main(["report", "lightning_logs", "--no-plot", "--out", str(tmp_path / "again")]) == 0
    assert json.loads((tmp_path / "again" / "pin_report.json").read_text())["steps"] == rebuilt["steps"]


def test_report_never_overwrites_a_json_that_is_not_a_pin_report(tmp_path, capsys):
    run = csv_run(tmp_path)
    mine = '{"experiment": "mine", "lr": 0.1}\n'
    (run / "pin_report.json").write_text(mine)
    for extra in ([], ["--force"]):
        assert main(["report", str(run), *extra]) == 2
        line = _one_error_line(capsys, "report")
        assert f"{run / 'pin_report.json'} is not a pin report" in line and "not overwriting it" in line
        assert (run / "pin_report.json").read_text() == mine
        assert not (run / "pin_report.png").exists()


def test_report_never_overwrites_a_png_that_is_not_a_png(tmp_path, capsys):
    run = csv_run(tmp_path)
    (run / "pin_report.png").write_text("my notes")
    assert main(["report", str(run)]) == 2
    assert f"{run / 'pin_report.png'} is not a PNG image" in _one_error_line(capsys, "report")
    assert (run / "pin_report.png").read_text() == "my notes" and not (run / "pin_report.json").exists()
    # --no-plot does not touch the PNG, so it may go ahead.
    assert main(["report", str(run), "--no-plot"]) == 0
    assert (run / "pin_report.png").read_text() == "my notes"


def test_report_out_naming_a_file_is_a_usage_error(tmp_path, capsys):
    run = csv_run(tmp_path)
    out = tmp_path / "notes.txt"
    out.write_text("keep me")
    assert main(["report", str(run), "--out", str(out)]) == 2
    assert f"{out} is a file: the report is written into a directory" in _one_error_line(capsys, "report")
    assert out.read_text() == "keep me"


def test_report_png_path_that_is_a_directory_writes_neither_file(tmp_path, capsys):
    run = csv_run(tmp_path)
    (run / "pin_report.png").mkdir()
    assert main(["report", str(run)]) == 2
    assert f"{run / 'pin_report.png'} is not a file" in _one_error_line(capsys, "report")
    assert not (run / "pin_report.json").exists()


def test_write_report_leaves_neither_file_when_the_plot_fails(tmp_path, monkeypatch):
    from lightning_pin.reporting import report as reporting
    from test_report import sample_report

    def broken_plot(report, path):
        path.write_bytes(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(reporting, "plot_report", broken_plot)
    with pytest.raises(OSError, match="disk full"):
        reporting.write_report(sample_report(), tmp_path)
    assert list(tmp_path.iterdir()) == []


def _events_run(directory, steps=10):
    """A TensorBoard run directory holding the pin/... scalars of ``steps`` logged steps."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(directory))
    writer.add_scalar("pin/accuracy_baseline", 0.9, 0)
    writer.add_scalar("pin/accuracy_forced", 0.3, 0)
    for step in range(steps):
        writer.add_scalar("pin/accuracy", 0.3 + 0.05 * step, step)
        writer.add_scalar("pin/violations", 0, step)
    writer.close()
    (events,) = directory.glob("events.out.tfevents.*")
    return events


def test_report_on_a_truncated_event_file_names_it_and_the_last_step_read(tmp_path, capsys):
    run = tmp_path / "run"
    events = _events_run(run)
    assert main(["report", str(run), "--no-plot", "--out", str(tmp_path / "whole")]) == 0
    assert json.loads((tmp_path / "whole" / "pin_report.json").read_text())["steps"] == 9
    # Cut the file in the middle of its last record (the last step's pin/violations).
    data = events.read_bytes()
    events.write_bytes(data[:-7])
    capsys.readouterr()
    assert main(["report", str(run), "--no-plot"]) == 2
    line = _one_error_line(capsys, "report")
    assert str(events) in line and "is truncated" in line and "after step 9" in line and "--allow-truncated" in line
    assert not (run / "pin_report.json").exists()
    # Asked for, the report is built from what was read, and says so.
    assert main(["report", str(run), "--no-plot", "--allow-truncated"]) == 0
    out = capsys.readouterr().out
    assert "truncated" in out and events.name in out
    report = json.loads((run / "pin_report.json").read_text())
    assert report["truncated"] == [{"file": str(events), "last_step": 9}]
    # A cut inside the first record's header is also a truncation (nothing read after step -).
    events.write_bytes(data[:5])
    assert main(["report", str(run), "--no-plot", "--out", str(tmp_path / "cut")]) == 2
    assert "is truncated" in _one_error_line(capsys, "report")
