"""Fixtures of the agent tests (their helpers are testkit.agent and testkit.gateway)."""

import subprocess

import pytest


@pytest.fixture(scope="session", autouse=True)
def _no_sandboxes_of_an_earlier_run(request: pytest.FixtureRequest):
    """Removes the sandboxes an earlier, killed run of these tests left on this dockerd (their
    nodes are gone, so no one else would): the tests' no-sandbox-left checks count every
    sandbox of this process's STACK_PURPOSE (one per pytest-xdist worker). One run of the agent
    tests at a time per dockerd and worker name. A run without docker
    tests (`-m "not docker"`) leaves dockerd alone."""
    if not any(item.get_closest_marker("docker") for item in request.session.items):
        return
    from testkit.agent import STACK_PURPOSE, swerl_sandboxes

    try:
        stale = [c for c, node in swerl_sandboxes() if node.startswith(STACK_PURPOSE + "-")]
    except (OSError, subprocess.CalledProcessError):
        return  # no dockerd: the tests that need one say so
    if stale:
        subprocess.run(["docker", "rm", "-f", *stale], capture_output=True)


@pytest.fixture(scope="session")
def vllm_engine():
    """The run's one real vLLM engine (SWERL_VLLM_URL), healthy and warm: testkit.vllm_engine."""
    from testkit.vllm_engine import wait_for_engine

    return wait_for_engine()
