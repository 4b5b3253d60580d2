"""Small classification data sets as LightningDataModules, images of shape ``1 x 8 x 8``.

Both split their samples into train and validation sets with a seeded permutation, so every run,
rank and resume sees the same split.
"""

from __future__ import annotations

from typing import Optional

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["CIFAR10DataModule", "DigitsDataModule", "SyntheticDataModule"]


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
        self.train_set: Optional[TensorDataset] = None
        self.val_set: Optional[TensorDataset] = None

    def _load(self) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        x, y = self._load()
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(self.seed))
        n_val = round(self.val_fraction * len(y))
        val, train = order[:n_val], order[n_val:]
        self.train_set = TensorDataset(x[train], y[train])
        self.val_set = TensorDataset(x[val], y[val])

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

        return get_class(self.dataset)

    def prepare_data(self) -> None:
        if self.download:
            for train in (True, False):
                self._dataset_class()(root=self.data_dir, train=train, download=True)

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        from torchvision import transforms

        transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(self.MEAN, self.STD)])
        cls = self._dataset_class()
        self.train_set = cls(root=self.data_dir, train=True, transform=transform, download=False)
        self.val_set = cls(root=self.data_dir, train=False, transform=transform, download=False)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.val_batch_size, shuffle=False, num_workers=self.num_workers)
