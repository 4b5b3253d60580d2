"""Hydra structured configs: the schema of ``conf/``, registered in Hydra's ConfigStore.

Every YAML option in ``conf/`` starts from one of these dataclasses::

    defaults:
      - /schema/trainer/default@_here_
      - _self_

so Hydra checks the YAML file and every command-line override against it before anything runs:
``trainer.max_epoch=3`` fails with ``Key 'max_epoch' not in 'TrainerConfig'``, and
``trainer.max_epochs=three`` with ``Value 'three' ... could not be converted to Integer``. A key
that a schema does not declare can still be added on purpose with Hydra's ``+key=value`` (for
instance ``+trainer.profiler=simple``).

Each group's options share one schema per kind of option: the optimizers one each, because their
arguments differ; the pin options one each, so that a knob is accepted only by the option that
uses it (``pin=none pin.fraction=0.1`` is an error, not a silent no-op).

``_target_`` names what :func:`hydra.utils.instantiate` builds; ``_partial_: true`` (optimizers)
builds a ``functools.partial`` that the model calls with its parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

__all__ = [
    "AdagradConfig", "AdamConfig", "AdamWConfig", "BitFaultsConfig", "CIFAR10DataConfig", "CNNClassifierConfig",
    "CellFaultsConfig", "ClassifierConfig", "ContinualConfig", "DigitsDataConfig", "ElementPinsConfig",
    "FaultMapConfig", "FaultPinsConfig", "FractionPinsConfig", "FreezeLayersConfig", "MLPClassifierConfig",
    "MLPConfig", "NeuronFaultsConfig", "OptimizerConfig", "PathsConfig", "PerTaskConfig", "PinCallbackConfig",
    "PinConfig", "PinMonitorConfig", "PinsConfig", "PretrainConfig", "RMSpropConfig", "SGDConfig", "SmallCNNConfig",
    "SyntheticDataConfig", "TinyTransformerConfig", "TorchvisionClassifierConfig", "TrainConfig", "TrainerConfig",
    "TransformerClassifierConfig", "register_configs",
]


# OmegaConf 2.3 has no Union type: keys that take "an int or a float" (limit_train_batches: 4 or
# 0.25), "a string or a list" (params) or "a number, a list or a node" (value) are typed Any,
# and the object they are passed to checks them (Lightning's Trainer, Pin, PinCallback).

# ----------------------------------------------------------------------------------------------
# data/


@dataclass
class DigitsDataConfig:
    """:class:`~lightning_pin.app.data.DigitsDataModule`: scikit-learn's 8x8 digits, 10 classes."""

    _target_: str = "lightning_pin.app.data.DigitsDataModule"
    batch_size: int = 64
    val_batch_size: int = 256
    val_fraction: float = 0.25
    seed: int = 0
    num_workers: int = 0


@dataclass
class SyntheticDataConfig:
    """:class:`~lightning_pin.app.data.SyntheticDataModule`: Gaussian blobs shaped like images."""

    _target_: str = "lightning_pin.app.data.SyntheticDataModule"
    num_samples: int = 2048
    num_classes: int = 10
    input_shape: List[int] = field(default_factory=lambda: [1, 8, 8])
    noise: float = 1.0
    batch_size: int = 64
    val_batch_size: int = 256
    val_fraction: float = 0.25
    seed: int = 0
    num_workers: int = 0


@dataclass
class FakeImagesDataConfig:
    """:class:`~lightning_pin.app.data.FakeImagesDataModule`: random images with a learnable class pattern."""

    _target_: str = "lightning_pin.app.data.FakeImagesDataModule"
    shape: List[int] = field(default_factory=lambda: [3, 32, 32])
    num_classes: int = 10
    num_samples: int = 1024
    signal: float = 1.0
    batch_size: int = 64
    val_batch_size: int = 256
    val_fraction: float = 0.25
    seed: int = 0
    num_workers: int = 0


@dataclass
class FakeTextDataConfig:
    """:class:`~lightning_pin.app.data.FakeTextDataModule`: random token ids with class marker tokens (dict batches)."""

    _target_: str = "lightning_pin.app.data.FakeTextDataModule"
    vocab_size: int = 100
    seq_len: int = 16
    num_classes: int = 2
    num_samples: int = 1024
    signal: float = 0.25
    batch_size: int = 32
    val_batch_size: int = 256
    val_fraction: float = 0.25
    seed: int = 0
    num_workers: int = 0


@dataclass
class CIFAR10DataConfig:
    """:class:`~lightning_pin.app.data.CIFAR10DataModule`: torchvision's CIFAR-10 (``download`` into ``data_dir``)."""

    _target_: str = "lightning_pin.app.data.CIFAR10DataModule"
    data_dir: str = MISSING
    download: bool = True
    batch_size: int = 128
    val_batch_size: int = 512
    num_workers: int = 0
    #: The torchvision data set class (tests put ``torchvision.datasets.FakeData`` in through a wrapper).
    dataset: str = "torchvision.datasets.CIFAR10"


# ----------------------------------------------------------------------------------------------
# model/: a Classifier around one backbone (the optimizer comes from optimizer/). ``model=custom``
# has no schema: your class gets exactly the keys you give it (see lightning_pin.app.custom).


@dataclass
class SmallCNNConfig:
    _target_: str = "lightning_pin.app.models.SmallCNN"
    num_classes: int = 10
    channels: List[int] = field(default_factory=lambda: [16, 32])
    in_channels: int = 1
    image_size: int = 8


@dataclass
class MLPConfig:
    _target_: str = "lightning_pin.app.models.MLP"
    in_features: int = 64
    hidden: List[int] = field(default_factory=lambda: [128, 64])
    num_classes: int = 10
    dropout: float = 0.0


@dataclass
class TinyTransformerConfig:
    _target_: str = "lightning_pin.app.models.TinyTransformer"
    num_classes: int = 10
    image_size: int = 8
    in_channels: int = 1
    dim: int = 32
    heads: int = 4
    layers: int = 2
    mlp_ratio: int = 2
    dropout: float = 0.0


@dataclass
class ClassifierConfig:
    """:class:`~lightning_pin.app.models.Classifier`; ``scheduler`` is a ``_partial_`` node or null."""

    _target_: str = "lightning_pin.app.models.Classifier"
    backbone: Any = MISSING
    scheduler: Any = None
    scheduler_interval: str = "epoch"


@dataclass
class CNNClassifierConfig(ClassifierConfig):
    backbone: SmallCNNConfig = field(default_factory=SmallCNNConfig)


@dataclass
class MLPClassifierConfig(ClassifierConfig):
    backbone: MLPConfig = field(default_factory=MLPConfig)


@dataclass
class TransformerClassifierConfig(ClassifierConfig):
    backbone: TinyTransformerConfig = field(default_factory=TinyTransformerConfig)


@dataclass
class TorchvisionClassifierConfig:
    """:func:`~lightning_pin.app.models.torchvision_classifier`: any torchvision classification model by name."""

    _target_: str = "lightning_pin.app.models.torchvision_classifier"
    name: str = "resnet18"
    num_classes: int = 10
    #: torchvision's weights name (``DEFAULT``, ``IMAGENET1K_V1``): downloaded, so null here.
    weights: Optional[str] = None
    scheduler: Any = None
    scheduler_interval: str = "epoch"


@dataclass
class HFClassifierConfig:
    """:func:`~lightning_pin.app.models.hf_classifier`: a Hugging Face model, by name or built from a config."""

    _target_: str = "lightning_pin.app.models.hf_classifier"
    #: A hub name in the local cache or a directory written by save_pretrained (from_pretrained).
    name: Optional[str] = None
    #: AutoConfig.for_model(**config) + from_config: random weights, no download ({model_type: bert, ...}).
    config: Any = None
    num_labels: int = 2
    #: text (sequence classification) or image (image classification); null: chosen by the data.
    task: Optional[str] = None
    vocab_size: Optional[int] = None
    image_shape: Optional[List[int]] = None
    scheduler: Any = None
    scheduler_interval: str = "epoch"


# ----------------------------------------------------------------------------------------------
# optimizer/: partials, called by the model with its parameters


@dataclass
class OptimizerConfig:
    _target_: str = MISSING
    _partial_: bool = True
    lr: float = MISSING
    weight_decay: float = 0.0
    foreach: Optional[bool] = None


@dataclass
class SGDConfig(OptimizerConfig):
    _target_: str = "torch.optim.SGD"
    lr: float = 0.1
    momentum: float = 0.9
    dampening: float = 0.0
    nesterov: bool = False


@dataclass
class AdamConfig(OptimizerConfig):
    _target_: str = "torch.optim.Adam"
    lr: float = 3e-3
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    amsgrad: bool = False


@dataclass
class AdamWConfig(AdamConfig):
    _target_: str = "torch.optim.AdamW"
    weight_decay: float = 1e-2


@dataclass
class RMSpropConfig(OptimizerConfig):
    _target_: str = "torch.optim.RMSprop"
    lr: float = 1e-3
    alpha: float = 0.99
    eps: float = 1e-8
    momentum: float = 0.0
    centered: bool = False


@dataclass
class AdagradConfig(OptimizerConfig):
    _target_: str = "torch.optim.Adagrad"
    lr: float = 3e-2
    lr_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10


# ----------------------------------------------------------------------------------------------
# pin/: what to pin. ``pins`` is the list the app builds; the other keys of an option are the
# knobs its pins refer to (``fraction: ${pin.fraction}``), so one override changes one number.


@dataclass
class PinConfig:
    """One :class:`~lightning_pin.Pin`, with the same keys.

    ``value`` may also be a ``_target_`` node that builds a value generator, such as
    :class:`~lightning_pin.app.pins.UniformValues`: the app calls it for every parameter the pin
    matches and pins the tensor it returns (random stuck-at values, reproducible from a seed).
    """

    params: Any = MISSING
    indices: Any = None
    mask: Any = None
    fraction: Optional[float] = None
    seed: int = 0
    value: Any = None
    start_step: int = 0
    stop_step: Optional[int] = None
    when: Optional[str] = None
    stuck_at_zero: Any = None
    stuck_at_one: Any = None
    bounds: Any = None
    buffers: bool = True


@dataclass
class PinsConfig:
    """``pin=none``, and the base of every pin option: the pins themselves."""

    pins: List[PinConfig] = field(default_factory=list)


@dataclass
class ElementPinsConfig(PinsConfig):
    """``pin=elements``: chosen elements of one parameter, forced to chosen values."""

    params: Any = MISSING
    indices: Any = MISSING
    value: Any = MISSING


@dataclass
class FractionPinsConfig(PinsConfig):
    """``pin=fraction``: a seeded random fraction of the matched parameters' elements."""

    params: Any = MISSING
    fraction: float = MISSING
    seed: int = 0
    value: Any = None


@dataclass
class FreezeLayersConfig(PinsConfig):
    """``pin=freeze_layers``: whole parameters, by glob, kept at their values."""

    params: Any = MISSING


@dataclass
class FaultMapConfig(PinsConfig):
    """``pin=fault_map``: stuck-at cells read from a file (see :func:`~lightning_pin.app.pins.fault_map_pins`)."""

    fault_map: str = MISSING


@dataclass
class CellFaultsConfig(PinsConfig):
    """``pin=cell_faults``: stuck-at cells drawn by :func:`lightning_pin.faults.cell_faults` (``faults`` calls it)."""

    params: Any = MISSING
    rate: float = MISSING
    sa1_fraction: float = 0.5
    high: Optional[float] = None
    seed: int = 0
    #: A ``_partial_`` node of a generator ``(module) -> list[Pin]``; the app calls it on the model it retrains.
    faults: Any = None


@dataclass
class BitFaultsConfig(PinsConfig):
    """``pin=bit_faults``: stuck bits drawn by :func:`lightning_pin.faults.bit_faults` (``faults`` calls it)."""

    params: Any = MISSING
    rate: float = MISSING
    bits: Any = None
    one_fraction: float = 0.5
    seed: int = 0
    #: Stuck bits of ``code_bits``-bit integer codes (per-channel scales from the weights) instead of float words.
    code_bits: Optional[int] = None
    #: A ``_partial_`` node of a generator ``(module) -> list[Pin]``; the app calls it on the model it retrains.
    faults: Any = None


@dataclass
class NeuronFaultsConfig(PinsConfig):
    """``pin=neuron_faults``: stuck neurons drawn by :func:`lightning_pin.faults.neuron_faults` (``faults`` calls it)."""

    #: Names of ``named_modules()`` (globs, ``re:``); null: every conv and linear layer of the model (the
    #: app's CNN: its two convolutions), see :func:`lightning_pin.app.fault_pins.default_neuron_modules`.
    modules: Any = None
    rate: float = MISSING
    #: What a stuck neuron reads: sa0, sa1 (``high``) or value (seeded in [low, high)); neuron_faults' ``kind``.
    stuck: str = "sa0"
    low: float = -2.0
    high: float = 2.0
    per: str = "channel"
    seed: int = 0
    #: A ``_partial_`` node of a generator ``(module) -> list[NeuronPin]``; the app calls it on the model it retrains.
    faults: Any = None


@dataclass
class FaultPinsConfig(PinsConfig):
    """``pin=faults``: faults of one kind at one rate, drawn from a seed (see :mod:`lightning_pin.app.fault_pins`).

    What ``lightning-pin faults`` sweeps: ``rate`` and ``seed`` alone decide the faulty cells, so
    every recipe meets the same faults. ``rate=0`` pins nothing (the control).
    """

    kind: str = "value"
    rate: float = 0.05
    seed: int = 0
    params: Any = MISSING
    #: kind=value: stuck-at values drawn uniformly from [low, high).
    low: float = -2.0
    high: float = 2.0
    #: kind=cell: share of stuck-at-1 cells, and their magnitude (null: the parameter's largest).
    sa1_fraction: float = 0.5
    cell_high: Optional[float] = None
    #: kind=bit: which bits may stick (null: all), and the share stuck at 1.
    bits: Any = None
    one_fraction: float = 0.5
    #: kind=bit: stuck bits of ``code_bits``-bit integer codes (per-channel scales from the weights; the
    #: forward reads the dequantized codes) instead of the float words (null).
    code_bits: Optional[int] = None
    #: kind=neuron: what a stuck neuron reads (sa0, sa1 = high, value in [low, high)), per channel or
    #: per output position, in the outputs of ``modules`` (null: the modules owning ``params``).
    neuron_kind: str = "sa0"
    per: str = "channel"
    modules: Any = None
    #: Map the pretrained model onto its faults before the forced accuracy and the retraining: hidden units
    #: permuted (function kept) so the faulty cells damage the weights least (:func:`lightning_pin.faults.remap`).
    remap: bool = False


@dataclass
class PerTaskConfig(PinsConfig):
    """``pin=per_task``: batches alternate between two tasks; each task's batches freeze the other's layers."""

    task_a_frozen: Any = MISSING
    task_b_frozen: Any = MISSING


# ----------------------------------------------------------------------------------------------
# trainer/, callbacks/, logger/, paths/


@dataclass
class TrainerConfig:
    """The :class:`lightning.pytorch.Trainer` arguments the configs use (``+trainer.<arg>=`` adds others).

    ``callbacks`` and ``logger`` come from their own groups; ``max_epochs`` is the pinned
    retraining's length (the plain pretraining's is ``pretrain.max_epochs``).
    """

    _target_: str = "lightning.pytorch.Trainer"
    accelerator: str = "cpu"
    devices: Any = 1
    strategy: str = "auto"
    num_nodes: int = 1
    precision: Any = None
    max_epochs: int = 6
    min_epochs: Optional[int] = None
    max_steps: int = -1
    limit_train_batches: Any = None
    limit_val_batches: Any = None
    val_check_interval: Any = None
    check_val_every_n_epoch: Optional[int] = 1
    num_sanity_val_steps: Optional[int] = None
    log_every_n_steps: Optional[int] = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = None
    gradient_clip_algorithm: Optional[str] = None
    deterministic: Any = None
    benchmark: Optional[bool] = None
    enable_checkpointing: Optional[bool] = None
    enable_progress_bar: Optional[bool] = None
    enable_model_summary: Optional[bool] = None
    default_root_dir: Optional[str] = None


@dataclass
class PinMonitorConfig:
    """:class:`~lightning_pin.PinMonitor`: what is measured, logged and reported."""

    _target_: str = "lightning_pin.PinMonitor"
    drift: bool = True
    weight_drift: bool = True
    # True, False, or a torchmetrics Metric node (_target_: torchmetrics...).
    accuracy: Any = True
    name: Optional[str] = None
    tolerance: float = 0.01
    higher_is_better: Optional[bool] = None
    max_gap: Optional[float] = None
    max_gap_from_epoch: int = 0
    on_max_gap: str = "stop"
    predict: Optional[str] = None
    dataloader_idx: int = 0
    report: bool = True
    report_dir: Optional[str] = None
    #: Known already (a fault study measures it once for all its jobs): not measured again.
    baseline: Optional[float] = None


@dataclass
class PinCallbackConfig:
    """:class:`~lightning_pin.PinCallback`, less its pins: the app passes the pins of the ``pin`` group."""

    _target_: str = "lightning_pin.PinCallback"
    strict: bool = True
    verify: str = "end"
    verbose: bool = True
    monitor: PinMonitorConfig = field(default_factory=PinMonitorConfig)


@dataclass
class PathsConfig:
    #: Where this run writes (Hydra's run or job directory).
    output_dir: str = MISSING
    #: The directory the command was started from (relative paths in configs are taken from it).
    work_dir: str = MISSING
    #: Where data sets that are downloaded live (data=cifar10).
    data_dir: str = MISSING


@dataclass
class PretrainConfig:
    """The plain fit (no pins) that makes the model to pin; skipped when ``ckpt_path`` is given."""

    max_epochs: int = 8
    #: Stop after the pretraining (and its checkpoint): the baseline of a fault study.
    only: bool = False


@dataclass
class ContinualConfig:
    """``experiment=continual``: tasks learned in sequence with task ownership (:mod:`lightning_pin.tasks`).

    Each task takes ``classes_per_task`` classes of the data (task t: classes ``(t-1)*k .. t*k-1``)
    and gets its own head; ``trainer.max_epochs`` trains a task, ``finetune_epochs`` retrains it
    after pruning ``prune`` of its elements.
    """

    tasks: int = 5
    classes_per_task: int = 2
    prune: float = 0.75
    finetune_epochs: int = 2
    #: The parameters tasks share (each task's head is its own).
    params: str = "backbone.*"
    #: "per_task" normalization snapshots, or "first" (held after task 1).
    norm: str = "per_task"
    #: Which ways to train, side by side: "task_ownership" and the "naive" control.
    methods: List[str] = field(default_factory=lambda: ["naive", "task_ownership"])


# ----------------------------------------------------------------------------------------------
# train.yaml


@dataclass
class TrainConfig:
    """The root of ``conf/train.yaml``: one key per group, and the run's own settings."""

    data: Any = MISSING
    model: Any = MISSING
    optimizer: Any = MISSING
    pin: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # name -> callback node; ``pin_callback`` is the PinCallback of the pinned retraining.
    callbacks: Dict[str, Any] = field(default_factory=dict)
    # name -> logger node (empty: no logger; the report is written to paths.output_dir anyway).
    logger: Dict[str, Any] = field(default_factory=dict)
    paths: PathsConfig = field(default_factory=PathsConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    #: Labels copied into run_summary.json (experiments set their own).
    tags: List[str] = field(default_factory=list)
    seed: int = 0
    #: Load the model's weights from this Lightning checkpoint (or state dict) instead of pretraining.
    ckpt_path: Optional[str] = None
    #: torch's intra-op threads (null: torch's default, one per core).
    torch_threads: Optional[int] = None
    #: The run summary key returned to sweepers (Optuna maximizes or minimizes it).
    optimized_metric: str = "final"
    #: The validation metric behind baseline / forced / final: a name the model logs (the app's classifier logs
    #: val_acc and val_loss).
    metric: str = "val_acc"
    #: ``max`` (higher is better) or ``min`` (a loss, an error).
    metric_mode: str = "max"
    #: Set (by ``experiment=continual``): learn tasks in sequence with task ownership instead.
    continual: Optional[ContinualConfig] = None
    #: Return the saved summary of a job whose directory already holds run_summary.json (resuming a sweep).
    skip_finished: bool = False
    #: What the pinned retraining keeps: ``full`` (``pinned.ckpt``: weights, optimizer state, pin state: resumable)
    #: or ``weights`` (``pinned.safetensors`` and the pin state ``pins.pt``, which ``lightning-pin check`` reads;
    #: what ``lightning-pin faults`` keeps per job unless ``--keep-checkpoints``).
    pinned_checkpoint: str = "full"


_SCHEMAS: dict[str, dict[str, type]] = {
    "schema/data": {
        "digits": DigitsDataConfig,
        "synthetic": SyntheticDataConfig,
        "cifar10": CIFAR10DataConfig,
        "fake_images": FakeImagesDataConfig,
        "fake_text": FakeTextDataConfig,
    },
    "schema/model": {
        "classifier": ClassifierConfig,
        "cnn": CNNClassifierConfig,
        "mlp": MLPClassifierConfig,
        "transformer": TransformerClassifierConfig,
        "torchvision": TorchvisionClassifierConfig,
        "hf": HFClassifierConfig,
    },
    "schema/optimizer": {
        "sgd": SGDConfig,
        "adam": AdamConfig,
        "adamw": AdamWConfig,
        "rmsprop": RMSpropConfig,
        "adagrad": AdagradConfig,
    },
    "schema/pin": {
        "none": PinsConfig,
        "elements": ElementPinsConfig,
        "fraction": FractionPinsConfig,
        "freeze_layers": FreezeLayersConfig,
        "fault_map": FaultMapConfig,
        "cell_faults": CellFaultsConfig,
        "bit_faults": BitFaultsConfig,
        "neuron_faults": NeuronFaultsConfig,
        "faults": FaultPinsConfig,
        "per_task": PerTaskConfig,
    },
    "schema/trainer": {"default": TrainerConfig},
    "schema/callbacks": {"pin_callback": PinCallbackConfig},
    "schema/paths": {"default": PathsConfig},
    "schema": {"train": TrainConfig},
}


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore, under ``schema/<group>/<name>``, and register the
    ``default_pins`` resolver the pin options use (:func:`lightning_pin.app.custom.default_pins`).

    Call before Hydra composes (``lightning_pin.train`` does it on import; tests using Hydra's
    compose API call it themselves). Storing twice replaces, so repeated calls are harmless.
    """
    from lightning_pin.app.custom import register_resolver

    register_resolver()  # ${default_pins:...} of conf/pin/*.yaml
    store = ConfigStore.instance()
    for group, nodes in _SCHEMAS.items():
        for name, node in nodes.items():
            store.store(group=group, name=name, node=node)
