"""Parse INI-style text into nested dictionaries."""

from __future__ import annotations


class ParseError(ValueError):
    """A line the parser does not understand; ``lineno`` is 1-based."""

    def __init__(self, lineno: int, line: str) -> None:
        super().__init__(f"line {lineno}: cannot parse {line!r}")
        self.lineno = lineno


def parse(text: str) -> dict[str, dict[str, str]]:
    """Return ``{section: {key: value}}``; keys before any section go to ``"DEFAULT"``."""
    sections: dict[str, dict[str, str]] = {"DEFAULT": {}}
    current = sections["DEFAULT"]
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1].strip(), {})
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ParseError(lineno, raw)
        current[key.strip()] = value.strip()
    return sections
