"""FSDP2 runs for tests/test_fsdp2.py: ``python tests/fsdp2_worker.py OUT_DIR MODE[,MODE...]``.

ModelParallelStrategy launches its ranks by re-running this command, so it is a script, not a
test module. Each rank writes what it saw to ``OUT_DIR/<mode>-rank<r>.pt``; the test reads them.
Several modes run one after the other in the same two processes (the first fit launches rank 1,
later fits find it running): one start-up of two interpreters for all of them.

Modes:
- ``train``: element, fraction and whole-tensor pins, stuck bits and bounds, under AdamW with weight decay and gradient
  accumulation; record the full parameters after every optimizer step; save a distributed
  checkpoint at the end.
- ``resume``: a re-initialised model resumes from that checkpoint and trains on.
- ``mismatch``: rank 1 holds a different plan than rank 0 (must fail at fit start).
"""

from __future__ import annotations

import math
import os
import sys

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_pin import Pin, PinCallback, PinError

PINS = [
    Pin("a.weight", indices=[(0, 0), (9, 3), (15, 7)], value=[25.0, 5.0, -0.5]),
    Pin("a.bias", fraction=0.5, seed=3),  # current values
    Pin("b.*"),  # whole tensors, under FSDP2 with zeroed (not dropped) grads
    # Fault models on shards: stuck bits on rows of both shards, bounds on a whole sharded tensor
    # and on elements of a bias split 2 + 1.
    Pin("a.weight", indices=[(2, 1), (10, 5), (14, 0)], stuck_at_zero=0x80000000, stuck_at_one=0x00400000),
    Pin("c.weight", bounds=(-0.05, 0.05)),
    Pin("c.bias", indices=[0, 2], bounds=(0.0, math.inf)),
]


class ShardedNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 3)

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.a, self.b, self.c):
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.c(torch.relu(self.b(torch.relu(self.a(x))))), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)


class Recorder(L.Callback):
    """Full parameters after every optimizer step (``full_tensor`` is a collective: all ranks)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []
        self.last_step = -1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.last_step:
            self.last_step = trainer.global_step
            self.steps.append({n: p.full_tensor().detach().clone() for n, p in pl_module.named_parameters()})

    def on_train_start(self, trainer, pl_module):
        self.start = {n: p.full_tensor().detach().clone() for n, p in pl_module.named_parameters()}


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def main(out_dir: str, mode: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0 if mode != "resume" else 123)
    pins = list(PINS)
    if mode == "mismatch" and int(os.environ.get("LOCAL_RANK", "0")) == 1:
        pins[0] = Pin("a.weight", indices=[(0, 0), (9, 3), (15, 7)], value=[25.0, 5.0, 0.5])
    callback = PinCallback(pins, verbose=False)
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=4 if mode != "resume" else 8,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback, recorder],
    )
    model = ShardedNet()
    outcome = "ok"
    try:
        trainer.fit(model, data(), ckpt_path=os.path.join(out_dir, "ckpt") if mode == "resume" else None)
    except PinError as err:
        outcome = f"PinError: {err}"
    if mode == "train":
        trainer.save_checkpoint(os.path.join(out_dir, "ckpt"))
    verified = "skipped"
    if outcome == "ok":
        try:
            callback.verify(model)
            verified = "ok"
        except PinError as err:
            verified = f"PinError: {err}"
    rank = trainer.global_rank
    torch.save(
        {
            "outcome": outcome,
            "verified": verified,
            "start": getattr(recorder, "start", None),
            "steps": recorder.steps,
            "state": callback.state_dict() if rank == 0 else None,
        },
        os.path.join(out_dir, f"{mode}-rank{rank}.pt"),
    )
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    for number, each in enumerate(sys.argv[2].split(",")):
        if number:
            # Each fit's process group on a port of its own (both ranks count alike): a rank that starts the
            # next fit first must not reach the store of the one the other rank is still tearing down.
            os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)
        main(sys.argv[1], each)
