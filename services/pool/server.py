"""Assembles the pool: store, Pool, gRPC server.

A pool with exec nodes in one process (tests, the demo, `swerl eval`) is `swerl.stack.local_stack`.
"""

from __future__ import annotations

from collections.abc import Callable

from swerl.chassis.gctune import tune_collector
from swerl.chassis.server import GrpcServer, ServiceHost
from swerl.pool.leases import Pool
from swerl.pool.nodes import GrpcNodeConnection, NodeConnection
from swerl.pool.servicer import PoolServicer
from swerl.pool.settings import PoolSettings
from swerl.pool.store import PoolStore
from swerl.pool.v1 import pool_pb2, pool_pb2_grpc

POOL_SERVICE = pool_pb2.DESCRIPTOR.services_by_name["PoolService"].full_name


def tune_garbage_collector(settings: PoolSettings) -> None:
    """For a process that serves a pool, once it has started (not for one that embeds a pool).

    The middle generation is collected less often, so that fewer short-lived objects (each
    KeepAlive stream's pending read lives a second) are promoted into the oldest generation,
    whose growth is what triggers a full collection of the whole lease table.
    """
    tune_collector(middle_every=settings.gc_middle_threshold)


class PoolServer(ServiceHost):
    """One running pool; `start()` then `serve_until_signal()` or `stop()`."""

    def __init__(
        self,
        settings: PoolSettings,
        connect: Callable[[str], NodeConnection] | None = None,
    ) -> None:
        self.settings = settings
        secret = settings.node_auth_token or settings.auth_token
        node_token = secret.get_secret_value() if secret else None
        self.store = PoolStore(settings.state_dir / "pool.sqlite")
        self.pool = Pool(
            settings,
            connect
            or (
                lambda address: GrpcNodeConnection(
                    address, token=node_token, timeout_s=settings.node_call_timeout_s
                )
            ),
            self.store,
        )
        self.server = GrpcServer(settings, name="pool")
        self.server.add_service(
            pool_pb2_grpc.add_PoolServiceServicer_to_server, PoolServicer(self.pool), [POOL_SERVICE]
        )
        self.server.add_shutdown_callback(self._shutdown)
        self.port = 0

    async def start(self) -> int:
        await self.pool.start()
        return await super().start()

    async def _shutdown(self) -> None:
        await self.pool.stop()
        self.store.close()
