"""ForkLease: n new leases whose sandboxes are copies of an ACTIVE lease's idle sandbox.

The copies are made by the source's node (its ForkSandbox commits the sandbox's filesystem and
creates the copies from it), so a fork never moves to another node: it waits there for room,
within its wait, and otherwise fails with FORK_NODE_FULL rather than placing anything elsewhere.
Each new lease then lives exactly like one from AcquireLease: it holds one unit of its node's
room from the moment the fork is admitted until its node confirms the destroy, has its own token
and expiry, is renewed on KeepAlive and released with ReleaseLease; a restarted pool adopts it
from the node's labels (the copies carry their lease ids). No grpc here.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import structlog

from swerl.chassis.errors import Internal, SwerlError
from swerl.pool import metrics
from swerl.pool.errors import (
    ForkNodeFull,
    InvalidLeaseRequest,
    LeaseNotFound,
    NodeFull,
    NodeRejected,
    NodeSandboxGone,
    SourceBusy,
)
from swerl.pool.keepalive import Tokens
from swerl.pool.model import ACTIVE, ENDED, LABEL_REQUEST, LABEL_TTL, PENDING, Lease, NodeState
from swerl.pool.nodes import ForkRequest
from swerl.pool.state import PoolState

log = structlog.get_logger("swerl.pool")

# How often a fork waiting for room on its node looks again (room frees on destroys).
ROOM_POLL_S = 0.1


@dataclass
class ForkLeaseRequest:
    lease_id: str
    count: int
    request_id: str = ""
    ttl_s: float = 0.0
    wait_s: float = 0.0
    owner: str = ""


@dataclass(frozen=True)
class ForkedLeases:
    leases: list[Lease]
    checkpoint_id: str


class Forks:
    def __init__(self, state: PoolState, tokens: Tokens) -> None:
        self._state = state
        self._settings = state.settings
        self._tokens = tokens
        self._inflight: dict[str, asyncio.Future[ForkedLeases]] = {}

    async def fork(self, request: ForkLeaseRequest) -> ForkedLeases:
        if request.request_id:
            inflight = self._inflight.get(request.request_id)
            if inflight is not None:
                return await asyncio.shield(inflight)
            made = [
                self._state.by_request.get(f"{request.request_id}/fork/{i}")
                for i in range(max(request.count, 0))
            ]
            if made and all(lease is not None for lease in made):
                return ForkedLeases([lease for lease in made if lease is not None], "")
        state, settings = self._state, self._settings
        source = state.leases.get(request.lease_id)
        if source is None or source.state is not ACTIVE:
            raise LeaseNotFound(
                f"no ACTIVE lease {request.lease_id!r} to fork", lease_id=request.lease_id
            )
        node = state.nodes.get(source.node_id)
        if node is None:
            raise LeaseNotFound(f"lease {source.lease_id} has no node", lease_id=source.lease_id)
        if not 1 <= request.count <= max(node.capacity, 1):
            raise InvalidLeaseRequest(
                f"count must be between 1 and the node's capacity {node.capacity},"
                f" got {request.count}"
            )
        if request.ttl_s < 0 or request.ttl_s > settings.max_ttl_s:
            raise InvalidLeaseRequest(f"ttl must be between 0 and {settings.max_ttl_s:g} s")
        if request.wait_s < 0 or request.wait_s > settings.max_wait_s:
            raise InvalidLeaseRequest(
                f"wait_timeout must be between 0 and {settings.max_wait_s:g} s"
            )
        # Like a placement, the fork runs to completion even if its caller goes away: a retry
        # with the same request_id gets its leases.
        task = asyncio.get_running_loop().create_task(self._fork(source, request))
        if request.request_id:
            self._inflight[request.request_id] = task
        return await asyncio.shield(task)

    async def _wait_for_room(self, source: Lease, count: int, wait_s: float) -> None:
        state = self._state
        deadline = time.time() + (min(wait_s or self._settings.default_wait_s, 3600.0))
        while True:
            node = state.nodes.get(source.node_id)
            if node is None or source.state is not ACTIVE:
                raise LeaseNotFound(
                    f"lease {source.lease_id} ended while its fork waited for room",
                    lease_id=source.lease_id,
                )
            room = node.capacity - node.used
            if node.state is NodeState.HEALTHY and min(room, state.global_free()) >= count:
                return
            if time.time() >= deadline:
                raise ForkNodeFull(
                    f"node {node.node_id} ({node.state}) has room for {max(room, 0)} of the"
                    f" {count} forks of lease {source.lease_id}; a fork stays on its node",
                    node_id=node.node_id,
                    lease_id=source.lease_id,
                )
            await asyncio.sleep(ROOM_POLL_S)

    async def _fork(self, source: Lease, request: ForkLeaseRequest) -> ForkedLeases:
        state = self._state
        started = time.time()
        ttl_s = request.ttl_s or source.ttl_s
        await self._wait_for_room(source, request.count, request.wait_s)
        node = state.nodes[source.node_id]
        leases = [
            Lease(
                lease_id="lse-" + uuid.uuid4().hex[:20],
                request_id=f"{request.request_id}/fork/{i}" if request.request_id else "",
                image=source.image,
                instance_id=source.instance_id,
                owner=request.owner or source.owner,
                ttl_s=ttl_s,
                spec=source.spec,
                spec_key=source.spec_key,
                node_selector=dict(source.node_selector),
                create_time=started,
                node_id=node.node_id,
                node_address=node.address,
                wait_duration_s=time.time() - started,
            )
            for i in range(request.count)
        ]
        # Admitted as being placed (PENDING with a node, not queued): each holds its room now.
        for lease in leases:
            state.leases[lease.lease_id] = lease
            if lease.request_id:
                state.by_request[lease.request_id] = lease
            node.hold(lease.lease_id)
        try:
            facts = await node.conn.fork(
                ForkRequest(
                    request_id=request.request_id or uuid.uuid4().hex,
                    sandbox_id=source.sandbox_id,
                    lease_token=source.token,
                    lease_ids=tuple(lease.lease_id for lease in leases),
                    ttl_s=ttl_s + self._settings.node_expiry_slack_s,
                    owner=request.owner or source.owner,
                    # The copies inherit the source's labels: theirs must not claim its request.
                    labels={LABEL_TTL: f"{ttl_s:g}", LABEL_REQUEST: ""},
                )
            )
        except BaseException as exc:
            self._fail_all(leases, self._error_of(exc, source))
            raise self._error_of(exc, source) from None
        finally:
            if request.request_id:
                self._inflight.pop(request.request_id, None)
        now = time.time()
        for lease, sandbox in zip(leases, facts.sandboxes, strict=True):
            lease.sandbox_id = sandbox.sandbox_id
            lease.node_expire_time = sandbox.expire_time
            if lease.state is not PENDING:  # Released while the fork was being made.
                state.start_destroy(lease)
                continue
            lease.expire_time = now + ttl_s
            self._tokens.issue(lease, ttl_s)
            state.transition(lease, ACTIVE)
            lease.claimed = True
        metrics.ACQUIRE_SECONDS.labels("fork").observe(now - started)
        log.info(
            "pool.lease_forked",
            lease_id=source.lease_id,
            count=request.count,
            checkpoint_id=facts.checkpoint_id,
        )
        return ForkedLeases(leases, facts.checkpoint_id)

    def _fail_all(self, leases: list[Lease], error: SwerlError) -> None:
        node = self._state.nodes.get(leases[0].node_id)
        for lease in leases:
            if node is not None:
                node.unhold(lease.lease_id)
            if lease.state is not ENDED:
                self._state.transition(lease, ENDED, error=error)
        self._state.pump()

    @staticmethod
    def _error_of(exc: BaseException, source: Lease) -> SwerlError:
        if isinstance(exc, SwerlError):  # NodeUnreachable included
            return exc
        if isinstance(exc, NodeRejected) and exc.reason == "SANDBOX_BUSY":
            return SourceBusy(
                f"lease {source.lease_id}'s sandbox has a command running; fork between commands",
                lease_id=source.lease_id,
            )
        if isinstance(exc, NodeFull):
            return ForkNodeFull(
                f"node {source.node_id} had no room for the forks",
                node_id=source.node_id,
                lease_id=source.lease_id,
            )
        if isinstance(exc, NodeSandboxGone):
            return LeaseNotFound(
                f"lease {source.lease_id}'s sandbox is gone", lease_id=source.lease_id
            )
        return Internal(f"forking the lease failed: {exc!r}")
