"""Stuck bits of the stored word, drawn at a bit error rate: :func:`bit_faults`."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Optional, Union

import torch
from torch import Tensor, nn

from lightning_pin.core.errors import PinError
from lightning_pin.core.kinds.quant_code import QuantCode
from lightning_pin.faults.int8 import is_int8_weight, stored_code
from lightning_pin.faults.quantize import weight_code
from lightning_pin.core.plan import name_seed
from lightning_pin.core.spec import Pin
from lightning_pin.core.state import BITS_DTYPES
from lightning_pin.faults._common import (
    FaultPins,
    Params,
    arrivals,
    check_fraction,
    check_seed,
    coordinates,
    exact_pattern,
    finish,
    floating_parameters,
)

__all__ = ["BitSpec", "bit_faults", "bit_positions", "code_bit_positions", "drawn_pairs"]


BitSpec = Union[None, str, int, Iterable[Union[int, str]]]


def bit_faults(
    module: nn.Module,
    params: Params,
    rate: float,
    *,
    bits: BitSpec = None,
    one_fraction: float = 0.5,
    seed: int = 0,
    code: Union[None, QuantCode, int] = None,
) -> FaultPins:
    """Stuck bits: each (element, bit) pair of the matched parameters' stored words stuck with probability ``rate``.

    ``rate`` is a bit error rate: each bit position of each element's bit pattern (32 for
    float32, 16 for bfloat16 / float16, 64 for float64) is stuck independently; a stuck bit reads
    one with probability ``one_fraction``, else zero. The result is one stuck-bit pin per
    parameter that drew a fault, holding ``stuck_at_zero`` / ``stuck_at_one`` masks for its faulty
    elements: after every optimizer step ``bits = (bits & ~stuck_at_zero) | stuck_at_one``, the other
    bits keep training. A pattern whose stuck bits alone would make the element inf or NaN
    (every exponent bit stuck at one, which lightning-pin refuses) has the exponent bit drawn last
    read zero instead; ``summary`` and ``redrawn`` say how many (``skipped`` is 0: nothing is dropped).

    Drawing costs about the number of stuck bits, not the number of (element, bit) pairs: each
    parameter draws how many pairs are stuck (a binomial), then that many distinct pairs of a
    seeded random order. Seeded with ``seed`` (an integer >= 0) and the parameter's name, on the
    CPU, in full-parameter coordinates: the same faults on every rank and run, and nested across
    rates: with one seed, a higher rate keeps every stuck bit of a lower one (reading the same,
    including the exponent bits read zero to keep a word finite) and adds more.

    Args:
        module: The module to be trained (``trainer.lightning_module``: names must match).
        params: ``fnmatch`` globs (or ``"re:"`` regular expressions) over parameter names.
        rate: Probability that one bit of one element is stuck, in ``[0, 1]``.
        bits: Which bit positions may be stuck: ``None`` (all), ``"sign"``, ``"exponent"``,
            ``"mantissa"`` (of each parameter's dtype), an int counted from the least significant
            bit (0), or an iterable of those.
        one_fraction: Probability that a stuck bit reads one, in ``[0, 1]``.
        seed: Seed of the draw.
        code: A :class:`~lightning_pin.QuantCode`: the weights are stored as its integer codes
            and the draw is over the code's ``bits`` bits of each element (``bits`` positions
            count from the code's least significant bit, ``"sign"`` is the top bit of a signed
            code); the pins carry the code and select only the faulty elements (healthy ones are
            not moved onto the code's grid). No pattern of code bits is refused: none is re-drawn.
            An int ``n``: each parameter's own symmetric signed ``n``-bit code with one scale per
            output channel (axis 0) from its current weights (:func:`~lightning_pin.faults.quantize.weight_code`).
            A weight stored as int8 codes (a torchao ``Int8Tensor``) is always drawn over its 8 code
            bits (the draw ``code=8`` makes on the float weight it came from); its scales are never hit.

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
    pins, lines, faulty, redrawn_total, shapes, dtypes = [], [], {}, 0, {}, {}
    given = code
    if code is not None and not _is_bits(code):
        code = given = QuantCode.from_config(code)
    for name, parameter in floating_parameters(module, params, "bit_faults").items():
        dtype, code = parameter.dtype, None
        if is_int8_weight(parameter):  # a runtime's int8 codes (torchao): the draw is over their 8 bits
            code = stored_code(parameter, name)
            if given is not None and not (given == 8 if _is_bits(given) else given.bits == 8 and given.signed):
                raise PinError(f"bit_faults: {name!r} is stored as int8 codes; code={given!r} does not describe "
                               "them (give code=None or 8)")
            positions = code_bit_positions(bits, code, name)
        elif given is not None:
            code = weight_code(parameter, given, name) if _is_bits(given) else given
            positions = code_bit_positions(bits, code, name)
        elif dtype not in BITS_DTYPES:
            raise PinError(
                f"bit_faults: {name!r} is {dtype}; stuck bits are modelled for {', '.join(map(str, BITS_DTYPES))}"
            )
        else:
            positions = bit_positions(bits, dtype, name)
        numel = parameter.numel()
        # save_fault_map records them, so the map is refused on a layer of another shape
        shapes[name], dtypes[name] = tuple(parameter.shape), dtype
        pairs, one, rank = drawn_pairs(name, numel * len(positions), float(rate), int(seed), float(one_fraction))
        if pairs.numel() == 0:
            faulty[name] = 0
            lines.append(f"{name}: no stuck bit ({rate:g} x {numel * len(positions):,} bit positions)")
            continue
        element = pairs // len(positions)
        bit = torch.tensor(positions, dtype=torch.int64)[pairs % len(positions)]
        value = torch.ones_like(bit).bitwise_left_shift(bit)  # bit 63 wraps to -2**63: still that bit
        cells, owner = torch.unique_consecutive(element, return_inverse=True)  # pairs are sorted
        redrawn = 0 if code is not None else _keep_finite(dtype, positions, cells.numel(), owner, value, one, rank)
        redrawn_total += redrawn
        zero_mask, one_mask = _masks(cells.numel(), owner, value, one)
        faulty[name] = cells.numel()
        if code is not None:  # code-bit masks: at most 16 bits, as int32
            masks = {"stuck_at_zero": zero_mask.to(torch.int32), "stuck_at_one": one_mask.to(torch.int32), "code": code}
        else:
            word = BITS_DTYPES[dtype]
            # integer casts wrap: the same bits in the word's type
            masks = {"stuck_at_zero": zero_mask.to(word), "stuck_at_one": one_mask.to(word)}
        pins.append(Pin(exact_pattern(name), indices=coordinates(cells, tuple(parameter.shape)), **masks))
        ones = int(one.sum())
        lines.append(
            f"{name}: {value.numel():,} stuck bits in {cells.numel():,} of {numel:,} elements ({ones:,} read 1, "
            f"{value.numel() - ones:,} read 0; bits {_ranges(positions)}); {redrawn} re-drawn, 0 skipped"
        )
    of_code = ""
    if given is None and code is not None:
        of_code = ", stored int8 codes"
    elif given is not None:
        of_code = f", int{given} codes per channel" if _is_bits(given) else f", {given.describe()}"
    title = f"bit faults (rate {rate:g}, one_fraction {one_fraction:g}, seed {seed}{of_code})"
    return finish(pins, title, lines, faulty, redrawn_total, 0, shapes=shapes, dtypes=dtypes)


def drawn_pairs(name: str, total: int, rate: float, seed: int, one_fraction: float) -> tuple[Tensor, Tensor, Tensor]:
    """The (element, bit) pairs of parameter ``name`` hit at ``rate`` (ids in ``[0, total)``, sorted), whether
    each reads one (probability ``one_fraction``), and its arrival rank (a lower rate hits the lower ranks).

    How many pairs: a binomial draw (its quantile at one seeded uniform: more for a higher rate);
    which: the first that many of a seeded random order (:func:`~lightning_pin.faults._common.arrivals`).
    Together the distribution of one independent draw per pair, at a cost of about the number of
    pairs hit. :func:`bit_faults` and :func:`~lightning_pin.faults.flip_bits` share it: one seed
    hits the same pairs in both.
    """
    seeds = [name_seed(f"{name}:{stream}", seed) for stream in ("bits", "ones", "count")]
    if rate == 0 or total == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, torch.zeros(0, dtype=torch.bool), empty
    level = float(torch.rand(1, generator=torch.Generator().manual_seed(seeds[2]), dtype=torch.float64))
    wanted = _binomial_quantile(total, rate, level)
    ids, uniforms = arrivals(total, wanted, seeds[0], seeds[1])
    order = ids.argsort()
    return ids[order], (uniforms < one_fraction)[order], order  # order[i]: the arrival rank of pair i


def _keep_finite(
    dtype: torch.dtype, positions: Sequence[int], count: int, owner: Tensor, value: Tensor, one: Tensor, rank: Tensor
) -> int:
    """Elements whose stuck bits would read inf / NaN (every exponent bit stuck at one): their exponent bit
    that arrived last reads zero instead (``one`` is changed in place). Returns how many.

    The last arrival is the same at every rate at which all the exponent bits are stuck, so the
    polarities a lower rate drew are never changed: the draws stay nested across rates.
    """
    exponent = _exponent_mask(dtype)
    width, mantissa = _word(dtype)
    exponent_bits = width - 1 - mantissa
    is_exponent = (value & exponent) != 0
    if sum(mantissa <= p < width - 1 for p in positions) < exponent_bits:
        return 0
    zeros = torch.zeros(count, dtype=torch.int64)
    ones_in_exponent = zeros.index_add(0, owner, (is_exponent & one).to(torch.int64))
    refused = ones_in_exponent == exponent_bits
    if not bool(refused.any()):
        return 0
    candidates = is_exponent & refused[owner]
    last = torch.full((count,), -1, dtype=torch.int64).scatter_reduce(
        0, owner[candidates], rank[candidates], reduce="amax"
    )
    one[candidates & (rank == last[owner])] = False
    return int(refused.sum())


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


def _is_bits(code: object) -> bool:
    return isinstance(code, numbers.Integral) and not isinstance(code, bool)


def code_bit_positions(bits: BitSpec, code: QuantCode, name: str = "") -> list[int]:
    """The sorted bit positions ``bits`` names in ``code``'s ``code.bits``-bit code (``"sign"``: its top bit).

    Example::

        >>> code_bit_positions(None, QuantCode(bits=4, scale=0.1)), code_bit_positions("sign", QuantCode(8, 0.1))
        ([0, 1, 2, 3], [7])

    Raises:
        PinError: ``"sign"`` of an unsigned code, ``"exponent"`` / ``"mantissa"`` (a code has
            neither), a position outside the code, or no position at all.
    """
    width = code.bits
    items = [bits] if bits is None or isinstance(bits, (str, int)) else list(bits)
    chosen: set[int] = set()
    for item in items:
        if item is None:
            chosen.update(range(width))
        elif item == "sign":
            if not code.signed:
                raise PinError(f"bit_faults: bits 'sign' of {code!r}, an unsigned code: it has no sign bit")
            chosen.add(width - 1)
        elif isinstance(item, str):
            raise PinError(f"bit_faults: bits {item!r} of {code!r}: an integer code has no exponent or mantissa; "
                           "give None (every code bit), 'sign' or positions")
        elif isinstance(item, numbers.Integral) and not isinstance(item, bool):
            if not 0 <= int(item) < width:
                where = f" of {name!r}" if name else ""
                raise PinError(f"bit_faults: bit {item} is outside the {width}-bit code{where}; positions count "
                               f"from 0 (least significant) to {width - 1}")
            chosen.add(int(item))
        else:
            raise PinError(f"bit_faults: bits must be None, 'sign' or ints, got {item!r}")
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


def _binomial_quantile(n: int, p: float, level: float) -> int:
    """The smallest k with ``P(Binomial(n, p) <= k) >= level``: increasing in ``p`` for a fixed level.

    The probabilities are summed in float64 over the mean +- 12 standard deviations (the mass
    outside is below 1e-30). A short range is summed in Python (each term from the last): a few
    hundred tensor elements would cost more in torch's thread pool than the sum itself.
    """
    if p >= 1:
        return n
    mean, sd = n * p, math.sqrt(n * p * (1 - p))
    low, high = max(0, math.floor(mean - 12 * sd) - 16), min(n, math.ceil(mean + 12 * sd) + 16)
    if high - low <= 4096:
        term = math.exp(math.lgamma(n + 1) - math.lgamma(low + 1) - math.lgamma(n - low + 1)
                        + low * math.log(p) + (n - low) * math.log1p(-p))
        odds, cdf = p / (1 - p), 0.0
        for k in range(low, high + 1):
            cdf += term
            if cdf >= level:
                return k
            term *= (n - k) / (k + 1) * odds
        return high
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
