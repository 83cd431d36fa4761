"""Where a sandbox goes: the choice of a node for a lease or a warm spare.

Pure functions over the pool's nodes and their load index: they read, never change anything, and
do no I/O. The queue (swerl.pool.queue) applies what they choose, one request at a time, so each
choice sees the room the previous one took.

Order of choice for a lease: a ready warm spare of its image and spec, else the least loaded
node that has its image and room. Only HEALTHY nodes that match the lease's node selector and
have not failed this lease are considered.
"""

from __future__ import annotations

from collections.abc import Mapping

from swerl.pool.errors import ImageNotPresent
from swerl.pool.model import Lease, LoadIndex, Node, NodeState, Spare

HEALTHY = NodeState.HEALTHY


def choose(
    lease: Lease, nodes: Mapping[str, Node], index: LoadIndex, may_create: bool
) -> tuple[Node, Spare | None] | None:
    """The node (and the spare on it, if one is bound) for `lease`, or None if nothing fits
    now. `may_create` is False when the global cap leaves no room for a new sandbox (a spare
    still serves: it already holds its room)."""
    selector = lease.node_selector
    for spare in index.spares.get((lease.image, lease.spec_key), {}).values():
        if not spare.ready or spare.destroying or spare.busy:
            continue
        node = nodes.get(spare.node_id)
        if (
            node is not None
            and node.state is HEALTHY
            and node.node_id not in lease.avoid
            and (not selector or node.matches(selector))
        ):
            return node, spare
    if not may_create:
        return None
    for used, node in index.by_load():
        if node.state is not HEALTHY or used >= node.capacity or node.node_id in lease.avoid:
            continue
        if (not selector or node.matches(selector)) and node.has_image(lease.image):
            return node, None
    return None


def node_for_spare(image: str, index: LoadIndex) -> Node | None:
    """The least loaded HEALTHY node with room that has `image`."""
    for used, node in index.by_load():
        if node.state is HEALTHY and used < node.capacity and node.has_image(image):
            return node
    return None


def check_image(image: str, selector: Mapping[str, str], nodes: Mapping[str, Node]) -> None:
    """Refuses at once an image that no healthy node matching `selector` has (the pool does not
    pull); with no healthy node at all the request may wait for one."""
    healthy = False
    for node in nodes.values():
        if node.state is HEALTHY and node.matches(selector):
            if node.has_image(image):
                return
            healthy = True
    if healthy:
        raise ImageNotPresent(
            f"no healthy node has image {image!r}; the pool never pulls (use EnsureImages)",
            image=image,
        )


def spares_hold_room(index: LoadIndex) -> bool:
    """Whether any ready warm spare exists (requests that fit nowhere may take its room)."""
    return any(
        s.ready and not s.destroying for spares in index.spares.values() for s in spares.values()
    )
