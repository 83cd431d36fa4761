"""Branching (EpisodeOptions.branch): a trunk runs `branch_at` turns, its sandbox is forked
`branch_count` times, and one branch per copy goes on from the trunk's state with its own
sampling seed, its own sandbox and its own result.

The trunk's stream carries every branch's turns and PRM scores tagged with the branch index;
each branch's result is emitted as it ends and the last one ends the stream. A cancel reaches
every branch, and each ends CANCELLED with its result. Forked sandboxes are held like leases:
released at the end whatever happens, a cancel during the fork included.
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from swerl.agent.loop.sandbox import ForkedSandbox, SandboxHandle, SandboxProvider, guarded
from swerl.agent.spec import EpisodeSpec
from swerl.agent.v1 import agent_pb2 as pb

Emit = Callable[[pb.RunEpisodeResponse], None]


class BranchRun(Protocol):
    """One branch as the trunk drives it (an `Episode` that starts at the fork)."""

    def cancel(self, reason: str) -> None: ...

    async def run(self) -> pb.RunEpisodeResponse: ...


async def fork(
    provider: SandboxProvider, sandbox: SandboxHandle, spec: EpisodeSpec
) -> list[ForkedSandbox]:
    """The branches' sandboxes. Shielded: a cancel during the fork still gets the leases
    back, so they are released rather than left to expire."""
    forking = asyncio.ensure_future(
        guarded(
            sandbox,
            provider.fork(
                sandbox,
                spec.branch_count,
                owner=spec.lease_owner,
                request_id=f"{spec.episode_id}-fork",
            ),
        )
    )
    try:
        return await asyncio.shield(forking)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            for forked in await forking:
                await forked.release()
        raise


@contextlib.asynccontextmanager
async def holding(forked: ForkedSandbox) -> AsyncIterator[SandboxHandle]:
    """A branch's forked sandbox, held like a lease: released at the end whatever happens
    (shielded, so a cancelled branch still gives it back)."""
    try:
        yield forked
    finally:
        await asyncio.shield(forked.release())


def seeds(spec: EpisodeSpec, count: int) -> list[int]:
    """The branches' sampling seeds: after the episode's own seed, or after a hash of its id."""
    base = spec.sampling_params.get("sampling_seed")
    if not isinstance(base, int):
        base = zlib.crc32(spec.episode_id.encode())
    return [base + 1 + index for index in range(count)]


def tagged(emit: Emit, index: int) -> Emit:
    """A branch's stream: its turns and scores carry its index; its evaluation stays in its
    result."""

    def send(message: pb.RunEpisodeResponse) -> None:
        kind = message.WhichOneof("kind")
        if kind == "turn":
            message.turn.branch = index
        elif kind == "prm_score":
            message.prm_score.branch = index
        elif kind == "evaluation":
            return  # the report is in the branch's result
        emit(message)

    return send


async def run_all(branches: Sequence[BranchRun], emit: Emit) -> pb.RunEpisodeResponse | None:
    """Runs every branch to its end; emits each result as it comes and returns the last."""
    runs = [asyncio.ensure_future(branch.run()) for branch in branches]
    last: pb.RunEpisodeResponse | None = None
    try:
        for n, finished in enumerate(asyncio.as_completed(runs)):
            response = await finished
            if n + 1 < len(runs):
                emit(response)
            else:
                last = response
    finally:
        for run in runs:  # the whole call went away: every branch releases its sandbox
            run.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
    return last
