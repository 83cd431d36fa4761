import pytest

from romans import from_roman, to_roman


@pytest.mark.parametrize(
    ("number", "numeral"), [(1, "I"), (3, "III"), (8, "VIII"), (2023, "MMXXIII")]
)
def test_to_roman_additive_forms(number, numeral):
    assert to_roman(number) == numeral


@pytest.mark.parametrize("number", [0, -1, 4000])
def test_to_roman_rejects_out_of_range(number):
    with pytest.raises(ValueError):
        to_roman(number)


def test_from_roman_reads_subtractive_forms():
    assert from_roman("MCMXCIV") == 1994


def test_from_roman_rejects_unknown_characters():
    with pytest.raises(ValueError, match="Z"):
        from_roman("XZ")
