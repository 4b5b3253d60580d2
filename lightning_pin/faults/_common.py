"""What the fault generators share: the :class:`FaultPins` list they return, input checks, exact names."""

from __future__ import annotations

import math
import numbers
import re
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from lightning_pin.core.errors import PinError
from lightning_pin.core.plan import resolve
from lightning_pin.core.spec import Pin

__all__ = [
    "FaultPins", "Params", "arrivals", "check_fraction", "check_seed", "coordinates", "exact_name", "exact_pattern",
    "finish", "floating_parameters", "in_dtype",
]


Params = Union[str, Sequence[str]]


class FaultPins(list):
    """The pins a fault generator drew (a plain ``list`` of :class:`~lightning_pin.Pin`), and what it drew.

    Attributes:
        summary: One line per matched parameter: how many faults of which kind it got, and
            (for :func:`bit_faults`) how many refused patterns were re-drawn or skipped.
        faulty: Faulty elements per parameter name (0 for a parameter that drew none).
        redrawn: :func:`bit_faults`: elements whose stuck bits would have read inf / NaN whatever
            training writes (every exponent bit stuck at one), whose polarities were drawn again.
        skipped: :func:`bit_faults`: such elements still refused after :data:`REDRAWS` draws
            (every exponent bit stuck and ``one_fraction`` near 1), left without faults.
        shapes: The shape of each parameter the pins were drawn for or read with, by name, where
            known (:func:`~lightning_pin.faults.load_fault_map` of a file that records them):
            :func:`~lightning_pin.faults.save_fault_map` records them in the file.
        dtypes: The dtype of each parameter, by name, where known (as ``shapes``).
    """

    def __init__(
        self,
        pins: Iterable[Pin] = (),
        summary: str = "",
        faulty: Optional[Mapping[str, int]] = None,
        redrawn: int = 0,
        skipped: int = 0,
        shapes: Optional[Mapping[str, tuple[int, ...]]] = None,
        dtypes: Optional[Mapping[str, torch.dtype]] = None,
    ) -> None:
        super().__init__(pins)
        self.summary = summary
        self.faulty = dict(faulty or {})
        self.redrawn = redrawn
        self.skipped = skipped
        self.shapes = {name: tuple(shape) for name, shape in (shapes or {}).items()}
        self.dtypes = dict(dtypes or {})


def finish(
    pins: list[Pin],
    title: str,
    lines: list[str],
    faulty: dict[str, int],
    redrawn: int = 0,
    skipped: int = 0,
    shapes: Optional[Mapping[str, tuple[int, ...]]] = None,
    dtypes: Optional[Mapping[str, torch.dtype]] = None,
) -> FaultPins:
    summary = "\n".join([title, *(f"  {line}" for line in lines)])
    return FaultPins(pins, summary, faulty, redrawn, skipped, shapes, dtypes)


def floating_parameters(module: nn.Module, params: Params, who: str) -> dict[str, Tensor]:
    """The parameters ``params`` matches, by (first) name; PinError for a pattern without match."""
    if not isinstance(module, nn.Module):
        raise PinError(f"{who}: module must be a torch.nn.Module, got {type(module).__name__}")
    named = _matched(module, params)
    odd = [f"{name} ({p.dtype})" for name, p in named.items() if not p.is_floating_point()]
    if odd:
        raise PinError(
            f"{who}: {', '.join(odd)} {'is' if len(odd) == 1 else 'are'} not floating point: fault models act on "
            "the stored words of float weights; narrow params to float parameters"
        )
    return named


#: Per module: which parameters each pattern matched, and the (name, parameter) list it was matched on.
_MATCHES: "weakref.WeakKeyDictionary[nn.Module, dict[Any, tuple[list, dict[str, Tensor]]]]" = weakref.WeakKeyDictionary()


def _matched(module: nn.Module, params: Params) -> dict[str, Tensor]:
    """The parameters ``params`` matches (:func:`resolve`'s rules), remembered while the module keeps the same
    parameters under the same names: a campaign draws hundreds of times on one model."""
    try:
        key: Any = params if isinstance(params, str) else tuple(params)
        hash(key)
    except TypeError:
        key = None
    current = [(name, id(p)) for name, p in module.named_parameters(remove_duplicate=False)]
    held = _MATCHES.get(module, {}).get(key) if key is not None else None
    if held is not None and held[0] == current:
        return dict(held[1])
    selections = resolve([Pin(params)], module).pins[0].selections
    named = {name: selection.parameter for name, selection in selections.items()}
    if key is not None:
        _MATCHES.setdefault(module, {})[key] = (current, dict(named))
    return named


def check_fraction(what: str, x: Any) -> None:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not 0 <= float(x) <= 1:
        raise PinError(f"{what} must be a number in [0, 1], got {x!r}")


def check_seed(seed: Any) -> None:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise PinError(f"seed must be an integer >= 0 (each seed draws its own faults), got {seed!r}")


def in_dtype(number: float, dtype: torch.dtype, name: str) -> Tensor:
    stored = torch.tensor(float(number), dtype=dtype)
    if not torch.isfinite(stored):
        raise PinError(f"{number!r} overflows {dtype} of {name!r} (largest finite: {torch.finfo(dtype).max:g})")
    return stored


def coordinates(flat: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Flat row-major indices as ``(k, ndim)`` int64 coordinates (what ``Pin(indices=...)`` takes)."""
    if not shape:
        return torch.zeros(flat.numel(), 0, dtype=torch.int64)
    return torch.stack(torch.unravel_index(flat.to(torch.int64), shape), dim=1)


_GLOB = re.compile(r"([*?\[])")
_ESCAPED = re.compile(r"\[([*?\[])\]")


def exact_pattern(name: str) -> str:
    """A glob that matches ``name`` only (``[`` ``*`` ``?`` escaped, as ``glob.escape`` does)."""
    return _GLOB.sub(r"[\1]", name)


def exact_name(pattern: str) -> Optional[str]:
    """The one name an exact pattern (as :func:`exact_pattern` writes) matches; None for a real glob or regex."""
    if pattern.startswith("re:"):
        return None
    plain = _ESCAPED.sub("", pattern)
    if _GLOB.search(plain):
        return None
    return _ESCAPED.sub(r"\1", pattern)


#: Draws of the stream are made in pieces of at least this many (a piece costs microseconds).
_PIECE = 64


def arrivals(total: int, wanted: int, seed: int, polarity_seed: int) -> tuple[Tensor, Tensor]:
    """The first ``wanted`` ids of a seeded random order of ``range(total)``, and one uniform per id.

    The order is fixed by the seeds alone, whatever ``wanted`` is, so the ids of a smaller
    ``wanted`` are a prefix of those of a larger one (nesting across rates) and so are their
    uniforms. Cost: about ``wanted`` draws, not ``total``.

    The first half of the order is the stream of ``torch.randint(total)`` draws from a generator
    seeded with ``seed``, repeats dropped (a draw's uniform comes from a generator seeded with
    ``polarity_seed``, at the same place in its stream); the rest (needed only when ``wanted`` is
    above ``total / 2``, where collecting distinct draws would cost ``total * log(total)``) is
    the remaining ids in an order of their own. Both are uniform: together a uniform random
    order. Draws of a torch CPU generator do not depend on how they are split into calls, so the
    stream is the same as one made in larger chunks.

    Returns:
        ``(ids, uniforms)``: int64 and float64, in arrival order.
    """
    if wanted <= 0 or total <= 0:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float64)
    wanted = min(wanted, total)
    where, polarity = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(polarity_seed)
    half = (total + 1) // 2
    head = min(wanted, half)
    # k distinct draws out of `total` take about -total * log(1 - k / total) draws.
    need = math.ceil(-total * math.log1p(-min(head / total, 0.75)) * 1.02) + _PIECE
    pieces: list[Tensor] = []
    uniforms: list[Tensor] = []
    drawn = 0
    while True:
        size = max(need - drawn, _PIECE)
        pieces.append(torch.randint(total, (size,), generator=where))
        uniforms.append(torch.rand(size, generator=polarity, dtype=torch.float64))
        drawn += size
        stream = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        unique, inverse = torch.unique(stream, return_inverse=True)
        if unique.numel() >= head:
            break
        missing = head - unique.numel()
        need = drawn + math.ceil(missing * total / max(total - unique.numel(), 1) * 1.1) + _PIECE
    first = torch.full((unique.numel(),), drawn, dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(drawn), reduce="amin")
    at = first.sort().values[:head]  # stream places of the first `head` distinct ids
    ids, drawn_uniforms = stream[at], torch.cat(uniforms)[at]
    if wanted <= half:
        return ids, drawn_uniforms
    taken = torch.zeros(total, dtype=torch.bool)
    taken[ids] = True
    rest = (~taken).nonzero().squeeze(1)
    tail = torch.Generator().manual_seed((seed + 0x9E3779B97F4A7C15) % 2**63)
    tail_polarity = torch.Generator().manual_seed((polarity_seed + 0x9E3779B97F4A7C15) % 2**63)
    order = torch.randperm(rest.numel(), generator=tail)[: wanted - half]
    tail_uniforms = torch.rand(rest.numel(), generator=tail_polarity, dtype=torch.float64)[: wanted - half]
    return torch.cat([ids, rest[order]]), torch.cat([drawn_uniforms, tail_uniforms])
