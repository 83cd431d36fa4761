"""Domain errors: one class per failure, each mapped to exactly one gRPC code and one reason.

Domain modules raise these and import no grpc; the boundary interceptor turns them into a gRPC
status carrying a `google.rpc.ErrorInfo{reason, domain, metadata}` detail. `code` is the *name* of
a `grpc.StatusCode` member so this module stays free of grpc imports.
"""

from __future__ import annotations

from typing import ClassVar

ERROR_DOMAIN = "swerl.dev"

# Names of the grpc.StatusCode members a domain error may map to (OK is not an error).
STATUS_CODE_NAMES = frozenset(
    {
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    }
)


class SwerlError(Exception):
    """Base of all domain errors. Subclasses set `code` and `reason`; instances add a message."""

    code: ClassVar[str] = "INTERNAL"
    reason: ClassVar[str] = "INTERNAL"

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        # A typo in `code` would otherwise only surface when the boundary maps the error.
        if cls.code not in STATUS_CODE_NAMES:
            raise TypeError(f"{cls.__name__}.code={cls.code!r} is not a grpc.StatusCode name")

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


class MissingToken(Unauthenticated):
    """The call carried no `authorization: Bearer <token>` metadata."""

    reason = "MISSING_TOKEN"


class InvalidToken(Unauthenticated):
    """The bearer token is malformed or not the server's token."""

    reason = "INVALID_TOKEN"


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


class StartupRefused(Exception):
    """A service will not start: its settings name something this host lacks (a runtime's
    socket, an isolation class the runtime does not offer). Never an RPC's error (so no status
    and no reason): `swerl <service> serve` prints it as one line and exits 2."""
