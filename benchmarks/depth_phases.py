"""One depth row split into phases: forward, backward, step and zero_grad, pinned and unpinned.

    python benchmarks/depth_phases.py 256 0.01 forloop     # tensors, fraction, forloop|foreach|sgd

Two loops over the same 4M parameters as N square Linear layers live side by side and take turns
step by step (the order flips every step) for 200 steps, on the same weights and statistics
(aliased, see bench.aliased); the medians of each phase and of the
whole step are printed, with the ratio and the microseconds pinning adds per pinned tensor.
"""
import gc
import statistics
import sys
import time

import torch
from torch import nn
from lightning_pin import Pin, pin

from bench import alias_statistics, aliased


def main() -> None:
    torch.set_num_threads(1)
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    frac = float(sys.argv[2]) if len(sys.argv) > 2 else 0.01
    opt_kind = sys.argv[3] if len(sys.argv) > 3 else "forloop"
    steps = 200
    width = round((4_000_000 / layers) ** 0.5)
    def optimizer(m):
        if opt_kind == "forloop":
            return torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False)
        if opt_kind == "foreach":
            return torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)
        return torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
    torch.manual_seed(0)
    mp = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    op = optimizer(mp)
    mu = aliased(mp)  # the unpinned loop trains the same memory (bench.aliased)
    ou = optimizer(mu)
    h = pin(mp, op, [Pin([f"{i}.weight" for i in range(layers)], fraction=frac, seed=0)])
    x = torch.randn(16, width)
    phases = ("fwd", "bwd", "step", "zero")
    res = {pinned: {phase: [] for phase in phases} for pinned in (False, True)}
    loops = {False: (mu, ou), True: (mp, op)}
    for s in range(steps):
        for pinned in (False, True) if s % 2 else (True, False):
            m, o = loops[pinned]
            t0 = time.perf_counter()
            loss = m(x).square().mean()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            o.step()
            t3 = time.perf_counter()
            o.zero_grad()
            t4 = time.perf_counter()
            if s == 0 and not pinned:
                alias_statistics(op, ou)
            if s >= 10:
                for phase, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    res[pinned][phase].append(seconds)
    tot = {}
    for pinned in (False, True):
        r = res[pinned]
        tot[pinned] = statistics.median([sum(each) for each in zip(*r.values())])
        medians = " ".join(f"{k} {statistics.median(v) * 1e3:.2f}" for k, v in r.items())
        print("pinned" if pinned else "unpinned", medians, f"total {tot[pinned] * 1e3:.2f}")
    print(f"layers {layers} frac {frac} {opt_kind}: ratio {tot[True] / tot[False]:.3f}  "
          f"us/tensor {(tot[True] - tot[False]) * 1e6 / layers:.1f}")
    h.verify()


if __name__ == "__main__":
    main()
