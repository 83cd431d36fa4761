"""One budget per harness episode: harness start, run and grading under `wall_timeout`; and the
deadline a RunEpisode client sets around it (`client_deadline`).

A harness episode's `wall_timeout` bounds the whole of it from the moment its sandbox is leased:
its gateway session, the harness's prepare and run, and the grading. The harness is stopped
early enough to leave the grading its share (`grading_share_s`: its own `eval_timeout`, never
more than a quarter of the budget); the grading then gets what is left of the budget, never more
than its own limit, and the whole grading (its lease, the patch applied, the tests) must end
within that plus `GRADING_OVERHEAD_S`, else the episode ends INFRA_ERROR `GRADING_OVER_BUDGET`.
swerl's own loop keeps its contract: `wall_timeout` for the loop, `eval_timeout` for the grading.

The budgets around an episode are ordered so that no sandbox is held past its episode: a
client's deadline on RunEpisode (the plugin's `episode_deadline_s`, `swerl eval`'s) exceeds the
agent's wait for a lease plus `agent_bound_s`, the longest the agent works for one episode once
leased, and every lease the agent holds is released within that bound (the pool's lease TTL only
outlives an agent that vanished). `client_deadline` is the one answer to "how long may a client
wait for this episode": the plugin and `swerl eval` both ask it.

Pure domain: no gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass

# The most of a harness episode's budget kept for its grading.
GRADING_SHARE = 0.25
# What grading costs beyond its tests' own limit: the grading sandbox's lease and start, the
# patch applied, the report. A grading past its share by more than this ends GRADING_OVER_BUDGET.
GRADING_OVERHEAD_S = 60.0
# The shortest limit a grading is given (the exec node refuses a zero one).
MIN_GRADING_S = 1.0
# How long an episode waits for its sandbox unless the agent's `lease_wait_s` says otherwise (the
# setting's default, kept here so that the clients that count on it import nothing heavy).
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


@dataclass(frozen=True)
class ClientDeadline:
    """What a RunEpisode client must wait for one episode, in its parts: the agent's wait for
    the lease, the episode's limits as the agent resolves them, and the grading's overhead."""

    lease_wait_s: float
    wall_timeout_s: float
    eval_timeout_s: float
    harnessed: bool

    @property
    def bound_s(self) -> float:
        """The longest the agent may hold the episode: its wait for the lease plus its bound
        once leased. A client's deadline must exceed it."""
        episode = agent_bound_s(self.wall_timeout_s, self.eval_timeout_s, harnessed=self.harnessed)
        return self.lease_wait_s + episode

    @property
    def deadline_s(self) -> float:
        """The deadline to set: the bound plus a margin for the result's way back."""
        return self.bound_s + CLIENT_MARGIN_S

    def parts(self) -> str:
        """The bound's sum as words, e.g. `600 s lease wait + 3600 s wall_timeout + ...`."""
        terms = [f"{self.lease_wait_s:g} s lease wait"]
        if self.harnessed:
            terms.append(f"{self.wall_timeout_s:g} s wall_timeout (the harness's budget)")
        else:
            terms.append(f"{self.wall_timeout_s:g} s wall_timeout")
            terms.append(f"{self.eval_timeout_s:g} s eval_timeout")
        terms.append(f"{GRADING_OVERHEAD_S:g} s grading overhead")
        return " + ".join(terms)

    def refuse_shorter(self, name: str, configured_s: float) -> None:
        """Raises ValueError when a configured deadline (setting `name`) does not exceed the
        agent's bound: the client would give up on an episode the agent still runs."""
        if configured_s > self.bound_s:
            return
        raise ValueError(
            f"{name} ({configured_s:g} s) must exceed the agent's bound on the episode"
            f" ({self.bound_s:g} s = {self.parts()}); leave it unset for"
            f" {self.deadline_s:g} s (that bound + {CLIENT_MARGIN_S:g} s)"
        )


def client_deadline(
    *,
    wall_timeout_s: float = 0.0,
    eval_timeout_s: float = 0.0,
    harness: str = "",
    config_name: str = "",
    lease_wait_s: float = DEFAULT_LEASE_WAIT_S,
) -> ClientDeadline:
    """The client deadline for one episode, from what its start asks: a zero limit is the
    agent config's default, as the agent resolves it (a config this install lacks: the default
    config's, and the agent judges the name); `harness` is EpisodeOptions.harness;
    `lease_wait_s` the agent's setting."""
    # Imported here: the trainer plugin imports this module, and stays light until it asks.
    from swerl.agent.config import load_config
    from swerl.agent.errors import UnknownConfig
    from swerl.agent.spec import is_harnessed

    try:
        defaults = load_config(config_name).defaults
    except UnknownConfig:
        defaults = load_config().defaults
    return ClientDeadline(
        lease_wait_s=lease_wait_s,
        wall_timeout_s=wall_timeout_s or defaults.wall_timeout_s,
        eval_timeout_s=eval_timeout_s or defaults.eval_timeout_s,
        harnessed=is_harnessed(harness),
    )
