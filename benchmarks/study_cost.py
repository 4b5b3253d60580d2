"""What a fault study costs over the training it runs: ``lightning-pin faults`` against a plain ``Trainer.fit``.

    python benchmarks/study_cost.py              # a 1.2M-parameter ResNet-like CNN, 4-job study, 3 rounds
    python benchmarks/study_cost.py --smoke      # tiny sizes, one round (tests/test_study_cost.py runs it)
    python benchmarks/study_cost.py --figure docs/study_cost.png   # also draw the figure of the performance page

One process, after a warm-up: each round times a plain ``Trainer.fit`` of the job's steps (the same
model loaded from the same baseline, the same data, epochs, batches and validations, a fresh
Trainer) and then a 4-job study (``run_study``, in this process, from that baseline:
``ckpt_path=``), side by side. The study's time per job is its whole wall time (composing the
config, every job, counting the changed bits, the CSV, the figure) divided by its jobs. It prints
each round's ratio and their median, and the bytes each job keeps against the bytes of the weights.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

__all__ = ["SmallResNet", "main", "measure"]

HERE = Path(__file__).resolve().parent


class Block(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with batch norm, and a 1x1 projection when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.skip(x))


class SmallResNet(nn.Module):
    """A ResNet-like CNN: a 3x3 stem, one basic block per width (the first at stride 1, the others 2), global
    average pooling and a linear head. The default widths make 1.2M parameters.

    Example::

        >>> net = SmallResNet(num_classes=10)
        >>> sum(p.numel() for p in net.parameters()) > 1_000_000, tuple(net(torch.zeros(2, 3, 16, 16)).shape)
        (True, (2, 10))
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, widths: Sequence[int] = (32, 64, 128, 256)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU())
        blocks, cin = [], widths[0]
        for i, width in enumerate(widths):
            blocks.append(Block(cin, width, 1 if i == 0 else 2))
            cin = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def _overrides(args: argparse.Namespace) -> list[str]:
    widths = ",".join(str(w) for w in args.widths)
    return [
        "model=custom", "model._target_=study_cost.SmallResNet", f"+model.widths=[{widths}]",
        *args.data, f"data.batch_size={args.batch}",
        f"trainer.max_epochs={args.epochs}", f"trainer.limit_train_batches={args.train_batches}",
        f"trainer.limit_val_batches={args.val_batches}", f"pretrain.max_epochs={args.epochs}",
        "callbacks.pin_callback.verbose=false",
    ]


def _plain_fit(cfg: Any, ckpt: str) -> int:
    """A plain Trainer.fit of the job's steps (its steps): the same model, baseline, data and validations."""
    import lightning.pytorch as pl
    from hydra.utils import instantiate

    from lightning_pin.app.custom import build_datamodule, build_model
    from lightning_pin.app.train import load_weights

    model = build_model(cfg, instantiate(cfg.optimizer, _convert_="all"), announce=False).model
    load_weights(model, ckpt)
    datamodule = build_datamodule(cfg)
    trainer = pl.Trainer(max_epochs=cfg.trainer.max_epochs, limit_train_batches=cfg.trainer.limit_train_batches,
                         limit_val_batches=cfg.trainer.limit_val_batches, num_sanity_val_steps=0,
                         log_every_n_steps=cfg.trainer.log_every_n_steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule)
    return trainer.global_step


def _quiet(call: Any) -> Any:
    """Run ``call()`` with its output into a log (the study prints its stages and table)."""
    import contextlib
    import io

    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        return call()


def measure(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The rounds' times and ratios, and the bytes kept per job (see the module's docstring)."""
    import logging

    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    lightning_log.setLevel(logging.WARNING)  # the plain fits' Trainer banners
    sys.path.insert(0, str(HERE))  # model._target_=study_cost.SmallResNet
    try:
        return _measure(args, out)
    finally:
        # As they were: tests/test_study_cost.py runs this in a test process, whose later tests read Lightning's
        # INFO lines (caplog).
        sys.path.remove(str(HERE))
        lightning_log.setLevel(level)


def _measure(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_pin.app.compose import compose_app
    from lightning_pin.app.study import Study, run_study
    from lightning_pin.app.train import run

    overrides = _overrides(args)
    cfg = compose_app([*overrides, "pin=faults", "pretrain.only=true"], (out / "baseline").resolve())
    _quiet(lambda: run(cfg))  # the baseline every round starts from, and the imports, warm
    ckpt = str((out / "baseline" / "pretrained.ckpt").resolve())
    job_cfg = compose_app([*overrides, "pin=faults"], (out / "plain").resolve())
    pl.seed_everything(0, verbose=False)
    rounds = []
    for index in range(args.rounds):
        wall, cpu = time.perf_counter(), time.process_time()
        steps = _quiet(lambda: _plain_fit(job_cfg, ckpt))
        plain, plain_cpu = time.perf_counter() - wall, time.process_time() - cpu
        study_dir = out / f"study{index}"
        study = Study(kind=args.kind, rates=tuple(args.rates), seeds=args.seeds, out=str(study_dir),
                      overrides=(*overrides, f"ckpt_path={ckpt}"))
        wall, cpu = time.perf_counter(), time.process_time()
        status = _quiet(lambda: run_study(study))
        seconds, study_cpu = time.perf_counter() - wall, time.process_time() - cpu
        if status != 0:
            raise SystemExit(f"the study failed: see {study_dir / 'study.log'}")
        jobs = len(args.rates) * args.seeds
        rounds.append({"plain": plain, "steps": steps, "study": seconds, "per_job": seconds / jobs,
                       "ratio": seconds / jobs / plain, "cpu_ratio": study_cpu / jobs / plain_cpu})
        print(f"round {index + 1}: plain fit {plain:.2f} s ({steps} steps, cpu {plain_cpu:.2f} s); study "
              f"{seconds:.2f} s for {jobs} jobs (cpu {study_cpu:.2f} s), {seconds / jobs:.2f} s a job: "
              f"{seconds / jobs / plain:.2f}x (cpu {study_cpu / jobs / plain_cpu:.2f}x)", flush=True)
    model = SmallResNet(widths=args.widths)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    kept = {}
    for job in sorted((out / "study0" / "jobs").iterdir()):
        files = {p.relative_to(job).as_posix(): p.stat().st_size for p in job.rglob("*") if p.is_file()}
        kept[job.name] = files
    return {"rounds": rounds, "weights": weights, "kept": kept,
            "parameters": sum(p.numel() for p in model.parameters())}


def report(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    ratios = [r["ratio"] for r in result["rounds"]]
    lines = [f"{result['parameters']:,} parameters ({result['weights']:,} bytes of weights), "
             f"{args.kind} faults at rates {', '.join(f'{r:g}' for r in args.rates)} x {args.seeds} seed(s)",
             f"time a job / a plain Trainer.fit of the same {result['rounds'][0]['steps']} steps: median "
             f"{statistics.median(ratios):.2f}x over {len(ratios)} round(s) ({', '.join(f'{r:.2f}' for r in ratios)}); "
             f"in CPU time of the process {statistics.median(r['cpu_ratio'] for r in result['rounds']):.2f}x"]
    for name, files in result["kept"].items():
        total = sum(files.values())
        big = ", ".join(f"{f} {size / 1e6:.2f} MB" for f, size in sorted(files.items(), key=lambda i: -i[1])[:3])
        lines.append(f"  {name}: keeps {total / 1e6:.2f} MB = {total / result['weights']:.3f}x the weights ({big})")
    return lines


def figure(result: dict[str, Any], path: Path) -> None:
    """Two panels: time per job over the plain fit's, round by round (wall and CPU time), and the bytes each job
    keeps over the bytes of the weights, by file."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.4, 3.6), dpi=120)
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.3]})
    rounds = result["rounds"]
    xs = list(range(1, len(rounds) + 1))
    for shift, key, color, label in ((-0.18, "ratio", "tab:blue", "wall time"), (0.18, "cpu_ratio", "tab:cyan",
                                                                                   "CPU time of the process")):
        values = [r[key] for r in rounds]
        left.bar([x + shift for x in xs], values, 0.36, color=color, label=label)
        for x, v in zip(xs, values):
            left.text(x + shift, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    left.axhline(1.0, color="black", lw=0.8)
    left.axhline(1.5, color="tab:red", ls="--", lw=1, label="goal: 1.5x")
    left.set_xticks(xs, [f"round {x}" for x in xs], fontsize=8)
    left.set_ylim(0, max(2.0, max(r["ratio"] for r in rounds) * 1.15))
    left.set_ylabel("a study's time per job / a plain fit's")
    median = statistics.median(r["ratio"] for r in rounds)
    left.set_title(f"time: median {median:.2f}x a plain Trainer.fit\n({rounds[0]['steps']} steps, one process)",
                   fontsize=9)
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, frameon=False)
    names = list(result["kept"])
    groups = {"pinned.safetensors": "tab:blue", "fault_map.pt": "tab:red", "pins.pt": "tab:orange"}
    bottom = [0.0] * len(names)
    for file, color in [*groups.items(), ("other", "0.6")]:
        sizes = [sum(s for f, s in result["kept"][n].items() if (f == file if file != "other" else f not in groups))
                 / result["weights"] for n in names]
        right.bar(range(len(names)), sizes, 0.6, bottom=bottom, color=color,
                  label=file if file != "other" else "the rest (summary, log, metrics)")
        bottom = [b + s for b, s in zip(bottom, sizes)]
    for x, total in enumerate(bottom):
        right.text(x, total, f"{total:.3f}", ha="center", va="bottom", fontsize=7)
    right.axhline(1.1, color="tab:red", ls="--", lw=1, label="goal: 1.1x")
    labels = [n.split("_rate")[1].replace("_seed", "\nseed ") for n in names]
    right.set_xticks(range(len(names)), [f"rate {label}" for label in labels], fontsize=7)
    right.set_ylim(0, 1.3)
    right.set_ylabel("bytes a job keeps / bytes of the weights")
    right.set_title(f"bytes: weights {result['weights'] / 1e6:.1f} MB, {result['parameters']:,} parameters",
                    fontsize=9)
    right.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--figure", type=Path, help="draw the figure into this PNG")
    parser.add_argument("--keep", type=Path, help="keep the runs in this directory")
    args = parser.parse_args(list(argv))
    torch.set_num_threads(1)
    args.widths, args.kind, args.rates, args.seeds = (32, 64, 128, 256), "value", [0.001, 0.01], 2
    args.data = ["data=fake_images", "data.shape=[3,32,32]", "data.num_samples=2048"]
    args.batch, args.epochs, args.train_batches, args.val_batches = 32, 2, 16, 2
    if args.smoke:
        args.widths, args.rounds, args.train_batches, args.val_batches = (4, 8), 1, 2, 1
        args.data = ["data=fake_images", "data.shape=[3,8,8]", "data.num_samples=128"]
        args.batch = 16
    if os.environ.get("STUDY_COST_DATA"):  # another data option, e.g. before data=fake_images existed
        args.data = os.environ["STUDY_COST_DATA"].split()
    out = args.keep or Path(tempfile.mkdtemp(prefix="study_cost_"))
    try:
        result = measure(args, out)
        for line in report(result, args):
            print(line)
        if args.figure is not None:
            figure(result, args.figure)
            print(f"wrote {args.figure}")
    finally:
        if args.keep is None:
            shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
