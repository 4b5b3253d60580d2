"""The Hydra configs: every option of every group composes and builds what it says, bad overrides
fail with Hydra's message naming the key, and PinCallback builds from plain dicts (instantiate) and
from LightningCLI."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import lightning_pin
from lightning_pin import Pin, PinCallback, PinError, PinMonitor
from lightning_pin.app.pins import UniformValues, fault_map_pins, random_fault_map, realize
from lightning_pin.app.config import TrainerConfig, register_configs
from lightning_pin.core.plan import fraction_indices, resolve
from lightning_pin.app.train import build_loggers, build_pin_callback, build_pins, build_trainer

from helpers import TinyNet, make_loader, trainer

CONF = Path(lightning_pin.__file__).resolve().parents[1] / "conf"
GROUPS = (
    "data", "model", "optimizer", "pin", "trainer", "callbacks", "logger", "paths", "experiment", "hparams_search"
)


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


#: Each composition once per module (a fifth of a second each; several tests read the same one): a copy per call.
_COMPOSED: dict[tuple, DictConfig] = {}


@pytest.fixture(scope="module", autouse=True)
def _schemas():
    """The app's structured configs in Hydra's ConfigStore, registered once for the module's compositions."""
    register_configs()
    yield
    _COMPOSED.clear()


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    """The output directory of the compositions that only read their config (shared, so they are composed once)."""
    return tmp_path_factory.mktemp("out")


def compose_train(directory: Path, *overrides: str, hydra_config: bool = False) -> DictConfig:
    key = (str(directory), overrides, hydra_config)
    if key not in _COMPOSED:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            _COMPOSED[key] = compose(
                "train",
                overrides=[f"paths.output_dir={directory}", f"paths.work_dir={directory}", *overrides],
                return_hydra_config=hydra_config,
            )
    return copy.deepcopy(_COMPOSED[key])


def build_model(cfg):
    optimizer = instantiate(cfg.optimizer, _convert_="all")
    return instantiate(cfg.model, _partial_=True, _convert_="all")(optimizer=optimizer)


def composition_error(tmp_path: Path, *overrides: str) -> str:
    """The message Hydra prints for a composition that fails (the exception and its cause)."""
    with pytest.raises(Exception) as info:
        compose_train(tmp_path, *overrides)
    return f"{info.value}\n{info.value.__cause__}"


# ------------------------------------------------------------------------------------------------
# Every option of every group


def test_every_group_has_its_options():
    assert options("model") == ["cnn", "custom", "hf", "mlp", "torchvision", "transformer"]
    assert options("data") == ["cifar10", "custom", "digits", "fake_images", "fake_text", "synthetic"]
    assert {"sgd", "adam", "adamw"} <= set(options("optimizer"))
    assert options("pin") == [
        "bit_faults", "cell_faults", "elements", "fault_map", "faults", "fraction", "freeze_layers", "neuron_faults",
        "none", "per_task",
    ]
    assert {"cpu", "ddp_sim", "gpu"} <= set(options("trainer"))
    assert {"csv", "tensorboard"} <= set(options("logger"))
    assert options("hparams_search") == ["optuna"]
    assert len(options("experiment")) >= 4


@pytest.mark.parametrize(
    "group,option", [(group, option) for group in GROUPS for option in options(group)], ids=lambda x: str(x)
)
def test_every_option_composes_and_resolves(out, group, option):
    if (group, option) == ("hparams_search", "optuna"):
        # Its hydra/sweeper=optuna comes with the Hydra plugin (the optuna-sweeper extra).
        pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    cfg = compose_train(out, f"{group}={option}")
    # Every interpolation resolves (the fault map path is the one required value left open).
    container = OmegaConf.to_container(cfg, resolve=True)
    assert container["paths"]["output_dir"] == str(out)
    if group == "pin" and option == "fault_map":
        assert OmegaConf.is_missing(cfg.pin, "fault_map")
    if group not in ("experiment", "hparams_search", "paths"):
        assert cfg[group] is not None


def test_defaults_tell_the_stuck_at_fault_story(out):
    cfg = compose_train(out)
    assert cfg.model.backbone._target_.endswith("SmallCNN")
    assert cfg.data._target_.endswith("DigitsDataModule")
    assert cfg.pin.fraction == 0.05 and cfg.trainer.max_epochs > 0
    model = build_model(cfg)
    pins = build_pins(cfg.pin, model)
    plan = resolve(pins, model)
    # 5% of each conv weight, at seeded random values in [-2, 2): the same numbers every time.
    values = UniformValues(-2.0, 2.0, seed=1)
    for name in ("backbone.features.0.weight", "backbone.features.2.weight"):
        selection = plan.pins[0].selections[name]
        parameter = model.get_parameter(name)
        expected_index = fraction_indices(name, parameter.numel(), 0.05, 0)
        assert torch.equal(selection.index, expected_index)
        assert torch.equal(selection.values, values(name, parameter.detach()).reshape(-1)[expected_index])
    assert set(plan.pins[0].selections) == {"backbone.features.0.weight", "backbone.features.2.weight"}


# Your own data (custom) and torchvision's CIFAR-10 are built in tests/test_custom_model.py, the fake data
# sets (shaped for real networks) in tests/test_fake_data.py.
@pytest.mark.parametrize("option", [o for o in options("data") if o not in ("custom", "cifar10", "fake_images",
                                                                             "fake_text")])
def test_data_options_build_data(out, option):
    data = instantiate(compose_train(out, f"data={option}").data, _convert_="all")
    data.setup()
    x, y = next(iter(data.train_dataloader()))
    assert tuple(x.shape[1:]) == (1, 8, 8) and int(y.max()) < data.num_classes == 10


# Your own model (custom) and the torchvision recipe are built in tests/test_custom_model.py, model=hf (a config
# of its own) in tests/test_hf_models.py.
@pytest.mark.parametrize("option", [o for o in options("model") if o not in ("custom", "torchvision", "hf")])
def test_model_options_build_classifiers(out, option):
    model = build_model(compose_train(out, f"model={option}"))
    assert model(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
    assert type(model.configure_optimizers()).__name__ == "AdamW"  # the default optimizer group


@pytest.mark.parametrize("option", options("optimizer"))
def test_optimizer_options_are_partials(out, option):
    cfg = compose_train(out, f"optimizer={option}")
    optimizer = instantiate(cfg.optimizer)(torch.nn.Linear(2, 2).parameters())
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert type(optimizer).__name__.lower() == option
    assert optimizer.param_groups[0]["lr"] == cfg.optimizer.lr


def test_pin_options_build_their_pins(out, tmp_path):
    def pins_of(*overrides):
        cfg = compose_train(out, *overrides)
        model = build_model(cfg)
        pins = build_pins(cfg.pin, model)
        return model, pins, resolve(pins, model) if pins else None

    _, pins, _ = pins_of("pin=none")
    assert pins == []

    model, pins, plan = pins_of("pin=elements")
    selection = plan.pins[0].selections["backbone.features.0.weight"]
    assert selection.values.tolist() == [25.0, 5.0, 125.0]  # (0,0,1,1) < (5,0,2,2) < (12,0,0,1) row-major

    _, pins, plan = pins_of("pin=fraction", "pin.fraction=0.2", "pin.value=0.0")
    selection = plan.pins[0].selections["backbone.features.2.weight"]
    assert selection.count == round(0.2 * 4608) and bool((selection.values == 0).all())

    _, pins, plan = pins_of("pin=freeze_layers", "pin.params=[backbone.features.*,backbone.head.bias]")
    assert set(plan.parameters) == {
        "backbone.features.0.weight", "backbone.features.0.bias", "backbone.features.2.weight",
        "backbone.features.2.bias", "backbone.head.bias",
    }
    assert all(s.index is None and s.values is None for rp in plan.pins for s in rp.selections.values())

    _, pins, plan = pins_of("pin=per_task")
    assert [p.when for p in pins] == ["lightning_pin.app.schedules.task_a", "lightning_pin.app.schedules.task_b"]
    assert plan.pins[0].when(None, 4) and not plan.pins[0].when(None, 5) and plan.pins[1].when(None, 5)

    model = build_model(compose_train(out))
    faults = random_fault_map(model, "backbone.features.2.weight", fraction=0.1, low=-2.0, high=2.0, seed=3)
    torch.save(faults, tmp_path / "faults.pt")
    _, pins, plan = pins_of("pin=fault_map", f"pin.fault_map={tmp_path / 'faults.pt'}")
    selection = plan.pins[0].selections["backbone.features.2.weight"]
    stuck = faults["backbone.features.2.weight"].reshape(-1)
    assert torch.equal(selection.index, (~stuck.isnan()).nonzero().squeeze(1))
    assert torch.equal(selection.values, stuck[selection.index])


def test_fault_groups_draw_what_the_generators_draw_with_rate_and_seed_overrides(out):
    from lightning_pin.faults import bit_faults, cell_faults

    cfg = compose_train(out, "pin=cell_faults", "pin.rate=0.2", "pin.seed=3", "pin.sa1_fraction=0.25")
    model = build_model(cfg)
    pins = build_pins(cfg.pin, model)
    expected = cell_faults(model, "backbone.features.*.weight", 0.2, sa1_fraction=0.25, seed=3)
    assert [p.fingerprint() for p in pins] == [p.fingerprint() for p in expected] and len(pins) == 2

    cfg = compose_train(out, "pin=bit_faults", "pin.rate=0.01", "pin.seed=4", "pin.bits=exponent")
    pins = build_pins(cfg.pin, model)
    expected = bit_faults(model, "backbone.features.*.weight", 0.01, bits="exponent", seed=4)
    assert [p.fingerprint() for p in pins] == [p.fingerprint() for p in expected] and len(pins) == 2
    cfg = compose_train(out, "pin=bit_faults", "pin.bits=[30,31]", "pin.params=backbone.head.weight")
    (p,) = build_pins(cfg.pin, model)
    assert p.params == "backbone.head.weight" and bool((((p.stuck_at_zero | p.stuck_at_one) & ~(3 << 30)) == 0).all())
    with pytest.raises(PinError, match="bit 40 is outside the 32-bit word"):
        build_pins(compose_train(out, "pin=bit_faults", "pin.bits=40").pin, model)


def test_fault_map_group_reads_stuck_bits_and_bounds(out, tmp_path):
    from lightning_pin.faults import bit_faults, save_fault_map

    model = build_model(compose_train(out))
    drawn = bit_faults(model, "backbone.features.0.weight", rate=0.05, seed=1)
    drawn.append(Pin("backbone.head.bias", indices=[1, 4], bounds=(0.0, 0.5)))
    save_fault_map(drawn, tmp_path / "chip.safetensors")
    cfg = compose_train(out, "pin=fault_map", f"pin.fault_map={tmp_path / 'chip.safetensors'}")
    pins = build_pins(cfg.pin, model)
    assert [(p.params, p.kind) for p in pins] == [("backbone.features.0.weight", "stuck_bits"),
                                                  ("backbone.head.bias", "bounds")]  # fmt: skip
    before, after = resolve(drawn, model), resolve(pins, model)
    for a, b in zip(before.pins, after.pins):
        (s,), (t,) = a.selections.values(), b.selections.values()
        assert torch.equal(s.index, t.index)
        for field in ("stuck_at_zero", "stuck_at_one", "low", "high"):
            assert (getattr(s, field) is None) == (getattr(t, field) is None)
            assert getattr(s, field) is None or torch.equal(getattr(s, field), getattr(t, field))


@pytest.mark.parametrize("option", options("experiment"))
def test_experiment_pins_resolve_on_their_model(out, option):
    cfg = compose_train(out, f"experiment={option}")
    if cfg.get("continual") is not None:  # its pins come from task ownership, one set per task
        from lightning_pin.app.continual import TaskIncremental
        from lightning_pin.tasks import TaskOwnership

        settings = cfg.continual
        model = TaskIncremental(instantiate(cfg.model.backbone), settings.tasks, settings.classes_per_task)
        heads = {t: f"heads.{t - 1}.*" for t in range(1, settings.tasks + 1)}
        own = TaskOwnership(model, settings.params, heads=heads, norm=settings.norm)
        own.pins(1)
        own.commit(1)
        assert own.pins(2) and sum(resolve(own.pins(2), model).pinned_counts().values()) > 0
        assert cfg.tags and cfg.tags != ["dev"]
        return
    model = build_model(cfg)
    pins = build_pins(cfg.pin, model)
    plan = resolve(pins, model)  # a pattern naming no parameter of this model would raise here
    assert pins and sum(plan.pinned_counts().values()) > 0
    assert cfg.tags and cfg.tags != ["dev"]


@pytest.mark.parametrize("option", ["cpu", "ddp_sim"])
def test_trainer_options_build_trainers(tmp_path, option):
    cfg = compose_train(tmp_path, f"trainer={option}", "logger=many_loggers")
    built = build_trainer(cfg, "pinned", callbacks=[])
    assert built.max_epochs == cfg.trainer.max_epochs
    assert built.world_size == (2 if option == "ddp_sim" else 1)
    assert [type(lg).__name__ for lg in built.loggers] == ["CSVLogger", "TensorBoardLogger"]
    assert all(lg.version == "pinned" for lg in built.loggers)


def test_gpu_trainer_asks_for_a_gpu(out):
    cfg = compose_train(out, "trainer=gpu")
    assert (cfg.trainer.accelerator, cfg.trainer.devices) == ("gpu", 1)


@pytest.mark.parametrize("option", options("callbacks"))
def test_callback_options_build_callbacks(out, option):
    cfg = compose_train(out, f"callbacks={option}")
    if "pin_callback" in cfg.callbacks:
        callback = build_pin_callback(cfg, [Pin("backbone.head.bias", value=0.0)])
        assert isinstance(callback, PinCallback) and isinstance(callback.monitor, PinMonitor)
        assert callback.monitor.tracks_accuracy and callback.monitor.report_dir == str(out)
    for name, node in cfg.callbacks.items():
        if name != "pin_callback":
            assert isinstance(instantiate(node), L.Callback)


def test_logger_versions_per_phase(out):
    cfg = compose_train(out, "logger=csv")
    assert [lg.log_dir for lg in build_loggers(cfg, "pretrain")] == [str(out / "csv" / "pretrain")]


def test_optuna_search_sweeps_lr_and_fraction(out):
    # hparams_search=optuna needs the Hydra plugin (the optuna-sweeper extra); `lightning-pin tune` does not.
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    cfg = compose_train(out, "hparams_search=optuna", hydra_config=True)
    assert cfg.hydra.sweeper._target_.endswith("OptunaSweeper")
    assert cfg.hydra.sweeper.direction == "maximize" and cfg.optimized_metric == "final"
    assert set(cfg.hydra.sweeper.params) == {"optimizer.lr", "pin.fraction"}
    assert any(cb._target_.endswith("SweepSummary") for cb in cfg.hydra.callbacks.values())


# ------------------------------------------------------------------------------------------------
# Bad overrides fail before anything runs, with Hydra's message naming the key


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["trainer.max_epoch=3"], "Key 'max_epoch' not in 'TrainerConfig'"),
        (["trainer.max_epochs=three"], "Value 'three' of type 'str' could not be converted to Integer"),
        (["pin.fraction=lots"], "could not be converted to Float"),
        (["pin=none", "pin.fraction=0.1"], "Key 'fraction' not in 'PinsConfig'"),
        (["optimizer=sgd", "optimizer.betas=[0.9,0.99]"], "Key 'betas' not in 'SGDConfig'"),
        (["model.backbone.chanels=[8,16]"], "Key 'chanels' not in 'SmallCNNConfig'"),
        (["data.batch_size=1.5"], "could not be converted to Integer"),
        (["pin.pins=[{params: x, fracton: 0.1}]"], "Key 'fracton' not in 'PinConfig'"),
        (["model=cnnn"], "Could not find 'model/cnnn'"),
        (["callbacks.pin_callback.monitor.tolerence=0.1"], "Key 'tolerence' not in 'PinMonitorConfig'"),
    ],
)
def test_bad_overrides_fail_with_hydras_message(tmp_path, overrides, message):
    assert message in composition_error(tmp_path, *overrides)


def test_every_schema_field_is_an_argument_of_its_target():
    """The schemas mirror __init__ signatures: a renamed argument must fail here, not at run time."""
    import dataclasses
    import inspect

    from hydra.utils import get_method

    from lightning_pin.app import config

    checked = []
    for schema in vars(config).values():
        if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
            continue
        target = {f.name: f.default for f in dataclasses.fields(schema)}.get("_target_")
        if not isinstance(target, str) or target == "???":
            continue  # no target (PinConfig, PathsConfig, ...) or an abstract base (OptimizerConfig)
        parameters = inspect.signature(get_method(target)).parameters
        for field in dataclasses.fields(schema):
            if field.name not in ("_target_", "_partial_"):
                assert field.name in parameters, f"{schema.__name__}.{field.name} is not an argument of {target}"
        checked.append(schema.__name__)
    assert {"TrainerConfig", "PinCallbackConfig", "PinMonitorConfig", "SmallCNNConfig", "AdamWConfig"} <= set(checked)
    # 3 data, 3 backbones, 5 classifiers (the torchvision recipe's included), 5 optimizers, trainer, callback, monitor
    assert len(checked) == 22


def test_schema_types_are_checked_on_merge():
    schema = OmegaConf.structured(TrainerConfig)
    with pytest.raises(Exception, match="could not be converted to Integer"):
        OmegaConf.merge(schema, {"max_epochs": "many"})
    with pytest.raises(Exception, match="Key 'max_epoch' not in 'TrainerConfig'"):
        OmegaConf.merge(schema, {"max_epoch": 3})
    assert OmegaConf.merge(schema, {"max_epochs": "7"}).max_epochs == 7


def test_bad_pin_is_a_pin_error_before_any_training(tmp_path):
    cfg = compose_train(tmp_path, "pin.params=backbone.nothing.*")
    model = build_model(cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(PinError, match="matches no parameter.*closest names"):
        build_pins(cfg.pin, model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# ------------------------------------------------------------------------------------------------
# Value generators and fault maps


def test_uniform_values_are_reproducible_per_parameter():
    values = UniformValues(-0.5, 0.5, seed=7)
    a = values("w", torch.zeros(4, 5))
    assert torch.equal(a, values("w", torch.zeros(4, 5)))
    assert not torch.equal(a, values("v", torch.zeros(4, 5)))  # each parameter gets its own stream
    assert bool((a >= -0.5).all() and (a < 0.5).all()) and a.dtype == torch.float32
    assert values("w", torch.zeros(3, dtype=torch.float64)).dtype == torch.float64


def test_realize_replaces_a_generator_by_tensors_and_leaves_other_pins():
    model = TinyNet()
    plain = Pin("head.bias", value=0.0)
    assert realize(plain, model) is plain
    realized = realize(Pin("*.weight", fraction=0.5, value=UniformValues(seed=2)), model)
    assert set(realized.value) == {"encoder.weight", "head.weight"}
    assert realized.value["head.weight"].shape == model.head.weight.shape


def test_fault_map_without_faults_or_file_is_an_error(tmp_path):
    with pytest.raises(PinError, match="does not exist"):
        fault_map_pins(tmp_path / "missing.pt")
    torch.save({"head.weight": torch.full((3, 16), float("nan"))}, tmp_path / "healthy.pt")
    with pytest.raises(PinError, match="marks no faulty cell"):
        fault_map_pins(tmp_path / "healthy.pt")


# ------------------------------------------------------------------------------------------------
# PinCallback from plain dicts (hydra.utils.instantiate) and from LightningCLI


def test_pin_callback_instantiates_from_plain_dicts():
    config = {
        "_target_": "lightning_pin.PinCallback",
        "pins": [{"params": "head.weight", "indices": [[0, 1], [2, 3]], "value": [2.5, -1.5]}, {"params": "encoder.*"}],
        "verify": "step",
        "monitor": {"_target_": "lightning_pin.PinMonitor", "weight_drift": False},
    }
    callback = instantiate(config)
    assert isinstance(callback, PinCallback) and isinstance(callback.monitor, PinMonitor)
    assert [p.params for p in callback.pins] == ["head.weight", "encoder.*"]
    model = TinyNet()
    encoder = model.encoder.weight.detach().clone()
    trainer(callbacks=[callback], max_epochs=2).fit(model, make_loader())
    callback.verify(model)
    assert torch.equal(model.head.weight[[0, 2], [1, 3]], torch.tensor([2.5, -1.5]))
    assert torch.equal(model.encoder.weight, encoder)


def test_pin_callback_builds_from_lightning_cli(tmp_path, monkeypatch):
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    from lightning_pin.app.data import SyntheticDataModule
    from lightning_pin.app.models import Classifier

    config = tmp_path / "config.yaml"
    config.write_text(
        """
model:
  backbone:
    class_path: lightning_pin.app.models.MLP
    init_args: {hidden: [16]}
data: {num_samples: 128}
trainer:
  max_epochs: 1
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  callbacks:
    - class_path: lightning_pin.PinCallback
      init_args:
        pins:
          - {params: backbone.head.weight, indices: [[0, 1], [2, 3]], value: [25.0, 5.0]}
          - {params: "backbone.layers.*", fraction: 0.1, seed: 3}
        verify: step
        monitor:
          class_path: lightning_pin.PinMonitor
          init_args: {accuracy: true}
"""
    )
    monkeypatch.setattr(sys, "argv", ["cli"])  # the config comes from args, not from pytest's command line
    cli = LightningCLI(Classifier, SyntheticDataModule, run=False, save_config_callback=None,
                       args=["--config", str(config)])
    callback = next(cb for cb in cli.trainer.callbacks if isinstance(cb, PinCallback))
    assert callback.verify_at == "step" and callback.monitor.tracks_accuracy
    assert callback.pins[1].fraction == 0.1 and callback.pins[1].seed == 3
    cli.trainer.fit(cli.model, cli.datamodule)
    callback.verify(cli.model)
    assert cli.model.backbone.head.weight[0, 1].item() == 25.0 and cli.model.backbone.head.weight[2, 3].item() == 5.0
    assert callback.monitor.baseline is not None and callback.monitor.final is not None
