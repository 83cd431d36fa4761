import pytest

from semverlite import Version


def test_parse_release():
    assert Version.parse("2.10.3") == Version(2, 10, 3)


def test_parse_prerelease():
    assert Version.parse("1.0.0-rc.1") == Version(1, 0, 0, "rc.1")


@pytest.mark.parametrize("text", ["1.2", "v1.2.3", "1.2.3-", "one.two.three"])
def test_parse_rejects_malformed(text):
    with pytest.raises(ValueError):
        Version.parse(text)


def test_str_round_trips():
    assert str(Version.parse("0.4.0-beta")) == "0.4.0-beta"
