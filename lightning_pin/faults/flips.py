"""Transient bit flips (:func:`flip_bits`), and faults written into the weights for one evaluation (:class:`WordPatch`).

A transient fault (a particle strike, a marginal read) flips a stored bit once: the model is
evaluated with the flip in, and nothing is retrained around it. Both classes here change the
stored words of some elements on entry and write the saved words back on exit, exactly (on an
integer view of the bytes: NaN payloads and ``-0.0`` come back as they were), also when the
code in the ``with`` block raises. They save only the words they change: a campaign of many
draws never copies the model. Patches nested on the same weights may be left in any order: each
exit leaves the words the patches still held give, entered in their order (see :class:`WordPatch`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_pin.core import kinds
from lightning_pin.core.errors import PinError
from lightning_pin.core.plan import resolve
from lightning_pin.core.spec import Pin
from lightning_pin.core.state import BITS_DTYPES
from lightning_pin.faults._common import Params, check_fraction, check_seed, exact_name, floating_parameters
from lightning_pin.faults.bits import BitSpec, _ranges, bit_positions, code_bit_positions, drawn_pairs
from lightning_pin.faults.int8 import int8_codes, is_int8_weight, stored_code

__all__ = ["BitFlips", "Rewrite", "WordPatch", "changed_bits", "flip_bits", "forced_patch"]


#: Set bits of every byte value (a popcount without torch.bitwise_count, which torch lacks).
_POPCOUNT = torch.tensor([bin(b).count("1") for b in range(256)], dtype=torch.int64)


def changed_bits(before: Tensor, after: Tensor) -> int:
    """How many bits differ between two tensors of words (any dtype; compared as bytes).

    A weight stored as int8 codes (torchao) is compared by its codes (``qdata``): code bits.
    """
    before, after = (t.qdata if is_int8_weight(t) else t for t in (before, after))
    if before.numel() == 0:
        return 0
    differ = before.contiguous().view(torch.uint8) ^ after.contiguous().view(torch.uint8)
    return int(_POPCOUNT[differ.long()].sum())


def _words(parameter: Tensor, name: str) -> Tensor:
    """The parameter's storage as a flat tensor of signed integer words (a view: writes land in the weights).

    For a weight stored as int8 codes (torchao): its codes, never its scales."""
    codes = int8_codes(parameter, name)
    if codes is not None:
        return codes
    if parameter.dtype not in BITS_DTYPES:
        raise PinError(f"{name!r} is {parameter.dtype}: words are modelled for {', '.join(map(str, BITS_DTYPES))}")
    if not parameter.is_contiguous():
        raise PinError(f"{name!r} is not contiguous: its stored words cannot be written in place")
    return parameter.detach().view(-1).view(BITS_DTYPES[parameter.dtype])


#: How a patch makes an element's new word from its old one.
Rewrite = Callable[[Tensor], Tensor]

#: The patches in the weights now, in the order they were entered (an out-of-order exit replays the later ones).
_HELD: list["WordPatch"] = []


def _storage(words: Tensor) -> tuple[int, int, torch.dtype]:
    """What identifies a parameter's words across views of it (tied weights are one)."""
    return words.data_ptr(), words.numel(), words.dtype


def _common(index: Tensor, other: Tensor) -> tuple[Tensor, Tensor]:
    """Positions ``(i, j)`` with ``index[i] == other[j]`` (both hold distinct flat element indices)."""
    ordered, order = other.sort()
    at = torch.searchsorted(ordered, index).clamp(max=max(ordered.numel() - 1, 0))
    found = ordered[at] == index if ordered.numel() else torch.zeros_like(index, dtype=torch.bool)
    return found.nonzero().squeeze(1), order[at[found]]


class WordPatch:
    """New words for some elements of some parameters, written on entry and undone exactly on exit.

    ``changes`` maps a name to ``(parameter, flat indices, rewrite)``, where ``rewrite(old_words)``
    gives the new words (a value, stuck bits, flipped bits). On entry the old words of those
    elements are saved (only those) and the new ones written; on exit the old ones come back.
    ``changed_bits`` counts the stored bits the last entry changed.

    Patches nested on the same weights may be exited in any order: leaving one that a later patch
    still holds (an outer ``with`` closed first) re-applies the later patches' rewrites to the words
    this one saved, so the weights are exactly what the patches still held give, entered in their
    order, and the last exit leaves the original words (a later patch's saved words are corrected
    too, so its own exit writes back the words from before the first patch).

    Example::

        >>> import torch
        >>> w = torch.nn.Parameter(torch.tensor([1.0, -0.0, 2.0]))
        >>> patch = WordPatch({"w": (w, torch.tensor([1]), lambda old: old & 0x7FFFFFFF)})  # clear a sign bit
        >>> with patch:
        ...     w.tolist()
        [1.0, 0.0, 2.0]
        >>> w.tolist(), patch.changed_bits   # -0.0 back, bit for bit; the sign bit was the change
        ([1.0, -0.0, 2.0], 1)
    """

    def __init__(self, changes: dict[str, tuple[Tensor, Tensor, Rewrite]]) -> None:
        self._changes: list[tuple[Tensor, Tensor, Rewrite]] = []
        self.changed_bits = 0
        self.elements = 0
        for name, (parameter, index, rewrite) in changes.items():
            words = _words(parameter, name)
            index = index.to(device=words.device, dtype=torch.int64)
            self.elements += index.numel()
            self._changes.append((words, index, rewrite))
        self._saved: Optional[list[Tensor]] = None

    def __enter__(self) -> "WordPatch":
        if self._saved is not None:
            raise PinError("this patch is already in the weights: enter it once at a time")
        changed = 0
        with torch.no_grad():
            self._saved = [words[index] for words, index, _ in self._changes]  # indexing copies
            _HELD.append(self)
            try:
                for (words, index, rewrite), old in zip(self._changes, self._saved):
                    new = rewrite(old)
                    words[index] = new
                    changed += changed_bits(old, new)
            except BaseException:
                self.__exit__(None, None, None)
                raise
        self.changed_bits = changed
        return self

    def __exit__(self, *exc: Any) -> None:
        saved, self._saved = self._saved, None
        if saved is None:
            return
        where = next(at for at, held in enumerate(_HELD) if held is self)
        later = _HELD[where + 1 :]
        del _HELD[where]
        with torch.no_grad():
            for (words, index, _), old in zip(self._changes, saved):
                words[index] = self._replayed(words, index, old, later)

    @staticmethod
    def _replayed(words: Tensor, index: Tensor, old: Tensor, later: list["WordPatch"]) -> Tensor:
        """The words of ``index`` with this patch taken out: ``old`` (what it saved) with the rewrites of the patches
        entered after it applied in their order; each of those now saves the words from before this patch."""
        current = old.clone()
        for patch in later:
            for at, (other, other_index, rewrite) in enumerate(patch._changes):
                if _storage(other) != _storage(words) or patch._saved is None:
                    continue
                mine, theirs = _common(index, other_index)
                if mine.numel() == 0:
                    continue
                before = patch._saved[at].clone()
                before[theirs] = current[mine]
                patch._saved[at] = before
                current[mine] = rewrite(before)[theirs]
        return current


def forced_patch(module: nn.Module, pins: Sequence[Pin], *,
                 parameters: Optional[Mapping[str, Tensor]] = None) -> WordPatch:
    """The words the fault ``pins`` force on ``module`` (what their first restore writes), as a :class:`WordPatch`.

    For the pins the fault generators draw: values (:func:`~lightning_pin.faults.cell_faults`, the
    app's value faults) and stuck bits (:func:`~lightning_pin.faults.bit_faults`), selected by
    indices or a mask. Resolved with the engine's own rules (:func:`lightning_pin.core.plan.resolve`),
    so a value lands in the parameter's dtype as it would in training.

    Pins as the generators draw them (one pin per parameter, its exact name, ``indices`` and per-element
    values or masks) are read directly, without resolving them again: a campaign of many draws pays
    for the faults it writes, not for the plan. Anything else goes through :func:`resolve`.

    ``parameters``: ``dict(module.named_parameters())`` when the caller holds it (a campaign that
    draws many times on one module).

    Raises:
        PinError: a pin of another kind (bounds, ``when``, step windows), or one :func:`resolve` refuses.
    """
    direct = _direct_patch(module, pins, parameters)
    if direct is not None:
        return direct
    changes: dict[str, tuple[Tensor, Tensor, Rewrite]] = {}
    for resolved in resolve(list(pins), module).pins:
        for name, selection in resolved.selections.items():
            parameter = selection.parameter
            if name in changes:
                raise PinError(f"forced_patch: {name!r} is in two fault pins; draw one pin per parameter")
            if is_int8_weight(parameter):
                raise PinError(f"forced_patch: {name!r} is stored as int8 codes; give the pins bit_faults or "
                               f"cell_faults draw on it (its exact name, indices, per-element masks or codes), not "
                               f"{resolved.pin!r}")
            words = _words(parameter, name)
            index = (
                torch.arange(parameter.numel(), device=words.device)
                if selection.index is None
                else selection.index.to(device=words.device, dtype=torch.int64)
            )
            # The words the fault leaves, as its kind says (values and stuck bits fix them; bounds do not).
            rewrite = kinds.of(selection.kind).word_rewrite(selection, words.dtype, index.numel())
            if rewrite is None:
                raise PinError(f"forced_patch: {resolved.pin!r} is not a value or stuck-bit fault")
            changes[name] = (parameter, index, rewrite)
    return WordPatch(changes)


def _direct_patch(module: nn.Module, pins: Sequence[Pin],
                  parameters: Optional[Mapping[str, Tensor]] = None) -> Optional[WordPatch]:
    """The patch of generator-drawn pins, read from their fields; None when a pin is of any other form."""
    named = parameters if parameters is not None else dict(module.named_parameters())
    changes: dict[str, tuple[Tensor, Tensor, Rewrite]] = {}
    for pin in pins:
        name = exact_name(pin.params) if isinstance(pin.params, str) else None
        parameter = named.get(name) if name is not None else None
        plain = (pin.mask is None and pin.fraction is None and pin.when is None and pin.start_step == 0
                 and pin.stop_step is None and pin.bounds is None)
        if parameter is None or name in changes or not plain or not isinstance(pin.indices, Tensor):
            return None
        int8 = is_int8_weight(parameter)
        if not int8 and (parameter.dtype not in BITS_DTYPES or not parameter.is_contiguous()
                         or getattr(pin, "code", None) is not None):  # a code's masks are code bits, not word bits
            return None
        indices = pin.indices
        if indices.dtype not in (torch.int32, torch.int64) or indices.ndim != 2 or indices.shape[1] != parameter.ndim:
            return None
        strides = torch.tensor((parameter.qdata if int8 else parameter).stride(), dtype=torch.int64)
        index = (indices.to(torch.int64) * strides).sum(dim=1)
        count = index.numel()
        word = torch.int8 if int8 else BITS_DTYPES[parameter.dtype]
        zero, one = pin.stuck_at_zero, pin.stuck_at_one
        if int8:
            change = _int8_change(pin, name, count)
            changes[name] = (parameter, index, change)
            continue
        if zero is not None or one is not None:
            masks = [m for m in (zero, one) if m is not None]
            if not all(isinstance(m, Tensor) and m.dtype == word and m.shape == (count,) for m in masks):
                return None
            changes[name] = (parameter, index, _stuck(zero, one, word))
        elif isinstance(pin.value, Tensor) and pin.value.dtype == parameter.dtype and pin.value.shape == (count,):
            new = pin.value.contiguous().view(word).to(parameter.device)
            changes[name] = (parameter, index, lambda old, new=new: new)
        else:
            return None
    return WordPatch(changes)


def _int8_change(pin: Pin, name: str, count: int) -> Rewrite:
    """The rewrite of a drawn pin on a weight stored as int8 codes: code-bit masks (bits 0-7) or int8 codes."""
    zero, one = pin.stuck_at_zero, pin.stuck_at_one
    if zero is not None or one is not None:
        masks = [m for m in (zero, one) if m is not None]
        if not all(isinstance(m, Tensor) and not m.is_floating_point() and m.dtype != torch.bool
                   and m.shape == (count,) for m in masks):
            raise PinError(f"forced_patch: {name!r} is stored as int8 codes; its stuck bits must be per-element "
                           f"integer code-bit masks, as bit_faults draws them")
        wide = [m.to(torch.int64) for m in masks]
        if any(bool(((m < 0) | (m > 0xFF)).any()) for m in wide):
            raise PinError(f"forced_patch: {name!r} is stored as int8 codes; a code-bit mask must be within 0x00..0xff")
        # integer casts wrap: bit 7 of the mask lands on the int8 code's sign bit
        return _stuck(None if zero is None else zero.to(torch.int64).to(torch.int8),
                      None if one is None else one.to(torch.int64).to(torch.int8), torch.int8)
    value = pin.value
    if isinstance(value, Tensor) and value.dtype == torch.int8 and value.shape == (count,):
        return lambda old, new=value: new.to(old.device)
    raise PinError(f"forced_patch: {name!r} is stored as int8 codes; give it code-bit masks or int8 codes per "
                   f"element (bit_faults / cell_faults draw them), not {pin!r}")


def _stuck(zero: Optional[Tensor], one: Optional[Tensor], dtype: torch.dtype) -> Rewrite:
    def rewrite(old: Tensor) -> Tensor:
        new = old
        if zero is not None:
            new = new & ~zero.reshape(-1).to(device=old.device, dtype=dtype)
        if one is not None:
            new = new | one.reshape(-1).to(device=old.device, dtype=dtype)
        return new.to(old.dtype)

    return rewrite


class BitFlips(WordPatch):
    """What :func:`flip_bits` drew: a context manager that flips the bits on entry and restores the words on exit.

    Attributes:
        positions: Per parameter name, an int64 ``(k, 2)`` tensor of ``(flat element index, bit)``
            rows, sorted; bits count from 0 (least significant).
        summary: One line per matched parameter: how many bits flip in how many elements.
        flipped: Flipped bits per parameter name (0 for one that drew none).
    """

    def __init__(self, changes: dict[str, tuple[Tensor, Tensor, Rewrite]], positions: dict[str, Tensor],
                 summary: str, flipped: dict[str, int]) -> None:
        super().__init__(changes)
        self.positions = positions
        self.summary = summary
        self.flipped = flipped

    def __enter__(self) -> "BitFlips":
        super().__enter__()
        return self


def flip_bits(module: nn.Module, params: Params, rate: float, *, bits: BitSpec = None, seed: int = 0) -> BitFlips:
    """Transient bit flips: each (element, bit) pair of the matched parameters' words flips with probability ``rate``.

    Positions are drawn as :func:`~lightning_pin.faults.bit_faults` draws its stuck bits (the same
    ``bits`` choices; with one seed the same pairs, nested across rates), at a cost of about the
    number of flips. The result is a context manager: entering it flips the bits in the weights
    (``word ^= mask``), leaving it writes the saved words back exactly, also when the block raises.
    A flip may make a word inf or NaN (an exponent flipped to all ones): that is what such a fault
    does to an evaluation, and nothing is refused or re-drawn.

    A weight stored as int8 codes (a torchao ``Int8Tensor``) flips bits 0-7 of its codes (``qdata``),
    never its scales.

    Args:
        module: The module to evaluate.
        params: ``fnmatch`` globs (or ``"re:"`` regular expressions) over parameter names.
        rate: Probability that one bit of one element flips, in ``[0, 1]``.
        bits: Which bit positions may flip, as for :func:`~lightning_pin.faults.bit_faults`.
        seed: Seed of the draw (an integer >= 0).

    Raises:
        PinError: ``params`` matches no parameter, a matched parameter is not float64 / float32 /
            bfloat16 / float16, ``bits`` names a position the dtype does not have, or ``rate`` /
            ``seed`` is out of range.

    Example::

        >>> import torch
        >>> from lightning_pin.faults import flip_bits
        >>> net = torch.nn.Linear(64, 32)
        >>> before = net.weight.detach().clone()
        >>> with flip_bits(net, "weight", rate=0.01, seed=0) as flips:
        ...     changed = int((net.weight.detach().view(torch.int32) != before.view(torch.int32)).sum())
        >>> changed == flips.positions["weight"][:, 0].unique().numel(), torch.equal(net.weight.detach(), before)
        (True, True)
    """
    check_fraction("rate", rate)
    check_seed(seed)
    changes, positions, flipped, lines = {}, {}, {}, []
    for name, parameter in floating_parameters(module, params, "flip_bits").items():
        if is_int8_weight(parameter):  # a runtime's int8 codes (torchao): flips of their 8 bits
            chosen = code_bit_positions(bits, stored_code(parameter, name), name)
            word = torch.int8
        elif parameter.dtype not in BITS_DTYPES:
            raise PinError(
                f"flip_bits: {name!r} is {parameter.dtype}; bit flips are modelled for "
                f"{', '.join(map(str, BITS_DTYPES))}"
            )
        else:
            chosen, word = bit_positions(bits, parameter.dtype, name), BITS_DTYPES[parameter.dtype]
        numel = parameter.numel()
        pairs, _, _ = drawn_pairs(name, numel * len(chosen), float(rate), int(seed), 0.5)
        element = pairs // len(chosen)
        bit = torch.tensor(chosen, dtype=torch.int64)[pairs % len(chosen)]
        positions[name] = torch.stack([element, bit], dim=1)
        flipped[name] = pairs.numel()
        if pairs.numel() == 0:
            lines.append(f"{name}: no flipped bit ({rate:g} x {numel * len(chosen):,} bit positions)")
            continue
        cells, owner = torch.unique_consecutive(element, return_inverse=True)
        mask = torch.zeros(cells.numel(), dtype=torch.int64).index_add(0, owner, torch.ones_like(bit) << bit)
        flip = mask.to(word)  # integer casts wrap: the same bits in the word's type
        changes[name] = (parameter, cells, lambda old, flip=flip: old ^ flip.to(old.device))
        lines.append(f"{name}: {pairs.numel():,} flipped bits in {cells.numel():,} of {numel:,} elements "
                     f"(bits {_ranges(chosen)})")
    title = f"bit flips (rate {rate:g}, seed {seed})"
    return BitFlips(changes, positions, "\n".join([title, *(f"  {line}" for line in lines)]), flipped)
