"""The pool's domain values as `swerl.pool.v1` protos: one explicit table per enum.

The servicer translates with these tables, and so does every client that reads the pool's
answers back into the domain's names (swerl.pool.client.node_state). A test checks that both
sides of every table are covered (tests/pool/test_pool_enum_tables.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from swerl.pool.model import LeaseState, LossReason, NodeState
from swerl.pool.v1 import pool_pb2 as pb

if TYPE_CHECKING:
    from swerl.pool.leases import PrefetchStatus

# The domain's enums and the contract's, value for value (a test checks both sides are covered).
LEASE_STATE_TO_PB: dict[LeaseState, pb.LeaseState] = {
    LeaseState.PENDING: pb.LEASE_STATE_PENDING,
    LeaseState.PULLING: pb.LEASE_STATE_PULLING,
    LeaseState.ACTIVE: pb.LEASE_STATE_ACTIVE,
    LeaseState.RELEASING: pb.LEASE_STATE_RELEASING,
    LeaseState.ENDED: pb.LEASE_STATE_ENDED,
}
LEASE_STATE_FROM_PB: dict[pb.LeaseState, LeaseState] = {v: k for k, v in LEASE_STATE_TO_PB.items()}
LOSS_REASON_TO_PB: dict[LossReason, pb.LeaseLossReason] = {
    LossReason.RELEASED: pb.LEASE_LOSS_REASON_RELEASED,
    LossReason.EXPIRED: pb.LEASE_LOSS_REASON_EXPIRED,
    LossReason.NODE_LOST: pb.LEASE_LOSS_REASON_NODE_LOST,
    LossReason.SANDBOX_LOST: pb.LEASE_LOSS_REASON_SANDBOX_LOST,
    LossReason.REVOKED: pb.LEASE_LOSS_REASON_REVOKED,
    LossReason.NOT_FOUND: pb.LEASE_LOSS_REASON_NOT_FOUND,
}
NODE_STATE_TO_PB: dict[NodeState, pb.NodeState] = {
    NodeState.PENDING: pb.NODE_STATE_PENDING,
    NodeState.HEALTHY: pb.NODE_STATE_HEALTHY,
    NodeState.UNHEALTHY: pb.NODE_STATE_UNHEALTHY,
    NodeState.DRAINING: pb.NODE_STATE_DRAINING,
    NodeState.DRAINED: pb.NODE_STATE_DRAINED,
}
NODE_STATE_FROM_PB: dict[pb.NodeState, NodeState] = {v: k for k, v in NODE_STATE_TO_PB.items()}
PREFETCH_STATUS_TO_PB: dict[PrefetchStatus, pb.PrefetchStatus] = {
    "STARTED": pb.PREFETCH_STATUS_STARTED,
    "PRESENT": pb.PREFETCH_STATUS_PRESENT,
    "FAILED": pb.PREFETCH_STATUS_FAILED,
    "SKIPPED": pb.PREFETCH_STATUS_SKIPPED,
}
