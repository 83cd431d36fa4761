"""List helpers: splitting into chunks, flattening, de-duplicating."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")
H = TypeVar("H", bound=Hashable)


def chunked(items: Sequence[T], size: int) -> list[list[T]]:
    """Split ``items`` into lists of ``size`` elements; the last one may be shorter."""
    if size < 1:
        raise ValueError(f"size must be at least 1, got {size}")
    return [list(items[i : i + size]) for i in range(0, len(items) - size + 1, size)]


def flatten(nested: Iterable[Iterable[T]]) -> list[T]:
    """Flatten one level of nesting."""
    return [item for inner in nested for item in inner]


def unique(items: Iterable[H]) -> list[H]:
    """Drop repeated items, keeping the first occurrence of each."""
    seen: set[H] = set()
    result: list[H] = []
    for item in items:
        if item not in seen:
            seen.add(item)
            result.append(item)
    return result
