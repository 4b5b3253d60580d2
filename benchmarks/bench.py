"""What pinning costs: step time, memory and set-up, measured side by side in one run.

    python benchmarks/bench.py            # the full table (about 15 minutes on 2 quiet CPU cores)
    python benchmarks/bench.py --quick    # a small model, for CI (under a minute)
    python benchmarks/bench.py --smoke    # every section on the smallest sizes: runs, figures meaningless (tests)

Every figure is a ratio of two things measured in this process, interleaved round by round, so
machine noise hits both sides alike. Step time is the wall time from ``on_train_batch_start`` of
the first callback to ``on_train_batch_end`` of the last one: forward, backward, the optimizer
step and everything the callbacks do, in a real ``Trainer.fit``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import lightning as L
import torch
from torch import nn
from torch.nn.utils import prune
from torch.utils.data import DataLoader, TensorDataset

from lightning_pin import Pin, PinCallback
from lightning_pin.core.plan import fraction_indices, resolve
from lightning_pin.core.kinds.value import _LAYOUTS as _VALUE_LAYOUTS


# ---------------------------------------------------------------------------------------------
# The model and the timed fit


#: The optimizers of the step-time rows: AdamW is the main table; SGD with momentum takes no root
#: of a statistic (the reference for what pinning itself costs), Adam is AdamW without decay.
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=1e-2),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
}
OPTIMIZER_LABELS = {"adamw": "AdamW(wd=1e-2)", "adam": "Adam", "sgd": "SGD(momentum=0.9)"}


class MLP(L.LightningModule):
    """``layers`` square Linear layers of width ``width``: the issue's 4 x 2500 x 2500 at full size."""

    def __init__(self, width: int, layers: int = 4, lr: float = 1e-3, optimizer: str = "adamw") -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.lr = lr
        self.optimizer = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        return self.layers[-1](x).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return OPTIMIZERS[self.optimizer](self.parameters(), self.lr)


class StepStart(L.Callback):
    def __init__(self) -> None:
        self.started = 0.0
        self.cpu_started = 0.0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.started = time.perf_counter()
        self.cpu_started = time.process_time()


class StepEnd(L.Callback):
    def __init__(self, start: StepStart, out: str | None = None) -> None:
        self.start = start
        self.out = out
        self.times: list[float] = []
        #: CPU time of this process per step (all its threads): other processes on a shared
        #: machine barely move it, where they do move wall time.
        self.cpu_times: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.times.append(time.perf_counter() - self.start.started)
        self.cpu_times.append(time.process_time() - self.start.cpu_started)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # Under ddp_spawn the timings live in the workers: rank 0 hands them over in a file.
        if self.out is not None and trainer.global_rank == 0:
            with open(self.out, "w") as handle:
                json.dump(self.times, handle)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.out is not None and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def loader(width: int, steps: int, batch: int = 64) -> DataLoader:
    x = torch.randn(steps * batch, width, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x), batch_size=batch)


def timed_fit(model: MLP, callbacks: list[L.Callback], data: DataLoader, warmup: int) -> float:
    """Median step time of one fit, after ``warmup`` steps."""
    return fit_times(model, callbacks, data, warmup)[0]


def fit_times(model: MLP, callbacks: list[L.Callback], data: DataLoader, warmup: int) -> tuple[float, float]:
    """Median wall and process-CPU seconds per step of one fit, after ``warmup`` steps."""
    start = StepStart()
    end = StepEnd(start)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        callbacks=[start, *callbacks, end],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=50,
    )
    trainer.fit(model, data)
    return statistics.median(end.times[warmup:]), statistics.median(end.cpu_times[warmup:])


def ddp_step_ratio(width: int, rounds: int, steps: int, warmup: int, start_method: str = "spawn") -> float:
    """Step time of 1%-pinned over unpinned DDP (ddp_spawn, 2 CPU processes), interleaved.

    ``start_method="forkserver"`` (--smoke): the ranks fork from :func:`forkserver`'s server, which
    imported Lightning and lightning_pin once, instead of each rank of each fit starting an interpreter
    that imports them (seconds of CPU each); the model and callbacks still go to the ranks pickled,
    and each rank still runs this script as ``__mp_main__``, as under spawn."""
    import tempfile

    from lightning.pytorch.strategies import DDPStrategy

    if start_method == "forkserver":
        forkserver()  # its preload, before the first fork

    ratios = []
    for _ in range(rounds):
        medians = {}
        for name, setup in (("unpinned", lambda model: []), ("pinned", ours(0.01))):
            torch.manual_seed(0)
            model = MLP(width)
            out = os.path.join(tempfile.mkdtemp(), "times.json")
            start = StepStart()
            trainer = L.Trainer(
                accelerator="cpu",
                devices=2,
                strategy="ddp_spawn" if start_method == "spawn" else DDPStrategy(start_method=start_method),
                max_epochs=1,
                callbacks=[start, *setup(model), StepEnd(start, out)],
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
            )
            trainer.fit(model, loader(width, steps * 2))
            with open(out) as handle:
                medians[name] = statistics.median(json.load(handle)[warmup:])
        ratios.append(medians["pinned"] / medians["unpinned"])
    return statistics.median(ratios)


@dataclass
class Case:
    """One way of training: a fresh model and the callbacks (or module edits) that pin it."""

    name: str
    setup: Callable[[MLP], list[L.Callback]]


@dataclass
class Rounds:
    """Per case, the median step time of each round's fit, in wall and in process-CPU seconds."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]

    def ratios(self, clock: str = "wall") -> dict[str, list[float]]:
        """Each case's time divided by the unpinned one of the same round, per round."""
        times = getattr(self, clock)
        return {name: [t / u for t, u in zip(values, times["unpinned"])] for name, values in times.items()}

    def best(self) -> dict[str, float]:
        """Each case's fastest round over the unpinned fastest round: noise only ever adds time."""
        return {name: min(values) / min(self.wall["unpinned"]) for name, values in self.wall.items()}


def compare_rounds(
    width: int, cases: list[Case], rounds: int, steps: int, warmup: int, optimizer: str = "adamw"
) -> Rounds:
    """Fit every case once per round, interleaved, from the same initial weights and data."""
    data = loader(width, steps)
    measured = Rounds({c.name: [] for c in cases}, {c.name: [] for c in cases})
    for _ in range(rounds):
        for case in cases:
            torch.manual_seed(0)
            model = MLP(width, optimizer=optimizer)
            callbacks = case.setup(model)
            gc.collect()
            wall, cpu = fit_times(model, callbacks, data, warmup)
            measured.wall[case.name].append(wall)
            measured.cpu[case.name].append(cpu)
    return measured


def compare(width: int, cases: list[Case], rounds: int, steps: int, warmup: int) -> dict[str, float]:
    """Median over rounds of each case's step time divided by the unpinned one of that round."""
    ratios = compare_rounds(width, cases, rounds, steps, warmup).ratios()
    return {name: statistics.median(values) for name, values in ratios.items()}


# ---------------------------------------------------------------------------------------------
# The alternatives


def _mask_of(model: MLP, name: str, fraction: float) -> torch.Tensor:
    parameter = model.get_parameter(name)
    mask = torch.zeros(parameter.numel(), dtype=torch.bool)
    mask[fraction_indices(name, parameter.numel(), fraction, 0)] = True
    return mask.view_as(parameter)


def pinned_positions(model: nn.Module, name: str, fraction: float) -> tuple[nn.Parameter, torch.Tensor, torch.Tensor]:
    """``(parameter, int64 positions, targets)`` of ``fraction`` of ``name``'s elements with seed 0: the
    elements ``Pin(name, fraction=fraction, seed=0)`` selects, and the values they hold now."""
    parameter = model.get_parameter(name)
    index = fraction_indices(name, parameter.numel(), fraction, 0).long()
    return parameter, index, parameter.detach().reshape(-1)[index].clone()


def weight_names(model: MLP) -> list[str]:
    return [f"layers.{i}.weight" for i in range(len(model.layers))]


class DenseMaskPins(L.Callback):
    """The textbook implementation: a bool mask and a full-size target per tensor."""

    def __init__(self, model: MLP, fraction: float) -> None:
        self.entries = []
        for name in weight_names(model):
            parameter = model.get_parameter(name)
            self.entries.append((parameter, _mask_of(model, name, fraction), parameter.detach().clone()))

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        for optimizer in trainer.optimizers:
            optimizer.register_step_post_hook(self._restore)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        for parameter, mask, _ in self.entries:
            if parameter.grad is not None:
                parameter.grad.masked_fill_(mask, 0)

    @torch.no_grad()
    def _restore(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for parameter, mask, target in self.entries:
            torch.where(mask, target, parameter, out=parameter.data)


class RawIndexPins(L.Callback):
    """The floor under the Trainer bars: pinning written bare with torch's index kernels, as the
    engine runs them on a tensor it does not serve densely. Per weight, int64 positions made once;
    before each step ``index_fill_`` zeroes the pinned gradient, after it ``index_copy_`` writes
    the targets back, and after the first step the pinned second moments are set to 1.0 once (the
    engine parks them so: torch's CPU square root of exact zeros is slow). No checks, no plan, no
    monitoring. A pinned fit over this one's is what lightning-pin adds above the kernels."""

    def __init__(self, model: MLP, fraction: float) -> None:
        self.entries = [pinned_positions(model, name, fraction) for name in weight_names(model)]
        self.parked = False

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        for optimizer in trainer.optimizers:
            optimizer.register_step_post_hook(self._restore)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        for parameter, index, _ in self.entries:
            parameter.grad.view(-1).index_fill_(0, index, 0)

    @torch.no_grad()
    def _restore(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for parameter, index, targets in self.entries:
            parameter.data.view(-1).index_copy_(0, index, targets)
        if not self.parked:
            self.parked = True
            for parameter, index, _ in self.entries:
                moments = optimizer.state[parameter].get("exp_avg_sq")  # Adam's kind; SGD has none
                if moments is not None:
                    moments.view(-1).index_fill_(0, index, 1.0)


class ResetEveryN(L.Callback):
    """The naive approach a user of ONNX Runtime training tried: write the targets back every
    ``every`` batches (they used 100), nothing else."""

    def __init__(self, model: MLP, fraction: float, every: int) -> None:
        self.every = every
        self.entries = [pinned_positions(model, name, fraction) for name in weight_names(model)]
        self.worst_drift = 0.0

    @torch.no_grad()
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx % self.every:
            return
        self._measure()
        for parameter, index, target in self.entries:
            parameter.data.view(-1).index_copy_(0, index, target)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._measure()

    @torch.no_grad()
    def _measure(self) -> None:
        for parameter, index, target in self.entries:
            drift = (parameter.detach().view(-1)[index] - target).abs().max()
            self.worst_drift = max(self.worst_drift, float(drift))


def pruned(model: MLP, fraction: float) -> list[L.Callback]:
    """``torch.nn.utils.prune``: can only pin to zero, through a reparametrisation."""
    for name in weight_names(model):
        layer = model.get_submodule(name.rsplit(".", 1)[0])
        prune.custom_from_mask(layer, "weight", mask=~_mask_of(model, name, fraction))
    return []


class ZeroStatistics(L.Callback):
    """After a PinCallback: its engine leaves the statistics of pinned elements at zero, as the
    engine did before it parked them (see ``PinEngine.park_statistics``)."""

    def __init__(self, callback: PinCallback) -> None:
        self.callback = callback

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.callback.engine.park = False


def ours(
    fraction: float, value: float | None = None, monitor: bool = True, park: bool = True
) -> Callable[[MLP], list[L.Callback]]:
    """PinCallback on every weight matrix; ``monitor=True`` is the default monitoring."""

    def setup(model: MLP) -> list[L.Callback]:
        pins = [Pin(weight_names(model), fraction=fraction, value=value)]
        callback = PinCallback(pins, verbose=False, monitor=monitor)
        return [callback] if park else [callback, ZeroStatistics(callback)]

    return setup


def faults(fraction: float, kind: str) -> Callable[[MLP], list[L.Callback]]:
    """Fault-model pins on every weight matrix: stuck bits (the sign at 0, a mantissa bit at 1) or
    bounds; their gradients and optimizer statistics train (no masking, no parking)."""

    def setup(model: MLP) -> list[L.Callback]:
        if kind == "stuck bits":
            pin_ = Pin(weight_names(model), fraction=fraction, stuck_at_zero=0x80000000, stuck_at_one=0x00010000)
        else:
            pin_ = Pin(weight_names(model), fraction=fraction, bounds=(-0.01, 0.01))
        return [PinCallback([pin_], verbose=False)]

    return setup


def frozen_halves(model: MLP) -> list[L.Callback]:
    """Whole-tensor freezes: the first half of the layers, weights and biases."""
    half = len(model.layers) // 2
    return [PinCallback([Pin([f"layers.{i}.*" for i in range(half)])], verbose=False)]


# ---------------------------------------------------------------------------------------------
# Memory and set-up


def pin_bytes(callback: PinCallback) -> tuple[int, int]:
    """Bytes the engine holds for its pins (indices, targets, merge layouts), and the pinned elements."""
    engine = callback.engine
    stored: dict[int, int] = {}
    pinned = 0
    for rp in engine.plan.pins:
        for selection in rp.selections.values():
            pinned += selection.count
            for tensor in (selection.index, selection.values):
                if tensor is not None:
                    stored[id(tensor)] = tensor.numel() * tensor.element_size()
    for targets in engine.captured.values():
        for tensor in targets.values():
            stored[id(tensor)] = tensor.numel() * tensor.element_size()
    for _, targets in engine._values.values():  # the value kernels' merged targets, per set of pins
        for target in targets:
            for tensor in (target.index, target.values, *target._by_strides.values()):
                if tensor is not None:
                    stored[id(tensor)] = tensor.numel() * tensor.element_size()
    for rp in engine.plan.pins:  # merge layouts of overlapping pins, kept with their selections (none here)
        for selection in rp.selections.values():
            for layout in _VALUE_LAYOUTS.get(selection, {}).values():
                for tensor in (layout.index, layout.take):
                    if tensor is not None:
                        stored[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(stored.values()), pinned


def step_buffer_bytes(callback: PinCallback) -> int:
    """Bytes the steps keep on top of :func:`pin_bytes`: the int64 copies of int32 indices that the
    index kernels take (made once: for targets of at most ``WIDE_LIMIT`` elements, and on CPU for every
    target that no dense pass serves; see ``KEEP_WIDE_ON_CPU``)."""
    stored: dict[int, int] = {}
    for _, targets in callback.engine._values.values():
        for target in targets:
            wide = getattr(target, "_wide", None)
            if wide is not None and wide is not target.index:
                stored[id(wide)] = wide.numel() * wide.element_size()
    return sum(stored.values())


def peak_rss_mb(width: int, cases: list[str], steps: int, forked: bool = False) -> dict[str, float]:
    """Peak RSS of a fresh process per case that trains ``steps`` steps of it. ``forked`` (--smoke) trains
    the cases one after the other in one process forked from :func:`forkserver`'s server, the peak reset
    before each: no interpreter start-up, and figures that mean nothing (each peak counts the server's
    imports and what the cases before left behind).

    Read from /proc (VmHWM): ``ru_maxrss`` would carry the parent's peak across fork + exec.
    """
    if forked:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(1, mp_context=forkserver()) as pool:
            return dict(zip(cases, pool.submit(fit_peaks, width, cases, steps, True).result()))

    def run(case: str) -> float:
        code = "import sys; sys.path.insert(0, %r); import bench; print('peaks', *bench.fit_peaks(%d, [%r], %d))" % (
            os.path.dirname(os.path.abspath(__file__)), width, case, steps)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        return float(next(line for line in done.stdout.splitlines() if line.startswith("peaks ")).split()[1])

    return {case: run(case) for case in cases}


def fit_peaks(width: int, cases: list[str], steps: int, reset_first: bool = False) -> list[float]:
    """Fit each case ``steps`` steps in turn (two threads); after each, this process's peak RSS in MB since
    the peak was last reset to the current RSS (writing 5 to /proc/self/clear_refs, Linux >= 4.0): before each
    case but the first, and before the first too with ``reset_first`` (a forked process has its parent's)."""
    torch.set_num_threads(2)
    peaks = []
    for i, case in enumerate(cases):
        if i or reset_first:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
        model = MLP(width)
        timed_fit(model, CASES_BY_NAME[case](model), loader(width, steps), 0)
        with open("/proc/self/status") as handle:
            peaks.append(int(next(line for line in handle if line.startswith("VmHWM")).split()[1]) / 1024)
    return peaks


def forkserver() -> Any:
    """The forkserver context, its server preloaded with Lightning and lightning_pin (--smoke): processes
    forked from it start in milliseconds, where each fresh interpreter imports them for seconds of CPU. Named:
    Python's own preload of ``__main__`` into the server never happens (up to 3.12 it looks for a key that
    ``get_preparation_data()`` does not write), and each child would import everything itself."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["lightning", "lightning_pin"])
    return context


CASES_BY_NAME: dict[str, Callable[[MLP], list[L.Callback]]] = {
    "unpinned": lambda model: [],
    "pinned 1%": ours(0.01),
    "pinned 1%, no monitor": ours(0.01, monitor=False),
    "pinned 50%, no monitor": ours(0.5, monitor=False),
    "frozen halves": frozen_halves,
}


def setup_seconds(width: int, layers: int, fraction: float) -> tuple[float, int]:
    model = MLP(width, layers)
    params = sum(p.numel() for p in model.parameters())
    started = time.perf_counter()
    resolve([Pin("layers.*", fraction=fraction)], model)
    return time.perf_counter() - started, params


class EngineTimes(L.Callback):
    """After a PinCallback: wall time of its engine's work per optimizer step (mask, restore, parking)."""

    def __init__(self, callback: PinCallback) -> None:
        self.callback = callback
        self.seconds: dict[str, list[float]] = {"mask": [], "restore": [], "park": []}

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        engine = self.callback.engine
        for name, method in (("mask", "mask_grads"), ("restore", "restore"), ("park", "park_statistics")):
            if hasattr(engine, method):
                setattr(engine, method, self._timed(getattr(engine, method), self.seconds[name]))

    @staticmethod
    def _timed(function: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            out = function(*args, **kwargs)
            into.append(time.perf_counter() - started)
            return out

        return timed


def where_time_goes(width: int, fraction: float, steps: int, warmup: int) -> dict[str, float]:
    """Median milliseconds per step of the whole step and of the engine's parts, in one pinned fit."""
    torch.manual_seed(0)
    model = MLP(width)
    callback = ours(fraction, monitor=False)(model)[0]
    times = EngineTimes(callback)
    start = StepStart()
    end = StepEnd(start)
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, callbacks=[start, callback, times, end], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, loader(width, steps))
    out = {"step": statistics.median(end.times[warmup:]) * 1e3}
    for name, seconds in times.seconds.items():
        if seconds:
            out[name] = statistics.median(seconds[warmup:]) * 1e3
    return out


# ---------------------------------------------------------------------------------------------
# The torch-native front door in a plain loop


def plain_loop_rounds(width: int, fraction: float, rounds: int, steps: int, warmup: int) -> list[float] | None:
    """Per round, the median step time of a plain loop under ``lightning_pin.pin`` over the same
    loop without it (AdamW; forward, backward, step, zero_grad). None when this build has no pin()."""
    try:
        from lightning_pin import pin
    except (ImportError, AttributeError):
        return None
    data = loader(width, steps)
    ratios = []
    for _ in range(rounds):
        medians = {}
        for pinned in (False, True):
            torch.manual_seed(0)
            model = MLP(width)
            optimizer = model.configure_optimizers()
            gc.collect()
            times = []
            context = pin(model, optimizer, [Pin(weight_names(model), fraction=fraction)]) if pinned else nullcontext()
            with context:
                for batch_idx, batch in enumerate(data):
                    started = time.perf_counter()
                    model.training_step(batch, batch_idx).backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    times.append(time.perf_counter() - started)
            medians[pinned] = statistics.median(times[warmup:])
        ratios.append(medians[True] / medians[False])
    return ratios


# ---------------------------------------------------------------------------------------------
# Depth at fixed size: the same parameters spread over more and more tensors


#: The depth rows' optimizers: torch's CPU default AdamW (the for-loop implementation), its
#: foreach implementation, and SGD with momentum.
DEPTH_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "AdamW for-loop": lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=False),
    "AdamW foreach": lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True),
    "SGD momentum": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
}


def _deep_stack(layers: int, parameters: int) -> tuple[nn.Module, list[str]]:
    """``layers`` square Linear layers holding about ``parameters`` parameters together."""
    width = max(2, round((parameters / layers) ** 0.5))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    return model, [f"{i}.weight" for i in range(layers)]


def aliased(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters are aliases of ``model``'s (``.data``: the same storage,
    version counters of their own). The depth rows time the unpinned loop on the pinned loop's
    memory: identical models in separate memory differed by several percent here, by where the
    allocator put them, as much as the differences measured."""
    twin = copy.deepcopy(model)
    for name, parameter in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        twin.get_submodule(owner)._parameters[leaf] = nn.Parameter(parameter.data)
    return twin


def alias_statistics(source: torch.optim.Optimizer, twin: torch.optim.Optimizer) -> None:
    """Point ``twin``'s per-element statistics at ``source``'s (both have stepped once; parameters
    in the same order)."""
    for mine, theirs in zip((p for g in twin.param_groups for p in g["params"]),
                            (p for g in source.param_groups for p in g["params"])):
        for key, value in source.state[theirs].items():
            if isinstance(value, torch.Tensor) and value.shape == theirs.shape:
                twin.state[mine][key] = value.data


class RawPins:
    """The floor under the depth rows: what pinning ``fraction`` of each of ``names`` must do at the
    least, written bare. One ``put_`` of zeros into each pinned gradient before the step and one
    ``put_`` of its targets after it (the optimizer's hooks), with int64 positions made once: the
    kernels the engine itself runs on such tensors, without its checks, plan or bookkeeping. The
    engine's step over this one's is what lightning-pin adds above torch's kernels."""

    def __init__(self, model: nn.Module, names: list[str], fraction: float, optimizer: torch.optim.Optimizer) -> None:
        self.entries = [
            (parameter, index, targets, torch.zeros_like(targets))
            for parameter, index, targets in (pinned_positions(model, name, fraction) for name in names)
        ]
        self.handles = [optimizer.register_step_pre_hook(self._mask), optimizer.register_step_post_hook(self._restore)]

    def _mask(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for parameter, index, _, zeros in self.entries:
            parameter.grad.put_(index, zeros)

    @torch.no_grad()
    def _restore(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for parameter, index, targets, _ in self.entries:
            parameter.data.put_(index, targets)


def depth_rounds(
    layers: int, fraction: float, optimizer: str, rounds: int, steps: int, warmup: int, parameters: int = 4_000_000,
    floor: bool = False,
) -> dict[str, Any]:
    """Plain-loop step times (forward of a batch of 16, backward, step, zero_grad) with ``pin()``
    on ``fraction`` of every weight and without, on the same weights and statistics (aliased).
    The loops take turns step by step (the order turns every step), so that the machine's noise,
    which on a shared host comes in bursts longer than a step, hits them alike. Returns the median step times, the ratio
    of medians per round and the microseconds pinning adds per pinned tensor and step. ``floor``:
    a third loop pinned by :class:`RawPins` on the same memory, and the engine's step over its step."""
    from lightning_pin import pin

    kinds = ("pinned", "unpinned", "floor") if floor else ("pinned", "unpinned")
    times: dict[str, list[float]] = {kind: [] for kind in kinds}  # per round, the median step (s)
    cpu_ratios = []
    for _ in range(rounds):
        model, names = _deep_stack(layers, parameters)
        opt = DEPTH_OPTIMIZERS[optimizer](model.parameters())
        # The other loops train the same memory (see aliased), made before pin()'s hooks.
        twins = {kind: aliased(model) for kind in kinds[1:]}
        optimizers = {"pinned": opt, **{kind: DEPTH_OPTIMIZERS[optimizer](t.parameters()) for kind, t in twins.items()}}
        handle = pin(model, opt, [Pin(names, fraction=fraction, seed=0)])
        raw = RawPins(twins["floor"], names, fraction, optimizers["floor"]) if floor else None
        models = {"pinned": model, **twins}
        wall: dict[str, list[float]] = {kind: [] for kind in kinds}
        cpu: dict[str, list[float]] = {kind: [] for kind in kinds}
        x = torch.randn(16, model[0].in_features)
        gc.collect()
        for step in range(warmup + steps):
            if step == 1:
                for kind in kinds[1:]:
                    alias_statistics(opt, optimizers[kind])
            turn = step % len(kinds)
            for kind in kinds[turn:] + kinds[:turn]:
                started, started_cpu = time.perf_counter(), time.process_time()
                models[kind](x).square().mean().backward()
                optimizers[kind].step()
                optimizers[kind].zero_grad()
                if step >= warmup:
                    wall[kind].append(time.perf_counter() - started)
                    cpu[kind].append(time.process_time() - started_cpu)
        handle.remove()
        for hook in raw.handles if raw is not None else ():
            hook.remove()
        for kind in kinds:
            times[kind].append(statistics.median(wall[kind]))
        cpu_ratios.append(statistics.median(cpu["pinned"]) / statistics.median(cpu["unpinned"]))
    ratios = [p / u for p, u in zip(times["pinned"], times["unpinned"])]
    row = {
        "unpinned_ms": statistics.median(times["unpinned"]) * 1e3,
        "pinned_ms": statistics.median(times["pinned"]) * 1e3,
        "ratio": statistics.median(ratios),
        "rounds": ratios,
        "cpu_ratio": statistics.median(cpu_ratios),
        "us_per_pinned_tensor": statistics.median(
            (p - u) * 1e6 / layers for p, u in zip(times["pinned"], times["unpinned"])
        ),
    }
    if floor:
        row["floor_ms"] = statistics.median(times["floor"]) * 1e3
        row["floor_rounds"] = [f / u for f, u in zip(times["floor"], times["unpinned"])]
        row["floor_ratio"] = statistics.median(row["floor_rounds"])
        row["over_floor"] = statistics.median(p / f for p, f in zip(times["pinned"], times["floor"]))
    return row


def depth_rows(
    depths: tuple[int, ...], fractions: tuple[float, ...], optimizers: tuple[str, ...], rounds: int, steps: int,
    warmup: int, parameters: int = 4_000_000, floor: bool = False,
) -> dict[str, dict[str, Any]]:
    """One row per depth, fraction and optimizer (see :func:`depth_rounds`), printed as they come;
    ``floor``: each with :class:`RawPins`' step over the unpinned one and the engine's over it."""
    print(
        f"depth at fixed size: {parameters / 1e6:.3g}M parameters as N square Linear layers, pin() on a fraction of "
        f"every weight, plain loop; median of {rounds} interleaved rounds of {steps} steps"
    )
    print(f"  {'optimizer':<16}{'pinned':>7}{'tensors':>8}{'unpinned ms':>13}{'pinned ms':>11}{'ratio':>8}"
          f"{'cpu':>7}{'us/tensor':>11}   rounds")
    rows = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # per-tensor overhead is host work: one thread, as in the runs
    for optimizer in optimizers:
        for fraction in fractions:
            for layers in depths:
                row = depth_rounds(layers, fraction, optimizer, rounds, steps, warmup, parameters, floor)
                rows[f"{optimizer} {fraction:.0%} x{layers}"] = row
                print(
                    f"  {optimizer:<16}{fraction:>7.0%}{layers:>8}{row['unpinned_ms']:>13.1f}{row['pinned_ms']:>11.1f}"
                    f"{row['ratio']:>8.3f}{row['cpu_ratio']:>7.3f}{row['us_per_pinned_tensor']:>11.1f}   "
                    + " ".join(f"{r:.3f}" for r in row["rounds"]),
                    flush=True,
                )
                if floor:
                    print(f"  {'':<16}{'floor':>7}{'':>8}{'':>13}{row['floor_ms']:>11.1f}{row['floor_ratio']:>8.3f}"
                          f"{'':>7}{'':>11}   " + " ".join(f"{r:.3f}" for r in row["floor_rounds"])
                          + f"   (the engine over it: {row['over_floor']:.3f})", flush=True)
    torch.set_num_threads(threads)
    return rows


def depth_trainer_rows(depths: tuple[int, ...], fraction: float, rounds: int, steps: int, warmup: int,
                       parameters: int = 4_000_000) -> dict[str, dict[str, Any]]:
    """The depth rows through the callback's door: a real ``Trainer.fit`` of ``N`` square Linear
    layers (AdamW, batch 16, one thread) with ``PinCallback`` on ``fraction`` of every weight and
    without, fits interleaved round by round (median of per-fit median step times)."""
    print(f"depth at fixed size, PinCallback in Trainer.fit: {parameters / 1e6:.3g}M parameters as N layers, "
          f"{fraction:.0%} of every weight; median of {rounds} interleaved fits of {steps} steps")
    print(f"  {'tensors':>8}{'unpinned ms':>13}{'pinned ms':>11}{'ratio':>8}{'us/tensor':>11}   rounds")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = {}
    for layers in depths:
        width = max(2, round((parameters / layers) ** 0.5))
        data = DataLoader(TensorDataset(torch.randn((steps + warmup) * 16, width)), batch_size=16)
        pinned_ms, unpinned_ms = [], []
        for _ in range(rounds):
            for pinned in (False, True):
                torch.manual_seed(0)
                model = MLP(width, layers)
                pins = [Pin([f"layers.{i}.weight" for i in range(layers)], fraction=fraction, seed=0)]
                callbacks = [PinCallback(pins, verbose=False, monitor=False)] if pinned else []
                gc.collect()
                (pinned_ms if pinned else unpinned_ms).append(timed_fit(model, callbacks, data, warmup) * 1e3)
        ratios = [p / u for p, u in zip(pinned_ms, unpinned_ms)]
        row = {
            "unpinned_ms": statistics.median(unpinned_ms), "pinned_ms": statistics.median(pinned_ms),
            "ratio": statistics.median(ratios), "rounds": ratios,
            "us_per_pinned_tensor": statistics.median((p - u) * 1e3 / layers for p, u in zip(pinned_ms, unpinned_ms)),
        }
        rows[f"callback {fraction:.0%} x{layers}"] = row
        print(f"  {layers:>8}{row['unpinned_ms']:>13.1f}{row['pinned_ms']:>11.1f}{row['ratio']:>8.3f}"
              f"{row['us_per_pinned_tensor']:>11.1f}   " + " ".join(f"{r:.3f}" for r in ratios), flush=True)
    torch.set_num_threads(threads)
    return rows


# ---------------------------------------------------------------------------------------------
# Reporting


def verdict(rounds: list[float], goal: float) -> str:
    """Whether the median meets ``goal``, and whether the rounds straddle it (noise decides)."""
    median = statistics.median(rounds)
    met = "met" if median <= goal else "MISSED"
    if min(rounds) <= goal < max(rounds):
        return f"{met} (within noise: rounds {min(rounds):.3f}-{max(rounds):.3f})"
    return met


def print_rows(title: str, measured: Rounds | dict[str, list[float]], goals: dict[str, float]) -> dict[str, float]:
    """One row per case: the median ratio, each round's ratio, the goal, and for :class:`Rounds`
    the median ratio in CPU time and the ratio of the fastest rounds."""
    rounds = measured.ratios() if isinstance(measured, Rounds) else measured
    if title:
        extra = "; cpu: the same in CPU time; best: fastest round / fastest unpinned round"
        print(title + (extra if isinstance(measured, Rounds) else ""))
    medians = {}
    for name, values in rounds.items():
        medians[name] = median = statistics.median(values)
        goal = goals.get(name)
        mark = "" if goal is None else f"   goal <= {goal:.2f}: {verdict(values, goal)}"
        per_round = " ".join(f"{v:.3f}" for v in values)
        more = ""
        if isinstance(measured, Rounds):
            more = f"  cpu {statistics.median(measured.ratios('cpu')[name]):.3f}  best {measured.best()[name]:.3f}"
        print(f"  {name:<40} {median:6.3f}   [{per_round}]{more}{mark}")
    return medians


def floor_cases(fractions: tuple[float, ...]) -> list[Case]:
    """:class:`RawIndexPins` on each fraction of every weight: the floor under the pinned cases."""
    return [Case(f"floor {f:.0%}", lambda model, f=f: [RawIndexPins(model, f)]) for f in fractions]


def _fraction_cases(fractions: tuple[float, ...], park: bool = True) -> list[Case]:
    if park:
        return [Case(f"pinned {f:.0%}", ours(f)) for f in fractions]
    return [Case(f"pinned {f:.0%}, statistics at zero (before)", ours(f, park=False)) for f in fractions]


# ---------------------------------------------------------------------------------------------


# glibc returns large freed blocks to the OS and faults them in again on the next allocation:
# every optimizer step's temporaries would then cost page faults whose count varies from fit to
# fit and swamps a 1% difference. Keep freed memory in the process, for both sides alike.
_STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}


def main() -> None:
    if any(os.environ.get(k) != v for k, v in _STEADY_MALLOC.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_STEADY_MALLOC})
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model and few steps (CI)")
    parser.add_argument(
        "--smoke", action="store_true",
        help="--quick on the smallest sizes: every section runs in seconds, its timings mean nothing (the tests)",
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument(
        "--depth", action="store_true", help="only the depth rows (4M parameters as 4 to 1,024 tensors)"
    )
    parser.add_argument("--depths", default="4,64,256,1024", help="tensor counts of the depth rows")
    parser.add_argument("--depth-optimizers", default=",".join(DEPTH_OPTIMIZERS), help="optimizers of the depth rows")
    parser.add_argument("--depth-fractions", default="0.01,0.2", help="fractions of the depth rows")
    parser.add_argument("--depth-trainer", action="store_true", help="the depth rows through PinCallback in a Trainer")
    args = parser.parse_args()
    quick, smoke = args.quick or args.smoke, args.smoke
    # --smoke's timings mean nothing: one thread, so a loaded machine does not spin two against each other
    torch.set_num_threads(1 if smoke else min(2, os.cpu_count() or 1))
    # The cases collect garbage before each fit; the ~400k objects of the imports never become garbage, and
    # scanning them took seconds per collection on a loaded machine (most of --smoke's time): move them out of
    # the collector's generations once.
    gc.freeze()
    if args.depth_trainer:
        depths = tuple(int(d) for d in args.depths.split(","))
        rows = {}
        for f in (float(f) for f in args.depth_fractions.split(",")):
            rows.update(depth_trainer_rows(depths, f, *((1, 4, 1) if quick else (5, 30, 5)),
                                           parameters=250_000 if quick else 4_000_000))
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"date": time.strftime("%Y-%m-%d"), "machine": _machine(), "depth_trainer": rows}, handle,
                          indent=2)
        return
    if args.depth:
        depths = tuple(int(d) for d in args.depths.split(","))
        fractions = tuple(float(f) for f in args.depth_fractions.split(","))
        optimizers = tuple(args.depth_optimizers.split(","))
        rows = depth_rows(depths, fractions, optimizers, *((2, 6, 2) if quick else (5, 30, 5)),
                          parameters=250_000 if quick else 4_000_000)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"date": time.strftime("%Y-%m-%d"), "machine": _machine(), "depth": rows}, handle, indent=2)
        return
    # --smoke keeps every section and case of --quick (so the test sees each figure) on a model so
    # small that Lightning's own per-fit cost is most of the time.
    width, rounds, steps, warmup = (64, 2, 4, 1) if smoke else (400, 2, 8, 2) if quick else (2500, 5, 20, 4)
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "machine": _machine(), "width": width}

    print(f"lightning-pin benchmark  {results['date']}  {results['machine']}")
    params = 4 * (width * width + width)
    print(f"MLP 4 x Linear({width}, {width}) = {params / 1e6:.1f}M parameters, batch 64, pins on every weight matrix\n")

    fractions = (0.2, 0.5, 0.8)
    cases = [
        Case("unpinned", lambda model: []),
        *([] if quick else [Case("pinned 0.1%", ours(0.001))]),
        Case("pinned 1%", ours(0.01)),
        Case("pinned 1%, no monitor", ours(0.01, monitor=False)),
        *_fraction_cases(fractions),
        # The engine before it parked the statistics of pinned elements, for comparison.
        *_fraction_cases((0.5,) if quick else fractions, park=False),
        Case("frozen halves", frozen_halves),
        Case("ours to zero 1%", ours(0.01, value=0.0)),
        Case("prune 1%", lambda model: pruned(model, 0.01)),
        Case("ours to zero 20%", ours(0.2, value=0.0)),
        Case("prune 20%", lambda model: pruned(model, 0.2)),
        Case("dense mask 1%", lambda model: [DenseMaskPins(model, 0.01)]),
        Case("dense mask 50%", lambda model: [DenseMaskPins(model, 0.5)]),
        Case("reset every 100 1%", lambda model: [ResetEveryN(model, 0.01, 100)]),
        # Fault models (stuck bits, bounded cells) against value pins at the same fractions.
        *(Case(f"{kind} {f:.0%}", faults(f, kind)) for kind in ("stuck bits", "bounds") for f in (0.01, 0.2)),
    ]
    measured = compare_rounds(width, cases, rounds, steps, warmup)
    goals = {"pinned 1%": 1.01, "pinned 20%": 1.05, "pinned 50%": 1.08, "pinned 80%": 1.10, "frozen halves": 1.00}
    label = OPTIMIZER_LABELS["adamw"]
    title = f"step time / unpinned step time, {label}: median of {rounds} interleaved rounds [each round]"
    ratios = print_rows(title, measured, goals)
    results["step_time_ratio"] = ratios
    results["step_time_rounds"] = measured.ratios()
    results["cpu_time_rounds"] = measured.ratios("cpu")
    results["step_time_best"] = measured.best()
    results["prune_overhead"] = {}
    for percent in ("1%", "20%"):
        ours_over, prune_over = ratios[f"ours to zero {percent}"] - 1, ratios[f"prune {percent}"] - 1
        met = ours_over <= prune_over / 4
        results["prune_overhead"][percent] = {"ours": ours_over, "prune": prune_over}
        print(
            f"  overhead at {percent}, pins to zero: ours {ours_over:+.3f}, prune {prune_over:+.3f}"
            f"   goal: ours <= prune / 4 = {prune_over / 4:+.3f}: {'met' if met else 'MISSED'}"
        )
    speedup = ratios["prune 1%"] / ratios["ours to zero 1%"]
    results["prune_over_ours_1pct"] = speedup
    print(f"  prune / ours (pins to zero, 1%): {speedup:.2f}x")

    # Other optimizers, each against its own unpinned fit.
    other_fractions = (0.5,) if quick else (0.01, 0.2, 0.5, 0.8)
    results["optimizers"] = {}
    for optimizer in ("adam", "sgd"):
        cases = [Case("unpinned", lambda model: []), *_fraction_cases(other_fractions)]
        rows = compare_rounds(width, cases, 1 if quick else 3, steps, warmup, optimizer=optimizer)
        label, count = OPTIMIZER_LABELS[optimizer], len(rows.wall["unpinned"])
        title = f"\nstep time / unpinned step time, {label}: median of {count} rounds"
        results["optimizers"][optimizer] = print_rows(title, rows, {})

    print("\nthe torch-native front door: lightning_pin.pin() in a plain loop, AdamW, step time / the loop unpinned")
    results["plain_loop"] = {}
    for fraction in (0.01, 0.5):
        loop_rounds = plain_loop_rounds(width, fraction, rounds, steps, warmup)
        if loop_rounds is None:
            print("  skipped: this build has no lightning_pin.pin (the front door)")
            break
        results["plain_loop"][f"{fraction:.0%}"] = statistics.median(loop_rounds)
        print_rows("", {f"pin() {fraction:.0%}": loop_rounds}, {})

    print("\nwhere the time goes: median ms per step in one pinned fit (AdamW, monitor=False)")
    results["engine_ms"] = {}
    for fraction in (0.5,) if quick else (0.01,) + fractions:
        parts = where_time_goes(width, fraction, steps, warmup)
        results["engine_ms"][f"{fraction:.0%}"] = parts
        print(f"  {fraction:4.0%}: " + ", ".join(f"{name} {ms:7.2f}" for name, ms in parts.items()))

    # How far the naive approach lets values drift between its resets.
    model = MLP(width)
    naive = ResetEveryN(model, 0.01, 100)
    timed_fit(model, [naive], loader(width, 101 if not quick else 21), 0)
    results["naive_reset_worst_drift"] = naive.worst_drift
    print(f"\nre-set every 100 batches: pinned values drift by up to {naive.worst_drift:.3g} between resets")

    print("\nmemory (the engine's indices, targets and merge layouts; the default monitor adds a copy of the weights)")
    for fraction in (0.01, 0.5, 0.8):
        model = MLP(width)
        callback = ours(fraction, monitor=False)(model)[0]
        timed_fit(model, [callback], loader(width, 3), 0)
        stored, pinned = pin_bytes(callback)
        results[f"bytes_per_pinned_{fraction}"] = stored / pinned
        wide = step_buffer_bytes(callback) / pinned
        results[f"step_buffer_bytes_per_pinned_{fraction}"] = wide
        print(
            f"  {fraction:.0%} pinned: {stored / pinned:.2f} bytes per pinned element (goal <= 8), "
            f"+ {wide:.2f} for int64 copies of the indices (tensors with at most 65,536 pinned elements)"
        )
    rss_cases = ["unpinned", "pinned 1%"] if quick else list(CASES_BY_NAME)
    rss = peak_rss_mb(width, rss_cases, 4, forked=smoke)
    results["peak_rss_mb"] = rss
    for name, mb in rss.items():
        print(f"  peak RSS {name:<24} {mb:8.1f} MB  ({mb / rss['unpinned']:.3f} x unpinned)")

    print("\nset-up: resolving 1% by fraction")
    width_big = 200 if smoke else 1581 if quick else 5000
    seconds, count = setup_seconds(width_big, 4, 0.01)
    results["setup_seconds"] = {"params": count, "seconds": seconds}
    print(f"  {count / 1e6:.0f}M parameters: {seconds:.2f} s (goal < 2 s)")

    print("\nscaling: step time at 1% pinned / unpinned")
    sizes = (width,) if smoke else (500,) if quick else (500, 1581, 2500, 5000)
    scaling = {}
    for size in sizes:
        pair = [Case("unpinned", lambda model: []), Case("pinned 1%", ours(0.01))]
        ratio = compare(size, pair, 2, steps if smoke else 8 if size < 5000 else 6, warmup if smoke else 2)["pinned 1%"]
        scaling[4 * (size * size + size)] = ratio
        print(f"  {4 * (size * size + size) / 1e6:6.1f}M parameters: {ratio:.3f}")
    results["scaling"] = scaling

    print()
    if quick:  # the section runs; --depth measures it
        results["depth"] = depth_rows((4, 64), (0.01,), ("AdamW for-loop",), 1, 4, 1,
                                      parameters=20_000 if smoke else 250_000)
    else:
        results["depth"] = depth_rows((4, 64, 256, 1024), (0.01, 0.2), tuple(DEPTH_OPTIMIZERS), 3, 15, 3)

    print("\nDDP, 2 CPU processes (ddp_spawn, one thread each): step time at 1% pinned / unpinned")
    ddp_width = width if smoke else 400 if quick else 1000
    ddp_steps, ddp_warmup = (steps, warmup) if smoke else (8, 2) if quick else (16, 2)
    ddp_ratio = ddp_step_ratio(ddp_width, 1 if quick else 3, ddp_steps, ddp_warmup,
                               start_method="forkserver" if smoke else "spawn")
    results["ddp_step_time_ratio"] = ddp_ratio
    print(f"  {4 * (ddp_width * ddp_width + ddp_width) / 1e6:.1f}M parameters: {ddp_ratio:.3f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


def _machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


if __name__ == "__main__":
    main()
