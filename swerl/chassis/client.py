"""Client side of the chassis: channels to swerl servers, and reading the ErrorInfo of a failure.

`make_channel` gives an aio channel whose every call carries the bearer token and a request id
(the current RPC's when a server calls another server, so one id follows a request across
services). `error_info` is how callers, and tests, branch on a failure's `ErrorInfo.reason`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeAlias, cast

import grpc
from google.rpc import error_details_pb2, status_pb2

from swerl.chassis.interceptors import (
    AUTHORIZATION_METADATA_KEY,
    REQUEST_ID_METADATA_KEY,
    current_request_id,
    new_request_id,
)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_STATUS_DETAILS_METADATA_KEY = "grpc-status-details-bin"

_Details: TypeAlias = grpc.aio.ClientCallDetails
_Continuation: TypeAlias = Callable[[_Details, Any], Awaitable[Any]]

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Pings find a dead peer behind a silent stream (a long Exec, a health Watch) within ~40 s.
    # Servers accept a ping per second without data (see server.SERVER_OPTIONS); keep them in
    # step.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)


def make_channel(
    address: str,
    *,
    token: str | None = None,
    tls_ca_file: Path | str | None = None,
    tls_client_cert_file: Path | str | None = None,
    tls_client_key_file: Path | str | None = None,
    request_id_provider: Callable[[], str | None] | None = None,
    metadata_provider: Callable[[], Sequence[tuple[str, str]]] | None = None,
    extra_options: Sequence[tuple[str, Any]] = (),
) -> grpc.aio.Channel:
    """Opens an aio channel to a swerl server at `address` ("host:port").

    TLS is used when `tls_ca_file` is given (the CA that signed the server's certificate); a
    client certificate and key are added for servers that require client auth. Request ids come
    from `request_id_provider`, else the RPC being handled, else a fresh id per call.
    """
    interceptors = [
        cls(token, request_id_provider, metadata_provider)
        for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)
    ]
    # One value per option, `extra_options` winning: gRPC does not promise which of two wins.
    extra_names = {name for name, _ in extra_options}
    options = (*(o for o in CHANNEL_OPTIONS if o[0] not in extra_names), *extra_options)
    if tls_ca_file is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(tls_ca_file).read_bytes(),
        private_key=Path(tls_client_key_file).read_bytes() if tls_client_key_file else None,
        certificate_chain=Path(tls_client_cert_file).read_bytes() if tls_client_cert_file else None,
    )
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


def error_info(err: grpc.RpcError) -> tuple[str | None, dict[str, str]]:
    """The `ErrorInfo` reason and metadata of a failed call; `(None, {})` when it has none.

    Works for `grpc.aio.AioRpcError` and the sync stack's `grpc.RpcError` alike.
    """
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in cast("Iterable[tuple[str, Any]]", trailing or ()):
        if key != _STATUS_DETAILS_METADATA_KEY:
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                return info.reason, dict(info.metadata)
    return None, {}


def trailing_request_id(metadata: Any) -> str | None:
    """The `x-request-id` a swerl server sent back, from a call's trailing metadata."""
    for key, value in metadata or ():
        if key == REQUEST_ID_METADATA_KEY:
            return str(value)
    return None


class _MetadataAdder:
    """Adds `authorization` and `x-request-id` metadata to a call's details."""

    def __init__(
        self,
        token: str | None,
        request_id_provider: Callable[[], str | None] | None,
        metadata_provider: Callable[[], Sequence[tuple[str, str]]] | None = None,
    ) -> None:
        self._authorization = f"Bearer {token}" if token else None
        self._request_id_provider = request_id_provider or current_request_id
        # Per-call extra metadata (e.g. a lease's current capability token).
        self._metadata_provider = metadata_provider

    def _details(self, details: _Details) -> _Details:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        if self._authorization and AUTHORIZATION_METADATA_KEY not in metadata:
            metadata[AUTHORIZATION_METADATA_KEY] = self._authorization
        if REQUEST_ID_METADATA_KEY not in metadata:
            metadata[REQUEST_ID_METADATA_KEY] = self._request_id_provider() or new_request_id()
        if self._metadata_provider is not None:
            for key, value in self._metadata_provider():
                if key not in metadata:
                    metadata[key] = value
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


# grpc.aio files each channel interceptor under the FIRST cardinality it implements, so one class
# implementing all four would only ever see unary-unary calls: one class per cardinality.
class _UnaryUnary(_MetadataAdder, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: _Continuation, client_call_details: _Details, request: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_MetadataAdder, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: _Continuation, client_call_details: _Details, request: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request)


class _StreamUnary(_MetadataAdder, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self, continuation: _Continuation, client_call_details: _Details, request_iterator: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStream(_MetadataAdder, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self, continuation: _Continuation, client_call_details: _Details, request_iterator: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)
