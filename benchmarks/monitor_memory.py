"""Peak memory of a ``Trainer.fit`` with ``PinCallback`` (5% of the weights pinned) and the default
``PinMonitor``, as a ratio to the same fit unpinned (issue 37's goal: at most 1.05).

    python benchmarks/monitor_memory.py           # a 25M-parameter MLP (5 x Linear(2236, 2236))
    python benchmarks/monitor_memory.py --quick   # a 1M-parameter one (seconds)

Each case runs in a fresh process (peak resident memory only ever grows), and the figure is that
process's peak resident set size (``ru_maxrss``) minus its resident size right before the fit,
once torch and Lightning are imported: what training itself needs (weights, gradients, AdamW's two
statistics, activations, and what pinning and the monitor keep), printed beside the peak itself.
The cases:

- ``unpinned``: no callback;
- ``pinned + default monitor``: ``PinCallback(pins)`` (the default ``PinMonitor()``: pin drift and
  violations, no copy of the weights);
- ``pinned + weight drift``: ``PinMonitor(weight_drift=True)``, which keeps a copy of every
  trainable weight from fit start (what the default monitor did before).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

__all__ = ["CASES", "main", "measure"]

CASES = ("unpinned", "pinned + default monitor", "pinned + weight drift")


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def measure(case: str, width: int, layers: int, steps: int) -> tuple[float, float]:
    """``(peak, extra)``: the process's peak resident memory and its growth over the fit, in MiB."""
    import lightning as L
    import torch
    from lightning.pytorch.loggers import CSVLogger
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pin import Pin, PinCallback, PinMonitor

    torch.set_num_threads(1)
    torch.manual_seed(0)

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch, batch_idx):
            return self.layers(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    model = MLP()
    data = DataLoader(TensorDataset(torch.randn(steps * 16, width)), batch_size=16)
    callbacks = []
    if case != "unpinned":
        monitor = PinMonitor(weight_drift=True) if case == "pinned + weight drift" else PinMonitor()
        pins = [Pin(f"layers.{i}.weight", fraction=0.05, seed=i) for i in range(layers)]
        callbacks.append(PinCallback(pins, verbose=False, monitor=monitor))
    with tempfile.TemporaryDirectory() as logdir:
        trainer = L.Trainer(
            max_steps=steps, logger=CSVLogger(logdir), log_every_n_steps=2, callbacks=callbacks,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, accelerator="cpu", devices=1,
        )
        before = _rss_kib()
        trainer.fit(model, data)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return peak / 1024, (peak - before) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 1M-parameter model")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in a child process
    args = parser.parse_args()
    width, layers, steps = (448, 5, 6) if args.quick else (2236, 5, 6)
    if args.case:
        print(json.dumps(measure(args.case, width, layers, steps)))
        return
    params = layers * (width * width + width)
    print(f"MLP {layers} x Linear({width}, {width}) = {params / 1e6:.1f}M parameters, AdamW, {steps} steps, 5% pinned")
    results = {}
    for case in CASES:
        command = [sys.executable, __file__, "--case", case] + (["--quick"] if args.quick else [])
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        results[case] = json.loads(done.stdout.strip().splitlines()[-1])
    peak0, extra0 = results["unpinned"]
    print(f"{'':>26}  peak MiB   ratio   grown in fit MiB   ratio")
    for case, (peak, extra) in results.items():
        print(f"{case:>26}: {peak:8.1f}   {peak / peak0:.3f}   {extra:16.1f}   {extra / extra0:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mib": results, "peak_ratio": {c: r[0] / peak0 for c, r in results.items()},
                       "fit_ratio": {c: r[1] / extra0 for c, r in results.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
