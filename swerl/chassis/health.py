"""`grpc.health.v1.Health` for swerl servers: the standard protocol, plus watches that end on drain.

grpcio-health-checking's aio servicer keeps every `Watch` stream open until the server cancels
it, so one watcher (the pool watches every node) holds a graceful stop open for the whole grace
period; and when one of two watchers of a service leaves, it drops the other's wake-up condition.
This servicer speaks the same protocol (its generated base and messages) but, once draining,
sends the final NOT_SERVING to every watcher and ends the stream with OK.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ServingStatus = int  # A health_pb2.HealthCheckResponse.ServingStatus value.
OVERALL = ""  # The service name clients ask about for the server as a whole.


class HealthServicer(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self._statuses: dict[str, ServingStatus] = {}
        # One condition for all services: watchers are few, and each rechecks its own service.
        self._changed = asyncio.Condition()
        self._draining = False

    async def set(self, service: str, status: ServingStatus) -> None:
        """Sets a service's status; ignored once draining, which is final."""
        async with self._changed:
            if self._draining:
                return
            self._statuses[service] = status
            self._changed.notify_all()

    async def enter_graceful_shutdown(self) -> None:
        """Marks every service NOT_SERVING for good and lets every watch end after saying so."""
        async with self._changed:
            self._draining = True
            for service in self._statuses:
                self._statuses[service] = health_pb2.HealthCheckResponse.NOT_SERVING
            self._changed.notify_all()

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        status = self._statuses.get(request.service)
        if status is None:
            # The health protocol prescribes a plain NOT_FOUND, not a swerl ErrorInfo.
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last: ServingStatus | None = None
        while True:
            async with self._changed:
                await self._changed.wait_for(
                    functools.partial(self._news_for, request.service, last)
                )
                status, draining = self._status_of(request.service), self._draining
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            if draining:
                return

    def _news_for(self, service: str, last: ServingStatus | None) -> bool:
        return self._draining or self._status_of(service) != last

    def _status_of(self, service: str) -> ServingStatus:
        return self._statuses.get(service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
