"""Assembles the agent service: pool client, episode runner, gRPC server.

In-process, for tests and tools:

    async with local_stack(nodes=1) as stack:                 # swerl.stack
        async with local_agent(stack.pool_address, stack.token) as agent:
            stub = AgentServiceStub(make_channel(agent.address, token=stack.token))
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from swerl.agent.gateway.service import Gateway
from swerl.agent.gateway.wire import SessionRpcs
from swerl.agent.loop.runner import EpisodeRunner, JudgeFactory
from swerl.agent.loop.sandbox import PoolSandboxProvider, SandboxProvider
from swerl.agent.servicer import AgentServicer
from swerl.agent.settings import AgentSettings
from swerl.agent.v1 import agent_pb2, agent_pb2_grpc
from swerl.chassis.server import GrpcServer, ServiceHost

AGENT_SERVICE = agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name


class AgentServer(ServiceHost):
    """One running agent service; `start()` then `serve_until_signal()` or `stop()`."""

    def __init__(
        self,
        settings: AgentSettings,
        provider: SandboxProvider | None = None,
        *,
        judge_factory: JudgeFactory | None = None,
    ) -> None:
        self.settings = settings
        self._pool = None
        if provider is None:
            from swerl.pool.client import PoolClient

            token = settings.pool_auth_token or settings.auth_token
            self._pool = PoolClient(
                settings.pool_address,
                token=token.get_secret_value() if token else None,
                tls_ca_file=settings.pool_tls_ca_file,
            )
            provider = PoolSandboxProvider(self._pool, lease_wait_s=settings.lease_wait_s)
        self._prm = None
        if judge_factory is None:
            # PRM judging over PrmService (swerl.prm); channels open only when an episode asks.
            from swerl.agent.judging.prm_client import PrmJudgeFactory

            prm_token = settings.prm_auth_token or settings.auth_token
            self._prm = judge_factory = PrmJudgeFactory(
                token=prm_token.get_secret_value() if prm_token else None,
                default_endpoint=settings.prm_endpoint,
            )
        self.runner = EpisodeRunner(settings, provider, judge_factory=judge_factory)
        self.gateway: Gateway | None = None
        if settings.gateway_port is not None:
            # The model gateway shares the runner's HTTP client and codec cache, and has a CPU
            # pool of its own (the runner's gateway_executor).
            self.gateway = Gateway(
                http_session=self.runner.session,
                codecs=self.runner.codec,
                executor=self.runner.gateway_executor,
                host=settings.gateway_host or settings.host,
                port=settings.gateway_port,
                public_url=settings.gateway_public_url or "",
                routing_key_header=settings.routing_key_header,
                max_sessions=settings.gateway_max_sessions,
                retrying=self.runner.policy_retrying,
                request_timeout_s=settings.policy_request_timeout_s,
            )
            self.runner.gateway = self.gateway  # harness episodes open their sessions here
        self.server = GrpcServer(settings, name="agent")
        self.server.add_service(
            agent_pb2_grpc.add_AgentServiceServicer_to_server,
            AgentServicer(self.runner, SessionRpcs(self.gateway, self.runner.executor)),
            [AGENT_SERVICE],
        )
        self.server.add_shutdown_callback(self._shutdown)
        self.port = 0

    async def start(self) -> int:
        if self.gateway is not None:
            await self.gateway.start()
        return await super().start()

    async def _shutdown(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop()
        await self.runner.close()
        if self._prm is not None:
            await self._prm.close()
        if self._pool is not None:
            await self._pool.close()


@contextlib.asynccontextmanager
async def local_agent(
    pool_address: str,
    token: str,
    *,
    judge_factory: JudgeFactory | None = None,
    **settings: Any,
) -> AsyncIterator[AgentServer]:
    """An agent service on a loopback port, leasing from the pool at `pool_address`."""
    values: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "auth_token": token,
        "pool_address": pool_address,
        "log_level": "warning",
        "drain_grace_s": 1.0,
        **settings,
    }
    server = AgentServer(AgentSettings(**values), judge_factory=judge_factory)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0)
