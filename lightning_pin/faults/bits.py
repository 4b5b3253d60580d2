"""Stuck bits of the stored word, drawn at a bit error rate: :func:`bit_faults`."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Union

import torch
from torch import Tensor, nn

from lightning_pin.core.errors import PinError
from lightning_pin.core.plan import name_seed
from lightning_pin.core.spec import Pin
from lightning_pin.core.state import BITS_DTYPES
from lightning_pin.faults._common import (
    FaultPins,
    Params,
    check_fraction,
    check_seed,
    coordinates,
    exact_pattern,
    finish,
    floating_parameters,
)


#: Draws of the polarities of an element whose stuck bits would read inf / NaN, before it is skipped.
REDRAWS = 8
#: A parameter with at most this many (element, bit) pairs draws one uniform per pair; a larger one
#: draws how many pairs are stuck (a binomial quantile), then which (a stream of distinct draws).
DENSE_PAIRS = 1 << 20
#: Pairs per chunk of the per-pair draw (a fixed schedule: the draws never depend on the rate).
CHUNK = 1 << 16

BitSpec = Union[None, str, int, Iterable[Union[int, str]]]


def bit_faults(
    module: nn.Module,
    params: Params,
    rate: float,
    *,
    bits: BitSpec = None,
    one_fraction: float = 0.5,
    seed: int = 0,
) -> FaultPins:
    """Stuck bits: each (element, bit) pair of the matched parameters' stored words stuck with probability ``rate``.

    ``rate`` is a bit error rate: each bit position of each element's bit pattern (32 for
    float32, 16 for bfloat16 / float16, 64 for float64) is stuck independently; a stuck bit reads
    one with probability ``one_fraction``, else zero. The result is one stuck-bit pin per
    parameter that drew a fault, holding ``stuck_at_zero`` / ``stuck_at_one`` masks for its faulty
    elements: after every optimizer step ``bits = (bits & ~stuck_at_zero) | stuck_at_one``, the other
    bits keep training. A pattern whose stuck bits alone would make the element inf or NaN
    (every exponent bit stuck at one, which lightning-pin refuses) gets its polarities drawn again,
    up to :data:`REDRAWS` times, then is skipped; ``summary``, ``redrawn`` and ``skipped`` say how many.

    Drawing is vectorized: a parameter of more than :data:`DENSE_PAIRS` pairs draws the number
    of stuck pairs (a binomial), then that many distinct pairs, so a large tensor at a small rate
    costs about its number of faults, not its size. Seeded with ``seed`` and the parameter's name,
    on the CPU, in full-parameter coordinates: the same faults on every rank and run, and nested
    across rates: with one seed, a higher rate keeps every stuck bit of a lower one (reading the
    same) and adds more.

    Args:
        module: The module to be trained (``trainer.lightning_module``: names must match).
        params: ``fnmatch`` globs (or ``"re:"`` regular expressions) over parameter names.
        rate: Probability that one bit of one element is stuck, in ``[0, 1]``.
        bits: Which bit positions may be stuck: ``None`` (all), ``"sign"``, ``"exponent"``,
            ``"mantissa"`` (of each parameter's dtype), an int counted from the least significant
            bit (0), or an iterable of those.
        one_fraction: Probability that a stuck bit reads one, in ``[0, 1]``.
        seed: Seed of the draw.

    Returns:
        A :class:`FaultPins` list of stuck-bit pins (masks in the signed integer type of the word:
        int32 for float32, int16 for bfloat16 / float16, int64 for float64).

    Raises:
        PinError: ``params`` matches no parameter, a matched parameter is not float64 / float32 /
            bfloat16 / float16, ``bits`` names a position the dtype does not have, or ``rate`` /
            ``one_fraction`` / ``seed`` is out of range.

    Example::

        >>> import torch
        >>> from lightning_pin.faults import bit_faults
        >>> net = torch.nn.Linear(256, 64)
        >>> pins = bit_faults(net, "weight", rate=1e-3, bits="exponent", seed=0)
        >>> stuck = pins[0].stuck_at_zero | pins[0].stuck_at_one
        >>> bool((stuck & ~0x7F800000 == 0).all())      # exponent bits of float32 only
        True
        >>> print(pins.summary.splitlines()[1])  # doctest: +ELLIPSIS
          weight: ... stuck bits in ... of 16,384 elements (... read 1, ... read 0; bits 23-30); 0 re-drawn, 0 skipped
    """
    check_fraction("rate", rate)
    check_fraction("one_fraction", one_fraction)
    check_seed(seed)
    pins, lines, faulty, redrawn_total, skipped_total = [], [], {}, 0, 0
    for name, parameter in floating_parameters(module, params, "bit_faults").items():
        dtype = parameter.dtype
        if dtype not in BITS_DTYPES:
            raise PinError(
                f"bit_faults: {name!r} is {dtype}; stuck bits are modelled for {', '.join(map(str, BITS_DTYPES))}"
            )
        positions = bit_positions(bits, dtype, name)
        numel = parameter.numel()
        seeds = [name_seed(f"{name}:{stream}", int(seed)) for stream in ("bits", "ones", "count")]
        pairs, one = _stuck_pairs(numel * len(positions), float(rate), float(one_fraction), *seeds)
        if pairs.numel() == 0:
            faulty[name] = 0
            lines.append(f"{name}: no stuck bit ({rate:g} x {numel * len(positions):,} bit positions)")
            continue
        element = pairs // len(positions)
        bit = torch.tensor(positions, dtype=torch.int64)[pairs % len(positions)]
        value = torch.ones_like(bit).bitwise_left_shift(bit)  # bit 63 wraps to -2**63: still that bit
        cells, owner = torch.unique_consecutive(element, return_inverse=True)  # pairs are sorted
        polarity = torch.Generator().manual_seed(name_seed(f"{name}:redraw", int(seed)))
        exponent = _exponent_mask(dtype)
        zero_mask, one_mask = _masks(cells.numel(), owner, value, one)
        refused = (one_mask & exponent) == exponent
        first_refused = int(refused.sum())
        for _ in range(REDRAWS if first_refused else 0):
            again = refused[owner]
            one[again] = torch.rand(int(again.sum()), generator=polarity, dtype=torch.float64) < one_fraction
            zero_mask, one_mask = _masks(cells.numel(), owner, value, one)
            refused = (one_mask & exponent) == exponent
            if not bool(refused.any()):
                break
        skipped = int(refused.sum())
        if skipped:
            kept = ~refused
            cells, zero_mask, one_mask = cells[kept], zero_mask[kept], one_mask[kept]
            one, value = one[kept[owner]], value[kept[owner]]
        redrawn_total += first_refused - skipped
        skipped_total += skipped
        faulty[name] = cells.numel()
        if cells.numel():
            word = BITS_DTYPES[dtype]
            pins.append(
                Pin(
                    exact_pattern(name),
                    indices=coordinates(cells, tuple(parameter.shape)),
                    stuck_at_zero=zero_mask.to(word),  # integer casts wrap: the same bits in the word's type
                    stuck_at_one=one_mask.to(word),
                )
            )
        ones = int(one.sum())
        lines.append(
            f"{name}: {value.numel():,} stuck bits in {cells.numel():,} of {numel:,} elements ({ones:,} read 1, "
            f"{value.numel() - ones:,} read 0; bits {_ranges(positions)}); {first_refused - skipped} re-drawn, "
            f"{skipped} skipped"
        )
    title = f"bit faults (rate {rate:g}, one_fraction {one_fraction:g}, seed {seed})"
    return finish(pins, title, lines, faulty, redrawn_total, skipped_total)


def bit_positions(bits: BitSpec, dtype: torch.dtype, name: str = "") -> list[int]:
    """The sorted bit positions (0 = least significant) ``bits`` names in ``dtype``'s word.

    Example::

        >>> bit_positions("exponent", torch.bfloat16), bit_positions(["sign", 0], torch.float16)
        ([7, 8, 9, 10, 11, 12, 13, 14], [0, 15])

    Raises:
        PinError: a name other than ``"sign"`` / ``"exponent"`` / ``"mantissa"``, a position
            outside the word, or no position at all.
    """
    width, mantissa = _word(dtype)
    named = {
        "sign": [width - 1],
        "exponent": list(range(mantissa, width - 1)),
        "mantissa": list(range(mantissa)),
    }
    items = [bits] if bits is None or isinstance(bits, (str, int)) else list(bits)
    chosen: set[int] = set()
    for item in items:
        if item is None:
            chosen.update(range(width))
        elif isinstance(item, str):
            if item not in named:
                raise PinError(f"bit_faults: bits {item!r} is not one of 'sign', 'exponent', 'mantissa' or a position")
            chosen.update(named[item])
        elif isinstance(item, numbers.Integral) and not isinstance(item, bool):
            if not 0 <= int(item) < width:
                where = f" of {name!r}" if name else ""
                raise PinError(
                    f"bit_faults: bit {item} is outside the {width}-bit word of {dtype}{where}; "
                    f"positions count from 0 (least significant) to {width - 1} (the sign)"
                )
            chosen.add(int(item))
        else:
            raise PinError(f"bit_faults: bits must be None, 'sign', 'exponent', 'mantissa' or ints, got {item!r}")
    if not chosen:
        raise PinError("bit_faults: bits names no bit position")
    return sorted(chosen)


def _word(dtype: torch.dtype) -> tuple[int, int]:
    """Bits of ``dtype``'s word and of its mantissa (eps is 2 ** -mantissa bits)."""
    info = torch.finfo(dtype)
    return info.bits, round(-math.log2(info.eps))


def _exponent_mask(dtype: torch.dtype) -> int:
    width, mantissa = _word(dtype)
    mask = ((1 << (width - 1 - mantissa)) - 1) << mantissa
    return mask if mask < 2**63 else mask - 2**64  # as int64 (float64's exponent fits anyway)


def _masks(count: int, owner: Tensor, value: Tensor, one: Tensor) -> tuple[Tensor, Tensor]:
    """Per element, the OR of its stuck-at-zero and stuck-at-one bits (distinct bits: a sum is an OR)."""
    zeros = torch.zeros(count, dtype=torch.int64)
    return (
        zeros.index_add(0, owner, torch.where(one, 0, value)),
        zeros.index_add(0, owner, torch.where(one, value, 0)),
    )


def _stuck_pairs(
    total: int, rate: float, one_fraction: float, seed: int, ones: int, count: int
) -> tuple[Tensor, Tensor]:
    """Sorted ids in ``[0, total)`` of the stuck pairs (each stuck with probability ``rate``), and
    which of them read one (each with probability ``one_fraction``).

    Nested in ``rate``: every pair carries its own draws whatever the rate (a uniform, or its place
    in a stream of distinct draws, and a polarity), so with the same seeds a higher rate keeps
    every stuck bit of a lower one, reading the same, and adds more.
    """
    where, polarity = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(ones)
    if rate == 0 or total == 0:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.bool)
    if total <= DENSE_PAIRS:
        stuck, reads_one = [], []
        for start in range(0, total, CHUNK):
            size = min(CHUNK, total - start)
            hit = (torch.rand(size, generator=where, dtype=torch.float64) < rate).nonzero().squeeze(1)
            stuck.append(hit + start)
            reads_one.append(torch.rand(size, generator=polarity, dtype=torch.float64)[hit] < one_fraction)
        return torch.cat(stuck), torch.cat(reads_one)
    # As many pairs as a binomial draw says (its quantile at one uniform: more for a higher rate),
    # then the first that many distinct pairs of a uniform stream: a uniform subset of that size,
    # which is the distribution of one draw per pair, at O(faults) cost.
    level = float(torch.rand(1, generator=torch.Generator().manual_seed(count), dtype=torch.float64))
    wanted = _binomial_quantile(total, rate, level)
    if wanted == 0:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.bool)
    streams: list[Tensor] = []
    polarities: list[Tensor] = []
    # m draws from `total` give about total * (1 - exp(-m / total)) distinct ones: draw that many
    # (and a margin) at once, then more only in the rare case that was not enough.
    needed = -total * math.log1p(-min(wanted / total, 1 - 1e-12)) * 1.02 + 1024
    while True:
        while sum(len(x) for x in streams) < needed:
            size = CHUNK << len(streams)  # a fixed schedule: the stream is the same whatever is wanted
            streams.append(torch.randint(total, (size,), generator=where))
            polarities.append(torch.rand(size, generator=polarity, dtype=torch.float64))
        drawn = torch.cat(streams)
        unique, inverse = torch.unique(drawn, return_inverse=True)
        if unique.numel() >= wanted:
            break
        needed = drawn.numel() + 1
    first = torch.full((unique.numel(),), drawn.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(drawn.numel()), reduce="amin")
    chosen = first.sort().values[:wanted]  # stream positions of the first `wanted` distinct pairs
    pairs, reads_one = drawn[chosen], torch.cat(polarities)[chosen] < one_fraction
    order = pairs.argsort()
    return pairs[order], reads_one[order]


def _binomial_quantile(n: int, p: float, level: float) -> int:
    """The smallest k with ``P(Binomial(n, p) <= k) >= level``: increasing in ``p`` for a fixed level.

    The probabilities are summed in float64 over the mean +- 12 standard deviations (the mass
    outside is below 1e-30).
    """
    if p >= 1:
        return n
    mean, sd = n * p, math.sqrt(n * p * (1 - p))
    low, high = max(0, math.floor(mean - 12 * sd) - 16), min(n, math.ceil(mean + 12 * sd) + 16)
    k = torch.arange(low, high + 1, dtype=torch.float64)
    log_pmf = math.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)
    log_pmf += k * math.log(p) + (n - k) * math.log1p(-p)
    cdf = log_pmf.exp().cumsum(0)
    at = int(torch.searchsorted(cdf, torch.tensor([level], dtype=torch.float64)).item())
    return low + min(at, high - low)


def _ranges(positions: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for p in positions:
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
