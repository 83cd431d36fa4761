"""Image pulls the pool asks its nodes for: on demand for a lease, or ahead of demand (prefetch).

One pull per (node, image): every lease placed on a node that is pulling its image waits on the
same pull, and a prefetch of an image a node is already pulling adds nothing. Each node runs at
most `pulls_per_node` pulls at once; the rest wait in that node's line, pulls a lease waits on
ahead of prefetches (a prefetch that a lease joins moves up with it).

A failed pull answers every lease waiting on it with the node's reason at once. Whether and when
the pool tries again depends on that reason, so a registry that is down or an image that does
not exist never turns into a stream of pulls:

  REGISTRY_UNREACHABLE   the registry (its host) is remembered down: new requests for any image
                         from it get the error at once, with a RetryInfo, and no pull starts until
                         the backoff ends (doubling from pull_backoff_s to pull_backoff_max_s)
  PULL_FAILED            tried again on the same node after pull_backoff_s while attempts remain
                         (a cut connection); then as REGISTRY_UNREACHABLE, for this image only
  IMAGE_NOT_FOUND, REGISTRY_AUTH, IMAGE_TOO_LARGE, INVALID_IMAGE_REFERENCE
                         no retry can help: remembered for pull_failure_ttl_s, requests for the
                         image get the error at once meanwhile

No grpc here: nodes pull through `NodeConnection.pull`.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from swerl.chassis.errors import SwerlError
from swerl.chassis.images import image_key
from swerl.pool import metrics, placement
from swerl.pool.errors import NodeUnreachable, pull_error
from swerl.pool.model import Node, image_names
from swerl.pool.nodes import PullProgress
from swerl.pool.state import PoolState

log = structlog.get_logger("swerl.pool")

# Reasons no later attempt can cure: remembered per image for pull_failure_ttl_s.
PERMANENT_REASONS = frozenset(
    {"IMAGE_NOT_FOUND", "REGISTRY_AUTH", "IMAGE_TOO_LARGE", "INVALID_IMAGE_REFERENCE"}
)


class PullPriority(enum.IntEnum):
    LEASE = 0  # a lease waits on it
    PREFETCH = 1  # nobody waits yet


@dataclass(eq=False)
class Pull:
    """One image being pulled (or waiting to be) on one node."""

    node_id: str
    image: str
    priority: PullPriority
    queued_time: float
    done: asyncio.Future[None]
    start_time: float = 0.0
    attempts: int = 0
    # The node's latest progress line (Docker reports it per layer).
    status: str = "queued"
    current_bytes: int = 0
    total_bytes: int = 0


@dataclass
class _Failure:
    reason: str
    message: str
    until: float  # no new pull before this (unix seconds)
    failures: int  # in a row, for the backoff


def registry_of(image: str) -> str:
    """The registry host an image is pulled from ("docker.io" for unqualified names)."""
    first, sep, _ = image_key(image).partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return first
    return "docker.io"


class Pulls:
    def __init__(self, state: PoolState, refresh: Callable[[Node], None]) -> None:
        self._state = state
        self._settings = state.settings
        self._refresh = refresh
        self._jobs: dict[tuple[str, str], Pull] = {}  # (node_id, image key)
        self._by_image: dict[str, dict[str, Pull]] = {}  # image key -> node_id -> pull
        self._lines: dict[str, list[Pull]] = {}  # node_id -> pulls waiting to start
        self._running: dict[str, int] = {}  # node_id -> pulls running
        self._failures: dict[str, _Failure] = {}  # "image:<key>" or "registry:<host>"
        # Home sets of the current healthy nodes, by image key (dropped when that set changes).
        self._homes: dict[str, list[str]] = {}
        self._homes_nodes: tuple[str, ...] = ()

    # -- what placement asks ------------------------------------------------------------
    def homes_of(self, image: str) -> list[str]:
        healthy = placement.home_candidates(
            (n.node_id, n.state) for n in self._state.nodes.values()
        )
        if healthy != self._homes_nodes:
            self._homes, self._homes_nodes = {}, healthy
        key = image_key(image)
        found = self._homes.get(key)
        if found is None:
            if len(self._homes) >= 100_000:  # Bounded: a dataset's images, not every name.
                self._homes.clear()
            found = self._homes[key] = placement.homes(
                image, healthy, self._settings.image_replicas
            )
        return found

    def pulling_on(self, image: str) -> dict[str, Pull]:
        """The nodes pulling `image` now (or about to)."""
        return self._by_image.get(image_key(image), {})

    def pulls(self) -> list[Pull]:
        return list(self._jobs.values())

    def check(self, image: str) -> None:
        """Raises at once the error of a recent failure that a new pull would only repeat."""
        now = time.time()
        key = image_key(image)
        for name in ("image:" + key, "registry:" + registry_of(image)):
            failure = self._failures.get(name)
            if failure is not None and failure.until > now:
                raise pull_error(
                    failure.reason,
                    f"{failure.message} (remembered; no new pull of {image!r} for"
                    f" {failure.until - now:.1f} s)",
                    image=image,
                    retry_delay_s=round(failure.until - now, 1),
                )

    # -- starting pulls -----------------------------------------------------------------
    def start(self, node: Node, image: str, priority: PullPriority) -> Pull:
        """The pull of `image` on `node`: the one in flight, or a new one in the node's line."""
        key = image_key(image)
        pull = self._jobs.get((node.node_id, key))
        if pull is not None:
            if priority < pull.priority:
                pull.priority = priority  # A lease now waits on a prefetch: move it up.
                line = self._lines.get(node.node_id)
                if line and pull in line:
                    line.sort(key=lambda p: (p.priority, p.queued_time))
            return pull
        pull = Pull(
            node.node_id,
            image,
            priority,
            time.time(),
            asyncio.get_running_loop().create_future(),
        )
        self._jobs[(node.node_id, key)] = pull
        self._by_image.setdefault(key, {})[node.node_id] = pull
        node.image_pulls += 1
        self._enqueue(pull)
        return pull

    def _enqueue(self, pull: Pull) -> None:
        line = self._lines.setdefault(pull.node_id, [])
        line.append(pull)
        line.sort(key=lambda p: (p.priority, p.queued_time))
        self._next(pull.node_id)

    def _next(self, node_id: str) -> None:
        line = self._lines.get(node_id)
        while line and self._running.get(node_id, 0) < self._settings.pulls_per_node:
            pull = line.pop(0)
            self._running[node_id] = self._running.get(node_id, 0) + 1
            self._state.spawn(self._run(pull))

    async def _run(self, pull: Pull) -> None:
        node = self._state.nodes.get(pull.node_id)
        pull.attempts += 1
        pull.start_time = pull.start_time or time.time()
        pull.status = "pulling"
        try:
            if node is None:
                raise NodeUnreachable(f"node {pull.node_id} is gone")

            def progress(p: PullProgress) -> None:
                pull.status, pull.current_bytes, pull.total_bytes = (
                    p.status,
                    p.current_bytes,
                    p.total_bytes,
                )

            outcome = await node.conn.pull(pull.image, progress)
        except NodeUnreachable as exc:
            self._finish(pull, exc)
            self._next(pull.node_id)
            return
        except Exception as exc:  # A bug must not leave leases waiting on this pull forever.
            log.exception("pool.pull_error", node_id=pull.node_id, image=pull.image)
            self._finish(pull, NodeUnreachable(f"pulling on {pull.node_id} failed: {exc!r}"))
            self._next(pull.node_id)
            return
        finally:
            self._running[pull.node_id] -= 1
        self._next(pull.node_id)  # Not when cancelled: the pool is stopping.
        if outcome.ok:
            self._succeeded(node, pull, outcome.status)
            return
        reason = outcome.reason or "PULL_FAILED"
        if reason == "PULL_FAILED" and pull.attempts < self._settings.pull_attempts:
            log.info(
                "pool.pull_retry", node_id=pull.node_id, image=pull.image, message=outcome.message
            )
            pull.status = "retrying"
            self._state.spawn(self._retry_later(pull))
            return
        self._failed(pull, reason, outcome.message)

    async def _retry_later(self, pull: Pull) -> None:
        await asyncio.sleep(self._settings.pull_backoff_s)
        self._enqueue(pull)

    def _succeeded(self, node: Node, pull: Pull, status: str) -> None:
        metrics.IMAGE_PULLS.labels(status).inc()
        metrics.PULL_SECONDS.labels(pull.priority.name).observe(time.time() - pull.queued_time)
        node.images |= set(image_names(pull.image))
        self._failures.pop("image:" + image_key(pull.image), None)
        self._failures.pop("registry:" + registry_of(pull.image), None)
        log.info(
            "pool.image_pulled",
            node_id=pull.node_id,
            image=pull.image,
            status=status,
            duration_s=round(time.time() - pull.start_time, 3),
            priority=pull.priority.name,
        )
        self._finish(pull, None)
        self._refresh(node)  # Its sizes, and whatever the node evicted to make room.
        self._state.pump()

    def _failed(self, pull: Pull, reason: str, message: str) -> None:
        now = time.time()
        s = self._settings
        if reason in PERMANENT_REASONS:
            name, delay = "image:" + image_key(pull.image), s.pull_failure_ttl_s
            failures = 1
        else:
            # REGISTRY_UNREACHABLE stops pulls from the whole registry; PULL_FAILED of one image.
            name = (
                "registry:" + registry_of(pull.image)
                if reason == "REGISTRY_UNREACHABLE"
                else "image:" + image_key(pull.image)
            )
            previous = self._failures.get(name)
            failures = (previous.failures if previous else 0) + 1
            delay = min(s.pull_backoff_s * 2 ** (failures - 1), s.pull_backoff_max_s)
        self._failures[name] = _Failure(reason, message, now + delay, failures)
        metrics.IMAGE_PULLS.labels(reason).inc()
        log.warning(
            "pool.pull_failed",
            node_id=pull.node_id,
            image=pull.image,
            reason=reason,
            message=message[-300:],
            no_pull_for_s=delay,
        )
        self._finish(
            pull,
            pull_error(
                reason,
                f"pulling {pull.image!r} on node {pull.node_id} failed ({reason}): {message}",
                image=pull.image,
                retry_delay_s=delay,
            ),
        )

    def _finish(self, pull: Pull, error: SwerlError | NodeUnreachable | None) -> None:
        key = image_key(pull.image)
        if self._jobs.get((pull.node_id, key)) is pull:
            del self._jobs[(pull.node_id, key)]
        on_image = self._by_image.get(key, {})
        if on_image.get(pull.node_id) is pull:
            del on_image[pull.node_id]
            if not on_image:
                self._by_image.pop(key, None)
        if pull.done.done():
            return
        if error is None:
            pull.done.set_result(None)
        else:
            pull.done.set_exception(error)
            pull.done.exception()  # Retrieved: the waiters re-raise it; none may be left.
