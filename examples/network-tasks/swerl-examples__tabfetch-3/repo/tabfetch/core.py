"""Parsing tab-separated text with a header line, and fetching it over HTTP."""

from __future__ import annotations

import urllib.request


def parse_table(text: str) -> list[dict[str, str]]:
    """The rows of ``text`` as dicts keyed by the header line's columns; blank lines are skipped."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    header = lines[0].split("\t")
    return [dict(zip(header, line.split("\t"), strict=False)) for line in lines[1:]]


def fetch_table(url: str, timeout: float = 10.0) -> list[dict[str, str]]:
    """The table served at ``url`` (UTF-8 text)."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return parse_table(response.read().decode("utf-8"))
