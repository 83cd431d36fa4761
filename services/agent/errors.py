"""Errors of the agent service: bad starts are refused with a status; everything after the
episode started ends in a result (INFRA_ERROR and friends), never in an RPC error."""

from __future__ import annotations

from swerl.chassis.errors import FailedPrecondition, InvalidArgument, SwerlError


class StartRequired(InvalidArgument):
    reason = "EPISODE_START_REQUIRED"


class InvalidEpisodeStart(InvalidArgument):
    reason = "INVALID_EPISODE_START"


class UnknownConfig(InvalidArgument):
    reason = "UNKNOWN_AGENT_CONFIG"


class UnknownHarness(InvalidArgument):
    """EpisodeOptions.harness names no harness this agent has."""

    reason = "UNKNOWN_HARNESS"


class HarnessUnavailable(FailedPrecondition):
    """EpisodeOptions.harness names a harness this agent knows but cannot run: a Python package
    it imports is not installed here. The message names the package and the extra that brings
    it; the metadata carries `harness`, `packages` and `install`."""

    reason = "HARNESS_UNAVAILABLE"


class TokenizerUnavailable(InvalidArgument):
    reason = "TOKENIZER_UNAVAILABLE"


class EpisodeRunning(SwerlError):
    code = "ALREADY_EXISTS"
    reason = "EPISODE_RUNNING"


class AgentAtCapacity(SwerlError):
    """The agent runs max_episodes already; another agent (or later) can take the episode."""

    code = "RESOURCE_EXHAUSTED"
    reason = "AGENT_AT_CAPACITY"


class EpisodeInfraError(Exception):
    """Infrastructure failed during an episode; the episode ends INFRA_ERROR with `reason`."""

    def __init__(self, reason: str, message: str, *, node_down: bool = False) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        # The sandbox's node cannot destroy it now: the node did not answer at all (a stopped
        # or unreachable node process), or its dockerd does not answer it.
        self.node_down = node_down


__all__ = [
    "AgentAtCapacity",
    "EpisodeInfraError",
    "EpisodeRunning",
    "HarnessUnavailable",
    "InvalidEpisodeStart",
    "StartRequired",
    "SwerlError",
    "TokenizerUnavailable",
    "UnknownConfig",
    "UnknownHarness",
]
