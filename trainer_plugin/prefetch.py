"""Image prefetch from the trainer: the images of the episodes about to run go to the pool's
PrefetchImages, so their pulls start before (or while) the episodes acquire their sandboxes.

Two sources add images here: the data source (data_source.py), which sees each batch when the
rollout fetches it and adds that batch's images and the next batch's, and each generate call,
which adds its own sample's. One PrefetchImages per `prefetch_delay_s` window carries every
image the window collected (images added while a call is in flight go in the next one), so a
batch of 256 samples costs a call or two, not 256. Images sent recently are not sent again
(the pool would only answer that they are being pulled). Prefetch is advice: a failed call is
logged and never fails an episode. Off unless `pool_address` is set.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog

from swerl.pool.client import PoolClient
from swerl.pool.v1 import pool_pb2
from swerl.trainer_plugin.settings import PluginSettings

_log = structlog.get_logger("swerl.trainer_plugin")

# An image sent within this long is not sent again.
RESEND_AFTER_S = 300.0
# One PrefetchImages call's deadline (the pool only starts the pulls before it answers); a call
# that fails is not retried, its images go in a later window's call.
PREFETCH_CALL_TIMEOUT_S = 10.0


class Prefetcher:
    def __init__(self, address: str, token: str | None, delay_s: float) -> None:
        self._pool = PoolClient(address, token=token, call_timeout_s=PREFETCH_CALL_TIMEOUT_S)
        self._delay_s = delay_s
        self._pending: dict[str, None] = {}
        self._sent: dict[str, float] = {}
        self._flush: asyncio.Task[None] | None = None
        self.calls = 0
        self.failures = 0

    def add(self, image: str) -> None:
        now = time.monotonic()
        if not image or now - self._sent.get(image, -RESEND_AFTER_S) < RESEND_AFTER_S:
            return
        self._pending[image] = None
        if self._flush is None or self._flush.done():
            self._flush = asyncio.get_running_loop().create_task(self._send_soon())

    async def _send_soon(self) -> None:
        # Images added while a call is in flight go in the next window's call.
        while self._pending:
            await asyncio.sleep(self._delay_s)
            images, self._pending = list(self._pending), {}
            await self._send(images)

    async def _send(self, images: list[str]) -> None:
        now = time.monotonic()
        for image in images:
            self._sent[image] = now
        self.calls += 1
        try:
            prefetches = await self._pool.prefetch_images(images, retry=False)
        except Exception as exc:  # Advice only: the episodes pull on demand anyway.
            # Logged once as a warning (a pool that is down would otherwise log every window).
            log = _log.warning if not self.failures else _log.debug
            self.failures += 1
            log("prefetch.failed", images=len(images), error=str(exc), failures=self.failures)
            for image in images:
                self._sent.pop(image, None)
            return
        started = sum(1 for p in prefetches if p.status == pool_pb2.PREFETCH_STATUS_STARTED)
        _log.info("prefetch.sent", images=len(images), started=started)

    async def close(self) -> None:
        if self._flush is not None:
            await asyncio.gather(self._flush, return_exceptions=True)
        await self._pool.close()


_prefetchers: dict[tuple[Any, ...], Prefetcher] = {}


def prefetcher(settings: PluginSettings) -> Prefetcher | None:
    """This process's prefetcher for the configured pool (None when prefetch is off)."""
    if not settings.pool_address:
        return None
    token = settings.pool_token.get_secret_value() if settings.pool_token else None
    key = (settings.pool_address, token, settings.prefetch_delay_s)
    found = _prefetchers.get(key)
    if found is None:
        found = _prefetchers[key] = Prefetcher(
            settings.pool_address, token, settings.prefetch_delay_s
        )
    return found
