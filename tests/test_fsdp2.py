"""FSDP2 (ModelParallelStrategy + fully_shard) on 2 CPU processes: pins exact (stuck bits and
bounds held) on every rank's shards after every step, resume from a distributed checkpoint, mismatched plans refused.

The runs live in tests/fsdp2_worker.py: ModelParallelStrategy launches its second rank by
re-running the command, so the runs are a subprocess of their own: all three modes, one after the other, in
one pair of processes (a start-up of two interpreters costs more than the runs). Rank 0 is forked from the fork
runner's server (tests/fork_runner.py), which has torch and Lightning imported already; rank 1, the command re-run,
is a fresh interpreter.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from lightning_pin.core.plan import fraction_indices

# Under pytest-xdist (make test) every test that starts several processes runs on one worker, one at a time:
# two process groups starting side by side compete for ports and for the two cores.
pytestmark = pytest.mark.xdist_group("processes")

WORKER = Path(__file__).with_name("fsdp2_worker.py")
ELEMENTS = [((0, 0), 25.0), ((9, 3), 5.0), ((15, 7), -0.5)]
STUCK_ROWS, STUCK_COLS = torch.tensor([2, 10, 14]), torch.tensor([1, 5, 0])


def assert_faults_hold(params: dict, where: str) -> None:
    bits = params["a.weight"][STUCK_ROWS, STUCK_COLS].contiguous().view(torch.int32)
    assert torch.equal(bits & -(2**31), torch.zeros_like(bits)), f"a sign bit stuck at 0 reads 1 {where}"
    assert torch.equal(bits & 0x00400000, torch.full_like(bits, 0x00400000)), f"a stuck mantissa bit {where}"
    assert bool((params["c.weight"].abs() <= 0.05).all()), f"c.weight out of bounds {where}"
    assert bool((params["c.bias"][[0, 2]] >= 0).all()), f"c.bias below 0 {where}"


MODES = ("train", "resume", "mismatch")


def run(out_dir: Path, modes: tuple[str, ...], fork_runner) -> dict[str, list[dict]]:
    # The repository on the path (tests/conftest.py already put tests/lean_imports there: lean ranks).
    path = [str(WORKER.parent.parent), os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)))
    done = fork_runner.run([sys.executable, str(WORKER), str(out_dir), ",".join(modes)], cwd=out_dir, env=env,
                           timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {mode: [torch.load(out_dir / f"{mode}-rank{r}.pt", weights_only=True) for r in (0, 1)] for mode in modes}


@pytest.fixture(scope="module")
def all_runs(tmp_path_factory, fork_runner):
    return run(tmp_path_factory.mktemp("fsdp2"), MODES, fork_runner)


@pytest.fixture(scope="module")
def runs(all_runs):
    return all_runs["train"], all_runs["resume"]


def step_records(rank: dict) -> list[dict]:
    # The recorder also snapshots the first batch of an accumulation window (before any step).
    return rank["steps"][1:]


def test_train_pins_exact_on_every_rank_after_every_step(runs):
    train, _ = runs
    bias_index = fraction_indices("a.bias", 16, 0.5, 3)
    for rank in train:
        assert rank["outcome"] == "ok" and rank["verified"] == "ok"
        start, steps = rank["start"], step_records(rank)
        assert len(steps) == 4
        for params in steps:
            for (i, j), value in ELEMENTS:
                assert params["a.weight"][i, j].item() == value
            assert torch.equal(params["a.bias"][bias_index], start["a.bias"][bias_index])
            assert torch.equal(params["b.weight"], start["b.weight"])
            assert torch.equal(params["b.bias"], start["b.bias"])
            assert_faults_hold(params, "after a step")
        # The free elements trained, and so did the free bits of the bit-pinned ones.
        moved = steps[-1]["a.weight"][STUCK_ROWS, STUCK_COLS].view(torch.int32) ^ start["a.weight"][
            STUCK_ROWS, STUCK_COLS
        ].view(torch.int32)
        assert bool(((moved & ~(-(2**31) | 0x00400000)) != 0).all())
        free = torch.ones(16, dtype=torch.bool)
        free[bias_index] = False
        assert not torch.equal(steps[-1]["a.bias"][free], start["a.bias"][free])
        assert not torch.equal(steps[-1]["c.weight"], start["c.weight"])
    # Both ranks hold the same full parameters after every step.
    for mine, theirs in zip(step_records(train[0]), step_records(train[1])):
        for name in mine:
            assert torch.equal(mine[name], theirs[name])


def test_resume_from_distributed_checkpoint_keeps_targets(runs):
    train, resume = runs
    before = step_records(train[0])[-1]
    saved = train[0]["state"]["pins"]
    bias_index = saved[1]["a.bias"]["index"]
    # The saved targets are the full-tensor values captured at activation in the first run.
    assert torch.equal(saved[1]["a.bias"]["target"], train[0]["start"]["a.bias"][bias_index])
    for rank in resume:
        assert rank["outcome"] == "ok" and rank["verified"] == "ok"
        steps = step_records(rank)
        assert len(steps) == 4  # steps 5..8 after resuming at step 4
        for params in steps:
            for (i, j), value in ELEMENTS:
                assert params["a.weight"][i, j].item() == value
            assert torch.equal(params["a.bias"][bias_index], saved[1]["a.bias"]["target"])
            assert torch.equal(params["b.weight"], before["b.weight"])
            assert_faults_hold(params, "after a resumed step")
        assert not torch.equal(steps[-1]["c.weight"], before["c.weight"])


def test_mismatched_plans_across_ranks_are_refused(all_runs):
    for rank in all_runs["mismatch"]:
        assert rank["outcome"].startswith("PinError: the ranks resolved different pins")
        assert rank["steps"] == []
