"""Fixtures shared by every test: real dockerd, the base image, real gRPC servers on port 0."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

BASE_IMAGE = os.environ.get("SWERL_BASE_IMAGE", "swerl-base:bookworm")


def _docker_ready() -> str | None:
    if shutil.which("docker") is None:
        return "docker CLI not installed (run deploy/docker-up.sh)"
    probe = subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True)
    if probe.returncode != 0:
        return f"dockerd or {BASE_IMAGE} missing (run deploy/docker-up.sh)"
    return None


@pytest.fixture(scope="session")
def base_image() -> str:
    problem = _docker_ready()
    if problem:
        # CI runs deploy/docker-up.sh first; a missing Docker there is a failure, not a skip.
        pytest.fail(problem)
    return BASE_IMAGE
