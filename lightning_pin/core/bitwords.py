"""Stuck-bit masks in words, from plain integers (no torch): one text for every place that shows them.

The engine's verify, the plan's error messages (both through the stuck-bits kind,
:mod:`~lightning_pin.core.kinds.stuck_bits`) and ``lightning-pin check`` (:mod:`lightning_pin.reporting.check`)
all describe a stuck-bit element the same way, so a violation reads alike wherever it is found.

Example::

    >>> hex_word(-2**31, 32)
    '0x80000000'
    >>> describe_stuck(0x3F800000, zero=0x80000000, one=0x00400000, width=32)
    'bits 0x3f800000, stuck at 1: 0x00400000, stuck at 0: 0x80000000, wrong: 0x00400000'
"""

from __future__ import annotations

__all__ = ["describe_stuck", "hex_word"]


def hex_word(value: int, width: int) -> str:
    """``value``'s low ``width`` bits as hex, zero-padded to the word (``0x40000000``); a signed
    value shows the bits of its two's complement."""
    return f"0x{value & ((1 << width) - 1):0{width // 4}x}"


def describe_stuck(word: int, zero: int, one: int, width: int) -> str:
    """What a stuck-bit element holds and must hold: its bits, the stuck ones, the wrong ones.

    ``word`` is the element's stored bits, ``zero`` and ``one`` the bits stuck at 0 and at 1
    (signed or unsigned integers of ``width`` bits: only the low ``width`` bits are shown).
    """
    wrong = (word & zero) | (~word & one)
    parts = [f"bits {hex_word(word, width)}"]
    if one:
        parts.append(f"stuck at 1: {hex_word(one, width)}")
    if zero:
        parts.append(f"stuck at 0: {hex_word(zero, width)}")
    parts.append(f"wrong: {hex_word(wrong, width)}")
    return ", ".join(parts)
