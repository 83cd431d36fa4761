"""Roman numerals for 1..3999."""

from __future__ import annotations

_VALUES = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
_GREEDY = [
    (1000, "M"),
    (500, "D"),
    (100, "C"),
    (50, "L"),
    (10, "X"),
    (5, "V"),
    (1, "I"),
]


def to_roman(number: int) -> str:
    """``1994`` -> ``"MCMXCIV"``."""
    if not 0 < number < 4000:
        raise ValueError(f"Roman numerals cover 1..3999, got {number}")
    parts = []
    for value, numeral in _GREEDY:
        count, number = divmod(number, value)
        parts.append(numeral * count)
    return "".join(parts)


def from_roman(numeral: str) -> int:
    """``"MCMXCIV"`` -> ``1994``; a smaller value before a larger one is subtracted."""
    unknown = set(numeral.upper()) - set(_VALUES)
    if unknown:
        raise ValueError(f"not a Roman numeral: {numeral!r} (bad: {sorted(unknown)})")
    values = [_VALUES[ch] for ch in numeral.upper()]
    total = 0
    for value, following in zip(values, [*values[1:], 0], strict=True):
        total += -value if value < following else value
    return total
