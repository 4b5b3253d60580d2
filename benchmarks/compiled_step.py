"""compile_step=True: the optimizer step with pinning fused in, against torch's own steps.

    python benchmarks/compiled_step.py                  # 4 x 1250 x 1250 floats (6.25M), 15 rounds
    python benchmarks/compiled_step.py --quick          # a small model, a few rounds
    python benchmarks/compiled_step.py --trainer        # the same in a real Trainer.fit

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
  step (``pin(..., compile_step=True, zero_pinned_grads=False)``, or ``PinCallback(compile_step=True)``
  in a Trainer that does not clip): no pass over the gradients at all, the step ignores pinned ones.

Rounds interleave every case, so machine noise hits all alike; medians of the per-round medians
are reported, with the compile time (the first call) and the memory the pins hold per pinned
element (the engine's index and targets, and the compiled step's dense mask and targets).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from typing import Any, Callable, Optional

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
            self.handle = pin(self.net, self.optimizer, pins, compile_step=compiled, zero_pinned_grads=read_grads)
            engine, optimizer = self.handle.engine, self.optimizer

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


# ---------------------------------------------------------------------------------------------
# The same in a real Trainer.fit: forward, backward and step of a batch, timed from the first
# callback's on_train_batch_start to the last one's on_train_batch_end.


def trainer_rows(width: int, layers: int, fractions: list[float], optimizers: list[str], rounds: int, steps: int,
                 warmup: int) -> list[dict[str, Any]]:
    """Per optimizer and fraction: unpinned eager, unpinned compiled (the module's ``optimizer_step``
    runs a ``torch.compile``-d step after Lightning's closure), ``PinCallback`` eager and
    ``PinCallback(compile_step=True)`` (the Trainer does not clip: pinned gradients are left to the
    step), fits interleaved round by round; medians of per-fit median step times (ms)."""
    import inspect

    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pin import PinCallback

    class Net(L.LightningModule):
        def __init__(self, make: Callable[..., torch.optim.Optimizer], compiled: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
            self.make, self.compiled = make, compiled
            self._step: Any = None

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return self.make(self.parameters())

        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            if not self.compiled:
                return super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
            optimizer_closure()  # forward and backward, as Lightning's step would run them
            if self._step is None:
                raw = inspect.unwrap(type(optimizer.optimizer).step)

                def step(opt: torch.optim.Optimizer) -> None:
                    raw(opt)

                # A code object of its own per fit: dynamo caches graphs per code object, and after
                # 8 optimizers on one it would run them eager.
                fresh = types.FunctionType(step.__code__.replace(), step.__globals__, "step", None, step.__closure__)
                self._step = torch.compile(fresh, fullgraph=True)
            with torch.no_grad():
                self._step(optimizer.optimizer)

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = 0.0

        def on_train_batch_start(self, *args: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            self.times.append(time.perf_counter() - self.start)

    data = DataLoader(TensorDataset(torch.randn((warmup + steps) * 16, width)), batch_size=16)
    rows = []
    for name in optimizers:
        make = OPTIMIZERS[name]
        cases: dict[str, tuple[bool, Optional[float], bool]] = {
            "eager": (False, None, False), "compiled": (True, None, False),
        }
        for f in fractions:
            cases[f"pinned eager {f:.0%}"] = (False, f, False)
            cases[f"pinned compiled {f:.0%}"] = (False, f, True)
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(rounds):
            for key, (compiled, fraction, compile_step) in cases.items():
                module = Net(make, compiled)
                timer = Timer()
                callbacks: list[Any] = [timer]
                if fraction is not None:
                    pins = [Pin(f"net.{i}.weight", fraction=fraction, seed=i) for i in range(layers)]
                    callbacks.insert(0, PinCallback(pins, verbose=False, monitor=False, compile_step=compile_step))
                L.Trainer(accelerator="cpu", max_epochs=1, callbacks=callbacks, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False).fit(module, data)
                times[key].append(statistics.median(timer.times[warmup:]))
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        for f in fractions:
            row = {
                "optimizer": name, "fraction": f, "eager_ms": ms["eager"], "compiled_ms": ms["compiled"],
                "pinned_eager_ms": ms[f"pinned eager {f:.0%}"], "pinned_compiled_ms": ms[f"pinned compiled {f:.0%}"],
            }
            row["over_compiled"] = row["pinned_compiled_ms"] / row["compiled_ms"]
            row["over_eager"] = row["pinned_compiled_ms"] / row["eager_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(f"Trainer.fit, {width * width * layers + width * layers:,} parameters, batch 16, {rounds} fits each, "
          f"median step (ms)")
    print("| optimizer | pinned | eager | compiled | PinCallback eager | PinCallback(compile_step=True) "
          "| / compiled | / eager |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['optimizer']} | {r['fraction']:.0%} | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | "
              f"{r['pinned_eager_ms']:.1f} | {r['pinned_compiled_ms']:.1f} | {r['over_compiled']:.2f} | "
              f"{r['over_eager']:.2f} |")
    return rows


# As in bench.py: keep freed memory in the process, so that temporaries are not faulted in again on
# every step (a page-fault noise that differs from case to case).
_STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}


def main() -> None:
    if any(os.environ.get(k) != v for k, v in _STEADY_MALLOC.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_STEADY_MALLOC})
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--optimizers", default="adamw,adam,sgd")
    parser.add_argument("--fractions", default="0.01,0.2,0.5,0.8")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--trainer", action="store_true", help="the rows of a real Trainer.fit instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    width, layers = (250, 2) if args.quick else (1250, 4)
    rounds = 3 if args.quick else args.rounds
    fractions = [float(f) for f in args.fractions.split(",")]
    if args.trainer:
        rows = trainer_rows(width, layers, fractions, args.optimizers.split(","), rounds, 8 if args.quick else 20, 3)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
        return
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
