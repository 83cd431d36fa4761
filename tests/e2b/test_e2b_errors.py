"""Bad inputs through the real E2B SDK: each answers in E2B's shape, so the SDK raises what it
raises against the hosted service."""

from __future__ import annotations

import pytest
from e2b import Sandbox
from e2b.exceptions import (
    AuthenticationException,
    SandboxException,
    SandboxNotFoundException,
    SandboxNotRunningException,
    TimeoutException,
)
from testkit.e2b import Face

pytestmark = pytest.mark.docker


def test_an_unknown_sandbox_is_not_found(face: Face):
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info("lse-unknown", **face.opts)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect("lse-unknown", **face.opts)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.set_timeout("lse-unknown", 30, **face.opts)
    assert Sandbox.kill("lse-unknown", **face.opts) is False


def test_a_killed_sandbox_takes_no_more_commands_or_files(face: Face, base_image: str):
    sandbox = Sandbox.create(base_image, timeout=60, **face.opts)
    sandbox.kill()
    assert sandbox.is_running() is False
    with pytest.raises(SandboxNotRunningException, match="was not found"):
        sandbox.commands.run("true")
    with pytest.raises(SandboxNotRunningException, match="was not found"):
        sandbox.files.read("/etc/hostname")


def test_a_wrong_api_key_is_refused(face: Face, base_image: str):
    opts = face.opts | {"api_key": "not-the-key"}
    with pytest.raises(AuthenticationException, match="401"):
        Sandbox.create(base_image, **opts)
    with pytest.raises(AuthenticationException, match="401"):
        Sandbox.list(**opts).next_items()
    face.assert_nothing_left()


def test_a_wrong_access_token_is_refused(face: Face, sandbox: Sandbox):
    # The server's record of the sandbox's envdAccessToken changes under the client.
    face.face.registry.sandboxes[sandbox.sandbox_id].access_token = "another-token"
    with pytest.raises(AuthenticationException):
        sandbox.commands.run("true")
    with pytest.raises(AuthenticationException):
        sandbox.files.write("/tmp/x", "y")
    with pytest.raises(AuthenticationException):
        sandbox.files.list("/tmp")


def test_an_image_that_cannot_be_had_fails_the_create_with_the_pools_reason(face: Face):
    with pytest.raises(SandboxException) as failed:
        # A registry that refuses connections: the pool's pull fails at once.
        Sandbox.create("127.0.0.1:9/absent-image:never", **face.opts)
    message = str(failed.value)
    assert "absent-image" in message
    assert any(
        reason in message
        for reason in ("IMAGE_NOT_FOUND", "REGISTRY_UNREACHABLE", "PULL_FAILED", "REGISTRY_AUTH")
    ), message
    face.assert_nothing_left()


def test_a_command_that_outlives_its_timeout_is_killed(sandbox: Sandbox):
    with pytest.raises(TimeoutException):
        sandbox.commands.run("sleep 30", timeout=1)
    # The next command runs once the timed-out one is gone, its whole group with it.
    assert sandbox.commands.run("pgrep -fx 'sleep 30' || echo none").stdout == "none\n"
    assert sandbox.commands.list() == []


def test_a_2_gb_upload_is_refused(sandbox: Sandbox, tmp_path):
    big = tmp_path / "two-gigabytes.bin"
    with open(big, "wb") as sparse:
        sparse.truncate(2 << 30)
    with open(big, "rb") as data, pytest.raises(SandboxException, match="413"):
        sandbox.files.write("/tmp/big.bin", data)
    assert sandbox.files.exists("/tmp/big.bin") is False


def test_a_full_snapshot_says_swerl_keeps_the_filesystem_only(face: Face, sandbox: Sandbox):
    with pytest.raises(SandboxException, match="filesystem"):
        sandbox.create_snapshot(mode="full")
    assert face.face.registry.snapshots == {}


def test_calls_swerl_does_not_serve_answer_not_implemented_naming_the_call(sandbox: Sandbox):
    with pytest.raises(SandboxException, match="pause is not implemented"):
        sandbox.pause()
    with pytest.raises(SandboxException, match="CreateWatcher is not implemented"):
        sandbox.files.watch_dir("/tmp")


def test_a_template_exists_when_the_face_maps_it_to_an_image(face: Face):
    from e2b import Template

    assert Template.exists("base", **face.opts) is True
    assert Template.exists("never-built-here", **face.opts) is False


def test_a_timeout_above_the_servers_limit_is_refused(face: Face, base_image: str):
    with pytest.raises(SandboxException, match="400"):
        Sandbox.create(base_image, timeout=10**9, **face.opts)
