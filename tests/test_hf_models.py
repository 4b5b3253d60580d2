"""Transformers and dict batches in every tool: model=hf (a tiny BERT and GPT-2 from configs) on data=fake_text
through train, faults (--kind value, --no-retrain with metric=val_loss), export --to model.onnx and check; a
model of your own whose forward takes the batch dict through --no-retrain, --kind flip and the ONNX export; the
default pins of a transformer; data=cifar10 offline in one line; the extras the docs and the errors name.

Runs that need Hydra's record of the run (export reads .hydra/config.yaml) go through ``lightning_pin.train`` in a
process forked from tests/fork_runner.py; studies run in this process (``cli.main``).
"""

from __future__ import annotations

import csv
import json
import re
import tomllib
from pathlib import Path

import pytest
import torch

from lightning_pin import cli
from lightning_pin.app.custom import default_pin_names
from lightning_pin.app.models import hf_model
from lightning_pin.batches import default_predict, forward_arguments, run_validation

from test_custom_model import env, forked

ROOT = Path(__file__).resolve().parents[1]
onnx = pytest.importorskip("onnx")
pytest.importorskip("transformers")

TINY_CONFIGS = {
    "bert": "{model_type: bert, num_hidden_layers: 2, hidden_size: 32, num_attention_heads: 2, intermediate_size: 64, "
            "max_position_embeddings: 32}",
    "gpt2": "{model_type: gpt2, n_layer: 2, n_embd: 32, n_head: 2, n_positions: 32}",
}
DATA = ["data=fake_text", "data.vocab_size=100", "data.seq_len=12", "data.num_samples=128"]
SHORT = ["pretrain.max_epochs=2", "trainer.max_epochs=1", "trainer.limit_train_batches=2",
         "callbacks.pin_callback.verbose=false", "callbacks.pin_callback.monitor.report=false"]


def rows(directory: Path) -> list[dict[str, str]]:
    with open(directory / "fault_curve.csv", newline="") as file:
        return list(csv.DictReader(file))


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def hf_run(request, fork_runner, tmp_path_factory):
    """A finished `lightning-pin train` run of a tiny transformer on data=fake_text."""
    name = request.param
    project = tmp_path_factory.mktemp(name)
    run = project / "run"
    result = forked(fork_runner, "lightning_pin.train", "model=hf", f"model.config={TINY_CONFIGS[name]}", *DATA,
                    *SHORT, f"hydra.run.dir={run}", cwd=project)
    assert result.returncode == 0, result.output
    return name, project, run


def test_a_tiny_transformer_trains_from_its_config_on_fake_text(hf_run):
    name, _, run = hf_run
    summary = json.loads((run / "run_summary.json").read_text())
    assert summary["pins_exact"] is True and summary["violations"] == 0 and summary["pinned_elements"] > 0
    assert 0.0 <= summary["baseline"] <= 1.0 and summary["metric"] == "accuracy"
    weights = torch.load(run / "pinned.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    assert any(re.search(r"backbone\.(bert|transformer)\.", n) for n in weights)  # a transformers model, trained


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_default_pins_of_a_transformer_are_its_linear_weights_not_embeddings_norms_or_biases(name):
    options = {"bert": dict(model_type="bert", num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=32),
               "gpt2": dict(model_type="gpt2", n_layer=2, n_embd=32, n_head=2, n_positions=32)}[name]
    model = hf_model(config=options, num_labels=2, vocab_size=100)
    names = default_pin_names(model.named_parameters(), model)
    assert names and all(n.endswith("weight") for n in names)
    assert not [n for n in names if re.search(r"embeddings|wte|wpe|LayerNorm|ln_|bias", n)], names
    embeddings = [n for n, p in model.named_parameters() if re.search(r"word_embeddings|wte", n)]
    assert embeddings and not set(embeddings) & set(names)  # the old rule (*.weight, ndim >= 2) took them
    expected = {"bert": ["query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense"],
                "gpt2": ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]}[name]
    for layer in ("0", "1"):
        for part in expected:
            assert any(f".{layer}." in n and part in n for n in names), (part, names)


def test_export_to_onnx_takes_the_tokenizer_dict_as_named_inputs_and_check_reads_it(hf_run, fork_runner):
    name, project, run = hf_run
    target = run / "model.onnx"
    result = forked(fork_runner, "lightning_pin.cli", "export", str(run), "--to", str(target), cwd=project)
    assert result.returncode == 0, result.output
    inputs = [i.name for i in onnx.load(str(target), load_external_data=False).graph.input]
    assert inputs == ["input_ids", "attention_mask"], inputs
    result = forked(fork_runner, "lightning_pin.cli", "check", str(run / "pinned.ckpt"), str(target), cwd=project)
    assert result.returncode == 0 and "OK: every pin holds" in result.output, result.output


def test_faults_kind_value_retrains_a_transformer(hf_run, monkeypatch):
    name, project, run = hf_run
    monkeypatch.chdir(project)
    out = project / "value"
    assert cli.main(["faults", "--kind", "value", "--rates", "0,0.2", "--seeds", "1", "--out", str(out), "model=hf",
                     f"model.config={TINY_CONFIGS[name]}", *DATA, *SHORT, f"ckpt_path={run / 'pretrained.ckpt'}"]) == 0
    found = rows(out)
    assert [float(r["rate"]) for r in found] == [0.0, 0.2]
    assert all(r["pins_exact"] == "true" for r in found) and int(found[1]["pinned_elements"]) > 0


def test_faults_kind_neuron_sticks_a_transformers_features_and_retrains(hf_run, monkeypatch):
    name, project, run = hf_run
    monkeypatch.chdir(project)
    out = project / "neuron"
    assert cli.main(["faults", "--kind", "neuron", "--rates", "0.25", "--seeds", "1", "--out", str(out), "model=hf",
                     f"model.config={TINY_CONFIGS[name]}", *DATA, *SHORT, f"ckpt_path={run / 'pretrained.ckpt'}"]) == 0
    (row,) = rows(out)
    assert row["kind"] == "neuron" and float(row["forced"]) >= 0 and float(row["final"]) >= 0


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_neuron_faults_read_a_tokenizer_dict_and_stick_features_at_every_position(name):
    """sa1 sticks at each layer's largest output on the batch: the batch dict goes to the forward by name."""
    transformers = pytest.importorskip("transformers")
    from omegaconf import OmegaConf

    from lightning_pin import pin
    from lightning_pin.faults import neuron_faults

    options = OmegaConf.to_container(OmegaConf.create(TINY_CONFIGS[name]))
    config = transformers.AutoConfig.for_model(**options, vocab_size=100, num_labels=3, pad_token_id=0)
    model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    batch = {"input_ids": torch.randint(1, 100, (2, 12)), "attention_mask": torch.ones(2, 12, dtype=torch.long),
             "labels": torch.tensor([0, 1])}
    layer = {"bert": "bert.encoder.layer.0.attention.self.query", "gpt2": "transformer.h.0.mlp.c_fc"}[name]  # Conv1D
    pins = neuron_faults(model, layer, 0.25, kind="sa1", batch=batch, seed=0)
    (stuck,) = pins
    seen = {}
    hook = dict(model.named_modules())[layer].register_forward_hook(lambda m, a, out: seen.update(out=out))
    with pin(model, torch.optim.SGD(model.parameters(), lr=0.1), list(pins)):
        for length in (5, 12):
            model(input_ids=batch["input_ids"][:, :length], attention_mask=batch["attention_mask"][:, :length])
            channels = torch.as_tensor(stuck.channels)
            held = seen["out"][..., channels]
            assert held.shape[1] == length
            assert torch.equal(held, held[:1, :1].expand_as(held))  # the same value at every sample and position
    hook.remove()


def test_no_retrain_measures_val_loss_through_the_models_own_validation_step(hf_run, monkeypatch):
    """metric=val_loss --no-retrain: the baseline is the loss the model's validation_step logs (once refused)."""
    import lightning.pytorch as pl

    from lightning_pin.app.data import FakeTextDataModule
    from lightning_pin.app.models import hf_classifier
    from lightning_pin.app.train import load_weights

    name, project, run = hf_run
    monkeypatch.chdir(project)
    out = project / "loss"
    assert cli.main(["faults", "--no-retrain", "--rates", "0,0.3", "--seeds", "2", "--out", str(out), "model=hf",
                     f"model.config={TINY_CONFIGS[name]}", *DATA, *SHORT, "metric=val_loss", "metric_mode=min",
                     f"ckpt_path={run / 'pretrained.ckpt'}"]) == 0
    found = rows(out)
    options = dict(re.findall(r"(\w+): (\w+)", TINY_CONFIGS[name]))
    options = {k: (int(v) if v.isdigit() else v) for k, v in options.items()}
    model = hf_classifier(config=options, num_labels=2, vocab_size=100)
    load_weights(model, str(run / "pretrained.ckpt"))
    data = FakeTextDataModule(vocab_size=100, seq_len=12, num_samples=128)
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    (logged,) = trainer.validate(model, datamodule=data, verbose=False)
    # Lightning's own reduction of the same logged values: equal up to float32 summation order.
    assert float(found[0]["baseline"]) == pytest.approx(logged["val_loss"], rel=1e-5)
    assert float(found[0]["forced"]) == pytest.approx(logged["val_loss"], rel=1e-5)  # rate 0: the baseline
    assert all(float(r["forced"]) != float(r["baseline"]) for r in found if float(r["rate"]) > 0)


# ------------------------------------------------------------------------------------------------
# A model of your own whose forward takes the batch dict

DICT_MODELS = '''
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Pairs(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 6, generator=g)
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "mask": torch.ones(6), "y": self.y[i]}


class DictData(L.LightningDataModule):
    num_classes = 2

    def train_dataloader(self):
        return DataLoader(Pairs(128, 0), batch_size=16, shuffle=True)

    def val_dataloader(self):
        return DataLoader(Pairs(64, 1), batch_size=16)


class DictNet(L.LightningModule):
    def __init__(self, width: int = 8):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, width), nn.ReLU(), nn.Linear(width, 2))

    def forward(self, batch):
        return self.body(batch["x"] * batch["mask"])

    def _loss(self, batch):
        logits = self(batch)
        return nn.functional.cross_entropy(logits, batch["y"]), logits

    def training_step(self, batch, batch_idx):
        return self._loss(batch)[0]

    def validation_step(self, batch, batch_idx):
        loss, logits = self._loss(batch)
        self.log("val_loss", loss)
        self.log("val_acc", (logits.argmax(-1) == batch["y"]).float().mean())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)
'''
OWN = ["model=custom", "model._target_=dictmods.DictNet", "data=custom", "data._target_=dictmods.DictData"]


@pytest.fixture(scope="module")
def dict_run(fork_runner, tmp_path_factory):
    project = tmp_path_factory.mktemp("dict")
    (project / "dictmods.py").write_text(DICT_MODELS)
    run = project / "run"
    result = forked(fork_runner, "lightning_pin.train", *OWN, *SHORT, f"hydra.run.dir={run}", cwd=project)
    assert result.returncode == 0, result.output
    return project, run


@pytest.mark.parametrize("kind", ["--no-retrain", "flip"])
def test_a_dict_batch_model_runs_test_time_campaigns(dict_run, kind, monkeypatch):
    """Once an IndexError in the user's forward (model(x) on a tensor pulled out of the batch)."""
    project, run = dict_run
    monkeypatch.chdir(project)
    out = project / kind.strip("-")
    args = ["--no-retrain", "--rates", "0,0.3"] if kind == "--no-retrain" else ["--kind", "flip", "--rates", "0,0.05"]
    assert cli.main(["faults", *args, "--seeds", "2", "--out", str(out), *OWN, *SHORT,
                     f"ckpt_path={run / 'pretrained.ckpt'}"]) == 0
    found = rows(out)
    assert len(found) == 4 and all(0.0 <= float(r["forced"]) <= 1.0 for r in found)
    assert float(found[0]["forced"]) == float(found[0]["baseline"]) > 0.0  # rate 0 changes nothing


def test_a_dict_batch_model_exports_to_onnx_and_check_reads_it(dict_run, fork_runner):
    project, run = dict_run
    target = run / "model.onnx"
    result = forked(fork_runner, "lightning_pin.cli", "export", str(run), "--to", str(target), cwd=project)
    assert result.returncode == 0, result.output
    result = forked(fork_runner, "lightning_pin.cli", "check", str(run / "pinned.ckpt"), str(target), cwd=project)
    assert result.returncode == 0 and "OK: every pin holds" in result.output, result.output


def test_forward_arguments_are_what_validation_step_passes_and_predict_feeds_named_inputs(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "dictmods2.py").write_text(DICT_MODELS)
    import dictmods2

    model = dictmods2.DictNet()
    batch = next(iter(dictmods2.DictData().val_dataloader()))
    args, kwargs = forward_arguments(model, batch)
    assert kwargs == {} and len(args) == 1 and sorted(args[0]) == ["mask", "x", "y"]
    assert args[0]["x"].shape == (1, 6)  # one sample
    capture = run_validation(model, [batch])
    assert sorted(capture.names()) == ["val_acc", "val_loss"] and model.training is True  # mode restored

    class Named(torch.nn.Module):  # a plain module taking a tokenizer's keys by name
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.EmbeddingBag(10, 3)

        def forward(self, input_ids, attention_mask=None):
            return self.embed(input_ids * attention_mask)

    ids = torch.randint(10, (4, 5))
    preds, target = default_predict(Named(), {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                              "labels": torch.zeros(4, dtype=torch.long)})
    assert preds.shape == (4, 3) and torch.equal(target, torch.zeros(4, dtype=torch.long))


# ------------------------------------------------------------------------------------------------
# Offline and install errors

OFFLINE = '''
import urllib.error


class OfflineCIFAR:
    def __init__(self, root, train=True, transform=None, download=False):
        if download:
            raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")
        raise RuntimeError("Dataset not found or corrupted. You can use download=True to download it")
'''


@pytest.mark.parametrize("download", ["true", "false"])
def test_cifar10_offline_ends_before_any_training_in_one_line(download, fork_runner, tmp_path):
    (tmp_path / "offline.py").write_text(OFFLINE)
    result = forked(fork_runner, "lightning_pin.train", "data=cifar10", "data.dataset=offline.OfflineCIFAR",
                    f"data.download={download}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 1
    message = result.stderr.strip().splitlines()[0]
    assert message.startswith("DataUnavailableError: data: OfflineCIFAR is not in ")
    assert re.search(r"is not in /\S*cifar10 and ", message), message  # the directory looked in, absolute
    assert "data.download=false" in message and "data=fake_images" in message
    assert not (tmp_path / "run" / "pretrained.ckpt").exists()


def test_every_extra_the_docs_and_the_errors_name_exists():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named: set[str] = set()
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for path in [*pages, *sorted((ROOT / "lightning_pin").rglob("*.py"))]:
        text = " ".join(path.read_text().split())  # a command wrapped over two lines of a page too
        named |= set(re.findall(r"lightning-pin\[([\w-]+)\]", text))
        named |= set(re.findall(r"pip install -e '\.\[([\w,-]+)\]'", text))
    named = {part for entry in named for part in entry.split(",")}
    assert {"vision", "hf", "export"} <= named and named <= extras, named - extras
    # From a clone, as the docs write them: the editable install of the checkout with its extras.
    texts = {path.relative_to(ROOT).as_posix(): " ".join(path.read_text().split()) for path in pages}
    assert "pip install -e '.[vision]'" in texts["docs/tutorials/fault-study-own-model.md"]
    assert "pip install -e '.[hf]'" in texts["docs/tutorials/hf-transformer.md"]
    for name, text in texts.items():
        assert not re.search(r"pip install (-e )?'lightning-pin\[", text), name


def test_the_apps_classifier_feeds_a_plain_backbone_mappings_by_its_own_signature():
    """A plain module wrapped by the app: (x, y) tuples and mappings with input and target keys, in training,
    validation and the monitor's predictions alike."""
    from lightning_pin.app.models import Classifier

    model = Classifier(torch.nn.Linear(4, 3))
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    expected = model(x)
    for batch in ((x, y), {"image": x, "label": y}, {"x": x, "y": y}):
        preds, target = default_predict(model, batch)
        assert torch.equal(preds, expected) and torch.equal(target, y)
        assert torch.equal(model.validation_step(batch, 0)["preds"], expected)
