"""Python calls into lightning-pin per steady-state step, by kind of pin.

    python benchmarks/step_calls.py                          # this tree's counts
    PYTHONPATH=/path/to/other/tree python benchmarks/step_calls.py   # another version's counts

A plain loop (``pin()`` with AdamW, forward, backward, ``step()``, ``zero_grad()``) on 16 Linear
layers, one pinned tensor per layer (a quarter of each weight's elements, or 2 neurons of each
layer's output). ``sys.setprofile`` counts every Python function call whose code lives in the
``lightning_pin`` package (comprehensions and generator resumptions included) during one step,
after the pins are active and the optimizer state exists. The goal (issue 37): at most
``20 + 2 x tensors`` calls for every kind, the rest of the step's work being built once when the
active pins change (a schedule boundary, a resume, a task switch).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import lightning_pin
from lightning_pin import Pin, pin

__all__ = ["KINDS", "LAYERS", "budget", "count_calls"]

#: Pinned tensors (one per layer) in every case.
LAYERS = 16


def _names() -> list[str]:
    return [f"{i}.weight" for i in range(LAYERS)]


#: The pins of each kind, on ``LAYERS`` Linear layers.
KINDS: dict[str, Callable[[], list[Any]]] = {
    "value": lambda: [Pin(_names(), fraction=0.25, seed=1)],
    "stuck bits": lambda: [Pin(_names(), fraction=0.25, seed=2, stuck_at_zero=0x80000000, stuck_at_one=0x00400000)],
    "bounds": lambda: [Pin(_names(), fraction=0.25, seed=3, bounds=(-0.05, 0.05))],
    "quantized codes": lambda: [
        Pin(_names(), fraction=0.25, seed=4, code=lightning_pin.QuantCode(bits=8, scale=0.05),
            stuck_at_zero=0x40, stuck_at_one=0x01)
    ],
    "neurons": lambda: [lightning_pin.NeuronPin(str(i), indices=[1, 5], value=0.5) for i in range(LAYERS)],
}


def budget(tensors: int = LAYERS) -> int:
    """Issue 37's bound: 20 calls per step plus 2 per pinned tensor."""
    return 20 + 2 * tensors


def count_calls(kind: str, steps: int = 6, **pin_kwargs: Any) -> list[int]:
    """Calls into lightning-pin in each of ``steps`` steps of the loop (the first ones build what is kept)."""
    root = lightning_pin.__file__.rsplit("/", 1)[0] + "/"
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(LAYERS)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    counts = []
    with pin(model, optimizer, KINDS[kind](), **pin_kwargs):
        for _ in range(steps):
            calls = [0]

            def profile(frame: Any, event: str, arg: Any) -> None:
                if event == "call" and frame.f_code.co_filename.startswith(root):
                    calls[0] += 1

            # A garbage collection inside the step would count the finalizers of objects other code left behind
            # (an earlier test's handles): not this step's work.
            gc.collect()
            gc.disable()
            sys.setprofile(profile)
            try:
                model(x).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            finally:
                sys.setprofile(None)
                gc.enable()
            counts.append(calls[0])
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the counts to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"lightning_pin from {lightning_pin.__file__.rsplit('/', 2)[0]}")
    print(f"{LAYERS} pinned tensors, plain loop with AdamW; budget {budget()} calls per step")
    results = {}
    for kind in KINDS:
        try:
            counts = count_calls(kind)
        except Exception as err:  # an older version may not know the kind (or its fields)
            print(f"{kind:>16}: not supported here ({type(err).__name__})")
            continue
        steady = counts[-1]
        results[kind] = steady
        per_tensor = steady / LAYERS
        print(f"{kind:>16}: {steady:4d} calls per steady step ({per_tensor:.1f} per tensor; first step {counts[0]})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
