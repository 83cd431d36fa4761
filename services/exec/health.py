"""dockerd's health as this exec node sees it: one ping per interval, and who hears of a change.

`DockerHealth.probe` asks dockerd once (`ContainerRuntime.ping`, bounded by
`ExecSettings.docker_ping_timeout_s`: a hung dockerd is a failed ping, not a wait) and records the
answer; `run` does that forever, `ExecSettings.docker_health_interval_s` apart. A change from
healthy to unhealthy or back is logged, handed to the backend (`mark_down` fails every Docker call
in flight at once with DOCKER_UNAVAILABLE, so callers learn of the fault within an interval plus a
ping, not at the Docker client's two-minute timeout; `mark_up` lets calls through again) and to
`on_change` (the server marks its gRPC health SERVING or NOT_SERVING with it). `NodeInfo` reports
`healthy`, `version` and `error` as last recorded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from swerl.exec.errors import DockerUnavailable
from swerl.exec.runtime import ContainerRuntime

log = structlog.get_logger(__name__)


class DockerHealth:
    """The last answer of the node's dockerd, and the loop that keeps asking."""

    def __init__(
        self,
        backend: ContainerRuntime,
        interval_s: float,
        on_change: Callable[[bool], None] | None = None,
        ping_timeout_s: float | None = None,
    ) -> None:
        self.backend = backend
        self.interval_s = interval_s
        self.ping_timeout_s = ping_timeout_s
        self.on_change = on_change
        self.healthy = True
        self.version = ""  # dockerd's version, from the last ping that answered
        self.error = ""  # why the last ping failed; empty while healthy

    async def probe(self) -> bool:
        """Pings dockerd once, records the outcome and reports a change; True if it answered."""
        try:
            self.version = await self.backend.ping(self.ping_timeout_s)
            healthy, error = True, ""
        except DockerUnavailable as exc:
            healthy, error = False, exc.message
        if healthy:
            self.backend.mark_up()
        else:
            self.backend.mark_down(error)
        if healthy != self.healthy:
            log.warning("exec.docker_health", healthy=healthy, error=error)
            if self.on_change is not None:
                self.on_change(healthy)
        self.healthy, self.error = healthy, error
        return healthy

    async def run(self) -> None:
        """Probes every `interval_s` until cancelled."""
        while True:
            await self.probe()
            await asyncio.sleep(self.interval_s)
