"""The app's continual-learning run (``experiment=continual``): task-incremental split data, one
head per task, PackNet-style task ownership held by :class:`~lightning_pin.PinCallback`, against
naive fine-tuning; writes ``continual_report.json``, the accuracy heat map and a checkpoint that
holds the ownership (``task_ownership``).

Each phase of a task is one ``trainer.fit`` of the same LightningModule with a new
``PinCallback(own.pins(t))``. Lightning builds the optimizer again in ``configure_optimizers`` on
every fit (fresh statistics); the pins do not depend on it (a plain loop with :func:`~lightning_pin.pin`
keeps one optimizer and scheduler across tasks, see ``examples/continual_packnet.py``).
"""

from __future__ import annotations

import copy
import json
import logging
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pin.app.sweep import RUN_SUMMARY
from lightning_pin.callbacks.pin_callback import PinCallback
from lightning_pin.core.errors import PinError
from lightning_pin.reporting.continual import PLOT_NAME, REPORT_NAME, print_comparison, write_continual_report
from lightning_pin.tasks import AccuracyMatrix, TaskOwnership

__all__ = ["CONTINUAL_CKPT", "METHODS", "TaskIncremental", "log", "run_continual", "split_tasks"]


log = logging.getLogger("lightning_pin.train")

CONTINUAL_CKPT = "continual.ckpt"
METHODS = ("naive", "task_ownership")


class TaskIncremental(pl.LightningModule):
    """A classifier's backbone with its ``head`` replaced by one head per task (``heads.<t-1>``).

    ``task`` (1-based) chooses the head that ``training_step`` trains and ``forward`` uses.

    Example::

        >>> import torch
        >>> from lightning_pin.app.models import MLP
        >>> model = TaskIncremental(MLP(hidden=(16,)), tasks=5, classes_per_task=2)
        >>> model.task = 3
        >>> model(torch.zeros(4, 1, 8, 8)).shape
        torch.Size([4, 2])
    """

    def __init__(self, backbone: nn.Module, tasks: int, classes_per_task: int, optimizer: Any = None) -> None:
        super().__init__()
        head = getattr(backbone, "head", None)
        if not isinstance(head, nn.Linear):
            raise PinError(f"continual: the backbone {type(backbone).__name__} has no Linear `head` to replace "
                           "by per-task heads")
        backbone.head = nn.Identity()
        self.backbone = backbone
        self.heads = nn.ModuleList(nn.Linear(head.in_features, classes_per_task) for _ in range(tasks))
        self.optimizer_factory = optimizer or (lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=1e-2))
        self.task = 1
        self.ownership: Optional[TaskOwnership] = None

    def forward(self, x: Tensor) -> Tensor:
        return self.heads[self.task - 1](self.backbone(x))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        return self.optimizer_factory(self.parameters())

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.ownership is not None:
            checkpoint["task_ownership"] = self.ownership.state_dict()


def split_tasks(datamodule: Any, tasks: int, classes_per_task: int) -> list[dict[str, TensorDataset]]:
    """Per task, its train and validation samples with labels renumbered ``0..classes_per_task-1``."""
    datamodule.setup("fit")
    needed = tasks * classes_per_task
    if getattr(datamodule, "num_classes", needed) < needed:
        raise PinError(f"continual: {tasks} tasks of {classes_per_task} classes need {needed} classes, the data "
                       f"has {datamodule.num_classes}")
    splits = []
    for t in range(tasks):
        classes = torch.arange(t * classes_per_task, (t + 1) * classes_per_task)
        split = {}
        for part, dataset in (("train", datamodule.train_set), ("val", datamodule.val_set)):
            x, y = dataset.tensors
            keep = torch.isin(y, classes)
            split[part] = TensorDataset(x[keep], y[keep] - classes[0])
        splits.append(split)
    return splits


def run_continual(cfg: DictConfig) -> dict[str, Any]:
    """Train the tasks in sequence for each method and report. Returns the run summary.

    Raises:
        PinError: a bad ``continual`` setting (before any training), or pins off target after a fit.
    """
    started = time.perf_counter()
    settings = cfg.continual
    methods = list(settings.methods)
    unknown = [m for m in methods if m not in METHODS]
    if unknown or "task_ownership" not in methods:
        raise PinError(f"continual.methods must include 'task_ownership' and be among {list(METHODS)}, got {methods}")
    if not 0 <= settings.prune <= 1:
        raise PinError(f"continual.prune must be in [0, 1], got {settings.prune}")
    output_dir = Path(cfg.paths.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)

    datamodule = instantiate(cfg.data, _convert_="all")
    splits = split_tasks(datamodule, settings.tasks, settings.classes_per_task)
    optimizer = instantiate(cfg.optimizer, _convert_="all")
    backbone = instantiate(cfg.model.backbone, _convert_="all")
    initial = TaskIncremental(backbone, settings.tasks, settings.classes_per_task, optimizer)

    results, summary_extra = {}, {}
    for method in methods:
        model = copy.deepcopy(initial)  # every method starts from the same weights
        log.info(f"Continual learning, {method}: {settings.tasks} tasks of {settings.classes_per_task} classes")
        matrix, extra = _train_tasks(cfg, model, splits, method == "task_ownership", output_dir)
        results[method] = matrix.to_dict()
        summary_extra[method] = extra

    written = write_continual_report(results, output_dir, tasks=settings.tasks, prune_fraction=settings.prune,
                                     capacity_left=summary_extra["task_ownership"]["capacity"])
    print_comparison({"methods": results}, f"{settings.tasks} tasks, lightning-pin train experiment=continual")
    owned = results["task_ownership"]
    if owned["bwt"] != 0.0 or owned["fingerprints_unchanged"] is not True:
        raise PinError(f"continual: task ownership did not hold earlier tasks (BWT {owned['bwt']}, fingerprints "
                       f"unchanged: {owned['fingerprints_unchanged']})")
    summary = {
        "tags": list(cfg.tags),
        "final": owned["average_accuracy"],
        "bwt": owned["bwt"],
        "fingerprints_unchanged": owned["fingerprints_unchanged"],
        "methods": {m: {"average_accuracy": r["average_accuracy"], "bwt": r["bwt"]} for m, r in results.items()},
        "pins_exact": True,
        "seconds": round(time.perf_counter() - started, 1),
        "output_dir": str(output_dir),
        "files": [p.name for p in written] + [CONTINUAL_CKPT],
    }
    (output_dir / RUN_SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"lightning-pin: continual, task ownership BWT {owned['bwt']} (exact), average accuracy "
          f"{100 * owned['average_accuracy']:.1f}%; wrote {REPORT_NAME}, {PLOT_NAME}, {CONTINUAL_CKPT} into "
          f"{output_dir}", flush=True)
    return summary


def _trainer(cfg: DictConfig, callbacks: list[pl.Callback], max_epochs: int) -> pl.Trainer:
    make = instantiate(cfg.trainer, _partial_=True, _convert_="all")
    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    lightning_log.setLevel(logging.WARNING)
    try:
        return make(callbacks=callbacks, logger=False, enable_checkpointing=False, max_epochs=max_epochs,
                    limit_val_batches=0, num_sanity_val_steps=0, enable_model_summary=False)
    finally:
        lightning_log.setLevel(level)


def _accuracy(model: TaskIncremental, dataset: TensorDataset, task: int) -> float:
    model.eval()
    model.task = task
    x, y = dataset.tensors
    with torch.no_grad():
        correct = (model(x).argmax(1) == y).float().mean()
    model.train()
    return float(correct)


def _train_tasks(
    cfg: DictConfig, model: TaskIncremental, splits: list[dict[str, TensorDataset]], owned: bool, output_dir: Path
) -> tuple[AccuracyMatrix, dict[str, Any]]:
    settings = cfg.continual
    tasks = settings.tasks
    own = None
    if owned:
        own = model.ownership = TaskOwnership(model, settings.params, heads={t: f"heads.{t - 1}.*" for t in range(
            1, tasks + 1)}, norm=settings.norm)
    matrix = AccuracyMatrix(tasks)
    batch_size = cfg.data.batch_size
    trainer = None
    for task in range(1, tasks + 1):
        model.task = task
        loader = DataLoader(splits[task - 1]["train"], batch_size=batch_size, shuffle=True)
        phases = [(cfg.trainer.max_epochs, False)]
        if owned and task < tasks and settings.finetune_epochs > 0:
            phases.append((settings.finetune_epochs, True))
        for epochs, after_prune in phases:
            if after_prune:
                own.prune(task, settings.prune)
            callback = PinCallback(own.pins(task) if owned else [], verbose=False, monitor=False)
            trainer = _trainer(cfg, [callback], epochs)
            trainer.fit(model, loader)
            callback.verify(model)
        if owned:
            own.commit(task)
        matrix.measure(task, lambda j: _accuracy(model, splits[j - 1]["val"], j), own)
        log.info(f"after task {task}: " + " ".join(f"{100 * a:.1f}" for a in matrix.matrix[task - 1][:task]))
    extra: dict[str, Any] = {}
    if owned:
        extra["capacity"] = own.capacity()
        trainer.save_checkpoint(output_dir / CONTINUAL_CKPT, weights_only=False)
    return matrix, extra
