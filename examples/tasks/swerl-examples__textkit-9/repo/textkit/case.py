"""Convert identifiers between snake_case and camelCase."""

from __future__ import annotations

import re

_LOWER_TO_UPPER = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_SEPARATORS = re.compile(r"[\s_-]+")


def snake_case(text: str) -> str:
    """``"HelloWorld"``, ``"hello-world"`` and ``"Hello world"`` -> ``"hello_world"``."""
    words = _SEPARATORS.split(_LOWER_TO_UPPER.sub(" ", text).strip())
    return "_".join(word.lower() for word in words if word)


def camel_case(text: str) -> str:
    """``"hello_world"`` -> ``"helloWorld"``."""
    first, *rest = snake_case(text).split("_")
    return first + "".join(word.capitalize() for word in rest)
