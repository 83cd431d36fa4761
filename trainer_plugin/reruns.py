"""Re-running an episode that the infrastructure failed, inside its generate call.

An episode that ends INFRA_ERROR (a lost lease, an unreachable policy, an evaluation the node
could not run) or whose stream broke without a result says nothing about the policy, yet the
dynamic-sampling filter must drop its whole prompt group: at 5% infra failures per episode a
group of 8 loses one in three. Since generate has not returned, none of the failed episode's
tokens has reached the trainer, so the call runs the episode again, up to `episode_attempts`
attempts in all, with the same sampling params (seed included) under a fresh episode id
(`<first id>-a<n>`: a new id is a new lease request and new artifacts), asking the pool to
place it on another node than the failed attempts' while one has room
(`EpisodeOptions.avoid_node_ids`). The filter then drops a group only when a member still failed
after its attempts.

Not re-run: an outcome the plugin or the rollout ended (an abort, the plugin's deadline: a re-run
would outlive the rollout), a refused start (INVALID_ARGUMENT and the like: the same start is
refused again), and anything graded. An abort between attempts stops the re-runs; one during a
re-run cancels it like any episode.

Every sample records its episode's attempts (`metadata["episode_attempts"]`, 1 without a re-run)
and why the earlier attempts failed (`metadata["rerun_reasons"]`); metrics.py sums them into
`agent/infra_reruns_sum`, `agent/episode_attempts_mean` and `agent/infra_recovered_ratio`.
"""

from __future__ import annotations

import zlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from swerl.agent.v1 import agent_pb2
from swerl.trainer_plugin.episode import STREAM_ENDED_WITHOUT_RESULT, EpisodeOutcome

# Sample metadata keys.
EPISODE_ATTEMPTS = "episode_attempts"
RERUN_REASONS = "rerun_reasons"

# Failures without a result that another attempt may cure: the agent or its stream went away,
# not the request. (RESOURCE_EXHAUSTED is left out: gRPC also says it for oversized messages.)
_CURABLE_CALL_FAILURES = frozenset(
    {
        "RPC_UNAVAILABLE",
        "RPC_INTERNAL",
        "RPC_UNKNOWN",
        "RPC_ABORTED",
        STREAM_ENDED_WITHOUT_RESULT,
    }
)

_log = structlog.get_logger("swerl.trainer_plugin")


@dataclass
class Attempts:
    """The attempts of one episode so far: how many ran, and why each failed attempt failed."""

    count: int = 0
    reasons: list[str] = field(default_factory=list)
    # The exec nodes the failed attempts ran on: the next attempt asks the pool to avoid them
    # while another node has room (EpisodeOptions.avoid_node_ids).
    nodes: list[str] = field(default_factory=list)

    def failed(self, reason: str, outcome: EpisodeOutcome) -> None:
        self.reasons.append(reason)
        node = outcome.started.node_id if outcome.started is not None else ""
        if node and node not in self.nodes:
            self.nodes.append(node)

    def annotate(self, samples: Sequence[Any]) -> None:
        for sample in samples:
            sample.metadata[EPISODE_ATTEMPTS] = self.count
            sample.metadata[RERUN_REASONS] = list(self.reasons)


@dataclass(frozen=True)
class RerunAlone:
    """A branching-group member's answer from its group: its branch failed after the fork, so
    it runs again on its own (unbranched: the fork cannot be had again without re-running the
    trunk) with these sampling params (its branch's seed) and the attempts spent so far."""

    sampling_params: dict[str, Any]
    attempts: Attempts


def infra_failure(outcome: EpisodeOutcome, *, group: bool = False) -> str | None:
    """Why `outcome` is an infra failure another attempt may cure, or None when it is not one
    (graded, cancelled by the plugin, refused). With `group` (a branching episode's whole
    outcome): None once any branch reported, since each branch is then judged on its own."""
    if outcome.cancelled_by is not None:
        return None
    if group and any(r.HasField("branch") for r in outcome.results):
        return None
    result = outcome.result
    if result is None:
        return outcome.failure_reason if outcome.failure_reason in _CURABLE_CALL_FAILURES else None
    if result.status == agent_pb2.EPISODE_STATUS_INFRA_ERROR:
        return result.error_reason or "INFRA_ERROR"
    return None


def attempt_id(first_id: str, attempt: int) -> str:
    """The episode id of attempt `attempt` (1-based) of the episode first run as `first_id`."""
    return first_id if attempt == 1 else f"{first_id}-a{attempt}"


async def run_with_reruns(
    run: Callable[[str, list[str]], Awaitable[EpisodeOutcome]],
    first_id: str,
    max_attempts: int,
    aborted: Callable[[], bool],
    attempts: Attempts | None = None,
    *,
    group: bool = False,
) -> tuple[EpisodeOutcome, Attempts]:
    """Runs `run(episode_id, nodes to avoid)` until its outcome is no curable infra failure,
    `max_attempts` attempts in all (counting those already in `attempts`), or the rollout is
    aborted. Returns the last outcome and the attempts. `group`: the outcomes are a branching
    group's."""
    attempts = attempts or Attempts()
    episode_id = attempt_id(first_id, attempts.count + 1)
    while True:
        attempts.count += 1
        outcome = await run(episode_id, list(attempts.nodes))
        reason = infra_failure(outcome, group=group)
        if reason is None or attempts.count >= max_attempts or aborted():
            if reason is not None:
                _log.warning(
                    "episode.infra_rerun_exhausted",
                    episode_id=outcome.episode_id,
                    attempts=attempts.count,
                    reason=reason,
                    aborted=aborted(),
                )
            return outcome, attempts
        attempts.failed(reason, outcome)
        episode_id = attempt_id(first_id, attempts.count + 1)
        _log.info(
            "episode.infra_rerun",
            failed_episode_id=outcome.episode_id,
            node_id=outcome.started.node_id if outcome.started is not None else "",
            reason=reason,
            episode_id=episode_id,
            attempt=attempts.count + 1,
            max_attempts=max_attempts,
        )


def group_params(params: dict[str, Any], first_id: str, episode_id: str) -> dict[str, Any]:
    """The sampling params of one attempt of a branching group's episode. Without a seed of
    their own the agent derives the branches' seeds from the episode id (crc32 of it, plus
    1 + branch: services/agent/loop/branching.py `seeds`); a re-run, under a new id, pins that base
    to the first attempt's so every branch samples with the same seed again."""
    if episode_id == first_id or isinstance(params.get("sampling_seed"), int):
        return params
    return {**params, "sampling_seed": zlib.crc32(first_id.encode())}


def member_reruns(
    splits: Sequence[Any],
    member_params: Sequence[dict[str, Any]],
    attempts: Attempts,
    max_attempts: int,
) -> dict[int, RerunAlone]:
    """The members of a forked group whose branch failed curably and who have attempts left:
    each re-runs alone with its branch's sampling seed (the one the agent reports in the
    branch's result) and the group's attempts plus this failure."""
    out: dict[int, RerunAlone] = {}
    if attempts.count >= max_attempts:
        return out
    for i, split in enumerate(splits):
        if not isinstance(split, EpisodeOutcome):
            continue
        reason = infra_failure(split)
        if reason is None:
            continue
        params = dict(member_params[i])
        result = split.result
        if result is not None and result.HasField("branch") and result.sampling_seed:
            params["sampling_seed"] = int(result.sampling_seed)
        member = Attempts(attempts.count, list(attempts.reasons), list(attempts.nodes))
        member.failed(reason, split)
        out[i] = RerunAlone(params, member)
    return out
