"""Fault-aware mapping on the digits CNN: what mapping the units onto the faults buys, as ratios mapped / unmapped.

For each seed (the CNN pretrained once per seed) and fault setting (stuck cells at 10 / 30 / 50% with SA1:SA0
1:1 and 5:1; float stuck bits at 1e-3), the same faults are pinned on two copies of the pretrained model, one
mapped first with :func:`lightning_pin.faults.remap`, and both retrained with ``pin()`` for the same steps.
Printed (not timed): damage (squared change ``l2``, weights changed ``count``), forced and final accuracy, steps
to come back within 1 point of the baseline, and the mapping's time as a fraction of one training epoch.

    python benchmarks/remap.py            # 3 seeds, 2 retraining epochs: about a minute on one core
    python benchmarks/remap.py --quick    # 1 seed, two settings, 1 epoch (the test's run)
"""

from __future__ import annotations

import argparse
import dataclasses
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from lightning_pin import pin
from lightning_pin.app.models import SmallCNN
from lightning_pin.faults import bit_faults, cell_faults, remap

PARAMS = "*.weight"
SETTINGS = {
    "cells 10% 1:1": dict(kind="cell", rate=0.1, sa1_fraction=0.5),
    "cells 30% 1:1": dict(kind="cell", rate=0.3, sa1_fraction=0.5),
    "cells 50% 1:1": dict(kind="cell", rate=0.5, sa1_fraction=0.5),
    "cells 10% 5:1": dict(kind="cell", rate=0.1, sa1_fraction=5 / 6),
    "cells 30% 5:1": dict(kind="cell", rate=0.3, sa1_fraction=5 / 6),
    "cells 50% 5:1": dict(kind="cell", rate=0.5, sa1_fraction=5 / 6),
    "stuck bits 1e-3": dict(kind="bit", rate=1e-3),
    # cell_faults' SA1 cells read +-high with the sign of the weight drawn there (the unmapped placement is then
    # already the best for them); here each SA1 cell's sign is its own (the array it sits in), drawn per cell
    "cells 30% 1:1, SA1 sign per cell": dict(kind="cell", rate=0.3, sa1_fraction=0.5, own_sign=True),
    "cells 30% 5:1, SA1 sign per cell": dict(kind="cell", rate=0.3, sa1_fraction=5 / 6, own_sign=True),
    "cells 50% 5:1, SA1 sign per cell": dict(kind="cell", rate=0.5, sa1_fraction=5 / 6, own_sign=True),
}
QUICK = ("cells 30% 1:1", "stuck bits 1e-3")


def digits() -> tuple[torch.Tensor, ...]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        result = float((model(x).argmax(1) == y).float().mean())
    model.train()
    return result


def batches(n: int, size: int, seed: int) -> list[torch.Tensor]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return [order[i:i + size] for i in range(0, n, size)]


def pretrain(seed: int, data: tuple[torch.Tensor, ...], epochs: int) -> nn.Module:
    x, y, _, _ = data
    torch.manual_seed(seed)
    model = SmallCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for epoch in range(epochs):
        for index in batches(len(y), 64, seed * 100 + epoch):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[index]), y[index]).backward()
            optimizer.step()
    return model


def draw(model: nn.Module, setting: dict[str, Any], seed: int) -> list[Any]:
    if setting["kind"] == "cell":
        pins = cell_faults(model, PARAMS, setting["rate"], sa1_fraction=setting["sa1_fraction"], seed=seed)
        if setting.get("own_sign"):
            signs = torch.Generator().manual_seed(10_000 + seed)
            pins = [dataclasses.replace(p, value=p.value.abs() * (torch.randint(0, 2, p.value.shape, generator=signs)
                                                                  * 2 - 1).to(p.value.dtype)) for p in pins]
        return pins
    return bit_faults(model, PARAMS, setting["rate"], seed=seed)


def retrain(model: nn.Module, faults: list[Any], data: tuple[torch.Tensor, ...], epochs: int, baseline: float,
            seed: int) -> dict[str, Any]:
    """Forced accuracy (faults in, no retraining), then retraining with the faults pinned: final accuracy, the
    first step (checked every 5) back within 1 point of the baseline, seconds per epoch."""
    x, y, vx, vy = data
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    recovered: Optional[int] = None
    step, started = 0, time.perf_counter()
    with pin(model, optimizer, faults) as handle:  # pin() forces the faulty cells now
        forced = accuracy(model, vx, vy)
        if forced >= baseline - 0.01:
            recovered = 0
        for epoch in range(epochs):
            for index in batches(len(y), 64, 1000 + seed * 100 + epoch):
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x[index]), y[index]).backward()
                optimizer.step()
                step += 1
                if recovered is None and step % 5 == 0 and accuracy(model, vx, vy) >= baseline - 0.01:
                    recovered = step
        handle.verify()
        final = accuracy(model, vx, vy)
    epoch_seconds = (time.perf_counter() - started) / max(epochs, 1)
    return {"forced": forced, "final": final, "recovered": recovered, "epoch_seconds": epoch_seconds}


def ratio(mapped: list[float], unmapped: list[float]) -> Optional[float]:
    values = [m for m in mapped if m is not None], [u for u in unmapped if u is not None]
    if not values[0] or not values[1] or statistics.mean(values[1]) == 0:
        return None
    return statistics.mean(values[0]) / statistics.mean(values[1])


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 seed, two settings, 1 epoch")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2, help="retraining epochs (22 steps each)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import scipy.optimize  # noqa: F401  imported once here, so the first mapping's time is the mapping's
    import torch.fx as _fx  # noqa: F401

    seeds, epochs = (1, 1) if args.quick else (args.seeds, args.epochs)
    settings = {k: SETTINGS[k] for k in QUICK} if args.quick else SETTINGS
    data = digits()
    results: dict[str, Any] = {}
    for seed in range(seeds):
        base = pretrain(seed, data, epochs=3 if args.quick else 8)
        baseline = accuracy(base, data[2], data[3])
        for label, setting in settings.items():
            faults = draw(base, setting, seed)
            entry = results.setdefault(label, {"unmapped": [], "mapped": [], "map_seconds": [], "baseline": []})
            entry["baseline"].append(baseline)
            for which in ("unmapped", "mapped"):
                model = copy.deepcopy(base)
                train_faults = faults
                row: dict[str, Any] = {}
                if which == "mapped":
                    mapping = remap(model, faults, data[2][:8], seed=seed)
                    counted = remap(copy.deepcopy(base), faults, data[2][:8], cost="count", max_rounds=0)
                    row.update(l2=mapping.cost_after, changed=sum(mapping.damaged_after.values()))
                    entry["unmapped"][-1].update(l2=mapping.cost_before, changed=counted.cost_before)
                    entry["map_seconds"].append(mapping.seconds)
                    train_faults = mapping.faults
                row.update(retrain(model, train_faults, data, epochs, baseline, seed))
                entry[which].append(row)
    table = {}
    for label, entry in results.items():
        mapped, unmapped = entry["mapped"], entry["unmapped"]

        def column(rows: list[dict[str, Any]], key: str) -> list[Any]:
            return [r[key] for r in rows]

        epoch = statistics.mean(column(unmapped, "epoch_seconds"))
        table[label] = {
            "damage l2": ratio(column(mapped, "l2"), column(unmapped, "l2")),
            "weights changed": ratio(column(mapped, "changed"), column(unmapped, "changed")),
            "forced acc": ratio(column(mapped, "forced"), column(unmapped, "forced")),
            "final acc": ratio(column(mapped, "final"), column(unmapped, "final")),
            "steps to recover": ratio(column(mapped, "recovered"), column(unmapped, "recovered")),
            "recovered": f"{sum(r is not None for r in column(mapped, 'recovered'))}/"
                         f"{sum(r is not None for r in column(unmapped, 'recovered'))} of {len(mapped)}",
            "forced (unmapped, mapped)": (statistics.mean(column(unmapped, "forced")),
                                          statistics.mean(column(mapped, "forced"))),
            "map time / epoch": statistics.mean(entry["map_seconds"]) / epoch,
        }
    print(f"digits CNN, {seeds} seed(s), {epochs} retraining epoch(s); ratios mapped / unmapped "
          f"(baseline accuracy {statistics.mean(results[next(iter(results))]['baseline']):.3f})")
    header = ("setting", "damage l2", "weights changed", "forced acc", "final acc", "steps to recover",
              "recovered (m/u)", "map time / epoch")
    print(" | ".join(header))
    for label, row in table.items():
        cells = [label] + [("n/a" if row[k] is None else f"{row[k]:.3f}") for k in header[1:6]]
        cells += [row["recovered"], f"{row['map time / epoch']:.3f}"]
        print(" | ".join(cells))
    if args.json:
        args.json.write_text(json.dumps({"table": table, "runs": results}, indent=2, default=str) + "\n")
    return table


if __name__ == "__main__":
    main()
