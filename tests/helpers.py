"""Small models, data and recorders shared by the tests (module level, so ddp_spawn can pickle them)."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path
from types import ModuleType

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pin.core.kinds.stuck_bits import BITS_DTYPES
from lightning_pin.core.sharding import DENSE_FRACTION


def make_loader(n: int = 64, features: int = 8, classes: int = 3, batch_size: int = 8, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


class TinyNet(L.LightningModule):
    """A two-layer MLP; the optimizer is chosen by a factory so tests can sweep them."""

    def __init__(self, optimizer_factory=None, features: int = 8, hidden: int = 16, classes: int = 3):
        super().__init__()
        self.encoder = nn.Linear(features, hidden)
        self.head = nn.Linear(hidden, classes)
        self.optimizer_factory = optimizer_factory

    def forward(self, x):
        return self.head(torch.relu(self.encoder(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        if self.optimizer_factory is None:
            return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)
        return self.optimizer_factory(self.parameters())


def trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)


# --------------------------------------------------------------------------------------------
def with_specials(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values of ``dtype`` with inf, -inf, NaNs of two payloads and -0.0 sprinkled in: the words a mask or a
    restore must carry or overwrite bit for bit."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator).to(dtype)
    word = BITS_DTYPES[dtype]
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0], dtype=dtype).view(word)
    specials = torch.cat([specials, specials[2:3] + 1])  # a NaN of another payload
    at = torch.randint(0, numel, (max(1, numel // 4),), generator=generator)
    values.view(word)[at] = specials[torch.arange(at.numel()) % specials.numel()]
    return values


def dense_index(numel: int, fraction: float, seed: int) -> torch.Tensor:
    """Sorted int32 positions of ``fraction`` of ``numel`` elements, at least DENSE_FRACTION of them: a pin that a
    dense pass (the gradient mask's, the CPU restore's) serves."""
    count = max(math.ceil(DENSE_FRACTION * numel), min(numel, round(fraction * numel)))
    return torch.randperm(numel, generator=torch.Generator().manual_seed(seed))[:count].sort().values.int()


class TanhStack(nn.Module):
    """``layers`` Linear(8, 8) layers with tanh between them: a plain loop's model of several small weights."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


# Integration-test helpers (trainer paths, resume, DDP): snapshots, a step recorder, pin checks.


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU clones of every named parameter."""
    return {name: p.detach().cpu().clone() for name, p in module.named_parameters()}


def flat_index(shape, coords) -> torch.Tensor:
    """Row-major flat indices of element coordinates (list of tuples) in a tensor of ``shape``."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return torch.tensor([sum(c * s for c, s in zip(row, strides)) for row in coords], dtype=torch.int64)


def check_pins(params: dict, expected: dict, where: str = "") -> None:
    """Assert bit-exact pinned values. ``expected``: name -> (flat index or None for whole, values)."""
    for name, (index, values) in expected.items():
        flat = params[name].detach().reshape(-1)
        actual = flat if index is None else flat[index]
        assert torch.equal(actual, values.reshape(-1).to(actual.dtype)), (
            f"{name} off target {where}: {actual.tolist()} != {values.reshape(-1).tolist()}"
        )


class StepRecorder(L.Callback):
    """Snapshots every parameter right after every real optimizer step.

    The snapshot is taken from a torch step post-hook registered in ``on_fit_start``. Hooks run in
    registration order and callbacks in list order, so put this callback AFTER the PinCallback:
    the snapshot then sees the values after the pin's own post-hook restored them. A step that
    the grad scaler skips fires no post-hook and leaves no record.
    """

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self._handles: list = []

    def on_fit_start(self, trainer, pl_module) -> None:
        for i, optimizer in enumerate(trainer.optimizers):
            self._handles.append(optimizer.register_step_post_hook(self._hook(trainer, i)))

    def _hook(self, trainer, opt_idx):
        def hook(optimizer, args, kwargs):
            self.steps.append(
                {
                    "step": trainer.global_step,
                    "opt": opt_idx,
                    "lr": optimizer.param_groups[0]["lr"],
                    "params": snapshot(trainer.lightning_module),
                }
            )

        return hook

    def teardown(self, trainer, pl_module, stage) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def first_label_is_zero(batch, batch_idx) -> bool:
    """A per-batch `when` that DDP ranks answer differently (their data differ); importable by
    path as ``"helpers.first_label_is_zero"`` in spawned processes."""
    return bool(batch[1][0] == 0)


def benchmark(name: str) -> ModuleType:
    """The module ``benchmarks/<name>.py`` (the benchmarks folder is not a package)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
