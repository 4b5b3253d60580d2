"""Where pinned elements live in a tensor: flat views, storage positions and shards.

:class:`Target` holds one parameter's pinned elements (full-tensor row-major indices) and a
per-element payload (targets, stuck-bit masks, bounds); :meth:`Target.part` maps them once onto
what this process holds of a tensor: a flat view of local storage and the positions in it, the
local shard of a DTensor (FSDP2) included. Every kernel of the engine and the projections goes
through it, so each is written once for dense, permuted (channels_last) and sharded tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable

import torch
import torch.utils.weak
from torch import Tensor, nn

from lightning_pin.core.errors import PinError

__all__ = [
    "KEEP_WIDE_ON_CPU", "LocalPart", "PUT_LIMIT", "Target", "WIDE_LIMIT", "copy_at", "fill_at", "flat_view",
    "is_sharded", "keep_dtype", "local_part", "local_tensor", "shared_zeros", "wide_index",
]


# torch.distributed.tensor costs seconds to import (it pulls in sympy), and a plain loop never
# needs it: a tensor can only be a DTensor once that module has been imported by someone else.
_DTENSOR_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")  # public from torch 2.4


@dataclasses.dataclass
class Target:
    """The merged targets of one parameter under one set of active pins.

    Indices and values are in full-tensor coordinates. For a sharded parameter (a DTensor, under
    FSDP2) :meth:`part` maps them once onto the shard this process holds, so masking and
    restoring touch local memory only and need no communication.
    """

    name: str
    parameter: nn.Parameter
    #: Sorted flat (row-major) indices, or None for the whole tensor.
    index: Tensor | None
    #: One value per index, or of the parameter's shape when ``index`` is None. None when only
    #: the positions matter (zeroing optimizer state).
    values: Tensor | None
    #: Storage-order positions for tensors that are not contiguous (e.g. channels_last), by strides.
    _by_strides: dict[Any, Tensor] = dataclasses.field(default_factory=dict)
    #: The pinned elements of each shard layout this process holds.
    _shards: dict[Any, LocalPart] = dataclasses.field(default_factory=dict)

    def part(self, tensor: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``(view, positions, targets)``: what of ``tensor`` (the parameter, its grad or an
        optimizer statistic) this process pins.

        For element pins ``view`` is a flat view of the local data and ``positions`` index the
        pinned elements in it; for a whole tensor ``positions`` is None and ``view`` is the
        local data itself.
        """
        if is_sharded(tensor):
            key = (tuple(tensor.placements), tuple(tensor.shape))
            if key not in self._shards:
                self._shards[key] = local_part(tensor, self.index, self.values, self.name)
            shard = self._shards[key]
            data, index, values, cache_key = tensor.to_local(), shard.index, shard.values, key
        else:
            data, index, values, cache_key = tensor, self.index, self.values, None
        if index is None:
            return data, None, values
        flat, positions = flat_view(data, index, self._by_strides, cache_key)
        return flat, positions, values

    def restore_dense(self) -> bool:
        """Write the targets of an element pin into a dense (not sharded) parameter with one kernel,
        no per-call allocation and little Python; False (nothing written) for every other case.

        Few elements are written with ``put_`` (row-major positions whatever the strides: no view to
        translate), many with ``index_copy_`` into a flat view (faster per element; see
        :data:`PUT_LIMIT`), and from :data:`DENSE_FRACTION` of a tensor on CPU by one pass over all
        of its words (see :meth:`_dense_write`)."""
        fast = self._fast
        if fast is None or fast[0] != self.parameter.data_ptr():
            fast = self._fast_restore()
            if fast is None:
                return False
        fast[1]()
        return True

    def kernel(self) -> Callable[[], None] | None:
        """The restore of an element pin into the parameter's own (dense) data as one C call with
        everything bound (a step plan's entry: no Python frame); None where :meth:`restore_dense`
        cannot write it. It is bound to the storage the parameter has now: a caller whose parameter
        may move binds it again (the step plan compares ``data_ptr`` once a step)."""
        fast = self._fast_restore()
        return None if fast is None else fast[1]

    def mask_grad(self, grad: Tensor) -> None:
        """Zero the pinned elements of ``grad`` (all of it for a whole tensor): ``put_`` of shared
        zeros for few elements (row-major whatever the strides: no view, no translation),
        ``index_fill_`` on a flat view for many; zeros, not a multiply: 0 * inf is NaN."""
        zeros = self._zeros
        if zeros is not None and grad.dtype is zeros.dtype:  # a grad lives on its parameter's device
            grad.put_(self._wide, zeros)
            return
        if self.index is None:
            local_tensor(grad).zero_()
            return
        if self._wide is None:
            if self._keep_dense(grad):
                return
            self._widen()
        if self._wide is not None and not is_sharded(grad):
            if self._wide.numel() <= PUT_LIMIT:
                self._zeros = zeros = shared_zeros(self.index.numel(), grad.dtype, grad.device)
                grad.put_(self._wide, zeros)
                return
            if grad.is_contiguous():
                grad.view(-1).index_fill_(0, self._wide, 0)
                return
        flat, positions, _ = self.part(grad)
        fill_at(flat, positions, 0)

    def _keep_dense(self, grad: Tensor) -> bool:
        """Zero a dense pin of many elements with one pass over ``grad``: its words multiplied by a
        kept mask (1 where free, 0 where pinned: the pinned words become +0.0 exactly as
        ``index_fill_`` writes them, the free ones stay as they are, NaN and -0.0 included). From
        :data:`DENSE_FRACTION` of the tensor on, that pass costs less than widening the indices and
        scattering zeros. The mask's dtype is :func:`keep_dtype`'s. False: not such a case."""
        words = self._dense_words(grad)
        if words is None:
            return False
        words.mul_(self._kept_mask(words))
        return True

    def _dense_words(self, tensor: Tensor) -> Tensor | None:
        """``tensor``'s flat integer words where a dense pass serves this pin (at least :data:`DENSE_FRACTION`
        of its elements pinned, a word-sized dtype, contiguous, not sharded); None elsewhere."""
        index = self.index
        if (
            index is None
            or index.numel() < DENSE_FRACTION * tensor.numel()
            or tensor.element_size() not in _WORDS
            or not tensor.is_contiguous()
            or is_sharded(tensor)
        ):
            return None
        return tensor.view(-1).view(_WORDS[tensor.element_size()])

    def _kept_mask(self, words: Tensor) -> Tensor:
        """The mask of :meth:`_keep_dense` for ``words`` (a gradient's or the parameter's), made once."""
        keep, dtype = self._keep, keep_dtype(words)
        if keep is None or keep.device != words.device or keep.numel() != words.numel() or keep.dtype != dtype:
            keep = torch.ones(words.numel(), dtype=dtype, device=words.device)
            fill_at(keep, self.index.to(words.device), 0)
            self._keep = keep
        return keep

    def _widen(self) -> Tensor | None:
        """The int64 positions of the index kernels: kept where :func:`wide_index` keeps them (on CPU, any
        size), asked at the first call only (off the CPU a large pin's answer is None every step)."""
        if not self._widened:
            self._widened = True
            if self.index is not None and not is_sharded(self.parameter):
                self._wide = wide_index(self.index)
        return self._wide

    def grad_zeros(self) -> tuple[Tensor, Tensor] | None:
        """``(positions, zeros)`` such that ``grad.put_(positions, zeros)`` zeroes the pinned
        elements of a dense gradient of this parameter (what :meth:`mask_grad` does for few
        elements), for a caller that masks many small tensors at once; None where
        :meth:`mask_grad` takes another path (a whole tensor, many elements, a sharded one)."""
        wide = self._wide
        if wide is None or self.index is None or wide.numel() > PUT_LIMIT or is_sharded(self.parameter):
            return None
        parameter = self.parameter
        self._zeros = zeros = shared_zeros(self.index.numel(), parameter.dtype, parameter.device)
        return wide, zeros

    def _fast_restore(self) -> tuple[int, Callable[[], None]] | None:
        """``(data_ptr, write)``: what :meth:`restore_dense` calls, cached while the parameter's storage
        stays put (checked by ``data_ptr``: a ``.data`` swap or a move makes a new one); None if sharded,
        whole, or too large for an int64 copy of its positions and not dense enough for one pass."""
        if self.index is None or self.values is None:
            return None
        parameter = self.parameter
        if self._dense is None:
            self._dense = not is_sharded(parameter)
        if not self._dense:
            return None
        data = parameter.data
        write = self._dense_write(data)
        if write is None:
            if self._widen() is None:
                return None
            by_put = self._wide.numel() <= PUT_LIMIT
            if not (data.is_contiguous() or (by_put and _is_dense(data))):
                return None  # gapped strides: the general path refuses them, as verify does
            if not by_put:
                data = data.view(-1)
            if self._flat_values is None:
                self._flat_values = self.values.reshape(-1).to(device=data.device, dtype=data.dtype)
            method = data.put_ if by_put else functools.partial(data.index_copy_, 0)
            write = functools.partial(method, self._wide, self._flat_values)
        self._fast = (parameter.data_ptr(), write)
        return self._fast

    def _dense_write(self, data: Tensor) -> Callable[[], None] | None:
        """The restore as one pass over every word of a CPU tensor with at least :data:`DENSE_FRACTION`
        of its elements pinned: ``words = targets + words * kept``, where ``kept`` is the gradient's mask
        (1 free, 0 pinned; see :meth:`_keep_dense`) and ``targets`` holds the pinned words and zeros
        elsewhere. Integer words, so exact for every bit pattern (NaN payloads, -0.0); 0 * x and 1 * x
        never overflow. On 2 CPU threads over 6.25M float32 elements half pinned this pass costs 1.4 ms
        against 4.8 ms for ``index_copy_`` of widened positions, whose scatter runs one element at a
        time; it is faster at every size (one thread: 1.1 against 1.2 us for ``put_`` of 32 of 64 elements,
        9.8 against 52 us for ``index_copy_`` of 32,768 of 65,536). Memory: the targets' 4 bytes an element
        of such tensors, and the kept mask's 4 where the gradient mask does not keep it already (pins of at
        most :data:`WIDE_LIMIT` elements, whose gradients are masked by their kept int64 positions). CPU
        only: CUDA's scatter runs at memory speed, and there the index kernels read less. None: not such a
        case."""
        words = self._dense_words(data) if data.device.type == "cpu" else None
        if words is None:
            return None
        keep = self._kept_mask(words)
        targets = self._dense_targets
        if targets is None or targets.dtype != words.dtype or targets.numel() != words.numel():
            values = self.values.reshape(-1).to(device=data.device, dtype=data.dtype).view(words.dtype)
            targets = torch.zeros_like(words)
            copy_at(targets, self.index, values)
            self._dense_targets = targets
        return functools.partial(torch.addcmul, targets, words, keep, out=words)

    def __post_init__(self) -> None:
        # int64 positions for the fast kernels (see wide_index); None keeps the general path. Small pins'
        # are made now; larger ones by _widen, once an index kernel needs them: never for a pin a dense
        # pass serves (a third or more of a tensor on CPU), whose steps read no positions.
        small = self.index is not None and self.index.numel() <= WIDE_LIMIT and not is_sharded(self.parameter)
        self._wide = wide_index(self.index) if small else None
        self._widened = small
        self._dense: bool | None = None
        self._fast: tuple[int, Callable[[], None]] | None = None
        self._flat_values: Tensor | None = None
        self._zeros: Tensor | None = None
        self._keep: Tensor | None = None  # see _keep_dense
        self._dense_targets: Tensor | None = None  # see _dense_write

    def flat(self, tensor: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(view, positions)`` of :meth:`part`, without the targets."""
        view, positions, _ = self.part(tensor)
        return view, positions

    def flat_index_of(self, tensor: Tensor, positions_taken: Tensor) -> Tensor:
        """Full-tensor row-major indices of the entries ``positions_taken`` of :meth:`part`."""
        if is_sharded(tensor):
            shard = self._shards[(tuple(tensor.placements), tuple(tensor.shape))]
            if shard.global_index is not None:
                return shard.global_index[positions_taken]
            coords = torch.stack(torch.unravel_index(positions_taken, shard.shape), dim=1)
            coords = coords + torch.tensor(shard.offset, device=coords.device)
            strides = torch.tensor(_row_major_strides(tuple(tensor.shape)), device=coords.device)
            return (coords * strides).sum(1)
        return positions_taken if self.index is None else self.index[positions_taken]


@dataclasses.dataclass
class LocalPart:
    """The pinned elements of a sharded tensor that lie in this process's shard."""

    #: Row-major indices into the local shard, or None when the whole tensor is pinned.
    index: Tensor | None
    #: Their targets (local shape for a whole tensor), or None.
    values: Tensor | None
    #: Their full-tensor indices (None for a whole tensor).
    global_index: Tensor | None
    #: Where the shard starts in the full tensor, and its shape.
    offset: tuple[int, ...]
    shape: tuple[int, ...]


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (FSDP2, tensor parallel), without importing DTensor."""
    for name in _DTENSOR_MODULES:
        module = sys.modules.get(name)
        if module is not None and isinstance(tensor, module.DTensor):
            return True
    return False


def local_part(tensor: Tensor, index: Tensor | None, values: Tensor | None, name: str) -> LocalPart:
    """Map full-tensor indices and targets onto the shard of ``tensor`` this process holds."""
    try:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # torch 2.3
        from torch.distributed._tensor import Replicate, Shard
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset

    unsupported = [p for p in tensor.placements if type(p) not in (Shard, Replicate)]
    if unsupported:
        raise PinError(
            f"{name!r} is laid out as {tuple(tensor.placements)}; pins support Shard and Replicate placements "
            "(FSDP2's fully_shard, data parallel), not {unsupported}"
        )
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if index is None:
        local = None if values is None else values[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        return LocalPart(None, None if local is None else local.contiguous(), None, tuple(offset), tuple(shape))
    coords = torch.stack(torch.unravel_index(index, tuple(tensor.shape)), dim=1)
    low = torch.tensor(offset, device=coords.device)
    inside = ((coords >= low) & (coords < low + torch.tensor(shape, device=coords.device))).all(dim=1)
    local_coords = coords[inside] - low
    strides = torch.tensor(_row_major_strides(tuple(shape)), device=coords.device)
    return LocalPart(
        index=(local_coords * strides).sum(1),
        values=None if values is None else values[inside],
        global_index=index[inside],
        offset=tuple(offset),
        shape=tuple(shape),
    )


def _row_major_strides(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def local_tensor(tensor: Tensor) -> Tensor:
    """The data of ``tensor`` this process holds: a DTensor's local shard, else the tensor."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def flat_view(tensor: Tensor, index: Tensor, cache: dict | None = None, key: Any = None) -> tuple[Tensor, Tensor]:
    """A 1-D view of ``tensor``'s storage and the storage positions of row-major ``index``.

    Contiguous tensors need no translation. Dense but permuted ones (channels_last weights and
    their grads) get the positions recomputed once per stride pattern and cached in ``cache``.
    """
    if tensor.is_contiguous():
        return tensor.view(-1), index
    strides = tensor.stride()
    positions = None if cache is None else cache.get((key, strides))
    if positions is None:
        if not _is_dense(tensor):
            raise PinError(f"cannot pin elements of a tensor with overlapping or gapped strides {strides}")
        coords = torch.stack(torch.unravel_index(index, tensor.shape), dim=1)
        positions = (coords * torch.tensor(strides, device=coords.device)).sum(1)
        if cache is not None:
            cache[(key, strides)] = positions
    return tensor.as_strided((tensor.numel(),), (1,)), positions


#: Indices converted to int64 at a time: the transient int64 copy (2 MiB) stays in cache for the
#: kernel that reads it (measured ~10% faster than 1M at a time on 3M elements).
_CONVERT_CHUNK = 1 << 18

#: Element pins of at most this many elements are written with ``put_`` (restore, gradient mask),
#: larger ones with ``index_copy_`` / ``index_fill_`` on a flat view: ``put_`` costs less to call
#: (about 1 us less per tensor here, which is what a step over hundreds of small tensors pays per
#: tensor), the index kernels less per element (10-25% fewer ns per element from ~10,000 on).
PUT_LIMIT = 4096

#: From this fraction of a tensor's elements on, a gradient mask is one dense pass with a kept
#: mask (see Target._keep_dense) rather than a scatter of zeros: measured on 2 CPU threads over
#: 6.25M float32 elements, the dense pass costs the same at any fraction (0.55-0.75 ms with an
#: int32 mask, 1.5-1.9 ms with int8), the scatter with widened indices 1.6 ms at 20% and 3.6 ms at
#: 50%. Below it the scatter costs too little to pay for the mask's memory (4 bytes an element on CPU).
#: On CPU the restore of such a tensor is one dense pass too (see Target._dense_write).
DENSE_FRACTION = 1 / 3
_WORDS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def keep_dtype(grad: Tensor) -> torch.dtype:
    """The dtype of a dense gradient mask (Target._keep_dense) for ``grad``: int8 (one byte an element)
    where the multiply reads it as it is (CUDA's kernels cast an operand in registers), the gradient's own
    word width on CPU, whose kernels first copy a narrower operand to the common dtype: every step, a
    temporary of the word width for the whole tensor (measured on 6.25M float32 elements, 2 threads:
    1.5 ms against 0.55 ms with an int32 mask; the memory is that temporary's, kept)."""
    return _WORDS[grad.element_size()] if grad.device.type == "cpu" else torch.int8


#: Index tensors of at most this many elements get an int64 copy, made once and kept as long as
#: the index lives (8 more bytes per pinned element, at most 512 KiB per tensor): there the fixed
#: cost of a conversion per call is what a many-small-tensors step would pay for. Larger ones off
#: the CPU are widened a chunk at a time on every call: on CUDA a conversion runs at memory speed
#: and device memory is what the model needs (see KEEP_WIDE_ON_CPU for the CPU).
WIDE_LIMIT = 1 << 16

#: On CPU every index tensor gets its int64 copy, whatever its size (8 bytes per pinned element):
#: there a conversion is a pass over the positions that the step waits for, and each chunk one more
#: kernel call. Measured in a ``Trainer.fit`` of the 25M-parameter MLP (AdamW, 2 threads) with 20% of
#: every weight pinned, the per-call conversions took 2.2% of the step, and each tensor made ten index
#: kernel calls a step (a chunk each) where two do. A pin a dense pass serves (see
#: ``Target._dense_write``) keeps no copy.
KEEP_WIDE_ON_CPU = True

# int64 copies of int32 indices, by the identity of the index tensor (indices are never written
# after resolution): the kernels (index_fill_, index_copy_, put_) want int64.
_WIDE: torch.utils.weak.WeakIdKeyDictionary = torch.utils.weak.WeakIdKeyDictionary()


def wide_index(positions: Tensor) -> Tensor | None:
    """``positions`` as int64, converted once and cached; None when it is too large to keep twice
    (more than :data:`WIDE_LIMIT` elements off the CPU)."""
    if positions.dtype == torch.int64:
        return positions
    wide = _WIDE.get(positions)
    if wide is None:
        if positions.numel() > WIDE_LIMIT and not (KEEP_WIDE_ON_CPU and positions.device.type == "cpu"):
            return None
        wide = _WIDE[positions] = positions.long()
    return wide


# Zeros that put_ reads (never writes), per dtype and device: every target takes a view of the
# first n, so their memory is that of the largest target, not the sum.
_ZEROS: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def shared_zeros(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A read-only view of ``n`` zeros of ``dtype`` on ``device`` (shared by every caller)."""
    zeros = _ZEROS.get((dtype, device))
    if zeros is None or zeros.numel() < n:
        zeros = _ZEROS[(dtype, device)] = torch.zeros(max(n, 1024), dtype=dtype, device=device)
    return zeros[:n]


def fill_at(flat: Tensor, positions: Tensor, value: float) -> None:
    """``flat[positions] = value``. Positions are stored as int32 where they fit (half the memory
    of int64); ``index_fill_`` wants int64: see :func:`wide_index`."""
    wide = wide_index(positions)
    if wide is not None:
        flat.index_fill_(0, wide, value)
        return
    for start in range(0, positions.numel(), _CONVERT_CHUNK):
        flat.index_fill_(0, positions[start : start + _CONVERT_CHUNK].long(), value)


def copy_at(flat: Tensor, positions: Tensor, values: Tensor) -> None:
    """``flat[positions] = values``, with int64 positions from :func:`wide_index` (see :func:`fill_at`)."""
    wide = wide_index(positions)
    if wide is not None:
        flat.index_copy_(0, wide, values)
        return
    for start in range(0, positions.numel(), _CONVERT_CHUNK):
        stop = start + _CONVERT_CHUNK
        flat.index_copy_(0, positions[start:stop].long(), values[start:stop])


def _is_dense(tensor: Tensor) -> bool:
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=lambda s: s[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True
