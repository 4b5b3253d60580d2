"""The commands keep data: ``lightning-pin report`` and ``diff`` exit 2 with one line naming the file
(and row) for a missing, empty or unreadable input, never replace a report with one built from
less data, keep exit 1 for "a pin is off target", and ``diff`` refuses checkpoints that share no
tensor."""

from __future__ import annotations

import json

import pytest
import torch
from test_report import csv_run

from lightning_pin import Pin
from lightning_pin.cli import main
from lightning_pin.core.engine import PinEngine
from lightning_pin.core.plan import resolve


def _one_error_line(capsys, command: str) -> str:
    """The command's stderr: exactly one line, argparse style. Returns it."""
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"lightning-pin {command}: error: "), lines[0]
    return lines[0]


# ----------------------------------------------------------------------------------------------
# report


def _good_report(run) -> bytes:
    """Build the run's report once (exit 0) and return the bytes of its pin_report.json."""
    assert main(["report", str(run), "--no-plot"]) == 0
    return (run / "pin_report.json").read_bytes()


def test_report_on_a_csv_with_a_header_and_no_rows_keeps_the_existing_report(tmp_path, capsys):
    run = csv_run(tmp_path)
    good = _good_report(run)
    capsys.readouterr()
    header = (run / "metrics.csv").read_text().splitlines()[0]
    (run / "metrics.csv").write_text(header + "\n")
    assert main(["report", str(run), "--no-plot"]) == 2
    line = _one_error_line(capsys, "report")
    assert f"{run / 'metrics.csv'} has a header and no rows" in line
    assert (run / "pin_report.json").read_bytes() == good


def test_report_never_replaces_a_report_with_one_from_less_data(tmp_path, capsys):
    run = csv_run(tmp_path)
    good = _good_report(run)
    capsys.readouterr()
    # A resume logs into a new metrics.csv: it holds only the last rows of the run.
    lines = (run / "metrics.csv").read_text().splitlines()
    (run / "metrics.csv").write_text("\n".join([lines[0], lines[1]]) + "\n")
    assert main(["report", str(run), "--no-plot"]) == 2
    line = _one_error_line(capsys, "report")
    assert f"{run / 'pin_report.json'} holds more data (10 steps, 7 history rows)" in line
    assert "(0 steps, 2 rows): not overwriting it" in line and "--force" in line
    assert (run / "pin_report.json").read_bytes() == good
    # --out elsewhere, or --force, writes it.
    assert main(["report", str(run), "--no-plot", "--out", str(tmp_path / "elsewhere")]) == 0
    assert json.loads((tmp_path / "elsewhere" / "pin_report.json").read_text())["steps"] == 0
    assert main(["report", str(run), "--no-plot", "--force"]) == 0
    assert json.loads((run / "pin_report.json").read_text())["steps"] == 0


def test_report_with_as_much_data_replaces_the_report(tmp_path, capsys):
    run = csv_run(tmp_path)
    _good_report(run)
    assert main(["report", str(run), "--no-plot", "--tolerance", "0.0625"]) == 0
    assert json.loads((run / "pin_report.json").read_text())["recovered_step"] == 10


def test_report_names_the_row_and_column_of_a_cell_that_is_not_a_number(tmp_path, capsys):
    run = csv_run(tmp_path)
    text = (run / "metrics.csv").read_text().replace("0.8125", "0.8l25")
    (run / "metrics.csv").write_text(text)
    assert main(["report", str(run)]) == 2
    line = _one_error_line(capsys, "report")
    assert f"{run / 'metrics.csv'}, row 4 (line 5), column 'pin/f1': '0.8l25' is not a number" in line
    assert not (run / "pin_report.json").exists()


@pytest.mark.parametrize(
    "content, phrase",
    [
        ("{ not json", "is not a valid pin report (Expecting property name"),
        ("[1, 2]", "is not a valid pin report: it holds a list, not an object"),
        ('{"tolerance": "small"}', "is not a valid pin report: 'tolerance' is 'small'"),
        ('{"higher_is_better": "yes"}', "is not a valid pin report: 'higher_is_better' is 'yes'"),
        ('{"steps": 1.5}', "is not a valid pin report: 'steps' is 1.5"),
    ],
    ids=["not-json", "list", "tolerance-str", "direction-str", "steps-float"],
)
def test_report_names_a_corrupt_existing_report(tmp_path, capsys, content, phrase):
    run = csv_run(tmp_path)
    (run / "pin_report.json").write_text(content)
    assert main(["report", str(run), "--no-plot"]) == 2
    line = _one_error_line(capsys, "report")
    assert f"{run / 'pin_report.json'} {phrase}" in line
    assert (run / "pin_report.json").read_text() == content


@pytest.mark.parametrize(
    "make, phrase",
    [
        (lambda run: (run / "metrics.csv").write_text(""), "is empty: no header, no rows"),
        (lambda run: (run / "metrics.csv").write_bytes(b"\xff\xfe\x00garbage\x00"), "is not a text CSV file"),
        (lambda run: (run / "metrics.csv").write_text("step,train_loss\n0,1.5\n1,1.25\n"), "holds no pin/... columns"),
        (lambda run: (run / "metrics.csv").write_text("step,pin/violations\n0,0\n1,0,7\n"),
         "row 2 (line 3): more cells than the header has columns"),
        (lambda run: (run / "metrics.csv").write_text("step,pin/violations\n0,0\nnan,0\n"),
         "row 2, column 'step': nan is not a count"),
        (lambda run: (run / "metrics.csv").write_text("step,pin/violations\n0,0\n1,inf\n"),
         "row 2, column 'pin/violations': inf is not a count"),
        (lambda run: (run / "metrics.csv").write_text("epoch,pin/violations\n0,0\n"),
         "row 1: no 'step' value"),
    ],
    ids=["empty-file", "binary", "no-pin-columns", "ragged-row", "nan-step", "inf-count", "no-step"],
)
def test_report_names_the_file_of_an_unreadable_csv(tmp_path, capsys, make, phrase):
    run = tmp_path / "run"
    run.mkdir()
    make(run)
    assert main(["report", str(run)]) == 2
    line = _one_error_line(capsys, "report")
    assert str(run / "metrics.csv") in line and phrase in line
    assert not (run / "pin_report.json").exists()


def test_report_on_a_missing_directory_or_one_without_a_csv(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert f"{tmp_path / 'nowhere'} does not exist" in _one_error_line(capsys, "report")
    assert main(["report", str(tmp_path)]) == 2
    assert f"no metrics.csv or TensorBoard event file in {tmp_path}" in _one_error_line(capsys, "report")


def test_report_with_two_tracked_metrics_asks_for_one(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text("step,pin/f1_baseline,pin/acc_baseline\n0,0.5,0.75\n")
    assert main(["report", str(run)]) == 2
    assert "several tracked metrics ['acc', 'f1']: choose one with --metric" in _one_error_line(capsys, "report")
    assert main(["report", str(run), "--metric", "f1", "--no-plot"]) == 0


# ----------------------------------------------------------------------------------------------
# diff


def _checkpoint(path, weights, pin_state=None, key="PinCallback{'pins': ['x']}"):
    checkpoint = {"state_dict": weights}
    if pin_state is not None:
        checkpoint["callbacks"] = {key: pin_state}
    torch.save(checkpoint, path)
    return str(path)


def _model_and_state():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    engine = PinEngine(resolve([Pin("0.weight", indices=[(1, 2)], value=0.5)], model))
    engine.set_active(engine.ids_at(0))
    engine.restore()  # as after a step: the pin is checked
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return weights, engine.state_dict()


def test_diff_on_a_missing_file_exits_2_naming_it(tmp_path, capsys):
    weights, state = _model_and_state()
    good = _checkpoint(tmp_path / "a.ckpt", weights, state)
    missing = str(tmp_path / "missing.ckpt")
    for args in ([missing, good], [good, missing], [good, missing, "--json"]):
        assert main(["diff", *args]) == 2
        line = _one_error_line(capsys, "diff")
        assert f"{missing} does not exist" in line
        assert "objects other than tensors" not in line
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    "make, phrase",
    [
        (lambda p: p.write_bytes(b"not a zip, not a pickle"), "is not a PyTorch or safetensors file"),
        (lambda p: p.write_bytes(b""), "is empty (0 bytes)"),
        (lambda p: torch.save({"w": torch.zeros(256)}, p) or p.write_bytes(p.read_bytes()[:300]), "is truncated"),
        (lambda p: torch.save([1, 2, 3], p), "holds neither a Lightning checkpoint nor a state dict"),
        (lambda p: torch.save({}, p), "holds neither a Lightning checkpoint nor a state dict"),
        (lambda p: p.mkdir(), "is a directory"),
    ],
    ids=["garbage", "empty-file", "truncated", "list", "empty-dict", "directory"],
)
def test_diff_on_an_unreadable_file_exits_2_naming_it(tmp_path, capsys, make, phrase):
    weights, state = _model_and_state()
    good = _checkpoint(tmp_path / "a.ckpt", weights, state)
    bad = tmp_path / "bad.ckpt"
    make(bad)
    assert main(["diff", good, str(bad)]) == 2
    line = _one_error_line(capsys, "diff")
    assert str(bad) in line and phrase in line


def test_diff_on_a_file_of_an_unknown_kind(tmp_path, capsys):
    weights, state = _model_and_state()
    good = _checkpoint(tmp_path / "a.ckpt", weights, state)
    (tmp_path / "weights.npy").write_bytes(b"\x00" * 8)
    assert main(["diff", good, str(tmp_path / "weights.npy")]) == 2
    assert "weights.npy must end in one of .pt, .pth, .bin, .ckpt, .safetensors" in _one_error_line(capsys, "diff")


def test_diff_of_checkpoints_that_share_no_tensor_exits_2(tmp_path, capsys):
    weights, state = _model_and_state()
    a = _checkpoint(tmp_path / "a.ckpt", weights, state)
    b = _checkpoint(tmp_path / "b.ckpt", {"other.weight": torch.zeros(2, 3), "other.bias": torch.zeros(2)})
    assert main(["diff", a, b]) == 2
    line = _one_error_line(capsys, "diff")
    assert f"{a} and {b} cannot be compared: they share no tensor name" in line
    # Same names, every shape different: no element can be compared either.
    c = _checkpoint(tmp_path / "c.ckpt", {"0.weight": torch.zeros(4, 3), "0.bias": torch.zeros(4)})
    assert main(["diff", a, c, "--json"]) == 2
    assert "every tensor name they share has a different shape" in _one_error_line(capsys, "diff")


def test_diff_keeps_exit_1_for_a_pin_off_target_and_0_when_it_holds(tmp_path, capsys):
    weights, state = _model_and_state()
    a = _checkpoint(tmp_path / "a.ckpt", weights, state)
    assert main(["diff", a, a]) == 0
    off = {k: v.clone() for k, v in weights.items()}
    off["0.weight"][1, 2] = 0.25
    b = _checkpoint(tmp_path / "b.ckpt", off, state)
    assert main(["diff", a, b]) == 1
    captured = capsys.readouterr()
    assert "1 element(s) OFF TARGET" in captured.out and captured.err == ""


def _corrupt(state, where, value):
    state = {**state, "pins": [dict(p) for p in state["pins"]]}
    if where == "state":
        return value
    if where == "pins":
        state["pins"] = value
    elif where == "entry":
        state["pins"][0]["0.weight"] = value
    elif where == "target":
        state["pins"][0]["0.weight"] = {**state["pins"][0]["0.weight"], "target": value}
    elif where == "no-target":
        state["pins"][0]["0.weight"] = {k: v for k, v in state["pins"][0]["0.weight"].items() if k != "target"}
    elif where == "active":
        state["active"] = value
    return state


@pytest.mark.parametrize(
    "where, value, phrase",
    [
        ("pins", "abc", "'pins' must be a list with one dict per pin"),
        ("pins", 5, "'pins' must be a list with one dict per pin"),
        ("entry", "abc", "pin 0, parameter '0.weight': expected a dict with 'index', 'target' and 'explicit'"),
        ("no-target", None, "pin 0, parameter '0.weight': 'target' missing"),
        ("target", torch.tensor([float("nan")]), "pin 0, parameter '0.weight': explicit targets hold NaN or infinity"),
        ("target", torch.zeros(3), "pin 0, parameter '0.weight': 1 indices but targets of shape (3,)"),
        ("active", [7], "'active' names pins [7], but the state holds 1"),
    ],
    ids=["pins-str", "pins-int", "entry-str", "no-target", "nan-target", "target-shape", "active-out-of-range"],
)
def test_diff_on_corrupt_pin_state_exits_2_naming_the_checkpoint(tmp_path, capsys, where, value, phrase):
    weights, state = _model_and_state()
    a = _checkpoint(tmp_path / "a.ckpt", weights, state)
    b = _checkpoint(tmp_path / "b.ckpt", weights, _corrupt(state, where, value))
    assert main(["diff", a, b]) == 2
    line = _one_error_line(capsys, "diff")
    assert f"the pin state \"PinCallback{{'pins': ['x']}}\" in {b} is corrupt: {phrase}" in line


def test_diff_reads_the_plain_loop_layout_and_names_the_elements_off_target(tmp_path, capsys):
    # The README's plain-loop save: {"model": model.state_dict(), "pins": handle.state_dict()}, as `check` reads it.
    weights, state = _model_and_state()
    torch.save({"model": weights, "pins": state}, tmp_path / "a.pt")
    assert main(["diff", str(tmp_path / "a.pt"), str(tmp_path / "a.pt")]) == 0
    assert "all active pins hold in B" in capsys.readouterr().out
    off = {k: v.clone() for k, v in weights.items()}
    off["0.weight"][1, 2] = 0.25
    torch.save({"model": off, "pins": state}, tmp_path / "b.pt")
    torch.save(off, tmp_path / "bare.pt")  # B as the model's state dict alone: the pins come from A
    for b in ("b.pt", "bare.pt"):
        assert main(["diff", str(tmp_path / "a.pt"), str(tmp_path / b)]) == 1
        captured = capsys.readouterr()
        assert "1 element(s) OFF TARGET" in captured.out and captured.err == ""
        # The element and its words, as `lightning-pin check` names them.
        assert "[1, 2] = 0.25, target 0.5" in captured.out
    assert main(["diff", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--json"]) == 1
    (pin,) = json.loads(capsys.readouterr().out)["pins"]
    assert pin["shown"] == [{"position": [1, 2], "value": 0.25, "target": 0.5, "expected": None}]


def test_diff_names_at_most_the_first_few_elements_off_target(tmp_path, capsys):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8))
    engine = PinEngine(resolve([Pin("0.weight", value=0.5)], model))
    engine.set_active(engine.ids_at(0))
    engine.restore()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    a = _checkpoint(tmp_path / "a.ckpt", weights, engine.state_dict())
    off = {k: v.clone() for k, v in weights.items()}
    off["0.weight"] += 1.0
    b = _checkpoint(tmp_path / "b.ckpt", off, engine.state_dict())
    assert main(["diff", a, b]) == 1
    out = capsys.readouterr().out
    assert "32 element(s) OFF TARGET" in out and "[0, 0] = 1.5, target 0.5" in out and "... and 22 more" in out


def test_report_writes_into_the_run_directory_it_reports_on(tmp_path, capsys):
    """An app run keeps its metrics below its directory (csv/pinned/metrics.csv): `report RUN_DIR` (or a directory
    above it) writes RUN_DIR's pin_report.json, where the run's monitor wrote it, not one in the metrics'
    subdirectory; --out still chooses, and a plain Lightning run (or a metrics.csv named) gets it beside metrics.csv."""
    run = tmp_path / "outputs" / "2026-01-01" / "00-00-00"
    (run / ".hydra").mkdir(parents=True)
    metrics = csv_run(run)  # RUN/lightning_logs/version_0/metrics.csv
    for given in (run, tmp_path / "outputs"):
        (run / "pin_report.json").unlink(missing_ok=True)
        assert main(["report", str(given), "--no-plot"]) == 0
        assert (run / "pin_report.json").is_file() and not (metrics / "pin_report.json").exists(), given
        assert f"wrote {run.resolve() / 'pin_report.json'}" in capsys.readouterr().out
    assert main(["report", str(run), "--no-plot", "--out", str(tmp_path / "elsewhere")]) == 0
    assert (tmp_path / "elsewhere" / "pin_report.json").is_file()
    assert main(["report", str(metrics / "metrics.csv"), "--no-plot"]) == 0  # a file named: beside it
    assert (metrics / "pin_report.json").is_file()
    plain = csv_run(tmp_path / "plain")  # no .hydra: a Lightning run's version directory is the run
    assert main(["report", str(tmp_path / "plain"), "--no-plot"]) == 0
    assert (plain / "pin_report.json").is_file() and not (tmp_path / "plain" / "pin_report.json").exists()
