"""The currency each country uses, read from the bundled gzip-compressed CSV table."""

from __future__ import annotations

import csv
import gzip
from functools import lru_cache
from pathlib import Path

DATA_FILE = Path(__file__).parent / "data" / "currencies.csv.gz"


@lru_cache(maxsize=1)
def _table() -> dict[str, dict[str, str]]:
    with gzip.open(DATA_FILE, "rt", encoding="utf-8", newline="") as handle:
        return {row["country"]: row for row in csv.DictReader(handle)}


def _row(country: str) -> dict[str, str]:
    try:
        return _table()[country.upper()]
    except KeyError:
        raise LookupError(f"unknown country code: {country!r}") from None


def currency_for(country: str) -> str:
    """ISO 4217 code of the currency used in ``country``: ``"DE"`` -> ``"EUR"``."""
    return _row(country)["currency"]


def country_name(country: str) -> str:
    """English short name of ``country``: ``"CH"`` -> ``"Switzerland"``."""
    return _row(country)["name"]


def countries_using(currency: str) -> list[str]:
    """Sorted country codes whose currency is ``currency``."""
    wanted = currency.upper()
    return sorted(code for code, row in _table().items() if row["currency"] == wanted)
