"""The FIFO queue of AcquireLease requests and the placement of each on a node.

A request is admitted PENDING at the queue's tail and waits there, within its wait_timeout, for
room. `pump` walks the queue oldest first and places every request that fits now (the choice is
`swerl.pool.placement`'s): the lease takes its node's room at once, then its sandbox is made (or
a warm spare bound) on the node; a node that fails sends it back to the head of the queue, and
that node is avoided for it until the next maintenance pass.

A request placed on a node without its image is PULLING: it holds the node's room and waits on
the node's pull of the image (swerl.pool.pulls, one per node and image) within its own
wait_timeout, then its sandbox is made. A failed pull ends it with the pull's reason.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import structlog

from swerl.chassis.bounded import within
from swerl.chassis.errors import Internal, SwerlError
from swerl.pool import metrics, placement
from swerl.pool.errors import (
    ImagePulling,
    InvalidLeaseRequest,
    NodeFull,
    NodeImageMissing,
    NodeRejected,
    NodeSandboxGone,
    NodeUnreachable,
    PoolAtCapacity,
)
from swerl.pool.keepalive import Tokens
from swerl.pool.model import (
    ACTIVE,
    ENDED,
    LABEL_REQUEST,
    LABEL_TTL,
    PENDING,
    PULLING,
    RELEASING,
    AcquireRequest,
    Lease,
    LossReason,
    Node,
    Spare,
    image_names,
)
from swerl.pool.nodes import CreateRequest
from swerl.pool.pulls import Pull, PullPriority, Pulls
from swerl.pool.state import PoolState

log = structlog.get_logger("swerl.pool")

RETRY_DELAY_S = 1.0


class Queue:
    def __init__(self, state: PoolState, tokens: Tokens, pulls: Pulls) -> None:
        self._state = state
        self._settings = state.settings
        self._tokens = tokens
        self._pulls = pulls
        state.pump = self.pump

    def _validate(self, request: AcquireRequest) -> None:
        s = self._settings
        if not request.image:
            raise InvalidLeaseRequest("image is required")
        if request.ttl_s < 0 or request.ttl_s > s.max_ttl_s:
            raise InvalidLeaseRequest(f"ttl must be between 0 and {s.max_ttl_s:g} s")
        if request.wait_s < 0 or request.wait_s > s.max_wait_s:
            raise InvalidLeaseRequest(f"wait_timeout must be between 0 and {s.max_wait_s:g} s")

    async def acquire(self, request: AcquireRequest) -> Lease:
        started = time.time()
        settings = self._settings
        wait_s = min(request.wait_s or settings.default_wait_s, settings.max_wait_s)
        if request.request_id:
            existing = self._state.by_request.get(request.request_id)
            if existing is not None:
                return await self._await_ready(existing, started + wait_s)
        self._validate(request)
        may_pull = settings.pull
        placement.check_image(
            request.image, request.node_selector, self._state.nodes, may_pull=may_pull
        )
        if may_pull:
            try:  # A pull that just failed is not started again...
                self._pulls.check(request.image)
            except SwerlError:
                # ...but an image some node has needs no pull (a registry that is down is no
                # reason to refuse the images already on the nodes).
                if not placement.image_present(
                    request.image, request.node_selector, self._state.nodes
                ):
                    raise
        lease = Lease(
            lease_id="lse-" + uuid.uuid4().hex[:20],
            request_id=request.request_id,
            image=request.image,
            instance_id=request.instance_id,
            owner=request.owner,
            ttl_s=request.ttl_s or settings.default_ttl_s,
            spec=request.spec,
            spec_key=request.spec.key(),
            node_selector=dict(request.node_selector),
            prefer_not=request.prefer_not,
            create_time=started,
            ready=asyncio.get_running_loop().create_future(),
        )
        self._state.admit(lease)
        self.pump()
        return await self._await_ready(lease, started + wait_s)

    async def _await_ready(self, lease: Lease, deadline: float) -> Lease:
        ready = lease.ready
        if ready is None or ready.done():
            if ready is not None and (error := ready.exception()) is not None:
                raise error
            return lease
        queue = self._state.queue
        lease.waiters += 1
        try:
            try:
                await within(asyncio.shield(ready), max(0.0, deadline - time.time()))
            except asyncio.TimeoutError:
                if lease in queue:
                    waited = time.time() - lease.create_time
                    self._state.transition(lease, ENDED, reason=LossReason.NOT_FOUND)
                    raise PoolAtCapacity(
                        f"no capacity for image {lease.image!r} within {waited:.1f} s",
                        retry_delay_s=RETRY_DELAY_S,
                        image=lease.image,
                    ) from None
                if lease.state is PULLING:
                    raise self._pull_timed_out(lease) from None
                # Its sandbox is being made right now: that ends soon either way.
                await asyncio.shield(ready)
        except asyncio.CancelledError:
            if lease.waiters == 1 and (lease.state is PULLING or lease in queue):
                self._state.transition(lease, ENDED, reason=LossReason.NOT_FOUND)
            raise
        finally:
            lease.waiters -= 1
        result = ready.result()
        result.claimed = True
        return result

    def _pull_timed_out(self, lease: Lease) -> ImagePulling:
        """The caller's wait ran out while the image is pulled: the lease ends (its room is
        given back), the pull goes on, and the caller is told to come back."""
        pull = lease.pull
        progress = ""
        if pull is not None and pull.total_bytes:
            progress = f" ({pull.status} {pull.current_bytes}/{pull.total_bytes} bytes)"
        node_id = lease.node_id
        self._state.transition(lease, ENDED, reason=LossReason.NOT_FOUND)
        return ImagePulling(
            f"image {lease.image!r} is still being pulled on node {node_id}{progress}; the pull"
            " goes on, retry shortly",
            retry_delay_s=RETRY_DELAY_S * 5,
            image=lease.image,
            node_id=node_id,
        )

    def pump(self) -> None:
        """Places queued requests, oldest first, wherever there is room now."""
        state = self._state
        if not state.queue:
            return
        free = state.global_free()
        pulls = self._pulls
        homes_of = pulls.homes_of if self._settings.pull else None
        placed: list[Lease] = []
        refused: list[tuple[Lease, SwerlError]] = []
        for lease in state.queue:
            choice = placement.choose(
                lease,
                state.nodes,
                state.index,
                free > 0,
                homes_of=homes_of,
                pulling_on=pulls.pulling_on(lease.image) if homes_of else (),
            )
            if choice is None:
                # Full for this request; a younger request for another image may still fit.
                continue
            if choice.pull and choice.node.node_id not in pulls.pulling_on(lease.image):
                try:  # Its image failed while it waited: no new pull before the backoff ends.
                    pulls.check(lease.image)
                except SwerlError as exc:
                    refused.append((lease, exc))
                    continue
            node, spare = choice.node, choice.spare
            if spare is None:
                free -= 1
            placed.append(lease)
            lease.wait_duration_s = time.time() - lease.create_time
            node.hold(lease.lease_id)
            lease.node_id, lease.node_address = node.node_id, node.address
            if spare is not None:
                node.pop_spare(spare.spare_id)
            if choice.pull:
                node.image_misses += 1
                lease.pull = pulls.start(node, lease.image, PullPriority.LEASE)
                state.transition(lease, PULLING)
            else:
                node.image_hits += 1
            state.spawn(self._place(lease, node, spare))
        for lease, error in refused:
            state.transition(lease, ENDED, error=error)
        if placed:
            ids = {id(lease) for lease in placed}
            state.queue[:] = [lease for lease in state.queue if id(lease) not in ids]
            metrics.WAITING.set(len(state.queue))
        elif state.queue and placement.spares_hold_room(state.index):
            # Requests wait while spares of other images hold the room: give one back.
            state.maintain_now.set()

    def _requeue(self, lease: Lease) -> None:
        self._state.queue.insert(0, lease)  # It keeps its place at the head.
        metrics.WAITING.set(len(self._state.queue))

    async def _await_pull(self, lease: Lease, node: Node, pull: Pull) -> bool:
        """Waits for the image pull `lease` is placed on; True when its sandbox is to be made
        now. A node that fails sends the lease back to the queue; a failed pull ends it with
        the pull's reason; a lease released or timed out meanwhile has given its room back."""
        state = self._state
        started = time.time()
        try:
            await asyncio.shield(pull.done)
        except NodeUnreachable as exc:
            if lease.state is PULLING:
                node.unhold(lease.lease_id)
                lease.node_id = lease.node_address = ""
                lease.pull = None
                lease.avoid.add(node.node_id)
                state.transition(lease, PENDING)
                log.warning("pool.pull_node_failed", lease_id=lease.lease_id, error=str(exc))
                self._requeue(lease)
                self.pump()
            return False
        except SwerlError as exc:
            if lease.state is PULLING:
                state.transition(lease, ENDED, error=exc)
            return False
        finally:
            waited = time.time() - started
            lease.pull_duration_s += waited
            lease.wait_duration_s += waited
        if lease.state is not PULLING:
            return False
        lease.pull = None
        state.transition(lease, PENDING)  # Pulled: its sandbox is made next.
        return True

    async def _place(self, lease: Lease, node: Node, spare: Spare | None) -> None:
        state = self._state
        slack = self._settings.node_expiry_slack_s
        if lease.pull is not None and not await self._await_pull(lease, node, lease.pull):
            return
        try:
            if spare is not None:
                facts = await node.conn.bind(
                    spare.sandbox_id,
                    lease.lease_id,
                    lease.owner,
                    lease.instance_id,
                    lease.ttl_s + slack,
                )
            else:
                facts = await node.conn.create(self._create_request(lease))
        except (NodeUnreachable, NodeFull, NodeImageMissing, NodeSandboxGone) as exc:
            node.unhold(lease.lease_id)
            lease.node_id = lease.node_address = ""
            if isinstance(exc, NodeImageMissing):
                node.images -= set(image_names(lease.image))
            if spare is None or isinstance(exc, NodeUnreachable):
                lease.avoid.add(node.node_id)
            log.warning(
                "pool.place_failed", lease_id=lease.lease_id, node_id=node.node_id, error=str(exc)
            )
            if lease.state is PENDING:
                self._requeue(lease)
            elif lease.state is RELEASING:
                state.finish(lease)
            self.pump()
            return
        except NodeRejected as exc:
            node.unhold(lease.lease_id)
            self.pump()
            error: SwerlError = (
                InvalidLeaseRequest(str(exc), node_reason=exc.reason)
                if exc.code == "INVALID_ARGUMENT"
                else Internal(f"the node refused the sandbox: {exc}")
            )
            self._fail(lease, error)
            return
        except Exception as exc:  # A bug must not leave the request waiting forever.
            node.unhold(lease.lease_id)
            log.exception("pool.place_error", lease_id=lease.lease_id)
            self._fail(lease, Internal(f"placing the lease failed: {exc!r}"))
            return
        now = time.time()
        lease.sandbox_id = facts.sandbox_id
        lease.node_expire_time = facts.expire_time
        lease.from_warm_spare = spare is not None
        if lease.state is not PENDING:  # Released while the sandbox was being made.
            state.start_destroy(lease)
            return
        lease.expire_time = now + lease.ttl_s
        self._tokens.issue(lease, lease.ttl_s)
        state.transition(lease, ACTIVE)
        metrics.ACQUIRE_SECONDS.labels("warm" if spare else "cold").observe(now - lease.create_time)
        if lease.ready is not None and not lease.ready.done():
            lease.ready.set_result(lease)
        if lease.waiters == 0:
            if not lease.request_id:  # Nobody will ever hold it.
                state.end(lease, LossReason.RELEASED, "the caller went away")
            else:  # The caller left mid-create; a retry with its request_id may still claim it.
                state.spawn(self._release_if_unclaimed(lease))
        if spare is not None:
            state.maintain_now.set()  # Refill.

    def _fail(self, lease: Lease, error: SwerlError) -> None:
        """A placement that cannot succeed: the lease ends and its callers get `error`."""
        if lease.state is not PENDING:  # Released while being placed: its room is given back.
            lease.node_id = lease.node_address = ""
        self._state.transition(lease, ENDED, error=error)

    async def _release_if_unclaimed(self, lease: Lease) -> None:
        await asyncio.sleep(self._settings.unclaimed_grace_s)
        if lease.state is ACTIVE and not lease.claimed and not lease.watchers:
            message = "every AcquireLease caller went away before it was ready"
            self._state.end(lease, LossReason.RELEASED, message)

    def _create_request(self, lease: Lease) -> CreateRequest:
        labels = {**lease.spec.labels, LABEL_TTL: f"{lease.ttl_s:g}"}
        if lease.request_id:
            labels[LABEL_REQUEST] = lease.request_id
        return lease.spec.create_request(
            request_id=lease.lease_id,
            image=lease.image,
            ttl_s=lease.ttl_s + self._settings.node_expiry_slack_s,
            lease_id=lease.lease_id,
            owner=lease.owner,
            instance_id=lease.instance_id,
            labels=labels,
        )
