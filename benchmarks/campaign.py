"""What a fault campaign costs beyond its training and its evaluations, measured side by side in one run.

    python benchmarks/campaign.py              # the three ratios (a few minutes on 2 CPU cores)
    python benchmarks/campaign.py --smoke      # the same sections on a tiny budget: runs, figures meaningless (tests)
    python benchmarks/campaign.py --json F     # also write the figures to F

(a) study overhead: the wall time of ``lightning-pin faults --kind cell --rates 0,0.1,0.2,0.3 --seeds 2 --jobs 2
    experiment=fault_study`` (a fresh command, as a user runs it: start-up, imports, composing, plotting) over
    what its training costs: the baseline's seconds plus the sum of the jobs' seconds divided by the jobs that
    run at a time. Goal <= 1.3.
(b) ``--no-retrain`` per draw over a hand-written loop doing the same work on the same model and batches: draw
    the faults (``cell_faults``), write them into the weights, evaluate, restore. Goal <= 1.15.
(c) drawing the faults of one draw over one forced evaluation, for ``bit_faults`` (rate 1e-3) and
    ``cell_faults`` (rate 0.1), on the study's model and on the app's digits CNN. Goal <= 0.2.

(b) and (c) are interleaved round by round (each round times both sides), so machine noise hits both alike; the
median round is reported, with every round's ratio.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

#: The study of (a), as the issue measured it.
STUDY = ["--kind", "cell", "--rates", "0,0.1,0.2,0.3", "--seeds", "2", "--jobs", "2", "experiment=fault_study"]
#: --smoke: one epoch of a few batches, two rates, one seed.
SMOKE = ["--kind", "cell", "--rates", "0,0.2", "--seeds", "1", "--jobs", "2", "experiment=fault_study",
         "pretrain.max_epochs=1", "trainer.max_epochs=1", "trainer.limit_train_batches=2",
         "callbacks.pin_callback.verbose=false", "callbacks.pin_callback.monitor.report=false"]


class _Forked:
    """``subprocess.Popen([python, "-m", "lightning_pin.cli", *argv], stdout=PIPE, stderr=PIPE, text=True)`` as a
    fork of this process, which imported torch already (--smoke: the same command, its lines through the same
    pipe, without an interpreter's start-up and imports; the figures mean nothing there anyway)."""

    def __init__(self, argv: list[str]) -> None:
        read, write = os.pipe()
        self._err = tempfile.TemporaryFile(mode="w+")  # a file: a full stderr pipe would block the child
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            self._child(argv, read, write)
        os.close(write)
        self.stdout = os.fdopen(read)
        self.returncode: int | None = None

    def _child(self, argv: list[str], read: int, write: int) -> None:
        import logging
        import traceback

        status = 1
        try:
            os.close(read)
            os.dup2(write, 1)
            os.dup2(self._err.fileno(), 2)
            # The old streams stay referenced: collected, those that own fds 1 and 2 would close them.
            inherited = sys.stdout, sys.stderr  # noqa: F841
            sys.stdout, sys.stderr = (open(fd, "w", buffering=1, closefd=False) for fd in (1, 2))
            from lightning_pin.cli import main

            status = main(argv)
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            # No atexit handlers: they are this process's parent's too (its temporary directories among them).
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)

    @property
    def stderr(self) -> io.TextIOBase:
        self._err.seek(0)
        return self._err

    def wait(self, timeout: float | None = None) -> int:
        self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


def study_overhead(out: Path, args: list[str], fresh: bool = True) -> dict[str, Any]:
    """(a): run the study as a command; its wall time over baseline + sum(job seconds) / jobs. ``fresh=False``
    (--smoke): the command in a fork of this process (see :class:`_Forked`), not a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    started = time.perf_counter()
    command = ["faults", *args, "--out", str(out)]
    process = (subprocess.Popen([sys.executable, "-m", "lightning_pin.cli", *command], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) if fresh
               else _Forked(command))
    timed = [(time.perf_counter() - started, line.rstrip("\n")) for line in process.stdout]  # each line when it came
    stderr = process.stderr.read()
    process.wait(timeout=3600)
    wall = time.perf_counter() - started
    if process.returncode != 0:
        raise SystemExit(f"the study failed ({process.returncode}):\n{timed[-20:]}\n{stderr[-3000:]}")
    baseline = json.loads((out / "baseline" / "run_summary.json").read_text())["seconds"]
    jobs = [json.loads(p.read_text())["seconds"] for p in (out / "jobs").glob("*/run_summary.json")]
    workers = int(args[args.index("--jobs") + 1])
    training = baseline + sum(jobs) / workers
    def at(prefix: str) -> float:
        return next((t for t, line in timed if line.startswith(prefix)), math.nan)

    # Where the wall time went, from when each stage's first line arrived.
    stages = {
        "start-up until the first line (python, import lightning_pin)": at("lightning-pin faults:"),
        "imports of the app (torch, Lightning, Hydra)": at("composing the job config") - at("lightning-pin faults:"),
        "composing": at("baseline:") - at("composing the job config"),
        "baseline": at("fault curve:") - at("baseline:"),
        "jobs": at("counting the stored bits") - at("fault curve:"),
        "changed_bits, plots, table, exit": wall - at("counting the stored bits"),
    }
    gaps = [b[0] - a[0] for a, b in zip(timed, timed[1:])]
    startup = stages["start-up until the first line (python, import lightning_pin)"] + stages[
        "imports of the app (torch, Lightning, Hydra)"]
    return {"wall_s": round(wall, 2), "baseline_s": baseline, "jobs": len(jobs), "job_s_sum": round(sum(jobs), 2),
            "workers": workers, "training_s": round(training, 2), "ratio": round(wall / training, 3),
            "progress_lines": len(timed), "stages_s": {k: round(v, 2) for k, v in stages.items()},
            "longest_silence_after_first_line_s": round(max(gaps, default=0.0), 2),
            # What a longer campaign tends to: the fixed start-up of a Python process that imports torch and
            # Lightning left out, and the jobs' phase alone.
            "ratio_after_imports": round((wall - startup) / training, 3),
            "jobs_phase_ratio": round(stages["jobs"] / (sum(jobs) / workers), 3)}


def _campaign(out: Path, overrides: list[str]) -> Any:
    """The study's own campaign (the model, its validation batches, the baseline) on the study's baseline."""
    from lightning_pin.app import study as study_module

    study = study_module.Study(kind="cell", rates=(0.1,), seeds=1, no_retrain=True, overrides=tuple(overrides))
    template = study_module._compose(study, study_module._compose_overrides(study), out / "bench")
    progress = study_module.Progress(io.StringIO())
    return study_module, study_module.ForcedCampaign(template, str(out / "baseline" / "pretrained.ckpt"), progress)


def _hand_loop(model: torch.nn.Module, batches: list[Any], params: str, rate: float, seeds: range) -> list[float]:
    """The same work written by hand: draw, write the faulty values, evaluate, restore (no library campaign)."""
    from lightning_pin.faults import cell_faults

    named = dict(model.named_parameters())
    accuracies = []
    for seed in seeds:
        pins = cell_faults(model, params, rate, seed=seed)
        saved = []
        with torch.no_grad():
            for pin in pins:
                flat = named[pin.params].data.view(-1)  # the generators name each parameter exactly
                strides = torch.tensor(named[pin.params].stride())
                index = (pin.indices * strides).sum(dim=1)
                saved.append((flat, index, flat[index].clone()))
                flat[index] = pin.value
            correct = total = 0
            for x, y in batches:
                correct += int((model(x).argmax(1) == y).sum())
                total += y.numel()
            for flat, index, old in saved:
                flat[index] = old
        accuracies.append(float(torch.tensor(correct) / torch.tensor(total)))  # as a torch metric divides
    return accuracies


def no_retrain_per_draw(out: Path, overrides: list[str], draws: int, rounds: int) -> dict[str, Any]:
    """(b): the study's --no-retrain loop against the hand-written one, per draw, interleaved."""
    study_module, campaign = _campaign(out, overrides)
    params = str(campaign.template.pin.params)
    jobs = [study_module.Job("cell", 0.1, seed) for seed in range(draws)]
    ours, theirs = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        rows = campaign.run(jobs, "bench")
        ours.append((time.perf_counter() - started) / draws)
        started = time.perf_counter()
        hand = _hand_loop(campaign.model, campaign.batches, params, 0.1, range(draws))
        theirs.append((time.perf_counter() - started) / draws)
        # The same work: the hand loop's accuracies are the campaign's (sorted by seed, one rate).
        assert [r["forced"] for r in rows] == hand, "the two loops disagree"
    campaign.check_restored()
    ratios = [a / b for a, b in zip(ours, theirs)]
    return {"draws": draws, "ours_ms": round(1e3 * statistics.median(ours), 3),
            "hand_ms": round(1e3 * statistics.median(theirs), 3), "ratio": round(statistics.median(ratios), 3),
            "rounds": [round(r, 3) for r in ratios]}


def _timed(fn: Callable[[], Any], repeat: int) -> float:
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - started) / repeat


def drawing_over_evaluation(out: Path, overrides: list[str], rounds: int, repeat: int) -> dict[str, Any]:
    """(c): one draw of bit_faults / cell_faults over one forced evaluation, on the study's model and the CNN."""
    from lightning_pin.faults import bit_faults, cell_faults

    _, study_campaign = _campaign(out, overrides)
    models = {"fault_study MLP": study_campaign}
    cnn_ckpt = out / "cnn.ckpt"
    # The app's default model (the digits CNN) with the same weights file layout; its own untrained weights do.
    from lightning_pin.app import study as study_module

    cnn_study = study_module.Study(kind="bit", rates=(1e-3,), seeds=1, no_retrain=True,
                                   overrides=tuple(o for o in overrides if not o.startswith("experiment")))
    cnn_template = study_module._compose(cnn_study, study_module._compose_overrides(cnn_study), out / "bench")
    from hydra.utils import instantiate

    make = instantiate(cnn_template.model, _partial_=True, _convert_="all")
    cnn = make(optimizer=instantiate(cnn_template.optimizer))
    torch.save({"state_dict": cnn.state_dict()}, cnn_ckpt)
    models["digits CNN"] = study_module.ForcedCampaign(cnn_template, str(cnn_ckpt), study_campaign.progress)
    results: dict[str, Any] = {}
    for label, campaign in models.items():
        params = campaign.template.pin.params
        params = list(params) if not isinstance(params, str) else params
        for kind, draw in (("bit_faults 1e-3", lambda m=campaign.model, p=params: bit_faults(m, p, 1e-3, seed=1)),
                           ("cell_faults 0.1", lambda m=campaign.model, p=params: cell_faults(m, p, 0.1, seed=1))):
            ratios, drawing, evaluating = [], [], []
            for _ in range(rounds):
                d = _timed(draw, repeat)
                e = _timed(campaign.evaluate, repeat)
                drawing.append(d)
                evaluating.append(e)
                ratios.append(d / e)
            results[f"{label}: {kind}"] = {
                "draw_ms": round(1e3 * statistics.median(drawing), 3),
                "evaluate_ms": round(1e3 * statistics.median(evaluating), 3),
                "ratio": round(statistics.median(ratios), 3), "rounds": [round(r, 3) for r in ratios],
                "elements": sum(campaign.sizes[n] for n in campaign.sizes if _matches(n, params)),
            }
    return results


def _matches(name: str, params: Any) -> bool:
    from fnmatch import fnmatchcase

    return any(fnmatchcase(name, p) for p in ([params] if isinstance(params, str) else params))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny budget: every section runs, figures meaningless")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    # One thread, as the app's jobs run (torch_threads=1): tiny models gain nothing from a second thread, and
    # on a shared machine waking it costs milliseconds per operation.
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    with tempfile.TemporaryDirectory(prefix="campaign_") as tmp:
        out = Path(tmp) / "study"
        overrides = ["experiment=fault_study"] + (SMOKE[SMOKE.index("experiment=fault_study") + 1:] if args.smoke
                                                  else [])
        if args.smoke:
            # (a) forks this process: what the study imports (the app, and scikit-learn for the digits, which
            # (b) and (c) load again here) is then imported once, not in the fork and again here.
            import sklearn.datasets  # noqa: F401

            import lightning_pin.app.study  # noqa: F401
        print("(a) the study as a command ...", flush=True)
        a = study_overhead(out, SMOKE if args.smoke else STUDY, fresh=not args.smoke)
        print("(b) --no-retrain per draw against a hand-written loop ...", flush=True)
        b = no_retrain_per_draw(out, overrides, draws=4 if args.smoke else 200, rounds=2 if args.smoke else 9)
        print("(c) drawing against one forced evaluation ...", flush=True)
        c = drawing_over_evaluation(out, overrides, rounds=2 if args.smoke else 7, repeat=2 if args.smoke else 20)
    after = os.getloadavg() if hasattr(os, "getloadavg") else None
    results = {"study_overhead": a, "no_retrain_per_draw": b, "drawing_over_evaluation": c,
               "load_average_before": load, "load_average_after": after, "threads": torch.get_num_threads(),
               "torch": torch.__version__, "smoke": args.smoke}
    print(f"\nload average before {load}, after {after}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"(a) study wall / (baseline + sum of job seconds / jobs): {a['ratio']:.3f}  (goal <= 1.3)\n"
          f"    wall {a['wall_s']:.1f} s; baseline {a['baseline_s']:.1f} s + {a['job_s_sum']:.1f} s of {a['jobs']} jobs"
          " / "
          f"{a['workers']} = {a['training_s']:.1f} s; {a['progress_lines']} lines printed, the longest silence "
          f"after the first {a['longest_silence_after_first_line_s']:.1f} s")
    print(f"    without the start-up and imports: {a['ratio_after_imports']:.3f}; the jobs' phase alone (its wall "
          f"/ sum of job seconds / jobs): {a['jobs_phase_ratio']:.3f}")
    for stage, seconds in a["stages_s"].items():
        print(f"      {stage}: {seconds:.1f} s")
    print(f"(b) --no-retrain per draw / hand-written loop: {b['ratio']:.3f}  (goal <= 1.15)\n"
          f"    {b['ours_ms']:.2f} ms against {b['hand_ms']:.2f} ms per draw over {b['draws']} draws; "
          f"rounds {b['rounds']}")
    print("(c) drawing / one forced evaluation  (goal <= 0.2)")
    for label, row in c.items():
        print(f"    {label}: {row['ratio']:.3f}  ({row['draw_ms']:.3f} ms against {row['evaluate_ms']:.3f} ms; "
              f"{row['elements']:,} elements; rounds {row['rounds']})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
