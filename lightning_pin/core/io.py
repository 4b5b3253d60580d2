"""Reading tensor files: the one place lightning-pin opens ``.pt`` / ``.pth`` / ``.ckpt`` /
``.safetensors`` files (masks, values, fault maps, checkpoints). Torch only, and always
``weights_only=True``: a file never runs code."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

import torch
from torch import Tensor

#: Suffixes :func:`load_tensors` reads.
TENSOR_FILE_SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors")


class TensorFileError(ValueError):
    """A tensor file that is missing, of an unknown kind, or unreadable; the message names it."""


def load_tensors(path: Union[str, Path]) -> Any:
    """What ``path`` holds, on the CPU: a tensor, or containers of tensors and plain values.

    Raises:
        TensorFileError: the file is missing, is a directory, has a suffix other than
            :data:`TENSOR_FILE_SUFFIXES`, or cannot be read with ``weights_only=True``.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise TensorFileError(f"{path} is a directory (a sharded checkpoint?): consolidate it into one file first")
    if path.suffix not in TENSOR_FILE_SUFFIXES:
        raise TensorFileError(f"{path} must end in one of {', '.join(TENSOR_FILE_SUFFIXES)}")
    if not path.is_file():
        raise TensorFileError(f"{path} does not exist (relative paths are taken from {Path.cwd()})")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path), device="cpu")
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle, zip and safetensors errors come in many types
        raise TensorFileError(
            f"cannot read {path} with weights_only=True ({type(err).__name__}: {err}); it must hold tensors "
            "and plain containers only"
        ) from err


def load_checkpoint(path: Union[str, Path]) -> dict[str, Any]:
    """A Lightning checkpoint, or a bare state dict of tensors wrapped like one (``{"state_dict": ...}``).

    Raises:
        TensorFileError: as :func:`load_tensors`, or the file holds neither.
    """
    loaded = load_tensors(path)
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        return dict(loaded)
    if isinstance(loaded, Mapping) and loaded and all(isinstance(v, Tensor) for v in loaded.values()):
        return {"state_dict": dict(loaded)}
    raise TensorFileError(f"{path} holds neither a Lightning checkpoint nor a state dict of tensors")
