"""``lightning-pin faults --remap`` (``pin.remap=true``): each job maps the pretrained model onto its faults
before the forced accuracy, retrains, saves remap.pt; the CSV's damage columns; ``--no-retrain`` maps before
the forced accuracy and unmaps exactly; the same faults with and without the mapping; refusals exit 2."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from lightning_pin import cli
from lightning_pin.faults import FaultMapping

TINY = ["pretrain.max_epochs=1", "trainer.max_epochs=1", "trainer.limit_train_batches=4", "data.batch_size=128",
        "callbacks.pin_callback.verbose=false", "callbacks.pin_callback.monitor.report=false",
        "pin.sa1_fraction=0.0"]


def faults(*args: str) -> int:
    return cli.main(["faults", *args])


def rows(directory: Path) -> list[dict[str, str]]:
    with open(directory / "fault_curve.csv", newline="") as file:
        return list(csv.DictReader(file))


@pytest.fixture(scope="module")
def mapped(tmp_path_factory):
    out = tmp_path_factory.mktemp("remap")
    status = faults("--kind", "cell", "--remap", "--rates", "0,0.3", "--seeds", "1", "--out", str(out), *TINY)
    assert status == 0, (out / "study.log").read_text()[-3000:]
    return out


def test_each_job_maps_retrains_and_saves_its_mapping(mapped, capsys) -> None:
    table = rows(mapped)
    assert [float(r["rate"]) for r in table] == [0.0, 0.3]
    control, faulty = table
    assert float(control["damage_before"]) == 0.0 and float(control["remap_seconds"]) == 0.0
    assert 0 < float(faulty["damage_after"]) < float(faulty["damage_before"])  # SA0 cells: small weights moved on
    assert float(faulty["remap_seconds"]) > 0 and faulty["pins_exact"] == "true"
    job = Path(faulty["job_dir"])
    mapping = FaultMapping.from_state_dict(torch.load(job / "remap.pt", weights_only=True))
    assert mapping.perms and mapping.cost_after == pytest.approx(float(faulty["damage_after"]))
    # the retrained, mapped model's weights hold its pins (a study job keeps its pin state and pinned weights):
    # lightning-pin check agrees
    capsys.readouterr()
    assert cli.main(["check", str(job / "pins.pt"), str(job / "pinned.safetensors")]) == 0, capsys.readouterr()


def test_same_faults_with_or_without_the_mapping_and_no_retrain(mapped, tmp_path) -> None:
    ckpt = mapped / "baseline" / "pretrained.ckpt"
    plain = tmp_path / "plain"
    assert faults("--kind", "cell", "--rates", "0.3", "--seeds", "1", "--out", str(plain), f"ckpt_path={ckpt}",
                  *TINY) == 0
    ours, theirs = (torch.load(Path(rows(d)[-1]["job_dir"]) / "fault_map.pt", weights_only=True)
                    for d in (mapped, plain))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k].view(torch.uint8), theirs[k].view(torch.uint8)) if ours[k].is_floating_point()
               else torch.equal(ours[k], theirs[k]) for k in ours)
    assert rows(plain)[0]["damage_before"] == ""  # not mapped: no damage columns filled
    # --no-retrain --remap: mapped before the forced accuracy, unmapped bit for bit after each draw
    forced = tmp_path / "forced"
    assert faults("--kind", "cell", "--remap", "--no-retrain", "--rates", "0.3", "--seeds", "2", "--out",
                  str(forced), f"ckpt_path={ckpt}", *TINY) == 0
    table = rows(forced)
    assert all(float(r["damage_after"]) < float(r["damage_before"]) for r in table)
    unmapped = tmp_path / "unmapped"
    assert faults("--kind", "cell", "--no-retrain", "--rates", "0.3", "--seeds", "2", "--out", str(unmapped),
                  f"ckpt_path={ckpt}", *TINY) == 0
    assert [r["changed_bits"] for r in rows(unmapped)] != [] and rows(unmapped)[0]["damage_before"] == ""


@pytest.mark.parametrize("kind", ["flip", "neuron"])
def test_remap_of_a_kind_it_cannot_map_exits_2_in_one_line(kind, tmp_path, capsys) -> None:
    assert faults("--kind", kind, "--remap", "--out", str(tmp_path / "x")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--remap" in err[0] and f"--kind {kind}" in err[0]
    assert not (tmp_path / "x").exists()


def test_remap_with_a_deployed_int8_campaign_exits_2_in_one_line(tmp_path, capsys) -> None:
    assert faults("--deploy", "torchao-int8", "--no-retrain", "--remap", "--out", str(tmp_path / "x")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--remap" in err[0] and "--deploy torchao-int8" in err[0]
    assert not (tmp_path / "x").exists()


def test_the_benchmark_reports_its_ratios(tmp_path, fork_runner) -> None:
    """benchmarks/remap.py --quick runs end to end (1 seed, two settings): no ratio asserted but the damage's."""
    import json
    import sys

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "remap.py"
    out = tmp_path / "remap.json"
    done = fork_runner.run([sys.executable, str(bench), "--quick", "--json", str(out)], cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    table = json.loads(out.read_text())["table"]
    assert set(table) == {"cells 30% 1:1", "stuck bits 1e-3"}
    for row in table.values():
        assert row["damage l2"] <= 1.0 and row["weights changed"] is not None and row["map time / epoch"] > 0
    assert "damage l2" in done.stdout
