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


@pytest.fixture(scope="session")
def harness_bundle_dir():
    """A harness bundle directory holding the default claude-code bundle (swerl.exec.bundles),
    built once and kept between runs (SWERL_EXEC_HARNESS_BUNDLE_DIR, default the local stack's
    ~/.cache/swerl-bundles): the Node wheel and the npm package are downloaded on the first run
    only."""
    from swerl.exec.bundles import HARNESS_PACKAGES, HarnessBundles
    from swerl.stack import local_bundle_dir

    root = local_bundle_dir()
    package = HARNESS_PACKAGES["claude-code"]
    HarnessBundles(root).build_blocking(package, package.default_version)
    return root
