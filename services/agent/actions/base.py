"""What the episode loop asks of an action protocol, and what one turn's action gives back.

The loop (`swerl.agent.loop.episode`) picks one `ActionProtocol` when an episode starts, from its
agent config: bash blocks (`swerl.agent.actions.bash_block`) or tool calls
(`swerl.agent.actions.tool_turn`). Each turn it hands the protocol the policy's reply and the
sandbox; the protocol runs what the reply asks for, appends the reply and its observation to the
conversation and the turn's step to the trajectory record, and answers with an `Acted`: the
turn's stream message, what the policy observes next, the submission if there was one, and what
the loop counts and judges. Everything else (the lease, the budget, cancelling, grading and the
records) stays the loop's.

A protocol holds the per-episode state its turns need (whether the last command was killed, the
tool-call counts); `branch()` copies it at a branching fork.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from swerl.agent.v1 import agent_pb2 as pb

if TYPE_CHECKING:  # the Protocols only
    from swerl.agent.loop.sandbox import SandboxHandle
    from swerl.agent.policy.modes import PolicyTurn

T = TypeVar("T")
# How much of a command's output the turn's stream message carries.
OUTPUT_HEAD_CHARS = 1000
# Runs CPU work (an observation's rendering) off the event loop: the episode's thread pool.
RunCpu = Callable[[Callable[[], T]], Awaitable[T]]


class SandboxBroken(Exception):
    """The policy's own command broke its sandbox beyond repair (ends SANDBOX_BROKEN)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass
class ActionTurn:
    """One policy reply to act on, and where its traces go."""

    sandbox: SandboxHandle
    index: int  # the turn's index in the episode
    answer: PolicyTurn
    turns_left: int
    # The conversation: the action appends the reply and the messages that answer it.
    messages: list[dict[str, Any]]
    # The trajectory's steps (`traj.json`): the action appends this turn's, before it runs
    # anything, so a sandbox lost mid-turn still leaves the step.
    steps: list[dict[str, Any]]


@dataclass
class Acted:
    """What one reply did, for the loop to stream, count, judge and observe."""

    turn: pb.EpisodeTurn  # the loop fills its index, token counts and model time
    observed: str | list[dict[str, Any]]  # what the policy observes next (unless it submitted)
    submission: str | None  # the patch the reply submitted, if it did
    commands: int  # commands (tool calls) the reply ran
    env_s: float  # seconds they took in the sandbox
    # For the PRM: the action as it ran (None: nothing ran), its exit code and its output.
    judged_action: str | None
    judged_exit_code: int
    judged_output: str


class ActionProtocol(Protocol):
    """How a policy reply becomes actions in the sandbox and an observation back."""

    name: str

    async def act(self, turn: ActionTurn) -> Acted:
        """Runs the reply's action; the sandbox's own failures raise (EpisodeInfraError, or
        SandboxBroken when the policy's previous command killed it)."""
        ...

    def limit(self) -> tuple[str, str] | None:
        """An episode-ending limit the protocol's own counts reached: (reason, detail)."""
        ...

    def metrics(self) -> dict[str, float]:
        """The protocol's counts, for the episode's `agent_metrics`."""
        ...

    def branch(self) -> ActionProtocol:
        """A branch's copy of this state at the fork."""
        ...
