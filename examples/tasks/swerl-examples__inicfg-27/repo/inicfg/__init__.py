"""A tiny reader for INI-style configuration files."""

from inicfg.config import Config
from inicfg.parser import ParseError, parse

__all__ = ["Config", "ParseError", "parse"]
