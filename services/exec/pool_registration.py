"""An exec node started with a pool address registers itself there (RegisterNode) at start-up.

It retries until the pool answers, so nodes and pool may start in any order. It registers once:
the pool keeps its node list across restarts, and registering again would undo a DrainNode.
"""

from __future__ import annotations

import asyncio

import grpc
import structlog

from swerl.chassis.client import error_info, make_channel
from swerl.exec.settings import ExecSettings

log = structlog.get_logger("swerl.exec.registration")


async def register_with_pool(settings: ExecSettings, address: str) -> None:
    from swerl.pool.v1 import pool_pb2, pool_pb2_grpc

    assert settings.pool_address is not None
    secret = settings.pool_auth_token or settings.auth_token
    channel = make_channel(
        settings.pool_address, token=secret.get_secret_value() if secret else None
    )
    stub = pool_pb2_grpc.PoolServiceStub(channel)
    request = pool_pb2.RegisterNodeRequest(
        request_id=f"register-{settings.node_id}",
        node_id=settings.node_id,
        address=address,
        labels=settings.node_labels,
    )
    delay_s = 0.2
    try:
        while True:
            try:
                await stub.RegisterNode(request, timeout=30.0)
                log.info("exec.registered", pool=settings.pool_address, address=address)
                return
            except grpc.aio.AioRpcError as err:
                log.warning(
                    "exec.register_failed",
                    pool=settings.pool_address,
                    code=err.code().name,
                    reason=error_info(err)[0],
                    retry_in_s=delay_s,
                )
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 5.0)
    finally:
        await channel.close()
