"""Classification data sets as LightningDataModules: the digits, Gaussian blobs, random images and tokens
with a learnable signal (no download), and CIFAR-10.

The in-memory ones split their samples into train and validation sets with a seeded permutation, so every
run, rank and resume sees the same split.
"""

from __future__ import annotations

import os
from typing import Optional

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

__all__ = [
    "CIFAR10DataModule",
    "DataUnavailableError",
    "DigitsDataModule",
    "FakeImagesDataModule",
    "FakeTextDataModule",
    "SyntheticDataModule",
]


class _SplitDataModule(L.LightningDataModule):
    """A train/val split of in-memory tensors, made by a seeded permutation."""

    num_classes: int
    input_shape: tuple[int, ...]

    def __init__(self, batch_size: int, val_batch_size: int, val_fraction: float, seed: int, num_workers: int) -> None:
        super().__init__()
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.train_set: Optional[Dataset] = None
        self.val_set: Optional[Dataset] = None

    def _load(self) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def _dataset(self, x: Tensor, y: Tensor) -> Dataset:
        """The samples ``x[i], y[i]`` as a data set (a subclass may yield them in another structure)."""
        return TensorDataset(x, y)

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        x, y = self._load()
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(self.seed))
        n_val = round(self.val_fraction * len(y))
        val, train = order[:n_val], order[n_val:]
        self.train_set = self._dataset(x[train], y[train])
        self.val_set = self._dataset(x[val], y[val])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.val_batch_size, shuffle=False, num_workers=self.num_workers)


class DigitsDataModule(_SplitDataModule):
    """scikit-learn's handwritten digits: 1,797 images of ``1 x 8 x 8`` pixels in [0, 1], 10 classes.

    The data ships with scikit-learn (no download). A seeded permutation holds out
    ``val_fraction`` of the samples for validation.

    Args:
        batch_size: Training batch size (training batches are shuffled).
        val_batch_size: Validation batch size.
        val_fraction: Share of the samples held out for validation.
        seed: Seed of the split.
        num_workers: DataLoader workers.

    Raises:
        ValueError: ``val_fraction`` is not in (0, 1).

    Example::

        >>> data = DigitsDataModule(batch_size=32)
        >>> data.setup()
        >>> x, y = next(iter(data.train_dataloader()))
        >>> tuple(x.shape), x.dtype, float(x.min()) >= 0.0, float(x.max()) <= 1.0, len(data.val_set)
        ((32, 1, 8, 8), torch.float32, True, True, 449)
    """

    num_classes = 10
    input_shape = (1, 8, 8)

    def __init__(
        self,
        batch_size: int = 64,
        val_batch_size: int = 256,
        val_fraction: float = 0.25,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, val_batch_size, val_fraction, seed, num_workers)

    def _load(self) -> tuple[Tensor, Tensor]:
        from sklearn.datasets import load_digits

        digits = load_digits()
        # Pixel intensities are integers 0..16.
        x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        return x, torch.tensor(digits.target, dtype=torch.long)


class SyntheticDataModule(_SplitDataModule):
    """Gaussian blobs around one random centre per class, shaped like images (default ``1 x 8 x 8``).

    Fast, deterministic (``seed``) and learnable in a few epochs: for smoke tests and sweeps.

    Args:
        num_samples: Samples in total (split into train and validation).
        num_classes: Classes, balanced.
        input_shape: Shape of one sample.
        noise: Standard deviation of the samples around their class centre (centres are standard
            normal); larger is harder.
        batch_size, val_batch_size, val_fraction, seed, num_workers: As in :class:`DigitsDataModule`.

    Raises:
        ValueError: ``val_fraction`` is not in (0, 1).

    Example::

        >>> data = SyntheticDataModule(num_samples=100, num_classes=4)
        >>> data.setup()
        >>> len(data.train_set), len(data.val_set), tuple(data.val_set[0][0].shape)
        (75, 25, (1, 8, 8))
    """

    def __init__(
        self,
        num_samples: int = 2048,
        num_classes: int = 10,
        input_shape: tuple[int, ...] = (1, 8, 8),
        noise: float = 1.0,
        batch_size: int = 64,
        val_batch_size: int = 256,
        val_fraction: float = 0.25,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, val_batch_size, val_fraction, seed, num_workers)
        self.num_samples = num_samples
        self.num_classes = num_classes
        self.input_shape = tuple(input_shape)
        self.noise = noise

    def _load(self) -> tuple[Tensor, Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        centres = torch.randn(self.num_classes, *self.input_shape, generator=generator)
        y = torch.arange(self.num_samples) % self.num_classes
        x = centres[y] + self.noise * torch.randn(self.num_samples, *self.input_shape, generator=generator)
        return x, y


class FakeImagesDataModule(_SplitDataModule):
    """Random images of any ``shape`` with a learnable signal, as ``(image, label)`` batches: no download.

    Each class has a fixed random pattern, coarse (a 4 x 4 grid per channel, stretched over the image) so
    that convolutions with global pooling (a ResNet) see it as well as a linear layer does; a sample is
    its class's pattern times ``signal`` plus standard normal noise. Accuracy rises well above chance in a
    few steps: a smoke test of a real network (a ResNet, a ViT) without its data set.

    Args:
        shape: Shape of one image, ``[channels, height, width]``.
        num_classes: Classes, balanced.
        num_samples: Samples in total (split into train and validation).
        signal: Strength of the class pattern against the unit noise (larger is easier).
        batch_size, val_batch_size, val_fraction, seed, num_workers: As in :class:`DigitsDataModule`.

    Raises:
        ValueError: ``val_fraction`` is not in (0, 1), or ``shape`` is not ``[channels, height, width]``.

    Example::

        >>> data = FakeImagesDataModule(shape=[3, 16, 16], num_classes=4, num_samples=64, batch_size=8)
        >>> data.setup()
        >>> x, y = next(iter(data.train_dataloader()))
        >>> tuple(x.shape), x.dtype, tuple(y.shape), y.dtype, data.num_classes, data.input_shape
        ((8, 3, 16, 16), torch.float32, (8,), torch.int64, 4, (3, 16, 16))
    """

    def __init__(
        self,
        shape: tuple[int, ...] = (3, 32, 32),
        num_classes: int = 10,
        num_samples: int = 1024,
        signal: float = 1.0,
        batch_size: int = 64,
        val_batch_size: int = 256,
        val_fraction: float = 0.25,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, val_batch_size, val_fraction, seed, num_workers)
        shape = tuple(int(s) for s in shape)
        if len(shape) != 3 or min(shape) < 1:
            raise ValueError(f"data.shape must be [channels, height, width] of positive sizes, got {list(shape)}")
        self.shape = self.input_shape = shape
        self.num_classes = num_classes
        self.num_samples = num_samples
        self.signal = signal

    def _load(self) -> tuple[Tensor, Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        channels, height, width = self.shape
        coarse = torch.randn(self.num_classes, channels, min(4, height), min(4, width), generator=generator)
        patterns = nn.functional.interpolate(coarse, size=(height, width), mode="nearest")
        y = torch.arange(self.num_samples) % self.num_classes
        x = self.signal * patterns[y] + torch.randn(self.num_samples, *self.shape, generator=generator)
        return x, y


class _TokenDataset(Dataset):
    """Token ids as the mapping a tokenizer gives: ``input_ids``, ``attention_mask`` and ``labels``."""

    def __init__(self, ids: Tensor, labels: Tensor) -> None:
        self.ids = ids
        self.labels = labels
        self.mask = torch.ones_like(ids)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"input_ids": self.ids[index], "attention_mask": self.mask[index], "labels": self.labels[index]}


class FakeTextDataModule(_SplitDataModule):
    """Random token ids with a learnable signal, as the dict batches of a tokenizer: no download.

    Batches are mappings ``{"input_ids": (batch, seq_len) int64, "attention_mask": ones, "labels":
    (batch,)}``, what a Hugging Face model takes as keyword arguments. Each class owns a few marker tokens
    (``vocab_size // (2 * num_classes)`` of them, at least one); a sequence is uniform random tokens with
    a ``signal`` share of its positions replaced by markers of its class, so a bag of words finds the
    class and accuracy rises well above chance in a few steps.

    Args:
        vocab_size: Token ids are in ``[0, vocab_size)``.
        seq_len: Tokens per sequence.
        num_classes: Classes, balanced.
        num_samples: Sequences in total (split into train and validation).
        signal: Share of the positions holding a marker of the class, in (0, 1].
        batch_size, val_batch_size, val_fraction, seed, num_workers: As in :class:`DigitsDataModule`.

    Raises:
        ValueError: ``val_fraction`` is not in (0, 1), ``signal`` not in (0, 1], or the vocabulary is
            smaller than twice the classes.

    Example::

        >>> data = FakeTextDataModule(vocab_size=100, seq_len=12, num_classes=2, num_samples=64, batch_size=8)
        >>> data.setup()
        >>> batch = next(iter(data.train_dataloader()))
        >>> sorted(batch), tuple(batch["input_ids"].shape), batch["input_ids"].dtype, tuple(batch["labels"].shape)
        (['attention_mask', 'input_ids', 'labels'], (8, 12), torch.int64, (8,))
    """

    def __init__(
        self,
        vocab_size: int = 100,
        seq_len: int = 16,
        num_classes: int = 2,
        num_samples: int = 1024,
        signal: float = 0.25,
        batch_size: int = 32,
        val_batch_size: int = 256,
        val_fraction: float = 0.25,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, val_batch_size, val_fraction, seed, num_workers)
        if not 0 < signal <= 1:
            raise ValueError(f"data.signal must be in (0, 1] (the share of marker tokens), got {signal!r}")
        if vocab_size < 2 * num_classes:
            raise ValueError(f"data.vocab_size={vocab_size} is too small for {num_classes} classes: "
                             f"at least {2 * num_classes}")
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.num_classes = num_classes
        self.num_samples = num_samples
        self.signal = signal
        self.input_shape = (seq_len,)

    def _load(self) -> tuple[Tensor, Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        per_class = max(1, self.vocab_size // (2 * self.num_classes))
        markers = torch.randperm(self.vocab_size, generator=generator)[: per_class * self.num_classes]
        markers = markers.view(self.num_classes, per_class)
        y = torch.arange(self.num_samples) % self.num_classes
        ids = torch.randint(self.vocab_size, (self.num_samples, self.seq_len), generator=generator)
        marked = torch.rand(self.num_samples, self.seq_len, generator=generator) < self.signal
        choice = torch.randint(per_class, (self.num_samples, self.seq_len), generator=generator)
        ids = torch.where(marked, markers[y.unsqueeze(1), choice], ids)
        return ids, y

    def _dataset(self, x: Tensor, y: Tensor) -> Dataset:
        return _TokenDataset(x, y)


class DataUnavailableError(RuntimeError):
    """A data set that must be downloaded and cannot be (offline), or is not where the config says."""


class CIFAR10DataModule(L.LightningDataModule):
    """torchvision's CIFAR-10: 50,000 training and 10,000 test images of ``3 x 32 x 32``, 10 classes.

    The test split is the validation set. Images are scaled to [0, 1] and normalized with the
    training set's per-channel mean and standard deviation. ``download=True`` fetches the data into
    ``data_dir`` once (on machines with the internet); ``dataset`` names the class that reads it, so
    another torchvision data set of the same signature (``root, train, transform, download``) fits.

    Args:
        data_dir: Where the data is (or is downloaded to).
        download: Download it when it is not there.
        batch_size, val_batch_size, num_workers: As in :class:`DigitsDataModule`.
        dataset: Import path of the data set class.
    """

    num_classes = 10
    input_shape = (3, 32, 32)
    MEAN = (0.4914, 0.4822, 0.4465)
    STD = (0.2470, 0.2435, 0.2616)

    def __init__(
        self,
        data_dir: str = "data",
        download: bool = True,
        batch_size: int = 128,
        val_batch_size: int = 512,
        num_workers: int = 0,
        dataset: str = "torchvision.datasets.CIFAR10",
    ) -> None:
        super().__init__()
        self.data_dir = data_dir
        self.download = download
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size
        self.num_workers = num_workers
        self.dataset = dataset
        self.train_set = None
        self.val_set = None

    def _dataset_class(self):
        from hydra.utils import get_class

        try:
            if self.dataset.startswith("torchvision."):
                import torchvision  # noqa: F401
        except Exception as err:  # a torchvision built for another torch fails at import with a RuntimeError
            raise ImportError(
                f"data=cifar10 needs torchvision built for torch {torch.__version__} ({type(err).__name__}: "
                f"{' '.join(str(err).split())}): pip install -e '.[vision]' from the index your torch came from, "
                "or smoke-test with data=fake_images (no download)"
            ) from None
        return get_class(self.dataset)

    def _unavailable(self, err: BaseException) -> DataUnavailableError:
        name = self.dataset.rpartition(".")[2]
        how = "cannot be downloaded" if self.download else "is not there (data.download=false)"
        return DataUnavailableError(
            f"data: {name} is not in {os.path.abspath(self.data_dir)} and {how} ({type(err).__name__}: "
            f"{' '.join(str(err).split())[:160]}): copy it there and set data.download=false, "
            "or smoke-test with data=fake_images (random images, no download)"
        )

    def prepare_data(self) -> None:
        """Download the data when it is not in ``data_dir`` (``download=True``), or check that it is there.

        Raises:
            DataUnavailableError: the data is not in ``data_dir`` and cannot be downloaded (offline), in one
                line naming the data set, the directory, ``data.download=false`` and ``data=fake_images``.
            ImportError: torchvision is not installed or does not load beside this torch.
        """
        cls = self._dataset_class()
        for train in (True, False):
            try:
                cls(root=self.data_dir, train=train, download=self.download)
            except (OSError, RuntimeError) as err:  # URLError is an OSError; a missing copy a RuntimeError
                raise self._unavailable(err) from None

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        from torchvision import transforms

        transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(self.MEAN, self.STD)])
        cls = self._dataset_class()
        try:
            self.train_set = cls(root=self.data_dir, train=True, transform=transform, download=False)
            self.val_set = cls(root=self.data_dir, train=False, transform=transform, download=False)
        except (OSError, RuntimeError) as err:
            raise self._unavailable(err) from None

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.val_batch_size, shuffle=False, num_workers=self.num_workers)
