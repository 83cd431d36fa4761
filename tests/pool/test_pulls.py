"""On-demand and prefetch image pulls through the pool, over simulated nodes that pull from a
simulated registry (behind the NodeConnection Protocol): shared pulls, PULLING leases, precise
failure reasons for every waiter, no retry storms, deadlines, prefetch priority."""

from __future__ import annotations

import asyncio
import time

import pytest

from swerl.devservers.simulated_nodes import SimulatedNode, SimulatedRegistry
from swerl.pool.errors import (
    ImageNotFound,
    ImagePulling,
    ImageTooLarge,
    LeaseCancelled,
    PullFailed,
    RegistryAuth,
    RegistryUnreachable,
)
from swerl.pool.leases import ENDED, PULLING, AcquireRequest, Pool
from swerl.pool.settings import PoolSettings

TASK = "registry.local:5000/swe/task-1:latest"
GIB = 1 << 30


class PullSim:
    """A Pool over simulated nodes sharing one simulated registry."""

    def __init__(self, tmp_path, **settings) -> None:
        self.registry = SimulatedRegistry({TASK: GIB, "registry.local:5000/swe/task-2:latest": GIB})
        self.nodes: dict[str, SimulatedNode] = {}
        self.settings = PoolSettings(
            insecure=True,
            port=0,
            state_dir=tmp_path,
            capability_secret="s3cret",
            health_retry_interval_s=0.05,
            expiry_interval_s=0.05,
            maintenance_interval_s=0.1,
            pull_backoff_s=0.3,
            **settings,
        )
        self.pool = Pool(self.settings, self.nodes.__getitem__)

    async def add(self, node_id: str, **kwargs) -> SimulatedNode:
        kwargs.setdefault("images", ["swerl-base:bookworm"])
        kwargs.setdefault("pull_bytes_per_s", 4 * GIB)  # a 1 GiB image in 0.25 s
        node = SimulatedNode(node_id, registry=self.registry, **kwargs)
        self.nodes[f"{node_id}:1"] = node
        await self.pool.register_node(node_id, f"{node_id}:1", 0, {})
        return node

    async def acquire(self, image: str = TASK, **kwargs):
        return await self.pool.acquire(AcquireRequest(image=image, **kwargs))

    def pulls(self) -> int:
        return sum(node.calls.get("pull", 0) for node in self.nodes.values())


@pytest.fixture
async def sim(tmp_path):
    sim = PullSim(tmp_path)
    await sim.pool.start()
    yield sim
    await sim.pool.stop()


async def test_a_lease_for_an_image_only_the_registry_has_waits_on_one_pull(sim):
    node = await sim.add("a")
    pending = asyncio.ensure_future(sim.acquire(wait_s=10))
    await asyncio.sleep(0.05)
    (listed,) = sim.pool.list_leases()
    assert listed.state is PULLING and listed.node_id == "a"
    assert listed.pull is not None and listed.pull.total_bytes == GIB
    lease = await pending
    assert lease.sandbox_id in node.sandboxes and TASK in node.image_names
    # The wait reports the pull it spent.
    assert 0.2 < lease.pull_duration_s <= lease.wait_duration_s
    assert lease.pull is None and node.calls["pull"] == 1
    # The next lease of the image finds it there: no second pull.
    again = await sim.acquire()
    assert (again.node_id, again.pull_duration_s, node.calls["pull"]) == ("a", 0.0, 1)
    assert sim.pool.nodes["a"].image_hits == 1 and sim.pool.nodes["a"].image_misses == 1


async def test_eight_concurrent_acquires_of_one_missing_image_share_one_pull(sim):
    for name in ("a", "b", "c"):
        await sim.add(name)
    leases = await asyncio.gather(*(sim.acquire(owner=f"w{i}", wait_s=10) for i in range(8)))
    assert sim.pulls() == 1
    assert len({lease.node_id for lease in leases}) == 1
    assert all(lease.pull_duration_s > 0 for lease in leases)
    # It went to one of the image's home nodes.
    assert leases[0].node_id in sim.pool._pulls.homes_of(TASK)


async def test_registry_down_answers_every_waiter_with_its_reason_and_no_retry_storm(sim):
    present = "registry.local:5000/swe/present:1"
    await sim.add("a", images=[present])
    await sim.add("b")
    sim.registry.down = True
    started = time.monotonic()
    results = await asyncio.gather(
        *(sim.acquire(owner=f"w{i}", wait_s=30) for i in range(8)), return_exceptions=True
    )
    assert all(isinstance(r, RegistryUnreachable) for r in results), results
    assert time.monotonic() - started < 5  # At once, long before the 30 s deadlines.
    assert results[0].retry_delay_s > 0 and results[0].metadata["image"] == TASK
    assert sim.pulls() == 1
    # Within the backoff, more requests (for any image of that registry) start no pull.
    for image in (TASK, "registry.local:5000/swe/task-2:latest"):
        with pytest.raises(RegistryUnreachable):
            await sim.acquire(image, wait_s=30)
    assert sim.pulls() == 1
    # An image of that registry already on a node needs no pull: it is served meanwhile.
    served = await sim.acquire(present, wait_s=5)
    await sim.pool.release(served.lease_id)
    # Past the backoff the registry is tried again, and works.
    sim.registry.down = False
    await asyncio.sleep(0.35)
    lease = await sim.acquire(wait_s=10)
    assert lease.sandbox_id and sim.pulls() == 2


@pytest.mark.parametrize(
    ("setup", "error"),
    [
        ("missing", ImageNotFound),
        ("auth", RegistryAuth),
        ("too_large", ImageTooLarge),
    ],
)
async def test_a_pull_no_retry_can_cure_is_answered_and_remembered(sim, setup, error):
    image = TASK
    budget = 0
    if setup == "missing":
        image = "registry.local:5000/swe/absent:1"
    elif setup == "auth":
        sim.registry.auth_failure = True
    else:
        budget = GIB // 2
    await sim.add("a", image_budget_bytes=budget)
    results = await asyncio.gather(
        *(sim.acquire(image, wait_s=10) for _ in range(3)), return_exceptions=True
    )
    assert all(isinstance(r, error) for r in results), results
    with pytest.raises(error):
        await sim.acquire(image, wait_s=10)
    assert sim.pulls() == 1
    # Every waiter's room was given back.
    assert sim.pool.nodes["a"].leases == set()


async def test_a_broken_pull_is_retried_once_then_reported(sim):
    await sim.add("a")
    sim.registry.cut_pulls = 1
    lease = await sim.acquire(wait_s=10)
    assert lease.sandbox_id and sim.pulls() == 2
    sim.registry.cut_pulls = 2
    with pytest.raises(PullFailed):
        await sim.acquire("registry.local:5000/swe/task-2:latest", wait_s=10)
    assert sim.pulls() == 4


async def test_a_wait_that_runs_out_while_pulling_ends_the_lease_but_not_the_pull(sim):
    node = await sim.add("a", pull_bytes_per_s=GIB)  # 1 s
    with pytest.raises(ImagePulling) as caught:
        await sim.acquire(wait_s=0.3)
    assert caught.value.retry_delay_s > 0
    assert sim.pool.nodes["a"].leases == set()  # Its room is free again.
    (ended,) = sim.pool.list_leases(states=[ENDED])
    assert ended.pull is None
    await asyncio.sleep(1.0)
    assert TASK in node.image_names  # The pull went on.
    lease = await sim.acquire(wait_s=5)
    assert lease.pull_duration_s == 0.0 and node.calls["pull"] == 1


async def test_releasing_a_pulling_lease_frees_its_room_at_once(sim):
    await sim.add("a", pull_bytes_per_s=GIB)
    pending = asyncio.ensure_future(sim.acquire(request_id="r1", wait_s=10))
    await asyncio.sleep(0.05)
    (lease,) = sim.pool.list_leases()
    existed, after = await sim.pool.release(lease.lease_id)
    assert existed and after.state is ENDED and sim.pool.nodes["a"].leases == set()
    with pytest.raises(LeaseCancelled):
        await pending


async def test_a_node_lost_during_a_pull_sends_its_lease_to_another_node(sim):
    a = await sim.add("a", pull_bytes_per_s=GIB)
    b = await sim.add("b", pull_bytes_per_s=GIB)
    pending = asyncio.ensure_future(sim.acquire(wait_s=10))
    await asyncio.sleep(0.1)
    (lease,) = sim.pool.list_leases()
    first, other = (a, b) if lease.node_id == "a" else (b, a)
    first.set_down(True)
    done = await pending
    assert done.node_id == other.node_id and done.sandbox_id in other.sandboxes


async def test_prefetch_pulls_on_the_best_home_once(tmp_path):
    sim = PullSim(tmp_path, image_replicas=2)
    await sim.pool.start()
    try:
        for name in ("a", "b", "c", "d"):
            await sim.add(name)
        images = [f"registry.local:5000/swe/p{i}:1" for i in range(6)]
        sim.registry.images.update(dict.fromkeys(images, GIB))
        done = sim.pool.prefetch([*images, images[0]])
        assert [p.image for p in done] == images  # once each, in order
        assert all(p.status == "STARTED" and p.node_id == p.homes[0] for p in done)
        assert all(len(p.homes) == 2 for p in done)
        # A repeat while pulling starts nothing new; once pulled, the homes have them.
        again = sim.pool.prefetch(images)
        assert [p.status for p in again] == ["STARTED"] * 6
        await asyncio.sleep(1.0)
        last = sim.pool.prefetch(images)
        assert [p.status for p in last] == ["PRESENT"] * 6
        assert sim.pulls() == 6
        # A lease of a prefetched image is a hit on its home.
        lease = await sim.acquire(images[0], wait_s=5)
        assert lease.node_id == done[0].node_id and lease.pull_duration_s == 0.0
    finally:
        await sim.pool.stop()


async def test_a_lease_pull_goes_ahead_of_queued_prefetches(tmp_path):
    sim = PullSim(tmp_path, pulls_per_node=1)
    await sim.pool.start()
    try:
        node = await sim.add("a", pull_bytes_per_s=4 * GIB)
        images = [f"registry.local:5000/swe/p{i}:1" for i in range(4)]
        sim.registry.images.update(dict.fromkeys(images, GIB))
        sim.pool.prefetch(images)
        lease = await sim.acquire(TASK, wait_s=10)
        # Only the prefetch already running when the lease came finished before its pull.
        assert node.pulled[:2] == [images[0], TASK], node.pulled
        assert lease.sandbox_id
    finally:
        await sim.pool.stop()


async def test_no_pull_prefetches_nothing(tmp_path):
    sim = PullSim(tmp_path, pull=False)
    await sim.pool.start()
    try:
        await sim.add("a")
        (done,) = sim.pool.prefetch([TASK])
        assert done.status == "SKIPPED" and sim.pulls() == 0
    finally:
        await sim.pool.stop()


async def test_a_queued_lease_whose_registry_failed_meanwhile_gets_the_error_not_a_pull(sim):
    node = await sim.add("a", capacity=1)
    holder = await sim.acquire("swerl-base:bookworm")
    sim.registry.down = True
    queued = asyncio.ensure_future(sim.acquire(TASK, wait_s=30))
    await asyncio.sleep(0.05)
    assert not queued.done()  # No room: it waits in the queue.
    (prefetched,) = sim.pool.prefetch(["registry.local:5000/swe/task-2:latest"])
    assert prefetched.status == "STARTED"
    await asyncio.sleep(0.05)  # That pull failed: the registry is remembered down.
    await sim.pool.release(holder.lease_id)
    with pytest.raises(RegistryUnreachable):
        await queued
    assert node.calls["pull"] == 1
