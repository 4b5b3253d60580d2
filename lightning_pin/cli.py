"""The ``lightning-pin`` command: the Hydra app (``train``), its reports, checks, exports and studies.

    lightning-pin train [OVERRIDES]     # python -m lightning_pin.train [OVERRIDES]: pretrain, pin, retrain, report
    lightning-pin report RUN_DIR        # pin_report.json / .png from a run's metrics.csv or TensorBoard events
    lightning-pin diff A.ckpt B.ckpt    # what changed between two checkpoints; do saved pins hold in B?
    lightning-pin check PINNED FILE...  # do the saved pins hold in exported models?
    lightning-pin export RUN_DIR [--to FILE.safetensors|FILE.onnx]   # an app run's pinned model, exported
    lightning-pin faults [--kind K] [--rates R1,R2] [--seeds N] [--no-retrain] [--remap] [--jobs J] [--launcher L] [--out DIR]
                         [--config-dir DIR] [OVERRIDES]
                                        # accuracy against the fault rate, forced and retrained (a study)
    lightning-pin tune [--trials N] [--param KEY=SPEC] [--objectives final:max,...] [--config-dir DIR] [OVERRIDES]
                                        # Optuna >= 3 over the app (SQLite, pruning, NSGA-II Pareto front)


Each subcommand is one function (``_<name>(args) -> exit status``) and one entry of :data:`COMMANDS`.

Exit status: 1 when a pin is off target (``diff``: a saved pin does not hold in B), so scripts and
CI can gate on it; 2 with one line naming the file (and row) when an input is missing, empty or
unreadable, when ``report`` would replace a report holding more data, or when ``diff`` is given two
checkpoints that share no tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn, Optional

__all__ = ["BAD_INPUT", "COMMANDS", "DEFAULT_EXPORT", "SUMMARIES", "TAKES_OVERRIDES", "build_parser", "main"]


#: Exit status for bad input (missing, empty or unreadable files; data that would be lost; usage).
BAD_INPUT = 2
#: What ``export`` writes without ``--to``: inside the run directory (under ``outputs/``, which git ignores).
DEFAULT_EXPORT = "model.safetensors"

#: Every subcommand and its one-line summary (the ``--help`` description lists them all).
SUMMARIES = {
    "train": "the Hydra app: pretrain, pin, retrain with PinCallback, verify, report",
    "report": "rebuild a run's pin_report.json / .png from its metrics.csv or TensorBoard events",
    "diff": "which tensors changed between two checkpoints; do saved pins hold in the second?",
    "check": "do the pins a checkpoint saved hold, bit for bit, in exported models?",
    "export": "write an app run's pinned model as .safetensors or .onnx (then `check` it)",
    "faults": "a fault study: accuracy against the fault rate, forced and retrained, over seeds",
    "tune": "an Optuna (>= 3) search over the app, one objective or a Pareto front of several",
}


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors in one line (status 2), like every other error of the command."""

    def error(self, message: str) -> NoReturn:
        self.exit(BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from lightning_pin import __version__

    parser = _Parser(
        prog="lightning-pin",
        description="Pin chosen parameters to exact values while the rest trains, and check that they held. "
        f"Commands: {', '.join(SUMMARIES)} (below; `lightning-pin COMMAND --help` for each).",
    )
    parser.add_argument("--version", action="version", version=f"lightning-pin {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # Listed for --help only: main() hands everything after "train" to Hydra untouched.
    train = commands.add_parser(
        "train",
        help=SUMMARIES["train"] + " (Hydra overrides follow)",
        description="Same as python -m lightning_pin.train (--config-dir DIR adds your config directory); see "
        "`lightning-pin train --help` for Hydra's help.",
    )
    train.add_argument("overrides", nargs=argparse.REMAINDER, help="Hydra overrides, -m for a multirun, --cfg job, ...")

    report = commands.add_parser(
        "report",
        help=SUMMARIES["report"],
        description="Rebuild the report of a run from the pin/... metrics it logged: a CSVLogger's metrics.csv or "
        "TensorBoard's event files (Lightning's default logger). Never overwrites a file that is not a report.",
    )
    report.add_argument(
        "run_dir", help="the run's log directory (metrics.csv or events.out.tfevents.*), or a parent of it"
    )
    report.add_argument("--out", help="where to write the report files (default: the app run directory the "
                        "metrics are in, else beside metrics.csv)")
    report.add_argument("--metric", help="name of the tracked metric (default: found in the CSV)")
    report.add_argument("--tolerance", type=float, help="gap that counts as recovered (default: as logged, or 0.01)")
    report.add_argument(
        "--lower-is-better", action="store_true", default=None, help="the metric is an error (MSE, ...), not a score"
    )
    report.add_argument("--no-plot", action="store_true", help="skip pin_report.png")
    report.add_argument("--allow-truncated", action="store_true",
                        help="report a TensorBoard event file that ends inside a record (a cut run) up to the cut")
    report.add_argument(
        "--force", action="store_true", help="replace an existing pin_report.json even if it holds more data"
    )

    diff = commands.add_parser(
        "diff",
        help=SUMMARIES["diff"],
        description="Compare the weights of two checkpoints (Lightning .ckpt, or state dicts in .pt / "
        ".safetensors) and check the pins a saved PinCallback state holds against B. Exit status 1 when a pin "
        "is off target.",
    )
    diff.add_argument("a", help="the earlier checkpoint")
    diff.add_argument("b", help="the later checkpoint")
    diff.add_argument("--changed-only", action="store_true", help="list only the tensors that changed")
    diff.add_argument("--json", action="store_true", help="print the comparison as JSON instead of tables")

    faults = commands.add_parser(
        "faults",
        help="a fault study: accuracy against the fault rate, forced and retrained, over seeds "
        "(Hydra overrides follow)",
        description="Pretrain one baseline (or load ckpt_path=), then for every rate x seed draw the faults, measure "
        "the accuracy with the faults in (forced) and after retraining around them (final, pins verified), and write "
        "fault_curve.csv and fault_curve.png into --out. The same (rate, seed) always draws the same faults; a rerun "
        "with the same --out skips finished jobs. Exit status 2 for bad arguments.",
    )
    faults.add_argument("--kind", help="value (stuck at random values; the default), cell (stuck-at-0/1), bit "
                        "(stuck bits; the default with --deploy), neuron (stuck neurons: output channels of the layers; "
                        "pin.neuron_kind=sa0|sa1|value), flip (transient bit flips; implies --no-retrain)")
    faults.add_argument("--code-bits", type=int, metavar="N", help="--kind bit: stick bits of N-bit integer weight "
                        "codes (one scale per output channel, from the weights; the forward reads the codes) instead "
                        "of float words")
    faults.add_argument("--rates", default="0,0.05,0.1,0.2,0.5", help="fault rates in [0, 1], comma separated "
                        "(0 is the unfaulted control; default: %(default)s)")
    faults.add_argument("--seeds", type=int, default=3, help="fault maps per rate (seeds 0..N-1; default: 3)")
    faults.add_argument("--per-layer", action="store_true",
                        help="also put the faults in one parameter at a time: layer_sensitivity.csv / .png")
    faults.add_argument("--layer-rate", type=float, help="the rate of --per-layer (default: the largest of --rates)")
    faults.add_argument("--no-retrain", action="store_true",
                        help="forced accuracy only (a test-time campaign): every draw in this process, the weights "
                        "restored exactly after each; final, gap and recovered_step stay empty")
    faults.add_argument("--remap", action="store_true",
                        help="map each job's pretrained model onto its faults first (hidden units permuted, function "
                        "kept; pin.remap=true): forced accuracy and retraining start from the mapping; CSV adds "
                        "damage_before, damage_after, remap_seconds")
    faults.add_argument("--jobs", type=int, default=1,
                        help="jobs at a time: workers forked from this process after the imports (default: 1, in "
                        "this process)")
    faults.add_argument("--launcher", choices=None,
                        help="run the jobs through a Hydra multirun on this launcher instead: joblib, submitit_local, "
                        "submitit_slurm (with its hydra.launcher.* overrides)")
    faults.add_argument("--deploy", metavar="TARGET", help="torchao-int8: the test-time campaign (--no-retrain) runs "
                        "on the trained model quantized by torchao, its faults in the stored int8 codes "
                        "(needs pip install 'lightning-pin[deploy]')")
    faults.add_argument("--out", help="the study's directory (default: outputs/faults/<date>/<time>)")
    faults.add_argument("--keep-checkpoints", action="store_true",
                        help="keep each job's full pinned.ckpt (optimizer state included); by default a job keeps "
                        "its summary, its fault map and its pinned weights (pinned.safetensors and pins.pt)")
    faults.add_argument("--config-dir", metavar="DIR", help="a config directory of your own (DIR/model/NAME.yaml, "
                        "DIR/data/NAME.yaml): model=NAME data=NAME then choose from it")
    faults.add_argument("overrides", nargs="*", help="Hydra overrides for every job (recovery=distill, optimizer=sgd)")

    tune = commands.add_parser(
        "tune",
        help="an Optuna (>= 3) search over the app: one objective (TPE, per-epoch pruning) or several (NSGA-II, "
        "Pareto front); Hydra overrides follow",
        description="Each trial composes the app's config with the parameters Optuna asks for and runs the job; the "
        "study is kept in DIR/tune.db (SQLite), so the same command resumes it. Every trial's config is composed "
        "before the first trains (a bad override, --param key or objective: exit 2, one line). One line per trial "
        "(its own output in DIR/trial_N/trial.log), then a table: every trial and DIR/trials.png for one objective, "
        "the Pareto front and DIR/pareto.png for several (and DIR/trials.csv). Needs pip install "
        "'lightning-pin[tune]'.",
    )
    tune.add_argument("--trials", type=int, default=12, help="finished trials the study should hold (default: 12)")
    tune.add_argument("--param", action="append", default=[], metavar="KEY=SPEC",
                      help="a searched key: KEY=float:LOW:HIGH, log:LOW:HIGH, int:LOW:HIGH or choice:A,B "
                      "(repeatable; default: optimizer.lr=log:3e-4:3e-2)")
    tune.add_argument("--objectives", default="final:max",
                      help="KEY:max|min, comma separated: run summary keys (final, gap) or config keys (pin.rate); "
                      "two or more: NSGA-II (default: %(default)s)")
    tune.add_argument("--out", help="the study's directory (default: outputs/tune/<date>/<time>)")
    tune.add_argument("--study-name", default="lightning_pin")
    tune.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    tune.add_argument("--no-prune", action="store_true", help="never prune a trial (single objective)")
    tune.add_argument("--config-dir", metavar="DIR", help="a config directory of your own (DIR/model/NAME.yaml, "
                      "DIR/data/NAME.yaml): model=NAME data=NAME then choose from it")
    tune.add_argument("overrides", nargs="*", help="Hydra overrides for every trial (pin=faults, ckpt_path=...)")

    check = commands.add_parser(
        "check",
        help=SUMMARIES["check"],
        description="Compare every pinned element of each exported model with the target the pinned file saved. "
        "Exit status 0: every pin holds bit for bit; 1: a pinned element is off target or a pinned parameter is "
        "missing (an exporter folded or renamed it?); 2: the check could not run. Stuck code bits are read in the "
        "stored integers of int8 QDQ ONNX models (export --int8) and torchao state dicts. ONNX needs "
        "pip install 'lightning-pin[export]'.",
    )
    check.add_argument(
        "pinned", help="a checkpoint saved by a fit with PinCallback, or a file holding PinHandle.state_dict()"
    )
    check.add_argument(
        "artifacts", nargs="+", metavar="artifact", help="exported models: .onnx, .safetensors, .pt / .pth / .ckpt"
    )

    export = commands.add_parser(
        "export",
        help=SUMMARIES["export"],
        description="Rebuild the model of a `lightning-pin train` run from its .hydra/config.yaml, load pinned.ckpt "
        "and write it, parameter names kept, so that `lightning-pin check RUN_DIR/pinned.ckpt FILE` verifies it. "
        "ONNX needs pip install 'lightning-pin[export]'.",
    )
    export.add_argument("run_dir", help="the run directory (outputs/<date>/<time>)")
    export.add_argument("--to", help="the file to write: a .safetensors or .onnx file (default: "
                        "RUN_DIR/model.safetensors, beside the run's checkpoints)")
    export.add_argument("--force", action="store_true",
                        help="replace an existing --to file even if it is not a model export")
    export.add_argument("--int8", action="store_true",
                        help="with --to FILE.onnx: every weight the run trained with a code as its integer codes "
                        "(int8 / uint8 / int4) and a DequantizeLinear (needs pip install 'lightning-pin[deploy]')")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _cwd_importable()
    if argv[:1] == ["train"]:
        return _train(argv[1:])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command not in TAKES_OVERRIDES and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command in TAKES_OVERRIDES:
            return COMMANDS[args.command](args, extra)
        return COMMANDS[args.command](args)
    except _BadOption as err:
        return _fail(args.command, str(err))


def _cwd_importable() -> None:
    """The current directory on ``sys.path``, as ``python -m`` has it: your ``model._target_`` imports from it.

    A console script's ``sys.path[0]`` is the script's own directory, not the one it was started from.
    """
    cwd = os.getcwd()
    if cwd not in (os.path.abspath(p or os.curdir) for p in sys.path):
        sys.path.insert(0, cwd)


def _train(overrides: Sequence[str]) -> int:
    import runpy

    # Hydra reads its overrides from sys.argv. Running the module as __main__ (as `python -m`
    # does) lets Hydra find conf/ from the module's file rather than as a Python package.
    sys.argv = ["lightning-pin train", *overrides]
    runpy.run_module("lightning_pin.train", run_name="__main__", alter_sys=True)
    return 0


def _fail(command: str, message: str) -> int:
    """One line on stderr, argparse style, and the bad-input status (never 1: that is "off target")."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) > 2:
        # Readers' own messages can run over many lines (torch's unpickler): keep the first
        # (what failed, on which file) and the last (what it must hold).
        lines = [lines[0], "...", lines[-1]]
    print(f"lightning-pin {command}: error: {' '.join(lines)}", file=sys.stderr)
    return BAD_INPUT


def _report(args: argparse.Namespace) -> int:
    from lightning_pin.reporting import report as reporting

    try:
        csv_path = reporting.find_metrics_csv(args.run_dir)
        higher_is_better = None if args.lower_is_better is None else not args.lower_is_better
        report = reporting.report_from_csv(
            csv_path, metric=args.metric, tolerance=args.tolerance, higher_is_better=higher_is_better,
            allow_truncated=args.allow_truncated,
        )
        out = args.out or _run_directory(csv_path, Path(args.run_dir))
        reporting.check_destination(out, plot=not args.no_plot)
        if not args.force:
            reporting.refuse_less_data(report, out)
        paths = reporting.write_report(report, out, plot=not args.no_plot)
    except (reporting.ReportError, OSError) as err:
        return _fail("report", str(err))
    reporting.print_report(report, note=f"wrote {', '.join(str(p) for p in paths)}")
    return 0


def _run_directory(found: Path, given: Path) -> Path:
    """Where ``report`` writes by default: the app run the metrics belong to (the nearest directory from them up to
    ``given`` holding ``.hydra/``: the app logs into ``RUN/csv/pinned``, and its monitor wrote ``RUN/pin_report.json``),
    else the directory of the metrics (a Lightning ``version_N``)."""
    start = found if found.is_dir() else found.parent
    top = given.resolve() if given.is_dir() else start.resolve()
    for directory in (start.resolve(), *start.resolve().parents):
        if (directory / ".hydra").is_dir():
            return directory
        if directory == top:
            break
    return start


def _diff(args: argparse.Namespace) -> int:
    from lightning_pin.core.io import TensorFileError
    from lightning_pin.core.state import CorruptPinState
    from lightning_pin.reporting import diff as ckpt_diff

    try:
        # Every layout `check` reads: Lightning checkpoints, state dicts, {"model": ..., "pins": ...}.
        a, b = ckpt_diff.read_checkpoint(args.a), ckpt_diff.read_checkpoint(args.b)
        result = ckpt_diff.diff_checkpoints(a, b, names=(args.a, args.b))
    except (TensorFileError, CorruptPinState, OSError) as err:
        return _fail("diff", str(err))
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        ckpt_diff.print_diff(result, args.a, args.b, changed_only=args.changed_only)
    unrelated = result.unrelated()
    if unrelated is not None:
        # "0 elements changed" between unrelated files would read as "nothing moved".
        return _fail("diff", f"{args.a} and {args.b} cannot be compared: {unrelated}")
    return 0 if result.pins_hold else 1


def _faults(args: argparse.Namespace, extra: Sequence[str]) -> int:
    from lightning_pin.app.study import Study, StudyError, parse_rates, run_study

    if args.kind is None:  # stuck code bits are what a deployed int8 model's campaign draws by default
        args.kind = "bit" if args.deploy else "value"
    try:
        study = Study(kind=args.kind, rates=parse_rates(args.rates), seeds=args.seeds, per_layer=args.per_layer,
                      layer_rate=args.layer_rate, jobs=args.jobs, out=args.out, no_retrain=args.no_retrain,
                      launcher=args.launcher, overrides=(*args.overrides, *extra, *_code_bits(args)),
                      config_dir=_config_dir(args.config_dir), deploy=args.deploy,
                      keep_checkpoints=args.keep_checkpoints, remap=args.remap)
        status = run_study(study)
    except StudyError as err:
        return _fail("faults", str(err))
    if _running_as_the_command("faults"):
        # Everything is written and flushed: tearing down an interpreter that holds torch and Lightning
        # takes seconds (as long as a short study's training), for nothing.
        import os

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _code_bits(args: argparse.Namespace) -> list[str]:
    """``--code-bits N`` as the override the study's jobs read; exit 2 for it without ``--kind bit`` or out of range."""
    if args.code_bits is None:
        return []
    if args.kind != "bit":
        raise _BadOption(f"--code-bits {args.code_bits}: integer codes are for --kind bit (stuck bits), not "
                         f"--kind {args.kind}")
    if not 2 <= args.code_bits <= 16:
        raise _BadOption(f"--code-bits {args.code_bits}: codes have 2 to 16 bits (8 for int8)")
    return [f"pin.code_bits={args.code_bits}"]


def _running_as_the_command(command: str) -> bool:
    """Whether this process is ``lightning-pin COMMAND`` itself (not a caller of :func:`main`, such as a test)."""
    import os

    program = os.path.basename(sys.argv[0]) if sys.argv else ""
    return sys.argv[1:2] == [command] and program in ("lightning-pin", "lightning-pin.exe", "cli.py")


def _tune(args: argparse.Namespace, extra: Sequence[str]) -> int:
    try:
        from lightning_pin.app.tune import Objective, Param, Tune, TuneError, run_tune
    except ImportError as err:
        return _fail("tune", f"{err}: pip install 'lightning-pin[tune]' (optuna >= 3)")
    from hydra.errors import HydraException

    from lightning_pin.app.compose import with_config_dir
    from lightning_pin.app.custom import ConfigError

    try:
        overrides = tuple(with_config_dir((*args.overrides, *extra), _config_dir(args.config_dir)))
        unknown = [o for o in overrides if o.startswith("-")]
        if unknown:
            raise TuneError(f"unknown option {unknown[0]!r}")
        tune = Tune(trials=args.trials, params=tuple(Param.parse(p) for p in args.param),
                    objectives=Objective.parse_all(args.objectives), out=args.out, study_name=args.study_name,
                    seed=args.seed, prune=not args.no_prune, overrides=overrides)
        return run_tune(tune)
    except (TuneError, ConfigError, HydraException) as err:
        return _fail("tune", str(err))


def _config_dir(path: Optional[str]) -> Optional[str]:
    """``--config-dir DIR`` as an absolute path (the jobs may run elsewhere); exit 2 when it is no directory."""
    if path is None:
        return None
    absolute = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(absolute):
        raise _BadOption(f"--config-dir {path}: no such directory (it should hold model/NAME.yaml, data/NAME.yaml)")
    return absolute


class _BadOption(ValueError):
    """A bad option of a command, reported by :func:`main` in one line (exit 2)."""


def _check(args: argparse.Namespace) -> int:
    from lightning_pin.core.errors import PinError
    from lightning_pin.reporting import check

    try:
        result = check.check_artifacts(args.pinned, args.artifacts)
    except PinError as err:
        # A usage error: one line, no traceback, status 2 (as argparse's own errors).
        print(f"lightning-pin check: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    check.print_check(result)
    return 0 if result.holds else 1


def _export(args: argparse.Namespace) -> int:
    from lightning_pin.core.errors import PinError

    try:
        from lightning_pin.app.custom import ConfigError
        from lightning_pin.app.export import export_run

        import warnings

        to = args.to or Path(args.run_dir) / DEFAULT_EXPORT
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UserWarning)
            path = export_run(args.run_dir, to, force=args.force, int8=args.int8)
        for warning in caught:
            if str(warning.message).startswith("to_onnx:"):  # weights left float: one line
                print(str(warning.message).replace("to_onnx:", "export:", 1))
            else:
                warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    except (PinError, ConfigError, ImportError, OSError) as err:
        return _fail("export", str(err))
    print(f"wrote {path}; verify it with: lightning-pin check {Path(args.run_dir) / 'pinned.ckpt'} {path}")
    return 0


#: The subcommands argparse parses (``train`` goes to Hydra untouched, see :func:`main`).
COMMANDS = {"report": _report, "diff": _diff, "check": _check, "export": _export, "faults": _faults, "tune": _tune}
#: Subcommands whose unparsed arguments are Hydra overrides (``_<name>(args, extra)``).
TAKES_OVERRIDES = ("faults", "tune")


if __name__ == "__main__":
    sys.exit(main())
