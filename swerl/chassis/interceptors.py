"""The one boundary interceptor of every swerl gRPC server.

For each call it: takes or makes the request id and binds it (and the method) to the log context;
checks the bearer token; turns a raised `SwerlError` into its status code with a
`google.rpc.ErrorInfo` detail, and any other exception into a bare INTERNAL; sends the request id
back as trailing metadata; writes one canonical `rpc` log line; and updates the RPC metrics.
Servicers therefore contain no try/except, logging or auth code.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import grpc
import structlog
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from swerl.chassis import metrics
from swerl.chassis.errors import ERROR_DOMAIN, InvalidToken, MissingToken, SwerlError

REQUEST_ID_METADATA_KEY = "x-request-id"
AUTHORIZATION_METADATA_KEY = "authorization"
HEALTH_SERVICE = "grpc.health.v1.Health"
# Health must answer probes (kubelet, the pool's node watch) that hold no token. Reflection is
# deliberately not exempt: it describes the whole API surface.
AUTH_EXEMPT_SERVICES = frozenset({HEALTH_SERVICE})

_MAX_REQUEST_ID_LENGTH = 128
_SERVER_FAULT_CODES = frozenset({"INTERNAL", "UNKNOWN", "DATA_LOSS"})

_request_id: ContextVar[str | None] = ContextVar("swerl_request_id", default=None)
_log = structlog.get_logger("swerl.rpc")


def current_request_id() -> str | None:
    """The request id of the RPC being handled in this task, or None outside one."""
    return _request_id.get()


def new_request_id() -> str:
    return uuid.uuid4().hex


@contextlib.contextmanager
def bound_request_id(request_id: str, **log_context: Any) -> Iterator[str]:
    """Binds `request_id` for `current_request_id()`, outgoing chassis calls and log lines.

    The boundary does this for every RPC; use it for work no RPC started (a background loop).
    """
    token = _request_id.set(request_id)
    try:
        with structlog.contextvars.bound_contextvars(request_id=request_id, **log_context):
            yield request_id
    finally:
        _request_id.reset(token)


class BoundaryInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every method handler, whatever its cardinality, in the swerl call boundary."""

    def __init__(self, *, auth_token: str | None) -> None:
        # None disables auth: the server was started insecure.
        self._token = auth_token.encode() if auth_token is not None else None

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:  # Unknown method: gRPC answers UNIMPLEMENTED itself.
            return None
        method: str = handler_call_details.method
        metadata = dict(handler_call_details.invocation_metadata or ())
        # intercept_service runs once per call, so this boundary belongs to this call alone.
        return _wrap_handler(handler, _Boundary(self._token, method, metadata))


def _wrap_handler(
    handler: grpc.RpcMethodHandler[Any, Any], boundary: _Boundary
) -> grpc.RpcMethodHandler[Any, Any]:
    """Rebuilds `handler` (any cardinality) with its behaviour running inside `boundary`."""
    # The behaviour of an aio handler is an async callable; grpc's stubs type it as the sync one.
    behavior: Callable[..., Any]
    factory: Callable[..., grpc.RpcMethodHandler[Any, Any]]
    if handler.request_streaming and handler.response_streaming:
        behavior, factory = _behavior(handler.stream_stream), grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        behavior, factory = _behavior(handler.stream_unary), grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        behavior, factory = _behavior(handler.unary_stream), grpc.unary_stream_rpc_method_handler
    else:
        behavior, factory = _behavior(handler.unary_unary), grpc.unary_unary_rpc_method_handler

    if handler.response_streaming:

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> None:
            await boundary.run(context, lambda: _write_responses(behavior, request, context))

        wrapped: Callable[..., Any] = streaming
    else:

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await boundary.run(context, lambda: _maybe_await(behavior(request, context)))

        wrapped = unary
    return factory(
        wrapped,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _behavior(behavior: Callable[..., Any] | None) -> Callable[..., Any]:
    if behavior is None:  # grpc sets exactly the attribute of the handler's own cardinality
        raise TypeError("method handler without a behaviour for its cardinality")
    return behavior


async def _maybe_await(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


async def _write_responses(
    behavior: Callable[..., Any], request: Any, context: grpc.aio.ServicerContext
) -> None:
    # The wrapper writes responses itself instead of being an async generator: a generator
    # left suspended at `yield` when the client cancels would run its cleanup (log line,
    # metrics, context reset) later, from another task. Here cancellation lands in this task.
    result = behavior(request, context)
    if inspect.isasyncgen(result):
        async with contextlib.aclosing(result) as responses:
            async for response in responses:
                await context.write(response)
    elif inspect.isawaitable(result):  # Handler uses context.write itself (e.g. Health.Watch).
        await result
    elif result is not None:  # Plain generator.
        for response in result:
            await context.write(response)


class _Boundary:
    """One call's boundary: request id, auth, error mapping, log line and metrics."""

    def __init__(self, token: bytes | None, method: str, metadata: Mapping[str, Any]) -> None:
        self._token = token
        self._method = method
        self._metadata = metadata
        self._service = method.lstrip("/").partition("/")[0]
        self._request_id = _valid_request_id(metadata.get(REQUEST_ID_METADATA_KEY))

    async def run(
        self, context: grpc.aio.ServicerContext, invoke: Callable[[], Awaitable[Any]]
    ) -> Any:
        with bound_request_id(self._request_id, method=self._method):
            context.set_trailing_metadata(((REQUEST_ID_METADATA_KEY, self._request_id),))
            return await self._guarded(context, invoke)

    async def _guarded(
        self, context: grpc.aio.ServicerContext, invoke: Callable[[], Awaitable[Any]]
    ) -> Any:
        request_id = self._request_id
        started = time.perf_counter()
        metrics.RPC_IN_FLIGHT.labels(self._method).inc()
        code, reason, failure = "OK", None, None
        try:
            if self._token is not None and self._service not in AUTH_EXEMPT_SERVICES:
                self._authenticate()
            result = await invoke()
            code = _code_name(context.code())
            return result
        except SwerlError as err:
            code, reason = err.code, err.reason
            status = _status_of(err)
            await context.abort(
                status.code,
                status.details,
                (*status.trailing_metadata, (REQUEST_ID_METADATA_KEY, request_id)),
            )
        except grpc.aio.AbortError:  # The handler (e.g. Health.Check) aborted itself.
            code = _code_name(context.code())
            raise
        except asyncio.CancelledError:  # The client cancelled or went away.
            code = "CANCELLED"
            raise
        except NotImplementedError:  # The generated servicer base class's stubs raise it.
            code = "UNIMPLEMENTED"
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                "method not implemented",
                ((REQUEST_ID_METADATA_KEY, request_id),),
            )
        except Exception as err:
            code, failure = "INTERNAL", err
            # The message names only the request id: internals stay in the log line.
            await context.abort(
                grpc.StatusCode.INTERNAL,
                f"internal error (request id {request_id})",
                ((REQUEST_ID_METADATA_KEY, request_id),),
            )
        finally:
            duration_s = time.perf_counter() - started
            metrics.RPC_IN_FLIGHT.labels(self._method).dec()
            metrics.RPC_REQUESTS.labels(self._method, code).inc()
            metrics.RPC_DURATION.labels(self._method).observe(duration_s)
            self._log_line(context, code, reason, failure, duration_s)

    def _authenticate(self) -> None:
        assert self._token is not None
        header = self._metadata.get(AUTHORIZATION_METADATA_KEY)
        if not header:
            raise MissingToken("the call needs 'authorization: Bearer <token>' metadata")
        scheme, _, presented = str(header).partition(" ")
        # compare_digest keeps the comparison time independent of where the tokens differ.
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            presented.strip().encode(), self._token
        ):
            raise InvalidToken("the bearer token is not valid for this server")

    def _log_line(
        self,
        context: grpc.aio.ServicerContext,
        code: str,
        reason: str | None,
        failure: BaseException | None,
        duration_s: float,
    ) -> None:
        fields: dict[str, Any] = {
            "method": self._method,
            "code": code,
            "duration_ms": round(duration_s * 1000, 3),
            "peer": context.peer(),
            "request_id": self._request_id,
        }
        if reason is not None:
            fields["reason"] = reason
        if failure is not None:
            _log.error("rpc", exc_info=failure, **fields)
        elif code in _SERVER_FAULT_CODES:
            _log.error("rpc", **fields)
        elif self._service == HEALTH_SERVICE and code == "OK":
            # Probes arrive every few seconds; at info they would drown the real traffic.
            _log.debug("rpc", **fields)
        else:
            _log.info("rpc", **fields)


def _valid_request_id(value: object) -> str:
    # A caller's id is kept only if it is safe to echo into logs and metadata.
    if (
        isinstance(value, str)
        and 0 < len(value) <= _MAX_REQUEST_ID_LENGTH
        and value.isascii()
        and value.isprintable()
    ):
        return value
    return new_request_id()


def _code_name(code: object) -> str:
    if code is None:
        return "OK"
    if isinstance(code, grpc.StatusCode):
        return code.name
    return str(code)


def _status_of(err: SwerlError) -> grpc.Status:
    info = error_details_pb2.ErrorInfo(
        reason=err.reason, domain=ERROR_DOMAIN, metadata=err.metadata
    )
    detail = any_pb2.Any()
    detail.Pack(info)
    details = [detail]
    # An error that knows when trying again makes sense (a full pool) says so in a RetryInfo.
    retry_delay_s = getattr(err, "retry_delay_s", None)
    if retry_delay_s is not None:
        retry_info = error_details_pb2.RetryInfo()
        retry_info.retry_delay.FromNanoseconds(int(retry_delay_s * 1e9))
        details.append(any_pb2.Any())
        details[-1].Pack(retry_info)
    code = grpc.StatusCode[err.code]
    return rpc_status.to_status(
        status_pb2.Status(code=code.value[0], message=err.message, details=details)
    )
