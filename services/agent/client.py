"""Async client of the agent service: the one way to run an episode over `RunEpisode`.

    start = episode_start(episode_id="ep-1", instance=instance, policy=policy,
                          limits=episode_limits(max_turns=30, wall_timeout_s=1800))
    async with await open_episode(stub, start, timeout=900) as episode:
        async for message in episode.messages():   # started, turns, PRM scores, evaluation
            ...                                    # await episode.cancel("why") to stop it
    episode.result                                 # the (last) EpisodeResult, or None

    results = await run_episode(stub, start, timeout=900)  # to the end in one call

The stream stays open after `start`, so `cancel` can be sent at any time (the agent then ends
the episode CANCELLED with a result and releases its sandbox); `abort` drops the call itself,
which stops the episode on the agent as well. With EpisodeOptions.branch the stream carries
one result per branch and is complete after the last. gRPC failures of the call are raised as
`grpc.aio.AioRpcError` from `open_episode` and `messages`; the client retries nothing (a
RunEpisode start is not idempotent: the episode may already be running).

Only the generated contract and grpc are imported here, so the trainer plugin and the tools
can use it without the service's internals.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any, cast

import grpc

from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.v1 import agent_pb2_grpc
from swerl.chassis.timeconv import duration_pb
from swerl.exec.v1 import evaluate_pb2

Call = grpc.aio.StreamStreamCall[pb.RunEpisodeRequest, pb.RunEpisodeResponse]
Metadata = Sequence[tuple[str, str]]


def _duration(seconds: float) -> Any:
    """A limit in seconds; zero (or less) leaves it unset: the agent's default."""
    return duration_pb(seconds) if seconds > 0 else None


def episode_limits(
    *,
    max_turns: int = 0,
    max_context_tokens: int = 0,
    max_new_tokens: int = 0,
    wall_timeout_s: float = 0.0,
    command_timeout_s: float = 0.0,
    eval_timeout_s: float = 0.0,
) -> pb.EpisodeLimits:
    """EpisodeLimits; every zero means the agent config's default (the proto's own zero), so
    a caller states only the limits it sets and restates none of the agent's."""
    return pb.EpisodeLimits(
        max_turns=max_turns,
        max_context_tokens=max_context_tokens,
        max_new_tokens=max_new_tokens,
        wall_timeout=_duration(wall_timeout_s),
        command_timeout=_duration(command_timeout_s),
        eval_timeout=_duration(eval_timeout_s),
    )


def episode_start(
    *,
    episode_id: str,
    instance: evaluate_pb2.SweInstance,
    policy: pb.PolicyConfig,
    limits: pb.EpisodeLimits | None = None,
    options: pb.EpisodeOptions | None = None,
    prm: pb.PrmConfig | None = None,
    sampling_params: Mapping[str, Any] | None = None,
) -> pb.EpisodeStart:
    """The `start` message; `sampling_params` (JSON values) are merged into the policy's."""
    start = pb.EpisodeStart(
        episode_id=episode_id,
        instance=instance,
        policy=policy,
        limits=limits,
        options=options,
        prm=prm,
    )
    if sampling_params:
        start.policy.sampling_params.update(dict(sampling_params))
    return start


def expected_results(start: pb.EpisodeStart) -> int:
    """Results a stream ends with: one per branch with EpisodeOptions.branch, else one."""
    if start.options.HasField("branch") and start.options.branch.count > 0:
        return start.options.branch.count
    return 1


class EpisodeCall:
    """One running episode: its messages as they arrive, `cancel`, and what came back."""

    def __init__(self, call: Call, start: pb.EpisodeStart) -> None:
        self._call = call
        self.episode_id = start.episode_id
        self._expected = expected_results(start)
        self.started: pb.EpisodeStarted | None = None
        self.turns: list[pb.EpisodeTurn] = []
        # Every result in arrival order: one, or with branching one per branch (or the trunk's
        # one unbranched result when it ended before the fork).
        self.results: list[pb.EpisodeResult] = []
        # The last result: set once the stream is complete.
        self.result: pb.EpisodeResult | None = None

    async def messages(self) -> AsyncIterator[pb.RunEpisodeResponse]:
        """Every message as it arrives (recorded on the way), to the last result or to the
        end of the call. Raises AioRpcError when the call fails."""
        while self.result is None:
            read = await self._call.read()
            if read is grpc.aio.EOF:
                return
            # grpc's stubs type a stream read as `object`; the stub's response type arrives.
            message = cast(pb.RunEpisodeResponse, read)
            kind = message.WhichOneof("kind")
            if kind == "started":
                self.started = message.started
            elif kind == "turn":
                self.turns.append(message.turn)
            elif kind == "result":
                self.results.append(message.result)
                # A result without `branch` is the only one (no branching, or a trunk that
                # ended before the fork); otherwise the stream holds one per branch.
                if not message.result.HasField("branch") or len(self.results) >= self._expected:
                    self.result = message.result
            yield message

    async def wait(self) -> list[pb.EpisodeResult]:
        """Reads the stream to its end; the results (empty when the call ended without)."""
        async for _ in self.messages():
            pass
        return self.results

    async def cancel(self, reason: str) -> None:
        """Asks the agent to end the episode CANCELLED (its result still comes). A call that
        has already ended is left as it is."""
        request = pb.RunEpisodeRequest(cancel=pb.EpisodeCancel(reason=reason))
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await self._call.write(request)

    async def done_writing(self) -> None:
        """Half-closes the request side: nothing more to say (no cancel will follow)."""
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await self._call.done_writing()

    def abort(self) -> None:
        """Drops the call; the agent stops the episode and releases its sandbox."""
        self._call.cancel()

    async def __aenter__(self) -> EpisodeCall:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # A stream left before its last result (an error, a cancelled task): drop the call.
        if self.result is None:
            self.abort()
        else:
            await self.done_writing()


async def open_episode(
    stub: agent_pb2_grpc.AgentServiceStub,
    start: pb.EpisodeStart,
    *,
    timeout: float | None = None,
    metadata: Metadata | None = None,
) -> EpisodeCall:
    """Opens a RunEpisode stream and sends `start`. A call that has already ended is returned
    as it is: reading it raises its status."""
    call = stub.RunEpisode(timeout=timeout, metadata=metadata)
    episode = EpisodeCall(call, start)
    try:
        await call.write(pb.RunEpisodeRequest(start=start))
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        pass  # the call has already ended: reading it gives its status
    except BaseException:
        call.cancel()
        raise
    return episode


async def run_episode(
    stub: agent_pb2_grpc.AgentServiceStub,
    start: pb.EpisodeStart,
    *,
    timeout: float | None = None,
    metadata: Metadata | None = None,
) -> list[pb.EpisodeResult]:
    """Runs one episode to its end: its results (one, or one per branch). Raises AioRpcError
    when the call fails; a task cancelled here drops the call (stopping the episode)."""
    async with await open_episode(stub, start, timeout=timeout, metadata=metadata) as episode:
        return await episode.wait()
