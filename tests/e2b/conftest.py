"""Fixtures of the E2B SDK tests: a real `swerl e2b serve` per module and a sandbox of the
real SDK on it (testkit.e2b)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from testkit.e2b import Face, running_face


@pytest.fixture(scope="module")
def face(base_image: str) -> Iterator[Face]:
    with running_face(base_image) as running:
        yield running


@pytest.fixture()
def sandbox(face: Face, base_image: str) -> Iterator[Any]:
    """A sandbox of the real SDK on the face, killed after the test."""
    from e2b import Sandbox

    created = Sandbox.create(base_image, timeout=120, **face.opts)
    yield created
    created.kill()
