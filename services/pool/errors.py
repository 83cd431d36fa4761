"""Failures of the pool, each with one gRPC code and one ErrorInfo reason."""

from __future__ import annotations

from swerl.chassis.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)


class PoolAtCapacity(ResourceExhausted):
    """No capacity freed up within the request's wait; carries a RetryInfo."""

    reason = "POOL_AT_CAPACITY"

    def __init__(self, message: str, *, retry_delay_s: float, **metadata: object) -> None:
        super().__init__(message, retry_after_s=f"{retry_delay_s:g}", **metadata)
        self.retry_delay_s = retry_delay_s


class ImageNotPresent(FailedPrecondition):
    """No healthy node that could host the lease has the image (the pool never pulls)."""

    reason = "IMAGE_NOT_PRESENT"


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
