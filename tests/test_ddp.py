"""DDP on CPU with two processes (``ddp_spawn``): pins are exact after every step on both ranks, and
the ranks stay identical. Each rank writes its snapshots to files that the test process checks.

One ddp_spawn run for the module, and for tests/test_monitor.py's check that the monitor's values agree across the
ranks (the run has a validation set and ``PinMonitor(accuracy=True)``): two interpreters importing torch and
Lightning cost several CPU seconds, the eight steps a fraction of one.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from helpers import StepRecorder, TinyNet, check_pins, flat_index, make_loader, snapshot, trainer
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pin import Pin, PinCallback, PinError, PinMonitor, QuantCode
from lightning_pin.callbacks.metrics import PinDrift, PinViolations, WeightDrift
from lightning_pin.core.engine import StepStats
from lightning_pin.core.plan import fraction_indices

# Under pytest-xdist (make test) every test that starts several processes runs on one worker, one at a time:
# two process groups starting side by side compete for ports and for the two cores.
pytestmark = pytest.mark.xdist_group("processes")

ENC_COORDS = [(0, 0), (5, 7), (11, 2)]
ENC_VALUES = [1.5, -2.0, 0.0]
STUCK_COORDS = [(1, 1), (6, 3), (12, 5)]
BOUNDED_COORDS = [(2, 2), (7, 4)]
CODE_COORDS = [(3, 3), (9, 6)]  # int8 codes: the sign bit stuck at 0, bit 0 at 1
STEPS = 8  # 64 samples, 32 per rank, batches of 8, two epochs


def first_label_is_zero(batch, batch_idx) -> bool:
    """A `when` predicate that the two ranks answer differently on some batches (their data differ)."""
    return bool(batch[1][0] == 0)


def ddp_pins() -> list[Pin]:
    return [
        Pin("encoder.weight", indices=ENC_COORDS, value=ENC_VALUES),
        Pin("head.weight", fraction=0.3, seed=1),  # value=None
        Pin("head.bias"),  # whole-tensor freeze
        Pin("encoder.bias", when=first_label_is_zero),  # per batch, must agree across ranks
        # Fault models: stuck bits (sign at 0, a mantissa bit at 1) and bounded cells.
        Pin("encoder.weight", indices=STUCK_COORDS, stuck_at_zero=0x80000000, stuck_at_one=0x00400000),
        Pin("encoder.weight", indices=BOUNDED_COORDS, bounds=(-0.01, 0.01)),
        Pin("encoder.weight", indices=CODE_COORDS, stuck_at_zero=0x80, stuck_at_one=0x01,
            code=QuantCode(bits=8, scale=2.0**-6)),
    ]


class DDPNet(TinyNet):
    def validation_step(self, batch, batch_idx):
        # Logs only: the monitor runs the model on the validation set itself.
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def teardown(self, stage):
        # Called after the callbacks' teardown (the recorder has written its file by now).
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


class RankRecorder(StepRecorder):
    """StepRecorder that also logs each rank's own `when` answers and writes everything to a file."""

    def __init__(self, out_dir: str):
        super().__init__()
        self.out_dir = out_dir
        self.init: dict = {}
        self.own_hits: list[bool] = []

    def on_fit_start(self, trainer, pl_module):
        self.init = snapshot(pl_module)
        super().on_fit_start(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.own_hits.append(first_label_is_zero(batch, batch_idx))

    def teardown(self, trainer, pl_module, stage):
        super().teardown(trainer, pl_module, stage)
        torch.save(
            {
                "world_size": trainer.world_size,
                "init": self.init,
                "steps": [(r["step"], r["params"]) for r in self.steps],
                "own_hits": self.own_hits,
                "final": snapshot(pl_module),
            },
            Path(self.out_dir) / f"rank{trainer.global_rank}.pt",
        )


class RankResults(Callback):
    """Writes this rank's monitor results, and metrics fed with rank-dependent values, to a file
    (for tests/test_monitor.py)."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        monitor = next(cb for cb in trainer.callbacks if isinstance(cb, PinCallback)).monitor
        rank = trainer.global_rank
        drift = PinDrift()
        stats = StepStats(torch.tensor(rank + 1.0), torch.tensor(4.0 * (rank + 1)), 2 * (rank + 1), torch.tensor(0))
        drift.update(stats)
        violations = PinViolations()
        violations.update(torch.tensor(3 * rank))
        weights = WeightDrift(["net"])
        weights.update(torch.tensor([8.0 + 2.0 * rank]), torch.tensor([36.0]))  # replicas: mean
        synced = {
            "drift": {k: v.item() for k, v in drift.compute().items()},
            "violations": violations.compute().item(),
            "weight_drift": {k: v.reshape(-1).tolist() for k, v in weights.compute().items()},
        }
        path = Path(self.out_dir) / f"results{rank}.json"
        path.write_text(json.dumps({"world_size": trainer.world_size, "results": monitor.results(), "synced": synced}))


def learnable_loader(n: int, seed: int, batch_size: int = 8) -> DataLoader:
    """Labels are the argmax of the first three features (the monitor's validation set)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, x[:, :3].argmax(1)), batch_size=batch_size, shuffle=False)


class DDPRun(NamedTuple):
    ranks: list[dict]  # what each rank recorded (RankRecorder)
    returned: dict  # the weights ddp_spawn handed back to the test process
    callback: PinCallback
    model: DDPNet
    results: list[dict]  # each rank's monitor results and synced metrics (RankResults)
    before: DDPNet  # a copy of the model before the fit
    val: DataLoader


#: The run, once per test process: tests/test_monitor.py's DDP test imports the fixture below.
_RUN: dict[str, DDPRun] = {}


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> DDPRun:
    if not _RUN:
        out = tmp_path_factory.mktemp("ddp")
        torch.manual_seed(0)
        model = DDPNet()
        before = copy.deepcopy(model)
        # 64 training samples (32 per rank, 4 steps per epoch); 32 validation samples, 16 per rank.
        val = learnable_loader(32, seed=2)
        cb = PinCallback(ddp_pins(), verbose=False, monitor=PinMonitor(accuracy=True))
        tr = trainer(
            strategy="ddp_spawn",
            accelerator="cpu",
            devices=2,
            max_epochs=2,
            log_every_n_steps=2,
            callbacks=[cb, RankRecorder(str(out)), RankResults(str(out))],
        )
        tr.fit(model, make_loader(), val)
        ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]
        results = [json.loads((out / f"results{r}.json").read_text()) for r in range(2)]
        _RUN["run"] = DDPRun(ranks, snapshot(model), cb, model, results, before, val)
    return _RUN["run"]


def expected(init: dict) -> dict:
    head = fraction_indices("head.weight", 48, 0.3, 1)
    return {
        "encoder.weight": (flat_index((16, 8), ENC_COORDS), torch.tensor(ENC_VALUES)),
        "head.weight": (head, init["head.weight"].reshape(-1)[head]),
        "head.bias": (None, init["head.bias"]),
    }


def test_ddp_pins_exact_on_both_ranks_after_every_step(ddp_run):
    ranks = ddp_run.ranks
    for rank, data in enumerate(ranks):
        assert data["world_size"] == 2
        assert [s for s, _ in data["steps"]] == list(range(STEPS))
        want = expected(data["init"])
        for step, params in data["steps"]:
            check_pins(params, want, f"on rank {rank} after step {step}")
        check_pins(data["final"], want, f"on rank {rank} at the end")
        # The free elements trained.
        assert not torch.equal(data["final"]["encoder.weight"], data["init"]["encoder.weight"])


def test_ddp_faults_hold_on_both_ranks_after_every_step(ddp_run):
    stuck, bounded = flat_index((16, 8), STUCK_COORDS), flat_index((16, 8), BOUNDED_COORDS)
    for rank, data in enumerate(ddp_run.ranks):
        for step, params in [*data["steps"], ("end", data["final"])]:
            bits = params["encoder.weight"].reshape(-1)[stuck].view(torch.int32)
            assert torch.equal(bits & -(2**31), torch.zeros_like(bits)), f"sign bit on rank {rank} after step {step}"
            assert torch.equal(bits & 0x00400000, torch.full_like(bits, 0x00400000)), f"rank {rank}, step {step}"
            assert bool((params["encoder.weight"].reshape(-1)[bounded].abs() <= 0.01).all()), f"rank {rank}, {step}"
        # The free bits of the bit-pinned elements trained.
        final, init = (data[k]["encoder.weight"].reshape(-1)[stuck].view(torch.int32) for k in ("final", "init"))
        moved = final ^ init
        assert bool(((moved & ~(-(2**31) | 0x00400000)) != 0).all())


def test_ddp_codes_hold_on_both_ranks_after_every_step(ddp_run):
    coded = flat_index((16, 8), CODE_COORDS)
    for rank, data in enumerate(ddp_run.ranks):
        for step, params in [*data["steps"], ("end", data["final"])]:
            w = params["encoder.weight"].reshape(-1)[coded]
            q = torch.round(w / 2.0**-6)
            assert torch.equal(w, q * 2.0**-6), f"off the code's grid on rank {rank} after step {step}"
            pattern = q.long() & 0xFF
            assert torch.equal(pattern & 0x81, torch.ones_like(pattern)), f"stuck code bits on rank {rank}, {step}"


def test_ddp_ranks_identical_after_every_step(ddp_run):
    ranks, main_model = ddp_run.ranks, ddp_run.returned
    zero, one = ranks
    for name in zero["init"]:
        assert torch.equal(zero["init"][name], one["init"][name])
    for (step, a), (_, b) in zip(zero["steps"], one["steps"]):
        for name in a:
            assert torch.equal(a[name], b[name]), f"{name} differs between ranks after step {step}"
    for name in zero["final"]:
        assert torch.equal(zero["final"][name], one["final"][name])
        # ddp_spawn hands rank 0's weights back to the test process.
        assert torch.equal(main_model[name], zero["final"][name])


def test_ddp_when_pin_active_if_any_rank_asks(ddp_run):
    ranks = ddp_run.ranks
    zero, one = ranks
    hits = [a or b for a, b in zip(zero["own_hits"], one["own_hits"])]
    assert len(hits) == STEPS
    # The ranks disagree on some batch, so this really exercises the cross-rank agreement.
    assert zero["own_hits"] != one["own_hits"]
    assert not all(hits) and any(hits)
    for data in ranks:
        before = data["init"]["encoder.bias"]
        for (step, params), hit in zip(data["steps"], hits):
            now = params["encoder.bias"]
            if hit:
                assert torch.equal(now, before), f"encoder.bias moved on frozen step {step}"
            else:
                assert not torch.equal(now, before), f"encoder.bias did not train on step {step}"
            before = now


def test_verify_in_main_process_after_ddp_spawn(ddp_run):
    """The callback in the test process never ran a hook; verify() still checks the returned weights."""
    cb, model = ddp_run.callback, ddp_run.model
    cb.verify(model)
    with torch.no_grad():
        old = model.encoder.weight[5, 7].clone()
        model.encoder.weight[5, 7] = 1.0  # pinned to -2.0
    try:
        with pytest.raises(PinError, match=r"encoder\.weight.*\(5, 7\)"):
            cb.verify(model)
    finally:
        with torch.no_grad():
            model.encoder.weight[5, 7] = old
    cb.verify(model)

