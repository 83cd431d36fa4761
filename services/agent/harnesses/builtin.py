"""`builtin`: swerl's own policy loop (turn → command → observation), the default harness."""

from __future__ import annotations

from swerl.agent.harnesses.base import HarnessRun
from swerl.agent.spec import DEFAULT_HARNESS
from swerl.agent.status import EpisodeStatus


class BuiltinHarness:
    """Runs the episode's own loop; the episode keeps its submission and status."""

    name = DEFAULT_HARNESS
    timeout_status = EpisodeStatus.LIMIT_TIME

    async def prepare(self, run: HarnessRun) -> None:
        return None

    async def run(self, run: HarnessRun) -> str | None:
        await run.agent_loop(run.sandbox)
        return None

    async def cancel(self) -> None:
        # The loop is a task of the episode: cancelling `run` stops its policy call and its
        # running command; nothing else was started.
        return None

    def log(self) -> bytes:
        return b""  # swerl's loop: its record is traj.json itself
