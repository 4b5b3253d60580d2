"""data=fake_images and data=fake_text: random samples of any shape with a learnable signal, no download."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from lightning_pin.app.data import FakeImagesDataModule, FakeTextDataModule
from lightning_pin.app.train import run

from test_config import compose_train


def _fit(model: nn.Module, data, inputs, steps: int = 60) -> float:
    """Train ``model`` for ``steps`` batches with Adam; validation accuracy after."""
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    done = 0
    while done < steps:
        for batch in data.train_dataloader():
            x, y = inputs(batch)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            done += 1
            if done == steps:
                break
    correct = total = 0
    with torch.no_grad():
        for batch in data.val_dataloader():
            x, y = inputs(batch)
            correct += int((model(x).argmax(-1) == y).sum())
            total += len(y)
    return correct / total


def test_fake_images_are_seeded_shaped_and_learnable_by_a_pooled_cnn():
    data = FakeImagesDataModule(shape=[3, 16, 16], num_classes=10, num_samples=600, batch_size=32, seed=3)
    data.setup()
    again = FakeImagesDataModule(shape=[3, 16, 16], num_classes=10, num_samples=600, batch_size=32, seed=3)
    again.setup()
    assert torch.equal(data.val_set.tensors[0], again.val_set.tensors[0])
    other = FakeImagesDataModule(shape=[3, 16, 16], num_classes=10, num_samples=600, seed=4)
    other.setup()
    assert not torch.equal(data.val_set.tensors[0], other.val_set.tensors[0])
    assert len(data.train_set) + len(data.val_set) == 600 and tuple(data.val_set[0][0].shape) == (3, 16, 16)
    # Convolutions then global average pooling, as a ResNet ends: the coarse class pattern must survive it.
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(16, 10))
    accuracy = _fit(model, data, lambda b: b)
    assert accuracy > 0.5, accuracy  # chance is 0.1


def test_fake_text_gives_tokenizer_dicts_learnable_by_a_bag_of_words():
    data = FakeTextDataModule(vocab_size=100, seq_len=16, num_classes=4, num_samples=800, batch_size=32)
    data.setup()
    batch = next(iter(data.val_dataloader()))
    assert sorted(batch) == ["attention_mask", "input_ids", "labels"]
    ids = batch["input_ids"]
    assert ids.dtype == torch.int64 and ids.shape[1] == 16 and int(ids.min()) >= 0 and int(ids.max()) < 100
    assert torch.equal(batch["attention_mask"], torch.ones_like(ids))
    model = nn.Sequential(nn.EmbeddingBag(100, 16), nn.Linear(16, 4))
    accuracy = _fit(model, data, lambda b: (b["input_ids"], b["labels"]))
    assert accuracy > 0.6, accuracy  # chance is 0.25


@pytest.mark.parametrize("kwargs,message", [
    (dict(shape=[8, 8]), "data.shape must be"),
])
def test_fake_images_refuse_a_shape_that_is_not_an_image(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FakeImagesDataModule(**kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(signal=0.0), "data.signal must be in"),
    (dict(vocab_size=3, num_classes=2), "data.vocab_size=3 is too small"),
])
def test_fake_text_refuses_data_without_a_signal(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FakeTextDataModule(**kwargs)


@pytest.mark.parametrize("option,expected", [("fake_images", FakeImagesDataModule), ("fake_text", FakeTextDataModule)])
def test_the_options_build_their_modules_from_target(tmp_path, option, expected):
    cfg = compose_train(tmp_path, f"data={option}", "data.num_classes=3", "seed=5")
    assert cfg.data._target_ == f"{expected.__module__}.{expected.__name__}"
    data = instantiate(cfg.data, _convert_="all")
    assert isinstance(data, expected) and data.num_classes == 3 and data.seed == 5


def test_the_app_trains_on_fake_images(tmp_path):
    cfg = compose_train(
        tmp_path, "data=fake_images", "data.shape=[1,8,8]", "data.num_samples=256", "trainer.max_epochs=1",
        "pretrain.max_epochs=2", "callbacks.pin_callback.monitor.report=false",
    )
    summary = run(cfg)
    assert summary["pins_exact"] is True and summary["baseline"] > 0.3  # chance is 0.1
