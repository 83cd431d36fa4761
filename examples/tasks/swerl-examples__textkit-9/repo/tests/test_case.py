import pytest

from textkit import camel_case, snake_case


@pytest.mark.parametrize("text", ["HelloWorld", "hello-world", "Hello world", "hello_world"])
def test_snake_case(text):
    assert snake_case(text) == "hello_world"


def test_camel_case():
    assert camel_case("parse_http_response") == "parseHttpResponse"


def test_camel_case_of_empty_string():
    assert camel_case("") == ""
