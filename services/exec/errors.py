"""Failures of the exec node, each with one gRPC code and one ErrorInfo reason."""

from __future__ import annotations

from swerl.chassis.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)


class SandboxNotFound(NotFound):
    reason = "SANDBOX_NOT_FOUND"


class ImageNotPresent(FailedPrecondition):
    reason = "IMAGE_NOT_PRESENT"


class InvalidImageReference(InvalidArgument):
    reason = "INVALID_IMAGE_REFERENCE"


class NodeAtCapacity(ResourceExhausted):
    reason = "NODE_AT_CAPACITY"


class InvalidSandboxSpec(InvalidArgument):
    reason = "INVALID_SANDBOX_SPEC"


class ExecStartRequired(InvalidArgument):
    reason = "EXEC_START_REQUIRED"


class EmptyCommand(InvalidArgument):
    reason = "EMPTY_COMMAND"


class InvalidCommand(InvalidArgument):
    reason = "INVALID_COMMAND"


class CwdNotFound(FailedPrecondition):
    """A command's cwd is not a directory it can enter in the sandbox."""

    reason = "CWD_NOT_FOUND"


class StdinNotOpen(FailedPrecondition):
    reason = "STDIN_NOT_OPEN"


class SandboxNotRunning(FailedPrecondition):
    """The sandbox's container stopped and cannot be started again (it dies again right after a
    start, or Docker refuses to start it)."""

    reason = "SANDBOX_NOT_RUNNING"


class SandboxContainerRemoved(FailedPrecondition):
    """The sandbox's container was removed behind the node's back: nothing to start again."""

    reason = "SANDBOX_CONTAINER_REMOVED"


class SandboxStopped(Unavailable):
    """The sandbox's container was stopped by Docker (`docker stop`/`kill`/`restart`, or a
    dockerd stopping or restarting) while a command ran: the command was lost with it, so its
    call fails with this instead of an exit status. The next command starts the container
    again."""

    reason = "SANDBOX_STOPPED"


class NotAGitRepository(FailedPrecondition):
    reason = "NOT_A_GIT_REPOSITORY"


class UnknownBaseRef(FailedPrecondition):
    reason = "UNKNOWN_BASE_REF"


class DiffTooLarge(FailedPrecondition):
    reason = "DIFF_TOO_LARGE"


class DockerUnavailable(Unavailable):
    reason = "DOCKER_UNAVAILABLE"


class ShellUnavailable(Unavailable):
    """The in-container shell could not be started (e.g. the image has no bash)."""

    reason = "SHELL_UNAVAILABLE"


class SandboxBusy(FailedPrecondition):
    """A fork or checkpoint of a sandbox while one of its commands runs or waits."""

    reason = "SANDBOX_BUSY"


class CheckpointNotFound(NotFound):
    reason = "CHECKPOINT_NOT_FOUND"


class UnknownHarnessBundle(InvalidArgument):
    """OpenHarness names a harness this node has no bundle recipe for."""

    reason = "UNKNOWN_HARNESS_BUNDLE"


class InvalidHarnessVersion(InvalidArgument):
    reason = "INVALID_HARNESS_VERSION"


class BundleBuildFailed(Unavailable):
    """The node could not build a harness bundle (its package registries unreachable, the
    package without the expected executable)."""

    reason = "BUNDLE_BUILD_FAILED"


class InvalidGatewayUrl(InvalidArgument):
    reason = "INVALID_GATEWAY_URL"
