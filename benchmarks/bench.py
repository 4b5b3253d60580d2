"""What pinning costs: step time, memory and set-up, measured side by side in one run.

    python benchmarks/bench.py            # the full table (about 5-8 minutes on 2 CPU cores)
    python benchmarks/bench.py --quick    # a small model, for CI (under a minute)

Every figure is a ratio of two things measured in this process, interleaved round by round, so
machine noise hits both sides alike. Step time is the wall time from ``on_train_batch_start`` of
the first callback to ``on_train_batch_end`` of the last one: forward, backward, the optimizer
step and everything the callbacks do, in a real ``Trainer.fit``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import lightning as L
import torch
from torch import nn
from torch.nn.utils import prune
from torch.utils.data import DataLoader, TensorDataset

from lightning_pin import Pin, PinCallback
from lightning_pin.core.plan import fraction_indices, resolve


# ---------------------------------------------------------------------------------------------
# The model and the timed fit


class MLP(L.LightningModule):
    """``layers`` square Linear layers of width ``width``: the issue's 4 x 2500 x 2500 at full size."""

    def __init__(self, width: int, layers: int = 4, lr: float = 1e-3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        return self.layers[-1](x).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=1e-2)


class StepStart(L.Callback):
    def __init__(self) -> None:
        self.started = 0.0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.started = time.perf_counter()


class StepEnd(L.Callback):
    def __init__(self, start: StepStart, out: str | None = None) -> None:
        self.start = start
        self.out = out
        self.times: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.times.append(time.perf_counter() - self.start.started)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # Under ddp_spawn the timings live in the workers: rank 0 hands them over in a file.
        if self.out is not None and trainer.global_rank == 0:
            with open(self.out, "w") as handle:
                json.dump(self.times, handle)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.out is not None and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def loader(width: int, steps: int, batch: int = 64) -> DataLoader:
    x = torch.randn(steps * batch, width, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x), batch_size=batch)


def timed_fit(model: MLP, callbacks: list[L.Callback], data: DataLoader, warmup: int) -> float:
    """Median step time of one fit, after ``warmup`` steps."""
    start = StepStart()
    end = StepEnd(start)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        callbacks=[start, *callbacks, end],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=50,
    )
    trainer.fit(model, data)
    return statistics.median(end.times[warmup:])


def ddp_step_ratio(width: int, rounds: int, steps: int, warmup: int) -> float:
    """Step time of 1%-pinned over unpinned DDP (ddp_spawn, 2 CPU processes), interleaved."""
    import tempfile

    ratios = []
    for _ in range(rounds):
        medians = {}
        for name, setup in (("unpinned", lambda model: []), ("pinned", ours(0.01))):
            torch.manual_seed(0)
            model = MLP(width)
            out = os.path.join(tempfile.mkdtemp(), "times.json")
            start = StepStart()
            trainer = L.Trainer(
                accelerator="cpu",
                devices=2,
                strategy="ddp_spawn",
                max_epochs=1,
                callbacks=[start, *setup(model), StepEnd(start, out)],
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
            )
            trainer.fit(model, loader(width, steps * 2))
            with open(out) as handle:
                medians[name] = statistics.median(json.load(handle)[warmup:])
        ratios.append(medians["pinned"] / medians["unpinned"])
    return statistics.median(ratios)


@dataclass
class Case:
    """One way of training: a fresh model and the callbacks (or module edits) that pin it."""

    name: str
    setup: Callable[[MLP], list[L.Callback]]


def compare(width: int, cases: list[Case], rounds: int, steps: int, warmup: int) -> dict[str, float]:
    """Median over rounds of each case's step time divided by the unpinned one of that round."""
    data = loader(width, steps)
    ratios: dict[str, list[float]] = {c.name: [] for c in cases}
    for _ in range(rounds):
        times = {}
        for case in cases:
            torch.manual_seed(0)
            model = MLP(width)
            callbacks = case.setup(model)
            gc.collect()
            times[case.name] = timed_fit(model, callbacks, data, warmup)
        for name, seconds in times.items():
            ratios[name].append(seconds / times["unpinned"])
    return {name: statistics.median(values) for name, values in ratios.items()}


# ---------------------------------------------------------------------------------------------
# The alternatives


def _mask_of(model: MLP, name: str, fraction: float) -> torch.Tensor:
    parameter = model.get_parameter(name)
    mask = torch.zeros(parameter.numel(), dtype=torch.bool)
    mask[fraction_indices(name, parameter.numel(), fraction, 0)] = True
    return mask.view_as(parameter)


def weight_names(model: MLP) -> list[str]:
    return [f"layers.{i}.weight" for i in range(len(model.layers))]


class DenseMaskPins(L.Callback):
    """The textbook implementation: a bool mask and a full-size target per tensor."""

    def __init__(self, model: MLP, fraction: float) -> None:
        self.entries = []
        for name in weight_names(model):
            parameter = model.get_parameter(name)
            self.entries.append((parameter, _mask_of(model, name, fraction), parameter.detach().clone()))

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        for optimizer in trainer.optimizers:
            optimizer.register_step_post_hook(self._restore)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        for parameter, mask, _ in self.entries:
            if parameter.grad is not None:
                parameter.grad.masked_fill_(mask, 0)

    @torch.no_grad()
    def _restore(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for parameter, mask, target in self.entries:
            torch.where(mask, target, parameter, out=parameter.data)


class ResetEveryN(L.Callback):
    """The naive approach a user of ONNX Runtime training tried: write the targets back every
    ``every`` batches (they used 100), nothing else."""

    def __init__(self, model: MLP, fraction: float, every: int) -> None:
        self.every = every
        self.entries = []
        for name in weight_names(model):
            parameter = model.get_parameter(name)
            index = fraction_indices(name, parameter.numel(), fraction, 0)
            self.entries.append((parameter, index, parameter.detach().view(-1)[index].clone()))
        self.worst_drift = 0.0

    @torch.no_grad()
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx % self.every:
            return
        self._measure()
        for parameter, index, target in self.entries:
            parameter.data.view(-1).index_copy_(0, index, target)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._measure()

    @torch.no_grad()
    def _measure(self) -> None:
        for parameter, index, target in self.entries:
            drift = (parameter.detach().view(-1)[index] - target).abs().max()
            self.worst_drift = max(self.worst_drift, float(drift))


def pruned(model: MLP, fraction: float) -> list[L.Callback]:
    """``torch.nn.utils.prune``: can only pin to zero, through a reparametrisation."""
    for name in weight_names(model):
        layer = model.get_submodule(name.rsplit(".", 1)[0])
        prune.custom_from_mask(layer, "weight", mask=~_mask_of(model, name, fraction))
    return []


def ours(fraction: float, value: float | None = None, monitor: bool = True) -> Callable[[MLP], list[L.Callback]]:
    """PinCallback on every weight matrix; ``monitor=True`` is the default monitoring."""

    def setup(model: MLP) -> list[L.Callback]:
        pins = [Pin(weight_names(model), fraction=fraction, value=value)]
        return [PinCallback(pins, verbose=False, monitor=monitor)]

    return setup


def frozen_halves(model: MLP) -> list[L.Callback]:
    """Whole-tensor freezes: the first half of the layers, weights and biases."""
    half = len(model.layers) // 2
    return [PinCallback([Pin([f"layers.{i}.*" for i in range(half)])], verbose=False)]


# ---------------------------------------------------------------------------------------------
# Memory and set-up


def pin_bytes(callback: PinCallback) -> tuple[int, int]:
    """Bytes the engine holds for its pins (indices + targets), and the pinned elements."""
    engine = callback.engine
    stored: dict[int, int] = {}
    pinned = 0
    for rp in engine.plan.pins:
        for selection in rp.selections.values():
            pinned += selection.count
            for tensor in (selection.index, selection.values):
                if tensor is not None:
                    stored[id(tensor)] = tensor.numel() * tensor.element_size()
    for targets in engine.captured.values():
        for tensor in targets.values():
            stored[id(tensor)] = tensor.numel() * tensor.element_size()
    for targets in engine._targets.values():
        for target in targets:
            for tensor in (target.index, target.values):
                if tensor is not None:
                    stored[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(stored.values()), pinned


def peak_rss_mb(width: int, case: str, steps: int) -> float:
    """Peak RSS of a fresh process that trains ``steps`` steps of ``case``.

    Read from /proc (VmHWM): ``ru_maxrss`` would carry the parent's peak across fork + exec.
    """
    code = (
        "import sys, torch; sys.path.insert(0, %r); import bench;"
        "torch.set_num_threads(2); m = bench.MLP(%d); cbs = bench.CASES_BY_NAME[%r](m);"
        "bench.timed_fit(m, cbs, bench.loader(%d, %d), 0);"
        "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])"
    ) % (os.path.dirname(os.path.abspath(__file__)), width, case, width, steps)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1]) / 1024


class ZeroGradsOnly(L.Callback):
    """Zero the same gradients as a pin would, and nothing else: isolates what the optimizer
    itself pays for zeros in its statistics (torch's CPU sqrt is slow on exact zeros)."""

    def __init__(self, model: MLP, fraction: float) -> None:
        self.entries = [
            (model.get_parameter(name), fraction_indices(name, model.get_parameter(name).numel(), fraction, 0))
            for name in weight_names(model)
        ]

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        for parameter, index in self.entries:
            parameter.grad.view(-1).index_fill_(0, index, 0)


CASES_BY_NAME: dict[str, Callable[[MLP], list[L.Callback]]] = {
    "unpinned": lambda model: [],
    "pinned 1%": ours(0.01),
    "pinned 1%, no monitor": ours(0.01, monitor=False),
    "pinned 50%, no monitor": ours(0.5, monitor=False),
    "frozen halves": frozen_halves,
}


def setup_seconds(width: int, layers: int, fraction: float) -> tuple[float, int]:
    model = MLP(width, layers)
    params = sum(p.numel() for p in model.parameters())
    started = time.perf_counter()
    resolve([Pin("layers.*", fraction=fraction)], model)
    return time.perf_counter() - started, params


# ---------------------------------------------------------------------------------------------


# glibc returns large freed blocks to the OS and faults them in again on the next allocation:
# every optimizer step's temporaries would then cost page faults whose count varies from fit to
# fit and swamps a 1% difference. Keep freed memory in the process, for both sides alike.
_STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}


def main() -> None:
    if any(os.environ.get(k) != v for k, v in _STEADY_MALLOC.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_STEADY_MALLOC})
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model and few steps (CI)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    width, rounds, steps, warmup = (400, 2, 8, 2) if args.quick else (2500, 5, 20, 4)
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "machine": _machine(), "width": width}

    print(f"lightning-pin benchmark  {results['date']}  {results['machine']}")
    params = 4 * (width * width + width)
    print(f"MLP 4 x Linear({width}, {width}) = {params / 1e6:.1f}M parameters, batch 64, AdamW(wd=1e-2)\n")

    cases = [
        Case("unpinned", lambda model: []),
        Case("pinned 0.1%", ours(0.001)),
        Case("pinned 1%", ours(0.01)),
        Case("pinned 1%, no monitor", ours(0.01, monitor=False)),
        Case("pinned 20%", ours(0.2)),
        Case("pinned 50%", ours(0.5)),
        Case("zeroed grads only 50%", lambda model: [ZeroGradsOnly(model, 0.5)]),
        Case("frozen halves", frozen_halves),
        Case("ours to zero 1%", ours(0.01, value=0.0)),
        Case("prune 1%", lambda model: pruned(model, 0.01)),
        Case("dense mask 1%", lambda model: [DenseMaskPins(model, 0.01)]),
        Case("dense mask 50%", lambda model: [DenseMaskPins(model, 0.5)]),
        Case("reset every 100 1%", lambda model: [ResetEveryN(model, 0.01, 100)]),
    ]
    ratios = compare(width, cases, rounds, steps, warmup)
    results["step_time_ratio"] = ratios
    goals = {"pinned 1%": 1.01, "pinned 20%": 1.05, "pinned 50%": 1.08, "frozen halves": 1.00}
    print("step time / unpinned step time (median of interleaved rounds)")
    for name, ratio in ratios.items():
        goal = goals.get(name)
        mark = "" if goal is None else f"   goal <= {goal:.2f}: {'met' if ratio <= goal else 'MISSED'}"
        print(f"  {name:<24} {ratio:6.3f}{mark}")
    speedup = ratios["prune 1%"] / ratios["ours to zero 1%"]
    results["prune_over_ours_1pct"] = speedup
    print(f"  prune / ours (pins to zero, 1%): {speedup:.2f}x   goal >= 1.2x: {'met' if speedup >= 1.2 else 'MISSED'}")

    # How far the naive approach lets values drift between its resets.
    model = MLP(width)
    naive = ResetEveryN(model, 0.01, 100)
    timed_fit(model, [naive], loader(width, 101 if not args.quick else 21), 0)
    results["naive_reset_worst_drift"] = naive.worst_drift
    print(f"\nre-set every 100 batches: pinned values drift by up to {naive.worst_drift:.3g} between resets")

    print("\nmemory (the engine's indices and targets; the default monitor adds one copy of the weights)")
    for fraction in (0.01, 0.5):
        model = MLP(width)
        callback = ours(fraction, monitor=False)(model)[0]
        timed_fit(model, [callback], loader(width, 3), 0)
        stored, pinned = pin_bytes(callback)
        results[f"bytes_per_pinned_{fraction}"] = stored / pinned
        print(f"  {fraction:.0%} pinned: {stored / pinned:.2f} bytes per pinned element (goal <= 8)")
    rss = {name: peak_rss_mb(width, name, 4) for name in CASES_BY_NAME}
    results["peak_rss_mb"] = rss
    for name, mb in rss.items():
        print(f"  peak RSS {name:<24} {mb:8.1f} MB  ({mb / rss['unpinned']:.3f} x unpinned)")

    print("\nset-up: resolving 1% by fraction")
    width_big = 1581 if args.quick else 5000
    seconds, count = setup_seconds(width_big, 4, 0.01)
    results["setup_seconds"] = {"params": count, "seconds": seconds}
    print(f"  {count / 1e6:.0f}M parameters: {seconds:.2f} s (goal < 2 s)")

    print("\nscaling: step time at 1% pinned / unpinned")
    sizes = (500, 1581) if args.quick else (500, 1581, 2500, 5000)
    scaling = {}
    for size in sizes:
        pair = [Case("unpinned", lambda model: []), Case("pinned 1%", ours(0.01))]
        ratio = compare(size, pair, 2, 8 if size < 5000 else 6, 2)["pinned 1%"]
        scaling[4 * (size * size + size)] = ratio
        print(f"  {4 * (size * size + size) / 1e6:6.1f}M parameters: {ratio:.3f}")
    results["scaling"] = scaling

    print("\nDDP, 2 CPU processes (ddp_spawn, one thread each): step time at 1% pinned / unpinned")
    ddp_width = 400 if args.quick else 1000
    ddp_ratio = ddp_step_ratio(ddp_width, 1 if args.quick else 3, 8 if args.quick else 16, 2)
    results["ddp_step_time_ratio"] = ddp_ratio
    print(f"  {4 * (ddp_width * ddp_width + ddp_width) / 1e6:.1f}M parameters: {ddp_ratio:.3f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


def _machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


if __name__ == "__main__":
    main()
