"""Reading tensor files: the one place lightning-pin opens ``.pt`` / ``.pth`` / ``.bin`` / ``.ckpt`` /
``.safetensors`` files (masks, values, fault maps, checkpoints). Torch only, and always
``weights_only=True``: a file never runs code.

Callers that know what the file is for (a pin's ``value`` file, a fault map, ``ckpt_path``) catch
:class:`TensorFileError` and say so in their own error; :attr:`TensorFileError.reason` tells them
what went wrong without parsing the message.
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
from torch import Tensor

__all__ = ["Reason", "TENSOR_FILE_SUFFIXES", "TensorFileError", "load_checkpoint", "load_tensors"]


#: Suffixes :func:`load_tensors` reads (``.bin``: ``torch.save`` files such as ``pytorch_model.bin``).
TENSOR_FILE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")

Reason = Literal["directory", "suffix", "missing", "unreadable", "contents"]


class TensorFileError(ValueError):
    """A tensor file that is missing, of an unknown kind, unreadable, or holding the wrong things.

    The message names the file and what would be right.

    Args:
        message: What is wrong, naming the file.
        path: The file.
        reason: ``"directory"``, ``"suffix"``, ``"missing"``, ``"unreadable"`` or ``"contents"``.
    """

    def __init__(self, message: str, path: Path, reason: Reason) -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        # Survives pickling (an error raised in a spawned worker process reaches the parent).
        return type(self), (str(self), self.path, self.reason)


def load_tensors(path: Union[str, Path]) -> Any:
    """What ``path`` holds, on the CPU: a tensor, or containers of tensors and plain values.

    Example::

        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     torch.save({"head.bias": torch.tensor([25.0, 5.0])}, Path(folder) / "values.pt")
        ...     load_tensors(Path(folder) / "values.pt")
        {'head.bias': tensor([25.,  5.])}
        >>> load_tensors("values.npy")
        Traceback (most recent call last):
        ...
        lightning_pin.core.io.TensorFileError: values.npy must end in one of .pt, .pth, .bin, .ckpt, .safetensors

    Raises:
        TensorFileError: the file is a directory, has a suffix other than
            :data:`TENSOR_FILE_SUFFIXES`, does not exist, or cannot be read with ``weights_only=True``.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise TensorFileError(
            f"{path} is a directory (a sharded checkpoint?): consolidate it into one file first", path, "directory"
        )
    if path.suffix not in TENSOR_FILE_SUFFIXES:
        raise TensorFileError(f"{path} must end in one of {', '.join(TENSOR_FILE_SUFFIXES)}", path, "suffix")
    if not path.is_file():
        raise TensorFileError(f"{path} does not exist (relative paths are taken from {Path.cwd()})", path, "missing")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path), device="cpu")
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle, zip and safetensors errors come in many types
        damaged = _damaged(path, err)
        if damaged is not None:
            raise TensorFileError(damaged, path, "unreadable") from err
        raise TensorFileError(
            f"cannot load {path} with weights_only=True ({type(err).__name__}: {err}). It must hold tensors and "
            "plain containers only; a checkpoint with other objects (hyperparameters such as functions?) can be "
            "loaded in Python by hand if you trust it",
            path,
            "unreadable",
        ) from err


#: How a ``torch.save`` file starts: a zip archive (torch >= 1.6), or a pickle (the legacy format).
_ZIP, _PICKLE = b"PK\x03\x04", b"\x80"
#: The largest header safetensors reads (100 MB): a first word above it is no safetensors length.
_SAFETENSORS_HEADER = 100_000_000


def _damaged(path: Path, err: BaseException) -> Optional[str]:
    """What is wrong with a file that did not load, when it is empty, cut short or not a tensor file at all (None
    when it is whole: then what it holds is the reason, which torch's own message tells)."""
    size = path.stat().st_size
    if size == 0:
        return f"{path} is empty (0 bytes): nothing was written to it (an interrupted save or copy?)"
    with path.open("rb") as stream:
        head = stream.read(8)
    cut = f"{path} is truncated ({size:,} bytes, cut short: an interrupted save or copy?); save or copy it again"
    if path.suffix == ".safetensors":
        header = int.from_bytes(head, "little") if len(head) == 8 else None
        if header is not None and header > _SAFETENSORS_HEADER:
            return f"{path} is not a safetensors file (it starts with {head!r}; {size:,} bytes)"
        return cut if header is None or size < 8 + header or "incomplete" in str(err).lower() else None
    if head.startswith(_ZIP):
        return None if zipfile.is_zipfile(path) else cut  # an archive cut short has no central directory
    if head.startswith(_PICKLE):  # the legacy format: pickles and raw storages one after the other
        said = str(err).lower()
        return cut if isinstance(err, EOFError) or "truncated" in said or "unexpected eof" in said else None
    return f"{path} is not a PyTorch or safetensors file (it starts with {head!r}; {size:,} bytes)"


def load_checkpoint(path: Union[str, Path]) -> dict[str, Any]:
    """A Lightning checkpoint, or a bare state dict of tensors wrapped like one (``{"state_dict": ...}``).

    Example::

        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     torch.save(torch.nn.Linear(2, 1).state_dict(), Path(folder) / "model.pt")
        ...     sorted(load_checkpoint(Path(folder) / "model.pt")["state_dict"])
        ['bias', 'weight']

    Raises:
        TensorFileError: as :func:`load_tensors`, or (``reason="contents"``) the file holds neither.
    """
    loaded = load_tensors(path)
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        return dict(loaded)
    if isinstance(loaded, Mapping) and loaded and all(isinstance(v, Tensor) for v in loaded.values()):
        return {"state_dict": dict(loaded)}
    raise TensorFileError(
        f"{path} holds neither a Lightning checkpoint nor a state dict of tensors", Path(path), "contents"
    )
