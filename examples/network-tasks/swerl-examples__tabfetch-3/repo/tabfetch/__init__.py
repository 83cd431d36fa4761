"""Small tab-separated tables, from text or from a URL."""

from tabfetch.core import fetch_table, parse_table

__all__ = ["fetch_table", "parse_table"]
