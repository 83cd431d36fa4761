"""Prometheus metrics of the PRM judge (served on the service's metrics port with the RPC ones)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

JUDGE_CALLS_IN_FLIGHT = Gauge(
    "swerl_prm_judge_calls_in_flight",
    "Calls to the judge model in flight (bounded by max_concurrent_requests).",
)
JUDGE_CALL_DURATION = Histogram(
    "swerl_prm_judge_call_duration_seconds",
    "Time of one call to the judge model (one vote attempt).",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300),
)
VOTES = Counter(
    "swerl_prm_votes",
    "Votes sampled, by outcome: valid, invalid (no readable verdict), failed (no answer).",
    ["outcome"],
)
JUDGMENTS = Counter("swerl_prm_judgments", "Steps judged, by final state.", ["state"])
