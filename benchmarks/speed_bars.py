"""The engine's speed bars alone: the eager step at 1% / 20% / 50% pinned, and 256 small pinned tensors.

    python benchmarks/speed_bars.py            # about 3 minutes on 2 quiet CPU cores
    python benchmarks/speed_bars.py --quick    # small sizes: it runs, the figures mean little

The same measurements as ``bench.py`` (its cases and its interleaved rounds, imported from it), limited
to the bars the engine must hold: a real ``Trainer.fit`` of the 25M-parameter MLP (AdamW, default
monitoring) pinned on 1%, 20% and 50% of every weight, against the unpinned fit of the same rounds
(goals 1.05, 1.10, 1.15), and a plain loop over 4M parameters as 256 square Linear layers with 1% of
every weight pinned (AdamW foreach and for-loop, goal 1.05). Beside each bar, its floor: the same pins
written bare with the index kernels the engine runs (bench.RawIndexPins, bench.RawPins), so that the
engine's step over the floor's says what lightning-pin adds above torch's kernels. Read it over several
runs on a quiet machine: a single round on a shared one moves by more than the goals' margins.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the benchmarks folder is not a package)

__all__ = ["EAGER_GOALS", "SMALL_TENSORS_GOAL", "main"]

#: Step time over unpinned, per pinned fraction: the goals the engine is held to.
EAGER_GOALS = {"pinned 1%": 1.05, "pinned 20%": 1.10, "pinned 50%": 1.15}
#: 256 small pinned tensors over unpinned.
SMALL_TENSORS_GOAL = 1.05


def main() -> None:
    if any(os.environ.get(k) != v for k, v in bench._STEADY_MALLOC.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **bench._STEADY_MALLOC})
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: it runs, the figures mean little")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    gc.freeze()
    width, rounds, steps, warmup = (256, 2, 4, 1) if args.quick else (2500, 5, 20, 4)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    print(f"lightning-pin speed bars  {stamp}  {bench._machine()}  load {os.getloadavg()[0]:.2f}")
    fractions = (0.01, 0.2, 0.5)
    cases = [bench.Case("unpinned", lambda model: []), *bench._fraction_cases(fractions), *bench.floor_cases(fractions)]
    measured = bench.compare_rounds(width, cases, rounds, steps, warmup)
    title = (f"Trainer.fit, MLP 4 x Linear({width}, {width}), AdamW, default monitoring: step time / unpinned, "
             f"median of {rounds} interleaved rounds [each round]; floor: the index kernels written bare")
    eager = bench.print_rows(title, measured, EAGER_GOALS)
    over_floor = {}
    for fraction in fractions:
        pinned, floor = measured.wall[f"pinned {fraction:.0%}"], measured.wall[f"floor {fraction:.0%}"]
        over_floor[f"{fraction:.0%}"] = rounds_over = [p / f for p, f in zip(pinned, floor)]
        print(f"  pinned {fraction:.0%} over its floor: {statistics.median(rounds_over):.3f}   "
              f"[{' '.join(f'{r:.3f}' for r in rounds_over)}]")
    depth_sizes = (2, 4, 1) if args.quick else (5, 30, 5)  # rounds, steps, warm-up steps
    depth = bench.depth_rows((256,), (0.01,), ("AdamW foreach", "AdamW for-loop"), *depth_sizes,
                             parameters=250_000 if args.quick else 4_000_000, floor=True)
    for name, row in depth.items():
        print(f"  {name}: {row['ratio']:.3f}   goal <= {SMALL_TENSORS_GOAL:.2f}: "
              f"{bench.verdict(row['rounds'], SMALL_TENSORS_GOAL)}; the same kernels written bare (the floor): "
              f"{row['floor_ratio']:.3f}, the engine over them {row['over_floor']:.3f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"eager": eager, "eager_rounds": measured.ratios(), "over_floor": over_floor,
                       "small_tensors": depth}, handle, indent=1)


if __name__ == "__main__":
    main()
