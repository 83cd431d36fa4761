"""Prometheus metrics of the pool (default registry, defined once at import)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LEASES = Gauge("swerl_pool_leases", "Leases by state.", ["state"])
WAITING = Gauge("swerl_pool_waiting", "AcquireLease calls queued for capacity.")
SPARES = Gauge("swerl_pool_warm_spares", "Warm spares running.")
ACQUIRE_SECONDS = Histogram(
    "swerl_pool_acquire_seconds",
    "AcquireLease latency (queue wait included), by how the sandbox was found.",
    ["source"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
LEASE_ENDS = Counter("swerl_pool_lease_ends", "Leases that ended, by reason.", ["reason"])
NODES = Gauge("swerl_pool_nodes", "Registered exec nodes by state.", ["state"])
NODE_HEALTHY = Gauge("swerl_pool_node_healthy", "1 when the node is HEALTHY.", ["node_id"])
DESTROY_FAILURES = Counter(
    "swerl_pool_destroy_failures", "Sandbox destroys that failed (capacity stays held)."
)
IMAGE_PULLS = Counter(
    "swerl_pool_image_pulls",
    "Image pulls the pool asked nodes for, by outcome (PULLED, PRESENT, or the failure reason).",
    ["outcome"],
)
PULL_SECONDS = Histogram(
    "swerl_pool_pull_seconds",
    "Time from asking a node for an image to having it, by priority (LEASE, PREFETCH).",
    ["priority"],
    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
)
