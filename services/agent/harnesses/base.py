"""The harness seam: what drives an episode inside its leased sandbox.

A harness is one module under `swerl.agent.harnesses` with one class behind `Harness`: the
episode leases the sandbox, calls `prepare`, then `run` under the episode's time budget, and
grades what the sandbox holds afterwards. The episode, not the harness, owns the clock and the
lease: when the budget runs out, the lease is lost or the trainer aborts, it cancels `run` and
calls `cancel` (which must stop whatever the harness started at once, and be idempotent).
A harness class that imports optional packages when it runs names them in a class attribute
`requires` (a tuple of `swerl.chassis.extras.OptionalPackage`): the registry checks them before
the episode is accepted.

Pure domain: no gRPC.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from swerl.agent.loop.sandbox import SandboxHandle
from swerl.agent.spec import EpisodeSpec
from swerl.agent.status import EpisodeStatus


class HarnessFailed(Exception):
    """The harness stopped on its own with a failure (crash, non-zero exit): the episode ends
    HARNESS_FAILED and is graded on its sandbox. `detail` is what the harness reported."""

    reason = "HARNESS_FAILED"

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


@dataclass(frozen=True)
class HarnessModel:
    """Where a harness reaches its policy: the episode's own gateway session. Every call through
    it is recorded token-exact; the session's chains become the episode's samples."""

    # The gateway session (GetSession / the inspector name it by this id).
    session_id: str
    # The session's secret: `Authorization: Bearer <key>` (OpenAI) or `x-api-key` (Anthropic).
    api_key: str
    # The model name the session answers to (any name is accepted; this one is echoed).
    model: str
    # OpenAI-compatible base URL (`.../s/<session>/v1`: POST chat/completions).
    openai_base_url: str
    # Anthropic-compatible base URL (`.../s/<session>`: POST v1/messages).
    anthropic_base_url: str


@dataclass(frozen=True)
class HarnessRun:
    """What one harness run gets from its episode."""

    spec: EpisodeSpec
    sandbox: SandboxHandle
    # swerl's own policy loop over this sandbox (the builtin harness runs it; others ignore it).
    agent_loop: Callable[[SandboxHandle], Awaitable[None]]
    # The episode's gateway session (None for the builtin harness, which calls the policy
    # itself).
    model: HarnessModel | None = None


class Harness(Protocol):
    # The harness's name in EpisodeOptions.harness.
    name: str
    # How the episode ends when `run` outlives the budget: LIMIT_TIME for swerl's loop (the
    # contract before harnesses), HARNESS_TIMEOUT for the others.
    timeout_status: EpisodeStatus

    async def prepare(self, run: HarnessRun) -> None:
        """Readies the harness in its sandbox (counted in the episode's budget)."""
        ...

    async def run(self, run: HarnessRun) -> str | None:
        """Drives the episode to its end; returns the submission (the patch) when the harness
        names one, None to grade the sandbox's diff. Raises HarnessFailed on its own failure,
        and `swerl.agent.errors.EpisodeInfraError` when what it stands on fails (its model
        endpoint unreachable, ...): INFRA_ERROR, no reward, as any infra failure."""
        ...

    async def cancel(self) -> None:
        """Stops everything `run` started, at once; idempotent."""
        ...

    def log(self) -> bytes:
        """The harness's own log so far (kept beside traj.json as `harness.log`); empty when it
        has none of its own."""
        ...


HarnessFactory = Callable[[], Harness]
