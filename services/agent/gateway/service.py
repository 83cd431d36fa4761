"""The gateway as the agent runs it: a SessionStore whose policies are SGLang or vLLM clients
(SessionSpec.engine) and whose chat templates come from the agent's codec cache, served on its
own HTTP port.

In-process (tests, `swerl eval`, the demo):

    async with local_gateway() as gateway:
        session = await gateway.store.open(SessionSpec(endpoint=url, tokenizer_path=path))
        client = openai.AsyncOpenAI(
            base_url=gateway.openai_base_url(session), api_key=session.secret
        )
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

import aiohttp

from swerl.agent.gateway.http import GatewayServer
from swerl.agent.gateway.session import (
    DEFAULT_MODEL,
    ENGINE_VLLM,
    CodecSource,
    Session,
    SessionSpec,
    SessionStore,
)
from swerl.agent.policy.clients import (
    RETRY_ATTEMPTS,
    RETRY_MAX_DELAY_S,
    SglangPolicy,
    TokenPolicy,
    policy_retrying,
)
from swerl.agent.policy.tokens import ChatCodec, TemplateMismatch, codec_key
from swerl.agent.policy.vllm import VllmPolicy
from swerl.agent.settings import GATEWAY_CPU_THREADS, POLICY_REQUEST_TIMEOUT_S
from swerl.chassis.gctune import tune_collector
from swerl.chassis.hf import load_tokenizer


def gateway_cpu_pool(threads: int = GATEWAY_CPU_THREADS) -> ThreadPoolExecutor:
    """The gateway's CPU pool: rendering, tokenizing, the policy's JSON."""
    return ThreadPoolExecutor(threads, thread_name_prefix="gateway-cpu")


class Gateway:
    """Sessions plus their HTTP face."""

    def __init__(
        self,
        *,
        http_session: Any,
        codecs: CodecSource,
        executor: Executor | None,
        host: str = "127.0.0.1",
        port: int = 0,
        public_url: str = "",
        routing_key_header: str = "X-SMG-Routing-Key",
        max_sessions: int = 4096,
        retrying: Any = None,
        request_timeout_s: float = POLICY_REQUEST_TIMEOUT_S,
    ) -> None:
        self._http_session = http_session
        # A session's policy calls' limit when its OpenSession names none (the agent's setting).
        self._request_timeout_s = request_timeout_s
        self._executor = executor
        self._routing_key_header = routing_key_header
        # The agent's policy retry policy (its settings), shared by every session's client.
        self._retrying = retrying or policy_retrying(RETRY_ATTEMPTS, RETRY_MAX_DELAY_S)
        self.store = SessionStore(
            codecs=codecs,
            policy_factory=self._policy,
            executor=executor,
            max_sessions=max_sessions,
        )
        self.server = GatewayServer(self.store, host=host, port=port, executor=executor)
        self._public_url = public_url.rstrip("/")
        # Set once the HTTP face is stopped: harness episodes on it end INFRA_ERROR at once.
        self.stopped = asyncio.Event()

    def _policy(self, spec: SessionSpec, session_id: str) -> TokenPolicy:
        header = self._routing_key_header
        http = self._http_session() if callable(self._http_session) else self._http_session
        if spec.engine == ENGINE_VLLM:
            return VllmPolicy(
                http,
                spec.endpoint,
                spec.sampling_params,
                request_timeout_s=spec.request_timeout_s or self._request_timeout_s,
                # DEFAULT_MODEL is the name the gateway answers with when the policy config
                # names none: then vLLM samples from its one served model.
                model="" if spec.model == DEFAULT_MODEL else spec.model,
                lora_path=spec.lora_path,
                executor=self._executor,
                retrying=self._retrying,
                headers={header: session_id} if header else {},
                turns=self.store.turns,
                request_key=session_id,
            )
        # The session id as routing key: a consistent-hashing router keeps all the session's
        # calls on one engine, whose prefix cache then holds its chains.
        return SglangPolicy(
            http,
            spec.endpoint,
            spec.sampling_params,
            request_timeout_s=spec.request_timeout_s or self._request_timeout_s,
            executor=self._executor,
            retrying=self._retrying,
            headers={header: session_id} if header else {},
            lora_path=spec.lora_path,
            request_id_prefix=spec.request_id_prefix,
            cache_key=spec.cache_key,
            turns=self.store.turns,
        )

    @property
    def url(self) -> str:
        return self._public_url or self.server.url

    def openai_base_url(self, session: Session) -> str:
        return f"{self.url}/s/{session.id}/v1"

    def anthropic_base_url(self, session: Session) -> str:
        return f"{self.url}/s/{session.id}"

    async def start(self) -> str:
        await self.server.start()
        return self.url

    async def stop(self) -> None:
        self.stopped.set()
        await self.server.stop()
        self.store.shutdown()


def codec_cache(executor: Executor | None) -> CodecSource:
    """Chat codecs loaded once per tokenizer path and template kwargs (for a gateway that runs
    without the agent's runner)."""
    cache: dict[tuple[str, str], ChatCodec] = {}
    lock = asyncio.Lock()

    async def get(path: str, kwargs: dict[str, Any]) -> ChatCodec:
        from swerl.agent.errors import TokenizerUnavailable

        key = codec_key(path, kwargs)
        async with lock:
            if key not in cache:
                loop = asyncio.get_running_loop()
                try:
                    cache[key] = await loop.run_in_executor(
                        executor, lambda: ChatCodec(load_tokenizer(path), kwargs, path)
                    )
                except (OSError, ValueError, TemplateMismatch) as err:
                    raise TokenizerUnavailable(
                        f"cannot load tokenizer {path!r}: {err}", tokenizer_path=path
                    ) from err
                # The tokenizer's long-lived objects leave the cyclic collector's view, as the
                # agent's runner does it: a full collection over them stalls the loop.
                tune_collector(full_every=100)
        return cache[key]

    return get


@contextlib.asynccontextmanager
async def local_gateway(
    *, threads: int = GATEWAY_CPU_THREADS, **options: Any
) -> AsyncIterator[Gateway]:
    """A gateway on a loopback port with its own CPU pool (as the agent's) and HTTP client.
    Tokenizers load in the loop's default executor, as the agent loads them in the episodes' pool:
    a load (~1 s) in the gateway's one thread would hold up every session's rendering."""
    executor = gateway_cpu_pool(threads)
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024))
    gateway = Gateway(http_session=http, codecs=codec_cache(None), executor=executor, **options)
    await gateway.start()
    try:
        yield gateway
    finally:
        await gateway.stop()
        await http.close()
        executor.shutdown(wait=False)
