import pytest

from isocodes import countries_using, country_name, currency_for


def test_currency_for_germany():
    assert currency_for("DE") == "EUR"


def test_lookup_ignores_case():
    assert currency_for("jp") == "JPY"


def test_unknown_country_raises_lookup_error():
    with pytest.raises(LookupError, match="XX"):
        currency_for("XX")


def test_country_name():
    assert country_name("CH") == "Switzerland"


def test_countries_using_swiss_franc():
    assert countries_using("chf") == ["CH", "LI"]
