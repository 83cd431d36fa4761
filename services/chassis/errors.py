"""Domain errors: one class per failure, each mapped to exactly one gRPC code and one reason.

Domain modules raise these and import no grpc; the boundary interceptor turns them into a gRPC
status carrying a `google.rpc.ErrorInfo{reason, domain, metadata}` detail. `code` is the *name* of
a `grpc.StatusCode` member so this module stays free of grpc imports.
"""

from __future__ import annotations

from typing import ClassVar

ERROR_DOMAIN = "swerl.dev"


class SwerlError(Exception):
    """Base of all domain errors. Subclasses set `code` and `reason`; instances add a message."""

    code: ClassVar[str] = "INTERNAL"
    reason: ClassVar[str] = "INTERNAL"

    def __init__(self, message: str, **metadata: object) -> None:
        super().__init__(message)
        self.message = message
        # ErrorInfo.metadata is map<string, string>: stringify once here.
        self.metadata = {k: str(v) for k, v in metadata.items() if v is not None}


class InvalidArgument(SwerlError):
    code = "INVALID_ARGUMENT"
    reason = "INVALID_ARGUMENT"


class Unauthenticated(SwerlError):
    code = "UNAUTHENTICATED"
    reason = "UNAUTHENTICATED"


class PermissionDenied(SwerlError):
    code = "PERMISSION_DENIED"
    reason = "PERMISSION_DENIED"


class NotFound(SwerlError):
    code = "NOT_FOUND"
    reason = "NOT_FOUND"


class FailedPrecondition(SwerlError):
    code = "FAILED_PRECONDITION"
    reason = "FAILED_PRECONDITION"


class ResourceExhausted(SwerlError):
    code = "RESOURCE_EXHAUSTED"
    reason = "RESOURCE_EXHAUSTED"


class Unavailable(SwerlError):
    code = "UNAVAILABLE"
    reason = "UNAVAILABLE"


class DeadlineExceeded(SwerlError):
    code = "DEADLINE_EXCEEDED"
    reason = "DEADLINE_EXCEEDED"


class Aborted(SwerlError):
    code = "ABORTED"
    reason = "ABORTED"


class Internal(SwerlError):
    code = "INTERNAL"
    reason = "INTERNAL"
