"""Small helpers for working with lists."""

from listutils.core import chunked, flatten, unique

__all__ = ["chunked", "flatten", "unique"]
