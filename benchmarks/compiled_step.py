"""compile_step=True: the optimizer step with pinning fused in, against torch's own steps.

    python benchmarks/compiled_step.py                  # 4 x 1250 x 1250 floats (6.25M), 15 rounds
    python benchmarks/compiled_step.py --quick          # a small model, a few rounds
    python benchmarks/compiled_step.py --trainer        # the same in a real Trainer.fit

One optimizer step in a plain loop (the gradients are left in place between steps, so backward
is out of the timing; what pinning adds to backward is the gradient mask, timed here as part of
the pinned step), for each optimizer and pinned fraction (random elements of every weight):

- ``eager``: torch's step, unpinned (foreach, torch's default);
- ``compiled``: torch's step compiled (``torch.compile`` of the optimizer class's undecorated step
  under ``no_grad``: the graph ``torch.compile(optimizer.step)`` makes, without the graph breaks of
  its grad-mode wrapper), unpinned;
- ``pinned eager``: ``pin()`` as without compile_step (index mask, eager step, index restore);
- ``pinned compiled``: ``pin(..., compile_step=True)``: the pinned gradients zeroed in memory
  (``pin()`` keeps them zero when backward returns), then torch's step compiled with the pinned
  elements and their statistics held where they were, in the update's own kernel;
- ``pinned compiled, no read``: the same when nothing reads the gradients between backward and the
  step (``pin(..., compile_step=True, zero_pinned_grads=False)``, or ``PinCallback(compile_step=True)``
  in a Trainer that does not clip): no pass over the gradients at all, the step ignores pinned ones.

Each pinned step is timed beside torch's unpinned steps *on the same memory* (parameters, gradients
and statistics aliased, see :func:`references`), taking turns step by step: separate models with
identical work differed by up to 15% here, by where the allocator put them. Rounds interleave
the cases; medians of the per-round medians are reported, ratios are medians of per-round ratios,
with the compile time (the first two calls) and the memory the pins hold per pinned element (the
engine's index and targets, and the compiled step's dense mask).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch
from torch import nn

from bench import alias_statistics  # benchmarks/ is sys.path[0] when run as a script
from lightning_pin import Pin, pin
from lightning_pin.core.compiled_step import _own_code

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


def references(net: nn.Module, optimizer: torch.optim.Optimizer,
               make: Callable[..., torch.optim.Optimizer]) -> dict[str, Callable[[], None]]:
    """torch's own steps, eager and compiled, unpinned, on the *same memory* as ``optimizer``'s:
    parameters, gradients and statistics are aliases (``.data``: the same storage, version counters
    of their own, so the pinned step does not take their writes for foreign ones). Separate models
    differed by up to 15% here with identical work (where the allocator put them), which is more
    than the differences measured; one memory for both sides takes that out."""
    params = list(net.parameters())
    aliases = [nn.Parameter(p.data) for p in params]
    for alias, p in zip(aliases, params):
        alias.grad = p.grad.data
    steps = {}
    for kind in ("eager", "compiled"):
        reference = make(aliases)
        raw = inspect.unwrap(type(reference).step)
        with torch.no_grad():
            raw(reference)  # make its statistics, then point them at the pinned optimizer's
        alias_statistics(optimizer, reference)
        if kind == "eager":
            steps[kind] = reference.step  # torch's hooked step, foreach: what users run
        else:
            def compiled_step(reference: torch.optim.Optimizer = reference, raw: Any = raw) -> None:
                raw(reference)

            graph = torch.compile(_own_code(compiled_step), fullgraph=True)

            def run(graph: Callable[[], None] = graph) -> None:
                with torch.no_grad():
                    graph()

            steps[kind] = run
    return steps


class Case:
    """One pinned step (or torch's unpinned steps alone, ``fraction=None``) and, beside it, torch's
    unpinned eager and compiled steps on the same memory; every step runs all of them, the order
    turning round step by step."""

    def __init__(self, name: str, width: int, layers: int, make: Callable[..., torch.optim.Optimizer],
                 fraction: float | None, compiled: bool, read_grads: bool = True) -> None:
        self.name = name
        self.net = model(width, layers)
        self.optimizer = make(self.net.parameters())
        self.handle = None
        if fraction is not None:
            pins = [Pin(f"{i}.weight", fraction=fraction, seed=i) for i in range(layers)]
            self.handle = pin(self.net, self.optimizer, pins, compile_step=compiled, zero_pinned_grads=read_grads)
            engine, optimizer = self.handle.engine, self.optimizer

            def step() -> None:
                engine.mask_grads(optimizer)  # what the gradient hooks do during backward
                optimizer.step()

            start = time.perf_counter()
            step()  # the first call compiles
            step()  # and the second (the first step has a graph of its own)
            self.compile_seconds = time.perf_counter() - start
            self.steps = {"pinned": step}
        else:
            self.optimizer.step()  # the statistics exist before the references alias them
            self.steps = {}
        start = time.perf_counter()
        self.steps.update(references(self.net, self.optimizer, make))
        self.steps["compiled"]()
        self.reference_compile_seconds = time.perf_counter() - start
        self.times: dict[str, list[float]] = {kind: [] for kind in self.steps}
        self._turn = 0

    def run(self, steps: int) -> None:
        each: dict[str, list[float]] = {kind: [] for kind in self.steps}
        kinds = list(self.steps)
        for _ in range(steps):
            self._turn += 1
            for kind in kinds[self._turn % len(kinds):] + kinds[: self._turn % len(kinds)]:
                start = time.perf_counter()
                self.steps[kind]()
                each[kind].append(time.perf_counter() - start)
        for kind, times in each.items():
            self.times[kind].append(statistics.median(times))

    def ms(self, kind: str) -> float:
        return statistics.median(self.times[kind]) * 1e3

    def ratio(self, kind: str, over: str) -> float:
        """Median over rounds of the per-round ratio of two of this case's steps (same memory)."""
        return statistics.median(a / b for a, b in zip(self.times[kind], self.times[over]))

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

                self._step = torch.compile(_own_code(step), fullgraph=True)  # a graph per fit
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
        cases: dict[str, Case] = {}
        for f in fractions:
            cases[f"pinned eager {f:.0%}"] = Case("pinned eager", width, layers, make, f, False)
            cases[f"pinned compiled {f:.0%}"] = Case("pinned compiled", width, layers, make, f, True)
            cases[f"no read {f:.0%}"] = Case("no read", width, layers, make, f, True, read_grads=False)
        for _ in range(rounds):
            for case in cases.values():
                case.run(args.steps)
        for f in fractions:
            eager, masked, no_read = (cases[f"{k} {f:.0%}"] for k in ("pinned eager", "pinned compiled", "no read"))
            row = {
                "optimizer": name,
                "fraction": f,
                # torch's own steps: medians over the three cases' memories
                "eager_ms": statistics.median(c.ms("eager") for c in (eager, masked, no_read)),
                "compiled_ms": statistics.median(c.ms("compiled") for c in (eager, masked, no_read)),
                "pinned_eager_ms": eager.ms("pinned"),
                "pinned_eager_over_eager": eager.ratio("pinned", "eager"),
                "pinned_compiled_ms": masked.ms("pinned"),
                "pinned_compiled_over_compiled": masked.ratio("pinned", "compiled"),
                "pinned_compiled_over_eager": masked.ratio("pinned", "eager"),
                "pinned_compiled_no_read_ms": no_read.ms("pinned"),
                "no_read_over_compiled": no_read.ratio("pinned", "compiled"),
                "no_read_over_eager": no_read.ratio("pinned", "eager"),
                "no_read_rounds": [round(a / b, 3) for a, b in zip(no_read.times["pinned"], no_read.times["compiled"])],
                "compile_s_compiled": masked.reference_compile_seconds,
                "compile_s_pinned_compiled": masked.compile_seconds,
                **masked.pinned_bytes(),
            }
            results.append(row)
            print(json.dumps(row), flush=True)
        for case in cases.values():
            case.handle.remove()
        del cases
    print()
    print(f"{width * width * layers + width * layers:,} parameters, {args.threads} threads, {rounds} rounds x "
          f"{args.steps} steps, medians (ms); ratios are medians of per-round ratios on the same memory")
    print("| optimizer | pinned | eager | compiled | pinned eager | / eager | pinned compiled | / compiled | / eager "
          "| pinned compiled, no read | / compiled | / eager "
          "| compile s (unpinned / pinned) | bytes per pinned element (engine + compiled) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['optimizer']} | {r['fraction']:.0%} | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | "
              f"{r['pinned_eager_ms']:.1f} | {r['pinned_eager_over_eager']:.2f} | {r['pinned_compiled_ms']:.1f} | "
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
