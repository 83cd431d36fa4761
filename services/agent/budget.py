"""One budget per harness episode: harness start, run and grading under `wall_timeout`.

A harness episode's `wall_timeout` bounds the whole of it from the moment its sandbox is leased:
its gateway session, the harness's prepare and run, and the grading. The harness is stopped
early enough to leave the grading its share (`grading_share_s`: its own `eval_timeout`, never
more than a quarter of the budget); the grading then gets what is left of the budget, never more
than its own limit, and the whole grading (its lease, the patch applied, the tests) must end
within that plus `GRADING_OVERHEAD_S`, else the episode ends INFRA_ERROR `GRADING_OVER_BUDGET`.
swerl's own loop keeps its contract: `wall_timeout` for the loop, `eval_timeout` for the grading.

The budgets around an episode are ordered so that no sandbox is held past its episode: a
client's deadline on RunEpisode (the plugin's `episode_deadline_s`, `swerl eval`'s, see
`client_deadline_s`) exceeds the agent's wait for a lease plus `agent_bound_s`, the longest the
agent works for one episode once leased, and every lease the agent holds is released within
that bound (the pool's lease TTL only outlives an agent that vanished).

Pure domain: no gRPC.
"""

from __future__ import annotations

# The most of a harness episode's budget kept for its grading.
GRADING_SHARE = 0.25
# What grading costs beyond its tests' own limit: the grading sandbox's lease and start, the
# patch applied, the report. A grading past its share by more than this ends GRADING_OVER_BUDGET.
GRADING_OVERHEAD_S = 60.0
# The shortest limit a grading is given (the exec node refuses a zero one).
MIN_GRADING_S = 1.0
# How long an episode waits for its sandbox by default (the agent's `lease_wait_s`).
DEFAULT_LEASE_WAIT_S = 600.0
# What a client's deadline keeps beyond the agent's bound (the result's way back).
CLIENT_MARGIN_S = 60.0


def grading_share_s(budget_s: float, eval_timeout_s: float) -> float:
    """The part of a harness episode's budget its harness leaves to the grading."""
    return min(eval_timeout_s, budget_s * GRADING_SHARE)


def harness_run_s(budget_s: float, eval_timeout_s: float) -> float:
    """How long the harness (its session, prepare and run) may take of the budget."""
    return budget_s - grading_share_s(budget_s, eval_timeout_s)


def grading_limit_s(budget_left_s: float, eval_timeout_s: float) -> float:
    """The grading's own limit: what is left of the budget, never more than `eval_timeout`."""
    return max(MIN_GRADING_S, min(eval_timeout_s, budget_left_s))


def agent_bound_s(wall_timeout_s: float, eval_timeout_s: float, *, harnessed: bool) -> float:
    """The longest the agent works for one episode once its sandbox is leased (a client's
    deadline must exceed it, plus its wait for the lease)."""
    if harnessed:
        return wall_timeout_s + GRADING_OVERHEAD_S
    return wall_timeout_s + eval_timeout_s + GRADING_OVERHEAD_S


def client_deadline_s(
    wall_timeout_s: float,
    eval_timeout_s: float,
    *,
    harnessed: bool,
    lease_wait_s: float = DEFAULT_LEASE_WAIT_S,
) -> float:
    """The shortest deadline a client may set on one RunEpisode call: the agent's wait for the
    lease, its bound on the episode, and a margin for the result's way back."""
    bound = agent_bound_s(wall_timeout_s, eval_timeout_s, harnessed=harnessed)
    return lease_wait_s + bound + CLIENT_MARGIN_S
