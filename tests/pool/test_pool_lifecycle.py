"""The lease lifecycle on its own: each move of PoolState.transition keeps every collection that
depends on a lease's state in step, and moves the lifecycle does not have are refused. Placement
is checked as the pure function it is: same inputs, same node, nothing changed."""

from __future__ import annotations

import asyncio
import time

import pytest

from swerl.devservers.simulated_nodes import SimulatedNode
from swerl.pool import placement
from swerl.pool.errors import ImageNotPresent, LeaseCancelled, NodeFull
from swerl.pool.model import (
    Lease,
    LeaseState,
    LossReason,
    Lost,
    Node,
    NodeState,
    Spare,
    Spec,
    Watcher,
)
from swerl.pool.placement import Choice
from swerl.pool.settings import PoolSettings
from swerl.pool.state import InvalidTransition, PoolState

IMAGE = "swerl-base:bookworm"


@pytest.fixture
def state(tmp_path) -> PoolState:
    return PoolState(PoolSettings(insecure=True, port=0, state_dir=tmp_path))


def add_node(state: PoolState, node_id: str, **kwargs) -> Node:
    node = Node(
        node_id=node_id,
        address=f"{node_id}:1",
        conn=SimulatedNode(node_id),
        asked_capacity=kwargs.pop("capacity", 4),
        labels=kwargs.pop("labels", {}),
        register_time=time.time(),
        state=kwargs.pop("node_state", NodeState.HEALTHY),
        images=set(kwargs.pop("images", [IMAGE])),
    )
    state.nodes[node_id] = node
    state.index.add(node)
    return node


def new_lease(lease_id: str = "lse-1", request_id: str = "req-1", **kwargs) -> Lease:
    return Lease(
        lease_id=lease_id,
        request_id=request_id,
        image=kwargs.pop("image", IMAGE),
        instance_id="",
        owner="",
        ttl_s=30.0,
        spec=Spec(),
        spec_key=Spec().key(),
        node_selector=kwargs.pop("node_selector", {}),
        create_time=time.time(),
        ready=asyncio.get_running_loop().create_future(),
        **kwargs,
    )


def place(state: PoolState, lease: Lease, node: Node) -> None:
    """What the queue does when it chooses a node for a lease."""
    state.queue.remove(lease)
    node.hold(lease.lease_id)
    lease.node_id, lease.node_address = node.node_id, node.address


async def test_a_lease_moves_through_every_state_and_every_index_follows(state):
    node = add_node(state, "a")
    lease = new_lease()
    state.admit(lease)
    assert lease.state is LeaseState.PENDING
    assert state.queue == [lease] and state.by_request == {"req-1": lease}

    place(state, lease, node)
    lease.expire_time = time.time() + 30
    assert state.transition(lease, LeaseState.ACTIVE)
    assert state.active == {"lse-1": lease} and node.leases == {"lse-1"}
    assert [entry[2] for entry in state.expiries] == ["lse-1"]

    watcher = Watcher()
    watcher.leases.add(lease.lease_id)
    lease.watchers.add(watcher)
    assert state.transition(lease, LeaseState.RELEASING, reason=LossReason.EXPIRED, message="m")
    assert (lease.loss_reason, lease.loss_message) == (LossReason.EXPIRED, "m")
    assert not state.active and state.releasing == {"lse-1": lease}
    assert watcher.events.get_nowait() == Lost("lse-1", LossReason.EXPIRED, "m")
    assert not watcher.leases and not lease.watchers
    assert node.leases == {"lse-1"}  # The room stays held until the destroy is confirmed.

    assert state.transition(lease, LeaseState.ENDED)
    assert not node.leases and not state.releasing and not state.by_request
    assert list(state.ended) == [lease] and state.leases == {"lse-1": lease}
    # A second confirmation (a sync and a destroy both saw it gone) changes nothing.
    assert not state.transition(lease, LeaseState.ENDED)
    assert list(state.ended) == [lease]


@pytest.mark.parametrize(
    ("start", "to"),
    [
        (LeaseState.ACTIVE, LeaseState.PENDING),
        (LeaseState.ACTIVE, LeaseState.ENDED),
        (LeaseState.RELEASING, LeaseState.ACTIVE),
        (LeaseState.ENDED, LeaseState.ACTIVE),
        (LeaseState.PENDING, LeaseState.PENDING),
    ],
)
async def test_moves_the_lifecycle_does_not_have_are_refused(state, start, to):
    lease = new_lease(state=start)
    with pytest.raises(InvalidTransition):
        state.transition(lease, to)
    assert lease.state is start


async def test_a_lease_dropped_from_the_queue_ends_and_its_callers_are_told(state):
    lease = new_lease()
    state.admit(lease)
    state.transition(lease, LeaseState.ENDED, reason=LossReason.RELEASED)
    assert not state.queue and not state.by_request and list(state.ended) == [lease]
    assert lease.loss_reason is LossReason.RELEASED
    assert isinstance(lease.ready.exception(), LeaseCancelled)


async def test_a_failed_placement_ends_the_lease_with_the_error_and_no_node(state):
    node = add_node(state, "a")
    lease = new_lease()
    state.admit(lease)
    place(state, lease, node)
    node.unhold(lease.lease_id)
    error = NodeFull("full")
    state.transition(lease, LeaseState.ENDED, error=error)
    assert (lease.node_id, lease.loss_reason) == ("", None)
    assert lease.ready.exception() is error and not state.by_request


async def test_a_lease_released_while_being_placed_waits_in_releasing(state):
    node = add_node(state, "a")
    lease = new_lease()
    state.admit(lease)
    place(state, lease, node)
    state.transition(lease, LeaseState.RELEASING)
    assert lease.loss_reason is LossReason.RELEASED and state.releasing == {"lse-1": lease}
    assert node.leases == {"lse-1"} and not lease.ready.done()


async def test_an_adopted_lease_enters_active_and_holds_its_node(state):
    node = add_node(state, "a")
    lease = new_lease(state=LeaseState.ACTIVE, node_id="a", expire_time=time.time() + 5)
    state.admit(lease)
    assert state.active == {"lse-1": lease} and node.leases == {"lse-1"}
    assert state.by_request == {"req-1": lease} and not state.queue
    with pytest.raises(InvalidTransition):
        state.admit(new_lease("lse-2", "req-2", state=LeaseState.RELEASING))


async def test_placement_prefers_a_ready_spare_then_the_least_loaded_node(state):
    busy = add_node(state, "busy")
    idle = add_node(state, "idle")
    busy.hold("other")
    lease = new_lease()
    assert placement.choose(lease, state.nodes, state.index, True) == Choice(idle)
    spare = Spare("spr-1", "busy", IMAGE, Spec().key(), "sb-1", ready=True)
    busy.put_spare(spare)
    assert placement.choose(lease, state.nodes, state.index, True) == Choice(busy, spare)
    # A spare serves even when the global cap allows no new sandbox.
    assert placement.choose(lease, state.nodes, state.index, False) == Choice(busy, spare)
    lease.avoid.add("busy")
    assert placement.choose(lease, state.nodes, state.index, False) is None
    assert placement.choose(lease, state.nodes, state.index, True) == Choice(idle)
    # Nothing was taken: choosing is not placing.
    assert idle.leases == set() and busy.spares == {"spr-1": spare}


async def test_placement_skips_nodes_that_are_full_unhealthy_unlabelled_or_lack_the_image(state):
    add_node(state, "full", capacity=1).hold("x")
    add_node(state, "sick", node_state=NodeState.UNHEALTHY)
    add_node(state, "other", labels={"zone": "b"})
    add_node(state, "bare", images=["other:1"], labels={"zone": "a"})
    lease = new_lease(node_selector={"zone": "a"})
    assert placement.choose(lease, state.nodes, state.index, True) is None
    right = add_node(state, "right", labels={"zone": "a"})
    assert placement.choose(lease, state.nodes, state.index, True) == Choice(right)
    assert placement.node_for_spare(IMAGE, state.index) is not None


async def test_an_image_no_healthy_node_has_is_refused_but_no_healthy_node_may_wait(state):
    placement.check_image(IMAGE, {}, state.nodes)  # No node at all: it may wait for one.
    add_node(state, "a", images=["other:1"])
    with pytest.raises(ImageNotPresent):
        placement.check_image(IMAGE, {}, state.nodes)
    placement.check_image("other:1", {}, state.nodes)


async def test_placement_pulls_on_a_node_pulling_the_image_then_a_home_then_any_node(state):
    bare = add_node(state, "bare", images=["other:1"])
    home = add_node(state, "home", images=["other:1"])
    lease = new_lease()
    # Without homes_of (--no-pull) an image nobody has fits nowhere.
    assert placement.choose(lease, state.nodes, state.index, True) is None
    home.hold("x")  # The home is busier than `bare`, and still chosen over it.
    assert placement.choose(
        lease, state.nodes, state.index, True, homes_of=lambda image: ["home", "bare"]
    ) == Choice(home, pull=True)
    # A node already pulling the image comes before the homes (the lease joins that pull).
    assert placement.choose(
        lease,
        state.nodes,
        state.index,
        True,
        homes_of=lambda image: ["home"],
        pulling_on={"bare": object()},
    ) == Choice(bare, pull=True)
    # A home the lease must avoid (or a full one): the least loaded node with room pulls.
    lease.avoid.add("home")
    assert placement.choose(
        lease, state.nodes, state.index, True, homes_of=lambda image: ["home"]
    ) == Choice(bare, pull=True)
    # A node that has the image always wins over pulling.
    has = add_node(state, "has")
    has.hold("y")
    has.hold("z")
    assert placement.choose(
        lease, state.nodes, state.index, True, homes_of=lambda image: ["home"]
    ) == Choice(has)


def test_homes_are_stable_and_a_leaving_node_moves_only_its_share():
    nodes = [f"node-{i}" for i in range(32)]
    images = [f"xingyaoww/sweb.eval.x86_64.task_s_{i}:latest" for i in range(2000)]
    before = placement.homes_by_image(images, nodes, 2)
    assert all(len(h) == 2 and h[0] != h[1] for h in before.values())
    # About 2/N of the images per node: no node is home to more than twice its share.
    load: dict[str, int] = {}
    for h in before.values():
        for node_id in h:
            load[node_id] = load.get(node_id, 0) + 1
    assert max(load.values()) < 2 * 2 * len(images) / len(nodes)
    # Node order does not matter, and names Docker treats as one image hash as one.
    assert placement.homes(images[0], list(reversed(nodes)), 2) == before[images[0]]
    assert placement.homes("docker.io/library/python:3.11", nodes, 2) == placement.homes(
        "python:3.11", nodes, 2
    )
    after = placement.homes_by_image(images, [n for n in nodes if n != "node-7"], 2)
    moved = [image for image in images if before[image] != after[image]]
    assert moved and all("node-7" in before[image] for image in moved)
    # Those images keep their other home.
    assert all(set(before[i]) - {"node-7"} <= set(after[i]) for i in moved)
