"""Prometheus metrics of the exec node's image cache (default registry, defined once at import)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

IMAGE_HITS = Counter(
    "swerl_exec_image_cache_hits", "Images asked for (EnsureImages) that were already present."
)
IMAGE_MISSES = Counter(
    "swerl_exec_image_cache_misses", "Images asked for (EnsureImages) that had to be pulled."
)
IMAGE_PULLS = Counter(
    "swerl_exec_image_pulls",
    "Pulls the node ran (one per image, shared by its waiters), by outcome reason or PULLED.",
    ["outcome"],
)
IMAGE_PULL_ATTEMPT_FAILURES = Counter(
    "swerl_exec_image_pull_attempt_failures",
    "Failed attempts of pulls, by reason (a transient failure is tried again, others are not).",
    ["reason"],
)
IMAGE_PULLED_BYTES = Counter(
    "swerl_exec_image_pulled_bytes", "Unpacked bytes of the images pulled (Docker's image size)."
)
IMAGE_EVICTIONS = Counter(
    "swerl_exec_image_evictions", "Images removed to keep the cache within its disk budget."
)
IMAGE_BUDGET_USED = Gauge(
    "swerl_exec_image_budget_used_bytes", "Bytes of cached (unpinned) images the node holds."
)
