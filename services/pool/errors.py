"""Failures of the pool, each with one gRPC code and one ErrorInfo reason."""

from __future__ import annotations

from swerl.chassis.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SwerlError,
    Unavailable,
)


class PoolAtCapacity(ResourceExhausted):
    """No capacity freed up within the request's wait; carries a RetryInfo."""

    reason = "POOL_AT_CAPACITY"

    def __init__(self, message: str, *, retry_delay_s: float, **metadata: object) -> None:
        super().__init__(message, retry_after_s=f"{retry_delay_s:g}", **metadata)
        self.retry_delay_s = retry_delay_s


class ImageNotPresent(FailedPrecondition):
    """No healthy node that could host the lease has the image, and the pool does not pull
    (`--no-pull`)."""

    reason = "IMAGE_NOT_PRESENT"


# A pull the pool asked a node for failed; every lease waiting on it gets the node's reason.
class ImageNotFound(NotFound):
    """The registry does not have the image (or the name is wrong)."""

    reason = "IMAGE_NOT_FOUND"


class RegistryUnreachable(Unavailable):
    """The node could not reach the registry. Carries a RetryInfo: the pool starts no new pull
    from that registry before then."""

    reason = "REGISTRY_UNREACHABLE"

    def __init__(self, message: str, *, retry_delay_s: float, **metadata: object) -> None:
        super().__init__(message, retry_after_s=f"{retry_delay_s:g}", **metadata)
        self.retry_delay_s = retry_delay_s


class RegistryAuth(FailedPrecondition):
    """The registry refused the node's credentials (or the node has none for it)."""

    reason = "REGISTRY_AUTH"


class ImageTooLarge(FailedPrecondition):
    """The image is larger than the node's whole image budget: no eviction makes room."""

    reason = "IMAGE_TOO_LARGE"


class PullFailed(Unavailable):
    """The pull broke off for another reason (disk, a cut connection) after the pool's
    attempts; carries a RetryInfo."""

    reason = "PULL_FAILED"

    def __init__(self, message: str, *, retry_delay_s: float, **metadata: object) -> None:
        super().__init__(message, retry_after_s=f"{retry_delay_s:g}", **metadata)
        self.retry_delay_s = retry_delay_s


class ImagePulling(DeadlineExceeded):
    """The request's wait ran out while its image was still being pulled. The pull goes on, so
    a retry (after the RetryInfo delay) usually finds the image in place."""

    reason = "IMAGE_PULLING"

    def __init__(self, message: str, *, retry_delay_s: float, **metadata: object) -> None:
        super().__init__(message, retry_after_s=f"{retry_delay_s:g}", **metadata)
        self.retry_delay_s = retry_delay_s


def pull_error(reason: str, message: str, *, image: str, retry_delay_s: float) -> SwerlError:
    """The error a lease waiting on a failed pull gets, from the node's ImagePullResult.reason
    (an unknown reason is PULL_FAILED; a bad reference is the request's fault)."""
    if reason == "IMAGE_NOT_FOUND":
        return ImageNotFound(message, image=image)
    if reason == "REGISTRY_AUTH":
        return RegistryAuth(message, image=image)
    if reason == "IMAGE_TOO_LARGE":
        return ImageTooLarge(message, image=image)
    if reason == "REGISTRY_UNREACHABLE":
        return RegistryUnreachable(message, image=image, retry_delay_s=retry_delay_s)
    if reason == "INVALID_IMAGE_REFERENCE":
        return InvalidLeaseRequest(message, image=image, node_reason=reason)
    return PullFailed(message, image=image, retry_delay_s=retry_delay_s)


class InvalidLeaseRequest(InvalidArgument):
    reason = "INVALID_LEASE_REQUEST"


class LeaseNotFound(NotFound):
    reason = "LEASE_NOT_FOUND"


class NodeNotFound(NotFound):
    reason = "NODE_NOT_FOUND"


class InvalidNode(InvalidArgument):
    reason = "INVALID_NODE"


class NodeUnreachable(Unavailable):
    """An exec node did not answer (down, restarting, network)."""

    reason = "NODE_UNREACHABLE"


class NodeIdMismatch(FailedPrecondition):
    reason = "NODE_ID_MISMATCH"


class LeaseCancelled(FailedPrecondition):
    """The lease was released (or revoked) while its AcquireLease was still waiting."""

    reason = "LEASE_CANCELLED"


class ForkNodeFull(ResourceExhausted):
    """A ForkLease found no room for all its copies on the source's node within its wait."""

    reason = "FORK_NODE_FULL"


class SourceBusy(FailedPrecondition):
    """A ForkLease while a command runs on the source lease's sandbox."""

    reason = "SANDBOX_BUSY"


# What a node call can fail with, as the pool's domain sees it (raised by NodeConnection).
class NodeImageMissing(Exception):
    """The node reports IMAGE_NOT_PRESENT."""


class NodeFull(Exception):
    """The node reports NODE_AT_CAPACITY."""


class NodeSandboxGone(Exception):
    """The node reports SANDBOX_NOT_FOUND."""


class NodeRejected(Exception):
    """The node refused the call for another reason (bad spec, auth); not worth a retry."""

    def __init__(self, message: str, *, code: str, reason: str | None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
