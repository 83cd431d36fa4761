"""Failures of gateway calls (answered in each protocol's own error shape) and of the session
RPCs (gRPC status and ErrorInfo reason through the chassis boundary)."""

from __future__ import annotations

from typing import ClassVar

from swerl.chassis.errors import InvalidArgument, SwerlError

# -- HTTP calls ----------------------------------------------------------------------------------


class GatewayError(Exception):
    """One failed gateway call: an HTTP status and a machine-readable kind.

    `kind` picks the protocol's wording (see openai_api.error_body / anthropic_api.error_body);
    `param` names the offending request field where there is one.
    """

    status: ClassVar[int] = 400
    kind: ClassVar[str] = "invalid_request"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class MalformedRequest(GatewayError):
    """Bad JSON, a missing or ill-typed field, an unknown role, content the model cannot take."""


class ContextTooLong(GatewayError):
    """The rendered prompt reaches the session's context budget. `at_least`: the prompt was
    refused on its size before tokenizing, and `prompt_tokens` is a lower bound."""

    kind = "context_length_exceeded"

    def __init__(self, prompt_tokens: int, budget: int, *, at_least: bool = False) -> None:
        count = f"at least {prompt_tokens}" if at_least else str(prompt_tokens)
        super().__init__(
            f"prompt is too long: {count} tokens >= {budget} maximum (this model's"
            f" maximum context length is {budget} tokens, your messages resulted in"
            f" {count} tokens)",
            param="messages",
        )
        self.prompt_tokens = prompt_tokens
        self.budget = budget


class EngineRefusedContext(GatewayError):
    """The engine itself refused the prompt as over its context length (its 400), although it
    fit the session's budget: the same limit the client can act on, in the protocol's words,
    with the engine's own message."""

    kind = "context_length_exceeded"

    def __init__(self, prompt_tokens: int, engine_message: str) -> None:
        super().__init__(
            f"the model's engine refused the prompt ({prompt_tokens} tokens) as over its"
            f" context length: {engine_message}",
            param="messages",
        )
        self.prompt_tokens = prompt_tokens


class BodyTooLarge(GatewayError):
    """The request body is over the gateway's maximum size (refused before it is read)."""

    status = 413
    kind = "request_too_large"

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(
            f"the request body exceeds the gateway's maximum of {limit_bytes} bytes",
            param="body",
        )


class BadSecret(GatewayError):
    status = 401
    kind = "authentication"


class SessionMissing(GatewayError):
    """Unknown session id, or a session that has ended."""

    status = 404
    kind = "not_found"


class RouteMissing(GatewayError):
    status = 404
    kind = "not_found"


class SessionAborted(GatewayError):
    """The trainer aborted the session: this and every later call fail (not retried by the
    SDKs: 410 is none of their retried statuses)."""

    status = 410
    kind = "aborted"


class PolicyDown(GatewayError):
    """The policy server could not be reached or failed (infra): retry later."""

    status = 503
    kind = "unavailable"
    retry_after_s: ClassVar[int] = 1


# -- session RPCs --------------------------------------------------------------------------------


class InvalidSessionSpec(InvalidArgument):
    reason = "INVALID_SESSION_SPEC"


class SessionNotFound(SwerlError):
    code = "NOT_FOUND"
    reason = "SESSION_NOT_FOUND"


class SessionClosed(SwerlError):
    code = "FAILED_PRECONDITION"
    reason = "SESSION_CLOSED"


class GatewayDisabled(SwerlError):
    code = "FAILED_PRECONDITION"
    reason = "GATEWAY_DISABLED"


class GatewayAtCapacity(SwerlError):
    code = "RESOURCE_EXHAUSTED"
    reason = "GATEWAY_AT_CAPACITY"
