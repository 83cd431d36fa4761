"""The pool's domain over simulated nodes (behind the NodeConnection Protocol): placement order,
caps, FIFO waits, expiry, node loss, destroy failures, drain and restart reconciliation."""

from __future__ import annotations

import asyncio
import time

import pytest

from swerl.chassis import capability
from swerl.devservers.simulated_nodes import SimulatedNode
from swerl.pool.errors import ImageNotPresent, InvalidLeaseRequest, NodeNotFound, PoolAtCapacity
from swerl.pool.leases import (
    ACTIVE,
    ENDED,
    N_DRAINED,
    N_DRAINING,
    RELEASING,
    RENEW_SLICE,
    AcquireRequest,
    Expiry,
    ExpiryBatch,
    Lost,
    Pool,
    Spec,
)
from swerl.pool.settings import PoolSettings
from swerl.pool.store import PoolStore

IMAGE = "swerl-base:bookworm"


class Sim:
    """A Pool over simulated nodes keyed by address."""

    def __init__(self, tmp_path, **settings) -> None:
        self.nodes: dict[str, SimulatedNode] = {}
        self.settings = PoolSettings(
            insecure=True,
            port=0,
            state_dir=tmp_path,
            capability_secret="s3cret",
            health_retry_interval_s=0.05,
            expiry_interval_s=0.05,
            maintenance_interval_s=0.1,
            node_expiry_slack_s=1.0,
            **settings,
        )
        self.store = PoolStore(tmp_path / "pool.sqlite")
        self.pool = Pool(self.settings, self.nodes.__getitem__, self.store)

    async def add(self, node_id: str, **kwargs) -> SimulatedNode:
        node = self.nodes.setdefault(f"{node_id}:1", SimulatedNode(node_id, **kwargs))
        await self.pool.register_node(node_id, f"{node_id}:1", 0, {})
        return node

    async def acquire(self, **kwargs):
        return await self.pool.acquire(AcquireRequest(image=kwargs.pop("image", IMAGE), **kwargs))

    async def restart(self) -> None:
        await self.pool.stop()
        self.pool = Pool(self.settings, self.nodes.__getitem__, self.store)
        await self.pool.start()


@pytest.fixture
async def sim(tmp_path):
    sim = Sim(tmp_path, max_leases=10)
    await sim.pool.start()
    yield sim
    await sim.pool.stop()


async def eventually(predicate, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_least_loaded_node_gets_the_lease(sim):
    await sim.add("a")
    for _ in range(2):
        await sim.acquire()
    await sim.add("b")
    lease = await sim.acquire()
    assert lease.node_id == "b"


async def test_node_with_the_image_wins_over_a_less_loaded_one(sim):
    await sim.add("has", images=[IMAGE])
    await sim.acquire()
    await sim.add("lacks", images=["other:1"])
    lease = await sim.acquire()
    assert lease.node_id == "has"


async def test_missing_image_everywhere_fails_at_once_with_no_pull(tmp_path):
    sim = Sim(tmp_path, pull=False)
    await sim.pool.start()
    try:
        node = await sim.add("a", images=["other:1"])
        with pytest.raises(ImageNotPresent):
            await sim.acquire(wait_s=30)
        assert "pull" not in node.calls  # --no-pull: the node is never asked to pull.
    finally:
        await sim.pool.stop()


async def test_warm_spare_wins_over_a_less_loaded_node(sim):
    await sim.add("a")
    await sim.acquire()
    sim.pool.prewarm(IMAGE, 1, Spec())
    await eventually(lambda: sim.pool.spare_counts(IMAGE, Spec().key())[0] == 1)
    await sim.add("b")
    lease = await sim.acquire()
    assert (lease.node_id, lease.from_warm_spare) == ("a", True)
    # The spare was bound to the lease on the node, and the target refills.
    assert sim.nodes["a:1"].sandboxes[lease.sandbox_id].lease_id == lease.lease_id
    await eventually(lambda: sim.pool.spare_counts(IMAGE, Spec().key())[0] == 1)


async def test_spare_with_another_spec_is_not_used(sim):
    await sim.add("a")
    sim.pool.prewarm(IMAGE, 1, Spec(workdir="/srv"))
    await eventually(lambda: sim.pool.spare_counts(IMAGE, Spec(workdir="/srv").key())[0] == 1)
    lease = await sim.acquire()
    assert not lease.from_warm_spare


async def test_per_node_and_global_caps_hold_under_100_concurrent_acquires(sim):
    for name in ("a", "b", "c"):
        await sim.add(name, capacity=4, create_latency_s=0.01)
    results = await asyncio.gather(
        *(sim.acquire(wait_s=0.5) for _ in range(100)), return_exceptions=True
    )
    leases = [r for r in results if not isinstance(r, BaseException)]
    assert len(leases) == 10
    assert all(isinstance(r, PoolAtCapacity) for r in results if isinstance(r, BaseException))
    assert max(len(n.sandboxes) for n in sim.nodes.values()) <= 4
    assert sum(len(n.sandboxes) for n in sim.nodes.values()) == 10


async def test_waiters_are_served_first_come_first_served(tmp_path):
    sim = Sim(tmp_path, max_leases=1)
    await sim.pool.start()
    try:
        await sim.add("a")
        held = await sim.acquire()
        order: list[str] = []

        async def wait(name: str):
            lease = await sim.acquire(owner=name, wait_s=10)
            order.append(name)
            await sim.pool.release(lease.lease_id)

        tasks = []
        for name in ("first", "second", "third"):
            tasks.append(asyncio.create_task(wait(name)))
            await asyncio.sleep(0.02)
        await sim.pool.release(held.lease_id)
        await asyncio.gather(*tasks)
        assert order == ["first", "second", "third"]
    finally:
        await sim.pool.stop()


async def test_full_pool_times_out_with_retry_delay(tmp_path):
    sim = Sim(tmp_path, max_leases=1)
    await sim.pool.start()
    try:
        await sim.add("a")
        await sim.acquire()
        started = time.monotonic()
        with pytest.raises(PoolAtCapacity) as caught:
            await sim.acquire(wait_s=0.3)
        assert 0.25 < time.monotonic() - started < 2.0
        assert caught.value.retry_delay_s > 0
        assert not sim.pool._queue
    finally:
        await sim.pool.stop()


async def test_same_request_id_returns_the_same_lease(sim):
    await sim.add("a")
    first, second = await asyncio.gather(
        sim.acquire(request_id="r-1"), sim.acquire(request_id="r-1")
    )
    third = await sim.acquire(request_id="r-1")
    assert first.lease_id == second.lease_id == third.lease_id
    assert len(sim.nodes["a:1"].sandboxes) == 1


async def _cancel_mid_create(sim, request_id: str):
    """Starts an acquire on a slow node and cancels it while the sandbox is being made."""
    node = await sim.add("slow", create_latency_s=0.4)
    task = asyncio.create_task(sim.acquire(request_id=request_id))
    await eventually(lambda: node.calls.get("create", 0) == 1, 2.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    (lease,) = [lease for lease in sim.pool.leases.values() if lease.request_id == request_id]
    return node, lease


async def test_lease_whose_caller_cancelled_mid_create_is_released_after_the_grace(tmp_path):
    sim = Sim(tmp_path, unclaimed_grace_s=0.3)
    await sim.pool.start()
    try:
        node, lease = await _cancel_mid_create(sim, "r-gone")
        await eventually(lambda: lease.state == ACTIVE, 2.0)
        await eventually(lambda: lease.state == ENDED, 3.0)
        assert node.sandboxes == {}, "the sandbox of an abandoned acquire must be destroyed"
    finally:
        await sim.pool.stop()


async def test_retry_with_the_same_request_id_claims_a_lease_made_after_a_cancel(tmp_path):
    sim = Sim(tmp_path, unclaimed_grace_s=0.5)
    await sim.pool.start()
    try:
        node, lease = await _cancel_mid_create(sim, "r-back")
        again = await sim.acquire(request_id="r-back")
        assert again.lease_id == lease.lease_id
        await asyncio.sleep(0.8)
        assert lease.state == ACTIVE and len(node.sandboxes) == 1
    finally:
        await sim.pool.stop()


async def test_bad_requests_are_refused(sim):
    await sim.add("a")
    with pytest.raises(InvalidLeaseRequest):
        await sim.acquire(image="")
    with pytest.raises(InvalidLeaseRequest):
        await sim.acquire(ttl_s=-1)
    with pytest.raises(NodeNotFound):
        await sim.pool.drain_node("nope", False)


async def test_lease_without_renewals_expires_and_is_destroyed(sim):
    node = await sim.add("a")
    lease = await sim.acquire(ttl_s=0.3)
    await eventually(lambda: lease.state == ENDED, 2.0)
    assert lease.loss_reason == "EXPIRED"
    assert not node.sandboxes


async def test_renewal_extends_the_lease_and_issues_a_fresh_token(sim):
    await sim.add("a")
    lease = await sim.acquire(ttl_s=0.5)
    watcher = sim.pool.open_watcher()
    first_token = lease.token
    for _ in range(4):
        await asyncio.sleep(0.2)
        await sim.pool.renew(watcher, lease.lease_id, 0.5)
    assert lease.state == ACTIVE
    events = [watcher.events.get_nowait() for _ in range(watcher.events.qsize())]
    assert all(isinstance(e, Expiry) for e in events)
    assert events[-1].token != first_token


async def test_lost_node_pushes_lost_and_new_leases_avoid_it(sim):
    a = await sim.add("a")
    lease = await sim.acquire()
    await sim.add("b")
    watcher = sim.pool.open_watcher()
    sim.pool.watch(watcher, lease.lease_id)
    assert isinstance(await watcher.events.get(), Expiry)
    a.set_down(True)
    lost = await asyncio.wait_for(watcher.events.get(), 2.0)
    assert isinstance(lost, Lost) and lost.reason == "NODE_LOST"
    assert (await sim.acquire()).node_id == "b"
    # The node returns: the lost lease's sandbox is destroyed, its capacity freed.
    a.set_down(False)
    await eventually(lambda: lease.state == ENDED and not a.sandboxes)


async def test_capacity_stays_held_until_the_node_confirms_the_destroy(tmp_path):
    sim = Sim(tmp_path, max_leases=1)
    await sim.pool.start()
    try:
        node = await sim.add("a")
        lease = await sim.acquire()
        node.fail_destroy = True
        await sim.pool.release(lease.lease_id)
        assert lease.state == RELEASING
        with pytest.raises(PoolAtCapacity):
            await sim.acquire(wait_s=0.4)
        node.fail_destroy = False
        again = await sim.acquire(wait_s=3)
        assert lease.state == ENDED and again.state == ACTIVE
    finally:
        await sim.pool.stop()


async def test_drained_node_gets_no_leases_and_is_drained_when_empty(sim):
    await sim.add("a")
    lease = await sim.acquire()
    await sim.add("b")
    node = await sim.pool.drain_node("a", False)
    assert node.state == N_DRAINING
    assert (await sim.acquire()).node_id == "b"
    await sim.pool.release(lease.lease_id)
    assert sim.pool.nodes["a"].state == N_DRAINED


async def test_drain_with_evict_revokes_leases(sim):
    await sim.add("a")
    lease = await sim.acquire()
    await sim.pool.drain_node("a", True)
    await eventually(lambda: lease.state == ENDED)
    assert lease.loss_reason == "REVOKED"


async def test_restarted_pool_rebuilds_its_leases_from_the_nodes(sim):
    await sim.add("a")
    await sim.add("b")
    leases = [await sim.acquire(request_id=f"r-{i}", owner=f"o{i}") for i in range(3)]
    sim.pool.prewarm(IMAGE, 1, Spec())
    await eventually(lambda: sim.pool.spare_counts(IMAGE, Spec().key())[0] == 1)
    await sim.restart()
    await eventually(lambda: len(sim.pool.list_leases(states=[ACTIVE])) == 3)
    for old in leases:
        new = sim.pool.leases[old.lease_id]
        assert (new.node_id, new.sandbox_id, new.owner) == (old.node_id, old.sandbox_id, old.owner)
        watcher = sim.pool.open_watcher()
        await sim.pool.renew(watcher, old.lease_id, 5)
        assert isinstance(watcher.events.get_nowait(), Expiry)
    # Idempotency survives too, and the spare is adopted rather than made again.
    assert (await sim.acquire(request_id="r-1")).lease_id == leases[1].lease_id
    await eventually(lambda: sim.pool.spare_counts(IMAGE, Spec().key())[0] == 1)
    assert sum(len(n.sandboxes) for n in sim.nodes.values()) == 4


async def test_batched_renewal_answers_once_and_reports_ended_leases(sim):
    await sim.add("a")
    alive = [await sim.acquire(ttl_s=5) for _ in range(3)]
    ended = await sim.acquire()
    await sim.pool.release(ended.lease_id)
    watcher = sim.pool.open_watcher()
    await sim.pool.renew_batch(watcher, [(x.lease_id, 5) for x in [*alive, ended]])
    events = [watcher.events.get_nowait() for _ in range(watcher.events.qsize())]
    lost = [e for e in events if isinstance(e, Lost)]
    batches = [e for e in events if isinstance(e, ExpiryBatch)]
    assert [e.lease_id for e in lost] == [ended.lease_id]
    assert len(batches) == 1
    assert {e.lease_id for e in batches[0].expiries} == {x.lease_id for x in alive}


async def test_renewals_keep_the_token_while_it_covers_the_grace_then_issue_a_new_one(tmp_path):
    sim = Sim(tmp_path, token_grace_s=60.0, token_reissue_fraction=0.25)
    await sim.pool.start()
    try:
        await sim.add("a")
        lease = await sim.acquire(ttl_s=8)
        secret = b"s3cret"

        def check_token(ttl_s: float) -> None:
            # Valid for the lease's sandbox at least token_grace_s past the lease's expiry, and
            # at most a further ttl x fraction (the ttl it was minted with: 8 x 0.25 = 2 s).
            claims = capability.verify(secret, lease.token)
            assert (claims.lease_id, claims.sandbox_id) == (lease.lease_id, lease.sandbox_id)
            assert claims.expire_time >= lease.expire_time + 60.0
            assert claims.expire_time <= lease.expire_time + 60.0 + ttl_s * 0.25 + 0.001

        check_token(8)
        first = lease.token
        watcher = sim.pool.open_watcher()
        await sim.pool.renew_batch(watcher, [(lease.lease_id, 9)])  # 1 s further: kept.
        assert lease.token == first
        check_token(8)
        await sim.pool.renew_batch(watcher, [(lease.lease_id, 12)])  # 4 s further: new one.
        assert lease.token != first
        check_token(12)
        batches = [watcher.events.get_nowait() for _ in range(watcher.events.qsize())]
        assert [b.expiries[0].token for b in batches] == [first, lease.token]
    finally:
        await sim.pool.stop()


async def test_reissue_fraction_zero_mints_a_token_on_every_renewal(tmp_path):
    sim = Sim(tmp_path, token_reissue_fraction=0.0)
    await sim.pool.start()
    try:
        await sim.add("a")
        lease = await sim.acquire(ttl_s=8)
        watcher = sim.pool.open_watcher()
        seen = {lease.token}
        for ttl in (8.1, 8.2, 8.3):
            await sim.pool.renew_batch(watcher, [(lease.lease_id, ttl)])
            seen.add(lease.token)
            claims = capability.verify(b"s3cret", lease.token)
            assert claims.expire_time == pytest.approx(lease.expire_time + 60.0, abs=0.001)
        assert len(seen) == 4
    finally:
        await sim.pool.stop()


async def test_only_leases_that_are_not_renewed_expire(sim):
    await sim.add("a")
    renewed = [await sim.acquire(ttl_s=0.3) for _ in range(3)]
    left = [await sim.acquire(ttl_s=0.3) for _ in range(3)]
    watcher = sim.pool.open_watcher()
    deadline = time.monotonic() + 1.2  # Four lifetimes: every expiry entry comes due and moves.
    while time.monotonic() < deadline:
        await sim.pool.renew_batch(watcher, [(x.lease_id, 0.3) for x in renewed])
        await asyncio.sleep(0.1)
    assert all(x.state == ACTIVE for x in renewed)
    assert all(x.state == ENDED and x.loss_reason == "EXPIRED" for x in left)


async def test_a_large_renewal_batch_lets_other_work_run_between_slices(tmp_path):
    sim = Sim(tmp_path)
    await sim.pool.start()
    try:
        await sim.add("a", capacity=3 * RENEW_SLICE)
        leases = [await sim.acquire(ttl_s=30) for _ in range(3 * RENEW_SLICE)]
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        before = ticks
        watcher = sim.pool.open_watcher()
        await sim.pool.renew_batch(watcher, [(x.lease_id, 30) for x in leases])
        task.cancel()
        assert ticks - before >= 2, "the batch ran in one piece"
        batch = watcher.events.get_nowait()
        assert len(batch.expiries) == len(leases) and watcher.events.empty()
    finally:
        await sim.pool.stop()


async def test_ended_leases_are_listed_until_the_retention_passes(tmp_path):
    sim = Sim(tmp_path, ended_retention_s=0.3)
    await sim.pool.start()
    try:
        await sim.add("a")
        lease = await sim.acquire()
        await sim.pool.release(lease.lease_id)
        assert lease.state == ENDED
        assert [x.lease_id for x in sim.pool.list_leases(states=[ENDED])] == [lease.lease_id]
        await eventually(lambda: lease.lease_id not in sim.pool.leases, 2.0)
    finally:
        await sim.pool.stop()


async def test_simulated_node_reports_the_renewed_expiry(sim):
    node = await sim.add("a")
    lease = await sim.acquire(ttl_s=5)
    expire_time = await node.renew(lease.sandbox_id, 100)
    [facts] = await node.list_sandboxes()
    assert facts.expire_time == expire_time > time.time() + 99
    assert facts.lease_id == lease.lease_id


async def test_a_lease_avoids_the_nodes_its_holder_prefers_not_while_another_has_room(sim):
    await sim.add("a")
    await sim.add("b")
    # Without the preference the least loaded node would take every other lease.
    placed = [(await sim.acquire(prefer_not=frozenset({"a"}))).node_id for _ in range(3)]
    assert placed == ["b", "b", "b"]
    assert (await sim.acquire()).node_id == "a"  # the least loaded, asked plainly
    assert (await sim.acquire(prefer_not=frozenset({"b", "x"}))).node_id == "a"


async def test_a_lease_takes_a_node_it_prefers_not_when_no_other_has_room(sim):
    await sim.add("full", capacity=1)
    await sim.add("only", capacity=2)
    await sim.acquire(prefer_not=frozenset({"only"}))  # takes "full"'s one slot
    lease = await sim.acquire(prefer_not=frozenset({"only"}))
    assert lease.node_id == "only"
