"""A read-only view over parsed configuration, with typed getters."""

from __future__ import annotations

from pathlib import Path

from inicfg.parser import parse

_TRUE = {"1", "yes", "true", "on"}
_FALSE = {"0", "no", "false", "off"}


class Config:
    """Sections of key/value pairs; a key missing from a section is looked up in DEFAULT."""

    def __init__(self, sections: dict[str, dict[str, str]]) -> None:
        self._sections = sections

    @classmethod
    def from_string(cls, text: str) -> Config:
        return cls(parse(text))

    @classmethod
    def from_file(cls, path: str | Path) -> Config:
        return cls(parse(Path(path).read_text(encoding="utf-8")))

    def sections(self) -> list[str]:
        return [name for name in self._sections if name != "DEFAULT"]

    def get(self, section: str, key: str, default: str | None = None) -> str:
        for source in (self._sections.get(section, {}), self._sections["DEFAULT"]):
            if key in source:
                return source[key]
        if default is None:
            raise KeyError(f"{section}.{key}")
        return default

    def getint(self, section: str, key: str) -> int:
        return int(self.get(section, key))

    def getbool(self, section: str, key: str) -> bool:
        value = self.get(section, key).lower()
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise ValueError(f"{section}.{key} is not a boolean: {value!r}")
