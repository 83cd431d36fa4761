import pytest

from listutils import chunked, flatten, unique


def test_chunked_even_split():
    assert chunked([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]


def test_chunked_empty_input():
    assert chunked([], 3) == []


def test_chunked_rejects_size_zero():
    with pytest.raises(ValueError, match="at least 1"):
        chunked([1, 2], 0)


def test_flatten_one_level():
    assert flatten([[1, 2], [], [3]]) == [1, 2, 3]


def test_unique_keeps_first_occurrence():
    assert unique(["b", "a", "b", "c", "a"]) == ["b", "a", "c"]
