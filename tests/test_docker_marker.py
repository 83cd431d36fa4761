"""The `docker` marker comes from a test's fixtures (testkit.docker): a test whose fixture closure
reaches a fixture that needs dockerd is marked without saying so, through any number of fixtures
between, a test that needs none is left out, and the markers a test or module sets keep working.

Each case is a small suite run by pytester in-process, with the same hook tests/conftest.py has."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

CONFTEST = """
import pytest
from testkit.docker import mark_docker_tests


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_docker_tests(items)


@pytest.fixture
def base_image():
    return "swerl-base:bookworm"


@pytest.fixture
def stack(base_image):
    return ["pool", "node"]


@pytest.fixture
def pool(stack):
    return stack[0]


@pytest.fixture
def settings(tmp_path):
    return {"state_dir": tmp_path}
"""

TESTS = """
import pytest


def test_through_two_fixtures(pool):
    pass


def test_with_the_base_image(base_image):
    pass


@pytest.mark.usefixtures("base_image")
def test_using_the_base_image():
    pass


@pytest.mark.docker
def test_marked_by_hand():
    pass


def test_with_plain_fixtures(settings, tmp_path):
    pass


def test_without_fixtures():
    pass
"""

MARKED_MODULE = """
import pytest

pytestmark = pytest.mark.docker


def test_in_a_docker_module():
    pass
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeini(
        "[pytest]\n"
        "asyncio_default_fixture_loop_scope = function\n"
        "markers =\n    docker: needs a running dockerd\n"
    )
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_suite=TESTS, test_marked_module=MARKED_MODULE)
    return pytester


def _selected(suite: pytest.Pytester, expression: str) -> set[str]:
    result = suite.runpytest("-m", expression, "--collect-only", "-q", "--strict-markers")
    assert result.ret == 0, result.stdout.str()
    return {line.split("::")[1] for line in result.outlines if "::" in line}


def test_tests_whose_fixtures_need_dockerd_and_marked_ones_are_in_the_docker_lane(suite):
    assert _selected(suite, "docker") == {
        "test_through_two_fixtures",
        "test_with_the_base_image",
        "test_using_the_base_image",
        "test_marked_by_hand",
        "test_in_a_docker_module",
    }


def test_tests_that_need_no_dockerd_are_the_not_docker_lane(suite):
    assert _selected(suite, "not docker") == {"test_with_plain_fixtures", "test_without_fixtures"}
