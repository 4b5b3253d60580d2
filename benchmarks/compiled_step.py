"""compile_step=True: the optimizer step with pinning fused in, against torch's own steps.

    python benchmarks/compiled_step.py                  # 4 x 1250 x 1250 floats (6.25M), 15 rounds
    python benchmarks/compiled_step.py --quick          # a small model, a few rounds

One optimizer step in a plain loop (the gradients are left in place between steps, so backward
is out of the timing; what pinning adds to backward is the gradient mask, timed here as part of
the pinned step), for each optimizer and pinned fraction (random elements of every weight):

- ``eager``: torch's step, unpinned (foreach, torch's default);
- ``compiled``: ``torch.compile(optimizer.step)``, unpinned;
- ``pinned eager``: ``pin()`` as without compile_step (index mask, eager step, index restore);
- ``pinned compiled``: ``pin(..., compile_step=True)``: the pinned gradients zeroed in memory
  (``pin()`` keeps them zero when backward returns), then torch's step compiled with the pinned
  elements and their statistics held where they were, in the update's own kernel;
- ``pinned compiled, no read``: the same when nothing reads the gradients between backward and the
  step (``PinCallback(compile_step=True)`` in a Trainer that does not clip): no pass over the
  gradients at all, the compiled step ignores pinned ones.

Rounds interleave every case, so machine noise hits all alike; medians of the per-round medians
are reported, with the compile time (the first call) and the memory the pins hold per pinned
element (the engine's index and targets, and the compiled step's dense mask and targets).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import torch
from torch import nn

from lightning_pin import Pin, pin

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=1e-2),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-4),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-4, momentum=0.9),
}


def model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    for p in net.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return net


class Case:
    def __init__(self, name: str, width: int, layers: int, make: Callable[..., torch.optim.Optimizer],
                 fraction: float | None, compiled: bool, read_grads: bool = True) -> None:
        self.name = name
        self.net = model(width, layers)
        self.optimizer = make(self.net.parameters())
        self.handle = None
        self.times: list[float] = []
        if fraction is None:
            self.step = torch.compile(self.optimizer.step) if compiled else self.optimizer.step
        else:
            pins = [Pin(f"{i}.weight", fraction=fraction, seed=i) for i in range(layers)]
            self.handle = pin(self.net, self.optimizer, pins, compile_step=compiled)
            engine, optimizer = self.handle.engine, self.optimizer
            engine.grads_read_before_step = read_grads

            def step() -> None:
                engine.mask_grads(optimizer)  # what the gradient hooks do during backward
                optimizer.step()

            self.step = step
        start = time.perf_counter()
        self.step()  # the first call compiles
        self.compile_seconds = time.perf_counter() - start

    def run(self, steps: int) -> None:
        each = []
        for _ in range(steps):
            start = time.perf_counter()
            self.step()
            each.append(time.perf_counter() - start)
        self.times.append(statistics.median(each))

    def pinned_bytes(self) -> dict[str, float]:
        if self.handle is None:
            return {}
        engine = self.handle.engine
        elements = sum(t.values.numel() for t in engine.targets())
        index = sum(t.index.numel() * t.index.element_size() + t.values.numel() * t.values.element_size()
                    for t in engine.targets())
        driver = self.optimizer.__dict__.get("step")
        dense = 0 if driver is None else sum(m.numel() * m.element_size() for m in driver.keeps)
        return {"engine_bytes_per_pinned": index / elements, "compiled_bytes_per_pinned": dense / elements}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--optimizers", default="adamw,adam,sgd")
    parser.add_argument("--fractions", default="0.01,0.2,0.5,0.8")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    width, layers = (250, 2) if args.quick else (1250, 4)
    rounds = 3 if args.quick else args.rounds
    fractions = [float(f) for f in args.fractions.split(",")]
    results: list[dict[str, Any]] = []
    for name in args.optimizers.split(","):
        make = OPTIMIZERS[name]
        cases = [Case("eager", width, layers, make, None, False), Case("compiled", width, layers, make, None, True)]
        for f in fractions:
            cases.append(Case(f"pinned eager {f:.0%}", width, layers, make, f, False))
            cases.append(Case(f"pinned compiled {f:.0%}", width, layers, make, f, True))
            cases.append(Case(f"pinned compiled no read {f:.0%}", width, layers, make, f, True, read_grads=False))
        for _ in range(rounds):
            for case in cases:
                case.run(args.steps)
        ms = {c.name: statistics.median(c.times) * 1e3 for c in cases}
        for f in fractions:
            pinned = next(c for c in cases if c.name == f"pinned compiled {f:.0%}")
            row = {
                "optimizer": name,
                "fraction": f,
                "eager_ms": ms["eager"],
                "compiled_ms": ms["compiled"],
                "pinned_eager_ms": ms[f"pinned eager {f:.0%}"],
                "pinned_compiled_ms": ms[f"pinned compiled {f:.0%}"],
                "pinned_compiled_over_compiled": ms[f"pinned compiled {f:.0%}"] / ms["compiled"],
                "pinned_compiled_over_eager": ms[f"pinned compiled {f:.0%}"] / ms["eager"],
                "pinned_compiled_no_read_ms": ms[f"pinned compiled no read {f:.0%}"],
                "no_read_over_compiled": ms[f"pinned compiled no read {f:.0%}"] / ms["compiled"],
                "no_read_over_eager": ms[f"pinned compiled no read {f:.0%}"] / ms["eager"],
                "compile_s_compiled": cases[1].compile_seconds,
                "compile_s_pinned_compiled": pinned.compile_seconds,
                **pinned.pinned_bytes(),
            }
            results.append(row)
            print(json.dumps(row), flush=True)
        for case in cases:
            if case.handle is not None:
                case.handle.remove()
        del cases
    print()
    print(f"{width * width * layers + width * layers:,} parameters, {args.threads} threads, {rounds} rounds x "
          f"{args.steps} steps, medians (ms)")
    print("| optimizer | pinned | eager | compiled | pinned eager | pinned compiled | / compiled | / eager "
          "| pinned compiled, no read | / compiled | / eager "
          "| compile s (unpinned / pinned) | bytes per pinned element (engine + compiled) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['optimizer']} | {r['fraction']:.0%} | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | "
              f"{r['pinned_eager_ms']:.1f} | {r['pinned_compiled_ms']:.1f} | "
              f"{r['pinned_compiled_over_compiled']:.2f} | "
              f"{r['pinned_compiled_over_eager']:.2f} | {r['pinned_compiled_no_read_ms']:.1f} | "
              f"{r['no_read_over_compiled']:.2f} | {r['no_read_over_eager']:.2f} | {r['compile_s_compiled']:.1f} / "
              f"{r['compile_s_pinned_compiled']:.1f} | {r['engine_bytes_per_pinned']:.0f} + "
              f"{r['compiled_bytes_per_pinned']:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
