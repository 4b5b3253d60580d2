"""What the parts of task ownership share: the saved format's name and versions, owner-map dtypes,
task states, and small helpers (patterns, the seeded smallest-magnitude choice, digests)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any, Union

import torch
from torch import Tensor, nn

__all__ = []


_FORMAT = "lightning_pin.tasks"
_VERSION = 2  # 2: the values prune(release="keep") set aside
_READS = (1, 2)
# Task ids up to 255 fit a byte per element; torch's CPU kernels lack comparisons on uint16, so
# more tasks take int16 (up to 32767).
_DTYPES = ((255, torch.uint8), (32767, torch.int16))
_TRAINING, _PRUNED, _COMMITTED = "training", "pruned", "committed"
_NORM_MODES = ("per_task", "first")
_RELEASES = ("zero", "keep")


def _norm_types() -> tuple[type, ...]:
    types: list[type] = [nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm]
    if hasattr(nn, "RMSNorm"):
        types.append(nn.RMSNorm)
    return tuple(types)


def _as_patterns(params: Union[str, Sequence[str]]) -> list[str]:
    return [params] if isinstance(params, str) else list(params)


def _exact_pattern(name: str) -> str:
    # Pins take globs; a name with glob characters is matched exactly through a regex instead.
    return name if not any(c in name for c in "*?[") else "re:" + re.escape(name)


def _smallest(magnitude: Tensor, count: int, seed: int) -> Tensor:
    """Positions of the ``count`` smallest entries of ``magnitude``; among entries equal to the
    ``count``-th smallest, a permutation seeded with ``seed`` chooses (the same on every rank).
    One selection pass (``kthvalue``), no full sort: pruning tens of millions of elements stays fast."""
    if count <= 0:
        return torch.zeros(0, dtype=torch.long, device=magnitude.device)
    if count >= magnitude.numel():
        return torch.arange(magnitude.numel(), device=magnitude.device)
    kth = torch.kthvalue(magnitude, count).values
    below = (magnitude < kth).nonzero().squeeze(1)
    tied = (magnitude == kth).nonzero().squeeze(1)
    order = torch.randperm(tied.numel(), generator=torch.Generator().manual_seed(seed)).to(tied.device)
    return torch.cat([below, tied[order[: count - below.numel()]]])


def _name_seed(name: str, seed: int) -> int:
    """The seed that breaks magnitude ties in a tensor's prune. It keeps the low 63 bits of the digest
    where :func:`lightning_pin.core.rules.name_seed` shifts it right by one. It stays as it was
    written: a run repeated with the same seed then prunes the same tied elements as before."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def _feed(digest: Any, name: str, tensor: Tensor) -> None:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    digest.update(f"{name}:{flat.dtype}:{flat.numel()}:".encode())
    digest.update(flat.view(torch.uint8).numpy().tobytes())
