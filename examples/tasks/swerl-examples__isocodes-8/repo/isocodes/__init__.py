"""Country and currency codes."""

from isocodes.currencies import countries_using, country_name, currency_for

__all__ = ["countries_using", "country_name", "currency_for"]
