"""The deployed-int8 commands: ``faults --no-retrain --deploy torchao-int8``, ``export --int8``, ``check`` on int8
ONNX."""

from __future__ import annotations

import csv
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_train_app import TINY, run

pytest.importorskip("torchao")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from lightning_pin import cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def page_commands() -> list[str]:
    """The command-line block of docs/how-to/deploy-int8.md (the README's "Deploying int8" before the docs site)."""
    page = (ROOT / "docs" / "how-to" / "deploy-int8.md").read_text()
    section = page[page.index("## From the command line"):]
    block = re.search(r"^```bash\n(.*?)^```$", section, re.M | re.S).group(1)
    lines = [line for line in block.splitlines() if line.startswith("lightning-pin")]
    assert [shlex.split(line)[1] for line in lines] == ["train", "export", "check", "faults"]
    return lines


def page_command(line: str, cwd: Path, fork_runner) -> subprocess.CompletedProcess:
    """One line of the page's block, run as written in ``cwd`` (train and faults made tiny)."""
    argv = shlex.split(line)
    if argv[1] == "train":
        command = [sys.executable, "-m", "lightning_pin.train", *argv[2:], *TINY]
    elif argv[1] == "faults":
        command = [sys.executable, "-m", "lightning_pin.cli", "faults", "--rates", "0,0.05", "--seeds", "1",
                   "--out", str(cwd / "study"), *argv[2:], *TINY]
    else:
        command = [sys.executable, "-m", "lightning_pin.cli", *argv[1:]]
    return run(command, cwd=cwd, runner=fork_runner, timeout=400)


@pytest.fixture(scope="module")
def code_run(tmp_path_factory, fork_runner):
    """An app run trained around stuck bits of int8 codes, exported as an int8 QDQ ONNX model: the page's own train
    and export lines, in an empty directory (the page's test runs its other lines there after them)."""
    root = tmp_path_factory.mktemp("code_run")
    train, export = page_commands()[:2]
    result = page_command(train, root, fork_runner)
    assert result.returncode == 0, (train, result.output)
    result = page_command(export, root, fork_runner)
    assert result.returncode == 0, (export, result.output)
    return root, root / "outputs" / "int8", result.output


def test_export_int8_writes_the_trained_codes_and_check_reads_them(code_run, capsys):
    root, run_dir, output = code_run
    assert "export: 1 weight(s) without a code stay float: backbone.head.weight" in output
    graph = onnx.load(str(root / "model.onnx"))
    inits = {i.name: i for i in graph.graph.initializer}
    convs = [n for n in inits if n.startswith("backbone.features") and n.endswith("weight")]
    assert len(convs) == 2 and all(inits[n].data_type == onnx.TensorProto.INT8 for n in convs)
    pinned = torch.load(run_dir / "pinned.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    for name in convs:  # the stored codes are the trained weights' codes (the code pins' rounding), bit for bit
        q = torch.from_numpy(onnx.numpy_helper.to_array(inits[name]).astype("float32"))
        s = torch.from_numpy(onnx.numpy_helper.to_array(inits[f"{name}_scale"]).copy()).reshape(-1, 1, 1, 1)
        assert torch.equal(q, torch.clamp(torch.round(pinned[name] / s), -128, 127))
    session = ort.InferenceSession(str(root / "model.onnx"))
    x = torch.randn(1, 1, 8, 8)
    assert session.run(None, {session.get_inputs()[0].name: x.numpy()})[0].shape == (1, 10)
    assert cli.main(["check", str(run_dir / "pinned.ckpt"), str(root / "model.onnx")]) == 0
    assert "pinned element(s) hold, bit for bit" in capsys.readouterr().out


def test_check_names_an_edited_int8_code(code_run, tmp_path, capsys):
    root, run_dir, _ = code_run
    from lightning_pin.core.io import load_checkpoint
    from lightning_pin.core.state import PinState, find_pin_states

    state = PinState.from_dict(next(iter(find_pin_states(load_checkpoint(run_dir / "pinned.ckpt")).values())))
    name, saved = next((n, s) for sel in state.pins for n, s in sel.items() if s.kind == "quant_code")
    at = int(saved.index[0])
    mask = int(saved.payload["stuck_at_zero"][0] | saved.payload["stuck_at_one"][0])
    graph = onnx.load(str(root / "model.onnx"))
    init = next(i for i in graph.graph.initializer if i.name == name)
    codes = onnx.numpy_helper.to_array(init).copy()
    flat = codes.reshape(-1)
    flat[at] = int(flat[at]) ^ (mask & -mask) if (mask & -mask) != 0x80 else int(flat[at]) ^ -128
    init.CopyFrom(onnx.numpy_helper.from_array(codes, name))
    onnx.save(graph, str(tmp_path / "edited.onnx"))
    capsys.readouterr()
    assert cli.main(["check", str(run_dir / "pinned.ckpt"), str(tmp_path / "edited.onnx")]) == 1
    out = capsys.readouterr().out
    element = [int(c) for c in torch.unravel_index(torch.tensor(at), tuple(codes.shape))]
    assert name in out and str(element) in out and "stored code 0x" in out and "expected code 0x" in out, out


def test_faults_deploy_torchao_int8_is_a_test_time_campaign_on_the_codes(tmp_path, fork_runner):
    out = tmp_path / "study"
    args = [sys.executable, "-m", "lightning_pin.cli", "faults", "--kind", "bit", "--rates", "0,0.05", "--seeds", "1",
            "--no-retrain", "--deploy", "torchao-int8", "--out", str(out), "model=mlp", "pin.params=backbone.*.weight",
            *TINY]
    result = run(args, cwd=tmp_path, runner=fork_runner, timeout=400)
    assert result.returncode == 0, result.output
    assert "torchao int8: faults in the stored codes of backbone.layers.0.weight" in result.output
    rows = {float(r["rate"]): r for r in csv.DictReader((out / "fault_curve.csv").open())}
    assert rows[0.0]["forced"] == rows[0.0]["baseline"] and int(rows[0.0]["changed_bits"]) == 0
    assert int(rows[0.05]["changed_bits"]) > 0 and "--deploy torchao-int8" in rows[0.05]["recipe"]


@pytest.mark.parametrize("argv, words", [
    (["faults", "--kind", "bit", "--deploy", "torchao-int8"], "add --no-retrain"),
    (["faults", "--kind", "value", "--no-retrain", "--deploy", "torchao-int8"], "use --kind bit, cell or flip"),
    (["faults", "--kind", "bit", "--no-retrain", "--deploy", "tensorrt"], "unknown --deploy 'tensorrt'"),
    (["export", "RUN", "--to", "m.safetensors", "--int8"], "--int8 writes an int8 QDQ ONNX model"),
])
def test_deploy_usage_errors_are_one_line(argv, words, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status = cli.main([*argv, *(["--out", str(tmp_path / "x")] if argv[0] == "faults" else [])])
    err = capsys.readouterr().err.strip().splitlines()
    assert status in (1, 2) and len(err) == 1 and words in err[0], err
    assert not (tmp_path / "x").exists()


def test_without_the_extra_the_commands_name_it(tmp_path, fork_runner):
    """Without torchao / onnx: the commands end with one line naming the extra, and so do the functions."""
    script = tmp_path / "no_extra.py"
    script.write_text(
        "import contextlib, io, sys\n"
        "for name in ('torchao', 'onnx', 'onnxscript'):\n"
        "    sys.modules[name] = None  # as if not installed\n"
        "import torch\n"
        "from lightning_pin import PinError, QuantCode, cli\n"
        "from lightning_pin.deploy import to_onnx, to_torchao\n"
        f"root = {str(tmp_path)!r}\n"
        "for argv in (['faults', '--no-retrain', '--deploy', 'torchao-int8', '--out', root + '/x'],\n"
        "             ['export', root, '--to', root + '/m.onnx', '--int8']):\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        status = cli.main(argv)\n"
        "    print(status, '|'.join(err.getvalue().strip().splitlines()))\n"
        "net, code = torch.nn.Linear(4, 2), {'weight': QuantCode(8, 0.1)}\n"
        "calls = (lambda: to_torchao(net, code),\n"
        "         lambda: to_onnx(net, root + '/m.onnx', torch.zeros(1, 4), codes=code))\n"
        "for call in calls:\n"
        "    try:\n"
        "        call()\n"
        "    except PinError as err:\n"
        "        print('PinError', err)\n")
    out = run([sys.executable, str(script)], cwd=tmp_path, runner=fork_runner)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 4, out.output
    for line in lines[:2]:
        status, message = line.split(" ", 1)
        assert status == "2" and "|" not in message and "pip install 'lightning-pin[deploy]'" in message, line
    assert all(line.startswith("PinError") and "lightning-pin[deploy]" in line for line in lines[2:]), lines


def test_the_deploy_int8_page_commands_run_as_written(code_run, fork_runner):
    """The page's block line by line in an empty directory: train and export are the module's run, then check and
    faults."""
    root, run_dir, _ = code_run
    for line in page_commands()[2:]:
        result = page_command(line, root, fork_runner)
        assert result.returncode == 0, (line, result.output)
    assert (root / "model.onnx").is_file() and (root / "study" / "fault_curve.csv").is_file()
    assert (run_dir / "pinned.ckpt").is_file()


def test_the_contract_command_as_given_runs_on_the_default_model(tmp_path, fork_runner):
    """``lightning-pin faults --no-retrain --deploy torchao-int8``: stuck code bits by default; the app's CNN keeps its
    convolutions float in torchao, so the faults go into its int8 head, and the output says so."""
    out = tmp_path / "study"
    args = [sys.executable, "-m", "lightning_pin.cli", "faults", "--no-retrain", "--deploy", "torchao-int8",
            "--rates", "0,0.05", "--seeds", "1", "--out", str(out), *TINY]
    result = run(args, cwd=tmp_path, runner=fork_runner, timeout=400)
    assert result.returncode == 0, result.output
    assert "faults in every int8 weight instead" in result.output and "kind=bit" in result.output
    rows = {float(r["rate"]): r for r in csv.DictReader((out / "fault_curve.csv").open())}
    assert rows[0.05]["kind"] == "bit" and int(rows[0.05]["changed_bits"]) > 0
