"""Ordering of version strings."""

from __future__ import annotations

from collections.abc import Iterable


def compare(a: str, b: str) -> int:
    """Return -1, 0 or 1 as version ``a`` is older than, equal to or newer than ``b``."""
    key_a, key_b = _sort_key(a), _sort_key(b)
    return (key_a > key_b) - (key_a < key_b)


def newest(versions: Iterable[str]) -> str:
    """The newest of ``versions``."""
    return max(versions, key=_sort_key)


def _sort_key(text: str) -> tuple[str, bool, str]:
    core, _, prerelease = text.strip().partition("-")
    # A release sorts after its pre-releases: 1.0.0-rc.1 < 1.0.0.
    return (core, prerelease == "", prerelease)
