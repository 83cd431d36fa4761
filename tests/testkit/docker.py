"""Which tests need dockerd: the `docker` marker, set from each test's fixtures.

tests/conftest.py calls `mark_docker_tests` on the collected items, so `pytest -m "not docker"`
runs what needs no dockerd (the inner loop) and `-m docker` the rest. A test is marked when its
fixture closure holds a fixture of DOCKER_FIXTURES, or when it (or its module, `pytestmark`)
carries the marker itself: a test that talks to dockerd without such a fixture says so.

A new fixture that talks to dockerd depends on `base_image` (which fails when dockerd or the
base image is missing) or is named here.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

DOCKER = "docker"

# Fixtures that reach dockerd themselves; every fixture built on one of them (exec nodes, stacks,
# clusters, registries' images, faces, evaluation nodes, ...) is in a test's closure with it.
DOCKER_FIXTURES = frozenset(
    {
        # the base image on a ready dockerd, and the bundled tasks' images built on it
        "base_image",
        # tests/web: real episodes on a local stack, and the images they lease
        "real_run",
        # tests/evaluation/test_eval_end_to_end.py: the bundled task images (module, autouse)
        "task_images",
        # tests/images/test_images.py: an exec node on the local dockerd
        "node",
        # tests/tasks/test_tasks.py: an image name removed from dockerd afterwards
        "scratch_image_name",
        # tests/exec/test_forks.py: removes the fork images a failed test left (autouse)
        "_no_fork_image_outlives_a_test",
    }
)


def needs_docker(item: pytest.Item) -> bool:
    """Whether the test is marked `docker` or one of its fixtures needs dockerd."""
    if item.get_closest_marker(DOCKER) is not None:
        return True
    return not DOCKER_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))


def mark_docker_tests(items: Iterable[pytest.Item]) -> None:
    """Adds the `docker` marker to every item that needs dockerd and lacks it."""
    for item in items:
        if item.get_closest_marker(DOCKER) is None and needs_docker(item):
            item.add_marker(pytest.mark.docker)
