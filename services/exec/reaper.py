"""The exec node's housekeeping: each round, every `ExecSettings.reap_interval_s`, it

- notices sandboxes whose container stopped or vanished behind swerl's back (logged; their next
  command starts them again, or finds them lost);
- removes orphans: containers of this node that no sandbox record accounts for (a create whose
  start and cleanup both failed, dockerd going away between the two), once older than
  `orphan_grace_s` so a create still in flight is left alone;
- destroys sandboxes past their expiry (a failed destroy is retried next round).

The reaper reads the manager's records and destroys through the manager (`records` and
`destroy`), so it holds no state of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

import structlog

from swerl.exec.labels import LABEL_PREFIX
from swerl.exec.runtime import ContainerRuntime
from swerl.exec.settings import ExecSettings

log = structlog.get_logger(__name__)


class ReapedRecord(Protocol):
    """What the reaper reads (and, for `running`, writes) of a sandbox record."""

    sandbox_id: str
    container_id: str
    expire_time: float
    tracked_since: float
    running: bool
    destroying: asyncio.Future[bool] | None


class SandboxReaper:
    def __init__(
        self,
        settings: ExecSettings,
        backend: ContainerRuntime,
        records: Callable[[], Iterable[ReapedRecord]],
        destroy: Callable[[str], Awaitable[bool]],
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.records = records
        self.destroy = destroy

    async def run(self) -> None:
        """One round every `reap_interval_s`, until cancelled."""
        while True:
            await asyncio.sleep(self.settings.reap_interval_s)
            await self.sweep()

    async def sweep(self) -> None:
        """One round: exited containers noticed, orphans removed, expired sandboxes destroyed."""
        with contextlib.suppress(Exception):
            await self.notice_exited_containers()
        with contextlib.suppress(Exception):
            await self.remove_orphans()
        now = time.time()
        for record in list(self.records()):
            if record.expire_time <= now and record.destroying is None:
                try:
                    await self.destroy(record.sandbox_id)
                    log.info("sandbox.reaped", sandbox_id=record.sandbox_id)
                except Exception as exc:  # retried next round
                    log.warning("sandbox.reap_failed", sandbox_id=record.sandbox_id, error=str(exc))

    async def remove_orphans(self) -> None:
        """Removes containers of this node that no sandbox record accounts for. A create whose
        start failed and whose cleanup failed too (dockerd going away between the two, seen in
        the soak's dockerd restart) leaves a container no record, and so no reaper, ever sees;
        only a node restart's reconcile would. A create still in flight has no record yet
        either, hence the grace on the container's age."""
        found = await self.backend.list_labelled({LABEL_PREFIX + "node": self.settings.node_id})
        known = {record.container_id for record in self.records()}
        cutoff = time.time() - self.settings.orphan_grace_s
        for info in found:
            created = float(info.labels.get(LABEL_PREFIX + "create_time", "0") or 0)
            if info.container_id in known or created > cutoff:
                continue
            await self.backend.remove(info.container_id)
            log.warning(
                "sandbox.orphan_removed",
                container=info.name,
                sandbox_id=info.labels.get(LABEL_PREFIX + "sandbox_id", ""),
            )

    async def notice_exited_containers(self) -> None:
        """Logs sandboxes whose container stopped or vanished behind swerl's back (their next
        command starts them again, or finds them lost)."""
        listed_at = time.time()
        found = await self.backend.list_labelled({LABEL_PREFIX + "node": self.settings.node_id})
        running = {info.container_id for info in found if info.running}
        for record in list(self.records()):
            # A sandbox created while the list was being taken is not in it yet.
            if record.tracked_since >= listed_at - 1.0:
                continue
            if record.running and record.destroying is None and record.container_id not in running:
                record.running = False
                log.warning("sandbox.exited", sandbox_id=record.sandbox_id)
