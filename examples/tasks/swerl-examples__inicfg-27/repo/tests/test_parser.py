import pytest

from inicfg.parser import ParseError, parse

SAMPLE = """
# global settings
timeout = 30

[server]
host = example.org
port = 8080

; comments with a semicolon work too
[client]
retries=3
"""


def test_parse_sections():
    sections = parse(SAMPLE)
    assert sections["server"] == {"host": "example.org", "port": "8080"}
    assert sections["client"] == {"retries": "3"}


def test_keys_before_first_section_go_to_default():
    assert parse(SAMPLE)["DEFAULT"] == {"timeout": "30"}


def test_value_may_contain_equals_sign():
    assert parse("[db]\nurl = postgres://u:p@h/db?x=1\n")["db"]["url"] == "postgres://u:p@h/db?x=1"


def test_line_without_equals_is_an_error():
    with pytest.raises(ParseError) as info:
        parse("[server]\nhost example.org\n")
    assert info.value.lineno == 2
