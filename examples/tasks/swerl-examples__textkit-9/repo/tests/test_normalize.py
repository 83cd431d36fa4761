from textkit import collapse_whitespace, strip_accents


def test_strip_accents():
    assert strip_accents("Crème brûlée à São Paulo") == "Creme brulee a Sao Paulo"


def test_collapse_whitespace():
    assert collapse_whitespace("  a \t b\n\nc ") == "a b c"
