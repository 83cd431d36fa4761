"""How an episode ended (the agent's own enum; `swerl.agent.wire` maps it to the contract)."""

from __future__ import annotations

import enum


class EpisodeStatus(enum.Enum):
    SUBMITTED = "submitted"  # the agent ran the submit command
    LIMIT_TURNS = "limit_turns"
    LIMIT_CONTEXT = "limit_context"  # the next turn no longer fits the context window
    LIMIT_TIME = "limit_time"  # the wall-clock limit of the agent loop
    CANCELLED = "cancelled"  # a `cancel` message (or the agent shutting down)
    ABORTED = "aborted"  # the policy server aborted a generation
    INFRA_ERROR = "infra_error"  # sandbox, policy or grading infrastructure failed
    # The policy's own command killed what its sandbox runs on and the sandbox could not be
    # started again: the policy's doing, scored like a failed attempt (reward -1, not graded).
    SANDBOX_BROKEN = "sandbox_broken"
    # A harness other than the builtin loop failed on its own, or outlived its budget and was
    # stopped: the policy's side, graded on what the sandbox holds.
    HARNESS_FAILED = "harness_failed"
    HARNESS_TIMEOUT = "harness_timeout"

    @property
    def graded(self) -> bool:
        """Whether the episode's work is graded (it ended on its own, not by failure)."""
        return self in _GRADED


_GRADED = frozenset(
    {
        EpisodeStatus.SUBMITTED,
        EpisodeStatus.LIMIT_TURNS,
        EpisodeStatus.LIMIT_CONTEXT,
        EpisodeStatus.LIMIT_TIME,
        EpisodeStatus.HARNESS_FAILED,
        EpisodeStatus.HARNESS_TIMEOUT,
    }
)
