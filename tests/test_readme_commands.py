"""Doc commands that must work where the docs put them: `lightning-pin report` right after `make demo`
(docs/how-to/monitor.md; the app's runs are under outputs/), the "Installed as a package" install
(docs/getting-started.md), which must give up on an unreachable CPU index within seconds and fall back to the
default one, and the Hugging Face tutorial's ResNet and BERT on fake data (docs/tutorials/hf-transformer.md)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_train_app import TINY, run

from lightning_pin import cli

ROOT = Path(__file__).resolve().parents[1]
MONITOR = (ROOT / "docs" / "how-to" / "monitor.md").read_text()
GETTING_STARTED = (ROOT / "docs" / "getting-started.md").read_text()
#: The README's own-model section's real networks on fake data, before the docs site.
HF_TUTORIAL = (ROOT / "docs" / "tutorials" / "hf-transformer.md").read_text()


def bash_blocks(text: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^```bash\n(.*?)^```$", text, re.M | re.S)]


def test_report_right_after_the_demo_reads_the_demos_run(tmp_path, fork_runner, monkeypatch, capsys):
    # make demo is `python -m lightning_pin.train`: its run goes to outputs/<date>/<time>/ of the directory it runs in.
    demo = run([sys.executable, "-m", "lightning_pin.train", *TINY], cwd=tmp_path, runner=fork_runner)
    assert demo.returncode == 0, demo.output
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    (line,) = [line for block in bash_blocks(MONITOR) for line in block.splitlines() if line.startswith("lightning-pin report")]
    command = shlex.split(line.split("#")[0])
    monkeypatch.chdir(tmp_path)
    assert cli.main(command[1:]) == 0, capsys.readouterr().err
    # Into the run directory, where the run's own report is (not into its csv/pinned/ subdirectory).
    assert not list((tmp_path / "outputs").rglob("csv/pinned/pin_report.json"))
    rebuilt = json.loads((run_dir / "pin_report.json").read_text())
    assert rebuilt["final"] == json.loads((run_dir / "run_summary.json").read_text())["final"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_package_install_falls_back_to_the_default_index_when_the_cpu_one_is_unreachable(tmp_path):
    start = GETTING_STARTED.index("Installed as a package instead")
    (block,) = [b for b in bash_blocks(GETTING_STARTED) if GETTING_STARTED.index(b) > start][:1]
    # pip stands in for the real one: the CPU index cannot be reached, every other install succeeds.
    stub = 'pip() { echo "$*" >> calls; case "$*" in *whl/cpu*) return 1;; esac; }\n'
    result = subprocess.run(["bash", "-e", "-c", stub + block], cwd=tmp_path, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 3, calls
    assert "--timeout 5 --retries 0" in calls[0] and "https://download.pytorch.org/whl/cpu" in calls[0]
    assert calls[1] == "install torch" and calls[2] == "install .[app]"
    # The same short timeout and no retries as `make install`'s probe.
    assert "--timeout 5 --retries 0" in (ROOT / "Makefile").read_text()


def test_the_real_networks_on_fake_data_run_as_written(tmp_path, fork_runner):
    """The tutorial's transformers ResNet on data=fake_images and BERT on data=fake_text, end to end."""
    pytest.importorskip("transformers")
    pytest.importorskip("onnx")
    (block,) = [b for b in bash_blocks(HF_TUTORIAL) if "model=hf" in b]
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) == 4 and "model_type: resnet" in lines[0] and "model_type: bert" in lines[2]
    for line in lines:
        for part in line.split("&&"):
            args = shlex.split(part)
            assert args[0] == "lightning-pin"
            command = ["train", *args[2:]] if args[1] == "train" else args[1:]
            result = run([sys.executable, "-m", "lightning_pin.cli", *command], cwd=tmp_path, runner=fork_runner)
            assert result.returncode == 0, (part, result.output[-3000:])
    resnet = json.loads((tmp_path / "resnet" / "run_summary.json").read_text())
    assert resnet["pins_exact"] is True and resnet["baseline"] > 0.2  # 10 classes: chance is 0.1
    with open(tmp_path / "resnet_faults" / "fault_curve.csv") as file:
        rows = file.read().splitlines()
    assert len(rows) == 5  # a header and two seeds at two rates
    assert "OK: every pin holds" in result.output  # check, the last command
