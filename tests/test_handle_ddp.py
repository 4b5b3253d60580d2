"""``pin()`` under plain ``torch.nn.parallel.DistributedDataParallel``: two CPU processes (gloo),
different data on each rank. Pins are exact on both ranks after every step, the ranks stay
identical, and a ``when`` pin that holds on one rank's batch holds on both (the handle ORs the
decision across ranks). Each rank writes what it saw to a file the test process checks.

One spawn for the module; this file imports neither Lightning nor the test helpers, so the
spawned processes start fast.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_pin import Pin, PinError, pin
from lightning_pin.core.plan import fraction_indices

# Under pytest-xdist (make test) every test that starts several processes runs on one worker, one at a time:
# two process groups starting side by side compete for ports and for the two cores.
pytestmark = pytest.mark.xdist_group("processes")

STEPS = 6
ENC_COORDS = [(0, 0), (5, 7), (11, 2)]
ENC_FLAT = torch.tensor([0, 5 * 8 + 7, 11 * 8 + 2])
ENC_VALUES = [1.5, -2.0, 0.0]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.relu(self.encoder(x)))


def first_label_is_zero(batch, batch_idx) -> bool:
    """A per-batch `when` that the ranks answer differently (their data differ)."""
    return bool(batch[1][0] == 0)


def ddp_pins() -> list[Pin]:
    return [
        Pin("encoder.weight", indices=ENC_COORDS, value=ENC_VALUES),
        Pin("head.weight", fraction=0.3, seed=1),  # value=None
        Pin("head.bias"),  # whole tensor
        Pin("encoder.bias", when=first_label_is_zero),  # per batch, ORed across ranks
    ]


def rank_batches(rank: int) -> list:
    g = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(STEPS)]


def snap(module: nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)  # the same initial weights on both ranks (DDP broadcasts rank 0's anyway)
        net = Net()
        model = DistributedDataParallel(net)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        handle = pin(model, optimizer, ddp_pins())
        record = {"init": snap(net), "steps": [], "own_hits": [], "pinned_grads": []}
        for batch_idx, batch in enumerate(rank_batches(rank)):
            handle.batch_start(batch, batch_idx)
            record["own_hits"].append(first_label_is_zero(batch, batch_idx))
            x, y = batch
            nn.functional.cross_entropy(model(x), y).backward()
            # After backward, DDP's all-reduce included: the pinned grads are still exactly zero.
            record["pinned_grads"].append(
                torch.cat(
                    [
                        net.encoder.weight.grad.reshape(-1)[ENC_FLAT],
                        net.head.bias.grad,
                        net.encoder.bias.grad if record["own_hits"][-1] else torch.zeros(0),
                    ]
                )
            )
            optimizer.step()
            optimizer.zero_grad()
            record["steps"].append(snap(net))
        handle.verify()
        record["step"] = handle.step
        handle.remove()
        # The compiled step (compile_step=True) under DDP, pinned gradients left to the step.
        torch.manual_seed(0)
        net2 = Net()
        model2 = DistributedDataParallel(net2)
        optimizer2 = torch.optim.AdamW(model2.parameters(), lr=0.05, weight_decay=0.1)
        with pin(model2, optimizer2, [Pin("encoder.weight", fraction=0.5, seed=3)], compile_step=True,
                 zero_pinned_grads=False) as handle2:
            record["compiled_init"] = snap(net2)
            record["compiled_steps"] = []
            for x, y in rank_batches(rank)[:4]:
                nn.functional.cross_entropy(model2(x), y).backward()
                optimizer2.step()
                optimizer2.zero_grad()
                record["compiled_steps"].append(snap(net2))
            handle2.verify()
            record["compiled_driver"] = type(optimizer2.__dict__["step"]).__name__
        # Ranks that resolve different pins, and a rank that rejects its spec: every rank raises.
        record["refused"] = []
        for pins in (
            [Pin("head.bias", value=0.0 if rank == 0 else 1.0)],
            [Pin("head.bias") if rank == 0 else Pin("head.bais")],
        ):
            before = snap(net)
            try:
                pin(model, optimizer, pins)
                record["refused"].append("")
            except PinError as err:
                record["refused"].append(str(err))
            unchanged = all(torch.equal(v, before[n]) for n, v in snap(net).items())
            hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in net.parameters())
            record["refused"][-1] += f" | unchanged={unchanged} hooks={hooks}"
        torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("handle_ddp")
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def test_pins_exact_on_both_ranks_after_every_step(ranks):
    head = fraction_indices("head.weight", 48, 0.3, 1)
    for rank, data in enumerate(ranks):
        init = data["init"]
        assert data["step"] == STEPS and len(data["steps"]) == STEPS
        for step, params in enumerate(data["steps"]):
            where = f"on rank {rank} after step {step}"
            assert torch.equal(params["encoder.weight"].reshape(-1)[ENC_FLAT], torch.tensor(ENC_VALUES)), where
            assert torch.equal(params["head.weight"].reshape(-1)[head], init["head.weight"].reshape(-1)[head]), where
            assert torch.equal(params["head.bias"], init["head.bias"]), where
        for grads in data["pinned_grads"]:
            assert torch.equal(grads, torch.zeros_like(grads))
        assert not torch.equal(data["steps"][-1]["encoder.weight"], init["encoder.weight"])  # the rest trained


def test_ranks_identical_after_every_step(ranks):
    zero, one = ranks
    for name in zero["init"]:
        assert torch.equal(zero["init"][name], one["init"][name])
    for step, (a, b) in enumerate(zip(zero["steps"], one["steps"])):
        for name in a:
            assert torch.equal(a[name], b[name]), f"{name} differs between ranks after step {step}"


def test_when_pin_holds_if_any_rank_asks(ranks):
    zero, one = ranks
    # The ranks disagree on some batch, so this exercises the agreement across ranks.
    assert zero["own_hits"] != one["own_hits"]
    hits = [a or b for a, b in zip(zero["own_hits"], one["own_hits"])]
    assert any(hits) and not all(hits)
    for data in ranks:
        before = data["init"]["encoder.bias"]
        for step, (params, hit) in enumerate(zip(data["steps"], hits)):
            now = params["encoder.bias"]
            assert torch.equal(now, before) == hit, f"encoder.bias on step {step}: hit={hit}"
            before = now


def test_every_rank_refuses_pins_that_differ_or_that_one_rank_rejects(ranks):
    zero, one = ranks
    differ, rejected = zip(zero["refused"], one["refused"])
    for message in differ:
        assert "the ranks resolved different pins" in message and message.endswith("unchanged=True hooks=0")
    assert "another rank rejected its pins" in rejected[0] and rejected[0].endswith("unchanged=True hooks=0")
    assert "head.bais" in rejected[1] and rejected[1].endswith("unchanged=True hooks=0")


def test_the_compiled_step_holds_pins_on_both_ranks_and_keeps_them_identical(ranks):
    held = fraction_indices("encoder.weight", 128, 0.5, 3)
    zero, one = ranks
    for data in ranks:
        assert data["compiled_driver"] == "CompiledStep"
        init = data["compiled_init"]["encoder.weight"].reshape(-1)[held]
        for step, params in enumerate(data["compiled_steps"]):
            assert torch.equal(params["encoder.weight"].reshape(-1)[held], init), step
        assert not torch.equal(data["compiled_steps"][-1]["head.weight"], data["compiled_init"]["head.weight"])
    for a, b in zip(zero["compiled_steps"], one["compiled_steps"]):
        for name in a:
            assert torch.equal(a[name], b[name]), name
