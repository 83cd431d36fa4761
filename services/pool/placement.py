"""Where a sandbox goes: the choice of a node for a lease or a warm spare, and where an image
lives.

Pure functions over the pool's nodes and their load index: they read, never change anything, and
do no I/O. The queue (swerl.pool.queue) applies what they choose, one request at a time, so each
choice sees the room the previous one took.

A dataset's images do not fit on one node, so each image has a home set: the `k` nodes that rank
highest for it by rendezvous hashing (image x node id) over the healthy nodes. Each node is home
to about k/N of the dataset, and a node joining or leaving moves only the images it ranks first
for. Which nodes are hashed over (`home_candidates`) and how (`homes`) is decided here once: the
pool's pulls and `swerl images pull --replicas k` (over the pool's ListNodes) both call these two,
so what an operator pre-pulls is where the pool looks.

Order of choice for a lease: a ready warm spare of its image and spec; else the least loaded node
that has its image and room; else a node already pulling the image, with room (the lease joins
that pull); else a home node with room, in rank order (pull there); else the least loaded node
with room (pull there). Only HEALTHY nodes that match the lease's node selector and have not
failed this lease are considered; with pulls off (`--no-pull`) only the first two count. Nodes the
holder asked to avoid (`prefer_not`) are left out of that whole order first, and used only when
nothing else fits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from swerl.chassis.images import image_key
from swerl.pool.errors import ImageNotPresent
from swerl.pool.model import Lease, LoadIndex, Node, NodeState, Spare

HEALTHY = NodeState.HEALTHY


@dataclass(frozen=True)
class Choice:
    node: Node
    spare: Spare | None = None
    pull: bool = False  # the node must pull the image first (or is pulling it already)


def _score(key: bytes, node_id: str) -> int:
    digest = hashlib.blake2b(key + b"\0" + node_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def home_candidates(nodes: Iterable[tuple[str, NodeState]]) -> tuple[str, ...]:
    """The node ids image homes are hashed over, from (node id, state) pairs: the HEALTHY ones.

    A node that is unhealthy, draining, drained or not yet synced takes no new sandbox, so an
    image homed on it would be pulled elsewhere anyway; leaving it out moves only its share."""
    return tuple(node_id for node_id, state in nodes if state is HEALTHY)


def homes(image: str, node_ids: Iterable[str], k: int) -> list[str]:
    """The image's home set among `node_ids` (`home_candidates`' answer): the k node ids that
    score highest for it, best first."""
    key = image_key(image).encode()
    ranked = sorted(node_ids, key=lambda node_id: _score(key, node_id), reverse=True)
    return ranked[: max(k, 0)]


def homes_by_image(images: Iterable[str], node_ids: Sequence[str], k: int) -> dict[str, list[str]]:
    """`homes` of every image among `node_ids` (pre-pulling a dataset: pass `home_candidates`)."""
    return {image: homes(image, node_ids, k) for image in images}


def _usable(
    node: Node | None, lease: Lease, used: int | None = None, skip: Collection[str] = ()
) -> bool:
    if node is None or node.state is not HEALTHY or node.node_id in lease.avoid:
        return False
    if node.node_id in skip:
        return False
    if used is None:
        used = node.used
    if used >= node.capacity:
        return False
    return not lease.node_selector or node.matches(lease.node_selector)


def choose(
    lease: Lease,
    nodes: Mapping[str, Node],
    index: LoadIndex,
    may_create: bool,
    *,
    homes_of: Callable[[str], Sequence[str]] | None = None,
    pulling_on: Collection[str] = (),
) -> Choice | None:
    """Where `lease` goes, or None if nothing fits now. `may_create` is False when the global
    cap leaves no room for a new sandbox (a spare still serves: it already holds its room).
    `homes_of` gives an image's home node ids (None: the pool does not pull); `pulling_on` names
    the nodes pulling the lease's image right now. The lease's `prefer_not` nodes are chosen
    only when no other node fits."""
    if lease.prefer_not:
        found = _choose(lease, nodes, index, may_create, homes_of, pulling_on, lease.prefer_not)
        if found is not None:
            return found
    return _choose(lease, nodes, index, may_create, homes_of, pulling_on, ())


def _choose(
    lease: Lease,
    nodes: Mapping[str, Node],
    index: LoadIndex,
    may_create: bool,
    homes_of: Callable[[str], Sequence[str]] | None,
    pulling_on: Collection[str],
    skip: Collection[str],
) -> Choice | None:
    selector = lease.node_selector
    for spare in index.spares.get((lease.image, lease.spec_key), {}).values():
        if not spare.ready or spare.destroying or spare.busy:
            continue
        node = nodes.get(spare.node_id)
        if (
            node is not None
            and node.state is HEALTHY
            and node.node_id not in lease.avoid
            and node.node_id not in skip
            and (not selector or node.matches(selector))
        ):
            return Choice(node, spare)
    if not may_create:
        return None
    least_loaded: Node | None = None
    for used, node in index.by_load():
        if _usable(node, lease, used, skip):
            if node.has_image(lease.image):
                return Choice(node)
            least_loaded = least_loaded or node
    # Nothing has room (homes are not even computed: a full pool stays cheap), or no pulls.
    if least_loaded is None or homes_of is None:
        return None
    for node_id in pulling_on:
        node = nodes.get(node_id)
        if node is not None and _usable(node, lease, skip=skip):
            return Choice(node, pull=True)
    for node_id in homes_of(lease.image):
        node = nodes.get(node_id)
        if node is not None and _usable(node, lease, skip=skip):
            return Choice(node, pull=True)
    return Choice(least_loaded, pull=True)


def prefetch_node(
    image: str, home_ids: Sequence[str], nodes: Mapping[str, Node], pulling_on: Collection[str]
) -> Node | None:
    """The node a prefetch of `image` pulls on: its best healthy home, unless a home has the
    image or is pulling it already (then None: nothing to do)."""
    candidates = [nodes[n] for n in home_ids if n in nodes and nodes[n].state is HEALTHY]
    if any(node.has_image(image) or node.node_id in pulling_on for node in candidates):
        return None
    return candidates[0] if candidates else None


def image_present(image: str, selector: Mapping[str, str], nodes: Mapping[str, Node]) -> bool:
    """Whether a healthy node matching `selector` has `image`."""
    return any(
        node.state is HEALTHY and node.matches(selector) and node.has_image(image)
        for node in nodes.values()
    )


def node_for_spare(image: str, index: LoadIndex) -> Node | None:
    """The least loaded HEALTHY node with room that has `image`."""
    for used, node in index.by_load():
        if node.state is HEALTHY and used < node.capacity and node.has_image(image):
            return node
    return None


def check_image(
    image: str, selector: Mapping[str, str], nodes: Mapping[str, Node], *, may_pull: bool = False
) -> None:
    """Refuses at once an image that no healthy node matching `selector` has, when the pool may
    not pull it; with no healthy node at all the request may wait for one."""
    if may_pull:
        return
    healthy = False
    for node in nodes.values():
        if node.state is HEALTHY and node.matches(selector):
            if node.has_image(image):
                return
            healthy = True
    if healthy:
        raise ImageNotPresent(
            f"no healthy node has image {image!r} and the pool does not pull it"
            " (pre-pull it with `swerl images pull`)",
            image=image,
        )


def spares_hold_room(index: LoadIndex) -> bool:
    """Whether any ready warm spare exists (requests that fit nowhere may take its room)."""
    return any(
        s.ready and not s.destroying for spares in index.spares.values() for s in spares.values()
    )
