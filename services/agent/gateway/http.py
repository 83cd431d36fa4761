"""The gateway's HTTP face (aiohttp): per-session OpenAI and Anthropic routes.

    POST /s/<session>/v1/chat/completions     OpenAI Chat Completions (stream or not)
    POST /s/<session>/v1/messages             Anthropic Messages (stream or not)
    GET  /s/<session>/v1/models[/<model>]     OpenAI models list (the session's model)

Each route checks the session (404 unknown or ended) and its secret (401; `Authorization:
Bearer` or Anthropic's `x-api-key`), reads the body (400 on bad JSON, naming the field), and
answers in its protocol's shapes and errors. The policy's own time is awaited; the JSON of the
request and of the reply is read and written in the CPU pool when it is large. Nothing a client
sends ends the agent: an unexpected failure is a 500 in the protocol's shape.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import Counter, Histogram

from swerl.agent.gateway import anthropic_api, openai_api
from swerl.agent.gateway.errors import (
    BodyTooLarge,
    GatewayError,
    MalformedRequest,
    PolicyDown,
    RouteMissing,
)
from swerl.agent.gateway.incremental import NestedTooDeep
from swerl.agent.gateway.messages import (
    Conversation,
    ConversationReader,
    MessageMemo,
    anthropic_conversation,
    openai_conversation,
)
from swerl.agent.gateway.session import Session, SessionStore

log = structlog.get_logger("swerl.agent.gateway")

GATEWAY_CALLS = Counter(
    "swerl_agent_gateway_calls_total",
    "Gateway calls by protocol and outcome (ok or the error kind)",
    ["protocol", "outcome"],
)
GATEWAY_OVERHEAD = Histogram(
    "swerl_agent_gateway_overhead_seconds",
    "Time of a gateway call not spent waiting for the policy",
    ["protocol"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
)

# Bodies above this many bytes are read in the CPU pool (decoding holds the GIL).
_INLINE_JSON_BYTES = 64 * 1024
# The largest request body the gateway reads; a larger one is 413 in the protocol's shape,
# refused on its Content-Length before a byte of it is read.
MAX_BODY_BYTES = 64 * 1024 * 1024


class _Protocol:
    def __init__(
        self,
        name: str,
        conversation: Callable[[Any, MessageMemo | None], Conversation],
        error_body: Callable[[GatewayError], dict[str, Any]],
        internal_error: Callable[[], dict[str, Any]],
    ) -> None:
        self.name = name
        self.conversation = conversation
        self.error_body = error_body
        self.internal_error = internal_error


OPENAI = _Protocol(
    "openai", openai_conversation, openai_api.error_body, openai_api.internal_error_body
)
ANTHROPIC = _Protocol(
    "anthropic",
    anthropic_conversation,
    anthropic_api.error_body,
    anthropic_api.internal_error_body,
)


def _read(reader: ConversationReader, raw: bytes) -> Conversation:
    try:
        return reader.read(raw)
    except NestedTooDeep as err:
        raise MalformedRequest(str(err), param="body") from err
    except UnicodeEncodeError as err:  # JSON's "\ud800" escape decodes to no UTF-8 text
        raise MalformedRequest(
            f"the request holds a lone surrogate escape ({err.object[err.start : err.end]!a}),"
            " which is not text",
            param="body",
        ) from err
    except ValueError as err:
        raise MalformedRequest(f"the request body is not valid JSON: {err}", param="body") from err


def _secret(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


def _error_response(protocol: _Protocol, error: GatewayError) -> web.Response:
    headers = {}
    if isinstance(error, PolicyDown):
        headers["Retry-After"] = str(error.retry_after_s)
    return web.json_response(protocol.error_body(error), status=error.status, headers=headers)


class GatewayApp:
    """The aiohttp application over a SessionStore."""

    def __init__(self, store: SessionStore, executor: Executor | None = None) -> None:
        self.store = store
        self._executor = executor
        self.app = web.Application(client_max_size=MAX_BODY_BYTES)
        self.app.router.add_post("/s/{session}/v1/chat/completions", self._chat)
        self.app.router.add_post("/s/{session}/v1/messages", self._messages)
        self.app.router.add_get("/s/{session}/v1/models", self._models)
        self.app.router.add_get("/s/{session}/v1/models/{model}", self._model)
        self.app.router.add_route("*", "/{tail:.*}", self._unknown)

    async def _conversation(
        self, request: web.Request, session: Session, protocol: _Protocol
    ) -> Conversation:
        """The request's conversation, read by the session's reader of this protocol (decoding
        only what the previous body did not hold; in the CPU pool when the body is large)."""
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            raise BodyTooLarge(MAX_BODY_BYTES)
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as err:  # a chunked body past the maximum
            raise BodyTooLarge(MAX_BODY_BYTES) from err
        # Reading the conversation and matching it to the tree (until the CPU pool takes the
        # rendering) is a step that waits its turn (SessionStore.turns).
        await self.store.turns.wait_turn()
        reader = session.readers.get(protocol.name)
        if reader is None:
            reader = session.readers[protocol.name] = ConversationReader(protocol.conversation)
        if len(raw) > _INLINE_JSON_BYTES:
            conv: Conversation = await self.store.cpu(len(raw), _read, reader, raw)
            return conv
        return _read(reader, raw)

    def _session(self, request: web.Request) -> Session:
        return self.store.for_call(request.match_info["session"], _secret(request))

    async def _serve(
        self,
        request: web.Request,
        protocol: _Protocol,
    ) -> web.StreamResponse:
        started = time.perf_counter()
        try:
            session = self._session(request)
            conv = await self._conversation(request, session, protocol)
            answer = await self.store.call(session, conv, protocol.name)
        except GatewayError as error:
            GATEWAY_CALLS.labels(protocol.name, error.kind).inc()
            log.info(
                "gateway.call_refused", protocol=protocol.name, kind=error.kind, status=error.status
            )
            return _error_response(protocol, error)
        except Exception:
            GATEWAY_CALLS.labels(protocol.name, "internal").inc()
            log.exception("gateway.call_failed", protocol=protocol.name)
            return web.json_response(protocol.internal_error(), status=500)
        GATEWAY_CALLS.labels(protocol.name, "ok").inc()
        overhead_s = time.perf_counter() - started - answer.policy_s
        GATEWAY_OVERHEAD.labels(protocol.name).observe(max(0.0, overhead_s))
        if protocol is OPENAI:
            if conv.stream:
                return await self._sse(
                    request, openai_api.stream_events(answer, conv.include_usage)
                )
            return web.json_response(openai_api.completion(answer))
        if conv.stream:
            return await self._sse(request, anthropic_api.stream_events(answer))
        return web.json_response(anthropic_api.message(answer))

    async def _sse(self, request: web.Request, events: Iterator[bytes]) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        for event in events:
            await response.write(event)
        await response.write_eof()
        return response

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, OPENAI)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, ANTHROPIC)

    async def _models(self, request: web.Request) -> web.Response:
        try:
            session = self._session(request)
        except GatewayError as error:
            return _error_response(OPENAI, error)
        return web.json_response(openai_api.models(session.spec.model, session.opened))

    async def _model(self, request: web.Request) -> web.Response:
        try:
            session = self._session(request)
            if request.match_info["model"] != session.spec.model:
                raise RouteMissing(
                    f"The model {request.match_info['model']!r} does not exist", param="model"
                )
        except GatewayError as error:
            return _error_response(OPENAI, error)
        return web.json_response(openai_api.model_entry(session.spec.model, session.opened))

    async def _unknown(self, request: web.Request) -> web.Response:
        # Both protocols live under /s/<session>/v1: Anthropic's SDKs say who they are with
        # `anthropic-version`, and /v1/messages/... (count_tokens, batches) is Anthropic's.
        anthropic = "anthropic-version" in request.headers or "/v1/messages" in request.path
        protocol = ANTHROPIC if anthropic else OPENAI
        error = RouteMissing(f"no route {request.method} {request.path} on the gateway")
        return _error_response(protocol, error)


class GatewayServer:
    """The gateway on a TCP port; `start()` returns its base URL."""

    def __init__(
        self,
        store: SessionStore,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        executor: Executor | None = None,
    ) -> None:
        self.gateway = GatewayApp(store, executor)
        self.host = host
        self.port = port
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        self._runner = web.AppRunner(self.gateway.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = site._server
        assert server is not None and server.sockets  # type: ignore[attr-defined]
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        self.url = f"http://{host}:{self.port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
