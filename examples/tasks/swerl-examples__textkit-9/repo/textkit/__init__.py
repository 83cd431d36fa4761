"""Text helpers without dependencies."""

from textkit.case import camel_case, snake_case
from textkit.normalize import collapse_whitespace, strip_accents

__all__ = ["camel_case", "collapse_whitespace", "snake_case", "strip_accents"]
