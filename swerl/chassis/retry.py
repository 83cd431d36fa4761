"""The one retry policy of swerl clients, for idempotent calls only.

Idempotent means a read, or a write carrying a `request_id` the server deduplicates. Only
UNAVAILABLE (the server or the network is down or restarting) and reasons listed here are
retried; RESOURCE_EXHAUSTED is not retried wholesale because gRPC also uses it for oversized
messages. Each attempt still needs its own deadline (`timeout=` on the call).

    @idempotent_retry()
    async def get_sandbox(stub, sandbox_id): ...

    async for attempt in async_retrying():
        with attempt:
            response = await stub.GetSandbox(request, timeout=10)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import grpc
import structlog
import tenacity

from swerl.chassis.client import error_info

# Reasons we own whose failure a later attempt can cure.
RETRYABLE_REASONS: frozenset[str] = frozenset(
    {
        "NODE_AT_CAPACITY",  # A sandbox on the node is destroyed or reaped sooner or later.
    }
)

_log = structlog.get_logger("swerl.retry")
F = TypeVar("F", bound=Callable[..., Any])


def is_retryable(exc: BaseException, reasons: Iterable[str] = RETRYABLE_REASONS) -> bool:
    """True for UNAVAILABLE and for failures whose ErrorInfo reason is in `reasons`."""
    if not isinstance(exc, grpc.RpcError) or not hasattr(exc, "code"):
        return False
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        return True
    reason, _ = error_info(exc)
    return reason is not None and reason in set(reasons)


def async_retrying(
    *,
    max_attempts: int = 5,
    max_delay_s: float = 30.0,
    initial_wait_s: float = 0.2,
    max_wait_s: float = 5.0,
    reasons: Iterable[str] = RETRYABLE_REASONS,
    retry_on: Callable[[BaseException], bool] | None = None,
) -> tenacity.AsyncRetrying:
    """An `AsyncRetrying` applying the policy; the last failure is re-raised as is.

    `retry_on` replaces the gRPC predicate for calls that are not gRPC (e.g. HTTP to a model
    server: retry only connection errors); waits and stops stay the policy's.
    """
    policy = _policy(max_attempts, max_delay_s, initial_wait_s, max_wait_s, reasons, retry_on)
    return tenacity.AsyncRetrying(**policy)


def idempotent_retry(
    *,
    max_attempts: int = 5,
    max_delay_s: float = 30.0,
    initial_wait_s: float = 0.2,
    max_wait_s: float = 5.0,
    reasons: Iterable[str] = RETRYABLE_REASONS,
) -> Callable[[F], F]:
    """Decorator applying the policy to a sync or async function."""
    policy = _policy(max_attempts, max_delay_s, initial_wait_s, max_wait_s, reasons)
    return tenacity.retry(**policy)


def _policy(
    max_attempts: int,
    max_delay_s: float,
    initial_wait_s: float,
    max_wait_s: float,
    reasons: Iterable[str],
    retry_on: Callable[[BaseException], bool] | None = None,
) -> dict[str, Any]:
    predicate = retry_on or functools.partial(is_retryable, reasons=frozenset(reasons))
    return {
        "retry": tenacity.retry_if_exception(predicate),
        # Jitter spreads the retries of many clients that failed together (a node restart). No
        # wait runs past max_delay_s: the last one is cut to end there, so the window is tried
        # to its end and a call given 2 s ends at 2 s plus its last attempt, not after a whole
        # backoff begun at 1.9 s.
        "wait": _until(max_delay_s, _exponential_jitter(initial_wait_s, max_wait_s)),
        "stop": tenacity.stop_after_attempt(max_attempts) | tenacity.stop_after_delay(max_delay_s),
        "reraise": True,
        "before_sleep": _log_retry,
    }


def _until(
    max_delay_s: float, wait: Callable[[tenacity.RetryCallState], float]
) -> Callable[[tenacity.RetryCallState], float]:
    """`wait`, cut to what is left of the first `max_delay_s` seconds since the first attempt."""

    def cut(state: tenacity.RetryCallState) -> float:
        left = max_delay_s - (state.seconds_since_start or 0.0)
        return max(0.0, min(wait(state), left))

    return cut


def _exponential_jitter(initial_s: float, max_s: float) -> tenacity.wait.wait_base:
    # tenacity 9.1 renamed `initial` to `multiplier` (the old name now warns); 8.x has `initial`.
    parameters = inspect.signature(tenacity.wait_exponential_jitter).parameters
    scale = "multiplier" if "multiplier" in parameters else "initial"
    return tenacity.wait_exponential_jitter(**{scale: initial_s}, max=max_s, jitter=initial_s)


def _log_retry(state: tenacity.RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    code = exc.code().name if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") else None
    _log.warning(
        "rpc.retry",
        attempt=state.attempt_number,
        code=code,
        reason=error_info(exc)[0] if isinstance(exc, grpc.RpcError) else None,
        # What failed, when it is no gRPC status (an HTTP call's error or status).
        error=None if code or exc is None else f"{type(exc).__name__}: {exc}"[:200],
        wait_s=round(state.next_action.sleep, 3) if state.next_action else None,
        target=getattr(state.fn, "__qualname__", None),
    )
