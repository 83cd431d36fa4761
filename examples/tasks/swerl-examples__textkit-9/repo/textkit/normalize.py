"""Normalize text for comparison and display."""

from __future__ import annotations

import unicodedata


def strip_accents(text: str) -> str:
    """Drop combining marks: ``"Crème brûlée"`` -> ``"Creme brulee"``."""
    decomposed = unicodedata.normalize("NFKD", text)
    return "".join(ch for ch in decomposed if not unicodedata.combining(ch))


def collapse_whitespace(text: str) -> str:
    """Replace each run of whitespace by one space and trim both ends."""
    return " ".join(text.split())
