"""What PinMonitor's measuring and logging cost, as a ratio to the same pinned fit without a monitor.

    python benchmarks/monitor_overhead.py           # a 4 x 1024 x 1024 MLP (about 2 minutes on 2 cores)
    python benchmarks/monitor_overhead.py --quick   # a 4 x 256 x 256 MLP (seconds)

The monitor measures only on logging steps (every ``log_every_n_steps``), so its cost is
amortised: this compares the *mean* step time (total time of the fit over its steps; a median
would hide a cost paid every 50th step), in CPU time of this process (other processes on a shared
machine barely move it) and in wall time, each the minimum over interleaved rounds (noise only
ever adds). Cases, each with 5% of every weight pinned to 0 and a CSVLogger:

- ``monitor=False``: pinning only (the reference);
- ``default``: ``PinMonitor()`` with Lightning's default ``log_every_n_steps=50``: pin drift,
  violations and weight drift (total, relative, per module) logged every 50 steps;
- ``every step``: the same, measured and logged on every step (the cost of one measured step).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from bench import MLP  # the same model as the main benchmark (benchmarks/ is on sys.path)
from lightning_pin import Pin, PinCallback


def timed_fit(width: int, steps: int, monitor: bool, log_every: int, logdir: str) -> tuple[float, float]:
    """Mean CPU and wall seconds per step of one fit (the first 5 steps excluded as warm-up)."""
    torch.manual_seed(0)
    model = MLP(width)
    data = DataLoader(TensorDataset(torch.randn((steps + 5) * 64, width)), batch_size=64)
    names = [f"layers.{i}.weight" for i in range(len(model.layers))]
    callback = PinCallback([Pin(names, fraction=0.05, value=0.0)], verbose=False, monitor=monitor)
    clock = _Clock(warmup=5)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        callbacks=[callback, clock],
        logger=CSVLogger(logdir),
        log_every_n_steps=log_every,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    return (clock.cpu_end - clock.cpu_start) / steps, (clock.end - clock.start) / steps


class _Clock(L.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.end, self.cpu_start, self.cpu_end = warmup, 0.0, 0.0, 0.0, 0.0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.warmup:
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.end, self.cpu_end = time.perf_counter(), time.process_time()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    width, steps = (256, 200) if args.quick else (1024, 100)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    cases = {"monitor=False": (False, 50), "default": (True, 50), "every step": (True, 1)}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    with tempfile.TemporaryDirectory() as logdir:
        for _ in range(args.rounds):
            for name, (monitor, log_every) in cases.items():
                gc.collect()
                times[name].append(timed_fit(width, steps, monitor, log_every, logdir))
    cpu_ref = min(c for c, _ in times["monitor=False"])
    wall_ref = min(w for _, w in times["monitor=False"])
    params = 4 * (width * width + width)
    print(f"MLP 4 x {width} x {width} ({params:,} parameters), {steps} steps, best of {args.rounds} rounds")
    print(f"  {'case':14s} {'CPU ms/step':>12s} {'ratio':>8s} {'wall ms/step':>13s} {'ratio':>8s}")
    for name, values in times.items():
        cpu, wall = min(c for c, _ in values), min(w for _, w in values)
        print(f"  {name:14s} {1000 * cpu:12.2f} {cpu / cpu_ref:8.4f} {1000 * wall:13.2f} {wall / wall_ref:8.4f}")


if __name__ == "__main__":
    main()
