"""An exec node started with a pool address registers itself there (RegisterNode) at start-up.

It retries until the pool answers, so nodes and pool may start in any order. It registers once:
the pool keeps its node list across restarts, and registering again would undo a DrainNode.
"""

from __future__ import annotations

import asyncio

import grpc
import structlog

from swerl.chassis.client import error_info
from swerl.exec.settings import ExecSettings

log = structlog.get_logger("swerl.exec.registration")


async def register_with_pool(settings: ExecSettings, address: str) -> None:
    from swerl.pool.client import PoolClient

    assert settings.pool_address is not None
    secret = settings.pool_auth_token or settings.auth_token
    pool = PoolClient(settings.pool_address, token=secret.get_secret_value() if secret else None)
    delay_s = 0.2
    try:
        while True:
            try:
                # One request id for every attempt: the pool answers a repeat as the first.
                await pool.register_node(
                    settings.node_id,
                    address,
                    labels=settings.node_labels,
                    request_id=f"register-{settings.node_id}",
                )
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
        await pool.close()
